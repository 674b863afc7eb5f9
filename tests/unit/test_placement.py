"""Tests for the pure placement decision (phalanx.domain.placement)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.domain.placement import place
from phalanx.domain.placement_reasons import unsatisfiable_reason
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView, Placement

NOW = 1000.0


def node(
    name: str,
    cpus: int = 8,
    mem: int = 8000,
    gpus: int = 0,
    gpu_type: str = "h100",
    features: Sequence[str] = (),
    partitions: Sequence[str] = ("batch",),
    schedulable: bool = True,
) -> NodeView:
    return NodeView(
        name=name,
        cpus=cpus,
        mem_mb=mem,
        gpus=tuple((i, gpu_type) for i in range(gpus)),
        features=frozenset(features),
        partitions=frozenset(partitions),
        schedulable=schedulable,
    )


def job(
    job_id: int,
    nodes: int = 1,
    cpus: int = 1,
    mem: int = 100,
    gpus: int = 0,
    gpu_type: str | None = None,
    exclusive: bool = False,
    constraint: Callable[[frozenset[str]], bool] | None = None,
    nodelist: Sequence[str] = (),
    exclude: Sequence[str] = (),
    time_limit: int | None = 3600,
    partitions: Sequence[str] = ("batch",),
) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        partitions=tuple(partitions),
        nodes=nodes,
        cpus_per_node=cpus,
        mem_per_node_mb=mem,
        gpus_per_node=gpus,
        gpu_type=gpu_type,
        exclusive=exclusive,
        constraint=constraint,
        nodelist=tuple(nodelist),
        exclude=tuple(exclude),
        time_limit_s=time_limit,
    )


def alloc(
    job_id: int,
    node_name: str,
    cpus: int = 1,
    mem: int = 100,
    gpu_ids: Sequence[int] = (),
    exclusive: bool = False,
    end: float | None = None,
) -> Allocation:
    return Allocation(job_id, node_name, cpus, mem, tuple(gpu_ids), exclusive, end)


def by_id(placements: list[Placement]) -> dict[int, Placement]:
    return {p.job_id: p for p in placements}


# ------------------------------------------------------------------------------------------
# Packing and multi-node
# ------------------------------------------------------------------------------------------


def test_single_node_job_packs_onto_partially_used_node() -> None:
    nodes = [node("n1"), node("n2"), node("n3")]
    allocs = [alloc(99, "n2", cpus=4)]
    [p] = place([job(1, cpus=2)], nodes, allocs, NOW)
    assert p.nodes == ("n2",)


def test_best_fit_prefers_fewest_cpus_left_then_name() -> None:
    nodes = [node("n1"), node("n2"), node("n3")]
    allocs = [alloc(98, "n1", cpus=2), alloc(99, "n3", cpus=5)]
    [p] = place([job(1, cpus=2)], nodes, allocs, NOW)
    assert p.nodes == ("n3",)  # 1 CPU left there vs 4 on n1
    [p] = place([job(1, cpus=2)], [node("b"), node("a")], [], NOW)
    assert p.nodes == ("a",)


def test_consecutive_small_jobs_fill_one_node_first() -> None:
    nodes = [node("n1", cpus=4), node("n2", cpus=4)]
    out = place([job(i, cpus=1) for i in range(1, 5)], nodes, [], NOW)
    assert {p.nodes for p in out} == {("n1",)}


def test_multi_node_job_is_all_or_nothing() -> None:
    nodes = [node("n1"), node("n2"), node("n3")]
    allocs = [alloc(99, "n2", cpus=8)]
    assert place([job(1, nodes=3, cpus=4)], nodes, allocs, NOW, backfill=False) == []
    [p] = place([job(1, nodes=2, cpus=4)], nodes, allocs, NOW)
    assert p.nodes == ("n1", "n3")


def test_multi_node_prefers_idle_nodes_in_natural_name_order() -> None:
    nodes = [node(f"node{i}") for i in (10, 2, 1, 3)]
    allocs = [alloc(99, "node1", cpus=1)]
    [p] = place([job(1, nodes=3, cpus=2)], nodes, allocs, NOW)
    assert p.nodes == ("node2", "node3", "node10")
    assert p.mem_per_node_mb == (100, 100, 100)
    assert p.gpu_ids == ((), (), ())


def test_multi_node_uses_partially_used_node_when_needed_and_ranks_by_name() -> None:
    nodes = [node("n1"), node("n2"), node("n3")]
    allocs = [alloc(99, "n1", cpus=1)]
    [p] = place([job(1, nodes=3, cpus=2)], nodes, allocs, NOW)
    assert p.nodes == ("n1", "n2", "n3")


# ------------------------------------------------------------------------------------------
# Exclusive, memory 0
# ------------------------------------------------------------------------------------------


def test_exclusive_job_needs_an_empty_node() -> None:
    nodes = [node("n1"), node("n2")]
    allocs = [alloc(99, "n1", cpus=1)]
    [p] = place([job(1, exclusive=True)], nodes, allocs, NOW)
    assert p.nodes == ("n2",)
    assert place([job(1, exclusive=True)], nodes[:1], allocs, NOW) == []


def test_exclusive_allocation_blocks_the_node() -> None:
    nodes = [node("n1"), node("n2")]
    allocs = [alloc(99, "n1", cpus=1, exclusive=True)]
    [p] = place([job(1)], nodes, allocs, NOW)
    assert p.nodes == ("n2",)


def test_exclusive_placement_blocks_later_jobs_in_same_call() -> None:
    out = place([job(1, exclusive=True), job(2)], [node("n1")], [], NOW)
    assert [p.job_id for p in out] == [1]


def test_mem_zero_takes_whole_node_memory() -> None:
    nodes = [node("n1", mem=4000), node("n2", mem=6000)]
    allocs = [alloc(99, "n1", cpus=1, mem=10)]
    [p] = place([job(1, mem=0)], nodes, allocs, NOW)
    assert p.nodes == ("n2",)
    assert p.mem_per_node_mb == (6000,)
    # After it, nothing needing memory fits on n2.
    out = place([job(1, mem=0), job(2, mem=1, exclude=["n1"])], nodes, allocs, NOW)
    assert [q.job_id for q in out] == [1]


def test_mem_zero_multi_node_resolves_per_node() -> None:
    nodes = [node("n1", mem=4000), node("n2", mem=6000)]
    [p] = place([job(1, nodes=2, mem=0)], nodes, [], NOW)
    assert p.mem_per_node_mb == (4000, 6000)


# ------------------------------------------------------------------------------------------
# GPUs
# ------------------------------------------------------------------------------------------


def test_gpu_devices_are_assigned_free_lowest_indices() -> None:
    nodes = [node("g1", gpus=4)]
    allocs = [alloc(99, "g1", gpu_ids=[0, 2])]
    [p] = place([job(1, gpus=2)], nodes, allocs, NOW)
    assert p.gpu_ids == ((1, 3),)
    assert p.gpu_type == "h100"


def test_gpu_devices_are_not_shared_within_one_call() -> None:
    nodes = [node("g1", gpus=4)]
    out = place([job(1, gpus=2), job(2, gpus=2), job(3, gpus=1)], nodes, [], NOW)
    assert [p.gpu_ids for p in out] == [((0, 1),), ((2, 3),)]


def test_gpu_type_filter_and_single_type_per_node() -> None:
    mixed = NodeView(
        "g1",
        16,
        8000,
        ((0, "a40"), (1, "a40"), (2, "h100"), (3, "h100"), (4, "h100")),
        frozenset(),
        frozenset({"gpu"}),
        True,
    )
    [p] = place([job(1, gpus=2, gpu_type="h100", partitions=["gpu"])], [mixed], [], NOW)
    assert p.gpu_ids == ((2, 3),) and p.gpu_type == "h100"
    # Any type: best fit picks the type with fewest free devices that still suffices (a40).
    [p] = place([job(1, gpus=2, partitions=["gpu"])], [mixed], [], NOW)
    assert p.gpu_ids == ((0, 1),) and p.gpu_type == "a40"
    # 4 GPUs of one type do not exist although the node has 5 GPUs.
    assert place([job(1, gpus=4, partitions=["gpu"])], [mixed], [], NOW) == []
    assert place([job(1, gpus=1, gpu_type="b200", partitions=["gpu"])], [mixed], [], NOW) == []


def test_cpu_job_on_gpu_node_gets_no_devices() -> None:
    [p] = place([job(1)], [node("g1", gpus=2)], [], NOW)
    assert p.gpu_ids == ((),) and p.gpu_type is None


# ------------------------------------------------------------------------------------------
# Filters and partitions
# ------------------------------------------------------------------------------------------


def test_constraint_nodelist_exclude() -> None:
    nodes = [node("n1", features=["ib"]), node("n2"), node("n3", features=["ib"])]
    has_ib = lambda f: "ib" in f  # noqa: E731
    [p] = place([job(1, constraint=has_ib, exclude=["n1"])], nodes, [], NOW)
    assert p.nodes == ("n3",)
    [p] = place([job(1, nodes=2, nodelist=["n3"])], nodes, [], NOW)
    assert p.nodes == ("n1", "n3")
    [p] = place([job(1, nodes=2, nodelist=["n3", "n2"])], nodes, [], NOW)
    assert p.nodes == ("n2", "n3")
    # A listed node that is busy blocks the job (all listed nodes must be included).
    busy = [alloc(99, "n3", cpus=8)]
    assert place([job(1, nodes=2, nodelist=["n3"])], nodes, busy, NOW, backfill=False) == []
    # More listed nodes than requested nodes can never be satisfied.
    assert place([job(1, nodes=1, nodelist=["n1", "n2"])], nodes, [], NOW) == []


def test_unschedulable_nodes_are_never_used() -> None:
    nodes = [node("n1", schedulable=False), node("n2")]
    [p] = place([job(1)], nodes, [], NOW)
    assert p.nodes == ("n2",)
    assert place([job(1, nodes=2)], nodes, [], NOW) == []


def test_first_partition_where_job_fits_now_wins() -> None:
    nodes = [node("a1", partitions=["short"]), node("b1", partitions=["long"])]
    busy = [alloc(99, "a1", cpus=8)]
    [p] = place([job(1, partitions=["short", "long"])], nodes, busy, NOW)
    assert (p.partition, p.nodes) == ("long", ("b1",))
    [p] = place([job(1, partitions=["short", "long"])], nodes, [], NOW)
    assert (p.partition, p.nodes) == ("short", ("a1",))


def test_nodes_only_in_their_partitions() -> None:
    nodes = [node("a1", partitions=["debug"]), node("b1", partitions=["batch"])]
    assert place([job(1, nodes=2)], nodes, [], NOW) == []


def test_duplicate_job_ids_start_once() -> None:
    out = place([job(1), job(1)], [node("n1")], [], NOW)
    assert len(out) == 1


# ------------------------------------------------------------------------------------------
# Priority and backfill
# ------------------------------------------------------------------------------------------


def test_strict_priority_stops_at_first_blocked_job() -> None:
    nodes = [node("n1"), node("n2")]
    allocs = [alloc(99, "n1", cpus=8, end=NOW + 100)]
    jobs = [job(1, nodes=2), job(2, time_limit=10)]
    assert place(jobs, nodes, allocs, NOW, backfill=False) == []


def test_short_job_backfills_around_blocked_big_job() -> None:
    nodes = [node("n1"), node("n2")]
    allocs = [alloc(99, "n1", cpus=8, end=NOW + 100)]
    jobs = [job(1, nodes=2, cpus=8), job(2, cpus=4, time_limit=50)]
    out = place(jobs, nodes, allocs, NOW)
    assert [(p.job_id, p.nodes) for p in out] == [(2, ("n2",))]


def test_long_job_does_not_delay_reservation() -> None:
    nodes = [node("n1"), node("n2")]
    allocs = [alloc(99, "n1", cpus=8, end=NOW + 100)]
    jobs = [job(1, nodes=2, cpus=8), job(2, cpus=4, time_limit=500)]
    assert place(jobs, nodes, allocs, NOW) == []
    unlimited = [job(1, nodes=2, cpus=8), job(2, cpus=4, time_limit=None)]
    assert place(unlimited, nodes, allocs, NOW) == []


def test_long_job_may_use_nodes_the_reserved_job_does_not_need() -> None:
    nodes = [node("n1"), node("n2"), node("n3")]
    allocs = [alloc(98, "n1", cpus=8, end=NOW + 100), alloc(99, "n2", cpus=8, end=NOW + 100)]
    # Head needs 2 full nodes: reserved at NOW+100 on n1+n2 (name order). n3 is not needed, so
    # even a job without a time limit may take it; job 3 fits nowhere now.
    jobs = [job(1, nodes=2, cpus=8), job(2, cpus=8, time_limit=None), job(3, cpus=1)]
    out = place(jobs, nodes, allocs, NOW)
    assert [(p.job_id, p.nodes) for p in out] == [(2, ("n3",))]


def test_long_job_may_share_reserved_node_with_spare_cpus() -> None:
    nodes = [node("n1", cpus=16)]
    allocs = [alloc(99, "n1", cpus=12, end=NOW + 100)]
    jobs = [job(1, cpus=8), job(2, cpus=4, time_limit=None), job(3, cpus=4, time_limit=None)]
    out = place(jobs, nodes, allocs, NOW)
    # Head gets 8 of 16 at NOW+100: 8 spare, but only 4 are free now.
    assert [p.job_id for p in out] == [2]


def test_reservation_counts_jobs_placed_earlier_in_the_call() -> None:
    nodes = [node("n1"), node("n2")]
    jobs = [job(1, cpus=8, time_limit=100), job(2, nodes=2, cpus=8), job(3, cpus=8, time_limit=99)]
    out = place(jobs, nodes, [], NOW)
    # Job 1 takes n1 until NOW+100, head (2) reserved at NOW+100, job 3 ends in time.
    assert [(p.job_id, p.nodes) for p in out] == [(1, ("n1",)), (3, ("n2",))]
    jobs[2] = job(3, cpus=8, time_limit=101)
    assert [p.job_id for p in place(jobs, nodes, [], NOW)] == [1]


def test_overdue_allocation_counts_as_ending_now() -> None:
    nodes = [node("n1"), node("n2")]
    allocs = [alloc(99, "n1", cpus=8, end=NOW - 5)]
    jobs = [job(1, nodes=2, cpus=8), job(2, cpus=8, time_limit=60)]
    assert place(jobs, nodes, allocs, NOW) == []


def test_unknown_end_closes_head_nodes_but_not_others() -> None:
    nodes = [
        node("n1", partitions=["gpu"]),
        node("n2", partitions=["gpu"]),
        node("c1", partitions=["batch"]),
    ]
    allocs = [alloc(99, "n1", cpus=8, end=None)]
    jobs = [
        job(1, nodes=2, cpus=8, partitions=["gpu"]),
        job(2, cpus=1, time_limit=1, partitions=["gpu"]),
        job(3, cpus=1, partitions=["batch"]),
    ]
    out = place(jobs, nodes, allocs, NOW)
    assert [(p.job_id, p.nodes) for p in out] == [(3, ("c1",))]


def test_job_impossible_on_idle_cluster_does_not_block_others() -> None:
    nodes = [node("n1"), node("n2", schedulable=False)]
    jobs = [job(1, nodes=2), job(2)]
    assert [p.job_id for p in place(jobs, nodes, [], NOW, backfill=False)] == [2]


def test_only_the_first_blocked_job_gets_a_reservation() -> None:
    nodes = [node("n1"), node("n2")]
    allocs = [alloc(99, "n1", cpus=8, end=NOW + 100)]
    jobs = [
        job(1, nodes=2, cpus=8),  # head, reserved at NOW+100
        job(2, cpus=8, time_limit=None),  # blocked, no reservation
        job(3, cpus=2, time_limit=50),  # ends before the head: may run on n2
    ]
    out = place(jobs, nodes, allocs, NOW)
    assert [(p.job_id, p.nodes) for p in out] == [(3, ("n2",))]


def test_deterministic() -> None:
    nodes = [node(f"n{i}", gpus=2) for i in range(5)]
    jobs = [job(i, nodes=1 + i % 2, cpus=3, gpus=1) for i in range(8)]
    assert place(jobs, nodes, [], NOW) == place(jobs, list(reversed(nodes)), [], NOW)


# ------------------------------------------------------------------------------------------
# unsatisfiable_reason
# ------------------------------------------------------------------------------------------

GPU_NODES = [
    node("g1", cpus=64, mem=512000, gpus=8, gpu_type="h100", partitions=["gpu"]),
    node("g2", cpus=64, mem=512000, gpus=4, gpu_type="a40", partitions=["gpu"]),
    node("c1", cpus=32, mem=64000, partitions=["batch", "debug"], features=["avx512"]),
    node("c2", cpus=32, mem=64000, partitions=["batch", "debug"], schedulable=False),
    node("c3", cpus=16, mem=128000, partitions=["batch"]),
]


def test_unsatisfiable_none_when_possible_even_if_drained() -> None:
    assert unsatisfiable_reason(job(1, nodes=3, cpus=16), GPU_NODES) is None
    assert unsatisfiable_reason(job(1, nodes=2, partitions=["debug"]), GPU_NODES) is None
    j = job(1, gpus=8, gpu_type="h100", partitions=["gpu"])
    assert unsatisfiable_reason(j, GPU_NODES) is None


def test_unsatisfiable_gpu_messages() -> None:
    j = job(1, gpus=9, gpu_type="h100", partitions=["gpu"])
    assert unsatisfiable_reason(j, GPU_NODES) == (
        "requested 9 GPUs of type h100 per node but the largest node in partition gpu has 8"
    )
    j = job(1, gpus=1, gpu_type="b200", partitions=["gpu"])
    assert unsatisfiable_reason(j, GPU_NODES) == (
        "gpu type 'b200' does not exist on any node in partition gpu (types: a40, h100)"
    )
    j = job(1, gpus=1, partitions=["batch"])
    assert unsatisfiable_reason(j, GPU_NODES) == (
        "requested 1 GPU per node but the largest node in partition batch has no GPUs"
    )


def test_unsatisfiable_cpu_mem_and_count_messages() -> None:
    reason = unsatisfiable_reason(job(1, cpus=65, partitions=["gpu"]), GPU_NODES)
    assert reason == "requested 65 CPUs per node but the largest node in partition gpu has 64"
    reason = unsatisfiable_reason(job(1, mem=200000), GPU_NODES)
    assert reason is not None and "200000 MB" in reason and "128000 MB" in reason
    reason = unsatisfiable_reason(job(1, nodes=3, partitions=["debug"]), GPU_NODES)
    assert reason == "requested 3 nodes but partition debug has only 2 nodes that fit: c1, c2"
    # Each resource exists somewhere, but not together on one node.
    reason = unsatisfiable_reason(job(1, cpus=32, mem=100000), GPU_NODES)
    assert reason is not None and reason.startswith("no single node in partition batch")


def test_unsatisfiable_filters_messages() -> None:
    avx = lambda f: "avx512" in f  # noqa: E731
    never = lambda f: "quantum" in f  # noqa: E731
    reason = unsatisfiable_reason(job(1, constraint=never), GPU_NODES)
    assert reason is not None and "no node in partition batch satisfies" in reason
    assert unsatisfiable_reason(job(1, constraint=avx), GPU_NODES) is None
    reason = unsatisfiable_reason(job(1, nodelist=["g1"]), GPU_NODES)
    assert reason == "node g1 in --nodelist is not in partition batch"
    reason = unsatisfiable_reason(job(1, nodelist=["node09"]), GPU_NODES)
    assert reason == "node node09 in --nodelist does not exist"
    reason = unsatisfiable_reason(job(1, cpus=20, nodelist=["c3"]), GPU_NODES)
    assert reason is not None and reason.startswith("node c3 in --nodelist can never hold")
    reason = unsatisfiable_reason(job(1, exclude=["c1", "c2", "c3"]), GPU_NODES)
    assert reason is not None and "excluded" in reason
    assert unsatisfiable_reason(job(1, nodes=0), GPU_NODES) is not None


def test_unsatisfiable_partition_mapping_and_multiple_partitions() -> None:
    mapping = {"batch": frozenset({"c1"}), "gpu": frozenset({"g1", "g2"})}
    reason = unsatisfiable_reason(job(1, nodes=2), GPU_NODES, mapping)
    assert reason == "requested 2 nodes but partition batch has only 1 node that fit: c1"
    reason = unsatisfiable_reason(job(1, partitions=["nope"]), GPU_NODES, mapping)
    assert reason == "partition nope does not exist"
    # Possible in the second partition: fine.
    both = ["batch", "gpu"]
    assert unsatisfiable_reason(job(1, nodes=2, partitions=both), GPU_NODES, mapping) is None
    reason = unsatisfiable_reason(job(1, nodes=5, partitions=both), GPU_NODES, mapping)
    assert reason is not None and "partition batch" in reason and "partition gpu" in reason


# ------------------------------------------------------------------------------------------
# Property tests
# ------------------------------------------------------------------------------------------

NAMES = [f"n{i}" for i in range(1, 7)]
FEATURE_PREDICATES: list[Callable[[frozenset[str]], bool] | None] = [
    None,
    lambda f: "x" in f,
    lambda f: "y" not in f,
]


@st.composite
def node_views(draw: st.DrawFn) -> list[NodeView]:
    count = draw(st.integers(1, 5))
    out = []
    for name in NAMES[:count]:
        ngpu = draw(st.integers(0, 4))
        types = draw(st.lists(st.sampled_from(["a", "b"]), min_size=ngpu, max_size=ngpu))
        out.append(
            NodeView(
                name=name,
                cpus=draw(st.sampled_from([2, 4, 8])),
                mem_mb=draw(st.sampled_from([1000, 2000, 4000])),
                gpus=tuple(enumerate(types)),
                features=frozenset(draw(st.sets(st.sampled_from(["x", "y"])))),
                partitions=frozenset(draw(st.sets(st.sampled_from(["p", "q"]), min_size=1))),
                schedulable=draw(st.sampled_from([True, True, True, False])),
            )
        )
    return out


@st.composite
def allocations_for(draw: st.DrawFn, nodes: list[NodeView]) -> list[Allocation]:
    """Valid running allocations: built greedily so the starting state is not overcommitted."""
    out: list[Allocation] = []
    for i in range(draw(st.integers(0, 6))):
        n = draw(st.sampled_from(nodes))
        on_node = [a for a in out if a.node == n.name]
        if any(a.exclusive for a in on_node):
            continue
        exclusive = draw(st.booleans()) and not on_node
        cpus = draw(st.integers(0, n.cpus - sum(a.cpus for a in on_node)))
        mem = draw(st.integers(0, n.mem_mb - sum(a.mem_mb for a in on_node)))
        used = {g for a in on_node for g in a.gpu_ids}
        free = [idx for idx, _ in n.gpus if idx not in used]
        k = draw(st.integers(0, len(free)))
        end = draw(st.sampled_from([None, NOW + 2000]) | st.floats(NOW - 50, NOW + 2000))
        out.append(Allocation(500 + i, n.name, cpus, mem, tuple(free[:k]), exclusive, end))
    return out


@st.composite
def job_requests(draw: st.DrawFn, job_id: int) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        partitions=tuple(
            draw(st.lists(st.sampled_from(["p", "q"]), min_size=1, max_size=2, unique=True))
        ),
        nodes=draw(st.sampled_from([1, 1, 1, 2, 3])),
        cpus_per_node=draw(st.integers(0, 6)),
        mem_per_node_mb=draw(st.sampled_from([0, 300, 300, 1000, 3000])),
        gpus_per_node=draw(st.sampled_from([0, 0, 0, 1, 2, 3])),
        gpu_type=draw(st.sampled_from([None, None, "a", "b"])),
        exclusive=draw(st.sampled_from([False, False, False, True])),
        constraint=draw(st.sampled_from(FEATURE_PREDICATES)),
        nodelist=tuple(draw(st.lists(st.sampled_from(NAMES[:4]), max_size=1))),
        exclude=tuple(draw(st.lists(st.sampled_from(NAMES[:4]), max_size=1))),
        time_limit_s=draw(st.one_of(st.none(), st.integers(0, 1500))),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[NodeView], list[Allocation], list[JobRequest], bool]:
    nodes = draw(node_views())
    allocs = draw(allocations_for(nodes))
    jobs = [draw(job_requests(i)) for i in range(1, draw(st.integers(1, 7)) + 1)]
    return nodes, allocs, jobs, draw(st.booleans())


def as_allocations(p: Placement, j: JobRequest, now: float) -> list[Allocation]:
    end = None if j.time_limit_s is None else now + j.time_limit_s
    return [
        Allocation(p.job_id, n, p.cpus_per_node, m, g, j.exclusive, end)
        for n, m, g in zip(p.nodes, p.mem_per_node_mb, p.gpu_ids, strict=True)
    ]


# Modest by default so the file runs in seconds; PX_EX=3000 for a deep local fuzz.
PROPS = settings(
    max_examples=int(os.environ.get("PX_EX", "75")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@PROPS
@given(scenarios())
def test_property_no_overcommit_and_filters_hold(
    scenario: tuple[list[NodeView], list[Allocation], list[JobRequest], bool],
) -> None:
    nodes, allocs, jobs, backfill = scenario
    out = place(jobs, nodes, allocs, NOW, backfill=backfill)
    view = {n.name: n for n in nodes}
    jobs_by_id = {j.job_id: j for j in jobs}
    assert len({p.job_id for p in out}) == len(out)
    holders = list(allocs)
    for p in out:
        j = jobs_by_id[p.job_id]
        assert len(p.nodes) == j.nodes == len(set(p.nodes))
        assert p.partition in j.partitions
        assert set(j.nodelist) <= set(p.nodes)
        for name, mem, gids in zip(p.nodes, p.mem_per_node_mb, p.gpu_ids, strict=True):
            n = view[name]
            assert n.schedulable and p.partition in n.partitions
            assert name not in j.exclude
            assert j.constraint is None or j.constraint(n.features)
            assert mem == (n.mem_mb if j.mem_per_node_mb == 0 else j.mem_per_node_mb)
            assert len(gids) == j.gpus_per_node
            types = {t for idx, t in n.gpus if idx in gids}
            assert len(types) <= 1
            if j.gpu_type is not None and gids:
                assert types == {j.gpu_type}
        holders += as_allocations(p, j, NOW)
    for name, n in view.items():
        here = [a for a in holders if a.node == name]
        assert sum(a.cpus for a in here) <= n.cpus
        assert sum(a.mem_mb for a in here) <= n.mem_mb
        devices = [g for a in here for g in a.gpu_ids]
        assert len(devices) == len(set(devices))
        assert set(devices) <= {idx for idx, _ in n.gpus}
        if any(a.exclusive for a in here):
            assert len(here) == 1
    mem_zero = [
        a
        for a in holders
        if jobs_by_id.get(a.job_id) and a.job_id < 500 and jobs_by_id[a.job_id].mem_per_node_mb == 0
    ]
    for a in mem_zero:
        assert [b for b in holders if b.node == a.node and b.mem_mb > 0] == [a]


@PROPS
@given(scenarios())
def test_property_head_is_placed_when_it_fits(
    scenario: tuple[list[NodeView], list[Allocation], list[JobRequest], bool],
) -> None:
    nodes, allocs, jobs, backfill = scenario
    alone = place(jobs[:1], nodes, allocs, NOW)
    out = place(jobs, nodes, allocs, NOW, backfill=backfill)
    if alone:
        assert out[:1] == alone


def _placed_at(j: JobRequest, nodes: list[NodeView], holders: list[Allocation], t: float) -> bool:
    """Would ``j`` start at time t, given that everything ending by t has ended?"""
    remaining = [a for a in holders if a.expected_end is None or max(a.expected_end, NOW) > t]
    return bool(place([j], nodes, remaining, t))


@PROPS
@given(scenarios())
def test_property_backfill_never_delays_the_blocked_head(
    scenario: tuple[list[NodeView], list[Allocation], list[JobRequest], bool],
) -> None:
    nodes, allocs, jobs, _ = scenario
    out = place(jobs, nodes, allocs, NOW)
    placed = {p.job_id for p in out}
    jobs_by_id = {j.job_id: j for j in jobs}
    head = next((j for j in jobs if j.job_id not in placed and place([j], nodes, [], NOW)), None)
    if head is None:
        return
    before = [p for p in out if jobs.index(jobs_by_id[p.job_id]) < jobs.index(head)]
    holders = list(allocs)
    for p in before:
        holders += as_allocations(p, jobs_by_id[p.job_id], NOW)
    times = sorted({max(a.expected_end, NOW) for a in holders if a.expected_end is not None})
    start = next((t for t in times if _placed_at(head, nodes, holders, t)), None)
    all_holders = list(allocs)
    for p in out:
        all_holders += as_allocations(p, jobs_by_id[p.job_id], NOW)
    if start is not None:
        assert _placed_at(head, nodes, all_holders, start)
    else:
        # No computable reservation: nothing after the head may touch a node it could use.
        usable = {
            n.name for n in nodes if place([replace(head, nodes=1, nodelist=())], [n], [], NOW)
        }
        after = [p for p in out if p not in before]
        assert not usable & {name for p in after for name in p.nodes}


@PROPS
@given(node_views(), st.integers(1, 10_000).flatmap(job_requests))
def test_property_unsatisfiable_agrees_with_idle_cluster(
    nodes: list[NodeView], j: JobRequest
) -> None:
    all_up = [replace(n, schedulable=True) for n in nodes]
    reason = unsatisfiable_reason(j, nodes)
    fits = bool(place([j], all_up, [], NOW))
    assert (reason is None) == fits, reason


def test_node_usage_rechecks_chosen_placements_by_placements_rule() -> None:
    """The start transaction's re-check (Store._fitting) uses placement's own rule."""
    from phalanx.domain.placement import NodeUsage

    u = NodeUsage()
    u.add("n1", 2, 1024, [0], False)
    assert u.fits("n1", 4, 4096, 2, 1024, [1], False)
    assert not u.fits("n1", 4, 4096, 3, 1024, [1], False)  # CPUs
    assert not u.fits("n1", 4, 2048, 2, 1025, [1], False)  # memory
    assert not u.fits("n1", 4, 4096, 1, 1024, [0], False)  # a GPU device already held
    assert not u.fits("n1", 4, 4096, 1, 1024, [], True)  # exclusive needs an idle node
    assert u.fits("n2", 4, 4096, 4, 4096, [0], True)  # an idle node takes it
    u.add("n2", 1, 1, [], True)
    assert not u.fits("n2", 4, 4096, 1, 1, [], False)  # nothing beside an exclusive job
