"""The blocked head's reservation (EASY backfill; steps 3 to 5 of `placement.place`).

`reserve` finds the earliest time the highest-priority job that does not fit now would fit,
replaying the known ends of running work in time order, and the *shadow* state at that time
with the head placed in it; the pass lets later jobs start only where they cannot delay it.
It is a module of its own because the explanation of a waiting job
(`placement_reasons.earliest_start`) asks the scheduler's very question.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from phalanx.domain.placement_fit import fit_node, statically_eligible, try_partitions
from phalanx.domain.placement_state import Cluster, Hold, State
from phalanx.domain.placement_types import JobRequest, Placement

__all__ = ["Reservation", "holds_of", "reserve"]


def holds_of(p: Placement, exclusive: bool, end: float | None) -> list[Hold]:
    return [
        Hold(node, p.cpus_per_node, mem, gpus, exclusive, end)
        for node, mem, gpus in zip(p.nodes, p.mem_per_node_mb, p.gpu_ids, strict=True)
    ]


@dataclass(slots=True)
class Reservation:
    start: float
    shadow: State  # usage at ``start`` including the head job and long backfilled jobs
    head: tuple[str, ...] = ()  # the head's nodes in it


def reserve(
    job: JobRequest,
    cluster: Cluster,
    state: State,
    holds: Iterable[Hold],
    now: float,
    *,
    fast: bool = True,
) -> Reservation | None:
    """Earliest time the head job fits, replaying known ends in time order; None if never.

    With ``fast`` (and no --nodelist or topology) the same answer from `_reserve_by_node`:
    one sweep of the ends re-checking only the node each frees, instead of a placement
    attempt at every end time.

    Work whose ``expected_end`` has already passed is still running (overdue); it is assumed to
    end "now" at the earliest, since time-limit enforcement is about to end it. An elastic job
    is reserved at its minimum size.
    """
    if job.nodes_max is not None:
        job = replace(job, nodes_max=None)
    holds = list(holds)
    independent = not job.nodelist and job.switches is None and job.spread is None
    if fast and independent and not cluster.places and job.nodes >= 1:
        return _reserve_by_node(job, cluster, state, holds, now)
    timed = sorted(
        ((max(h.end, now), i, h) for i, h in enumerate(holds) if h.end is not None),
        key=lambda e: (e[0], e[1]),
    )
    sim = state.copy()
    i = 0
    while i < len(timed):
        t = timed[i][0]
        while i < len(timed) and timed[i][0] == t:
            sim.remove(timed[i][2])
            i += 1
        p = try_partitions(job, cluster, sim)
        if p is not None:
            for h in holds_of(p, job.exclusive, None):
                sim.add(h)
            return Reservation(t, sim, p.nodes)
    return None


def _reserve_by_node(
    job: JobRequest, cluster: Cluster, state: State, holds: list[Hold], now: float
) -> Reservation | None:
    """`reserve` when nodes fit independently (no --nodelist, no topology): the job fits at
    time t iff ``nodes + spares`` candidate nodes of one of its partitions can each take a
    rank once the work ending by t has ended. So the ends of the work on candidate nodes are
    swept once in time order, each only re-checking its own node, counting the nodes that
    have become free per partition, and the sweep stops at the first end where a partition
    has enough: the start. O(candidates + holds up to the start), where the replay tries a
    whole placement at every distinct end. The shadow state (usage at the start, with the
    head placed) is then built as the replay builds it.
    """
    need = job.nodes + max(0, job.spares)
    parts_of: dict[str, list[str]] = {}  # candidate node -> the job's partitions it is in
    for partition in dict.fromkeys(job.partitions):
        for node in cluster.by_partition.get(partition, ()):
            if statically_eligible(job, node):
                parts_of.setdefault(node.name, []).append(partition)
    count = dict.fromkeys(job.partitions, 0)
    free: set[str] = set()
    for name in parts_of:
        if fit_node(job, cluster.by_name[name], state.get(name)) is not None:
            free.add(name)
            for partition in parts_of[name]:
                count[partition] += 1
    if any(c >= need for c in count.values()):
        return None  # it fits now, which the caller has ruled out
    timed = sorted(
        (max(h.end, now), i, h)
        for i, h in enumerate(holds)
        if h.end is not None and h.node in parts_of and h.node not in free
    )
    sim: dict[str, State] = {}
    start: float | None = None
    i = 0
    while i < len(timed) and start is None:
        t = timed[i][0]
        while i < len(timed) and timed[i][0] == t:
            h = timed[i][2]
            i += 1
            if h.node in free:
                continue
            one = sim.get(h.node)
            if one is None:
                one = sim[h.node] = State({h.node: state.get(h.node).copy()})
            one.remove(h)
            if fit_node(job, cluster.by_name[h.node], one.get(h.node)) is not None:
                free.add(h.node)
                for partition in parts_of[h.node]:
                    count[partition] += 1
        if any(c >= need for c in count.values()):
            start = t
    if start is None:
        return None  # the known ends never free enough nodes
    shadow = state.copy()
    for h in holds:
        if h.end is not None and max(h.end, now) <= start:
            shadow.remove(h)
    p = try_partitions(job, cluster, shadow)
    if p is None:
        return None  # cannot happen: `need` nodes of a partition are free at `start`
    for h in holds_of(p, job.exclusive, None):
        shadow.add(h)
    return Reservation(start, shadow, p.nodes)
