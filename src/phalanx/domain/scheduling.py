"""One scheduling pass as a pure function: snapshot in, plan out.

The controller's loop reads a `SchedSnapshot` from the store, calls `plan`, and applies the plan
in one fenced transaction. Nothing here reads a clock or touches I/O, so every rule (dependency
verdicts, array concurrency limits, singleton, placement) is unit-testable on plain data.
"""

from __future__ import annotations

import fnmatch
import functools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any

from phalanx.domain import licenses, maintenance, reservations, topology, values
from phalanx.domain.deps import DepVerdict, evaluate
from phalanx.domain.placement import place
from phalanx.domain.placement_fit import usable_in_cluster
from phalanx.domain.placement_state import Cluster
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView, Placement
from phalanx.domain.priority import Queue, QueuePolicy

# How many pending jobs, in queue order, one pass examines for a start (Slurm's
# default_queue_depth / bf_max_job_test, Armada's maxQueueLookback); config cluster.queue_depth
# (its default is this value; tests/unit/test_config.py holds them equal).
DEFAULT_QUEUE_DEPTH = 1000

BEGIN = "BeginTime"  # the reason of a job before its begin time (--begin, a retry's backoff)


def begin_reason(eligible_at: float) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(eligible_at))
    return f"{BEGIN} (not before {when})"


# The reason of a job waiting for nodes held for it (a restart after a node failure, or the
# nodes of the jobs it preempts, docs/preemption.md)
RESERVED = "Reserved (waits for the nodes held for it: a restart or a preemption)"


@dataclass
class Plan:
    starts: list[Placement] = field(default_factory=list)
    never: list[tuple[int, str]] = field(default_factory=list)  # (job id, why it can never run)
    reasons: dict[int, str] = field(default_factory=dict)  # why a pending job still waits
    # ids of the jobs behind the queue depth, not examined this pass (reason Priority); in
    # queue order only when the pass sorted the whole queue (QueuePolicy.queue)
    beyond: list[int] = field(default_factory=list)

    def sentence(self) -> str:
        return (
            f"started {len(self.starts)} jobs, {len(self.reasons)} waiting, "
            f"{len(self.never)} can never run"
        )


def node_partitions(node: str, partitions: Iterable[dict[str, Any]]) -> frozenset[str]:
    """Partitions whose node pattern (globs, comma separated) matches this node name."""
    return _matching(node, _patterns(partitions))


def _patterns(partitions: Iterable[dict[str, Any]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple(
        (str(p["name"]), tuple(x.strip() for x in str(p["nodes"]).split(",") if x.strip()))
        for p in partitions
    )


@functools.lru_cache(maxsize=1 << 17)
def _matching(node: str, patterns: tuple[tuple[str, tuple[str, ...]], ...]) -> frozenset[str]:
    """node_partitions, remembered: the partitions and the node names seldom change, and a
    pass over 10,000 nodes would otherwise run every glob against every name each time."""
    return frozenset(
        name for name, pats in patterns if any(fnmatch.fnmatchcase(node, pat) for pat in pats)
    )


def node_views(
    nodes: list[dict[str, Any]],
    partitions: dict[str, dict[str, Any]],
    topo: topology.Layout | None = None,
) -> list[NodeView]:
    """Nodes as placement sees them; ``topo``: their places in the tree (config, or what
    each agent reported at register, in the row's ``topology``).

    A node's view depends only on its row's `_VIEW_COLUMNS`, the partitions and the
    topology: the views of the last call are kept, and a node whose row reads the same
    (one itemgetter and one tuple comparison, mostly identity checks) gets its view back
    instead of a new one; at 10,000 nodes that is most of the cost of this function."""
    patterns = _patterns(partitions.values())
    try:
        rows = list(map(_VIEW_ROW, nodes))
    except KeyError:  # a hand-made row without every column
        return _node_views(nodes, patterns, topo)
    with _VIEWS_LOCK:
        known_patterns, known_topo, known = _VIEWS[0]
    if known_patterns != patterns or known_topo is not topo:
        known = {}
    views: list[NodeView] = []
    fresh: dict[str, tuple[tuple[Any, ...], NodeView]] = {}
    for row, n in zip(rows, nodes, strict=True):
        got = known.get(row[0])
        same = got is not None and got[0] == row
        view = got[1] if got is not None and same else _node_views([n], patterns, topo)[0]
        fresh[row[0]] = (row, view)
        views.append(view)
    with _VIEWS_LOCK:
        _VIEWS[0] = (patterns, topo, fresh)
    return views


_VIEW_COLUMNS = ("name", "cpus", "mem_mb", "gpus", "features", "registered", "down", "drain")
_VIEW_ROW = itemgetter(*_VIEW_COLUMNS, "topology")
_VIEWS: list[tuple[Any, Any, dict[str, tuple[tuple[Any, ...], NodeView]]]] = [((), None, {})]
_VIEWS_LOCK = threading.Lock()  # the scheduling loop and `explain` (API threads) share it


def _node_views(
    nodes: list[dict[str, Any]],
    patterns: tuple[tuple[str, tuple[str, ...]], ...],
    topo: topology.Layout | None,
) -> list[NodeView]:
    return [
        NodeView(
            name=n["name"],
            cpus=int(n["cpus"]),
            mem_mb=int(n["mem_mb"]),
            gpus=tuple((int(i), str(t)) for i, t in (n["gpus"] or [])),
            features=frozenset(n["features"] or []),
            partitions=_matching(n["name"], patterns),
            schedulable=bool(n["registered"]) and not n["down"] and not n["drain"],
            place=topo.place(n["name"], n.get("topology")) if topo is not None else (),
        )
        for n in nodes
    ]


def resolved_request(resolved: Any) -> JobRequest:
    """The placement request of a job not stored yet (a spec.ResolvedJob), for submit checks."""
    return job_request(resolved_fields(resolved))


def resolved_fields(resolved: Any) -> dict[str, Any]:
    """What of a ResolvedJob placement looks at (a job row's columns), and nothing else."""
    return {
        "id": 0,
        "partitions": ",".join(resolved.partitions),
        "nodes": resolved.nodes,
        "cpus_per_node": resolved.cpus_per_node,
        "mem_per_node_mb": resolved.mem_per_node_mb,
        "gpus_per_node": resolved.gpus_per_node,
        "gpu_type": resolved.gpu_type,
        "exclusive": resolved.exclusive,
        "constraint_expr": resolved.constraint,
        "nodelist": resolved.nodelist,
        "exclude": resolved.exclude,
        "time_limit_s": resolved.time_limit_s,
        "nodes_max": getattr(resolved, "nodes_max", None),
        "spares": getattr(resolved, "spares", 0),
        "licenses": getattr(resolved, "licenses", None),
        "switches": getattr(resolved, "switches", None),
        "spread": getattr(resolved, "spread", None),
        "group": getattr(resolved, "group", None),
        "anti_affinity": getattr(resolved, "anti_affinity", None),
    }


def job_request(job: dict[str, Any]) -> JobRequest:
    expr = job["constraint_expr"]

    def _pred(features: frozenset[str], expr: str | None = expr) -> bool:
        return expr is None or values.constraint_matches(expr, features)

    return JobRequest(
        job_id=int(job["id"]),
        partitions=tuple(job["partitions"].split(",")),
        nodes=int(job["nodes"]),
        cpus_per_node=int(job["cpus_per_node"]),
        mem_per_node_mb=int(job["mem_per_node_mb"]),
        gpus_per_node=int(job["gpus_per_node"]),
        gpu_type=job["gpu_type"],
        exclusive=bool(job["exclusive"]),
        constraint=_pred if expr else None,
        nodelist=tuple(job["nodelist"] or ()),
        exclude=tuple(sorted(set(job["exclude"] or ()) | set(job.get("avoid_nodes") or ()))),
        time_limit_s=job["time_limit_s"],
        nodes_max=int(job["nodes_max"]) if job.get("nodes_max") else None,
        spares=int(job.get("spares") or 0),
        licenses=license_request(job.get("licenses")),
        switches=int(job["switches"]) if job.get("switches") else None,
        spread=job.get("spread") or None,
        group=job.get("group") or None,
        anti_affinity=job.get("anti_affinity") or None,
        constraint_key=expr or None,
    )


def avoid_cluster(views: list[NodeView], nodes: list[dict[str, Any]]) -> Cluster:
    """The nodes `soft_avoid` counts: the schedulable ones, and those DOWN but not drained,
    which come back when their agent does (a drained node is an operator's decision, which
    may last)."""
    returning = {
        n["name"] for n in nodes if n.get("registered") and n.get("down") and not n.get("drain")
    }
    return Cluster([replace(v, schedulable=True) if v.name in returning else v for v in views])


def soft_avoid(job: dict[str, Any], req: JobRequest, cluster: Cluster) -> JobRequest:
    """The job's avoid list (the nodes its failures happened on) is soft (docs/retries.md):
    while the nodes it leaves in `cluster` (`avoid_cluster`) could never hold the job (nodes,
    spares), the job is placed as if it had none, rather than wait for ever. The list is
    checked when it grows (store/attempts.py `_avoidable`), but a node drained since can
    leave too few: after failures on two of four nodes and a drain of a third, the job
    waited "Resources" with the fourth node free until an operator resumed the drained one.
    A node merely DOWN counts as one the job may wait for: it comes back with its agent, and
    the failed node it would replace may fail the job again."""
    if len(usable_in_cluster(req, cluster)) >= req.nodes + req.spares:
        return req
    return replace(req, exclude=tuple(sorted(set(job["exclude"] or ()))))


# Slurm's max_switch_wait default: how long --switches=N without @TIME holds out for N switches
DEFAULT_SWITCH_WAIT_S = 300


def switch_wait_over(job: dict[str, Any], now: float) -> bool:
    """Whether a --switches=N[@TIME] job has waited TIME (default 300 s; -1: for ever) since
    it was submitted: its switch count is then ignored, as Slurm does."""
    wait = job.get("switches_wait_s")
    wait = DEFAULT_SWITCH_WAIT_S if wait is None else int(wait)
    if wait < 0:
        return False  # --switches=N@UNLIMITED: waits for its switches for ever
    submitted = job.get("submit_time")
    return submitted is not None and now - float(submitted) >= wait


def license_request(text: str | None) -> tuple[tuple[str, int], ...]:
    """A stored --licenses text as placement's sorted (name, count) pairs; () for none."""
    if not text:
        return ()
    return tuple(sorted(licenses.parse_licenses(text).items()))


def live_reservation(job: dict[str, Any], now: float) -> tuple[str, ...]:
    """The job's restart reservation (rank order, then spares) if it has not run out."""
    nodes = job.get("reserved_nodes")
    until = job.get("reserved_until")
    if not nodes or until is None or until <= now:
        return ()
    return tuple(str(n) for n in nodes)


def allocations(rows: Iterable[dict[str, Any]]) -> list[Allocation]:
    """What running work holds, as placement takes it, from a snapshot's allocation rows."""
    return [
        Allocation(
            job_id=int(a["job_id"]),
            node=a["node"],
            cpus=int(a["cpus"]),
            mem_mb=int(a["mem_mb"]),
            gpu_ids=tuple(a["gpu_ids"] or ()),
            exclusive=bool(a["exclusive"]),
            expected_end=a["expected_end"],
        )
        for a in rows
    ]


def plan(
    snap: Any,
    now: float,
    *,
    backfill: bool = True,
    policy: QueuePolicy | None = None,
    license_totals: dict[str, int] | None = None,
    topo: topology.Layout | None = None,
    queue_depth: int | None = None,
) -> Plan:
    """Decide which pending jobs start where (snap: a store.SchedSnapshot).

    With a `policy` (multifactor priority and limits, domain/priority.py) the pending jobs are
    taken in its order and jobs over a limit wait with the limit's reason; without one, in the
    snapshot's order. ``license_totals``: the cluster's licence counts (config
    ``cluster.licenses``); the ones in use are the snapshot's ``licenses_held`` (one request
    text per attempt that holds its resources). ``topo``: the topology layout (config
    ``topology``); the snapshot's ``groups_active`` (job id -> --group of jobs holding nodes)
    feeds --anti-affinity.

    ``queue_depth`` (config ``cluster.queue_depth``; None: no bound): at most this many jobs,
    in queue order, are examined for a start or a backfill reservation; the ones behind them
    are not looked at this pass and wait with reason ``Priority`` (Slurm's
    ``default_queue_depth``). Jobs skipped before the depth is reached (BeginTime, a
    dependency, a limit, an array's task limit) do not count against it.
    """
    out = Plan()
    for row in getattr(snap, "not_yet", None) or []:  # not read whole before their time
        out.reasons[int(row["id"])] = begin_reason(float(row["eligible_time"]))
    depth = len(snap.pending) if queue_depth is None else max(1, queue_depth)
    # the head of the queue in order, the rest only if the pass reaches it (QueuePolicy.queue)
    queue = policy.queue(snap, now, depth) if policy else Queue(snap.pending)
    holding = policy.holding(snap) if policy else None
    views = node_views(snap.nodes, snap.partitions, topo)
    allocs = allocations(snap.allocations)
    array_active = dict(snap.array_active)
    names_taken = set(snap.active_names)
    keep_off = maintenance.KeepOff(getattr(snap, "maintenance", None) or [], now)
    gate = reservations.Gate(getattr(snap, "resv", None) or [], now, [v.name for v in views])
    eligible: list[JobRequest] = []
    examined: dict[int, dict[str, Any]] = {}
    cluster: Cluster | None = None  # for soft_avoid, built for the first avoid list
    while True:
        if len(eligible) >= depth:  # beyond the lookahead: not examined this pass
            out.beyond = queue.rest_ids()
            out.reasons.update(dict.fromkeys(out.beyond, "Priority"))
            break
        job = queue.take()
        if job is None:
            break
        jid = int(job["id"])
        examined[jid] = job
        key = (job["name"], job["user"])
        eligible_at = job.get("eligible_time")
        if eligible_at and eligible_at > now:
            out.reasons[jid] = begin_reason(eligible_at)
            continue
        singleton = any(d["type"] == "singleton" for d in job["dependency"])
        verdict, why = evaluate(
            job["dependency"],
            snap.dep_states,
            started=snap.dep_started,
            singleton_busy=singleton and key in names_taken,
        )
        if verdict is DepVerdict.NEVER:
            out.never.append((jid, why or "dependency can never be satisfied"))
            continue
        if verdict is DepVerdict.WAIT:
            out.reasons[jid] = why or "Dependency"
            continue
        if policy and holding is not None:
            over = policy.blocker(job, holding)
            if over:
                out.reasons[jid] = over
                continue
        req = job_request(job)
        if job.get("avoid_nodes"):
            cluster = cluster or avoid_cluster(views, snap.nodes)
            req = soft_avoid(job, req, cluster)
        req, waits = gate.admit(keep_off.restrict(req), job.get("reservation"))
        if waits:
            out.reasons[jid] = waits
            continue
        arr = job["array_job_id"]
        if arr is not None and job["array_limit"]:
            if array_active.get(int(arr), 0) >= int(job["array_limit"]):
                out.reasons[jid] = f"JobArrayTaskLimit ({job['array_limit']} running at most)"
                continue
            # optimistic: counts as active if placed; corrected below if not placed
            array_active[int(arr)] = array_active.get(int(arr), 0) + 1
        if singleton:
            names_taken.add(key)
        if req.switches is not None and switch_wait_over(job, now):
            req = replace(req, switches=None)
        reserved = live_reservation(job, now)
        if reserved:
            req = replace(req, reserved=reserved)
        eligible.append(req)
    # reservations of jobs this pass does not schedule (another partition's lease holder)
    others: dict[str, int] = {}
    for r in getattr(snap, "reservations", None) or []:
        for name in live_reservation(r, now):
            others.setdefault(name, int(r["id"]))
    held = licenses.held(
        dict(license_request(t)) for t in getattr(snap, "licenses_held", None) or []
    )
    pool = licenses.Pool(license_totals or {}, held)
    placed = place(
        eligible,
        views,
        allocs,
        now,
        backfill=backfill,
        reserved_nodes=others,
        licenses=pool,
        levels=topo.levels if topo is not None else (),
        groups=getattr(snap, "groups_active", None),
    )
    if policy and holding is not None:
        placed = _within_limits(placed, examined, policy, holding, out.reasons)
    placed_ids = {p.job_id for p in placed}
    out.starts = placed
    first_blocked = True
    for req in eligible:
        if req.job_id in pool.blocked:
            out.reasons[req.job_id] = "Licenses"
        elif req.job_id not in placed_ids and req.reserved:
            out.reasons[req.job_id] = RESERVED
        elif req.job_id not in placed_ids and req.job_id not in out.reasons:  # not over a limit
            out.reasons[req.job_id] = "Resources" if first_blocked else "Priority"
            first_blocked = False
    if keep_off.blocked or gate.blocked:
        exclusive = {p.job_id: bool(examined[p.job_id]["exclusive"]) for p in placed}
        out.reasons.update(keep_off.reasons(out.reasons, placed, views, allocs, exclusive))
        out.reasons.update(gate.reasons(out.reasons, placed, views, allocs, exclusive))
    return out


def _within_limits(
    placed: list[Placement],
    by_id: dict[int, dict[str, Any]],
    policy: QueuePolicy,
    holding: Any,
    reasons: dict[int, str],
) -> list[Placement]:
    """Keep the placements that fit the limits, counted in start order (several jobs of one
    user may each fit alone but not together); the others wait with the limit's reason.
    ``by_id``: the job rows the pass examined (every placed job is one)."""
    kept = []
    for p in placed:
        job = by_id[p.job_id]
        over = policy.blocker(job, holding)
        if over:
            reasons[p.job_id] = over
            continue
        policy.take(job, holding)
        kept.append(p)
    return kept
