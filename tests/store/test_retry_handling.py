"""Retry rules applied by the store, on SQLite and PostgreSQL: the per-job budget in
jobs.retries, backoff as eligible_time, avoided nodes, planned requeues that spend nothing,
hung attempts, and array tasks that each have their own budget."""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_store_contract import (  # the contract suite's helpers and `store` fixture
    add_node,
    exited,
    item,
    running,
    start,
    state,
    store,
    submit1,
)

from phalanx.domain import scheduling
from phalanx.errors import InvalidSpec
from phalanx.store.store import Store

__all__ = ["store"]


def fail_once(store: Store, jid: int, node: str, code: int = 1, **extra: Any) -> dict[str, Any]:
    """Run the job's next attempt on `node` and let it exit with `code`; return the job."""
    att = start(store, jid, [node])
    store.apply_reports(node, [running(att)], None)
    store.apply_reports(node, [exited(att, code, **extra)], None)
    return store.get_job(jid)


def requeue_reasons(store: Store, jid: int) -> list[str]:
    """The reasons of the job's requeue events (without their `OLD -> NEW: ` prefix)."""
    return [
        e["message"].split(": ", 1)[1]
        for e in store.events(job_id=jid)
        if e["kind"] == "job.requeue"
    ]


def test_exit_code_rule_retries_within_the_budget_then_fails_with_the_rule(store: Store) -> None:
    for n in ("n1", "n2", "n3", "n4"):
        add_node(store, n)
    jid = submit1(store, retries=2, retry_on="exit:1", retry_backoff="0")
    job = fail_once(store, jid, "n1")
    assert job["state"] == "PENDING" and job["retries"] == 1 and job["restart_count"] == 1
    assert job["avoid_nodes"] == ["n1"], "the next attempt stays off the node it failed on"
    assert job["eligible_time"] is None, "--retry-backoff=0: no wait"
    job = fail_once(store, jid, "n2")
    assert job["retries"] == 2 and job["avoid_nodes"] == ["n1", "n2"]
    job = fail_once(store, jid, "n3")
    assert job["state"] == "FAILED" and job["retries"] == 2
    assert job["reason"] == (
        "task on n3 exited with code 1; not retried: all 2 retries used (--retries=2)"
    )
    assert requeue_reasons(store, jid) == [
        "task on n1 exited with code 1; requeued (retry 1 of 2)",
        "task on n2 exited with code 1; requeued (retry 2 of 2)",
    ]


def test_unlisted_exit_code_ends_at_once_and_says_why(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, retries=5, retry_on="exit:1")
    job = fail_once(store, jid, "n1", code=2)
    assert job["state"] == "FAILED" and job["retries"] == 0
    assert job["reason"].endswith("not retried: exit code 2 is not in --retry-on (exit:1)")


def test_a_begin_time_is_the_jobs_eligible_time_from_submission(store: Store) -> None:
    """sbatch --begin: stored as the job's eligible time by both submission paths (one job,
    and a group of plain ones), kept out of the plan with BeginTime until it comes."""
    add_node(store, "n1")
    begin = time.time() + 600
    alone = submit1(store, begin_time=begin)
    grouped = store.submit([item(store, begin_time=begin), item(store)], "alice")
    later, now_ = grouped[0][0], grouped[1][0]
    for jid in (alone, later):
        assert store.get_job(jid)["eligible_time"] == pytest.approx(begin)
    plan = scheduling.plan(store.sched_snapshot(), time.time())
    assert [p.job_id for p in plan.starts] == [now_]
    assert plan.reasons[alone].startswith("BeginTime") and plan.reasons[later].startswith(
        "BeginTime"
    )
    assert {p.job_id for p in scheduling.plan(store.sched_snapshot(), begin + 1).starts} == {
        alone,
        later,
        now_,
    }


def test_backoff_becomes_the_jobs_eligible_time_and_keeps_it_out_of_the_plan(
    store: Store,
) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, retries=3, retry_on="exit", retry_backoff="30:100")
    before = time.time()
    job = fail_once(store, jid, "n1")
    assert job["state"] == "PENDING"
    assert before + 30 <= job["eligible_time"] <= time.time() + 30
    assert "starts in 30s at the earliest" in requeue_reasons(store, jid)[0]
    plan = scheduling.plan(store.sched_snapshot(), time.time())
    assert not plan.starts and plan.reasons[jid].startswith("BeginTime")
    assert [p.job_id for p in scheduling.plan(store.sched_snapshot(), time.time() + 31).starts] == [
        jid
    ]


def test_cluster_defaults_apply_when_the_job_gives_none(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)  # default retry_on has no exit codes
    job = fail_once(store, jid, "n1", code=1)
    assert job["state"] == "FAILED" and "is not in --retry-on" in job["reason"]


def test_planned_requeue_spends_no_retry_but_a_node_failure_does(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, retries=1)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.drain("n1", "firmware", "ops", now=True)
    store.apply_reports("n1", [exited(att, 0)], None)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["retries"] == 0, "drain --now is planned"

    for expected_state in ("PENDING", "NODE_FAIL"):
        att = start(store, jid, ["n2"])
        store.apply_reports("n2", [running(att)], None)
        store.fail_node_tasks("n2", "node n2 is DOWN", None)
        assert state(store, jid) == expected_state
    job = store.get_job(jid)
    assert job["retries"] == 1
    assert job["reason"].startswith("node failure: task on n2")
    assert job["reason"].endswith("not retried: all 1 retries used (--retries=1)")


def test_health_failure_is_a_retry_with_the_check_in_the_reason(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.apply_health("n1", {"status": "fail", "check": "gpu", "reason": "GPU 0: XID 79"})
    store.apply_reports("n1", [exited(att, 0)], None)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["retries"] == 1 and job["avoid_nodes"] == ["n1"]
    assert job["eligible_time"] is None, "the node failed, not the job: no backoff"
    (why,) = requeue_reasons(store, jid)
    assert "failing health check on n1 health check gpu: GPU 0: XID 79" in why


def test_hung_attempt_is_requeued_with_its_story_and_avoids_the_node(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, retries=3, retry_backoff="0")
    hung = {"last_progress_at": time.time() - 30, "timeout_s": 30, "step": 120}
    job = fail_once(store, jid, "n2", code=None, signal=15, hung=hung)
    assert job["state"] == "PENDING" and job["retries"] == 1 and job["avoid_nodes"] == ["n2"]
    assert requeue_reasons(store, jid) == [
        "hung: no progress for 30s since step 120 on n2; requeued (retry 1 of 3)"
    ]
    att = store.attempts_of(jid)[0]
    assert att["result"] == "FAILED"


def test_hung_job_that_exits_zero_on_sigterm_is_not_completed(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, retry_on="none")
    job = fail_once(store, jid, "n1", code=0, hung={"timeout_s": 5})
    assert job["state"] == "FAILED"
    assert (
        job["reason"]
        == "hung: no progress for 5s on n1; not retried: hang is not in --retry-on (none)"
    )


def test_every_array_task_has_its_own_budget(store: Store) -> None:
    for n in ("n1", "n2"):
        add_node(store, n)
    (ids,) = store.submit(
        [item(store, array="0-3", retries=1, retry_on="exit", retry_backoff="0")], "alice"
    )
    t0, t1 = ids[0], ids[1]
    assert fail_once(store, t0, "n1")["retries"] == 1
    assert store.get_job(t1)["retries"] == 0
    assert fail_once(store, t1, "n1")["state"] == "PENDING", "task 1 still has its retry"
    assert fail_once(store, t0, "n2")["state"] == "FAILED"
    assert fail_once(store, t1, "n2")["state"] == "FAILED"
    assert [store.get_job(i)["state"] for i in ids[2:]] == ["PENDING", "PENDING"]


def test_no_requeue_with_retries_is_refused_at_submit(store: Store) -> None:
    with pytest.raises(InvalidSpec, match=r"--no-requeue .* --retries=2"):
        submit1(store, requeue=False, retries=2)
    with pytest.raises(InvalidSpec, match="unknown failure kind"):
        submit1(store, retry_on="sometimes")
    with pytest.raises(InvalidSpec, match="below the base"):
        submit1(store, retry_backoff="10:1")


def test_a_pass_reads_a_job_before_its_begin_time_only_to_say_so_once(store: Store) -> None:
    """A pass (`eligible_by`: its clock) does not read pending jobs before their begin time
    whole (a store with many jobs for tomorrow would re-read them every pass): it gets their
    ids until their reason says BeginTime, then nothing, until their time comes."""
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, retries=3, retry_on="exit", retry_backoff="30:100")
    fail_once(store, jid, "n1")
    now = time.time()
    snap = store.sched_snapshot(eligible_by=now)
    assert snap.pending == []
    assert [r["id"] for r in snap.not_yet] == [jid]
    plan = scheduling.plan(snap, now)
    assert not plan.starts and plan.reasons[jid].startswith("BeginTime (not before ")
    store.set_pending_reasons(plan.reasons)
    quiet = store.sched_snapshot(eligible_by=now)
    assert quiet.not_yet == [], "said once"
    # nothing for a pass to do: the nodes are not read at all
    assert quiet.quiet and quiet.nodes == [] and quiet.pending == []
    later = store.sched_snapshot(eligible_by=now + 31)
    assert [j["id"] for j in later.pending] == [jid] and later.not_yet == []
    assert not later.quiet and sorted(n["name"] for n in later.nodes) == ["n1", "n2"]
    assert not store.sched_snapshot().quiet, "explain (no clock) always reads everything"
    assert [p.job_id for p in scheduling.plan(later, now + 31).starts] == [jid]
