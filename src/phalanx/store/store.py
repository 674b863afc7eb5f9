"""The store: the one place Phalanx touches persistence.

Interface at a glance (every method is one transaction; every state change appends `events`):

    schema      migrate()
    leases      acquire_lease, renew_lease, release_lease, get_lease        (database clock)
    jobs        submit, get_job, list_jobs, resolve_refs, attempts_of, cancel, hold, release
    scheduler   sched_snapshot, start_attempts(fence), end_pending(fence)
    agents      register_node, record_heartbeats, node_work, apply_reports, node_gens
    nodes       list_nodes, drain, resume
    maintenance add_window, list_windows, start_window, end_window, ... (store/windows.py)
    events      events, add_event
    cluster     register_controller, cluster_counts

Outcomes are kept apart: a database that cannot be reached raises `StoreUnavailable`; a lost race
(a lease someone else holds, a job that changed state under us) returns False/None or skips.
Writes made on behalf of a single-owner duty take a `Fence` and check it inside the transaction,
so a paused old leader can never write after its lease was taken over.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from sqlalchemy import (
    Connection,
    Table,
    and_,
    bindparam,
    column,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    true,
    update,
)

from phalanx.domain import checkpointing, efficiency, job_reports, licenses
from phalanx.domain.elastic import restart_layout
from phalanx.domain.outcome import (
    BATCH_ENDED,
    advance,
    task_end,
)
from phalanx.domain.placement import NodeUsage
from phalanx.domain.policy import (
    Action,
    FailureKind,
    RetryRules,
    after_attempt,
    is_user_requeue,
    user_requeue_reason,
)
from phalanx.domain.scheduling import BEGIN
from phalanx.domain.spec import PartitionInfo, ResolvedJob
from phalanx.domain.states import (
    TERMINAL,
    AttemptState,
    JobState,
    TaskState,
)
from phalanx.errors import InvalidSpec, InvalidTransition, NotFound
from phalanx.store import schema as s
from phalanx.store.arrayinsert import insert_array_tasks
from phalanx.store.base import _EVENT_ROW
from phalanx.store.metrics import MetricsQueries
from phalanx.store.pending import Pending, PendingMirror
from phalanx.store.prebuilt import Prebuilt, only, select_where, update_where
from phalanx.store.preemption import Preemptions
from phalanx.store.rowinsert import RowInsert
from phalanx.store.sqlbits import JOB_SUMMARY as _JOB_SUMMARY
from phalanx.store.sqlbits import NODE_WORK_COLUMNS, Fence, attempt_holds
from phalanx.store.sqlbits import active_tasks as _active_tasks
from phalanx.store.sqlbits import chunks as _chunks
from phalanx.store.sqlbits import now as _now
from phalanx.store.steps import JobSteps
from phalanx.store.usage import FairShareUsage
from phalanx.store.windows import MaintenanceWindows

ACTIVE_ATTEMPT = (AttemptState.STARTING, AttemptState.RUNNING, AttemptState.STOPPING)

# Submission's statements, built once: SQLAlchemy caches a statement's compiled form, but
# building one (and its cache key) costs a submission more than the SQLite insert itself.
_JOB_ROW = RowInsert(s.jobs)
_INSERT_JOBS_IDS = insert(s.jobs).returning(s.jobs.c.id, sort_by_parameter_order=True)
# the report path's statements, built once (store/prebuilt.py says why)
_JOB_SUMMARY_BY_ID = Prebuilt(select(*_JOB_SUMMARY).where(s.jobs.c.id == bindparam("id")))
# What `apply_reports` compares a heartbeat's reports with: only the columns it reads. Every
# held task of the node is read on every heartbeat, and whole rows decoded their JSON columns
# (gpu_ids, detail, usage) each time, which cost more than the rest of an "exited" report.
_REPORTED_TASKS = Prebuilt(
    _active_tasks(
        s.tasks.c.attempt_id,
        s.tasks.c.rank,
        s.tasks.c.state,
        s.tasks.c.started_at,
        s.attempts.c.token,
        s.attempts.c.state.label("attempt_state"),
    ).where(s.tasks.c.node == bindparam("node"), s.tasks.c.spare.is_(False))
)
# Store.node_work's query, built once with the node as a parameter: every heartbeat runs it,
# and building a statement of this size (and its cache key) costs about as much as running it
# on SQLite.
_NODE_WORK = Prebuilt(
    _active_tasks(
        s.tasks.c.attempt_id,
        s.tasks.c.state.label("task_state"),
        *NODE_WORK_COLUMNS,
        s.jobs.c.checkpoint.label("job_checkpoint"),
        s.attempts.c.progress.label("attempt_progress"),
        s.attempts.c.signals.label("attempt_signals"),
    )
    .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
    .where(
        s.tasks.c.node == bindparam("node"),
        s.tasks.c.spare.is_(False),  # a hot spare runs nothing: the agent never sees it
    )
)
_CLEAR_LAUNCH_FAILURES = Prebuilt(
    update(s.nodes)
    .where(s.nodes.c.name == bindparam("node"), s.nodes.c.launch_failures > 0)
    .values(launch_failures=0)
)


def _by_job(table: Table) -> Any:
    """Rows of a table with a `job_id` column that belong to these jobs."""
    return lambda ids: table.c.job_id.in_(ids)


# What `purge_finished` deletes with a job, children before parents: (table, rows of these
# job ids). A new table of per-job rows (job steps: `(s.steps, _by_job(s.steps))`, before
# `attempts` if it refers to them) is one more line here.
JOB_ROWS: tuple[tuple[Table, Any], ...] = (
    (
        s.step_nodes,
        lambda ids: s.step_nodes.c.attempt_id.in_(
            select(s.attempts.c.id).where(s.attempts.c.job_id.in_(ids))
        ),
    ),
    (s.steps, _by_job(s.steps)),
    (
        s.tasks,
        lambda ids: s.tasks.c.attempt_id.in_(
            select(s.attempts.c.id).where(s.attempts.c.job_id.in_(ids))
        ),
    ),
    (s.attempts, _by_job(s.attempts)),
    (s.events, _by_job(s.events)),
)


@dataclass
class TaskReport:
    """What an agent says about one task (one attempt on its node)."""

    attempt_id: int
    token: str
    state: str  # "starting" | "running" | "exited" | "lost"
    started_at: float | None = None
    exit: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None  # the job's latest checkpoint marker on this node
    progress: dict[str, Any] | None = None  # the job's latest progress report on this node
    # the highest signal seq (scancel --signal) the agent delivered to this attempt; None from
    # agents that do not know signals
    signals_done: int | None = None


@dataclass
class SchedSnapshot:
    nodes: list[dict[str, Any]]
    partitions: dict[str, dict[str, Any]]
    allocations: list[dict[str, Any]]
    pending: list[dict[str, Any]]
    dep_states: dict[int, JobState]
    dep_started: dict[int, bool]
    active_names: set[tuple[str, str]]
    array_active: dict[int, int]
    singleton_first: dict[tuple[str, str], int] = field(default_factory=dict)
    # pending jobs holding a restart reservation: id, reserved_nodes, reserved_until
    reservations: list[dict[str, Any]] = field(default_factory=list)
    # maintenance windows still to come or under way (rows of `maintenance`)
    maintenance: list[dict[str, Any]] = field(default_factory=list)
    # pending jobs before their begin time whose reason does not say so yet (sched_snapshot)
    not_yet: list[dict[str, Any]] = field(default_factory=list)
    # jobs holding resources (for limits): user, account, qos, nodes, gpus_per_node
    active_jobs: list[dict[str, Any]] = field(default_factory=list)
    # the --licenses text of every attempt that holds its resources (not ENDED)
    licenses_held: list[str] = field(default_factory=list)
    # job id -> --group of every job with an attempt that holds its nodes (anti-affinity)
    groups_active: dict[int, str] = field(default_factory=dict)
    # True: no pending job at all for this pass (nothing else was read; see sched_snapshot)
    quiet: bool = False


MAX_ID = 2**63 - 1  # the largest id an INTEGER column holds (SQLite and PostgreSQL)


class Store(JobSteps, MaintenanceWindows, MetricsQueries, FairShareUsage, Preemptions):
    """The store's one interface (see the module docstring)."""

    # ------------------------------------------------------------------ leases
    def acquire_lease(
        self, name: str, holder: str, ttl: float, *, after_expiry: float = 0.0
    ) -> int | None:
        """Take or keep the lease; return its term, or None if someone else holds it.

        `after_expiry`: take an expired lease only once it has been expired this long (lets
        the preferred holder go first without any coordination)."""
        now = self.db.db_now_sql()
        with self.db.begin(urgent=True) as conn:
            # a lease that never existed counts as expired just now, so that its preferred
            # holder gets the first chance at it
            if self.dialect == "postgresql":
                conn.execute(
                    text(
                        "INSERT INTO leases (name, holder, term, expires_at) "
                        f"VALUES (:n, NULL, 0, {now.text}) ON CONFLICT (name) DO NOTHING"
                    ),
                    {"n": name},
                )
            else:
                conn.execute(
                    text(
                        "INSERT OR IGNORE INTO leases (name, holder, term, expires_at) "
                        f"VALUES (:n, NULL, 0, {now.text})"
                    ),
                    {"n": name},
                )
            res = conn.execute(
                text(
                    f"UPDATE leases SET "
                    f"term = CASE WHEN holder = :me THEN term ELSE term + 1 END, "
                    f"holder = :me, expires_at = {now.text} + :ttl "
                    f"WHERE name = :n AND (holder = :me OR expires_at <= {now.text} - :slack)"
                ),
                {"n": name, "me": holder, "ttl": ttl, "slack": after_expiry},
            )
            if res.rowcount != 1:
                return None
            row = conn.execute(select(s.leases.c.term).where(s.leases.c.name == name)).one()
            return int(row.term)

    def renew_lease(self, name: str, holder: str, term: int, ttl: float) -> bool:
        now = self.db.db_now_sql()
        with self.db.begin(urgent=True) as conn:
            res = conn.execute(
                text(
                    f"UPDATE leases SET expires_at = {now.text} + :ttl "
                    "WHERE name = :n AND holder = :me AND term = :term"
                ),
                {"n": name, "me": holder, "term": term, "ttl": ttl},
            )
            return res.rowcount == 1

    def release_lease(self, name: str, holder: str, term: int) -> bool:
        with self.db.begin(urgent=True) as conn:
            res = conn.execute(
                update(s.leases)
                .where(
                    s.leases.c.name == name, s.leases.c.holder == holder, s.leases.c.term == term
                )
                .values(expires_at=0.0)
            )
            return res.rowcount == 1

    def get_lease(self, name: str) -> dict[str, Any] | None:
        with self.db.begin(write=False) as conn:
            row = conn.execute(select(s.leases).where(s.leases.c.name == name)).mappings().first()
            return dict(row) if row else None

    def list_leases(self) -> list[dict[str, Any]]:
        now = self.db.db_now_sql()
        with self.db.begin(write=False) as conn:
            db_now = conn.execute(select(now)).scalar_one()
            rows = conn.execute(select(s.leases).order_by(s.leases.c.name)).mappings().all()
            return [{**dict(r), "valid": r["expires_at"] > db_now} for r in rows]

    # ------------------------------------------------------------------ partitions & controllers
    def sync_partitions(self, parts: Sequence[dict[str, Any]]) -> None:
        """Make the partitions table match the controller's configuration."""
        with self.db.begin() as conn:
            existing = {r.name for r in conn.execute(select(s.partitions.c.name))}
            for p in parts:
                if p["name"] in existing:
                    conn.execute(
                        update(s.partitions).where(s.partitions.c.name == p["name"]).values(**p)
                    )
                else:
                    conn.execute(insert(s.partitions).values(**p))
            gone = existing - {p["name"] for p in parts}
            if gone:
                conn.execute(s.partitions.delete().where(s.partitions.c.name.in_(sorted(gone))))

    def partitions(self) -> dict[str, dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            return {r["name"]: dict(r) for r in conn.execute(select(s.partitions)).mappings()}

    def partition_infos(self) -> dict[str, PartitionInfo]:
        return {
            n: PartitionInfo(
                name=n,
                default=bool(p["is_default"]),
                default_time_s=p["default_time_s"],
                max_time_s=p["max_time_s"],
            )
            for n, p in self.partitions().items()
        }

    def register_controller(self, cid: str, url: str | None) -> None:
        now = _now()
        with self.db.begin() as conn:
            res = conn.execute(
                update(s.controllers)
                .where(s.controllers.c.id == cid)
                .values(url=url, started_at=now, last_seen=now)
            )
            if res.rowcount == 0:
                conn.execute(
                    insert(s.controllers).values(id=cid, url=url, started_at=now, last_seen=now)
                )
            self._event(conn, "controller.start", f"controller {cid} started at {url}")

    def touch_controller(self, cid: str) -> None:
        """Stamp a controller's last_seen with the database's clock (peers compare it).
        Urgent, like the lease writes: peers spread leases over the controllers seen lately."""
        with self.db.begin(urgent=True) as conn:
            now = conn.execute(select(self.db.db_now_sql())).scalar_one()
            conn.execute(
                update(s.controllers).where(s.controllers.c.id == cid).values(last_seen=now)
            )

    def live_controllers(self, within: float) -> list[str]:
        with self.db.begin(write=False) as conn:
            now = float(conn.execute(select(self.db.db_now_sql())).scalar_one())
            return [
                r.id
                for r in conn.execute(
                    select(s.controllers.c.id).where(s.controllers.c.last_seen >= now - within)
                )
            ]

    def list_controllers(self) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            return [
                dict(r)
                for r in conn.execute(select(s.controllers).order_by(s.controllers.c.id)).mappings()
            ]

    # ------------------------------------------------------------------ jobs
    def submit(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any]]], user: str
    ) -> list[list[int]]:
        """Insert jobs (arrays expand to one row per task); return the ids per item.

        One transaction for the whole request. Plain jobs are inserted with one multi-row
        statement and their events with another, so a batch of thousands costs a few
        statements, not thousands.
        """
        return self.submit_each([(resolved, spec, user) for resolved, spec in items])

    def submit_each(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any], str]]
    ) -> list[list[int]]:
        """`submit` where each item names its own submitter: several users' requests
        committed in one transaction (the API's group commit, controller/submitq.py)."""
        now = _now()
        if self.dialect == "sqlite" and all(
            r.array_indices is None and not r.dependency for r, _, _ in items
        ):
            return self._submit_plain_sqlite(items, now)
        out: list[list[int]] = [[] for _ in items]
        with self.db.begin() as conn:
            plain: list[tuple[int, dict[str, Any]]] = []  # consecutive plain jobs, not yet inserted
            events: list[dict[str, Any]] = []

            def flush() -> None:
                if not plain:
                    return
                if len(plain) == 1:  # `sbatch`: one row, straight to the driver (rowinsert.py)
                    idx, row = plain[0]
                    jid = _JOB_ROW(conn, row)
                    out[idx] = [jid]
                    events.append(_submit_event(jid, row, row["user"], now))
                    plain.clear()
                    return
                res = conn.execute(_INSERT_JOBS_IDS, [row for _, row in plain])
                for (idx, row), r in zip(plain, res, strict=True):
                    out[idx] = [int(r[0])]
                    events.append(_submit_event(int(r[0]), row, row["user"], now))
                plain.clear()

            for idx, (resolved, spec, user) in enumerate(items):
                base = self._job_row(conn, resolved, spec, user, now)
                if resolved.array_indices is None:
                    plain.append((idx, base))
                    continue
                flush()  # ids follow the order of the request
                first, *rest = resolved.array_indices
                jid = conn.execute(
                    insert(s.jobs).values({**base, "array_task_id": first}).returning(s.jobs.c.id)
                ).scalar_one()
                conn.execute(update(s.jobs).where(s.jobs.c.id == jid).values(array_job_id=jid))
                ids = [int(jid)]
                if rest:
                    ids.extend(insert_array_tasks(conn, {**base, "array_job_id": jid}, rest))
                out[idx] = ids
                events.extend(_submit_event(i, base, user, now) for i in ids)
            flush()
            self._events_many(conn, events)
        return out

    def _submit_plain_sqlite(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any], str]], now: float
    ) -> list[list[int]]:
        """`submit_each` of plain jobs without dependencies (every `sbatch` of a script) on
        SQLite: each job row and its event straight to the driver, in one transaction of the
        driver's own (Engines.driver_write), the rows exactly as the general path writes them
        (the same RowInsert plans and bind processors)."""
        dialect = self.db.write.dialect
        out: list[list[int]] = []
        with self.db.driver_write() as driver:
            for resolved, spec, user in items:
                row = self._job_values(resolved, spec, user, now, [])
                jid = _JOB_ROW.on_driver(driver, dialect, row)
                event = self._event_values(_submit_event(jid, row, user, now))
                _EVENT_ROW.on_driver(driver, dialect, event)
                out.append([jid])
        return out

    def _job_row(
        self, conn: Connection, resolved: ResolvedJob, spec: dict[str, Any], user: str, now: float
    ) -> dict[str, Any]:
        deps = self._resolve_dependencies(conn, resolved.dependency)
        return self._job_values(resolved, spec, user, now, deps)

    def _job_values(
        self,
        resolved: ResolvedJob,
        spec: dict[str, Any],
        user: str,
        now: float,
        dependency: list[dict[str, Any]],
    ) -> dict[str, Any]:
        state = JobState.HELD if resolved.hold else JobState.PENDING
        held = {"held_by": user, "hold_kind": HOLD_USER} if resolved.hold else {}
        return {
            **held,  # sbatch -H: a user hold (only then: an ordinary row keeps its columns)
            "name": resolved.name,
            "user": user,
            "partitions": ",".join(resolved.partitions),
            "partition": resolved.partitions[0],
            "state": state.value,
            "reason": "held by user" if resolved.hold else None,
            "priority": resolved.priority,
            "submit_time": now,
            "time_limit_s": resolved.time_limit_s,
            "nodes": resolved.nodes,
            "cpus_per_node": resolved.cpus_per_node,
            "mem_per_node_mb": resolved.mem_per_node_mb,
            "gpus_per_node": resolved.gpus_per_node,
            "gpu_type": resolved.gpu_type,
            "exclusive": resolved.exclusive,
            "constraint_expr": resolved.constraint,
            "nodelist": resolved.nodelist,
            "exclude": resolved.exclude,
            "dependency": dependency,
            "requeue": resolved.requeue,
            "spec": {
                **spec,
                "signal_parsed": resolved.signal,
                "checkpoint_parsed": resolved.checkpoint,
                "workdir": resolved.workdir,
            },
            "restart_count": 0,
            "array_limit": resolved.array_limit,
            "array_job_id": None,
            "array_task_id": None,
            "account": spec.get("account"),
            "qos": spec.get("qos"),
            "nice": int(spec.get("nice") or 0),
        }

    def _resolve_dependencies(
        self, conn: Connection, deps: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Turn `123` / `123_4` references into concrete job ids; unknown jobs are refused."""
        out = []
        for dep in deps:
            ids: list[int] = []
            for ref in dep.get("jobs", []):
                found = self._refs(conn, [str(ref)])
                if not found:
                    raise InvalidSpec(
                        f"dependency: job {ref} does not exist", field="dependency", job=str(ref)
                    )
                ids.extend(found)
            out.append({"type": dep["type"], "jobs": ids})
        return out

    def _refs(self, conn: Connection, refs: Sequence[str]) -> list[int]:
        ids: list[int] = []
        for ref in refs:
            ref = str(ref).strip()
            if "_" in ref:
                a, _, t = ref.partition("_")
                if not (a.isdecimal() and t.isdecimal()):
                    raise InvalidSpec(f"invalid job id '{ref}': use 123 or 123_4")
                if int(a) > MAX_ID or int(t) > MAX_ID:
                    continue  # larger than any id a job can have: no such job
                row = conn.execute(
                    select(s.jobs.c.id).where(
                        s.jobs.c.array_job_id == int(a), s.jobs.c.array_task_id == int(t)
                    )
                ).first()
                if row:
                    ids.append(int(row.id))
                continue
            if not ref.isdecimal():
                raise InvalidSpec(f"invalid job id '{ref}': use 123 or 123_4")
            jid = int(ref)
            if jid > MAX_ID:
                continue
            rows = conn.execute(
                select(s.jobs.c.id).where(s.jobs.c.array_job_id == jid).order_by(s.jobs.c.id)
            ).all()
            if rows:
                ids.extend(int(r.id) for r in rows)
            elif conn.execute(select(s.jobs.c.id).where(s.jobs.c.id == jid)).first():
                ids.append(jid)
        return ids

    def resolve_refs(self, refs: Sequence[str]) -> list[int]:
        """Job references as users type them: `123` (a job, or a whole array) or `123_4`."""
        with self.db.begin(write=False) as conn:
            return self._refs(conn, refs)

    def get_job(self, job_id: int) -> dict[str, Any]:
        with self.db.begin(write=False) as conn:
            row = conn.execute(select(s.jobs).where(s.jobs.c.id == job_id)).mappings().first()
            if row is None:
                raise NotFound(f"job {job_id} does not exist", job_id=job_id)
            return dict(row)

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
    ) -> list[dict[str, Any]]:
        """Jobs by filters. `active_after`/`submitted_before` select the jobs that existed in a
        time window (sacct -S/-E): not ended before its start, submitted before its end.
        `with_spec` adds each job's spec (command, workdir, account: sacct's detail)."""
        cols = [*_JOB_SUMMARY, s.jobs.c.spec] if with_spec else _JOB_SUMMARY
        q = select(*cols).order_by(s.jobs.c.id)
        if active_after is not None:
            q = q.where(or_(s.jobs.c.end_time.is_(None), s.jobs.c.end_time >= active_after))
        if submitted_before is not None:
            q = q.where(s.jobs.c.submit_time <= submitted_before)
        if states:
            q = q.where(s.jobs.c.state.in_(list(states)))
        if user:
            q = q.where(s.jobs.c.user == user)
        if partition:
            q = q.where(s.jobs.c.partition == partition)
        if name:
            q = q.where(s.jobs.c.name == name)
        if ids is not None:
            q = q.where(s.jobs.c.id.in_(list(ids)))
        if not node:  # the node filter runs below, in Python: limit after it
            q = q.limit(limit)
        with self.db.begin(write=False) as conn:
            rows = [dict(r) for r in conn.execute(q).mappings()]
        if node:
            rows = [r for r in rows if node in (r["nodelist_run"] or [])][:limit]
        return rows

    def attempts_of(self, job_id: int) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            atts = [
                dict(r)
                for r in conn.execute(
                    select(s.attempts)
                    .where(s.attempts.c.job_id == job_id)
                    .order_by(s.attempts.c.id)
                ).mappings()
            ]
            if atts:
                tasks = conn.execute(
                    select(s.tasks)
                    .where(s.tasks.c.attempt_id.in_([a["id"] for a in atts]))
                    .order_by(s.tasks.c.rank)
                ).mappings()
                by: dict[int, list[dict[str, Any]]] = {}
                for t in tasks:
                    by.setdefault(t["attempt_id"], []).append(dict(t))
                for a in atts:
                    a["tasks"] = by.get(a["id"], [])
            return atts

    def attempts_by_id(self, attempt_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """These attempts with their tasks (as `attempts_of` gives them), by id."""
        out: dict[int, dict[str, Any]] = {}
        with self.db.begin(write=False) as conn:
            for chunk in _chunks(sorted(set(attempt_ids)), 500):
                for r in conn.execute(
                    select(s.attempts).where(s.attempts.c.id.in_(chunk))
                ).mappings():
                    out[int(r["id"])] = {**dict(r), "tasks": []}
                for t in conn.execute(
                    select(s.tasks).where(s.tasks.c.attempt_id.in_(chunk)).order_by(s.tasks.c.rank)
                ).mappings():
                    out[int(t["attempt_id"])]["tasks"].append(dict(t))
        return out

    def cancel(
        self, job_ids: Sequence[int], actor: str, reason: str = "cancelled"
    ) -> dict[int, str]:
        """Cancel jobs: pending ones end at once; running ones are asked to stop."""
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                state = JobState(job["state"])
                text_reason = f"{reason} by {actor}"
                if state.terminal:
                    out[jid] = f"already {state.value}"
                elif state in (JobState.PENDING, JobState.HELD):
                    self._set_job_state(conn, job, JobState.CANCELLED, text_reason, actor=actor)
                    out[jid] = "cancelled"
                else:
                    self._stop_attempt(conn, job, f"cancel: {text_reason}", actor=actor)
                    out[jid] = "stopping"
        return out

    def requeue(
        self, job_ids: Sequence[int], actor: str, *, hold: bool = False, admin: bool = False
    ) -> dict[int, str]:
        """Requeue jobs as `scontrol requeue` does (`hold`: `requeuehold`, they wait HELD; an
        admin hold when `admin`, placed by an operator or admin, see `hold`).

        A running job is stopped with a user-requeue stop reason (no checkpoint signal, no
        retry spent) and its next attempt has restart count + 1; a finished job goes back to
        the queue at once, restart count + 1; a pending job is left as it is (or held). A job
        that said --no-requeue is refused, as Slurm refuses it. Results per job: text that
        starts with "requeued"/"held" on success, anything else says why not.
        """
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                state = JobState(job["state"])
                if not job["requeue"]:
                    out[jid] = "not requeue-able: the job was submitted with --no-requeue"
                elif state is JobState.PENDING:
                    if hold:
                        self._set_job_state(
                            conn,
                            job,
                            JobState.HELD,
                            f"held by {actor}",
                            actor=actor,
                            extra=_hold_columns(actor, admin),
                        )
                        out[jid] = "held"
                    else:
                        out[jid] = "pending: the job has not started, there is nothing to requeue"
                elif state is JobState.HELD:
                    out[jid] = "held" if hold else "held: release it instead (scontrol release)"
                elif state.terminal:
                    new = JobState.HELD if hold else JobState.PENDING
                    why = f"requeued{' and held' if hold else ''} by {actor} after {state.value}"
                    res = conn.execute(
                        update(s.jobs)
                        .where(s.jobs.c.id == jid, s.jobs.c.state == state.value)
                        .values(
                            state=new.value,
                            reason=why,
                            end_time=None,
                            eligible_time=None,
                            restart_count=s.jobs.c.restart_count + 1,
                            **_hold_columns(actor, admin, held=hold),
                        )
                    )
                    if res.rowcount == 1:
                        self._event(
                            conn,
                            "job.requeue",
                            f"{state.value} -> {new.value}: {why}",
                            job_id=jid,
                            actor=actor,
                            data={"from": state.value, "to": new.value, "why": "user"},
                        )
                    out[jid] = "requeued and held" if hold else "requeued"
                else:
                    stop = self._attempt_stop_reason(conn, job)
                    if stop is not None and not is_user_requeue(stop):
                        out[jid] = f"completing: the job is already stopping ({stop})"
                        continue
                    self._stop_attempt(
                        conn, job, user_requeue_reason(actor, hold=hold), actor=actor
                    )
                    if hold:  # the attempt's end puts it HELD: with these, set now
                        update_where(conn, s.jobs, {"id": jid}, _hold_columns(actor, admin))
                    out[jid] = "requeued and held" if hold else "requeued"
        return out

    def _attempt_stop_reason(self, conn: Connection, job: dict[str, Any]) -> str | None:
        """Why the job's current attempt is stopping (None: it is not being stopped)."""
        if job["attempt_id"] is None:
            return None
        row = conn.execute(
            select(s.attempts.c.state, s.attempts.c.stop_reason).where(
                s.attempts.c.id == job["attempt_id"]
            )
        ).first()
        if row is None or row.state != AttemptState.STOPPING.value:
            return None
        return str(row.stop_reason or "stopping")

    def update_pending(
        self, job_ids: Sequence[int], changes: dict[str, Any], actor: str, *, may_raise: bool
    ) -> dict[int, str]:
        """Change pending jobs (scontrol update JobId=...): `time_limit_s`, `nodes`,
        `partition`, `dependency` (text as --dependency), `priority`, `nice`. A running or finished job is refused
        (its allocation is made); `may_raise` (operators) may also raise a time limit, as in
        Slurm where users may only lower theirs. Results per job: "updated" or why not."""
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            parts = {r["name"]: dict(r) for r in conn.execute(select(s.partitions)).mappings()}
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                if job["state"] not in (JobState.PENDING.value, JobState.HELD.value):
                    out[jid] = (
                        f"{job['state'].lower()}: only a pending job can be changed here "
                        "(its allocation is already made)"
                    )
                    continue
                values: dict[str, Any] = {}
                part_names = job["partitions"].split(",")
                if "partition" in changes:
                    name = str(changes["partition"])
                    if name not in parts:
                        raise InvalidSpec(f"partition {name} does not exist", field="partition")
                    part_names = [name]
                    values.update(partitions=name, partition=name)
                if "time_limit_s" in changes:
                    tl = changes["time_limit_s"]
                    old = job["time_limit_s"]
                    raising = tl is None or (old is not None and tl > old)
                    if raising and not may_raise:
                        out[jid] = "time limit: a user may only lower a job's time limit"
                        continue
                    maxes = [parts[p]["max_time_s"] for p in part_names if p in parts]
                    if tl is not None and any(m is not None and tl > m for m in maxes):
                        out[jid] = "time limit: longer than the partition's maximum time"
                        continue
                    values["time_limit_s"] = tl
                if "nodes" in changes:
                    values["nodes"] = int(changes["nodes"])
                if "dependency" in changes:
                    values["dependency"] = self._resolve_dependencies(conn, changes["dependency"])
                for key in ("priority", "nice"):  # the API checked who may set them
                    if key in changes:
                        values[key] = int(changes[key])
                if not values:
                    out[jid] = "nothing to change"
                    continue
                res = conn.execute(
                    update(s.jobs)
                    .where(s.jobs.c.id == jid, s.jobs.c.state == job["state"])
                    .values(**values)
                )
                if res.rowcount != 1:
                    out[jid] = "changed state meanwhile: try again"
                    continue
                shown = ", ".join(f"{k}={v}" for k, v in sorted(values.items()))
                self._event(
                    conn, "job.update", f"updated by {actor}: {shown}", job_id=jid, actor=actor
                )
                out[jid] = "updated"
        return out

    def purge_finished(self, older_than: float, batch: int = 500) -> int:
        """Delete up to `batch` jobs that ended before `older_than`, with their rows in
        `JOB_ROWS` (attempts, tasks, events); returns how many jobs went (accounting retention:
        the cluster duty calls this until it returns less than `batch`)."""
        with self.db.begin() as conn:
            ids = [
                int(r.id)
                for r in conn.execute(
                    # by ix_jobs_end_time: the old-enough range only, oldest end first. By
                    # the state index it read every finished job's row, to find none mostly;
                    # SQLite, which keeps no statistics, prefers an equality on an indexed
                    # column, so the state is tested as an expression (`state || ''`)
                    select(s.jobs.c.id)
                    .where(
                        s.jobs.c.end_time < older_than,
                        s.jobs.c.state.concat("").in_([t.value for t in TERMINAL]),
                    )
                    .order_by(s.jobs.c.end_time, s.jobs.c.id)
                    .limit(batch)
                )
            ]
            if not ids:
                return 0
            self.carry_purged(conn, ids)  # /metrics counters must not go down (store/metrics.py)
            for table, rows_of in JOB_ROWS:
                conn.execute(delete(table).where(rows_of(ids)))
            conn.execute(delete(s.jobs).where(s.jobs.c.id.in_(ids)))
        return len(ids)

    def signal(
        self, job_ids: Sequence[int], signum: int, target: str, actor: str
    ) -> dict[int, str]:
        """Record a signal for each job's running attempt (``scancel --signal``).

        The request is kept on the attempt (``attempts.signals``, in seq order) so that agents
        deliver it level-triggered, each seq once, even across controller or agent restarts.
        Outcomes: ``signalled``; ``pending`` (not running yet: Slurm refuses "Job is pending
        execution"); ``done`` (completing or ended: "already completing or completed");
        ``not found``.
        """
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                state = JobState(job["state"])
                if state in (JobState.PENDING, JobState.HELD):
                    out[jid] = "pending"
                    continue
                att = (
                    conn.execute(
                        select(
                            s.attempts.c.id,
                            s.attempts.c.state,
                            s.attempts.c.signals,
                            s.attempts.c.nodes,
                        ).where(s.attempts.c.id == job["attempt_id"])
                    )
                    .mappings()
                    .first()
                )
                live = (AttemptState.STARTING.value, AttemptState.RUNNING.value)
                if state.terminal or att is None or att["state"] not in live:
                    out[jid] = "done"
                    continue
                signals = list(att["signals"] or [])
                seq = (signals[-1]["seq"] if signals else 0) + 1
                signals.append({"seq": seq, "signum": int(signum), "target": target})
                conn.execute(
                    update(s.attempts).where(s.attempts.c.id == att["id"]).values(signals=signals)
                )
                self._event(
                    conn,
                    "job.signal",
                    f"signal {signum} to the {target} of job {jid} by {actor}",
                    job_id=jid,
                    actor=actor,
                    data={"seq": seq, "signum": int(signum), "target": target},
                )
                self._bump_gen(conn, att["nodes"])  # wakes the nodes' long-polling heartbeats
                out[jid] = "signalled"
        return out

    def _jobs_by_id(self, conn: Connection, job_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        q = select(*_JOB_SUMMARY).where(s.jobs.c.id.in_(list(job_ids)))
        return {r["id"]: dict(r) for r in conn.execute(q).mappings()}

    def _stop_attempt(
        self, conn: Connection, job: dict[str, Any], stop_reason: str, *, actor: str
    ) -> None:
        att = (
            conn.execute(select(s.attempts).where(s.attempts.c.id == job["attempt_id"]))
            .mappings()
            .first()
        )
        if att is None or att["state"] == AttemptState.ENDED.value:
            return
        if att["state"] != AttemptState.STOPPING.value or not att["stop_reason"]:
            conn.execute(
                update(s.attempts)
                .where(s.attempts.c.id == att["id"])
                .values(state=AttemptState.STOPPING.value, stop_reason=stop_reason)
            )
        if job["state"] != JobState.COMPLETING.value:
            self._set_job_state(conn, job, JobState.COMPLETING, stop_reason, actor=actor)
        self._bump_gen(conn, att["nodes"])

    def hold(self, job_ids: Sequence[int], actor: str, *, admin: bool = False) -> dict[int, str]:
        """Hold pending jobs. `admin` (the caller is an operator or admin): an admin hold,
        which only an operator or admin may release (Slurm's `scontrol hold`); otherwise a
        user hold. An admin holding a job its owner held makes it an admin hold."""
        return self._hold_release(job_ids, actor, hold=True, admin=admin)

    def release(self, job_ids: Sequence[int], actor: str, *, admin: bool = False) -> dict[int, str]:
        """Release held jobs; an admin hold only when `admin` (else the result says why)."""
        return self._hold_release(job_ids, actor, hold=False, admin=admin)

    def _hold_release(
        self, job_ids: Sequence[int], actor: str, *, hold: bool, admin: bool
    ) -> dict[int, str]:
        out: dict[int, str] = {}
        src, dst = (JobState.PENDING, JobState.HELD) if hold else (JobState.HELD, JobState.PENDING)
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                elif hold and admin and job["state"] == JobState.HELD.value:
                    if job.get("hold_kind") == HOLD_ADMIN:
                        out[jid] = "held"  # already an admin hold
                        continue
                    # the owner's hold becomes an operator's: they no longer release it alone
                    n = update_where(
                        conn,
                        s.jobs,
                        {"id": jid, "state": JobState.HELD.value},
                        {"reason": f"held by {actor}", **_hold_columns(actor, True)},
                    )
                    if n == 1:
                        self._event(
                            conn,
                            "job.held",
                            f"user hold made an admin hold by {actor}",
                            job_id=jid,
                            actor=actor,
                            data={"hold_kind": HOLD_ADMIN},
                        )
                    out[jid] = "held"
                elif job["state"] != src.value:
                    out[jid] = f"not {src.value.lower()} (state {job['state']})"
                elif not hold and job.get("hold_kind") == HOLD_ADMIN and not admin:
                    out[jid] = (
                        f"held by {job.get('held_by') or 'an operator'} (an admin hold): only "
                        "an operator or admin may release it"
                    )
                else:
                    reason = f"held by {actor}" if hold else None
                    self._set_job_state(
                        conn, job, dst, reason, actor=actor, extra=_hold_columns(actor, admin, hold)
                    )
                    out[jid] = dst.value.lower() if hold else "released"
        return out

    # ------------------------------------------------------------------ scheduler
    @functools.cached_property
    def pending_mirror(self) -> PendingMirror:
        """The scheduling loop's copy of the pending queue, read incrementally."""
        return _pending_mirror(self.dialect)

    def sched_snapshot(self, eligible_by: float | None = None) -> SchedSnapshot:
        """What one scheduling pass reads. The pending jobs, all of them, come from the
        process's `PendingMirror` (store/pending.py), which reads only the rows changed since
        its last read. `eligible_by` (the scheduling loop's clock): the jobs before their
        begin time (--begin, a retry's backoff) are left out, and those whose reason does
        not say `BeginTime` yet come in ``not_yet`` (id, partitions, time), for the pass to
        set it once.  None: every pending job, as `explain` wants.  A pass with no pending
        job at all gets a `quiet` snapshot, without nodes or allocations. One snapshot of
        the store throughout (on PostgreSQL too): the pending jobs, nodes and allocations
        agree with each other."""
        with self.db.begin(write=False, snapshot=True) as conn:
            got = self.pending_mirror.sync(conn)
            pending, not_yet, reservations = _split_pending(got, eligible_by)
            if eligible_by is not None and not (pending or not_yet or reservations):
                # nothing a pass could start, reserve or explain: a quiet cluster of 10,000
                # nodes would otherwise read every node row once a second for nothing
                return SchedSnapshot(
                    nodes=[],
                    partitions={},
                    allocations=[],
                    pending=[],
                    dep_states={},
                    dep_started={},
                    active_names=set(),
                    array_active={},
                    quiet=True,
                )
            nodes = [
                dict(r) for r in conn.execute(select(s.nodes).order_by(s.nodes.c.name)).mappings()
            ]
            parts = {r["name"]: dict(r) for r in conn.execute(select(s.partitions)).mappings()}
            allocs = [
                dict(r)
                for r in conn.execute(
                    _active_tasks(
                        s.tasks.c.node,
                        s.tasks.c.cpus,
                        s.tasks.c.mem_mb,
                        s.tasks.c.gpu_ids,
                        s.tasks.c.exclusive,
                        s.attempts.c.job_id,
                        s.attempts.c.expected_end,
                    )
                ).mappings()
            ]
            # only the mirror's marked rows have dependencies
            dep_ids = {
                int(j) for p in got.marked for d in p["dependency"] for j in d.get("jobs", [])
            }
            dep_states: dict[int, JobState] = {}
            dep_started: dict[int, bool] = {}
            for chunk in _chunks(sorted(dep_ids), 500):
                for r in conn.execute(
                    select(s.jobs.c.id, s.jobs.c.state, s.jobs.c.start_time).where(
                        s.jobs.c.id.in_(chunk)
                    )
                ):
                    dep_states[int(r.id)] = JobState(r.state)
                    dep_started[int(r.id)] = r.start_time is not None
            active_states = [
                JobState.STARTING.value,
                JobState.RUNNING.value,
                JobState.COMPLETING.value,
            ]
            active_names = {
                (r.name, r.user)
                for r in conn.execute(
                    select(s.jobs.c.name, s.jobs.c.user)
                    .where(s.jobs.c.state.in_(active_states))
                    .distinct()
                )
            }
            array_active = {
                int(r.array_job_id): int(r.n)
                for r in conn.execute(
                    select(s.jobs.c.array_job_id, func.count().label("n"))
                    .where(s.jobs.c.state.in_(active_states), s.jobs.c.array_job_id.is_not(None))
                    .group_by(s.jobs.c.array_job_id)
                )
            }
            return SchedSnapshot(
                nodes=nodes,
                partitions=parts,
                allocations=allocs,
                pending=pending,
                dep_states=dep_states,
                dep_started=dep_started,
                active_names=active_names,
                array_active=array_active,
                reservations=reservations,
                not_yet=not_yet,
                maintenance=self._live_windows(conn),
                active_jobs=self._limit_rows(conn, active_states),
                licenses_held=self._licenses_held(conn),
                groups_active=self._groups_active(conn),
            )

    @staticmethod
    def _groups_active(conn: Connection) -> dict[int, str]:
        """The --group of every job with an attempt that still holds its nodes."""
        group = s.jobs.c.spec["group"].as_string()
        return {
            int(r[0]): str(r[1])
            for r in conn.execute(
                select(s.attempts.c.job_id, group)
                .select_from(s.attempts.join(s.jobs, s.jobs.c.id == s.attempts.c.job_id))
                .where(attempt_holds(), group.is_not(None))
            )
            if r[1]
        }

    def licenses_in_use(self) -> dict[str, int]:
        """Licence name -> count held by attempts that hold their nodes."""
        with self.db.begin(write=False) as conn:
            return licenses.held(licenses.parse_licenses(t) for t in self._licenses_held(conn))

    @staticmethod
    def _licenses_held(conn: Connection) -> list[str]:
        """The --licenses text of every attempt that still holds its resources: a licence is
        given back when the attempt ENDS, not when the job leaves RUNNING."""
        return [
            str(r[0])
            for r in conn.execute(
                select(_LICENSES_TEXT)
                .select_from(s.attempts.join(s.jobs, s.jobs.c.id == s.attempts.c.job_id))
                .where(attempt_holds(), _LICENSES_TEXT.is_not(None))
            )
            if r[0]
        ]

    def start_attempts(
        self,
        starts: Sequence[dict[str, Any]],
        fence: Fence | None,
        *,
        license_totals: Mapping[str, int] | None = None,
    ) -> list[int]:
        """Create attempts for placements, in one fenced transaction; return the job ids started.

        Each item: job_id, partition, nodes (rank order), cpus_per_node, mem_per_node_mb (list),
        gpu_ids (list of lists), exclusive, time_limit_s, and optionally spares: how many of the
        last `nodes` are hot spares (their tasks hold resources, rank -1, and run nothing). A
        job that is no longer PENDING is skipped. Starting ends a job's restart reservation.
        An item with `licenses` (its --licenses text) is skipped when they are no longer free
        against `license_totals` (another partition's scheduler took them since the snapshot).
        """
        now = _now()
        if not starts:
            return []
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            term = fence.term if fence else 0
            current: dict[int, Any] = {}
            for chunk in _chunks([int(st["job_id"]) for st in starts], 500):
                q = select(
                    s.jobs.c.id, s.jobs.c.state, s.jobs.c.restart_count, s.jobs.c.time_limit_s
                ).where(s.jobs.c.id.in_(chunk))
                if self.dialect == "postgresql":
                    q = q.with_for_update()  # a concurrent cancel waits for us, or we see it
                current.update({int(r.id): r for r in conn.execute(q)})
            # a job cancelled or held since the snapshot is skipped
            ok = [
                st
                for st in starts
                if (r := current.get(int(st["job_id"]))) is not None
                and r.state == JobState.PENDING.value
            ]
            ok = self._fitting(conn, ok)
            if any(st.get("licenses") for st in ok):
                ok = self._licensed(conn, ok, license_totals or {})
            if not ok:
                return []
            res = conn.execute(
                insert(s.attempts).returning(s.attempts.c.id, sort_by_parameter_order=True),
                [
                    {
                        "job_id": st["job_id"],
                        "seq": current[int(st["job_id"])].restart_count,
                        "token": _attempt_token(),
                        "state": AttemptState.STARTING.value,
                        "partition": st["partition"],
                        "nodes": _rank_nodes(st),
                        "fence_term": term,
                        "created_at": now,
                        "expected_end": (now + tl)
                        if (tl := current[int(st["job_id"])].time_limit_s)
                        else None,
                    }
                    for st in ok
                ],
            )
            att_ids = [int(r[0]) for r in res]
            conn.execute(
                insert(s.tasks),
                [
                    {
                        "attempt_id": aid,
                        "node": n,
                        "rank": i if i < len(_rank_nodes(st)) else -1,
                        "cpus": st["cpus_per_node"],
                        "mem_mb": st["mem_per_node_mb"][i],
                        "gpu_ids": list(st["gpu_ids"][i]),
                        "exclusive": bool(st["exclusive"]),
                        "state": TaskState.STARTING.value,
                        "spare": i >= len(_rank_nodes(st)),
                    }
                    for st, aid in zip(ok, att_ids, strict=True)
                    for i, n in enumerate(st["nodes"])
                ],
            )
            conn.execute(
                update(s.jobs)
                .where(s.jobs.c.id == bindparam("b_id"), s.jobs.c.state == JobState.PENDING.value)
                .values(
                    state=JobState.STARTING.value,
                    reason=None,
                    attempt_id=bindparam("b_att"),
                    partition=bindparam("b_part"),
                    nodelist_run=bindparam("b_nodes"),
                    reserved_nodes=None,
                    reserved_until=None,
                ),
                [
                    {
                        "b_id": st["job_id"],
                        "b_att": aid,
                        "b_part": st["partition"],
                        "b_nodes": _rank_nodes(st),
                    }
                    for st, aid in zip(ok, att_ids, strict=True)
                ],
            )
            self._events_many(
                conn,
                [
                    {
                        "kind": "job.starting",
                        "job_id": int(st["job_id"]),
                        "term": term,
                        "message": f"allocated {','.join(_rank_nodes(st))} in {st['partition']} "
                        f"(attempt {aid})" + _spares_text(st),
                        "data": {"from": JobState.PENDING.value, "to": JobState.STARTING.value},
                        "ts": now,
                    }
                    for st, aid in zip(ok, att_ids, strict=True)
                ],
            )
            self._bump_gen(conn, {n for st in ok for n in st["nodes"]})
        return [int(st["job_id"]) for st in ok]

    def _licensed(
        self, conn: Connection, starts: list[dict[str, Any]], totals: Mapping[str, int]
    ) -> list[dict[str, Any]]:
        """The starts whose licences are still free, checked inside the write transaction
        (PostgreSQL: under a transaction-scoped advisory lock, so two schedulers of different
        partitions cannot both hand out the last licence; SQLite writers are serialised)."""
        if self.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LICENSE_LOCK})
        pool = licenses.Pool(
            totals,
            licenses.held(licenses.parse_licenses(t) for t in self._licenses_held(conn)),
        )
        out = []
        for st in starts:
            want = (
                sorted(licenses.parse_licenses(st["licenses"]).items())
                if st.get("licenses")
                else []
            )
            if pool.fits(want):
                pool.take(want)
                out.append(st)
        return out

    def _fitting(self, conn: Connection, starts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The starts that still fit their nodes, checked inside the write transaction.

        The plan was made on a snapshot; since then a node may have been drained or marked
        DOWN, and another scheduler (another partition's lease holder) may have placed work on
        a node both partitions share. Node rows are locked (PostgreSQL; SQLite writers are
        serialised) and capacity is re-checked, so resources are never double-booked; a start
        that no longer fits is skipped and planned again on the next pass.
        """
        names = sorted({n for st in starts for n in st["nodes"]})
        q = select(s.nodes).where(s.nodes.c.name.in_(names)).order_by(s.nodes.c.name)
        if self.dialect == "postgresql":
            q = q.with_for_update()
        nodes = {r["name"]: r for r in conn.execute(q).mappings()}
        used = NodeUsage()
        for r in conn.execute(
            _active_tasks(
                s.tasks.c.node,
                s.tasks.c.cpus,
                s.tasks.c.mem_mb,
                s.tasks.c.gpu_ids,
                s.tasks.c.exclusive,
            ).where(s.tasks.c.node.in_(names))
        ):
            used.add(r.node, r.cpus, r.mem_mb, r.gpu_ids or (), bool(r.exclusive))
        out = []
        for st in starts:
            want = [
                (n, st["mem_per_node_mb"][i], st["gpu_ids"][i]) for i, n in enumerate(st["nodes"])
            ]
            cpus, exclusive = st["cpus_per_node"], bool(st["exclusive"])
            if all(
                (node := nodes.get(n)) is not None
                and node["registered"]
                and not node["down"]
                and not node["drain"]
                and used.fits(n, node["cpus"], node["mem_mb"], cpus, mem, gpus, exclusive)
                for n, mem, gpus in want
            ):
                for n, mem, gpus in want:
                    used.add(n, cpus, mem, gpus, exclusive)
                out.append(st)
        return out

    def end_pending(self, job_id: int, state: JobState, reason: str, fence: Fence | None) -> bool:
        """End a pending job the scheduler found can never run (e.g. a dependency that failed)."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            job = (
                conn.execute(select(*_JOB_SUMMARY).where(s.jobs.c.id == job_id)).mappings().first()
            )
            if job is None or job["state"] != JobState.PENDING.value:
                return False
            return self._set_job_state(
                conn, dict(job), state, reason, term=fence.term if fence else None
            )

    def set_pending_reasons(self, reasons: Mapping[int, str | None]) -> None:
        """Record why pending jobs wait (Slurm's Reason column); no event, not a state change."""
        if not reasons:
            return
        with self.db.begin() as conn:
            conn.execute(
                update(s.jobs)
                .where(s.jobs.c.id == bindparam("b_id"), s.jobs.c.state == JobState.PENDING.value)
                .values(reason=bindparam("b_reason")),
                [{"b_id": k, "b_reason": v} for k, v in reasons.items()],
            )

    # ------------------------------------------------------------------ agents
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
    ) -> dict[str, Any]:
        now = _now()
        values = {
            "topology": topology or None,
            "registered": True,
            "cpus": cpus,
            "mem_mb": mem_mb,
            "gpus": gpus,
            "features": sorted(set(features)),
            "addr": addr,
            "boot_id": boot_id,
            "agent_version": version,
            "registered_at": now,
            "last_heartbeat": now,
        }
        with self.db.begin() as conn:
            values["last_heartbeat"] = float(
                conn.execute(select(self.db.db_now_sql())).scalar_one()
            )
            row = conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().first()
            if row is None:
                conn.execute(
                    insert(s.nodes).values(name=name, down=False, drain=False, work_gen=0, **values)
                )
                self._event(
                    conn,
                    "node.register",
                    f"node {name} registered: {cpus} cpus, {mem_mb} MB, {len(gpus)} gpus",
                    node=name,
                    actor=name,
                )
            else:
                if row["down"]:
                    values.update(down=False, down_reason=None)
                    self._event(
                        conn,
                        "node.up",
                        f"node {name} is back (was DOWN: {row['down_reason']})",
                        node=name,
                        actor=name,
                    )
                else:
                    self._event(
                        conn, "node.register", f"node {name} re-registered", node=name, actor=name
                    )
                conn.execute(update(s.nodes).where(s.nodes.c.name == name).values(**values))
            if health:
                # in the same transaction: a node failing its preflight is never schedulable
                self._apply_health(conn, name, health)
            return dict(
                conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().one()
            )

    def record_heartbeats(self, ages: dict[str, float]) -> list[str]:
        """One transaction for a batch of heartbeats: node -> seconds since it was seen.

        Stamped with the database's clock (now - age), so controllers on hosts whose clocks
        disagree still agree on when a node was last heard from. A node that was DOWN only
        because it stopped answering is back in service as soon as it is heard from again
        (its jobs were requeued and its agent is told to stop the old attempts); an operator's
        drain is untouched. Returns the nodes that came back.

        A node's stamp never moves back. A controller that was paused (or slow) between
        answering a heartbeat and writing it flushes an older stamp than another controller
        already wrote for the node's later heartbeats: moving the stamp back would make the
        failure detector count the node silent since then, and declare it DOWN while its
        agent's fence (freshened by those later replies) still lets its jobs run. Such a stale
        heartbeat brings no DOWN node back either: it says nothing about the node since.
        """
        if not ages:
            return []
        n = s.nodes.c
        # urgent (engine.WriterQueue): a flush that fails restarts the failure detector's
        # grace, so it must not wait behind bulk writes; one small row per node heard from
        with self.db.begin(urgent=True) as conn:
            db_now = float(conn.execute(select(self.db.db_now_sql())).scalar_one())
            stamps = {name: db_now - age for name, age in ages.items()}
            rows = conn.execute(
                select(n.name, n.last_heartbeat).where(n.name.in_(sorted(ages)))
            ).all()
            newer = {
                r.name
                for r in rows
                if r.last_heartbeat is None or r.last_heartbeat <= stamps[r.name]
            }
            if newer:
                # the filter again in the update: on PostgreSQL another controller's flush
                # may commit between the read and this write
                conn.execute(
                    update(s.nodes)
                    .where(
                        n.name == bindparam("b_name"),
                        or_(n.last_heartbeat.is_(None), n.last_heartbeat <= bindparam("b_t")),
                    )
                    .values(last_heartbeat=bindparam("b_t")),
                    [{"b_name": name, "b_t": stamps[name]} for name in sorted(newer)],
                )
            # read after the update (which waited for any concurrent writer of these rows):
            # a node declared DOWN meanwhile comes back with this newer heartbeat
            back = conn.execute(
                select(n.name, n.down_reason).where(n.name.in_(sorted(newer)), n.down.is_(True))
            ).all()
            if back:
                conn.execute(
                    update(s.nodes)
                    .where(s.nodes.c.name.in_([r.name for r in back]))
                    .values(down=False, down_reason=None)
                )
                self._events_many(
                    conn,
                    [
                        {
                            "kind": "node.up",
                            "node": r.name,
                            "actor": r.name,
                            "message": f"node {r.name} answers again (was DOWN: {r.down_reason})",
                        }
                        for r in back
                    ],
                )
            return [r.name for r in back]

    def db_time(self) -> float:
        with self.db.begin(write=False) as conn:
            return float(conn.execute(select(self.db.db_now_sql())).scalar_one())

    def node_gens_total(self) -> int:
        """The sum of every node's work generation: gens only grow, so an unchanged sum means
        no node got work since it was last read, and a poll of 10,000 nodes reads one number
        instead of 10,000 rows (`Controller.gen_tick`)."""
        with self.db.begin(write=False) as conn:
            return int(
                conn.execute(select(func.coalesce(func.sum(s.nodes.c.work_gen), 0))).scalar_one()
            )

    def node_gens(self) -> dict[str, int]:
        with self.db.begin(write=False) as conn:
            return {
                r.name: int(r.work_gen)
                for r in conn.execute(select(s.nodes.c.name, s.nodes.c.work_gen))
            }

    def node_work(self, node: str, conn: Connection | None = None) -> list[dict[str, Any]]:
        """Every task of a not-yet-ended attempt on this node, with its job, for the agent."""
        if conn is not None:
            return _NODE_WORK.rows(conn, {"node": node})
        with self.db.begin(write=False) as c:
            return _NODE_WORK.rows(c, {"node": node})

    def node_all_work(
        self, node: str, needs_steps: Callable[[list[dict[str, Any]]], bool]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The node's task work and, when ``needs_steps(task work)`` says the heartbeat can
        use it (exchange.steps_to_decide: not for an idle node), its step work
        (JobSteps.node_step_work), in one read transaction: on SQLite a transaction of its
        own costs about as much as the query."""
        with self.db.begin(write=False) as conn:
            work = self.node_work(node, conn)
            return work, self.node_step_work(node, conn) if needs_steps(work) else []

    def finished_attempts(self, attempt_ids: Sequence[int]) -> set[int]:
        """Which of these attempts the store has fully recorded (ENDED) or never heard of."""
        if not attempt_ids:
            return set()
        with self.db.begin(write=False) as conn:
            live = {
                int(r.id)
                for r in conn.execute(
                    select(s.attempts.c.id).where(
                        s.attempts.c.id.in_(list(attempt_ids)),
                        s.attempts.c.state != AttemptState.ENDED.value,
                    )
                )
            }
        return set(attempt_ids) - live

    def apply_reports(
        self, node: str, reports: Sequence[TaskReport], taken_at: float | None
    ) -> None:
        """Record what an agent says about its tasks; finish attempts whose every task is done.

        Reports about attempts that are not the job's current one, or with a wrong token, are
        ignored (the agent is told to stop those by the reply). A task that the store believes
        RUNNING on this node and that the agent no longer knows, although it started before the
        report was taken, is LOST.
        """
        now = _now()
        with self.db.begin() as conn:
            mine = {r["attempt_id"]: r for r in _REPORTED_TASKS.rows(conn, {"node": node})}
            touched: set[int] = set()
            reported = {r.attempt_id for r in reports}
            for rep in reports:
                task = mine.get(rep.attempt_id)
                if task is None or task["token"] != rep.token:
                    continue
                self._record_job_reports(conn, node, rep, task)
                if rep.state in ("starting", "running"):
                    if task["state"] == TaskState.STARTING.value and rep.state == "running":
                        update_where(
                            conn,
                            s.tasks,
                            {"attempt_id": rep.attempt_id, "node": node},
                            {"state": TaskState.RUNNING.value, "started_at": rep.started_at or now},
                        )
                        touched.add(rep.attempt_id)
                elif rep.state in ("exited", "lost") and task["state"] not in (
                    TaskState.EXITED.value,
                    TaskState.LOST.value,
                ):
                    ex = rep.exit or {}
                    update_where(
                        conn,
                        s.tasks,
                        {"attempt_id": rep.attempt_id, "node": node},
                        {
                            "state": (
                                TaskState.EXITED if rep.state == "exited" else TaskState.LOST
                            ).value,
                            "started_at": task["started_at"] or ex.get("started_at"),
                            "ended_at": ex.get("ended_at") or now,
                            "exit_code": ex.get("exit_code"),
                            "exit_signal": ex.get("signal"),
                            "detail": ex,
                            **efficiency.task_usage(ex),
                        },
                    )
                    touched.add(rep.attempt_id)
            if taken_at is not None:
                for aid, task in mine.items():
                    if (
                        aid not in reported
                        and task["state"] == TaskState.STARTING.value
                        and task["attempt_state"] == AttemptState.STOPPING.value
                    ):
                        # stopped before the agent ever launched it: nothing to kill
                        conn.execute(
                            update(s.tasks)
                            .where(s.tasks.c.attempt_id == aid, s.tasks.c.node == node)
                            .values(
                                state=TaskState.EXITED.value,
                                ended_at=now,
                                detail={"cancelled": True, "never_started": True},
                            )
                        )
                        touched.add(aid)
                    elif (
                        aid not in reported
                        and task["state"] == TaskState.RUNNING.value
                        and (task["started_at"] or now) < taken_at
                    ):
                        conn.execute(
                            update(s.tasks)
                            .where(s.tasks.c.attempt_id == aid, s.tasks.c.node == node)
                            .values(
                                state=TaskState.LOST.value,
                                ended_at=now,
                                detail={"error": f"node {node} no longer knows this task"},
                            )
                        )
                        touched.add(aid)
            if any(
                r.state == "running" or (r.state == "exited" and (r.exit or {}).get("started_at"))
                for r in reports
            ):
                # a job started here: the node's failed launches are no longer "in a row"
                _CLEAR_LAUNCH_FAILURES.run(conn, {"node": node})
            for aid in sorted(touched):
                self._advance_attempt(conn, aid)

    def _record_job_reports(
        self, conn: Connection, node: str, rep: TaskReport, task: Mapping[Any, Any]
    ) -> None:
        """Record a task's new checkpoint (event + jobs.checkpoint) and progress (throttled)."""
        if rep.checkpoint is None and rep.progress is None:
            return
        row = (
            conn.execute(
                select(
                    s.attempts.c.job_id,
                    s.attempts.c.seq,
                    s.attempts.c.progress,
                    s.jobs.c.checkpoint,
                )
                .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
                .where(s.attempts.c.id == rep.attempt_id)
            )
            .mappings()
            .first()
        )
        if row is None:
            return
        seq = int(row["seq"])
        if rep.checkpoint is not None and job_reports.is_new_checkpoint(
            row["checkpoint"], rep.checkpoint, seq=seq, rank=int(task["rank"])
        ):
            record = job_reports.checkpoint_record(rep.checkpoint, seq=seq, node=node)
            conn.execute(
                update(s.jobs).where(s.jobs.c.id == row["job_id"]).values(checkpoint=record)
            )
            took = record["duration_s"]
            self._event(
                conn,
                "job.checkpoint",
                f"checkpoint {record['path']}"
                + (f" took {took:.1f}s" if took is not None else "")
                + f" (restart {seq}, {node})",
                job_id=int(row["job_id"]),
                node=node,
                data=record,
            )
        if job_reports.progress_due(row["progress"], rep.progress, rank=int(task["rank"])):
            conn.execute(
                update(s.attempts)
                .where(s.attempts.c.id == rep.attempt_id)
                .values(progress={**(rep.progress or {}), "node": node})
            )

    def _advance_attempt(self, conn: Connection, attempt_id: int) -> None:
        """Move an attempt (and its job) forward after its tasks changed: `outcome.advance`
        decides, this writes what it decided."""
        att = only(select_where(conn, s.attempts, {"id": attempt_id}))
        if att["state"] == AttemptState.ENDED.value:
            return
        rows = select_where(conn, s.tasks, {"attempt_id": attempt_id}, order_by="rank")
        # hot spares run nothing: they never decide an attempt's progress or outcome
        spare_tasks = [t for t in rows if t["spare"]]
        tasks = [t for t in rows if not t["spare"]]
        job = _JOB_SUMMARY_BY_ID.one(conn, {"id": att["job_id"]})
        now = _now()
        batch = (
            len(tasks) > 1
            and any(t["state"] in (TaskState.EXITED.value, TaskState.LOST.value) for t in tasks)
            and not self._runs_on_all_nodes(conn, att["job_id"])
        )
        step = advance(att["state"], tasks, stop_reason=att["stop_reason"], batch=batch)
        if step.start is not None:
            self._attempt_running(conn, att, job, step.start, bool(spare_tasks))
        if step.stop is not None:
            values: dict[str, Any] = {"state": AttemptState.STOPPING.value}
            if step.stop != BATCH_ENDED:
                values["stop_reason"] = step.stop
            update_where(conn, s.attempts, {"id": attempt_id}, values)
            if job["state"] in (JobState.STARTING.value, JobState.RUNNING.value):
                self._set_job_state(conn, job, JobState.COMPLETING, step.stop)
            self._bump_gen(conn, att["nodes"])
        end = step.end
        if end is None:
            return
        started = [t["started_at"] for t in tasks if t["started_at"] is not None]
        update_where(
            conn,
            s.attempts,
            {"id": attempt_id},
            {
                "state": AttemptState.ENDED.value,
                "end_time": now,
                "result": end.result.value,
                "exit_code": end.exit_code,
                "exit_signal": end.exit_signal,
                "start_time": att["start_time"] or min(started, default=None),
            },
        )
        # its tasks leave the heartbeat's reads (tasks.held, migration 0011)
        update_where(conn, s.tasks, {"attempt_id": attempt_id}, {"held": False})
        self._bump_gen(conn, att["nodes"])
        self._end_steps_of_attempt(conn, attempt_id, end.result, now)
        if spare_tasks:
            self._release_spares(conn, attempt_id, now)
        launch_failed = list(end.launch_failed)
        if launch_failed:
            self._count_node_launch_failures(conn, launch_failed)
        result, reason, code, sig = end.result, end.reason, end.exit_code, end.exit_signal
        all_tasks, tasks = tasks, list(end.deciding)
        if job["attempt_id"] != attempt_id or JobState(job["state"]).terminal:
            return
        if (
            result is JobState.NODE_FAIL
            and not launch_failed
            and self._fast_restart(conn, job, att, all_tasks, spare_tasks, reason, now)
        ):
            return
        verdict = after_attempt(
            result=result,
            reason=reason,
            stop_reason=att["stop_reason"],
            requeue=bool(job["requeue"]),
            lost_nodes=[
                t["node"]
                for t in tasks
                if t["state"] == TaskState.LOST.value or (t["detail"] or {}).get("fenced")
            ],
            launch_failed=launch_failed,
            launch_failures=int(job["launch_failures"] or 0),
            policy=self.policy,
            tasks=[task_end(t) for t in tasks],
            retries=int(job["retries"] or 0),
            rules=(
                self._retry_rules(conn, job["id"])
                if result is not JobState.COMPLETED or att["stop_reason"]
                else None
            ),
        )
        extra: dict[str, Any] = {"exit_code": code, "exit_signal": sig}
        if verdict.launch_failure:
            extra["launch_failures"] = int(job["launch_failures"] or 0) + 1
        if verdict.retry:  # a failure retry spends the job's budget; planned requeues do not
            extra["retries"] = int(job["retries"] or 0) + 1
        if verdict.avoid:
            extra["avoid_nodes"] = self._avoidable(conn, job, verdict.avoid)
        if verdict.action is Action.END:
            extra.update(end_time=now, start_time=job["start_time"] or att["start_time"])
            self._set_job_state(conn, job, verdict.state, verdict.reason, extra=extra)
            return
        extra["restart_count"] = job["restart_count"] + 1
        if verdict.retry_after:
            extra["eligible_time"] = now + verdict.retry_after
        self._set_job_state(
            conn,
            job,
            verdict.state,
            verdict.reason,
            extra=extra,
            event_kind="job.requeue" if verdict.action is Action.REQUEUE else "job.held",
            # why, for /metrics (requeues and retries by reason): the failure kind, or planned
            data={"why": verdict.kind.value if verdict.kind else "planned", "retry": verdict.retry},
        )

    def _attempt_running(
        self,
        conn: Connection,
        att: dict[str, Any],
        job: dict[str, Any],
        start: float,
        spares: bool,
    ) -> None:
        """A STARTING attempt's first task started: the attempt (and a STARTING job) runs from
        `start`; `att` and `job` are updated in place for what the caller writes next (a task
        that also exited in this report ends the job)."""
        tl = job["time_limit_s"]
        update_where(
            conn,
            s.attempts,
            {"id": att["id"]},
            {
                "state": AttemptState.RUNNING.value,
                "start_time": start,
                "expected_end": (start + tl) if tl else None,
            },
        )
        att["state"] = AttemptState.RUNNING.value
        att["start_time"] = start
        if spares:  # spares hold their nodes while the job runs
            conn.execute(
                update(s.tasks)
                .where(
                    s.tasks.c.attempt_id == att["id"],
                    s.tasks.c.spare.is_(True),
                    s.tasks.c.state == TaskState.STARTING.value,
                )
                .values(state=TaskState.RUNNING.value)
            )
        if job["state"] == JobState.STARTING.value:
            self._set_job_state(
                conn,
                job,
                JobState.RUNNING,
                None,
                extra={"start_time": start},
                message=f"running on {','.join(att['nodes'])}",
            )
            job["state"] = JobState.RUNNING.value
            job["start_time"] = start

    def _runs_on_all_nodes(self, conn: Connection, job_id: int) -> bool:
        """The job asked for its script on every node (--all-nodes), not Slurm's batch step."""
        spec = only(select_where(conn, s.jobs, {"id": job_id}, cols=["spec"]))["spec"]
        return bool((spec or {}).get("all_nodes"))

    def _release_spares(self, conn: Connection, attempt_id: int, now: float) -> None:
        """The attempt ended: its spare tasks (which never ran anything) end with it."""
        conn.execute(
            update(s.tasks)
            .where(
                s.tasks.c.attempt_id == attempt_id,
                s.tasks.c.spare.is_(True),
                s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
            )
            .values(state=TaskState.EXITED.value, ended_at=now)
        )

    def _fast_restart(
        self,
        conn: Connection,
        job: dict[str, Any],
        att: dict[str, Any],
        tasks: list[dict[str, Any]],
        spare_tasks: list[dict[str, Any]],
        reason: str | None,
        now: float,
    ) -> bool:
        """An elastic or spare job lost a node: back to PENDING with its nodes reserved.

        The job restarts at once on its surviving nodes (a spare in place of the failed rank,
        rank layout kept; an elastic job may shrink to MIN and grow with free nodes) without
        going back through the queue: the scheduler places a job with a live reservation first
        and closes its nodes to everyone else until `reserved_until`. It spends one retry of
        the job's budget (as any node-failure requeue does) and sets no backoff. False when the
        job is not elastic or spare, is not requeue-able, was being stopped on purpose, its
        retry rules do not retry node failures or its budget is spent, or too few nodes are
        left (then the usual policy decides).
        """
        stop = att["stop_reason"] or ""
        if not job["requeue"] or stop.startswith(("cancel", "requeue")):
            return False
        nodes_max, spares = self._elastic_of(conn, int(job["id"]))
        if nodes_max is None and not spares:
            return False
        # A node failure is a failure whatever the job's shape: the restart spends a retry like
        # any node-failure requeue, so a job whose nodes keep dying cannot restart forever.
        rules = self._retry_rules(conn, int(job["id"]))
        used = int(job["retries"] or 0)
        if (
            rules.never
            or not rules.retry_on.retries(FailureKind.NODE_FAIL)
            or used >= rules.max_retries
        ):
            return False
        failed = {
            t["node"]
            for t in tasks
            if t["state"] == TaskState.LOST.value or (t["detail"] or {}).get("fenced")
        }
        failed |= {t["node"] for t in spare_tasks if t["state"] == TaskState.LOST.value}
        ranks = [t["node"] for t in sorted(tasks, key=lambda t: t["rank"])]
        spare_nodes = [t["node"] for t in spare_tasks]
        candidates = sorted(set(ranks + spare_nodes) - failed)
        if candidates:
            failed |= {
                r.name
                for r in conn.execute(
                    select(s.nodes.c.name).where(
                        s.nodes.c.name.in_(candidates),
                        (s.nodes.c.down.is_(True))
                        | (s.nodes.c.drain.is_(True))
                        | (s.nodes.c.registered.is_(False)),
                    )
                )
            }
        layout = restart_layout(
            ranks,
            spare_nodes,
            failed,
            nodes_min=int(job["nodes"]),
            elastic=nodes_max is not None,
        )
        if layout is None:
            return False
        until = now + self.restart_reservation
        lost = sorted(failed & set(ranks))
        why = (
            f"restarting on {len(layout)} reserved nodes after losing {','.join(lost) or 'a node'}"
            f" ({reason or 'node failure'}); retry {used + 1} of {rules.max_retries}"
        )
        extra: dict[str, Any] = {
            "restart_count": job["restart_count"] + 1,
            "retries": used + 1,
            "reserved_nodes": layout,
            "reserved_until": until,
            "eligible_time": None,
        }
        avoid = self._avoidable(conn, job, sorted(failed))
        if avoid:
            extra["avoid_nodes"] = avoid
        return self._set_job_state(
            conn,
            job,
            JobState.PENDING,
            why,
            extra=extra,
            event_kind="job.restart",
            data={"why": "node_fail", "retry": True},
            message=f"{job['state']} -> PENDING: {why}; reserved {','.join(layout)} for "
            f"{self.restart_reservation:g}s",
        )

    def _elastic_of(self, conn: Connection, job_id: int) -> tuple[int | None, int]:
        """(elastic MAX or None, spare count) of a job, from its stored spec."""
        row = conn.execute(select(*_elastic_columns()).where(s.jobs.c.id == job_id)).one()
        nodes_max = int(row.nodes_max) if row.nodes_max else None
        return nodes_max, int(row.spares or 0)

    def _retry_rules(self, conn: Connection, job_id: int) -> RetryRules:
        """The job's retry rules: its own --retries/--retry-on/--retry-backoff (kept in its
        spec, checked at submit) over the cluster's defaults."""
        spec = only(select_where(conn, s.jobs, {"id": job_id}, cols=["spec"]))["spec"]
        return self.policy.job_rules(spec)

    def _avoidable(
        self, conn: Connection, job: dict[str, Any], failed: Sequence[str]
    ) -> list[str] | None:
        """Nodes the job should avoid from now on, unless that would leave too few to run it:
        its nodes and its spares (a job with --spares=1 on three nodes that avoided two of them
        would wait for ever, "Resources", on a healthy cluster)."""
        avoid = sorted(set(job["avoid_nodes"] or []) | set(failed))
        _, spares = self._elastic_of(conn, int(job["id"]))
        usable = conn.execute(
            select(func.count())
            .select_from(s.nodes)
            .where(
                s.nodes.c.registered.is_(True),
                s.nodes.c.name.not_in(avoid + list(job["exclude"] or [])),
            )
        ).scalar_one()
        return avoid if usable >= int(job["nodes"]) + spares else None

    def _count_node_launch_failures(self, conn: Connection, failed: list[tuple[str, str]]) -> None:
        """Failed launches in a row on one node drain it: something there is broken."""
        limit = self.policy.node_launch_failures_to_drain
        for node, error in failed:
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == node)
                .values(launch_failures=s.nodes.c.launch_failures + 1)
            )
            row = conn.execute(
                select(s.nodes.c.launch_failures, s.nodes.c.drain).where(s.nodes.c.name == node)
            ).first()
            if row is not None and row.launch_failures >= limit and not row.drain:
                reason = f"{row.launch_failures} launch failures in a row, last: {error}"
                conn.execute(
                    update(s.nodes)
                    .where(s.nodes.c.name == node)
                    .values(drain=True, drain_reason=reason, drain_by="phalanx", drain_time=_now())
                )
                self._event(conn, "node.drain", f"drained by phalanx: {reason}", node=node)

    def requeue_lost_launch(self, attempt_id: int, reason: str, fence: Fence | None) -> bool:
        """A STARTING attempt nobody confirmed: mark its tasks lost and advance (used by the reaper)."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            att = (
                conn.execute(select(s.attempts).where(s.attempts.c.id == attempt_id))
                .mappings()
                .first()
            )
            if att is None or att["state"] == AttemptState.ENDED.value:
                return False
            conn.execute(
                update(s.tasks)
                .where(
                    s.tasks.c.attempt_id == attempt_id,
                    s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                )
                .values(state=TaskState.LOST.value, ended_at=_now(), detail={"error": reason})
            )
            self._advance_attempt(conn, attempt_id)
            return True

    def fail_node_tasks(self, node: str, reason: str, fence: Fence | None) -> list[int]:
        """Every unfinished task on a node that is DOWN is LOST; its attempts end (requeue or
        NODE_FAIL). `mark_down` already does this in the transaction that marks the node; this
        is the repair for a DOWN node found still holding live tasks (`down_nodes_with_tasks`:
        rows written by an older version that split the two, or by a hand edit)."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            return self._fail_node_tasks(conn, node, reason, fence)

    def _fail_node_tasks(
        self, conn: Connection, node: str, reason: str, fence: Fence | None
    ) -> list[int]:
        rows = conn.execute(
            select(s.tasks.c.attempt_id, s.tasks.c.spare, s.attempts.c.job_id)
            .join(s.attempts, s.attempts.c.id == s.tasks.c.attempt_id)
            .where(
                s.tasks.c.node == node,
                s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                s.attempts.c.state != AttemptState.ENDED.value,
            )
        ).all()
        aids = sorted({int(r.attempt_id) for r in rows})
        for r in rows:
            if r.spare:  # the job runs on; a later failure has one spare less
                self._event(
                    conn,
                    "job.spare_lost",
                    f"spare node {node} lost: {reason}",
                    job_id=int(r.job_id),
                    node=node,
                    term=fence.term if fence else None,
                )
        if aids:
            conn.execute(
                update(s.tasks)
                .where(
                    s.tasks.c.node == node,
                    s.tasks.c.attempt_id.in_(aids),
                    s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                )
                .values(state=TaskState.LOST.value, ended_at=_now(), detail={"error": reason})
            )
        for aid in aids:
            self._advance_attempt(conn, aid)
        return aids

    def down_nodes_with_tasks(self) -> list[str]:
        """DOWN nodes that still hold a live task of a live attempt: none, unless rows were
        written apart from `mark_down` (an older version marked a node DOWN and failed its
        tasks in two transactions, and a controller dying between them left a ghost job
        holding its resources forever). The failure detector repairs them every tick."""
        t, a, n = s.tasks.c, s.attempts.c, s.nodes.c
        with self.db.begin(write=False) as conn:
            return [
                str(r.node)
                for r in conn.execute(
                    select(t.node)
                    .distinct()
                    .join(s.attempts, a.id == t.attempt_id)
                    .join(s.nodes, n.name == t.node)
                    .where(
                        n.down.is_(True),
                        t.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                        a.state != AttemptState.ENDED.value,
                    )
                    .order_by(t.node)
                )
            ]

    # ------------------------------------------------------------------ nodes
    def node_count(self) -> int:
        """Node rows, registered or only configured: the size the heartbeat rule scales the
        timings for (Controller.rescale_timing). Rows are never deleted, so it never falls,
        which is what makes the rule safe to apply while the cluster runs."""
        with self.db.begin(write=False) as conn:
            return int(conn.execute(select(func.count()).select_from(s.nodes)).scalar_one())

    def silent_node_rows(self, heard_before: float) -> list[dict[str, Any]]:
        """Registered, not-DOWN nodes whose last heartbeat in the store is older than
        `heard_before` (database clock): the failure detector's candidates (name, registered,
        down, last_heartbeat). The filter runs in the database, so a detector tick on a
        healthy 10,000-node cluster reads no rows instead of all of them with their usage."""
        n = s.nodes.c
        with self.db.begin(write=False) as conn:
            return [
                dict(r)
                for r in conn.execute(
                    select(n.name, n.registered, n.down, n.last_heartbeat)
                    .where(
                        n.registered.is_(True), n.down.is_(False), n.last_heartbeat < heard_before
                    )
                    .order_by(n.name)
                ).mappings()
            ]

    def list_nodes(self) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            nodes = [
                dict(r) for r in conn.execute(select(s.nodes).order_by(s.nodes.c.name)).mappings()
            ]
            usage: dict[str, dict[str, Any]] = {}
            spare_for: dict[str, list[int]] = {}
            for r in conn.execute(
                _active_tasks(
                    s.tasks.c.node,
                    s.tasks.c.cpus,
                    s.tasks.c.mem_mb,
                    s.tasks.c.gpu_ids,
                    s.attempts.c.job_id,
                    s.tasks.c.spare,
                )
            ).mappings():
                u = usage.setdefault(r["node"], {"cpus": 0, "mem_mb": 0, "gpus": 0, "jobs": []})
                u["cpus"] += r["cpus"]
                u["mem_mb"] += r["mem_mb"]
                u["gpus"] += len(r["gpu_ids"] or [])
                u["jobs"].append(int(r["job_id"]))
                if r["spare"]:  # held for the job as a hot spare (counts as used)
                    spare_for.setdefault(r["node"], []).append(int(r["job_id"]))
        for n in nodes:
            n["used"] = usage.get(n["name"], {"cpus": 0, "mem_mb": 0, "gpus": 0, "jobs": []})
            n["spare_for"] = sorted(spare_for.get(n["name"], []))
        return nodes

    def get_node(self, name: str) -> dict[str, Any]:
        for n in self.list_nodes():
            if n["name"] == name:
                return n
        raise NotFound(f"node {name} does not exist", node=name)

    def drain(self, name: str, reason: str, actor: str, *, now: bool = False) -> list[int]:
        """No new work on the node. With `now`, its requeue-able jobs also get their
        checkpoint signal and are requeued; the others run to their end. Returns the jobs
        being requeued."""
        if not reason.strip():
            raise InvalidSpec("drain needs a reason (--reason)", field="reason")
        with self.db.begin() as conn:
            row = conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().first()
            if row is None:
                raise NotFound(f"node {name} does not exist", node=name)
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == name)
                .values(drain=True, drain_reason=reason, drain_by=actor, drain_time=_now())
            )
            self._event(
                conn,
                "node.drain",
                f"drained{' now' if now else ''} by {actor}: {reason}",
                node=name,
                actor=actor,
            )
            if not now:
                return []
            return self._requeue_running_on(
                conn, name, f"requeue: node {name} drained by {actor}: {reason}", actor
            )

    def _requeue_running_on(self, conn: Connection, node: str, why: str, actor: str) -> list[int]:
        """Planned stop of the requeue-able jobs with a task on `node` (checkpoint, then requeue).

        A hot spare on the node is no reason to stop its job: nothing runs there, and a drained
        node is never used when the job restarts."""
        rows = conn.execute(
            select(s.attempts.c.id, s.attempts.c.nodes, s.attempts.c.job_id)
            .join(s.tasks, s.tasks.c.attempt_id == s.attempts.c.id)
            .where(
                s.tasks.c.node == node,
                s.tasks.c.spare.is_(False),
                s.attempts.c.state.in_([AttemptState.STARTING.value, AttemptState.RUNNING.value]),
            )
        ).all()
        requeued = []
        for r in rows:
            job = _JOB_SUMMARY_BY_ID.one(conn, {"id": r.job_id})
            if not job["requeue"] or job["attempt_id"] != r.id:
                continue
            conn.execute(
                update(s.attempts)
                .where(s.attempts.c.id == r.id)
                .values(state=AttemptState.STOPPING.value, stop_reason=why)
            )
            if job["state"] in (JobState.STARTING.value, JobState.RUNNING.value):
                self._set_job_state(conn, job, JobState.COMPLETING, why, actor=actor)
            self._bump_gen(conn, r.nodes)
            requeued.append(int(r.job_id))
        return requeued

    def apply_health(self, node: str, summary: dict[str, Any]) -> str | None:
        """Act on an agent's health summary; return a sentence when something changed.

        fail: drain (by `health:<check>`) and requeue its requeue-able jobs with a checkpoint;
        warn: drain only (no new work); ok: a node drained by a health check resumes. A node
        an operator drained stays drained whatever the checks say.
        """
        with self.db.begin() as conn:
            return self._apply_health(conn, node, summary)

    def _apply_health(self, conn: Connection, node: str, summary: dict[str, Any]) -> str | None:
        status = summary.get("status") or "ok"
        row = conn.execute(select(s.nodes).where(s.nodes.c.name == node)).mappings().first()
        if row is None:
            return None
        prev = (row["health"] or {}).get("status") or "ok"
        conn.execute(update(s.nodes).where(s.nodes.c.name == node).values(health=summary))
        by_health = (row["drain_by"] or "").startswith("health:")
        said = None
        if status in ("fail", "warn"):
            check = summary.get("check") or "health"
            reason = f"health check {check}: {summary.get('reason') or status}"
            if not row["drain"] or (by_health and row["drain_reason"] != reason):
                conn.execute(
                    update(s.nodes)
                    .where(s.nodes.c.name == node)
                    .values(
                        drain=True,
                        drain_reason=reason,
                        drain_by=f"health:{check}",
                        drain_time=_now(),
                    )
                )
                self._event(
                    conn,
                    "node.drain",
                    f"drained: {reason}",
                    node=node,
                    actor=node,
                    # a check turning to `fail` is a node failure (failure_history counts it)
                    data={
                        "drain_by": f"health:{check}",
                        "status": status,
                        "failure": status == "fail" and prev != "fail",
                    },
                )
                said = f"{node} drained: {reason}"
            if status == "fail" and prev != "fail":
                jobs = self._requeue_running_on(conn, node, f"requeue: {node} {reason}", node)
                if jobs:
                    said = f"{said or node}; requeueing jobs {jobs}"
        elif row["drain"] and by_health:
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == node)
                .values(drain=False, drain_reason=None, drain_by=None, drain_time=None)
            )
            self._event(
                conn,
                "node.resume",
                f"resumed: health checks pass again (was: {row['drain_reason']})",
                node=node,
                actor=node,
            )
            said = f"{node} resumed by its health checks"
        return said

    def resume(self, name: str, actor: str) -> None:
        with self.db.begin() as conn:
            row = conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().first()
            if row is None:
                raise NotFound(f"node {name} does not exist", node=name)
            if not row["drain"] and not row["down"]:
                raise InvalidTransition(f"node {name} is neither drained nor down", node=name)
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == name)
                .values(
                    drain=False,
                    drain_reason=None,
                    drain_by=None,
                    drain_time=None,
                    down=False,
                    down_reason=None,
                )
            )
            self._event(conn, "node.resume", f"resumed by {actor}", node=name, actor=actor)

    def mark_down(
        self, name: str, reason: str, fence: Fence | None, *, silent_for: float | None = None
    ) -> bool:
        """Declare a node DOWN and, in the same transaction, fail every task it runs (LOST;
        each attempt requeued or ended by its policy). One transaction, so no controller
        death, lost lease or store error between the two can leave a DOWN node with RUNNING
        tasks that nothing would ever fail. False (nothing written) when it already was DOWN.

        `silent_for` (the failure detector's verdict): only if the node's last heartbeat is
        still older than this many seconds (database clock) when the write happens. The
        detector reads the silent nodes first; a heartbeat another controller writes between
        that read and this write (a slow tick, a busy database) must keep the node up, as its
        agent's fence was freshened by that heartbeat's reply."""
        n = s.nodes.c
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            q = update(s.nodes).where(n.name == name, n.down.is_(False))
            if silent_for is not None:
                db_now = float(conn.execute(select(self.db.db_now_sql())).scalar_one())
                q = q.where(n.last_heartbeat < db_now - silent_for)
            res = conn.execute(q.values(down=True, down_reason=reason))
            if res.rowcount != 1:
                return False
            self._event(
                conn, "node.down", f"DOWN: {reason}", node=name, term=fence.term if fence else None
            )
            self._fail_node_tasks(conn, name, f"node {name} is DOWN: {reason}", fence)
            return True

    # ------------------------------------------------------------------ events & status
    def add_event(self, kind: str, message: str, **kw: Any) -> None:
        with self.db.begin() as conn:
            self._event(conn, kind, message, **kw)

    def events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        since_id: int = 0,
        limit: int = 1000,
        newest: bool = False,
    ) -> list[dict[str, Any]]:
        """Events after `since_id`, oldest first: the first `limit` of them, or with `newest`
        the last `limit` (a node page's recent history: the first thousand of a busy node's
        events are weeks old)."""
        order = s.events.c.id.desc() if newest else s.events.c.id
        q = select(s.events).where(s.events.c.id > since_id).order_by(order).limit(limit)
        if job_id is not None:
            q = q.where(s.events.c.job_id == job_id)
        if node is not None:
            q = q.where(s.events.c.node == node)
        with self.db.begin(write=False) as conn:
            rows = [dict(r) for r in conn.execute(q).mappings()]
        return rows[::-1] if newest else rows

    def node_events_between(
        self, nodes: Sequence[str], since: float, until: float, limit: int = 200
    ) -> list[dict[str, Any]]:
        """Events of these nodes stamped in [since, until], oldest first (`phalanx explain`:
        the drains and failures around an attempt's end)."""
        if not nodes:
            return []
        q = (
            select(s.events)
            .where(
                s.events.c.node.in_(sorted(set(nodes))),
                s.events.c.ts >= since,
                s.events.c.ts <= until,
            )
            .order_by(s.events.c.id)
            .limit(limit)
        )
        with self.db.begin(write=False) as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def cluster_counts(self) -> dict[str, Any]:
        with self.db.begin(write=False) as conn:
            by_state = {
                r.state: int(r.n)
                for r in conn.execute(
                    select(s.jobs.c.state, func.count().label("n")).group_by(s.jobs.c.state)
                )
            }
            n_nodes = conn.execute(select(func.count()).select_from(s.nodes)).scalar_one()
            down = conn.execute(
                select(func.count()).select_from(s.nodes).where(s.nodes.c.down.is_(True))
            ).scalar_one()
            drain = conn.execute(
                select(func.count()).select_from(s.nodes).where(and_(s.nodes.c.drain.is_(True)))
            ).scalar_one()
        return {
            "jobs": by_state,
            "nodes": {"total": int(n_nodes), "down": int(down), "drain": int(drain)},
        }

    def stale_starting_attempts(self, older_than: float) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            return [
                dict(r)
                for r in conn.execute(
                    select(s.attempts).where(
                        s.attempts.c.state == AttemptState.STARTING.value,
                        s.attempts.c.created_at < older_than,
                    )
                ).mappings()
            ]

    # ------------------------------------------------------------------ checkpoint interval
    def failure_history(
        self, now: float, window_s: float = checkpointing.FAILURE_WINDOW_S
    ) -> tuple[float, int]:
        """Node-seconds observed and node failures seen in the last `window_s` before `now`.

        Replayed from the node events (`checkpointing.node_history`): a node counts while it is
        registered and not DOWN; a failure is a DOWN transition (`mark_down`) or a health check
        turning to `fail` (the `node.drain` event `_apply_health` marks with `failure`).
        Operator and maintenance drains are not failures. Reads the events of the window (no
        index on kind): callers cache the result rather than ask per job per pass.
        """
        start = now - window_s
        state_kinds = sorted(checkpointing.UP_KINDS | {checkpointing.DOWN_KIND})
        cols = (s.events.c.id, s.events.c.ts, s.events.c.node, s.events.c.kind, s.events.c.data)
        latest = (
            select(func.max(s.events.c.id).label("id"))
            .where(
                s.events.c.kind.in_(state_kinds),
                s.events.c.ts < start,
                s.events.c.node.is_not(None),
            )
            .group_by(s.events.c.node)
            .subquery()
        )
        with self.db.begin(write=False) as conn:
            before = [
                dict(r)
                for r in conn.execute(
                    select(*cols).where(s.events.c.id.in_(select(latest.c.id)))
                ).mappings()
            ]
            during = [
                dict(r)
                for r in conn.execute(
                    select(*cols).where(
                        s.events.c.kind.in_(checkpointing.HISTORY_KINDS),
                        s.events.c.ts >= start,
                        s.events.c.ts <= now,
                        s.events.c.node.is_not(None),
                    )
                ).mappings()
            ]
        return checkpointing.node_history(before, during, start=start, now=now)

    def checkpoint_cost(
        self, job_id: int, samples: int = checkpointing.COST_SAMPLES
    ) -> float | None:
        """The job's measured checkpoint duration: the median over its latest `samples`
        checkpoints (`job.checkpoint` events, data `{path, finished_at, duration_s, seq}`),
        or the duration in jobs.checkpoint when no event has one; None when nothing was
        measured (a job that writes its marker by hand reports no duration)."""
        with self.db.begin(write=False) as conn:
            rows = [
                dict(r)
                for r in conn.execute(
                    select(s.events.c.data)
                    .where(s.events.c.job_id == job_id, s.events.c.kind == "job.checkpoint")
                    .order_by(s.events.c.id.desc())
                    .limit(samples * 16)  # a multi-node job may record one event per rank
                ).mappings()
            ]
            cost = checkpointing.median_cost(rows, samples)
            if cost is not None:
                return cost
            latest = conn.execute(
                select(s.jobs.c.checkpoint).where(s.jobs.c.id == job_id)
            ).scalar_one_or_none()
        return checkpointing.median_cost([{"data": latest}] if latest else [], samples)


def _submit_event(job_id: int, row: dict[str, Any], user: str, now: float) -> dict[str, Any]:
    held = " (held)" if row["state"] == JobState.HELD.value else ""
    return {
        "kind": "job.submit",
        "job_id": job_id,
        "actor": user,
        "message": f"submitted by {user} to {row['partitions']}{held}",
        "ts": now,
    }


# A job's --licenses text, read from its stored spec (no own column, so no migration).
_LICENSES_TEXT = s.jobs.c.spec["licenses"].as_string()
_LICENSES = _LICENSES_TEXT.label("licenses")
# pg_advisory_xact_lock key that serialises licence checks of concurrent start transactions
_LICENSE_LOCK = 0x5048584C4943  # "PHXLIC"


def _split_pending(
    got: Pending, now: float | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The mirror's pending rows as a pass wants them: the jobs eligible at `now` (None:
    all) in (--priority, id) order (the queue order without multifactor priority), the
    later ones whose reason does not say `BeginTime` yet, and those holding a restart
    reservation. Only the mirror's marked rows can be either of the last two: the whole
    queue is walked only to leave out the jobs not eligible yet, when there are any."""
    late = {
        int(j["id"])
        for j in got.marked
        if now is not None and j["eligible_time"] is not None and j["eligible_time"] > now
    }
    eligible = [j for j in got.rows if int(j["id"]) not in late] if late else got.rows
    not_yet = [
        {k: j[k] for k in ("id", "partitions", "eligible_time")}
        for j in got.marked
        if int(j["id"]) in late and not (j["reason"] or "").startswith(BEGIN)
    ]
    reservations = [_reservation(j) for j in got.marked if j["reserved_until"] is not None]
    _queue_sort(eligible)
    return eligible, not_yet, reservations


def _reservation(job: dict[str, Any]) -> dict[str, Any]:
    return {k: job[k] for k in ("id", "reserved_nodes", "reserved_until")}


_BY_ID = itemgetter("id")
_BY_PRIORITY = itemgetter("priority")


def _queue_sort(jobs: list[dict[str, Any]]) -> None:
    """Sort in (--priority descending, id) order: two stable sorts on keys read in C, several
    times faster than one on a Python key (100,000 pending jobs a pass)."""
    jobs.sort(key=_BY_ID)
    jobs.sort(key=_BY_PRIORITY, reverse=True)  # reverse=True keeps equal keys' order


def _topology_columns() -> list[Any]:
    """A job's topology options, read from its stored spec (domain/topology.py)."""
    spec = s.jobs.c.spec
    return [
        spec["switches"].as_integer().label("switches"),
        spec["switches_wait_s"].as_integer().label("switches_wait_s"),
        spec["spread"].as_string().label("spread"),
        spec["group"].as_string().label("group"),
        spec["anti_affinity"].as_string().label("anti_affinity"),
    ]


def _elastic_columns() -> list[Any]:
    """A job's elastic maximum and spare count, read from its stored spec (no own columns)."""
    return [
        s.jobs.c.spec["nodes_max"].as_integer().label("nodes_max"),
        s.jobs.c.spec["spares"].as_integer().label("spares"),
    ]


# what a scheduling pass reads of each pending job
_PENDING_COLUMNS = [*_JOB_SUMMARY, *_elastic_columns(), _LICENSES, *_topology_columns()]


def _pending_mirror(dialect: str) -> PendingMirror:
    """A mirror of `_PENDING_COLUMNS`, read as this database reads them fastest. PostgreSQL
    parses a `json` column's whole text for each `->>`: eight keys of a 1 KB spec cost 40 us
    a row, 4 s for 100,000 pending jobs; `json_to_record` parses it once for all eight (5x
    less). SQLite keeps a parsed document for the next `json_extract` of the same text."""
    if dialect != "postgresql":
        return PendingMirror(_PENDING_COLUMNS)
    summary = {c.name for c in _JOB_SUMMARY}
    keys = [c for c in _PENDING_COLUMNS if c.name not in summary]
    record = (
        func.json_to_record(s.jobs.c.spec)
        .table_valued(*(column(c.name, c.type) for c in keys))
        .render_derived(with_types=True)
        .lateral()
    )
    return PendingMirror(
        [*_JOB_SUMMARY, *(record.c[c.name] for c in keys)], s.jobs.join(record, true())
    )


def _attempt_token() -> str:
    """A new attempt's token: 128 random bits behind the time of its making.

    The token is the attempt's secret (a report with a wrong one is ignored) and is unique in
    the store. Random bits alone would put every start's entry in that unique index at a random
    leaf of a B-tree as large as the history kept, a page read from disk per start once the
    index outgrows the cache; the millisecond prefix makes new tokens sort after old ones, so
    their entries append at the end, where the pages are already in memory.
    """
    return f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(16)}"


def _rank_nodes(st: Mapping[str, Any]) -> list[str]:
    """The nodes of a start item that run the job (the trailing `spares` ones do not)."""
    nodes = list(st["nodes"])
    return nodes[: len(nodes) - int(st.get("spares") or 0)]


def _spares_text(st: Mapping[str, Any]) -> str:
    spares = list(st["nodes"])[len(_rank_nodes(st)) :]
    return f" with spares {','.join(spares)}" if spares else ""


HOLD_USER, HOLD_ADMIN = "user", "admin"  # jobs.hold_kind (migration 0013)


def _hold_columns(actor: str, admin: bool, held: bool = True) -> dict[str, Any]:
    """jobs.held_by/hold_kind for a hold `actor` places (`admin`: an operator or admin), or
    cleared (`held` false: a release, a requeue that does not hold)."""
    if not held:
        return {"held_by": None, "hold_kind": None}
    return {"held_by": actor, "hold_kind": HOLD_ADMIN if admin else HOLD_USER}
