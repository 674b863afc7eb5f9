"""Placement's rules asked one question at a time, for people: why a job waits (the
per-node predicates domain/explain.py words its reasons with) and why it could never run
(`unsatisfiable_reason`, the submit-time check a job is refused with).

These only read: they build a state or cluster of their own from their arguments and decide
with the scheduler's own fitting and reservation functions, so an explanation does not
disagree with a decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from phalanx.domain.placement_backfill import reserve
from phalanx.domain.placement_fit import fit_node, try_partitions, usable_in_cluster
from phalanx.domain.placement_state import IDLE, Cluster, Hold, State, holding, name_key
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView

__all__ = [
    "earliest_start",
    "fits_now",
    "node_free_at",
    "node_shortfall",
    "unsatisfiable_reason",
    "usable_nodes",
]


def node_shortfall(job: JobRequest, node: NodeView) -> str | None:
    """What an empty ``node`` lacks for one rank of ``job`` ("only 4 GPUs ..."), or None."""
    if fit_node(job, node, IDLE) is not None:
        return None
    return _why_not_node(job, node) or "not enough of the requested resources together"


def _usage_of(node: str, allocations: Iterable[Allocation]) -> tuple[State, list[Hold]]:
    return holding(a for a in allocations if a.node == node)


def fits_now(job: JobRequest, node: NodeView, allocations: Sequence[Allocation]) -> bool:
    """Whether one rank of ``job`` fits on ``node`` beside its running work, now (work past
    its time limit still holds what it holds until it has ended)."""
    state, _ = _usage_of(node.name, allocations)
    return fit_node(job, node, state.get(node.name)) is not None


def node_free_at(
    job: JobRequest, node: NodeView, allocations: Sequence[Allocation], now: float
) -> float | None:
    """When one rank of ``job`` fits on ``node``, replaying the known ends of its running work
    as the scheduler's backfill does (``now`` if it fits already; overdue work ends "now").
    None: it never fits by the known ends (work without a time limit holds what it needs)."""
    state, holds = _usage_of(node.name, allocations)
    if fit_node(job, node, state.get(node.name)) is not None:
        return now
    for end, h in sorted(
        ((max(h.end, now), h) for h in holds if h.end is not None), key=lambda e: e[0]
    ):
        state.remove(h)
        if fit_node(job, node, state.get(node.name)) is not None:
            return end
    return None


def usable_nodes(job: JobRequest, nodes: Sequence[NodeView]) -> frozenset[str]:
    """Every schedulable node the job could ever use (its partitions, exclusions, capacity)."""
    return usable_in_cluster(job, Cluster(nodes))


def earliest_start(
    job: JobRequest, nodes: Sequence[NodeView], allocations: Sequence[Allocation], now: float
) -> float | None:
    """The start the scheduler would reserve for ``job`` as the blocked head of the queue: the
    first time it fits when running work ends at its time limits (``now`` if it fits now).
    None when that cannot be known (it needs nodes held by work without a time limit, or
    nodes that are not schedulable)."""
    cluster = Cluster(nodes)
    state, holds = holding(allocations)
    if try_partitions(job, cluster, state) is not None:
        return now
    res = reserve(job, cluster, state, holds, now)
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
    ordered = sorted(by_name.values(), key=lambda n: name_key(n.name))

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
