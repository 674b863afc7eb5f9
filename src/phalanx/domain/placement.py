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
"""

from __future__ import annotations

import bisect
import functools
import heapq
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from phalanx.domain import topology
from phalanx.domain.licenses import Pool

__all__ = [
    "Allocation",
    "JobRequest",
    "NodeUsage",
    "NodeView",
    "Placement",
    "earliest_start",
    "fits_now",
    "node_free_at",
    "node_shortfall",
    "place",
    "statically_eligible",
    "unsatisfiable_reason",
    "usable_nodes",
]


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node as the scheduler sees it in one snapshot (capacity, not usage)."""

    name: str
    cpus: int
    mem_mb: int
    gpus: tuple[tuple[int, str], ...]  # (device index, gpu type)
    features: frozenset[str]
    partitions: frozenset[str]
    schedulable: bool  # registered, not DOWN, not DRAIN
    # Place in the network/power tree, (level, domain) pairs (domain/topology.py); () = none.
    place: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Allocation:
    """What a running attempt holds on one node."""

    job_id: int
    node: str
    cpus: int
    mem_mb: int
    gpu_ids: tuple[int, ...]
    exclusive: bool
    expected_end: float | None  # start + time limit; None = unknown/unlimited


@dataclass(frozen=True, slots=True)
class JobRequest:
    """The resource shape of one eligible pending job."""

    job_id: int
    partitions: tuple[str, ...]  # try in this order; the first where it fits now wins
    nodes: int  # exact node count
    cpus_per_node: int
    mem_per_node_mb: int  # 0 = the node's whole memory
    gpus_per_node: int
    gpu_type: str | None  # None = any type (one type per node)
    exclusive: bool
    constraint: Callable[[frozenset[str]], bool] | None
    nodelist: tuple[str, ...]  # must include all of these nodes
    exclude: tuple[str, ...]
    time_limit_s: int | None
    # Elastic job (--nodes=MIN-MAX): start on as many nodes as fit up to this (at least
    # `nodes`, which is MIN; backfill reservations use MIN). None: exactly `nodes`.
    nodes_max: int | None = None
    spares: int = 0  # hot spares (--spares=K) held with the allocation; they run nothing
    # A live restart reservation (rank order, then spares; see domain/elastic.py): the job is
    # placed first, on these nodes, and no other job may use them meanwhile.
    reserved: tuple[str, ...] = ()
    # Cluster-wide counted resources (--licenses), (name, count) sorted by name; see
    # domain/licenses.py. Checked against the pass's licence Pool before nodes are looked at.
    licenses: tuple[tuple[str, int], ...] = ()
    # Topology (domain/topology.py): at most this many leaf switches (--switches, None: any);
    # rank nodes spread over the domains of this level (--spread); jobs of the same group kept
    # in different domains of `anti_affinity` (--group, --anti-affinity).
    switches: int | None = None
    spread: str | None = None
    group: str | None = None
    anti_affinity: str | None = None
    # The text of the --constraint expression behind ``constraint`` (None: none, or unknown):
    # jobs of one shape share placement work within a pass only when it is known.
    constraint_key: str | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """Decision to start one job now."""

    job_id: int
    partition: str
    nodes: tuple[str, ...]  # rank order
    cpus_per_node: int
    mem_per_node_mb: tuple[int, ...]  # resolved per node (0 -> that node's memory)
    gpu_ids: tuple[tuple[int, ...], ...]  # per node, device indices
    # The job's gpu_type when given; else the single type used on every node, or None when the
    # job has no GPUs or its nodes ended up with different types.
    gpu_type: str | None
    spares: int = 0  # the last `spares` entries of `nodes` are hot spares (no rank)

    @property
    def rank_nodes(self) -> tuple[str, ...]:
        """The nodes that run the job, in rank order (spares excluded)."""
        return self.nodes[: len(self.nodes) - self.spares]


# --------------------------------------------------------------------------------------------
# Internal model
# --------------------------------------------------------------------------------------------

_DIGITS = re.compile(r"(\d+)")


@functools.lru_cache(maxsize=1 << 17)
def _name_key(name: str) -> tuple[tuple[str | int, ...], str]:
    """Natural order ("node2" < "node10") so rank layouts read like hostlists; raw name breaks ties.

    ``re.split`` with a capture group alternates text/digits starting with text, so position i
    always holds the same type in every key and tuples compare without type errors.
    """
    parts = _DIGITS.split(name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


@dataclass(slots=True)
class _Usage:
    """Mutable usage of one node. GPU devices are counted, not set, so bad input that already
    double-books a device stays visible (the device stays busy until every holder leaves)."""

    cpus: int = 0
    mem: int = 0
    gpus: dict[int, int] = field(default_factory=dict)
    holders: int = 0
    exclusive: int = 0

    def copy(self) -> _Usage:
        return _Usage(self.cpus, self.mem, dict(self.gpus), self.holders, self.exclusive)


_IDLE = _Usage()  # shared read-only "nothing here"; never mutated (see _State.add)


@dataclass(frozen=True, slots=True)
class _Hold:
    """One node's share of a running or just-placed job, with when it frees up."""

    node: str
    cpus: int
    mem: int
    gpus: tuple[int, ...]
    exclusive: bool
    end: float | None


class _State:
    """Usage of every node; nodes never mentioned are idle. ``index``: the node classes of
    this state (see _Index), kept up to date through ``dirty`` (nodes changed since)."""

    __slots__ = ("dirty", "index", "usage")

    def __init__(self, usage: dict[str, _Usage] | None = None) -> None:
        self.usage: dict[str, _Usage] = usage if usage is not None else {}
        self.index: _Index | None = None
        self.dirty: set[str] = set()

    def get(self, node: str) -> _Usage:
        return self.usage.get(node, _IDLE)

    def put(self, node: str, u: _Usage) -> None:
        self.usage[node] = u
        if self.index is not None:
            self.dirty.add(node)

    def add(self, hold: _Hold) -> None:
        if self.index is not None:
            self.dirty.add(hold.node)
        u = self.usage.get(hold.node)
        if u is None:
            u = self.usage[hold.node] = _Usage()
        u.cpus += hold.cpus
        u.mem += hold.mem
        for g in hold.gpus:
            u.gpus[g] = u.gpus.get(g, 0) + 1
        u.holders += 1
        u.exclusive += int(hold.exclusive)

    def remove(self, hold: _Hold) -> None:
        if self.index is not None:
            self.dirty.add(hold.node)
        u = self.usage[hold.node]
        u.cpus -= hold.cpus
        u.mem -= hold.mem
        for g in hold.gpus:
            left = u.gpus[g] - 1
            if left:
                u.gpus[g] = left
            else:
                del u.gpus[g]
        u.holders -= 1
        u.exclusive -= int(hold.exclusive)

    def copy(self) -> _State:
        return _State({k: v.copy() for k, v in self.usage.items()})


def _merged(a: _Usage, b: _Usage) -> _Usage:
    """Usage that fits a job iff the job fits on both ``a`` and ``b`` (used for backfill: a long
    job must fit now *and* beside the reserved head at the reservation time)."""
    gpus = dict(a.gpus)
    for g in b.gpus:
        gpus[g] = max(gpus.get(g, 0), b.gpus[g])
    return _Usage(
        max(a.cpus, b.cpus),
        max(a.mem, b.mem),
        gpus,
        max(a.holders, b.holders),
        max(a.exclusive, b.exclusive),
    )


@dataclass(frozen=True, slots=True)
class _NodeFit:
    node: NodeView
    mem: int
    gpu_ids: tuple[int, ...]
    gpu_type: str | None
    idle: bool
    cpus_left: int
    gpus_left: int
    mem_left: int


def _shares(u: _Usage, exclusive: bool) -> bool:
    """Whether a node with usage ``u`` can take one more holder: not while an exclusive job
    holds it, and an exclusive job only an idle one."""
    return not (u.exclusive or (exclusive and u.holders))


class NodeUsage:
    """What live work holds on some nodes, for re-checking chosen placements (the start
    transaction's check, under the node rows' locks, that nothing changed since the plan):
    the same rule as placement's, applied to placements already chosen."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = _State()

    def add(
        self, node: str, cpus: int, mem_mb: int, gpu_ids: Iterable[int], exclusive: bool
    ) -> None:
        self._state.add(_Hold(node, cpus, mem_mb, tuple(gpu_ids), exclusive, None))

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
            _shares(u, exclusive)
            and u.cpus + cpus <= total_cpus
            and u.mem + mem_mb <= total_mem_mb
            and not any(u.gpus.get(g) for g in gpu_ids)
        )


def _fit_node(job: JobRequest, node: NodeView, u: _Usage) -> _NodeFit | None:
    """Whether one node can take one rank of ``job`` on top of usage ``u``, and with what."""
    if not _shares(u, job.exclusive):
        return None
    cpus_left = node.cpus - u.cpus - job.cpus_per_node
    if cpus_left < 0:
        return None
    if job.mem_per_node_mb == 0:
        # "All of the node's memory": any memory already in use makes it impossible.
        if u.mem > 0:
            return None
        mem = node.mem_mb
    else:
        mem = job.mem_per_node_mb
    mem_left = node.mem_mb - u.mem - mem
    if mem_left < 0:
        return None
    free_total = sum(1 for idx, _ in dict(node.gpus).items() if not u.gpus.get(idx))
    if job.gpus_per_node <= 0:
        return _NodeFit(node, mem, (), None, u.holders == 0, cpus_left, free_total, mem_left)
    free_by_type: dict[str, list[int]] = {}
    for idx, gtype in dict(node.gpus).items():
        if u.gpus.get(idx):
            continue
        if job.gpu_type is not None and gtype != job.gpu_type:
            continue
        free_by_type.setdefault(gtype, []).append(idx)
    options = [
        (len(ids), gtype, ids)
        for gtype, ids in free_by_type.items()
        if len(ids) >= job.gpus_per_node
    ]
    if not options:
        return None
    # Best fit among types: the type with the fewest free devices that still suffices, so a
    # type with many free devices stays whole for a bigger request.
    _, gtype, ids = min(options, key=lambda o: (o[0], o[1]))
    chosen = tuple(sorted(ids)[: job.gpus_per_node])
    return _NodeFit(
        node,
        mem,
        chosen,
        gtype,
        u.holders == 0,
        cpus_left,
        free_total - len(chosen),
        mem_left,
    )


def _statically_eligible(job: JobRequest, node: NodeView) -> bool:
    """Filters that do not depend on usage or partition: exclude list and feature constraint."""
    if node.name in job.exclude:
        return False
    return job.constraint is None or bool(job.constraint(node.features))


class _Cluster:
    """Schedulable nodes indexed by partition, in natural name order (built once per call)."""

    def __init__(self, nodes: Sequence[NodeView], levels: Sequence[str] = ()) -> None:
        by_name: dict[str, NodeView] = {}
        for n in nodes:
            by_name[n.name] = n  # a duplicate name: the last view wins, deterministically
        self.by_name = by_name
        self.levels = tuple(levels)  # topology levels, leaf first; () = no topology
        self.places: dict[str, dict[str, str]] = {
            n.name: dict(n.place) for n in by_name.values() if n.place
        }
        ordered = sorted(by_name.values(), key=lambda n: _name_key(n.name))
        self.ordered = ordered  # natural name order; a node's ordinal is its place here
        self.ordinal = {n.name: i for i, n in enumerate(ordered)}
        self.by_partition: dict[str, list[NodeView]] = {}
        for n in ordered:
            if not n.schedulable:
                continue
            for p in n.partitions:
                self.by_partition.setdefault(p, []).append(n)


def _fit_in_partition(
    job: JobRequest,
    partition: str,
    cluster: _Cluster,
    state: _State,
    closed: frozenset[str],
) -> Placement | None:
    """All-or-nothing choice of ``job.nodes`` nodes (up to ``job.nodes_max`` for an elastic
    job) plus ``job.spares`` spare nodes in one partition, or None."""
    if job.nodes < 1:
        return None
    required = list(dict.fromkeys(job.nodelist))
    if len(required) > max(job.nodes, job.nodes_max or 0):
        return None
    fits: dict[str, _NodeFit] = {}
    for node in cluster.by_partition.get(partition, ()):
        if node.name in closed or not _statically_eligible(job, node):
            continue
        f = _fit_node(job, node, state.get(node.name))
        if f is not None:
            fits[node.name] = f
    if any(r not in fits for r in required):
        return None
    req_set = set(required)
    others = [f for name, f in fits.items() if name not in req_set]
    spares = max(0, job.spares)
    ranks = job.nodes
    if job.nodes_max is not None and job.nodes_max > job.nodes:
        # elastic: as many ranks as fit now, up to MAX, after the spares are set aside
        ranks = max(job.nodes, min(job.nodes_max, len(required) + len(others) - spares))
    ranks = max(ranks, len(required))
    need = ranks + spares - len(required)
    if len(others) < need:
        return None
    if job.nodes == 1:
        # Packing: a partially used node first, then the tightest fit, so idle nodes stay whole
        # for big and exclusive jobs.
        others.sort(
            key=lambda f: (f.idle, f.cpus_left, f.gpus_left, f.mem_left, _name_key(f.node.name))
        )
    else:
        # Multi-node: idle nodes first (they are the ones big jobs are kept whole for and avoid
        # noisy neighbours), then name order for a stable, readable rank layout.
        others.sort(key=lambda f: (not f.idle, _name_key(f.node.name)))
    picked = _pick(job, others, ranks - len(required), spares, required, cluster)
    if picked is None:
        return None
    rank_fits = [fits[r] for r in required] + picked[: ranks - len(required)]
    spare_fits = picked[ranks - len(required) :]
    return _placement(job, partition, rank_fits, spare_fits)


def _placement(
    job: JobRequest, partition: str, rank_fits: list[_NodeFit], spare_fits: list[_NodeFit]
) -> Placement:
    """The placement of the chosen nodes: ranks, then spares, each in natural name order."""
    rank_fits.sort(key=lambda f: _name_key(f.node.name))
    spare_fits.sort(key=lambda f: _name_key(f.node.name))
    chosen = rank_fits + spare_fits
    if job.gpus_per_node <= 0:
        gtype: str | None = None
    elif job.gpu_type is not None:
        gtype = job.gpu_type
    else:
        types = {f.gpu_type for f in chosen}
        gtype = types.pop() if len(types) == 1 else None
    return Placement(
        job_id=job.job_id,
        partition=partition,
        nodes=tuple(f.node.name for f in chosen),
        cpus_per_node=job.cpus_per_node,
        mem_per_node_mb=tuple(f.mem for f in chosen),
        gpu_ids=tuple(f.gpu_ids for f in chosen),
        gpu_type=gtype,
        spares=len(spare_fits),
    )


# --------------------------------------------------------------------------------------------
# Node classes: placement against groups of identical nodes instead of node by node
# --------------------------------------------------------------------------------------------

_NOGPU: frozenset[int] = frozenset()
_MISS = object()

ClassKey = tuple[object, ...]


def _class_key(node: NodeView, u: _Usage) -> ClassKey:
    """What `_fit_node` looks at of a node and its usage, and nothing else (not its name):
    two nodes with the same key fit every job alike, with the same devices."""
    if u is _IDLE:
        return (node.cpus, node.mem_mb, node.gpus, node.features, *_IDLE_TAIL)
    return (
        node.cpus,
        node.mem_mb,
        node.gpus,
        node.features,
        u.cpus,
        u.mem,
        frozenset(u.gpus) if u.gpus else _NOGPU,
        u.holders > 0,
        u.exclusive > 0,
    )


_IDLE_TAIL = (0, 0, _NOGPU, False, False)


class _Index:
    """The schedulable nodes of each partition grouped in classes (`_class_key` over one
    `_State`): each class is the ascending list of its nodes' ordinals (natural name order).
    A 10,000-node cluster has a few hundred classes, and a job is checked once per class.
    The state marks the nodes it changes (``dirty``); `refresh` moves just those."""

    __slots__ = ("cluster", "key", "parts")

    def __init__(self, cluster: _Cluster, state: _State, like: _Index | None = None) -> None:
        self.cluster = cluster
        if like is not None:
            # a copy of another state's index, then the nodes where the states differ moved:
            # a few list copies instead of a class key per node
            self.key: dict[str, ClassKey] = dict(like.key)
            self.parts: dict[str, dict[ClassKey, list[int]]] = {
                p: {k: list(v) for k, v in c.items()} for p, c in like.parts.items()
            }
            state.index = self
            return
        self.key = {}
        self.parts = {}
        for p, members in cluster.by_partition.items():
            classes: dict[ClassKey, list[int]] = {}
            self.parts[p] = classes
            for n in members:  # natural name order: every list is built ascending
                k = self.key.get(n.name)
                if k is None:
                    k = self.key[n.name] = _class_key(n, state.get(n.name))
                classes.setdefault(k, []).append(cluster.ordinal[n.name])
        state.index = self
        state.dirty.clear()

    def refresh(self, state: _State) -> None:
        for name in state.dirty:
            old = self.key.get(name)
            if old is None:
                continue  # not schedulable, or in no partition
            node = self.cluster.by_name[name]
            new = _class_key(node, state.get(name))
            if new == old:
                continue
            o = self.cluster.ordinal[name]
            for p in node.partitions:
                classes = self.parts.get(p)
                if classes is None:
                    continue
                members = classes[old]
                del members[bisect.bisect_left(members, o)]
                if not members:
                    del classes[old]
                bisect.insort(classes.setdefault(new, []), o)
            self.key[name] = new
        state.dirty.clear()


def _classable(job: JobRequest, cluster: _Cluster) -> bool:
    """Whether `_fit_classes` decides this job exactly as `_fit_in_partition` would: no
    per-node lists, no topology, and a constraint known by its text."""
    # with topology, a single-node job without spares still takes the first node in the
    # packing order (`_pick`); several nodes or spares are chosen by domain/topology.py
    single = job.nodes == 1 and (job.nodes_max or 1) <= 1 and job.spares <= 0
    return (
        job.nodes >= 1
        and not job.nodelist
        and not job.exclude
        and job.switches is None
        and job.spread is None
        and (not cluster.places or single)
        and (job.constraint is None or job.constraint_key is not None)
    )


def _shape(job: JobRequest) -> tuple[object, ...]:
    """What of a classable job its placement depends on (not its id, time limit, licences)."""
    return (
        job.partitions,
        job.nodes,
        job.nodes_max,
        job.cpus_per_node,
        job.mem_per_node_mb,
        job.gpus_per_node,
        job.gpu_type,
        job.exclusive,
        job.constraint_key,
        job.spares,
    )


def _fit_classes(
    job: JobRequest,
    partition: str,
    cluster: _Cluster,
    state: _State,
    memo: dict[ClassKey, _NodeFit | None],
) -> Placement | None:
    """`_fit_in_partition` for a classable job on an indexed state, class by class: the
    same nodes in the same order (packing for one node, idle nodes then name order for
    several), at the cost of one `_fit_node` per class and shape (``memo``)."""
    index = state.index
    assert index is not None
    index.refresh(state)
    classes = index.parts.get(partition)
    if not classes:
        return None
    fitting: list[tuple[_NodeFit, list[int]]] = []
    total = 0
    for k, members in classes.items():
        f = memo.get(k, _MISS)
        if f is _MISS:
            rep = cluster.ordered[members[0]]
            ok = job.constraint is None or bool(job.constraint(rep.features))
            f = _fit_node(job, rep, state.get(rep.name)) if ok else None
            memo[k] = f
        if f is not None:
            assert isinstance(f, _NodeFit)
            fitting.append((f, members))
            total += len(members)
    spares = max(0, job.spares)
    ranks = job.nodes
    if job.nodes_max is not None and job.nodes_max > job.nodes:
        ranks = max(job.nodes, min(job.nodes_max, total - spares))
    need = ranks + spares
    if total < need:
        return None
    groups: dict[tuple[object, ...], list[tuple[_NodeFit, list[int]]]] = {}
    for f, members in fitting:
        g = (f.idle, f.cpus_left, f.gpus_left, f.mem_left) if job.nodes == 1 else (not f.idle,)
        groups.setdefault(g, []).append((f, members))
    picked: list[_NodeFit] = []
    for gk in sorted(groups):
        group = groups[gk]
        heap = [(members[0], i, 0) for i, (_, members) in enumerate(group)]
        heapq.heapify(heap)
        while heap and len(picked) < need:
            o, i, at = heapq.heappop(heap)
            f, members = group[i]
            n = cluster.ordered[o]
            picked.append(
                _NodeFit(
                    n, f.mem, f.gpu_ids, f.gpu_type, f.idle, f.cpus_left, f.gpus_left, f.mem_left
                )
            )
            if at + 1 < len(members):
                heapq.heappush(heap, (members[at + 1], i, at + 1))
        if len(picked) >= need:
            break
    return _placement(job, partition, picked[:ranks], picked[ranks:need])


def _pick(
    job: JobRequest,
    others: list[_NodeFit],
    ranks: int,
    spares: int,
    required: list[str],
    cluster: _Cluster,
) -> list[_NodeFit] | None:
    """The rank nodes to add (``ranks``), then the spares, from ``others`` (in preference
    order). Without topology rules this is simply the first ones; with them, the choice is
    domain/topology.py's (compact for multi-node jobs, --switches, --spread, spares outside
    the job's own domains)."""
    multi = ranks + len(required) > 1
    topo = job.switches is not None or job.spread is not None
    if not topo and not (cluster.places and (multi or spares)):
        return others[: ranks + spares]
    got = topology.select(
        [f.node.name for f in others],
        ranks,
        spares,
        cluster.places,
        cluster.levels if multi or job.switches is not None else (),
        fixed=required,
        switches=job.switches,
        spread=job.spread,
        spare_level=job.spread
        or job.anti_affinity
        or (cluster.levels[-1] if cluster.levels else None),
    )
    if got is None:
        return None
    by_name = {f.node.name: f for f in others}
    return [by_name[n] for n in (*got[0], *got[1])]


def _place_reserved(
    job: JobRequest, cluster: _Cluster, state: _State, closed: frozenset[str]
) -> Placement | None:
    """The restart of a job with a live restart reservation, or None if it cannot start yet.

    Ranks go on the reserved nodes in their rank order; a reserved rank node that cannot take
    its rank now (it went down or was drained since) is replaced by the next reserved spare,
    or dropped by an elastic job (a fixed-size job then waits). An elastic job grows with free
    nodes up to MAX, appended as new last ranks; spares are refilled from the reserved ones
    and then free nodes, best effort (the restart never waits for a spare). ``closed``: nodes
    other jobs hold reservations on.
    """
    max_ranks = job.nodes_max if job.nodes_max is not None else job.nodes
    cut = min(len(job.reserved), max_ranks)
    for partition in job.partitions:
        members = {n.name: n for n in cluster.by_partition.get(partition, ())}

        def fit(name: str, members: dict[str, NodeView] = members) -> _NodeFit | None:
            node = members.get(name)
            if node is None or not _statically_eligible(job, node):
                return None
            return _fit_node(job, node, state.get(name))

        fits = {n: f for n in dict.fromkeys(job.reserved) if (f := fit(n)) is not None}
        pool = [n for n in job.reserved[cut:] if n in fits]
        ranks: list[str] = []
        for name in job.reserved[:cut]:
            if name in fits:
                ranks.append(name)
            elif pool:
                ranks.append(pool.pop(0))
            elif job.nodes_max is None:
                break  # a fixed-size job cannot lose a rank
        else:
            if len(ranks) < job.nodes:
                continue
            taken = set(job.reserved)
            free = [
                f
                for name in members
                if name not in taken and name not in closed and (f := fit(name)) is not None
            ]
            free.sort(key=lambda f: (not f.idle, _name_key(f.node.name)))
            grow = free[: max(0, max_ranks - len(ranks))]
            ranks += [f.node.name for f in grow]
            for f in grow:
                fits[f.node.name] = f
            spares = pool[: max(0, job.spares)]
            for f in free[len(grow) : len(grow) + max(0, job.spares - len(spares))]:
                spares.append(f.node.name)
                fits[f.node.name] = f
            chosen = [fits[n] for n in ranks + spares]
            types = {f.gpu_type for f in chosen}
            gtype = job.gpu_type if job.gpu_type is not None else None
            if job.gpus_per_node > 0 and gtype is None and len(types) == 1:
                gtype = types.pop()
            return Placement(
                job_id=job.job_id,
                partition=partition,
                nodes=tuple(ranks + spares),
                cpus_per_node=job.cpus_per_node,
                mem_per_node_mb=tuple(f.mem for f in chosen),
                gpu_ids=tuple(f.gpu_ids for f in chosen),
                gpu_type=gtype,
                spares=len(spares),
            )
    return None


def _try(
    job: JobRequest,
    cluster: _Cluster,
    state: _State,
    closed: frozenset[str] = frozenset(),
) -> Placement | None:
    """First partition in the job's list where it fits on ``state``."""
    for partition in job.partitions:
        p = _fit_in_partition(job, partition, cluster, state, closed)
        if p is not None:
            return p
    return None


def _holds_of(p: Placement, exclusive: bool, end: float | None) -> list[_Hold]:
    return [
        _Hold(node, p.cpus_per_node, mem, gpus, exclusive, end)
        for node, mem, gpus in zip(p.nodes, p.mem_per_node_mb, p.gpu_ids, strict=True)
    ]


@dataclass(slots=True)
class _Reservation:
    start: float
    shadow: _State  # usage at ``start`` including the head job and long backfilled jobs
    head: tuple[str, ...] = ()  # the head's nodes in it


def _reserve(
    job: JobRequest,
    cluster: _Cluster,
    state: _State,
    holds: Iterable[_Hold],
    now: float,
    *,
    fast: bool = True,
) -> _Reservation | None:
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
        p = _try(job, cluster, sim)
        if p is not None:
            for h in _holds_of(p, job.exclusive, None):
                sim.add(h)
            return _Reservation(t, sim, p.nodes)
    return None


def _reserve_by_node(
    job: JobRequest, cluster: _Cluster, state: _State, holds: list[_Hold], now: float
) -> _Reservation | None:
    """`_reserve` when nodes fit independently (no --nodelist, no topology): the job fits at
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
            if _statically_eligible(job, node):
                parts_of.setdefault(node.name, []).append(partition)
    count = dict.fromkeys(job.partitions, 0)
    free: set[str] = set()
    for name in parts_of:
        if _fit_node(job, cluster.by_name[name], state.get(name)) is not None:
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
    sim: dict[str, _State] = {}
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
                one = sim[h.node] = _State({h.node: state.get(h.node).copy()})
            one.remove(h)
            if _fit_node(job, cluster.by_name[h.node], one.get(h.node)) is not None:
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
    p = _try(job, cluster, shadow)
    if p is None:
        return None  # cannot happen: `need` nodes of a partition are free at `start`
    for h in _holds_of(p, job.exclusive, None):
        shadow.add(h)
    return _Reservation(start, shadow, p.nodes)


def _usable_nodes(job: JobRequest, cluster: _Cluster) -> frozenset[str]:
    """Every schedulable node the job could ever use (in its partitions, capacity permitting)."""
    names: set[str] = set()
    for partition in job.partitions:
        for node in cluster.by_partition.get(partition, ()):
            if _statically_eligible(job, node) and _fit_node(job, node, _IDLE) is not None:
                names.add(node.name)
    return frozenset(names)


def _holding(allocations: Iterable[Allocation]) -> tuple[_State, list[_Hold]]:
    """The usage running work puts on the nodes, and each allocation as a hold (whose end
    frees it, for the backfill reservation)."""
    state = _State()
    holds: list[_Hold] = []
    for a in allocations:
        h = _Hold(a.node, a.cpus, a.mem_mb, tuple(a.gpu_ids), a.exclusive, a.expected_end)
        state.add(h)
        holds.append(h)
    return state, holds


_CLUSTERS: dict[tuple[tuple[NodeView, ...], tuple[str, ...]], tuple[_Cluster, _Index]] = {}
_CLUSTERS_LOCK = threading.Lock()


def _cluster_of(nodes: Sequence[NodeView], levels: Sequence[str]) -> tuple[_Cluster, _Index]:
    """The indexed cluster of these node views, and the classes of its idle state: the same
    from pass to pass while no node changes, so remembered (the last few node sets; the views
    are immutable and compared whole, so a changed node is a new entry, never a stale one)."""
    key = (tuple(nodes), tuple(levels))
    with _CLUSTERS_LOCK:  # the scheduling loop and `explain` (API threads) share it
        got = _CLUSTERS.get(key)
    if got is None:
        cluster = _Cluster(nodes, levels)
        got = (cluster, _Index(cluster, _State()))  # both only read from now on
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

    ``fast`` (the default) places jobs against node classes (`_Index`), remembers within the
    pass the job shapes that did not fit (usage only grows during a pass, so they still do
    not), and reserves the blocked head node by node (`_reserve_by_node`); the
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
    cluster, idle_index = _cluster_of(nodes, levels) if fast else (_Cluster(nodes, levels), None)
    group_nodes: dict[str, set[str]] = {}
    for a in allocations:
        g = (groups or {}).get(a.job_id)
        if g is not None:
            group_nodes.setdefault(g, set()).add(a.node)
    state, holds = _holding(allocations)

    result: list[Placement] = []
    seen: set[int] = set()
    reservation: _Reservation | None = None
    closed: frozenset[str] | None = None  # set when the head's reservation is not computable
    idle = _State()

    both: _State | None = None  # per node, the larger of `state` and the head's shadow

    def commit(job: JobRequest, p: Placement, *, into_shadow: bool) -> None:
        end = None if job.time_limit_s is None else now + job.time_limit_s
        for h in _holds_of(p, job.exclusive, end):
            state.add(h)
            holds.append(h)
            if into_shadow and reservation is not None:
                reservation.shadow.add(h)
        if both is not None and reservation is not None:
            for name in p.nodes:
                both.put(name, _merged(state.get(name), reservation.shadow.get(name)))
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
            p = _place_reserved(job, cluster, state, closed_here)
            if p is not None:
                commit(job, p, into_shadow=False)
        cluster = _Cluster(
            [replace(n, schedulable=False) if n.name in owners else n for n in nodes], levels
        )

    # fast: the states jobs are tried on get node-class indexes; the shapes that did not fit
    # on `state` ("s") or `both` ("b") are remembered (both only grow during the pass), and
    # whether a shape fits the idle cluster
    if fast:
        _Index(cluster, state)
        if idle_index is not None and idle_index.cluster is cluster:
            idle.index = idle_index  # the idle cluster's classes never change
        else:
            _Index(cluster, idle)
    fit_memo: dict[tuple[object, ...], dict[ClassKey, _NodeFit | None]] = {}
    failed: set[tuple[str, tuple[object, ...]]] = set()
    idle_fits: dict[tuple[object, ...], bool] = {}

    def attempt(job: JobRequest, on: _State, tag: str) -> Placement | None:
        if on.index is None or not _classable(job, cluster):
            return _try(job, cluster, on)
        shape = _shape(job)
        if tag == "i":
            if shape not in idle_fits:
                idle_fits[shape] = attempt(job, on, "") is not None
            return _DUMMY if idle_fits[shape] else None
        if tag and ((tag, shape) in failed or ("s", shape) in failed):
            return None  # fit on `both` implies fit on `state`: a miss there is a miss here
        memo = fit_memo.setdefault(shape, {})
        for partition in job.partitions:
            p = _fit_classes(job, partition, cluster, on, memo)
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
            reservation = _reserve(job, cluster, state, holds, now, fast=fast)
            if reservation is None:
                closed = _usable_nodes(job, cluster)
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
                    both = _State(dict(state.usage))
                    _Index(cluster, both, like=state.index)
                    for n in reservation.head:
                        both.put(n, _merged(state.get(n), reservation.shadow.get(n)))
                elif both is None:
                    names = state.usage.keys() | reservation.shadow.usage.keys()
                    both = _State(
                        {n: _merged(state.get(n), reservation.shadow.get(n)) for n in names}
                    )
                p = attempt(job, both, "b")
                if p is not None:
                    commit(job, p, into_shadow=True)
        else:
            assert closed is not None
            p = _try(job, cluster, state, closed)
            if p is not None:
                commit(job, p, into_shadow=False)
    return result


# what `attempt` answers for "fits on the idle cluster" (only its being not None is used)
_DUMMY = Placement(0, "", (), 0, (), (), None)


# --------------------------------------------------------------------------------------------
# The same predicates, for explanations (domain/explain.py): why a job waits, in words
# --------------------------------------------------------------------------------------------


def statically_eligible(job: JobRequest, node: NodeView) -> bool:
    """Whether ``node`` passes the job's --exclude list and --constraint (usage aside)."""
    return _statically_eligible(job, node)


def node_shortfall(job: JobRequest, node: NodeView) -> str | None:
    """What an empty ``node`` lacks for one rank of ``job`` ("only 4 GPUs ..."), or None."""
    if _fit_node(job, node, _IDLE) is not None:
        return None
    return _why_not_node(job, node) or "not enough of the requested resources together"


def _usage_of(node: str, allocations: Iterable[Allocation]) -> tuple[_State, list[_Hold]]:
    return _holding(a for a in allocations if a.node == node)


def fits_now(job: JobRequest, node: NodeView, allocations: Sequence[Allocation]) -> bool:
    """Whether one rank of ``job`` fits on ``node`` beside its running work, now (work past
    its time limit still holds what it holds until it has ended)."""
    state, _ = _usage_of(node.name, allocations)
    return _fit_node(job, node, state.get(node.name)) is not None


def node_free_at(
    job: JobRequest, node: NodeView, allocations: Sequence[Allocation], now: float
) -> float | None:
    """When one rank of ``job`` fits on ``node``, replaying the known ends of its running work
    as the scheduler's backfill does (``now`` if it fits already; overdue work ends "now").
    None: it never fits by the known ends (work without a time limit holds what it needs)."""
    state, holds = _usage_of(node.name, allocations)
    if _fit_node(job, node, state.get(node.name)) is not None:
        return now
    for end, h in sorted(
        ((max(h.end, now), h) for h in holds if h.end is not None), key=lambda e: e[0]
    ):
        state.remove(h)
        if _fit_node(job, node, state.get(node.name)) is not None:
            return end
    return None


def usable_nodes(job: JobRequest, nodes: Sequence[NodeView]) -> frozenset[str]:
    """Every schedulable node the job could ever use (its partitions, exclusions, capacity)."""
    return _usable_nodes(job, _Cluster(nodes))


def earliest_start(
    job: JobRequest, nodes: Sequence[NodeView], allocations: Sequence[Allocation], now: float
) -> float | None:
    """The start the scheduler would reserve for ``job`` as the blocked head of the queue: the
    first time it fits when running work ends at its time limits (``now`` if it fits now).
    None when that cannot be known (it needs nodes held by work without a time limit, or
    nodes that are not schedulable)."""
    cluster = _Cluster(nodes)
    state, holds = _holding(allocations)
    if _try(job, cluster, state) is not None:
        return now
    res = _reserve(job, cluster, state, holds, now)
    return None if res is None else res.start


# --------------------------------------------------------------------------------------------
# Submit-time check
# --------------------------------------------------------------------------------------------


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _max_gpus(node: NodeView, gpu_type: str | None) -> int:
    """Largest number of same-type devices on the node (of ``gpu_type`` when given)."""
    counts: dict[str, int] = {}
    for _, t in dict(node.gpus).items():
        counts[t] = counts.get(t, 0) + 1
    if gpu_type is not None:
        return counts.get(gpu_type, 0)
    return max(counts.values(), default=0)


def _why_not_node(job: JobRequest, node: NodeView) -> str | None:
    """Which resource an empty ``node`` lacks for one rank of ``job`` (None if it fits)."""
    short: list[str] = []
    if node.cpus < job.cpus_per_node:
        short.append(f"{node.cpus} CPUs ({job.cpus_per_node} requested)")
    if job.mem_per_node_mb > node.mem_mb:
        short.append(f"{node.mem_mb} MB memory ({job.mem_per_node_mb} MB requested)")
    if job.gpus_per_node > 0:
        have = _max_gpus(node, job.gpu_type)
        if have < job.gpus_per_node:
            kind = f" of type {job.gpu_type}" if job.gpu_type else " of one type"
            short.append(f"{have} GPUs{kind} ({job.gpus_per_node} requested)")
    return "only " + ", ".join(short) if short else None


def _partition_reason(
    job: JobRequest,
    partition: str,
    members: list[NodeView],
    by_name: Mapping[str, NodeView],
) -> str | None:
    """Why ``job`` can never run in ``partition`` (None if it could, on empty nodes)."""
    if not members:
        return f"partition {partition} has no nodes"
    member_names = {n.name for n in members}
    required = list(dict.fromkeys(job.nodelist))
    for name in required:
        if name not in by_name:
            return f"node {name} in --nodelist does not exist"
        if name not in member_names:
            return f"node {name} in --nodelist is not in partition {partition}"
        if name in job.exclude:
            return f"node {name} is in both --nodelist and --exclude"
    most = max(job.nodes, job.nodes_max or 0)
    if len(required) > most:
        return (
            f"--nodelist names {_plural(len(required), 'node')} but the job requests "
            f"only {_plural(most, 'node')}"
        )

    cands = [n for n in members if n.name not in job.exclude]
    if not cands:
        return f"every node in partition {partition} is excluded by --exclude"
    if job.constraint is not None:
        constraint = job.constraint
        featured = [n for n in cands if constraint(n.features)]
        if not featured:
            present = sorted(set().union(*(n.features for n in cands)))
            listed = ", ".join(present) if present else "none"
            return (
                f"no node in partition {partition} satisfies the --constraint feature "
                f"expression (features present: {listed})"
            )
        for name in required:
            if name not in {n.name for n in featured}:
                return f"node {name} in --nodelist does not satisfy the --constraint expression"
        cands = featured

    # Per-resource maxima first: they name the resource that no node has enough of.
    if job.gpus_per_node > 0:
        if job.gpu_type is not None:
            types = sorted({t for n in cands for _, t in n.gpus})
            if job.gpu_type not in types:
                listed = f"types: {', '.join(types)}" if types else "it has no GPUs"
                return (
                    f"gpu type '{job.gpu_type}' does not exist on any node in partition "
                    f"{partition} ({listed})"
                )
        most = max(_max_gpus(n, job.gpu_type) for n in cands)
        if most < job.gpus_per_node:
            kind = f" of type {job.gpu_type}" if job.gpu_type else ""
            if most == 0:
                has = "has no GPUs"
            elif job.gpu_type is None:
                has = f"has {most} of a single type"
            else:
                has = f"has {most}"
            return (
                f"requested {_plural(job.gpus_per_node, 'GPU')}{kind} per node but the largest "
                f"node in partition {partition} {has}"
            )
    most_cpus = max(n.cpus for n in cands)
    if most_cpus < job.cpus_per_node:
        return (
            f"requested {_plural(job.cpus_per_node, 'CPU')} per node but the largest node in "
            f"partition {partition} has {most_cpus}"
        )
    most_mem = max(n.mem_mb for n in cands)
    if most_mem < job.mem_per_node_mb:
        return (
            f"requested {job.mem_per_node_mb} MB of memory per node but the largest node in "
            f"partition {partition} has {most_mem} MB"
        )

    fitting = [n for n in cands if _why_not_node(job, n) is None]
    if not fitting:
        want = [f"{job.cpus_per_node} CPUs"]
        if job.mem_per_node_mb:
            want.append(f"{job.mem_per_node_mb} MB memory")
        if job.gpus_per_node:
            kind = f" {job.gpu_type}" if job.gpu_type else ""
            want.append(f"{job.gpus_per_node}{kind} GPUs")
        return f"no single node in partition {partition} has {' and '.join(want)} together"
    fit_names = {n.name for n in fitting}
    for name in required:
        if name not in fit_names:
            why = _why_not_node(job, by_name[name])
            return f"node {name} in --nodelist can never hold the job: it has {why}"
    if len(fitting) < job.nodes + max(0, job.spares):
        listed = ", ".join(n.name for n in fitting)
        spares = f" and {_plural(job.spares, 'spare')}" if job.spares > 0 else ""
        return (
            f"requested {_plural(job.nodes, 'node')}{spares} but partition {partition} has "
            f"only {_plural(len(fitting), 'node')} that fit: {listed}"
        )
    return None


def unsatisfiable_reason(
    job: JobRequest,
    nodes: Sequence[NodeView],
    partition_nodes: Mapping[str, frozenset[str]] | None = None,
) -> str | None:
    """Why ``job`` could NEVER run, as one human sentence; None if it could.

    Used at submit time, so current usage and node state (DOWN/DRAIN) are ignored: a drained
    node may come back, and refusing a job because the cluster is busy would be wrong.
    ``partition_nodes`` (partition -> node names) overrides the partitions carried by each
    NodeView. When the job
    lists several partitions it is refused only if none could hold it; the reasons are joined.
    """
    if job.nodes < 1:
        return f"requested {job.nodes} nodes; at least 1 is required"
    for value, what in (
        (job.cpus_per_node, "CPUs"),
        (job.mem_per_node_mb, "MB of memory"),
        (job.gpus_per_node, "GPUs"),
    ):
        if value < 0:
            return f"requested a negative number of {what} per node ({value})"
    if job.time_limit_s is not None and job.time_limit_s < 0:
        return f"time limit must not be negative (got {job.time_limit_s} s)"
    if not job.partitions:
        return "no partition requested"

    by_name: dict[str, NodeView] = {}
    for n in nodes:
        by_name[n.name] = n
    ordered = sorted(by_name.values(), key=lambda n: _name_key(n.name))

    reasons: list[str] = []
    for partition in dict.fromkeys(job.partitions):
        if partition_nodes is not None:
            if partition not in partition_nodes:
                reasons.append(f"partition {partition} does not exist")
                continue
            names = partition_nodes[partition]
            members = [n for n in ordered if n.name in names]
        else:
            members = [n for n in ordered if partition in n.partitions]
        reason = _partition_reason(job, partition, members, by_name)
        if reason is None:
            return None
        reasons.append(reason)
    return "; ".join(reasons)
