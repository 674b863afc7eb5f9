"""Elastic jobs, hot spares and restart reservations in the pure core.

`restart_layout` (which nodes a job keeps after a node failure), placement of node ranges and
spares, and the scheduler's handling of restart reservations: the reserved job goes first, on
its nodes in rank order, and nobody else may use those nodes meanwhile.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from phalanx.domain import scheduling
from phalanx.domain.elastic import restart_layout
from phalanx.domain.placement import place
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView
from phalanx.domain.spec import JobSpec, PartitionInfo, normalize
from phalanx.errors import InvalidSpec

NOW = 1000.0


def nodes(n: int, cpus: int = 4) -> list[NodeView]:
    return [
        NodeView(
            name=f"n{i + 1:02d}",
            cpus=cpus,
            mem_mb=8000,
            gpus=(),
            features=frozenset(),
            partitions=frozenset({"batch"}),
            schedulable=True,
        )
        for i in range(n)
    ]


def job(job_id: int, n: int = 1, **kw: Any) -> JobRequest:
    base = JobRequest(
        job_id=job_id,
        partitions=("batch",),
        nodes=n,
        cpus_per_node=4,
        mem_per_node_mb=100,
        gpus_per_node=0,
        gpu_type=None,
        exclusive=False,
        constraint=None,
        nodelist=(),
        exclude=(),
        time_limit_s=3600,
    )
    return replace(base, **kw)


def busy(node: str, job_id: int = 99, end: float | None = None) -> Allocation:
    return Allocation(job_id, node, 4, 100, (), False, end)


# ------------------------------------------------------------------ restart_layout
def test_layout_elastic_drops_the_failed_rank_and_keeps_the_order() -> None:
    ranks = ["a", "b", "c", "d", "e"]
    assert restart_layout(ranks, [], {"c"}, nodes_min=4, elastic=True) == ["a", "b", "d", "e"]
    assert restart_layout(ranks, [], {"c", "d"}, nodes_min=4, elastic=True) is None


def test_layout_spare_takes_the_failed_rank() -> None:
    got = restart_layout(["a", "b", "c"], ["s1", "s2"], {"b"}, nodes_min=3, elastic=False)
    assert got == ["a", "s1", "c", "s2"]  # ranks 0..2, then the spare left over


def test_layout_fixed_job_without_spare_left_cannot_restart() -> None:
    assert restart_layout(["a", "b"], ["s"], {"a", "s"}, nodes_min=2, elastic=False) is None
    assert restart_layout(["a", "b"], [], {"b"}, nodes_min=2, elastic=False) is None


def test_layout_dead_spare_is_not_used() -> None:
    got = restart_layout(["a", "b"], ["s1", "s2"], {"a", "s1"}, nodes_min=2, elastic=False)
    assert got == ["s2", "b"]


# ------------------------------------------------------------------ ranges and spares
def test_elastic_job_takes_every_free_node_up_to_max() -> None:
    [p] = place([job(1, 4, nodes_max=8)], nodes(10), [], NOW)
    assert len(p.nodes) == 8 and p.spares == 0
    [p] = place([job(1, 4, nodes_max=8)], nodes(6), [], NOW)
    assert p.nodes == tuple(f"n{i:02d}" for i in range(1, 7))


def test_elastic_job_below_min_waits() -> None:
    allocs = [busy(f"n{i:02d}") for i in range(1, 6)]
    assert place([job(1, 4, nodes_max=8)], nodes(8), allocs, NOW) == []


def test_spares_are_allocated_with_the_job_after_the_ranks() -> None:
    [p] = place([job(1, 2, spares=1)], nodes(4), [], NOW)
    assert p.nodes == ("n01", "n02", "n03") and p.spares == 1
    assert p.rank_nodes == ("n01", "n02")
    # all or nothing: 2 ranks + 1 spare do not fit on 2 nodes
    assert place([job(1, 2, spares=1)], nodes(2), [], NOW) == []


def test_elastic_with_spares_keeps_the_spares_aside() -> None:
    [p] = place([job(1, 2, nodes_max=4, spares=1)], nodes(4), [], NOW)
    assert len(p.rank_nodes) == 3 and p.spares == 1


def test_backfill_reservation_uses_the_minimum() -> None:
    # head: an elastic 3-4 job blocked by two busy nodes that end at t+100. Reserved at MIN
    # it needs one of the two free nodes then, so one long job may take the other one; a
    # reservation at MAX would need both and let neither start.
    allocs = [busy("n01", end=NOW + 100), busy("n02", end=NOW + 100)]
    head = job(1, 3, nodes_max=4)
    long = job(3, 1, time_limit_s=10_000)
    got = place([head, long, replace(long, job_id=4)], nodes(4), allocs, NOW)
    assert [p.job_id for p in got] == [3]


# ------------------------------------------------------------------ restart reservations
def test_reserved_job_goes_first_on_its_nodes_in_rank_order() -> None:
    reserved = job(5, 2, nodes_max=4, reserved=("n04", "n02", "n03"))
    other = job(1, 2)  # higher priority (first in the list) but the nodes are reserved
    got = {p.job_id: p for p in place([other, reserved], nodes(5), [], NOW)}
    assert got[5].nodes[:3] == ("n04", "n02", "n03")
    # elastic growth with the free node left over after the reserved ones
    assert len(got[5].nodes) == 4
    assert got[5].nodes[3] == "n01"
    assert 1 not in got  # n05 alone is left for it


def test_nobody_takes_reserved_nodes_while_the_reserved_job_waits() -> None:
    # the reserved job cannot start yet (a rank node is busy); its nodes stay closed
    reserved = job(5, 3, spares=0, reserved=("n01", "n02", "n03"))
    allocs = [busy("n03")]
    other = job(1, 1)
    got = place([other, reserved], nodes(4), allocs, NOW)
    assert [(p.job_id, p.nodes) for p in got] == [(1, ("n04",))]


def test_reservation_from_another_pass_closes_its_nodes() -> None:
    got = place([job(1, 2)], nodes(3), [], NOW, reserved_nodes={"n01": 7, "n02": 7})
    assert got == []
    [p] = place([job(1, 1)], nodes(3), [], NOW, reserved_nodes={"n01": 7, "n02": 7})
    assert p.nodes == ("n03",)


def test_spare_restart_replaces_an_unusable_rank_and_refills_spares() -> None:
    views = nodes(5)
    views[1] = replace(views[1], schedulable=False)  # n02 went down after the reservation
    reserved = job(5, 3, spares=1, reserved=("n01", "n02", "n03", "n04"))
    [p] = place([reserved], views, [], NOW)
    assert p.rank_nodes == ("n01", "n04", "n03")  # the spare took rank 1, the others stayed
    assert p.nodes[3:] == ("n05",) and p.spares == 1  # a free node became the new spare


def test_fixed_reserved_job_without_replacement_waits() -> None:
    views = nodes(3)
    views[1] = replace(views[1], schedulable=False)
    assert place([job(5, 3, reserved=("n01", "n02", "n03"))], views, [], NOW) == []


def test_plan_uses_only_live_reservations() -> None:
    pending = [
        {
            "id": 5,
            "name": "x",
            "user": "u",
            "partitions": "batch",
            "nodes": 2,
            "cpus_per_node": 4,
            "mem_per_node_mb": 100,
            "gpus_per_node": 0,
            "gpu_type": None,
            "exclusive": False,
            "constraint_expr": None,
            "nodelist": [],
            "exclude": [],
            "time_limit_s": 3600,
            "dependency": [],
            "array_job_id": None,
            "array_limit": None,
            "reason": None,
            "nodes_max": 3,
            "spares": 0,
            "reserved_nodes": ["n03", "n02"],
            "reserved_until": NOW + 10,
        }
    ]

    class Snap:
        def __init__(self, until: float) -> None:
            pending[0]["reserved_until"] = until
            self.nodes = [
                {
                    "name": f"n{i:02d}",
                    "cpus": 4,
                    "mem_mb": 8000,
                    "gpus": [],
                    "features": [],
                    "registered": True,
                    "down": False,
                    "drain": False,
                }
                for i in (1, 2, 3)
            ]
            self.partitions = {"batch": {"name": "batch", "nodes": "*"}}
            self.allocations: list[dict[str, Any]] = []
            self.pending = pending
            self.dep_states: dict[int, Any] = {}
            self.dep_started: dict[int, bool] = {}
            self.active_names: set[tuple[str, str]] = set()
            self.array_active: dict[int, int] = {}
            self.reservations = [
                {"id": 5, "reserved_nodes": ["n03", "n02"], "reserved_until": until}
            ]

    [p] = scheduling.plan(Snap(NOW + 10), NOW).starts
    assert p.nodes == ("n03", "n02", "n01")  # reserved ranks first, then growth
    [p] = scheduling.plan(Snap(NOW - 1), NOW).starts  # expired: an ordinary placement
    assert p.nodes == ("n01", "n02", "n03")


# ------------------------------------------------------------------ spec
PARTS = {"batch": PartitionInfo("batch", True, 3600, None)}


def _norm(**kw: Any) -> Any:
    spec = JobSpec(wrap="true", **kw)
    return normalize(spec, PARTS, default_mem_per_cpu_mb=100, default_requeue=True)


def test_spec_accepts_ranges_and_spares() -> None:
    r = _norm(nodes=4, nodes_max=8, spares=1)
    assert (r.nodes, r.nodes_max, r.spares) == (4, 8, 1)
    assert _norm(nodes=4, nodes_max=4).nodes_max is None


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"nodes": 4, "nodes_max": 2}, "nodes"),
        ({"nodes": 2, "nodes_max": 4, "gpus_total": 8}, "gpus_total"),
        ({"nodes": 2, "nodes_max": 4, "ntasks": 8}, "ntasks"),
    ],
)
def test_spec_refuses_what_a_range_cannot_mean(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        _norm(**kw)
    assert e.value.details.get("field") == field, e.value.message


def test_submit_check_counts_spares() -> None:
    from phalanx.domain.placement_reasons import unsatisfiable_reason

    why = unsatisfiable_reason(job(1, 2, spares=1), nodes(2))
    assert why is not None and "2 nodes and 1 spare" in why, why
    assert unsatisfiable_reason(job(1, 2, nodes_max=8, spares=1), nodes(3)) is None


def test_elastic_nodelist_may_name_up_to_max_nodes() -> None:
    from phalanx.domain.placement_reasons import unsatisfiable_reason

    req = job(1, 2, nodes_max=4, nodelist=("n01", "n02", "n03"))
    assert unsatisfiable_reason(req, nodes(4)) is None
    [p] = place([req], nodes(4), [], NOW)
    assert set(p.nodes) >= {"n01", "n02", "n03"}


def test_restart_reservation_config_rule() -> None:
    from phalanx.config import load_config
    from phalanx.errors import ConfigError

    assert load_config(overrides={"timing": {"restart_reservation": 5.0}}).timing
    with pytest.raises(ConfigError, match="restart_reservation >= 2 \\* scheduler_interval"):
        load_config(overrides={"timing": {"restart_reservation": 1.0}})


def test_node_seconds_count_spares() -> None:
    from phalanx.controller.views import allocation_view

    attempts = [
        {
            "state": "ENDED",
            "start_time": 100.0,
            "end_time": 110.0,
            "tasks": [{"node": "a", "spare": False}, {"node": "s", "spare": True}],
        },
        {
            "state": "RUNNING",
            "start_time": 120.0,
            "end_time": None,
            "tasks": [{"node": "a", "spare": False}, {"node": "s2", "spare": True}],
        },
    ]
    got = allocation_view(attempts, now=130.0)
    assert got == {"spare_nodes": ["s2"], "node_seconds": 40.0, "spare_node_seconds": 20.0}
