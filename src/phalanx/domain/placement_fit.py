"""Whether a job fits now, and where: on one node (`fit_node`), in one partition
(`fit_in_partition` node by node, or `fit_classes` class by class with the same answer), in the
first partition of its list that takes it (`try_partitions`), and the restart of a job on its
reserved nodes (`place_reserved`).

The packing rules live here: a single-node job takes the tightest partially used node, a
multi-node job idle nodes in name order, GPUs are chosen best-fit by type, and topology rules
(--switches, --spread, spares) are domain/topology.py's. The scheduling pass, the backfill
reservation and the explanations all decide "fits" with these functions, so they cannot
disagree.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from phalanx.domain import topology
from phalanx.domain.placement_state import IDLE, ClassKey, Cluster, State, Usage, name_key, shares
from phalanx.domain.placement_types import JobRequest, NodeView, Placement

__all__ = [
    "NodeFit",
    "classable",
    "fit_classes",
    "fit_in_partition",
    "fit_node",
    "job_shape",
    "place_reserved",
    "statically_eligible",
    "try_partitions",
    "usable_in_cluster",
]


@dataclass(frozen=True, slots=True)
class NodeFit:
    node: NodeView
    mem: int
    gpu_ids: tuple[int, ...]
    gpu_type: str | None
    idle: bool
    cpus_left: int
    gpus_left: int
    mem_left: int


def fit_node(job: JobRequest, node: NodeView, u: Usage) -> NodeFit | None:
    """Whether one node can take one rank of ``job`` on top of usage ``u``, and with what."""
    if not shares(u, job.exclusive):
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
        return NodeFit(node, mem, (), None, u.holders == 0, cpus_left, free_total, mem_left)
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
    return NodeFit(
        node,
        mem,
        chosen,
        gtype,
        u.holders == 0,
        cpus_left,
        free_total - len(chosen),
        mem_left,
    )


def statically_eligible(job: JobRequest, node: NodeView) -> bool:
    """Whether ``node`` passes the job's --exclude list and --constraint (usage and partition
    aside)."""
    if node.name in job.exclude:
        return False
    return job.constraint is None or bool(job.constraint(node.features))


def fit_in_partition(
    job: JobRequest,
    partition: str,
    cluster: Cluster,
    state: State,
    closed: frozenset[str],
) -> Placement | None:
    """All-or-nothing choice of ``job.nodes`` nodes (up to ``job.nodes_max`` for an elastic
    job) plus ``job.spares`` spare nodes in one partition, or None."""
    if job.nodes < 1:
        return None
    required = list(dict.fromkeys(job.nodelist))
    if len(required) > max(job.nodes, job.nodes_max or 0):
        return None
    fits: dict[str, NodeFit] = {}
    for node in cluster.by_partition.get(partition, ()):
        if node.name in closed or not statically_eligible(job, node):
            continue
        f = fit_node(job, node, state.get(node.name))
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
            key=lambda f: (f.idle, f.cpus_left, f.gpus_left, f.mem_left, name_key(f.node.name))
        )
    else:
        # Multi-node: idle nodes first (they are the ones big jobs are kept whole for and avoid
        # noisy neighbours), then name order for a stable, readable rank layout.
        others.sort(key=lambda f: (not f.idle, name_key(f.node.name)))
    picked = _pick(job, others, ranks - len(required), spares, required, cluster)
    if picked is None:
        return None
    rank_fits = [fits[r] for r in required] + picked[: ranks - len(required)]
    spare_fits = picked[ranks - len(required) :]
    return _placement(job, partition, rank_fits, spare_fits)


def _placement(
    job: JobRequest, partition: str, rank_fits: list[NodeFit], spare_fits: list[NodeFit]
) -> Placement:
    """The placement of the chosen nodes: ranks, then spares, each in natural name order."""
    rank_fits.sort(key=lambda f: name_key(f.node.name))
    spare_fits.sort(key=lambda f: name_key(f.node.name))
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


def _pick(
    job: JobRequest,
    others: list[NodeFit],
    ranks: int,
    spares: int,
    required: list[str],
    cluster: Cluster,
) -> list[NodeFit] | None:
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


def try_partitions(
    job: JobRequest,
    cluster: Cluster,
    state: State,
    closed: frozenset[str] = frozenset(),
) -> Placement | None:
    """First partition in the job's list where it fits on ``state``."""
    for partition in job.partitions:
        p = fit_in_partition(job, partition, cluster, state, closed)
        if p is not None:
            return p
    return None


def usable_in_cluster(job: JobRequest, cluster: Cluster) -> frozenset[str]:
    """Every schedulable node the job could ever use (in its partitions, capacity permitting)."""
    names: set[str] = set()
    for partition in job.partitions:
        for node in cluster.by_partition.get(partition, ()):
            if statically_eligible(job, node) and fit_node(job, node, IDLE) is not None:
                names.add(node.name)
    return frozenset(names)


# --------------------------------------------------------------------------------------------
# Node classes: placement against groups of identical nodes instead of node by node
# --------------------------------------------------------------------------------------------

_MISS = object()


def classable(job: JobRequest, cluster: Cluster) -> bool:
    """Whether `fit_classes` decides this job exactly as `fit_in_partition` would: no
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


def job_shape(job: JobRequest) -> tuple[object, ...]:
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


def fit_classes(
    job: JobRequest,
    partition: str,
    cluster: Cluster,
    state: State,
    memo: dict[ClassKey, NodeFit | None],
) -> Placement | None:
    """`fit_in_partition` for a classable job on an indexed state, class by class: the
    same nodes in the same order (packing for one node, idle nodes then name order for
    several), at the cost of one `fit_node` per class and shape (``memo``)."""
    index = state.index
    assert index is not None
    index.refresh(state)
    classes = index.parts.get(partition)
    if not classes:
        return None
    fitting: list[tuple[NodeFit, list[int]]] = []
    total = 0
    for k, members in classes.items():
        f = memo.get(k, _MISS)
        if f is _MISS:
            rep = cluster.ordered[members[0]]
            ok = job.constraint is None or bool(job.constraint(rep.features))
            f = fit_node(job, rep, state.get(rep.name)) if ok else None
            memo[k] = f
        if f is not None:
            assert isinstance(f, NodeFit)
            fitting.append((f, members))
            total += len(members)
    spares = max(0, job.spares)
    ranks = job.nodes
    if job.nodes_max is not None and job.nodes_max > job.nodes:
        ranks = max(job.nodes, min(job.nodes_max, total - spares))
    need = ranks + spares
    if total < need:
        return None
    groups: dict[tuple[object, ...], list[tuple[NodeFit, list[int]]]] = {}
    for f, members in fitting:
        g = (f.idle, f.cpus_left, f.gpus_left, f.mem_left) if job.nodes == 1 else (not f.idle,)
        groups.setdefault(g, []).append((f, members))
    picked: list[NodeFit] = []
    for gk in sorted(groups):
        group = groups[gk]
        heap = [(members[0], i, 0) for i, (_, members) in enumerate(group)]
        heapq.heapify(heap)
        while heap and len(picked) < need:
            o, i, at = heapq.heappop(heap)
            f, members = group[i]
            n = cluster.ordered[o]
            picked.append(
                NodeFit(
                    n, f.mem, f.gpu_ids, f.gpu_type, f.idle, f.cpus_left, f.gpus_left, f.mem_left
                )
            )
            if at + 1 < len(members):
                heapq.heappush(heap, (members[at + 1], i, at + 1))
        if len(picked) >= need:
            break
    return _placement(job, partition, picked[:ranks], picked[ranks:need])


# --------------------------------------------------------------------------------------------
# A restart on its reserved nodes
# --------------------------------------------------------------------------------------------


def place_reserved(
    job: JobRequest, cluster: Cluster, state: State, closed: frozenset[str]
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

        def fit(name: str, members: dict[str, NodeView] = members) -> NodeFit | None:
            node = members.get(name)
            if node is None or not statically_eligible(job, node):
                return None
            return fit_node(job, node, state.get(name))

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
            free.sort(key=lambda f: (not f.idle, name_key(f.node.name)))
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
