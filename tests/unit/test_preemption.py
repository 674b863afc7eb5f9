"""Victim selection (domain/preemption.py): tiers, minimal work lost, gang-atomic, exempt time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.domain import preemption
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView
from phalanx.domain.preemption import Mode, Running, Tiers

NOW = 10_000.0


def view(name: str, cpus: int = 4) -> NodeView:
    return NodeView(
        name=name,
        cpus=cpus,
        mem_mb=8192,
        gpus=(),
        features=frozenset(),
        partitions=frozenset({"batch"}),
        schedulable=True,
    )


def request(jid: int, nodes: int = 1, cpus: int = 4) -> JobRequest:
    return JobRequest(
        job_id=jid,
        partitions=("batch",),
        nodes=nodes,
        cpus_per_node=cpus,
        mem_per_node_mb=1,
        gpus_per_node=0,
        gpu_type=None,
        exclusive=False,
        constraint=None,
        nodelist=(),
        exclude=(),
        time_limit_s=None,
    )


def running(
    jid: int,
    nodes: tuple[str, ...],
    *,
    tier: int = 0,
    start: float = NOW - 1000,
    ck: float | None = None,
    cpus: int = 4,
    **kw: object,
) -> Running:
    return Running(
        job_id=jid,
        tier=tier,
        nodes=nodes,
        cpus=cpus * len(nodes),
        start_time=start,
        last_checkpoint=ck,
        **kw,  # type: ignore[arg-type]
    )


def holds(r: Running, cpus: int = 4) -> list[Allocation]:
    return [Allocation(r.job_id, n, cpus, 1, (), False, None) for n in r.nodes]


def test_tiers_from_qos_before_partition() -> None:
    t = Tiers(
        partition_tier={"high": 2, "low": 0},
        partition_mode={"low": Mode.CANCEL},
        qos_tier={"urgent": 5},
        qos_mode={"scavenger": Mode.REQUEUE},
    )
    assert t.tier("high", None) == 2
    assert t.tier("high", "urgent") == 5
    assert t.tier("high", "normal") == 2  # a QOS without a tier leaves the partition's
    assert t.tier("nowhere", None) == 0
    assert t.mode("low", None) is Mode.CANCEL
    assert t.mode("low", "scavenger") is Mode.REQUEUE
    assert t.mode("other", None) is Mode.REQUEUE
    assert t.active
    assert not Tiers(partition_tier={"a": 0}).active


def test_least_work_lost_first_then_size_then_age() -> None:
    views = [view("n1"), view("n2"), view("n3")]
    # job 1 checkpointed 10 s ago, job 2 300 s ago, job 3 never (started 1000 s ago)
    rs = [
        running(1, ("n1",), ck=NOW - 10),
        running(2, ("n2",), ck=NOW - 300),
        running(3, ("n3",)),
    ]
    allocs = [a for r in rs for a in holds(r)]
    got = preemption.decide([(request(9), 1)], rs, views, allocs, NOW)
    assert [v.job_id for v in got[0].victims] == [1]
    assert got[0].placement.nodes == ("n1",)
    # same work at risk: the smaller job goes first, then the younger
    a = running(1, ("n1", "n2"), start=NOW - 100)
    b = running(2, ("n3",), start=NOW - 100)
    assert [r.job_id for r in preemption.candidates([a, b], 1, NOW, 0)] == [2, 1]
    old = running(1, ("n1",), start=NOW - 500, ck=NOW - 50)
    young = running(2, ("n2",), start=NOW - 60, ck=NOW - 50)
    assert [r.job_id for r in preemption.candidates([old, young], 1, NOW, 0)] == [2, 1]


def test_a_checkpoint_of_an_earlier_attempt_does_not_count() -> None:
    rows = [
        {
            "job_id": 1,
            "partition": "batch",
            "nodes": ["n1"],
            "cpus": 4,
            "start_time": NOW - 100,
            "checkpoint": {"finished_at": NOW - 500},
        },
    ]
    (r,) = preemption.running_from_rows(rows, Tiers())
    assert r.last_checkpoint is None and r.work_at_risk(NOW) == 100


def test_never_same_or_higher_tier_nor_exempt_nor_stopping_nor_off() -> None:
    rs = [
        running(1, ("n1",), tier=1),  # same tier as the preemptor
        running(2, ("n2",), tier=3),  # higher
        running(3, ("n3",), start=NOW - 5),  # inside the exempt time
        running(4, ("n4",), stopping=True),  # already being stopped
        running(5, ("n5",), mode=Mode.OFF),  # never preempted
    ]
    assert preemption.candidates(rs, 1, NOW, exempt_s=60) == []
    views = [view(f"n{i}") for i in range(1, 6)]
    allocs = [a for r in rs for a in holds(r)]
    assert preemption.decide([(request(9), 1)], rs, views, allocs, NOW, exempt_s=60) == []


def test_gang_job_is_taken_whole_and_spare_victims_are_given_back() -> None:
    views = [view(f"n{i}") for i in range(1, 5)]
    gang = running(1, ("n1", "n2", "n3"), ck=NOW - 5)  # cheapest, but three nodes
    small = running(2, ("n4",), ck=NOW - 50)
    allocs = holds(gang) + holds(small)
    # a 2-node job: the gang frees enough alone; `small` is not needed
    (d,) = preemption.decide([(request(9, nodes=2), 1)], [gang, small], views, allocs, NOW)
    assert [v.job_id for v in d.victims] == [1]
    # a 4-node job needs both; every node of the gang is freed
    (d,) = preemption.decide([(request(9, nodes=4), 1)], [gang, small], views, allocs, NOW)
    assert sorted(v.job_id for v in d.victims) == [1, 2]
    assert sorted(d.placement.nodes) == ["n1", "n2", "n3", "n4"]


def test_prunes_a_victim_that_turned_out_unneeded() -> None:
    views = [view("n1"), view("n2")]
    a = running(1, ("n1",), cpus=2, ck=NOW - 1)  # cheapest, but frees only half of n1
    b = running(2, ("n2",), ck=NOW - 2)  # frees all of n2
    c = running(3, ("n1",), cpus=2, ck=NOW - 900)
    allocs = holds(a, 2) + holds(b) + holds(c, 2)
    (d,) = preemption.decide([(request(9), 1)], [a, b, c], views, allocs, NOW)
    assert [v.job_id for v in d.victims] == [2]


def test_two_preemptors_in_one_pass_do_not_share_victims_or_capacity() -> None:
    views = [view("n1"), view("n2")]
    rs = [running(1, ("n1",)), running(2, ("n2",))]
    allocs = [a for r in rs for a in holds(r)]
    got = preemption.decide([(request(8), 1), (request(9), 1)], rs, views, allocs, NOW)
    assert [[v.job_id for v in d.victims] for d in got] == [[1], [2]]
    assert {d.placement.nodes for d in got} == {("n1",), ("n2",)}
    # only one victim: the second job gets nothing
    got = preemption.decide([(request(8), 1), (request(9), 1)], rs[:1], views[:1], allocs[:1], NOW)
    assert [d.job_id for d in got] == [8]


def test_stop_reasons_name_the_preemptor_and_keep_their_kind() -> None:
    text = preemption.stop_reason(Mode.REQUEUE, 12, "tier 2 > 0")
    assert text.startswith("requeue") and preemption.preemptor_of(text) == 12
    cancel = preemption.stop_reason(Mode.CANCEL, 7, "tier 1 > 0")
    assert cancel.startswith("cancel") and preemption.is_preemption(cancel)
    assert preemption.preemptor_of("requeue: node n1 drained by alice") is None
    no_requeue = running(1, ("n1",), requeue=False)
    assert no_requeue.effective_mode() is Mode.CANCEL


# ------------------------------------------------------------------ properties

_NODES = [f"n{i}" for i in range(6)]


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[Running], JobRequest, int, float]:
    """Running jobs on disjoint nodes (one CPU each), a pending request and its tier."""
    free = list(_NODES)
    rs: list[Running] = []
    jid = 1
    while free and draw(st.booleans()):
        k = draw(st.integers(1, min(3, len(free))))
        nodes, free = tuple(free[:k]), free[k:]
        rs.append(
            Running(
                job_id=jid,
                tier=draw(st.integers(0, 3)),
                nodes=nodes,
                cpus=4 * k,
                start_time=NOW - draw(st.integers(0, 5000)),
                last_checkpoint=draw(st.none() | st.just(NOW - draw(st.integers(0, 4000)))),
                mode=draw(st.sampled_from(list(Mode))),
                stopping=draw(st.booleans()),
            )
        )
        jid += 1
    req = request(100, nodes=draw(st.integers(1, len(_NODES))))
    return rs, req, draw(st.integers(0, 4)), float(draw(st.integers(0, 3000)))


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_property_victims_are_lower_tier_whole_and_enough(
    case: tuple[list[Running], JobRequest, int, float],
) -> None:
    rs, req, tier, exempt = case
    views = [view(n) for n in _NODES]
    allocs = [a for r in rs for a in holds(r)]
    got = preemption.decide([(req, tier)], rs, views, allocs, NOW, exempt_s=exempt)
    assert len(got) <= 1
    by_id = {r.job_id: r for r in rs}
    if not got:
        # nothing returned: the job fits as things are (nothing needs stopping), or even every
        # eligible victim would not free enough
        pool = preemption.candidates(rs, tier, NOW, exempt)
        gone = {r.job_id for r in pool}
        free_now = len(_NODES) - sum(len(r.nodes) for r in rs)
        free_all = len(_NODES) - sum(len(r.nodes) for r in rs if r.job_id not in gone)
        assert free_now >= req.nodes or free_all < req.nodes
        return
    assert len(_NODES) - sum(len(r.nodes) for r in rs) < req.nodes  # it was blocked
    (d,) = got
    for v in d.victims:
        r = by_id[v.job_id]
        assert r.tier < tier  # never a same-or-higher tier
        assert not r.stopping and r.mode is not Mode.OFF
        assert NOW - r.start_time >= exempt
    victim_nodes = {n for v in d.victims for n in by_id[v.job_id].nodes}
    busy = {n for r in rs if r.job_id not in {v.job_id for v in d.victims} for n in r.nodes}
    # gang-atomic: every node of a victim is freed, and the job goes only on free nodes
    assert not (set(d.placement.nodes) & busy)
    assert len(d.placement.nodes) == req.nodes  # frees enough
    # minimal: no victim could be spared
    assert victim_nodes <= set(_NODES) - busy
    for v in d.victims:
        assert len(_NODES) - len(busy) - len(by_id[v.job_id].nodes) < req.nodes


# ------------------------------------------------------------------ what Slurm's commands show


def test_sacct_shows_preempted_and_scontrol_the_tier_mode_and_preempt_time() -> None:
    from phalanx.slurm import records, scontrol

    cancelled = {"state": "CANCELLED", "reason": "preempted by job 7 (tier 1 over tier 0)"}
    assert records.state_text(cancelled) == "PREEMPTED"
    assert records.state_text({"state": "CANCELLED", "reason": "cancelled by 0"}) != "PREEMPTED"
    part = {
        "name": "high",
        "nodes": "*",
        "priority": 3,
        "priority_tier": 2,
        "preempt_mode": "cancel",
    }
    text = " ".join(scontrol.partition_lines(part, []))
    assert "PriorityTier=2" in text and "PriorityJobFactor=3" in text
    assert "PreemptMode=CANCEL" in text
    assert "PreemptMode=OFF" in " ".join(scontrol.partition_lines({"name": "x"}, []))
    job = {
        "attempts": [
            {"stop_reason": "requeue: preempted by job 7 (tier 1 over tier 0)", "end_time": NOW},
            {"stop_reason": None, "end_time": None},
        ]
    }
    assert scontrol._preempt_time(job) != "None"
    assert scontrol._preempt_time({"attempts": [{"stop_reason": "cancel: cancelled by x"}]}) == (
        "None"
    )


def test_explain_says_whom_a_preempting_job_waits_for() -> None:
    import explain_cluster as ec

    from phalanx.controller.preemption import waiting_reason
    from phalanx.domain.explain import explain_pending

    reason = waiting_reason([7])
    assert reason == "Preempting (waits for job 7 to checkpoint and leave its nodes)"
    assert "jobs 3, 7 to" in waiting_reason([7, 3])
    j = ec.job(
        12, cpus_per_node=16, reason=reason, reserved_nodes=["n1"], reserved_until=ec.NOW + 90
    )
    snap = ec.snapshot(
        [ec.node("n1")],
        [ec.partition("batch", "n*")],
        allocations=[ec.alloc(7, "n1", cpus=16)],
        pending=[j],
        reservations=[{"id": 12, "reserved_nodes": ["n1"], "reserved_until": ec.NOW + 90}],
    )
    e = explain_pending(j, snap, ec.NOW)
    assert e.summary == reason and e.verdict == "wait"
    assert any(x.startswith("preemption: n1 held for it until") for x in e.lines), e.lines
    assert not any("node failure" in x for x in e.lines), e.lines


def test_victims_outside_the_jobs_partitions_are_never_stopped() -> None:
    from dataclasses import replace

    gpu = replace(view("g1"), partitions=frozenset({"gpu"}))
    views = [view("n1"), gpu]
    cheap = running(1, ("g1",), ck=NOW - 1)  # cheapest, but on a node the job cannot use
    dear = running(2, ("n1",), ck=NOW - 900)
    allocs = holds(cheap) + holds(dear)
    (d,) = preemption.decide([(request(9), 1)], [cheap, dear], views, allocs, NOW)
    assert [v.job_id for v in d.victims] == [2]
    calls: list[frozenset[int]] = []

    def fits(ids: frozenset[int]) -> bool:
        calls.append(ids)
        return 37 in ids

    many = [running(i, (f"x{i}",), ck=NOW - i) for i in range(1, 200)]
    (v,) = preemption.choose(many, fits, NOW) or ()
    assert v.job_id == 37
    # bisection finds the prefix in ~log2(199) placements; pruning then tries each of the 37
    # once: not one placement per candidate, nor one per subset
    assert len(calls) <= 2 + 9 + 37
