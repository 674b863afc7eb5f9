"""The measured inputs of `--checkpoint-interval=auto`, on SQLite and PostgreSQL: the cluster's
failure history (node time observed, node failures seen) and a job's checkpoint cost.

Histories are built two ways: through the store's real paths (register, DOWN, health checks,
operator drains), so the event kinds the estimator reads are the ones the store writes; and as
events stamped in the past (`add_event(ts=...)`), so windows and up/down periods can be checked
to the second.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import update
from test_store_contract import add_node, store, submit1  # the contract suite's `store` fixture

from phalanx.domain import checkpointing
from phalanx.store import schema
from phalanx.store.store import Store

__all__ = ["store"]

DAY = 86400.0
FAIL = {"status": "fail", "check": "gpu", "reason": "XID 79"}
WARN = {"status": "warn", "check": "memory", "reason": "512 MB available"}
OK = {"status": "ok", "check": None, "reason": None}


def past(store: Store, kind: str, node: str, ts: float, **data: object) -> None:
    store.add_event(kind, f"{kind} {node} (test history)", node=node, ts=ts, data=data or None)


# --------------------------------------------------------------------------------------------
# failure_history: real store paths
# --------------------------------------------------------------------------------------------


def test_empty_cluster_has_no_history(store: Store) -> None:
    assert store.failure_history(time.time()) == (0.0, 0)


def test_registered_nodes_accumulate_node_time(store: Store) -> None:
    t0 = time.time()
    add_node(store, "n1")
    add_node(store, "n2")
    t1 = time.time()
    node_s, failures = store.failure_history(t1 + 1000)
    assert failures == 0
    # each node counts from its registration: between 1000 s and 1000 s + the setup time
    assert 2000 <= node_s <= 2000 + 2 * (t1 - t0) + 1e-6
    # re-registering (an agent restart) neither restarts nor doubles a node's time
    add_node(store, "n1")
    assert store.failure_history(t1 + 1000)[0] == pytest.approx(node_s)


def test_down_is_a_failure_and_down_time_is_not_observed(store: Store) -> None:
    add_node(store, "n1")
    assert store.mark_down("n1", "no heartbeat for 10s", None)
    down_at = time.time()
    # a second verdict on a node already DOWN is no new failure
    assert not store.mark_down("n1", "no heartbeat for 10s", None)
    node_s, failures = store.failure_history(down_at + 5000)
    assert failures == 1
    assert node_s < 5  # up only between registration and the DOWN, not the 5000 s after
    # it answers again: counting resumes from then
    assert store.record_heartbeats({"n1": 0.0}) == ["n1"]
    back = time.time()
    node_s2, failures2 = store.failure_history(back + 600)
    assert failures2 == 1
    assert 600 <= node_s2 - node_s <= 600 + (time.time() - down_at) + 1


def test_failing_health_check_is_a_failure_once(store: Store) -> None:
    add_node(store, "n1")
    store.apply_health("n1", FAIL)
    # the same failure reported again, and a second failing check while it stays failed,
    # are one failure: the node's jobs were stopped once
    store.apply_health("n1", FAIL)
    store.apply_health("n1", {"status": "fail", "check": "disk", "reason": "/ckpt full"})
    assert store.failure_history(time.time())[1] == 1
    # it passes, resumes, and fails again later: a second failure
    store.apply_health("n1", OK)
    assert not store.get_node("n1")["drain"]
    store.apply_health("n1", FAIL)
    assert store.failure_history(time.time())[1] == 2


def test_warnings_and_operator_drains_are_not_failures(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    store.apply_health("n1", WARN)  # drains (no new work), but the node still works
    store.drain("n2", "replace PSU", "ops", now=True)
    store.resume("n2", "ops")
    node_s, failures = store.failure_history(time.time() + 100)
    assert failures == 0
    assert node_s >= 200  # drained nodes are still up and observed


def test_operator_resume_of_a_down_node_counts_from_then(store: Store) -> None:
    add_node(store, "n1")
    store.mark_down("n1", "no heartbeat", None)
    store.resume("n1", "ops")  # also clears DOWN
    resumed = time.time()
    node_s, failures = store.failure_history(resumed + 1000)
    assert failures == 1
    assert 1000 <= node_s <= 1000 + 5


# --------------------------------------------------------------------------------------------
# failure_history: windows and exact periods (history stamped in the past)
# --------------------------------------------------------------------------------------------


def test_exact_up_and_down_periods(store: Store) -> None:
    now = time.time()
    past(store, "node.register", "a", now - 10 * DAY)
    past(store, "node.down", "a", now - 8 * DAY)
    past(store, "node.up", "a", now - 7 * DAY)
    past(store, "node.register", "a", now - 6 * DAY)  # agent restart: no change
    past(store, "node.register", "b", now - 2 * DAY)
    past(store, "node.drain", "b", now - 1 * DAY, failure=True, status="fail")
    past(store, "node.drain", "b", now - 0.5 * DAY, failure=False, status="warn")
    node_s, failures = store.failure_history(now, window_s=30 * DAY)
    # a: up 10->8 days ago and 7 days ago -> now (9 days); b: 2 days
    assert node_s == pytest.approx(11 * DAY)
    assert failures == 2


def test_window_forgets_old_failures_but_not_who_was_up(store: Store) -> None:
    now = time.time()
    past(store, "node.register", "a", now - 100 * DAY)
    past(store, "node.down", "a", now - 90 * DAY)  # old failure, before the window
    past(store, "node.up", "a", now - 80 * DAY)  # up since before the window
    past(store, "node.register", "b", now - 50 * DAY)
    past(store, "node.down", "b", now - 40 * DAY)  # DOWN before the window, still DOWN
    past(store, "node.register", "c", now - 10 * DAY)
    past(store, "node.down", "c", now - 5 * DAY)
    node_s, failures = store.failure_history(now, window_s=30 * DAY)
    # a: the whole window; b: nothing (down throughout); c: 10 -> 5 days ago
    assert node_s == pytest.approx(30 * DAY + 5 * DAY)
    assert failures == 1
    # the default window is the documented 30 days
    assert store.failure_history(now) == pytest.approx((35 * DAY, 1))
    # a wider window sees everything: a up 10 + 80 days, b 10, c 5; three failures
    assert store.failure_history(now, window_s=200 * DAY) == pytest.approx((105 * DAY, 3))


def test_events_after_now_do_not_count(store: Store) -> None:
    now = time.time()
    past(store, "node.register", "a", now - DAY)
    past(store, "node.down", "a", now + DAY)
    assert store.failure_history(now) == pytest.approx((DAY, 0))


def test_history_feeds_the_estimator(store: Store) -> None:
    """The store's numbers in the estimator: 64 nodes for a day with 64 failures, against a
    30-day prior worth 30 node-days, give about the history's 1 node-day."""
    now = time.time()
    for i in range(64):
        past(store, "node.register", f"n{i}", now - DAY)
        past(store, "node.down", f"n{i}", now - DAY / 2)
        past(store, "node.up", f"n{i}", now - DAY / 2)
    node_s, failures = store.failure_history(now)
    assert node_s == pytest.approx(64 * DAY) and failures == 64
    mtbf, source = checkpointing.estimate_node_mtbf(
        node_s, failures, prior_s=30 * DAY, prior_weight_s=30 * DAY
    )
    assert source == "history"
    assert mtbf == pytest.approx((30 + 64) / (1 + 64) * DAY)


# --------------------------------------------------------------------------------------------
# checkpoint_cost
# --------------------------------------------------------------------------------------------


def ckpt(store: Store, job_id: int, seq: int, duration: float | None, node: str = "n1") -> None:
    store.add_event(
        "job.checkpoint",
        f"checkpoint {seq}",
        job_id=job_id,
        node=node,
        data={
            "path": f"/ckpt/{seq}",
            "finished_at": time.time(),
            "duration_s": duration,
            "seq": seq,
        },
    )


def test_no_checkpoint_no_cost(store: Store) -> None:
    job = submit1(store)
    assert store.checkpoint_cost(job) is None
    assert store.checkpoint_cost(999_999) is None  # unknown job: nothing measured


def test_cost_is_the_median_of_the_latest_checkpoints(store: Store) -> None:
    job, other = submit1(store), submit1(store)
    for seq, d in enumerate([100.0, 100.0, 3.0, 4.0, 60.0, 5.0, 4.5]):
        ckpt(store, job, seq, d)
    ckpt(store, other, 0, 1000.0)  # another job's checkpoints do not count
    # latest five: 3, 4, 60, 5, 4.5 -> median 4.5; the slow outlier does not move it
    assert store.checkpoint_cost(job) == pytest.approx(4.5)
    assert store.checkpoint_cost(other) == pytest.approx(1000.0)


def test_cost_of_a_multi_node_checkpoint_is_its_slowest_rank(store: Store) -> None:
    job = submit1(store)
    for seq, (d0, d1) in enumerate([(2.0, 8.0), (3.0, 9.0), (1.0, 10.0)]):
        ckpt(store, job, seq, d0, node="n1")
        ckpt(store, job, seq, d1, node="n2")
    assert store.checkpoint_cost(job) == pytest.approx(9.0)


def test_checkpoints_without_duration_are_skipped(store: Store) -> None:
    job = submit1(store)
    ckpt(store, job, 0, 7.0)
    ckpt(store, job, 1, None)  # a job that wrote its marker by hand: no duration
    assert store.checkpoint_cost(job) == pytest.approx(7.0)


def test_cost_falls_back_to_the_jobs_latest_checkpoint(store: Store) -> None:
    job = submit1(store)
    with store.db.begin() as conn:
        conn.execute(
            update(schema.jobs)
            .where(schema.jobs.c.id == job)
            .values(checkpoint={"path": "/ckpt/1", "finished_at": time.time(), "duration_s": 12.5})
        )
    assert store.checkpoint_cost(job) == pytest.approx(12.5)
    with store.db.begin() as conn:
        conn.execute(
            update(schema.jobs)
            .where(schema.jobs.c.id == job)
            .values(checkpoint={"path": "/ckpt/1", "finished_at": time.time()})
        )
    assert store.checkpoint_cost(job) is None
