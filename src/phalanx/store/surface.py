"""The store's public surface, grouped by who uses it (as Patroni's AbstractDCS groups its
methods): leases, submission, job control, scheduling, the agents' hot path, nodes and the
failure detector, history, steps, maintenance windows, fair share, lifecycle.

`Store` is the one implementation (store.py and its mixins); these Protocols say what each
part of the controller may ask of it, so a reader finds a method's neighbours here and a
duty can be typed against the part it needs (`controller/leases.py` takes a `LeaseStore`).
`tests/unit/test_store_surface.py` holds the Protocols and `Store`'s public methods to the
same set, and mypy checks that `Store` satisfies each (`_store_satisfies_every_part`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.domain import checkpointing  # default values of two reads

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from phalanx.domain import accounts as acct
    from phalanx.domain import reservations as rules
    from phalanx.domain.spec import PartitionInfo, ResolvedJob
    from phalanx.domain.states import JobState
    from phalanx.domain.steps import StepRequest
    from phalanx.store.metrics import StoreFigures
    from phalanx.store.rendezvous import RdzvRead
    from phalanx.store.sqlbits import Fence
    from phalanx.store.steps import StepReport
    from phalanx.store.store import SchedSnapshot, Store, TaskReport


class LeaseStore(Protocol):
    """Leases and controllers: the duty leases every fenced write is checked against (acquire, renew, release) and the controllers' presence rows."""

    def acquire_lease(
        self, name: str, holder: str, ttl: float, *, after_expiry: float = 0.0
    ) -> int | None: ...

    def renew_lease(self, name: str, holder: str, term: int, ttl: float) -> bool: ...

    def release_lease(self, name: str, holder: str, term: int) -> bool: ...

    def get_lease(self, name: str) -> dict[str, Any] | None: ...

    def list_leases(self) -> list[dict[str, Any]]: ...

    def register_controller(
        self, cid: str, url: str | None, local_settings: dict[str, Any] | None = None
    ) -> None: ...

    def controllers_seen(self, within: float) -> list[dict[str, Any]]: ...

    def touch_controller(self, cid: str) -> None: ...

    def list_controllers(self) -> list[dict[str, Any]]: ...

    def live_controllers(self, within: float) -> list[str]: ...


class SubmissionStore(Protocol):
    """Submission: jobs into the queue, job references resolved, the partitions the config declares."""

    def submit(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any]]], user: str
    ) -> list[list[int]]: ...

    def submit_each(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any], str]]
    ) -> list[list[int]]: ...

    def resolve_refs(self, refs: Sequence[str]) -> list[int]: ...

    def sync_partitions(self, parts: Sequence[dict[str, Any]]) -> None: ...

    def partitions(self) -> dict[str, dict[str, Any]]: ...

    def partition_infos(self) -> dict[str, PartitionInfo]: ...


class JobControl(Protocol):
    """Acting on jobs users and operators name (scancel, scontrol hold/release/requeue/update)."""

    def cancel(
        self, job_ids: Sequence[int], actor: str, reason: str = "cancelled"
    ) -> dict[int, str]: ...

    def signal(
        self, job_ids: Sequence[int], signum: int, target: str, actor: str
    ) -> dict[int, str]: ...

    def hold(
        self, job_ids: Sequence[int], actor: str, *, admin: bool = False
    ) -> dict[int, str]: ...

    def release(
        self, job_ids: Sequence[int], actor: str, *, admin: bool = False
    ) -> dict[int, str]: ...

    def requeue(
        self, job_ids: Sequence[int], actor: str, *, hold: bool = False, admin: bool = False
    ) -> dict[int, str]: ...

    def update_pending(
        self, job_ids: Sequence[int], changes: dict[str, Any], actor: str, *, may_raise: bool
    ) -> dict[int, str]: ...

    def end_pending(
        self, job_id: int, state: JobState, reason: str, fence: Fence | None
    ) -> bool: ...


class SchedulingStore(Protocol):
    """The scheduling loop's reads and its fenced writes: the snapshot it plans from, the attempts it starts, the reasons pending jobs wait, preemption."""

    def sched_snapshot(self, eligible_by: float | None = None) -> SchedSnapshot: ...

    def start_attempts(
        self,
        starts: Sequence[dict[str, Any]],
        fence: Fence | None,
        *,
        license_totals: Mapping[str, int] | None = None,
    ) -> list[int]: ...

    def set_pending_reasons(self, reasons: Mapping[int, str | None]) -> None: ...

    def preempt(
        self,
        job_id: int,
        victims: Sequence[tuple[int, str]],
        nodes: Sequence[str],
        until: float,
        fence: Fence | None,
        *,
        why: str,
    ) -> list[int]: ...

    def preemption_rows(self) -> list[dict[str, Any]]: ...

    def licenses_in_use(self) -> dict[str, int]: ...

    def node_gens(self) -> dict[str, int]: ...

    def node_gens_total(self) -> int: ...

    def notify_schedulers(self) -> bool: ...

    def queue_entries(self, job_ids: Sequence[int]) -> dict[int, float]: ...


class AgentExchange(Protocol):
    """The agents' hot path: registration, heartbeats, what a node runs and what its agent reports."""

    def register_node(
        self,
        name: str,
        *,
        cpus: int,
        mem_mb: int,
        gpus: list[list[Any]],
        features: list[str],
        addr: str | None,
        boot_id: str | None,
        version: str | None,
        health: dict[str, Any] | None = None,
        topology: dict[str, str] | None = None,
        steps_at: str | None = None,
    ) -> dict[str, Any]: ...

    def record_config_versions(self, versions: Mapping[str, int]) -> None: ...

    def record_heartbeats(
        self,
        ages: dict[str, float],
        *,
        controller: str | None = None,
        flushed_age: float | None = None,
        retire: bool = False,
    ) -> list[str]: ...

    def node_work(self, node: str, conn: Connection | None = None) -> list[dict[str, Any]]: ...

    def node_all_work(
        self, node: str, needs_steps: Callable[[list[dict[str, Any]]], bool]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]: ...

    def node_step_work(self, node: str, conn: Connection | None = None) -> list[dict[str, Any]]: ...

    def step_addresses(self, names: list[str]) -> dict[str, str]: ...

    def apply_reports(
        self, node: str, reports: Sequence[TaskReport], taken_at: float | None
    ) -> list[dict[str, Any]]: ...

    def apply_step_reports(self, node: str, reports: Sequence[StepReport]) -> bool: ...

    def finished_steps(self, keys: Sequence[tuple[int, int, str]]) -> set[tuple[int, int]]: ...

    def apply_health(self, node: str, summary: dict[str, Any]) -> str | None: ...

    def record_gpu_events(self, node: str, items: Sequence[dict[str, Any]]) -> int: ...


class NodeStore(Protocol):
    """Nodes and the failure detector's fenced writes: drain, resume, DOWN (with its tasks failed in the same write), lost launches."""

    def get_node(self, name: str) -> dict[str, Any]: ...

    def list_nodes(self) -> list[dict[str, Any]]: ...

    def node_count(self) -> int: ...

    def drain(self, name: str, reason: str, actor: str, *, now: bool = False) -> list[int]: ...

    def resume(self, name: str, actor: str) -> None: ...

    def mark_down(
        self,
        name: str,
        reason: str,
        fence: Fence | None,
        *,
        silent_for: float | None = None,
        heard_window: float | None = None,
    ) -> bool: ...

    def fail_node_tasks(self, node: str, reason: str, fence: Fence | None) -> list[int]: ...

    def down_nodes_with_tasks(self) -> list[str]: ...

    def heard_horizon(self, window: float) -> tuple[float, float]: ...

    def silent_node_rows(self, heard_before: float) -> list[dict[str, Any]]: ...

    def stale_starting_attempts(self, older_than: float) -> list[dict[str, Any]]: ...

    def requeue_lost_launch(self, attempt_id: int, reason: str, fence: Fence | None) -> bool: ...


class HistoryStore(Protocol):
    """Reads of jobs, attempts and events, accounting and retention, the database clock."""

    def usage_rows(
        self, start: float, end: float
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[tuple[float, bool]]]]: ...

    def get_job(self, job_id: int) -> dict[str, Any]: ...

    def list_jobs(
        self,
        *,
        states: Sequence[str] | None = None,
        user: str | None = None,
        partition: str | None = None,
        name: str | None = None,
        ids: Sequence[int] | None = None,
        node: str | None = None,
        limit: int = 10_000,
        active_after: float | None = None,
        submitted_before: float | None = None,
        with_spec: bool = False,
    ) -> list[dict[str, Any]]: ...

    def attempts_of(self, job_id: int) -> list[dict[str, Any]]: ...

    def attempts_by_id(self, attempt_ids: Sequence[int]) -> dict[int, dict[str, Any]]: ...

    def events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        since_id: int = 0,
        limit: int = 1000,
        newest: bool = False,
    ) -> list[dict[str, Any]]: ...

    def node_events_between(
        self, nodes: Sequence[str], since: float, until: float, limit: int = 200
    ) -> list[dict[str, Any]]: ...

    def add_event(self, kind: str, message: str, **kw: Any) -> None: ...

    def record_event(self, kind: str, message: str, *, actor: str | None = None) -> None: ...

    def failure_history(
        self, now: float, window_s: float = checkpointing.FAILURE_WINDOW_S
    ) -> tuple[float, int]: ...

    def checkpoint_cost(
        self, job_id: int, samples: int = checkpointing.COST_SAMPLES
    ) -> float | None: ...

    def cluster_counts(self) -> dict[str, Any]: ...

    def ended_since(self, since: float) -> dict[str, int]: ...

    def metrics_figures(
        self,
        *,
        checkpoint_bounds: Sequence[float],
    ) -> StoreFigures: ...

    def purge_finished(self, older_than: float, batch: int = 500) -> int: ...

    def carry_purged(self, conn: Connection, job_ids: Sequence[int]) -> None: ...

    def db_time(self) -> float: ...


class StepStore(Protocol):
    """Job steps (srun inside a job)."""

    def create_step(
        self,
        job_id: int,
        req: StepRequest,
        spec: dict[str, Any],
        name: str,
        actor: str,
        *,
        launch_rows: bool = False,
    ) -> dict[str, Any]: ...

    def get_step(self, job_id: int, step_id: int) -> dict[str, Any]: ...

    def step_io(self, job_id: int, step_id: int) -> dict[str, Any]: ...

    def steps_of(self, job_id: int) -> list[dict[str, Any]]: ...

    def steps_of_jobs(self, job_ids: Sequence[int]) -> dict[int, list[dict[str, Any]]]: ...

    def signal_steps(
        self, job_id: int, signum: int, step_id: int | None, actor: str
    ) -> list[int]: ...

    def cancel_steps(
        self, job_id: int, step_id: int | None, reason: str, actor: str
    ) -> list[int]: ...


class RendezvousStore(Protocol):
    """The torchrun rendezvous the controllers host (store/rendezvous.py)."""

    def rdzv_get(
        self, job_id: int, run_id: str, keys: Sequence[str], *, departed: bool = False
    ) -> RdzvRead: ...

    def rdzv_cas(
        self,
        job_id: int,
        run_id: str,
        key: str,
        value: bytes,
        expect: int | None,
        *,
        member: tuple[str, str] | None = None,
    ) -> tuple[bytes, int, bool, list[str]]: ...

    def rdzv_set(self, job_id: int, run_id: str, items: Mapping[str, bytes]) -> None: ...

    def rdzv_add(self, job_id: int, run_id: str, key: str, delta: int) -> int: ...

    def rdzv_delete(self, job_id: int, run_id: str, key: str) -> bool: ...

    def rdzv_count(self, job_id: int, run_id: str, prefix: str) -> int: ...


class MaintenanceStore(Protocol):
    """Maintenance windows and the planned stops they cause."""

    def add_window(
        self,
        nodes_expr: str,
        start: float,
        end: float,
        reason: str | None,
        actor: str,
    ) -> dict[str, Any]: ...

    def get_window(self, wid: int) -> dict[str, Any]: ...

    def list_windows(
        self, *, include_past: bool = False, limit: int = 1000
    ) -> list[dict[str, Any]]: ...

    def remove_window(self, wid: int, actor: str) -> dict[str, Any]: ...

    def start_window(self, wid: int, fence: Fence | None) -> tuple[list[str], list[str]] | None: ...

    def end_window(self, wid: int, fence: Fence | None) -> list[str] | None: ...

    def stop_for_maintenance(
        self, stops: Sequence[tuple[int, int, str]], fence: Fence | None
    ) -> list[int]: ...

    def checkpoint_graces(self, job_ids: Sequence[int]) -> dict[int, float]: ...

    def attempts_on(self, nodes: Sequence[str]) -> list[dict[str, Any]]: ...


class ReservationStore(Protocol):
    """Reservations (`scontrol create|update|delete|show reservation`)."""

    def create_reservation(
        self,
        name: str,
        *,
        start: float,
        end: float,
        nodes_expr: str | None,
        node_count: int | None,
        users: Sequence[str],
        accounts: Sequence[str],
        flags: Sequence[str],
        partition: str | None,
        actor: str,
    ) -> dict[str, Any]: ...

    def update_reservation(
        self, name: str, changes: dict[str, Any], actor: str
    ) -> dict[str, Any]: ...

    def delete_reservation(self, name: str, actor: str) -> dict[str, Any]: ...

    def list_reservations(self) -> list[dict[str, Any]]: ...

    def get_reservation(self, name: str) -> dict[str, Any]: ...

    def watched_reservations(self) -> list[dict[str, Any]]: ...

    def attempts_in_reservations(self, names: Sequence[str]) -> list[dict[str, Any]]: ...

    def reservation_end(self, name: str) -> float | None: ...

    def move_reservation(
        self,
        rid: int,
        old: rules.Phase,
        new: rules.Phase,
        fence: Fence | None,
        *,
        message: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> bool: ...

    def stop_at_reservation_end(
        self, stops: Sequence[tuple[int, str, str]], fence: Fence | None
    ) -> list[int]: ...


class FairShareStore(Protocol):
    """Fair-share usage: what associations used, charged and decayed."""

    def charge_usage(
        self,
        now: float,
        *,
        half_life: float,
        cpu_weight: float,
        gpu_weight: float,
        default_account: str,
        fence: Fence | None,
    ) -> int: ...

    def usage_table(self, now: float, half_life: float) -> dict[tuple[str, str], float]: ...

    def job_users(self) -> set[tuple[str | None, str]]: ...

    def submitted_counts(self, users: Sequence[str] | None = None) -> list[dict[str, Any]]: ...


class AccountStore(Protocol):
    """Accounts, user associations and QOS (`sacctmgr`; store/accounts.py)."""

    def accounts_version(self) -> int | None: ...

    def accounts_tree(self) -> tuple[acct.Tree, dict[str, Any]] | None: ...

    def import_accounts(
        self, tree: acct.Tree, actor: str, *, replace: bool = False, source: str = "the file"
    ) -> bool: ...

    def change_accounts(
        self,
        what: str,
        kind: str,
        *,
        names: Sequence[str] = (),
        where: Mapping[str, Sequence[str]] | None = None,
        settings: Mapping[str, Any] | None = None,
        accounts: Sequence[str] = (),
        keep: Mapping[str, str] | None = None,
        actor: str,
        dry_run: bool = False,
    ) -> dict[str, Any]: ...


class StoreLifecycle(Protocol):
    """Opening the schema and closing the connections."""

    def migrate(self) -> None: ...

    def close(self) -> None: ...


class ConfigStore(Protocol):
    """The cluster configuration's versions (store/configs.py): the one in force, history,
    the next one written with its partitions, and each controller's report of the one it runs."""

    def config_current(self) -> dict[str, Any] | None: ...

    def config_get(self, version: int) -> dict[str, Any] | None: ...

    def config_history(self, limit: int = 100) -> list[dict[str, Any]]: ...

    def config_first(
        self, document: dict[str, Any], *, actor: str, partitions: Sequence[dict[str, Any]]
    ) -> dict[str, Any]: ...

    def config_put(
        self,
        document: dict[str, Any],
        *,
        actor: str,
        action: str,
        base_version: int | None,
        partitions: Sequence[dict[str, Any]],
        message: str,
        comment: str | None = None,
        source: int | None = None,
    ) -> int: ...

    def controller_presence(
        self, cid: str, *, config_version: int | None, problem: str | None, seen: bool = True
    ) -> int | None: ...

    def config_live_facts(self) -> dict[str, Any]: ...


PARTS: tuple[type, ...] = (
    LeaseStore,
    SubmissionStore,
    JobControl,
    SchedulingStore,
    AgentExchange,
    NodeStore,
    HistoryStore,
    StepStore,
    RendezvousStore,
    MaintenanceStore,
    ReservationStore,
    FairShareStore,
    AccountStore,
    StoreLifecycle,
    ConfigStore,
)


def _store_satisfies_every_part(store: Store) -> list[object]:
    """Never called: mypy checks each assignment (a signature drifting from its Protocol
    fails `make lint`)."""
    parts: list[object] = []
    lease: LeaseStore = store
    submission: SubmissionStore = store
    control: JobControl = store
    scheduling: SchedulingStore = store
    agents: AgentExchange = store
    nodes: NodeStore = store
    history: HistoryStore = store
    steps: StepStore = store
    maintenance: MaintenanceStore = store
    reservations: ReservationStore = store
    fairshare: FairShareStore = store
    accounts: AccountStore = store
    lifecycle: StoreLifecycle = store
    configs: ConfigStore = store
    rendezvous: RendezvousStore = store
    parts += [lease, submission, control, scheduling, agents, nodes, history]
    parts += [steps, maintenance, reservations, fairshare, accounts, lifecycle]
    parts += [configs, rendezvous]
    return parts
