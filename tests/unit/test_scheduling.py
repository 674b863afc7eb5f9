"""`phalanx.domain.scheduling.plan`: one pure scheduling pass over a hand-built snapshot."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.domain.scheduling import job_request, node_partitions, node_views, plan
from phalanx.domain.states import JobState
from phalanx.store.store import SchedSnapshot

NOW = 1_000_000.0


def node(name: str, cpus: int = 4, mem_mb: int = 8192, gpus: int = 0, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "cpus": cpus,
        "mem_mb": mem_mb,
        "gpus": [[i, "a100"] for i in range(gpus)],
        "features": kw.pop("features", []),
        "registered": kw.pop("registered", True),
        "down": kw.pop("down", False),
        "drain": kw.pop("drain", False),
    }


def job(jid: int, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": jid,
        "name": f"job{jid}",
        "user": "alice",
        "partitions": "batch",
        "nodes": 1,
        "cpus_per_node": 1,
        "mem_per_node_mb": 512,
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
    }
    base.update(kw)
    return base


def alloc(
    job_id: int,
    node_name: str,
    cpus: int,
    mem_mb: int = 512,
    gpu_ids: tuple[int, ...] = (),
    expected_end: float | None = None,
) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "node": node_name,
        "cpus": cpus,
        "mem_mb": mem_mb,
        "gpu_ids": list(gpu_ids),
        "exclusive": False,
        "expected_end": expected_end,
    }


def snap(
    nodes: list[dict[str, Any]],
    pending: list[dict[str, Any]],
    *,
    allocations: list[dict[str, Any]] | None = None,
    dep_states: dict[int, JobState] | None = None,
    dep_started: dict[int, bool] | None = None,
    active_names: set[tuple[str, str]] | None = None,
    array_active: dict[int, int] | None = None,
    partitions: dict[str, dict[str, Any]] | None = None,
) -> SchedSnapshot:
    return SchedSnapshot(
        nodes=nodes,
        partitions=partitions or {"batch": {"name": "batch", "nodes": "*"}},
        allocations=allocations or [],
        pending=pending,
        dep_states=dep_states or {},
        dep_started=dep_started or {},
        active_names=active_names or set(),
        array_active=array_active or {},
    )


def started(p: Any) -> list[int]:
    return [s.job_id for s in p.starts]


# --------------------------------------------------------------------------------------------
# dependencies
# --------------------------------------------------------------------------------------------


def test_afterok_on_failed_job_can_never_run() -> None:
    p = plan(
        snap(
            [node("n1")],
            [job(2, dependency=[{"type": "afterok", "jobs": [1]}])],
            dep_states={1: JobState.FAILED},
        ),
        NOW,
    )
    assert started(p) == []
    assert p.never == [(2, "dependency afterok:1 can never be satisfied: job 1 ended FAILED")]
    assert 2 not in p.reasons


def test_afterok_waits_then_starts() -> None:
    deps = [{"type": "afterok", "jobs": [1]}]
    p = plan(snap([node("n1")], [job(2, dependency=deps)], dep_states={1: JobState.RUNNING}), NOW)
    assert started(p) == [] and p.never == []
    assert p.reasons == {2: "Dependency (afterok:1)"}
    p = plan(snap([node("n1")], [job(2, dependency=deps)], dep_states={1: JobState.COMPLETED}), NOW)
    assert started(p) == [2] and p.reasons == {}


@pytest.mark.parametrize(
    ("kind", "dep_state", "outcome"),
    [
        ("afterany", JobState.FAILED, "start"),
        ("afterany", JobState.CANCELLED, "start"),
        ("afterany", JobState.PENDING, "wait"),
        ("afternotok", JobState.FAILED, "start"),
        ("afternotok", JobState.COMPLETED, "never"),
        ("afterok", JobState.TIMEOUT, "never"),
        ("afterok", JobState.COMPLETING, "wait"),
    ],
)
def test_dependency_verdicts(kind: str, dep_state: JobState, outcome: str) -> None:
    p = plan(
        snap(
            [node("n1")],
            [job(2, dependency=[{"type": kind, "jobs": [1]}])],
            dep_states={1: dep_state},
        ),
        NOW,
    )
    got = "start" if started(p) == [2] else "never" if p.never else "wait"
    assert got == outcome
    if outcome == "wait":
        assert p.reasons[2].startswith("Dependency")


def test_after_waits_for_start_only() -> None:
    deps = [{"type": "after", "jobs": [1]}]
    pending = [job(2, dependency=deps)]
    p = plan(
        snap([node("n1")], pending, dep_states={1: JobState.PENDING}, dep_started={1: False}), NOW
    )
    assert started(p) == [] and p.reasons[2] == "Dependency (after:1)"
    p = plan(
        snap([node("n1")], pending, dep_states={1: JobState.RUNNING}, dep_started={1: True}), NOW
    )
    assert started(p) == [2]


def test_purged_dependency() -> None:
    """A referenced job that no longer exists: afterok never, afterany satisfied."""
    p = plan(
        snap(
            [node("n1")],
            [
                job(2, dependency=[{"type": "afterok", "jobs": [1]}]),
                job(3, dependency=[{"type": "afterany", "jobs": [1]}]),
            ],
        ),
        NOW,
    )
    assert [j for j, _ in p.never] == [2] and started(p) == [3]


# --------------------------------------------------------------------------------------------
# arrays and singleton
# --------------------------------------------------------------------------------------------


def test_array_concurrency_limit() -> None:
    tasks = [job(10 + i, array_job_id=10, array_task_id=i, array_limit=2) for i in range(4)]
    p = plan(snap([node("n1", cpus=16)], tasks), NOW)
    assert started(p) == [10, 11]
    assert p.reasons == {
        12: "JobArrayTaskLimit (2 running at most)",
        13: "JobArrayTaskLimit (2 running at most)",
    }
    # one already running: only one more
    p = plan(snap([node("n1", cpus=16)], tasks[2:], array_active={10: 1}), NOW)
    assert started(p) == [12] and list(p.reasons) == [13]
    # an array without a limit starts everything that fits
    free = [{**t, "array_limit": None} for t in tasks]
    assert started(plan(snap([node("n1", cpus=16)], free), NOW)) == [10, 11, 12, 13]


def test_array_limit_slot_not_wasted_when_unplaced() -> None:
    """A task that was counted but did not fit must not leave the array below its limit forever."""
    tasks = [
        job(10 + i, array_job_id=10, array_task_id=i, array_limit=2, cpus_per_node=4)
        for i in range(3)
    ]
    p = plan(snap([node("n1", cpus=4)], tasks), NOW)
    assert started(p) == [10]
    assert p.reasons[11] == "Resources"


def test_singleton() -> None:
    single = [{"type": "singleton", "jobs": []}]
    a = job(1, name="train", dependency=single)
    b = job(2, name="train", dependency=single)
    other_user = job(3, name="train", user="bob", dependency=single)
    p = plan(snap([node("n1")], [a, b, other_user]), NOW)
    assert started(p) == [1, 3]
    assert p.reasons[2] == "Dependency (singleton: another job with this name and user is active)"
    p = plan(snap([node("n1")], [a], active_names={("train", "alice")}), NOW)
    assert started(p) == [] and "another job with this name and user is active" in p.reasons[1]
    # without the singleton dependency the name does not matter
    p = plan(snap([node("n1")], [job(4, name="train")], active_names={("train", "alice")}), NOW)
    assert started(p) == [4]


# --------------------------------------------------------------------------------------------
# placement outcomes and reasons
# --------------------------------------------------------------------------------------------


def test_reasons_resources_then_priority() -> None:
    nodes = [node("n1", cpus=4)]
    busy = [alloc(99, "n1", 4, expected_end=NOW + 600)]
    pending = [job(1, cpus_per_node=2), job(2, cpus_per_node=2), job(3, cpus_per_node=4)]
    p = plan(snap(nodes, pending, allocations=busy), NOW)
    assert started(p) == []
    assert p.reasons == {1: "Resources", 2: "Priority", 3: "Priority"}
    assert p.sentence() == "started 0 jobs, 3 waiting, 0 can never run"


def test_allocations_are_respected() -> None:
    nodes = [node("n1", cpus=4, gpus=2), node("n2", cpus=4)]
    busy = [alloc(99, "n1", 2, gpu_ids=(0,)), alloc(98, "n2", 3)]
    pending = [job(1, cpus_per_node=2, gpus_per_node=1), job(2, cpus_per_node=2)]
    p = plan(snap(nodes, pending, allocations=busy), NOW)
    (s1,) = [s for s in p.starts if s.job_id == 1]
    assert s1.nodes == ("n1",) and s1.gpu_ids == ((1,),)  # device 0 is taken
    assert 2 in p.reasons  # n1 is then full, n2 has only one free cpu


def test_unschedulable_nodes_are_skipped() -> None:
    nodes = [
        node("n1", drain=True),
        node("n2", down=True),
        node("n3", registered=False),
        node("n4"),
    ]
    p = plan(snap(nodes, [job(1), job(2, nodes=2)]), NOW)
    assert [(s.job_id, s.nodes) for s in p.starts] == [(1, ("n4",))]
    assert p.reasons == {2: "Resources"}


def test_multi_node_and_partition_membership() -> None:
    parts = {"gpu": {"name": "gpu", "nodes": "g*"}, "batch": {"name": "batch", "nodes": "c1,c2"}}
    nodes = [node("c1"), node("c2"), node("g1", gpus=4)]
    pending = [job(1, nodes=2, partitions="batch"), job(2, partitions="gpu", gpus_per_node=4)]
    p = plan(snap(nodes, pending, partitions=parts), NOW)
    by = {s.job_id: s for s in p.starts}
    assert by[1].nodes == ("c1", "c2") and by[1].partition == "batch"
    assert by[2].nodes == ("g1",) and by[2].gpu_ids == ((0, 1, 2, 3),)


def test_node_partitions_globs() -> None:
    parts = [
        {"name": "a", "nodes": "gpu[0-9]*"},
        {"name": "b", "nodes": "*"},
        {"name": "c", "nodes": "cpu1, cpu2"},
    ]
    assert node_partitions("cpu2", parts) == {"b", "c"}
    assert node_partitions("gpu7", parts) == {"a", "b"}


def test_node_views_and_job_request() -> None:
    (v,) = node_views(
        [node("n1", gpus=2, features=["ib"], drain=True)], {"b": {"name": "b", "nodes": "n*"}}
    )
    assert v.gpus == ((0, "a100"), (1, "a100")) and v.features == {"ib"}
    assert v.partitions == {"b"} and v.schedulable is False
    req = job_request(job(5, partitions="a,b", constraint_expr="ib&avx"))
    assert req.partitions == ("a", "b")
    assert req.constraint is not None
    assert req.constraint(frozenset({"ib", "avx"})) and not req.constraint(frozenset({"ib"}))
    p = plan(
        snap(
            [node("n1", features=["ib"]), node("n2", features=["ib", "avx"])],
            [job(5, constraint_expr="ib&avx")],
        ),
        NOW,
    )
    assert p.starts[0].nodes == ("n2",)


# --------------------------------------------------------------------------------------------
# the avoid list (nodes a job's failures happened on) is soft
# --------------------------------------------------------------------------------------------


def test_avoided_nodes_are_kept_off_while_other_nodes_could_hold_the_job() -> None:
    nodes = [node("n1"), node("n2"), node("n3"), node("n4")]
    j = job(5, nodes=2, avoid_nodes=["n1", "n2"])
    p = plan(snap(nodes, [j]), NOW)
    assert [list(s.nodes) for s in p.starts] == [["n3", "n4"]]


def test_a_job_whose_avoided_nodes_leave_too_few_schedulable_ones_runs_on_them() -> None:
    """Failures on n1 and n2 put them on the avoid list when n3 and n4 were fine; then n4
    was drained. Waiting for ever ("Resources") with n1 and n2 idle is what the soft list
    rules out (docs/retries.md); the user's own --exclude stays hard."""
    nodes = [node("n1"), node("n2"), node("n3"), node("n4", drain=True)]
    p = plan(snap(nodes, [job(5, nodes=2, avoid_nodes=["n1", "n2"])]), NOW)
    assert len(p.starts) == 1 and "n4" not in p.starts[0].nodes
    one = plan(snap(nodes, [job(6, avoid_nodes=["n1", "n2"])]), NOW)
    assert [list(s.nodes) for s in one.starts] == [["n3"]]  # n3 alone still holds a 1-node job
    hard = plan(snap(nodes, [job(7, nodes=2, exclude=["n1"], avoid_nodes=["n2"])]), NOW)
    assert [sorted(s.nodes) for s in hard.starts] == [["n2", "n3"]]
    never = plan(snap(nodes, [job(8, nodes=3, exclude=["n1"], avoid_nodes=["n2"])]), NOW)
    assert never.starts == []


def test_a_down_node_is_waited_for_rather_than_a_failed_one_used() -> None:
    """A DOWN (not drained) node comes back with its agent: the job waits for it rather
    than go back to the node it just failed on."""
    nodes = [node("n1"), node("n2", down=True)]
    assert plan(snap(nodes, [job(5, avoid_nodes=["n1"])]), NOW).starts == []
    drained = [node("n1"), node("n2", down=True, drain=True)]
    assert [
        list(s.nodes) for s in plan(snap(drained, [job(5, avoid_nodes=["n1"])]), NOW).starts
    ] == [["n1"]]
