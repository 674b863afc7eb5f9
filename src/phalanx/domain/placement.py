"""Pure placement decision: which pending jobs start now, on which nodes, with which devices.

Everything here is a function of its arguments (a snapshot of nodes, running allocations and the
eligible jobs in priority order, plus ``now``). There is no I/O and no clock read, so the
scheduler loop can apply the returned placements in one transaction and tests can replay any
situation exactly. The same input always yields the same output: every choice between equal
candidates is broken by a stable key (natural node-name order, then device index, then type name).

Algorithm of :func:`place` (EASY backfill):

1. Usage per node starts as the sum of the running allocations.
2. Jobs are taken in the given (priority) order. A job that fits now is placed and its usage is
   added, so later jobs see it.
3. The first job that does not fit now, but would fit on the idle schedulable cluster, is the
   *blocked head*. Its reservation is computed by replaying the known ``expected_end`` of running
   work (allocations and placements made in this call) in time order until it fits; that gives a
   start time ``t_res`` and a *shadow* state: the usage at ``t_res`` with the head placed in it.
4. A later job may start now only if it cannot delay the head: either it ends by ``t_res``
   (``now + time_limit_s <= t_res``), or it fits both now and in the shadow state at once (it
   only uses resources the head will not need). Jobs without a time limit are always in the second
   case. Only the head gets a reservation; other jobs that do not fit are simply skipped.
5. If no reservation can be computed (the head needs resources held by work with no known end),
   every node the head could ever use is closed to later jobs, so the head cannot be starved.
6. Jobs that would not fit even on the idle schedulable cluster (their nodes are drained, or the
   request is impossible) are skipped without blocking anybody: holding the queue for them would
   stall the whole cluster for a job that cannot run anyway.

The pieces live beside this module: the data it takes and returns (placement_types), node usage
and the cluster's node classes (placement_state), whether a job fits and where
(placement_fit), the head's reservation (placement_backfill), and the same rules worded for
people (placement_reasons). This module holds the pass itself and `NodeUsage`, the store's
re-check of chosen placements when it starts them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from phalanx.domain import topology
from phalanx.domain.licenses import Pool
from phalanx.domain.placement_backfill import Reservation, holds_of, reserve
from phalanx.domain.placement_fit import (
    NodeFit,
    classable,
    fit_classes,
    job_shape,
    place_reserved,
    try_partitions,
    usable_in_cluster,
)
from phalanx.domain.placement_state import (
    ClassKey,
    Cluster,
    Hold,
    Index,
    State,
    holding,
    merged,
    shares,
)
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView, Placement

__all__ = ["NodeUsage", "place"]


class NodeUsage:
    """What live work holds on some nodes, for re-checking chosen placements (the start
    transaction's check, under the node rows' locks, that nothing changed since the plan):
    the same rule as placement's, applied to placements already chosen."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = State()

    def add(
        self, node: str, cpus: int, mem_mb: int, gpu_ids: Iterable[int], exclusive: bool
    ) -> None:
        self._state.add(Hold(node, cpus, mem_mb, tuple(gpu_ids), exclusive, None))

    def fits(
        self,
        node: str,
        total_cpus: int,
        total_mem_mb: int,
        cpus: int,
        mem_mb: int,
        gpu_ids: Iterable[int],
        exclusive: bool,
    ) -> bool:
        """Whether one more holder of ``cpus``/``mem_mb`` and these GPU devices fits ``node``
        (of ``total_cpus``/``total_mem_mb``) beside what it holds."""
        u = self._state.get(node)
        return (
            shares(u, exclusive)
            and u.cpus + cpus <= total_cpus
            and u.mem + mem_mb <= total_mem_mb
            and not any(u.gpus.get(g) for g in gpu_ids)
        )


_CLUSTERS: dict[tuple[tuple[NodeView, ...], tuple[str, ...]], tuple[Cluster, Index]] = {}
_CLUSTERS_LOCK = threading.Lock()


def _cluster_of(nodes: Sequence[NodeView], levels: Sequence[str]) -> tuple[Cluster, Index]:
    """The indexed cluster of these node views, and the classes of its idle state: the same
    from pass to pass while no node changes, so remembered (the last few node sets; the views
    are immutable and compared whole, so a changed node is a new entry, never a stale one)."""
    key = (tuple(nodes), tuple(levels))
    with _CLUSTERS_LOCK:  # the scheduling loop and `explain` (API threads) share it
        got = _CLUSTERS.get(key)
    if got is None:
        cluster = Cluster(nodes, levels)
        got = (cluster, Index(cluster, State()))  # both only read from now on
        with _CLUSTERS_LOCK:
            while len(_CLUSTERS) >= 4:
                _CLUSTERS.pop(next(iter(_CLUSTERS)))
            _CLUSTERS[key] = got
    return got


def place(
    jobs: Sequence[JobRequest],
    nodes: Sequence[NodeView],
    allocations: Sequence[Allocation],
    now: float,
    *,
    backfill: bool = True,
    reserved_nodes: Mapping[str, int] | None = None,
    licenses: Pool | None = None,
    levels: Sequence[str] = (),
    groups: Mapping[int, str] | None = None,
    fast: bool = True,
) -> list[Placement]:
    """Decide which of ``jobs`` (eligible, in priority order) start now, and where.

    ``fast`` (the default) places jobs against node classes (`Index`), remembers within the
    pass the job shapes that did not fit (usage only grows during a pass, so they still do
    not), and reserves the blocked head node by node (placement_backfill); the
    decisions are the same as with ``fast=False``, the plain node-by-node algorithm kept as
    the test oracle (tests/unit/test_placement_fast.py compares them on random cases).

    Never overcommits CPUs, memory or a GPU device, respects exclusivity, and never lets a
    lower-priority job delay the highest-priority blocked job (EASY backfill; see module doc).
    With ``backfill=False`` scheduling stops at the first blocked job (strict priority).

    Jobs with a live restart reservation (``JobRequest.reserved``) go first, on their reserved
    nodes; those nodes, and ``reserved_nodes`` (node -> job id: reservations of jobs that are
    not in ``jobs``, e.g. scheduled by another partition's lease holder), are closed to every
    other job for this pass.

    ``licenses``: the free cluster-wide licences; a job whose licences are not free is skipped
    (recorded in ``licenses.blocked``, it neither starts nor blocks others) and every job
    placed takes its licences from the pool. None: licences are not checked.

    ``levels``: the topology levels, leaf first (nodes carry their place in ``NodeView.place``);
    ``groups``: job id -> --group of running jobs, for --anti-affinity (a job of a group is
    kept off every domain where a running or just-placed job of its group holds a node,
    spares included).
    """
    cluster, idle_index = _cluster_of(nodes, levels) if fast else (Cluster(nodes, levels), None)
    group_nodes: dict[str, set[str]] = {}
    for a in allocations:
        g = (groups or {}).get(a.job_id)
        if g is not None:
            group_nodes.setdefault(g, set()).add(a.node)
    state, holds = holding(allocations)

    result: list[Placement] = []
    seen: set[int] = set()
    reservation: Reservation | None = None
    closed: frozenset[str] | None = None  # set when the head's reservation is not computable
    idle = State()

    both: State | None = None  # per node, the larger of `state` and the head's shadow

    def commit(job: JobRequest, p: Placement, *, into_shadow: bool) -> None:
        end = None if job.time_limit_s is None else now + job.time_limit_s
        for h in holds_of(p, job.exclusive, end):
            state.add(h)
            holds.append(h)
            if into_shadow and reservation is not None:
                reservation.shadow.add(h)
        if both is not None and reservation is not None:
            for name in p.nodes:
                both.put(name, merged(state.get(name), reservation.shadow.get(name)))
        if licenses is not None:
            licenses.take(job.licenses)
        if job.group is not None:
            group_nodes.setdefault(job.group, set()).update(p.nodes)  # spares too
        result.append(p)

    def kept_apart(job: JobRequest) -> JobRequest:
        """The job with the nodes its group's anti-affinity forbids added to its excludes."""
        if job.group is None or job.anti_affinity is None:
            return job
        away = topology.avoided(
            cluster.by_name, cluster.places, job.anti_affinity, group_nodes.get(job.group, ())
        )
        if not away:
            return job
        return replace(job, exclude=tuple(sorted(set(job.exclude) | away)))

    def licensed(job: JobRequest) -> bool:
        return licenses is None or not job.licenses or licenses.gate(job.job_id, job.licenses)

    owners = dict(reserved_nodes or {})
    for job in jobs:
        for name in job.reserved:
            owners.setdefault(name, job.job_id)
    if owners:
        for job in jobs:
            if not job.reserved or job.job_id in seen:
                continue
            seen.add(job.job_id)  # placed now or waits for its reserved nodes
            if not licensed(job):
                continue
            closed_here = frozenset(n for n, j in owners.items() if j != job.job_id)
            p = place_reserved(job, cluster, state, closed_here)
            if p is not None:
                commit(job, p, into_shadow=False)
        cluster = Cluster(
            [replace(n, schedulable=False) if n.name in owners else n for n in nodes], levels
        )

    # fast: the states jobs are tried on get node-class indexes; the shapes that did not fit
    # on `state` ("s") or `both` ("b") are remembered (both only grow during the pass), and
    # whether a shape fits the idle cluster
    if fast:
        Index(cluster, state)
        if idle_index is not None and idle_index.cluster is cluster:
            idle.index = idle_index  # the idle cluster's classes never change
        else:
            Index(cluster, idle)
    fit_memo: dict[tuple[object, ...], dict[ClassKey, NodeFit | None]] = {}
    failed: set[tuple[str, tuple[object, ...]]] = set()
    idle_fits: dict[tuple[object, ...], bool] = {}

    def attempt(job: JobRequest, on: State, tag: str) -> Placement | None:
        if on.index is None or not classable(job, cluster):
            return try_partitions(job, cluster, on)
        shape = job_shape(job)
        if tag == "i":
            if shape not in idle_fits:
                idle_fits[shape] = attempt(job, on, "") is not None
            return _DUMMY if idle_fits[shape] else None
        if tag and ((tag, shape) in failed or ("s", shape) in failed):
            return None  # fit on `both` implies fit on `state`: a miss there is a miss here
        memo = fit_memo.setdefault(shape, {})
        for partition in job.partitions:
            p = fit_classes(job, partition, cluster, on, memo)
            if p is not None:
                return p
        if tag:
            failed.add((tag, shape))
        return None

    for job in jobs:
        if job.job_id in seen:
            continue  # a duplicate in the input must not start twice
        seen.add(job.job_id)
        if not licensed(job):
            continue  # waits for licences (reason Licenses); holds no nodes back
        job = kept_apart(job)

        if reservation is None and closed is None:
            p = attempt(job, state, "s")
            if p is not None:
                commit(job, p, into_shadow=False)
                continue
            if attempt(job, idle, "i") is None:
                continue  # cannot run even on the idle cluster: not blocked by anyone
            if not backfill:
                break
            reservation = reserve(job, cluster, state, holds, now, fast=fast)
            if reservation is None:
                closed = usable_in_cluster(job, cluster)
            continue

        if reservation is not None:
            ends_in_time = (
                job.time_limit_s is not None and now + job.time_limit_s <= reservation.start
            )
            if ends_in_time:
                p = attempt(job, state, "s")
                if p is not None:
                    commit(job, p, into_shadow=False)
            else:
                # Must fit now and beside the head at its start: check against the per-node
                # maximum of both states (only nodes busy in either can differ from idle),
                # built once and kept up to date by `commit`.
                if both is None and fast and state.index is not None:
                    # The shadow is the state with work ended and the head added, and only
                    # `commit` changes either afterwards (and updates `both` where it does):
                    # off the head's nodes the maximum is the state itself. So `both` starts
                    # as the state (its usages are replaced, never changed, by `put`) and
                    # its classes as the state's, with the head's nodes moved.
                    state.index.refresh(state)
                    both = State(dict(state.usage))
                    Index(cluster, both, like=state.index)
                    for n in reservation.head:
                        both.put(n, merged(state.get(n), reservation.shadow.get(n)))
                elif both is None:
                    names = state.usage.keys() | reservation.shadow.usage.keys()
                    both = State(
                        {n: merged(state.get(n), reservation.shadow.get(n)) for n in names}
                    )
                p = attempt(job, both, "b")
                if p is not None:
                    commit(job, p, into_shadow=True)
        else:
            assert closed is not None
            p = try_partitions(job, cluster, state, closed)
            if p is not None:
                commit(job, p, into_shadow=False)
    return result


# what `attempt` answers for "fits on the idle cluster" (only its being not None is used)
_DUMMY = Placement(0, "", (), 0, (), (), None)
