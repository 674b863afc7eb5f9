"""The store: the one place Phalanx touches persistence.

`Store` is one class assembled from one module per topic; `store/surface.py` declares the same
methods as Protocols grouped by who calls them, and a test holds the two to the same set:

    schema       migrate, close                                   store/base.py
    leases       acquire_lease, renew_lease, ..., controllers     store/leases.py  (database clock)
    submission   submit, submit_each, resolve_refs, partitions     store/submission.py
    job control  cancel, signal, hold, release, requeue, ...       store/job_control.py
    scheduling   sched_snapshot, start_attempts(fence), ...        store/scheduling.py
    agents       record_heartbeats, node_work, apply_reports       store/exchange.py
    attempts     what a task's change does to its attempt and job  store/attempts.py
    nodes        register_node, drain, resume, mark_down(fence)    store/nodes.py
    history      get_job, list_jobs, events, purge_finished, ...   store/history.py
    steps        create_step, apply_step_reports, ...              store/steps.py
    maintenance  add_window, start_window, end_window, ...         store/maintenance.py
    reservations create_reservation, update_reservation, ...      store/reservations.py
    preemption   preempt, preemption_rows                          store/preemption.py
    fair share   charge_usage, usage_table, ...                    store/fairshare.py
    accounts     import_accounts, change_accounts, accounts_tree    store/accounts.py
    metrics      metrics_figures, carry_purged                     store/metrics.py
    configs      config_current, config_put, controller_presence   store/configs.py
    rendezvous   rdzv_get, rdzv_cas, rdzv_set, rdzv_add, ...        store/rendezvous.py

Every method is one transaction; every state change appends `events` in it. Outcomes are kept
apart: a database that cannot be reached raises `StoreUnavailable`; a lost race (a lease
someone else holds, a job that changed state under us) returns False/None or skips. Writes
made on behalf of a single-owner duty take a `Fence` and check it inside the transaction, so a
paused old leader can never write after its lease was taken over.
"""

from __future__ import annotations

from phalanx.store.accounts import AccountRecords
from phalanx.store.configs import ConfigRecords
from phalanx.store.exchange import AgentReports, TaskReport
from phalanx.store.history import History
from phalanx.store.job_control import JobCommands
from phalanx.store.leases import LeaseRecords
from phalanx.store.nodes import NodeRecords
from phalanx.store.preemption import Preemptions
from phalanx.store.rendezvous import RendezvousRecords
from phalanx.store.scheduling import SchedSnapshot, SchedulingReads
from phalanx.store.sqlbits import Fence

# the types Store's methods take and return, importable with it
__all__ = ["Fence", "SchedSnapshot", "Store", "TaskReport"]


class Store(
    LeaseRecords,
    JobCommands,
    SchedulingReads,
    AgentReports,
    NodeRecords,
    History,
    Preemptions,
    AccountRecords,
    ConfigRecords,
    RendezvousRecords,
):
    """The store's one interface (see the module docstring)."""
