"""The queue depth (config cluster.queue_depth): a pass examines at most that many jobs in
queue order; the ones behind wait with reason Priority, and `explain` says why."""

from __future__ import annotations

from pathlib import Path

import pytest
from explain_cluster import NOW, job, node, partition, snapshot

from phalanx.config import Config, load_config
from phalanx.domain.explain import explain_pending
from phalanx.domain.scheduling import DEFAULT_QUEUE_DEPTH, plan
from phalanx.domain.states import JobState
from phalanx.errors import ConfigError


def _queue(n: int) -> list[dict]:
    return [job(10 + i, cpus_per_node=1, partitions="batch") for i in range(n)]


def test_jobs_beyond_the_depth_are_not_examined_and_wait_with_priority() -> None:
    snap = snapshot([node("n1", cpus=8)], [partition("batch", "n*")], pending=_queue(5))
    p = plan(snap, NOW, queue_depth=2)
    assert [s.job_id for s in p.starts] == [10, 11]  # all five would fit: only two looked at
    assert p.beyond == [12, 13, 14]
    assert {j: p.reasons[j] for j in p.beyond} == {12: "Priority", 13: "Priority", 14: "Priority"}
    unbounded = plan(snap, NOW)
    assert [s.job_id for s in unbounded.starts] == [10, 11, 12, 13, 14]
    assert unbounded.beyond == []


def test_jobs_skipped_before_placement_do_not_count_against_the_depth() -> None:
    queue = _queue(4)
    queue[0]["dependency"] = [{"type": "afterok", "jobs": [1]}]  # waits: not examined for nodes
    queue[1]["eligible_time"] = NOW + 3600  # BeginTime
    snap = snapshot(
        [node("n1", cpus=8)],
        [partition("batch", "n*")],
        pending=queue,
        dep_states={1: JobState.RUNNING},
    )
    p = plan(snap, NOW, queue_depth=2)
    assert [s.job_id for s in p.starts] == [12, 13]
    assert p.reasons[10].startswith("Dependency") and p.reasons[11].startswith("BeginTime")
    assert p.beyond == []


def test_a_blocked_head_within_the_depth_still_reserves() -> None:
    """The head that does not fit is within the depth: backfill still protects it, and
    jobs beyond the depth do not start even if they would fit."""
    queue = [job(10, cpus_per_node=8, partitions="batch"), *_queue(3)[1:]]
    for j in queue[1:]:
        j["time_limit_s"] = 300  # ends before the head's reservation: may backfill
    snap = snapshot(
        [node("n1", cpus=8)],
        [partition("batch", "n*")],
        pending=queue,
        allocations=[
            {
                "job_id": 1,
                "node": "n1",
                "cpus": 2,
                "mem_mb": 512,
                "gpu_ids": [],
                "exclusive": False,
                "expected_end": NOW + 600,
            }
        ],
    )
    p = plan(snap, NOW, queue_depth=2)
    assert p.reasons[10] == "Resources"
    assert [s.job_id for s in p.starts] == [11]  # 12 would backfill too, but is not examined
    assert p.beyond == [12]


def test_explain_names_the_queue_depth() -> None:
    queue = _queue(4)
    snap = snapshot([node("n1", cpus=8)], [partition("batch", "n*")], pending=queue)
    e = explain_pending(queue[3], snap, NOW, queue_depth=2)
    assert e.summary.startswith("behind the scheduler's queue depth (2 jobs examined per pass")
    assert "scheduler's reason: Priority" in e.lines
    inside = explain_pending(queue[1], snap, NOW, queue_depth=2)
    assert inside.verdict == "start"


def test_config_default_and_check(tmp_path: Path) -> None:
    assert Config().cluster.queue_depth == DEFAULT_QUEUE_DEPTH
    cfg = tmp_path / "phalanx.toml"
    cfg.write_text("[cluster]\nqueue_depth = 5000\n")
    assert load_config(cfg).cluster.queue_depth == 5000
    cfg.write_text("[cluster]\nqueue_depth = 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "queue_depth" in err.value.message
