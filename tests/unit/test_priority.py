"""Multifactor priority (domain/priority.py), limits (domain/limits.py) and the scheduling
pass that applies both (`scheduling.plan(..., policy=...)`)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduling import job as scheduling_job
from test_scheduling import node as scheduling_node

from phalanx.domain import limits as lim
from phalanx.domain.priority import ClusterSize, QueuePolicy, Weights, breakdown, order
from phalanx.domain.scheduling import plan
from phalanx.store.store import SchedSnapshot

NOW = 1_000_000.0


def node(name: str, cpus: int = 4, gpus: int = 0) -> dict[str, Any]:
    return scheduling_node(name, cpus=cpus, gpus=gpus)


def job(jid: int, **kw: Any) -> dict[str, Any]:
    """test_scheduling's job row, submitted at NOW with no explicit priority unless told."""
    return scheduling_job(jid, **{"submit_time": NOW, "priority": 0, **kw})


def snap(nodes: list[dict[str, Any]], pending: list[dict[str, Any]]) -> SchedSnapshot:
    return SchedSnapshot(
        nodes=nodes,
        partitions={"batch": {"name": "batch", "nodes": "*", "priority": 0}},
        allocations=[],
        pending=pending,
        dep_states={},
        dep_started={},
        active_names=set(),
        array_active={},
    )


W = Weights(age=1000, fairshare=10000, jobsize=1000, partition=1000, qos=1000, max_age_s=1000.0)
SIZE = ClusterSize(nodes=10, cpus=40)


def _b(j: dict[str, Any], fs: float = 0.5, **kw: Any) -> Any:
    return breakdown(
        j,
        NOW,
        kw.pop("weights", W),
        fairshare=fs,
        size=kw.pop("size", SIZE),
        partition_priority=kw.pop("parts", {"batch": 10, "high": 20}),
        qos_priority=kw.pop("qos", {"normal": 0, "urgent": 50}),
    )


def test_a_hand_worked_priority():
    """A job submitted 250 s ago (max age 1000 s), fair share 0.5, 2 nodes x 4 CPUs of a
    10-node 40-CPU cluster, in partition batch (10 of at most 20), QOS urgent (50 of 50),
    nice 7:
      age       1000 x 250/1000 = 0.25          ->  250
      fairshare 10000 x 0.5                     -> 5000
      jobsize   1000 x max(2/10, 8/40) = 0.2    ->  200
      partition 1000 x 10/20 = 0.5              ->  500
      qos       1000 x 50/50 = 1.0              -> 1000
      total     round(6950) - 7 = 6943"""
    j = job(1, submit_time=NOW - 250, nodes=2, cpus_per_node=4, qos="urgent", nice=7)
    b = _b(j)
    assert b.factors == {
        "age": 0.25,
        "fairshare": 0.5,
        "jobsize": 0.2,
        "partition": 0.5,
        "qos": 1.0,
    }
    assert b.total == 6943
    text = "\n".join(b.explain())
    assert "fairshare   10000 x 0.500000 =      5000.00" in text
    assert "- nice 7 = 6943" in text


def test_age_is_capped_and_counts_from_eligible_time():
    old = job(1, submit_time=NOW - 10_000)
    assert _b(old).factors["age"] == 1.0
    begun = job(2, submit_time=NOW - 10_000, eligible_time=NOW - 100)
    assert _b(begun).factors["age"] == pytest.approx(0.1)


def test_favor_small_inverts_job_size():
    small = Weights(max_age_s=1000.0, favor_small=True)
    j = job(1, submit_time=NOW, nodes=1, cpus_per_node=4)  # 1/10 nodes, 4/40 CPUs: 0.1
    assert _b(j, weights=small).factors["jobsize"] == pytest.approx(0.9)


def test_unknown_qos_and_no_priorities_give_zero_factors():
    j = job(1, submit_time=NOW, qos=None)
    b = _b(j, parts={"batch": 0}, qos={"normal": 0})
    assert b.factors["partition"] == 0.0
    assert b.factors["qos"] == 0.0


def test_order_is_explicit_priority_then_multifactor_then_id():
    jobs = [
        job(1, submit_time=NOW),
        job(2, submit_time=NOW, priority=5),
        job(3, submit_time=NOW),
    ]
    fs = {1: 0.25, 2: 0.0, 3: 1.0}
    got = order(jobs, lambda j: _b(dict(j), fs=fs[int(j["id"])]))
    assert [j["id"] for j in got] == [2, 3, 1]


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0, 1),
    st.floats(0, 1),
    st.integers(0, 5000),
    st.integers(1, 10),
    st.integers(-1000, 1000),
)
def test_total_is_the_weighted_sum_less_nice_and_factors_are_in_range(fs, fs2, age, nodes, nice):
    j = job(1, submit_time=NOW - age, nodes=nodes, cpus_per_node=4, nice=nice, qos="normal")
    b = _b(j, fs=fs)
    assert all(0.0 <= v <= 1.0 for v in b.factors.values())
    assert b.total == round(sum(b.products().values())) - nice
    # more fair share never lowers the priority
    if fs2 >= fs:
        assert _b(j, fs=fs2).total >= b.total


# ------------------------------------------------------------------ limits


def _limits(**kw: Any) -> lim.Limits:
    return lim.Limits(parents={"phys": "root", "hep": "phys"}, **kw)


def test_account_limits_count_the_subtree():
    limits = _limits(accounts={"phys": lim.Limit(max_running_jobs=1)})
    usage = lim.Usage()
    usage.add(job(1, account="hep", user="bob"), limits)
    why = lim.run_blocker(job(2, account="phys", user="alice"), usage, limits)
    assert why is not None and why.startswith("AssocGrpJobsLimit (account phys: 1 running")


@pytest.mark.parametrize(
    ("limits", "j", "reason"),
    [
        (
            _limits(assocs={("phys", "alice"): lim.Limit(max_running_jobs=1)}),
            job(2, account="phys", user="alice"),
            "AssocMaxJobsLimit",
        ),
        (
            _limits(qos={"normal": lim.Limit(max_gpus=2)}),
            job(2, account="phys", user="alice", qos="normal", gpus_per_node=2),
            "QOSMaxGRESPerUser",
        ),
        (
            _limits(qos={"normal": lim.Limit(max_wall_s=600)}),
            job(2, account="phys", user="alice", qos="normal", time_limit_s=3600),
            "QOSMaxWallDurationPerJobLimit",
        ),
        (
            _limits(qos={"normal": lim.Limit(max_wall_s=600)}),
            job(2, account="phys", user="alice", qos="normal", time_limit_s=None),
            "QOSMaxWallDurationPerJobLimit",
        ),
        (
            _limits(accounts={"hep": lim.Limit(max_gpus=2)}),
            job(2, account="hep", user="alice", gpus_per_node=2),
            "AssocGrpGRES",
        ),
    ],
)
def test_run_limits_name_slurms_reason(limits, j, reason):
    usage = lim.Usage()
    usage.add(job(1, account=j["account"], user="alice", qos=j.get("qos"), gpus_per_node=1), limits)
    why = lim.run_blocker(j, usage, limits)
    assert why is not None and why.split(" ")[0] == reason


def test_within_limits_nothing_blocks():
    limits = _limits(
        assocs={("phys", "alice"): lim.Limit(max_running_jobs=2, max_gpus=4, max_wall_s=3600)}
    )
    usage = lim.Usage()
    usage.add(job(1, account="phys", user="alice", gpus_per_node=2), limits)
    assert (
        lim.run_blocker(job(2, account="phys", user="alice", gpus_per_node=2), usage, limits)
        is None
    )


def test_submit_limit_counts_what_is_asked():
    limits = _limits(qos={"normal": lim.Limit(max_submit_jobs=3)})
    submitted = lim.Usage()
    submitted.jobs[("qos", "normal", "alice")] = 2
    j = job(0, account="phys", user="alice", qos="normal")
    assert lim.submit_refusal(j, submitted, limits, 1) is None
    why = lim.submit_refusal(j, submitted, limits, 2)
    assert why is not None and why.startswith("QOSMaxSubmitJobPerUserLimit")


# ------------------------------------------------------------------ the pass


def _policy(fs: dict[str, float], limits: lim.Limits | None = None) -> QueuePolicy:
    return QueuePolicy(
        weights=W,
        fairshare=lambda account, user: fs.get(user, 1.0),
        qos_priority={"normal": 0},
        limits=limits or lim.Limits(),
        default_account="default",
    )


def test_the_pass_starts_jobs_in_fair_share_order():
    """One free CPU; alice's job is older and first by id, but bob's fair share is higher."""
    pending = [
        job(1, user="alice", submit_time=NOW - 10, cpus_per_node=4),
        job(2, user="bob", submit_time=NOW, cpus_per_node=4),
    ]
    p = plan(snap([node("n1")], pending), NOW, policy=_policy({"alice": 0.5, "bob": 1.0}))
    assert [s.job_id for s in p.starts] == [2]
    assert p.reasons[1] == "Resources"
    # without a policy the snapshot's order holds
    assert [s.job_id for s in plan(snap([node("n1")], pending), NOW).starts] == [1]


def test_the_pass_keeps_jobs_over_a_limit_pending_with_the_reason():
    limits = lim.Limits(assocs={("default", "alice"): lim.Limit(max_running_jobs=1)})
    pending = [job(i, user="alice", submit_time=NOW) for i in (1, 2, 3)]
    p = plan(snap([node("n1"), node("n2")], pending), NOW, policy=_policy({}, limits))
    assert [s.job_id for s in p.starts] == [1]
    assert p.reasons[2].startswith("AssocMaxJobsLimit")
    assert p.reasons[3].startswith("AssocMaxJobsLimit")


def test_running_jobs_count_against_the_limit():
    limits = lim.Limits(qos={"normal": lim.Limit(max_gpus=2)})
    s = snap([node("n1", gpus=4)], [job(2, user="alice", qos="normal", gpus_per_node=1)])
    s.active_jobs = [
        {"id": 1, "user": "alice", "account": None, "qos": "normal", "nodes": 1, "gpus_per_node": 2}
    ]
    p = plan(s, NOW, policy=_policy({}, limits))
    assert p.starts == []
    assert p.reasons[2].startswith("QOSMaxGRESPerUser (QOS normal per user: 2 GPUs in use + 1")


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alice", "bob", "carol"]),
            st.integers(0, 5000),  # age
            st.integers(1, 4),  # nodes
            st.sampled_from(["batch", "high"]),
            st.sampled_from(["normal", "urgent", None]),
            st.integers(-50, 50),  # nice
            st.integers(0, 2),  # --priority
        ),
        max_size=30,
    )
)
def test_the_pass_order_is_breakdowns_order(rows):
    """`QueuePolicy.order` computes totals inline for speed: the same as `breakdown`'s."""
    fs = {"alice": 0.25, "bob": 1.0, "carol": 0.5}
    pending = [
        job(
            i,
            user=u,
            submit_time=NOW - age,
            nodes=n,
            cpus_per_node=4,
            partitions=part,
            qos=q,
            nice=nice,
            priority=p,
        )
        for i, (u, age, n, part, q, nice, p) in enumerate(rows)
    ]
    s = snap([node(f"n{i}") for i in range(10)], pending)
    s.partitions = {"batch": {"priority": 10}, "high": {"priority": 20}}
    pol = QueuePolicy(
        weights=W,
        fairshare=lambda account, user: fs[user],
        qos_priority={"normal": 0, "urgent": 50},
        limits=lim.Limits(),
        default_account="default",
    )
    fast = [j["id"] for j in pol.order(s, NOW)]
    slow = [j["id"] for j in order(pending, pol.scorer(s, NOW))]
    assert fast == slow


@pytest.mark.parametrize(
    "nices,priorities",
    [
        ([0, 0, 0, 0], [0, -3, 2**70, -(2**70)]),  # --priority beyond 64 bits: still exact
        ([2**63, -(2**63), 0, 5], [0, 0, 0, 0]),  # totals beyond the integer key: plain order
        ([0, 0, 0, 0], [1, 1, 0, 0]),  # ties in everything but the id
    ],
)
def test_the_integer_sort_key_orders_as_the_breakdowns(nices, priorities):
    pending = [
        job(10 + i, user="alice", submit_time=NOW - 100, nice=n, priority=p)
        for i, (n, p) in enumerate(zip(nices, priorities, strict=True))
    ]
    s = snap([node("n1")], list(reversed(pending)))
    pol = _policy({"alice": 0.5})
    fast = [j["id"] for j in pol.order(s, NOW)]
    slow = [j["id"] for j in order(s.pending, pol.scorer(s, NOW))]
    assert fast == slow
