"""The scheduler's reads and writes: the snapshot a pass plans on, and the starts it makes.

`sched_snapshot` reads what a pass needs (pending jobs through the pending mirror, nodes,
allocations, windows, limits); `start_attempts` writes the plan's starts under the caller's
fence, checking again inside the transaction that each still fits its nodes (the capacity
rule of `domain.placement.NodeUsage`) and its licences, since the plan was made on a
snapshot another partition's scheduler may have changed since.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    column,
    func,
    insert,
    select,
    text,
    true,
    update,
)

from phalanx.domain import licenses
from phalanx.domain.placement import NodeUsage
from phalanx.domain.scheduling import BEGIN
from phalanx.domain.states import (
    ACTIVE,
    AttemptState,
    JobState,
    TaskState,
)
from phalanx.store import schema as s
from phalanx.store.attempts import _elastic_columns
from phalanx.store.configs import latest_config_version
from phalanx.store.fairshare import FairShareUsage
from phalanx.store.maintenance import MaintenanceWindows
from phalanx.store.pending import Pending, PendingMirror
from phalanx.store.prebuilt import Prebuilt
from phalanx.store.reservations import RESERVATION_OF_JOB, Reservations
from phalanx.store.sqlbits import JOB_SUMMARY as _JOB_SUMMARY
from phalanx.store.sqlbits import Fence, attempt_holds, literal_in
from phalanx.store.sqlbits import active_tasks as _active_tasks
from phalanx.store.sqlbits import chunks as _chunks
from phalanx.store.sqlbits import now as _now


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
    # reservations (`scontrol create reservation`) that have not ended (rows of `reservations`)
    resv: list[dict[str, Any]] = field(default_factory=list)
    # pending jobs before their begin time whose reason does not say so yet (sched_snapshot)
    not_yet: list[dict[str, Any]] = field(default_factory=list)
    # jobs holding resources (for limits): user, account, qos, nodes, gpus_per_node
    active_jobs: list[dict[str, Any]] = field(default_factory=list)
    # the --licenses text of every attempt that holds its resources (not ENDED)
    licenses_held: list[str] = field(default_factory=list)
    # the cluster configuration version current when it was read (store/configs.py): the
    # partitions above are that version's
    config_version: int | None = None
    # job id -> --group of every job with an attempt that holds its nodes (anti-affinity)
    groups_active: dict[int, str] = field(default_factory=dict)
    # True: no pending job at all for this pass (nothing else was read; see sched_snapshot)
    quiet: bool = False


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


# what a scheduling pass reads of each pending job
_PENDING_COLUMNS = [
    *_JOB_SUMMARY,
    *_elastic_columns(),
    _LICENSES,
    *_topology_columns(),
    RESERVATION_OF_JOB.label("reservation"),
]


# The statements of every scheduling pass's snapshot, built once and run through the driver
# (store/prebuilt.py): built and executed through SQLAlchemy each pass, their statement
# objects, cache keys and execution contexts were most of a small cluster's snapshot, 2.5 ms
# of CPU for 13 statements (a pass at most every scheduler_min_gap, on every submission).
_NODES = Prebuilt(select(s.nodes).order_by(s.nodes.c.name))
_PARTITIONS = Prebuilt(select(s.partitions))
_ALLOCATIONS = Prebuilt(
    _active_tasks(
        s.tasks.c.node,
        s.tasks.c.cpus,
        s.tasks.c.mem_mb,
        s.tasks.c.gpu_ids,
        s.tasks.c.exclusive,
        s.attempts.c.job_id,
        s.attempts.c.expected_end,
    )
)
# every job in an active state, once: its name (singleton dependencies), array (%N
# throttles) and what limits count (`_LIMIT_KEYS`)
_ACTIVE_JOBS = Prebuilt(
    select(
        s.jobs.c.id,
        s.jobs.c.name,
        s.jobs.c.user,
        s.jobs.c.array_job_id,
        s.jobs.c.account,
        s.jobs.c.qos,
        s.jobs.c.nodes,
        s.jobs.c.gpus_per_node,
    ).where(literal_in(s.jobs.c.state, (state.value for state in ACTIVE)))
)
_HOLDING_JOBS = s.attempts.join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
_GROUP_TEXT = s.jobs.c.spec["group"].as_string()
_GROUPS_ACTIVE = Prebuilt(
    select(s.attempts.c.job_id, _GROUP_TEXT.label("group"))
    .select_from(_HOLDING_JOBS)
    .where(attempt_holds(), _GROUP_TEXT.is_not(None))
)
_LICENSES_HELD = Prebuilt(
    select(_LICENSES_TEXT.label("licenses"))
    .select_from(_HOLDING_JOBS)
    .where(attempt_holds(), _LICENSES_TEXT.is_not(None))
)


# what limits count of each active job (domain/priority.py): user, account, qos, nodes, GPUs
_LIMIT_KEYS = ("id", "user", "account", "qos", "nodes", "gpus_per_node")


def _active_summary(
    rows: list[dict[str, Any]],
) -> tuple[set[tuple[str, str]], dict[int, int], list[dict[str, Any]]]:
    """From the active jobs' rows: their (name, user) pairs, the count of each array's
    active tasks, and the rows limits count (id, user, account, qos, nodes, gpus_per_node)."""
    names = {(r["name"], r["user"]) for r in rows}
    arrays: dict[int, int] = {}
    for r in rows:
        if r["array_job_id"] is not None:
            arrays[int(r["array_job_id"])] = arrays.get(int(r["array_job_id"]), 0) + 1
    limits = [{k: r[k] for k in _LIMIT_KEYS} for r in rows]
    return names, arrays, limits


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


class SchedulingReads(MaintenanceWindows, Reservations, FairShareUsage):
    """The scheduler's reads and writes."""

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
            nodes = _NODES.rows(conn, {})
            parts = {r["name"]: r for r in _PARTITIONS.rows(conn, {})}
            allocs = _ALLOCATIONS.rows(conn, {})
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
            active_names, array_active, active_jobs = _active_summary(_ACTIVE_JOBS.rows(conn, {}))
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
                resv=self._live_reservations(conn),
                active_jobs=active_jobs,
                licenses_held=self._licenses_held(conn),
                config_version=latest_config_version(conn),
                groups_active=self._groups_active(conn),
            )

    @staticmethod
    def _groups_active(conn: Connection) -> dict[int, str]:
        """The --group of every job with an attempt that still holds its nodes."""
        return {
            int(r["job_id"]): str(r["group"]) for r in _GROUPS_ACTIVE.rows(conn, {}) if r["group"]
        }

    def licenses_in_use(self) -> dict[str, int]:
        """Licence name -> count held by attempts that hold their nodes."""
        with self.db.begin(write=False) as conn:
            return licenses.held(licenses.parse_licenses(t) for t in self._licenses_held(conn))

    @staticmethod
    def _licenses_held(conn: Connection) -> list[str]:
        """The --licenses text of every attempt that still holds its resources: a licence is
        given back when the attempt ENDS, not when the job leaves RUNNING."""
        return [str(r["licenses"]) for r in _LICENSES_HELD.rows(conn, {}) if r["licenses"]]

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
