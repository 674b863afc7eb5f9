"""The chaos test's history checker (tests/system/history.py) catches each kind of violation.

A good history (two jobs, one requeued after a node failure, a lease handed from ctl-1 to ctl-2
under a new term) passes; each test breaks it in one way and expects that exact violation kind,
so a checker that silently stopped looking would fail here rather than bless a broken run.
"""

from __future__ import annotations

import dataclasses

import pytest

from system.history import (
    Attempt,
    Event,
    Fault,
    History,
    Holding,
    Job,
    LeaseSample,
    Run,
    Submission,
    Violation,
    check,
    parse_runs,
    summarize,
)

SCHED = "sched:batch"


def take(eid: int, ts: float, who: str, lease: str, term: int) -> Event:
    return Event(eid, ts, "lease.take", f"{who} took lease {lease} term {term}", None, who, term)


def state(eid: int, ts: float, job: int, frm: str, to: str, kind: str | None = None) -> Event:
    kind = kind or f"job.{to.lower()}"
    return Event(eid, ts, kind, f"{frm} -> {to}", job, "ctl-1", None, frm, to)


def starting(eid: int, ts: float, job: int, attempt: int, term: int, who: str) -> Event:
    return Event(
        eid,
        ts,
        "job.starting",
        f"allocated node01 in batch (attempt {attempt})",
        job,
        who,
        term,
        "PENDING",
        "STARTING",
    )


def good() -> History:
    """Job 1 ran once under ctl-1's term 1; job 2's first run (term 1) was fenced when node01
    went down (cluster lease term 1), ctl-2 took the scheduling lease (term 2) and ran it again."""
    jobs = [
        Job(1, "c-1", "COMPLETED", 0, (Attempt(11, 0, "batch", 1, 10.0),)),
        Job(
            2,
            "c-2",
            "COMPLETED",
            0,
            (Attempt(21, 0, "batch", 1, 10.5), Attempt(22, 1, "batch", 2, 20.0)),
        ),
    ]
    events = [
        take(1, 5.0, "ctl-1", SCHED, 1),
        take(2, 5.1, "ctl-1", "cluster", 1),
        starting(3, 10.0, 1, 11, 1, "ctl-1"),
        starting(4, 10.5, 2, 21, 1, "ctl-1"),
        state(5, 11.0, 1, "STARTING", "RUNNING"),
        state(6, 11.2, 2, "STARTING", "RUNNING"),
        state(7, 12.5, 1, "RUNNING", "COMPLETED"),
        Event(8, 17.0, "node.down", "DOWN: no heartbeat", None, "ctl-1", 1, node="node01"),
        state(9, 17.0, 2, "RUNNING", "PENDING", kind="job.requeue"),
        take(10, 19.0, "ctl-2", SCHED, 2),
        starting(11, 20.0, 2, 22, 2, "ctl-2"),
        state(12, 20.5, 2, "STARTING", "RUNNING"),
        state(13, 22.0, 2, "RUNNING", "COMPLETED"),
    ]
    runs = [
        Run(1, 11, "node01", 10.2, 12.3, True),
        Run(2, 21, "node01", 10.7, 14.0, False),
        Run(2, 22, "node02", 20.1, 21.9, True),
    ]
    samples = [
        LeaseSample(6.0, {SCHED: ("ctl-1", 1), "cluster": ("ctl-1", 1)}),
        LeaseSample(16.0, {SCHED: ("ctl-1", 1), "cluster": ("ctl-1", 1)}),
        LeaseSample(21.0, {SCHED: ("ctl-2", 2), "cluster": ("ctl-1", 1)}),
    ]
    subs = [
        Submission("c-1", "acked", 1),
        Submission("c-2", "unknown"),
        Submission("c-3", "refused"),
    ]
    faults = [Fault("node01", "agent-down", 13.0, 18.0)]  # its agent killed until DOWN
    return History(subs, jobs, runs, events, samples, faults, [Holding("cpus", "node01", 0)])


def kinds(h: History) -> list[str]:
    return sorted({v.kind for v in check(h)})


def replace_job(h: History, job_id: int, **kw: object) -> History:
    jobs = [
        dataclasses.replace(j, **kw)  # type: ignore[arg-type]
        if j.id == job_id
        else j
        for j in h.jobs
    ]
    return dataclasses.replace(h, jobs=jobs)


def test_a_good_history_passes() -> None:
    h = good()
    assert check(h) == []
    s = summarize(h)
    assert (s.jobs, s.runs, s.requeued_jobs, s.stopped_runs, s.takes) == (2, 3, 1, 1, 3)
    assert s.term_writes == 7  # 3 attempts, 3 job.starting events, 1 node.down


def test_parse_runs_splits_executions_and_ignores_torn_lines() -> None:
    text = (
        "start 11 node01 10.0\n"
        "tick 11 10.5\n"
        "start 12 node02 20.0\n"
        "tick 12 20.2\n"
        "end 12 20.4\n"
        "tick 11 1"  # torn: the first run was killed mid-write (still a number: counted)
        "\nstart 13 nod"  # torn start: ignored
    )
    runs = parse_runs(7, text)
    assert [(r.attempt_id, r.node, r.start, r.finished) for r in runs] == [
        (11, "node01", 10.0, False),
        (12, "node02", 20.0, True),
    ]
    assert runs[0].last == 10.5 and runs[1].last == 20.4


# ---------------------------------------------------------------------- submissions
def test_lost_acknowledged_job() -> None:
    h = good()
    h = dataclasses.replace(h, submissions=[*h.submissions, Submission("c-4", "acked", 99)])
    assert kinds(h) == ["lost"]


def test_acknowledged_id_holding_another_job_is_lost() -> None:
    h = replace_job(good(), 1, name="c-9")
    assert "lost" in kinds(h)


def test_submission_applied_twice() -> None:
    h = good()
    dup = dataclasses.replace(h.jobs[0], id=3, attempts=(Attempt(31, 0, "batch", 1, 10.1),))
    h = dataclasses.replace(h, jobs=[*h.jobs, dup])
    assert "duplicate-submit" in kinds(h)


def test_refused_submission_in_the_store() -> None:
    h = good()
    h = dataclasses.replace(h, submissions=[*h.submissions[:2], Submission("c-2", "refused")])
    assert "phantom" in kinds(h)


def test_job_nobody_submitted() -> None:
    h = good()
    h = dataclasses.replace(h, submissions=h.submissions[:1])
    assert kinds(h) == ["unknown-job"]


def test_one_id_acknowledged_twice() -> None:
    h = good()
    h = dataclasses.replace(h, submissions=[*h.submissions, Submission("c-1", "acked", 1)])
    assert "duplicate-ack" in kinds(h)


# ---------------------------------------------------------------------- runs
def test_overlapping_executions() -> None:
    h = good()
    runs = list(h.runs)
    runs[1] = dataclasses.replace(runs[1], last=20.2)  # the fenced run outlived the new start
    # (and so also outlived its node's DOWN at 17.0)
    assert kinds(dataclasses.replace(h, runs=runs)) == ["alive-on-down", "overlap"]


def test_execution_without_an_attempt_in_the_store() -> None:
    h = good()
    # job 1 ran again, one attempt (and its work ran to its end twice, node01 never DOWN)
    runs = [*h.runs, Run(1, 11, "node02", 13.0, 14.0, True)]
    assert kinds(dataclasses.replace(h, runs=runs)) == ["double-run", "early-rerun"]
    runs = [*h.runs, Run(1, 12, "node02", 13.0, 14.0, False)]
    assert kinds(dataclasses.replace(h, runs=runs)) == ["unrecorded-run"]
    runs = [*h.runs, Run(5, 51, "node02", 13.0, 14.0, True)]
    assert kinds(dataclasses.replace(h, runs=runs)) == ["unrecorded-run"]


def test_completed_job_whose_last_attempt_never_finished() -> None:
    h = good()
    runs = [r if r.attempt_id != 22 else dataclasses.replace(r, finished=False) for r in h.runs]
    assert kinds(dataclasses.replace(h, runs=runs)) == ["missing-run"]
    assert "missing-run" in kinds(dataclasses.replace(h, runs=h.runs[:2]))


# ---------------------------------------------------------------------- terminal states
def test_two_terminal_states() -> None:
    h = good()
    events = [*h.events, state(14, 23.0, 1, "COMPLETED", "FAILED")]
    assert kinds(dataclasses.replace(h, events=events)) == ["state-mismatch", "terminal-count"]


def test_state_change_after_the_end() -> None:
    h = good()
    events = [*h.events, state(14, 23.0, 1, "COMPLETED", "PENDING", kind="job.requeue")]
    assert kinds(dataclasses.replace(h, events=events)) == ["after-terminal", "state-mismatch"]


def test_not_ended_or_ended_otherwise() -> None:
    assert "not-terminal" in kinds(replace_job(good(), 1, state="RUNNING"))
    h = good()
    events = [e if e.id != 7 else dataclasses.replace(e, to_state="FAILED") for e in h.events]
    h = replace_job(dataclasses.replace(h, events=events), 1, state="FAILED", exit_code=1)
    assert kinds(h) == ["unexpected-end"]
    assert "unexpected-end" in kinds(replace_job(good(), 1, exit_code=3))


def node_fail_after(retries: list[int], budget: int, h: History | None = None) -> History:
    """Job 1 requeued after a node failure once for each of `retries` ("retry k of `budget`"),
    then ended NODE_FAIL with its budget of `budget` retries used."""
    h = h or good()
    events = [e for e in h.events if e.id != 7]  # job 1 no longer completes
    eid, ts, state_now = 100, 12.5, "RUNNING"
    for k in retries:
        why = f"RUNNING -> PENDING: requeued after node failure: node01 (retry {k} of {budget})"
        events.append(Event(eid, ts, "job.requeue", why, 1, "ctl-1", None, "RUNNING", "PENDING"))
        events.append(state(eid + 1, ts + 0.1, 1, "PENDING", "STARTING"))
        events.append(state(eid + 2, ts + 0.2, 1, "STARTING", "RUNNING"))
        eid, ts = eid + 3, ts + 1
    end = (
        "RUNNING -> NODE_FAIL: node failure: node01; not retried: "
        f"all {budget} retries used (--retries={budget})"
    )
    events.append(Event(eid, ts, "job.node_fail", end, 1, "ctl-1", None, state_now, "NODE_FAIL"))
    return replace_job(dataclasses.replace(h, events=events), 1, state="NODE_FAIL", exit_code=None)


def test_node_fail_is_expected_only_when_node_failures_spent_every_retry() -> None:
    assert check(node_fail_after([1, 2, 3], 3)) == []
    assert kinds(node_fail_after([1, 3], 3)) == ["unexpected-end"]  # one retry never happened
    assert kinds(node_fail_after([1, 2, 2, 3], 3)) == ["unexpected-end"]  # one counted twice
    assert kinds(node_fail_after([1, 2], 5)) == ["unexpected-end"]  # the budget was not spent


def test_missing_state_event_breaks_the_chain() -> None:
    h = good()
    events = [e for e in h.events if e.id != 5]
    assert kinds(dataclasses.replace(h, events=events)) == ["state-chain"]


# ---------------------------------------------------------------------- terms
def test_same_term_taken_by_two_controllers() -> None:
    h = good()
    events = [*h.events, take(14, 19.5, "ctl-3", SCHED, 2)]
    assert "term-holder" in kinds(dataclasses.replace(h, events=events))


def test_controller_takes_a_lower_term() -> None:
    h = good()
    events = [*h.events, take(14, 23.0, "ctl-1", SCHED, 2), take(15, 24.0, "ctl-1", SCHED, 1)]
    assert "term-regress" in kinds(dataclasses.replace(h, events=events))


def test_sampled_term_goes_down_or_changes_holder() -> None:
    h = good()
    samples = [*h.samples, LeaseSample(25.0, {SCHED: ("ctl-1", 1)})]
    assert "term-regress" in kinds(dataclasses.replace(h, samples=samples))
    samples = [*h.samples, LeaseSample(25.0, {SCHED: ("ctl-3", 2)})]
    assert kinds(dataclasses.replace(h, samples=samples)) == ["term-holder"]


def test_write_under_a_stale_term() -> None:
    h = good()
    # ctl-1 (term 1) scheduled job 1 again after ctl-2 took term 2 at 19.0
    events = [*h.events, starting(14, 19.4, 1, 11, 1, "ctl-1")]
    assert "stale-write" in kinds(dataclasses.replace(h, events=events))
    # an attempt created under term 1 after the take of term 2
    h2 = replace_job(
        good(),
        2,
        attempts=(Attempt(21, 0, "batch", 1, 10.5), Attempt(22, 1, "batch", 1, 20.0)),
    )
    assert "stale-write" in kinds(h2)
    # node.down under the cluster term 1 after someone took cluster term 2
    h3 = good()
    events = [*h3.events, take(14, 16.0, "ctl-2", "cluster", 2)]
    assert kinds(dataclasses.replace(h3, events=events)) == ["stale-write"]


def test_a_spare_lost_is_written_under_the_cluster_lease() -> None:
    h = good()
    lost = Event(14, 20.2, "job.spare_lost", "spare node node02 lost", 2, "ctl-1", 1, node="node02")
    # the detector's write carries the cluster term (1, still current): the scheduling lease's
    # term 2, taken by ctl-2 at 19.0, does not make it stale
    assert check(dataclasses.replace(h, events=[*h.events, lost])) == []
    events = [*h.events, take(14, 16.0, "ctl-2", "cluster", 2), dataclasses.replace(lost, id=15)]
    assert kinds(dataclasses.replace(h, events=events)) == ["stale-write"]


def test_write_by_a_controller_that_does_not_hold_the_term() -> None:
    h = good()
    events = [e if e.id != 11 else dataclasses.replace(e, controller="ctl-3") for e in h.events]
    assert kinds(dataclasses.replace(h, events=events)) == ["foreign-write"]


def test_termed_event_of_no_known_lease_and_unreadable_take() -> None:
    h = good()
    events = [*h.events, Event(14, 23.0, "node.weird", "?", None, "ctl-1", 1)]
    assert kinds(dataclasses.replace(h, events=events)) == ["unattributed"]
    events = [*h.events, Event(14, 23.0, "lease.take", "ctl-1 took something", None, "ctl-1", 3)]
    assert kinds(dataclasses.replace(h, events=events)) == ["bad-take"]


@pytest.mark.parametrize(
    "v", [Violation("overlap", "job 1", "attempt 2 started while attempt 1 ran")]
)
def test_violation_reads_as_one_line(v: Violation) -> None:
    assert str(v) == "overlap [job 1]: attempt 2 started while attempt 1 ran"


# ---------------------------------------------------------------------- nodes and leftovers
def test_a_job_alive_on_its_node_after_the_node_went_down() -> None:
    """Job 2's first run ticked on node01 after node01 was declared DOWN at 17.0: its
    self-fencing failed (the run also overlaps its rerun's start)."""
    h = good()
    runs = [dataclasses.replace(r, last=17.5) if r.attempt_id == 21 else r for r in h.runs]
    assert kinds(dataclasses.replace(h, runs=runs)) == ["alive-on-down"]
    # a node that came back (node.up) runs jobs again: fine
    events = [*h.events, Event(14, 25.0, "node.up", "back", None, "node01", node="node01")]
    later = [*h.runs, Run(1, 11, "node01", 26.0, 27.0, False)]
    assert "alive-on-down" not in kinds(dataclasses.replace(h, events=events, runs=later))


def test_a_node_declared_down_without_a_fault_is_a_false_down() -> None:
    h = good()
    assert kinds(dataclasses.replace(h, faults=[])) == ["false-down"]
    # a fault on another node does not excuse it, nor one that ended before
    other = [Fault("node02", "agent-freeze", 13.0, 18.0), Fault("node01", "partition", 1, 9)]
    assert kinds(dataclasses.replace(h, faults=other)) == ["false-down"]


def test_work_finished_twice_needs_its_node_declared_down_between() -> None:
    """Job 2's first run finished on node01 but its report was lost: its rerun is fine only
    because node01 was declared DOWN between the two; counted in the summary."""
    h = good()
    runs = [dataclasses.replace(r, finished=True) if r.attempt_id == 21 else r for r in h.runs]
    finished_twice = dataclasses.replace(h, runs=runs)
    assert check(finished_twice) == []
    assert summarize(finished_twice).finished_twice == 1
    events = [e for e in h.events if e.kind != "node.down"]
    assert "early-rerun" in kinds(dataclasses.replace(finished_twice, events=events))


def test_something_held_after_every_job_ended() -> None:
    h = good()
    held = [Holding("gpus", "node02", 1), Holding("licence fluent", "cluster", 2)]
    bad = dataclasses.replace(h, held=held)
    assert kinds(bad) == ["held-after-end"]
    assert len(check(bad)) == 2
