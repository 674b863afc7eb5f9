"""Checkpoints and progress that agents report, recorded by the store (SQLite and PostgreSQL).

Heartbeats repeat the latest marker and progress of every task; the store records a checkpoint
once (a `job.checkpoint` event and jobs.checkpoint), only rank 0's, and keeps the attempt's
latest progress; node_work hands both back so the controller can tell news from repeats.
"""

from __future__ import annotations

import time

from test_store_contract import add_node, exited, running, start, store, submit1

from phalanx.controller.exchange import needs_write
from phalanx.domain import job_reports
from phalanx.store.store import Store, TaskReport

__all__ = ["store"]


def report(att: dict[str, object], **kw: object) -> TaskReport:
    return TaskReport(att["id"], att["token"], "running", started_at=time.time(), **kw)  # type: ignore[arg-type]


def checkpoints(store: Store, jid: int) -> list[dict[str, object]]:
    return [e["data"] for e in store.events(job_id=jid) if e["kind"] == "job.checkpoint"]


def test_a_checkpoint_is_recorded_once_per_marker(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, checkpoint_dir="/ck")
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    marker = {"path": "/ck/step-1", "finished_at": 1000.5, "duration_s": 2.5, "request_seq": 1}
    for _ in range(3):  # level-triggered: every heartbeat repeats it
        store.apply_reports("n1", [report(att, checkpoint=marker)], None)
    (rec,) = checkpoints(store, jid)
    assert rec == {**marker, "seq": 0, "node": "n1"}
    assert store.get_job(jid)["checkpoint"] == rec
    (w,) = store.node_work("n1")
    assert w["job_checkpoint"] == rec  # what the controller compares the next report with
    assert not needs_write([w], [report(att, checkpoint=marker)], None)
    newer = {**marker, "path": "/ck/step-2", "finished_at": 1010.0, "duration_s": None}
    assert needs_write([w], [report(att, checkpoint=newer)], None)
    store.apply_reports("n1", [report(att, checkpoint=newer)], None)
    assert [r["path"] for r in checkpoints(store, jid)] == ["/ck/step-1", "/ck/step-2"]
    assert store.get_job(jid)["checkpoint"]["duration_s"] is None


def test_a_requeued_job_announcing_its_checkpoint_again_records_nothing(store: Store) -> None:
    """The next attempt of a requeued job that rewrites its marker with the checkpoint it came
    back from reports the same checkpoint: recorded once, by the attempt that took it."""
    add_node(store, "n1")
    jid = submit1(store, checkpoint_dir="/ck")
    first = start(store, jid, ["n1"])
    marker = {"path": "/ck/step-9", "finished_at": 2000.0, "duration_s": 1.0, "request_seq": 1}
    store.apply_reports("n1", [report(first, checkpoint=marker)], None)
    store.apply_reports("n1", [exited(first, 0)], None)
    assert store.requeue([jid], "alice")[jid].startswith("requeued")
    second = start(store, jid, ["n1"])
    store.apply_reports("n1", [report(second, checkpoint=marker)], None)
    assert [(r["path"], r["seq"]) for r in checkpoints(store, jid)] == [("/ck/step-9", 0)]
    later = {**marker, "path": "/ck/step-12", "finished_at": 2050.0}
    store.apply_reports("n1", [report(second, checkpoint=later)], None)
    assert [(r["path"], r["seq"]) for r in checkpoints(store, jid)] == [
        ("/ck/step-9", 0),
        ("/ck/step-12", 1),
    ]


def test_only_rank_0_records_checkpoints(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, nodes=2, checkpoint_dir="/ck")
    att = start(store, jid, ["n1", "n2"])
    marker = {"path": "/ck/r1", "finished_at": 5.0, "duration_s": 1.0, "request_seq": None}
    store.apply_reports("n2", [report(att, checkpoint=marker)], None)  # rank 1
    assert checkpoints(store, jid) == []
    store.apply_reports("n1", [report(att, checkpoint={**marker, "path": "/ck/r0"})], None)
    assert [r["path"] for r in checkpoints(store, jid)] == ["/ck/r0"]


def test_progress_is_kept_per_attempt_and_throttled(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [report(att, progress={"step": 3, "ts": 100.0})], None)
    assert store.attempts_of(jid)[0]["progress"] == {"step": 3, "ts": 100.0, "node": "n1"}
    store.apply_reports("n1", [report(att, progress={"step": 4, "ts": 101.0})], None)
    assert store.attempts_of(jid)[0]["progress"]["step"] == 3  # within the write interval
    later = 100.0 + job_reports.PROGRESS_WRITE_INTERVAL_S
    store.apply_reports("n1", [report(att, progress={"step": 50, "ts": later})], None)
    assert store.attempts_of(jid)[0]["progress"]["step"] == 50
    (w,) = store.node_work("n1")
    assert w["attempt_progress"]["step"] == 50


def test_progress_of_other_ranks_is_not_recorded(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, nodes=2)
    att = start(store, jid, ["n1", "n2"])
    store.apply_reports("n2", [report(att, progress={"step": 3, "ts": 100.0})], None)
    assert store.attempts_of(jid)[0]["progress"] is None


def test_reports_about_another_attempt_are_ignored(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, checkpoint_dir="/ck")
    att = start(store, jid, ["n1"])
    marker = {"path": "/ck/x", "finished_at": 5.0, "duration_s": 1.0, "request_seq": None}
    wrong = TaskReport(att["id"], "not-the-token", "running", checkpoint=marker)
    store.apply_reports("n1", [wrong], None)
    assert checkpoints(store, jid) == [] and store.get_job(jid)["checkpoint"] is None
