"""What placement takes and returns: nodes and running allocations of one snapshot, the
resource shape of each eligible job, and the placements decided.

Plain frozen dataclasses, kept apart from the algorithm so that its callers (the scheduling
pass, preemption, maintenance, explanations) and placement's own modules (placement_state,
placement_fit, placement_backfill, placement_reasons, placement) share one vocabulary without
importing one another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Allocation", "JobRequest", "NodeView", "Placement"]


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

    def start_item(self, *, exclusive: bool = False, licenses: str | None = None) -> dict[str, Any]:
        """This placement as one item of `Store.start_attempts`, with the job's --exclusive
        and --licenses text (which the plan does not carry)."""
        return {
            "job_id": self.job_id,
            "partition": self.partition,
            "nodes": self.nodes,
            "cpus_per_node": self.cpus_per_node,
            "mem_per_node_mb": self.mem_per_node_mb,
            "gpu_ids": self.gpu_ids,
            "exclusive": exclusive,
            "spares": self.spares,
            "licenses": licenses,
        }
