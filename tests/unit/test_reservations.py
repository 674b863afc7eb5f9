"""Reservations as pure logic (domain/reservations.py) and as scontrol and sinfo parse and print
them (slurm/scontrol_resv.py): what operators type, who may use one, which nodes each job may
use in a scheduling pass and the reason it waits."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from explain_cluster import small_cluster, small_job

from phalanx.domain import reservations as r
from phalanx.domain import scheduling
from phalanx.domain.reservations import Reservation
from phalanx.slurm import scontrol_resv
from phalanx.slurm.common import SlurmUsageError, timestamp

NOW = datetime(2026, 12, 2, 14, 0, 0).timestamp()


def resv(
    name: str = "r1",
    nodes: tuple[str, ...] = ("n1", "n2"),
    start: float = NOW,
    end: float | None = None,
    users: tuple[str, ...] = ("alice",),
    accounts: tuple[str, ...] = (),
    flags: frozenset[str] = frozenset(),
) -> Reservation:
    return Reservation(
        name, nodes, start, end if end is not None else start + 3600, users, accounts, flags
    )


def row(x: Reservation) -> dict[str, Any]:
    return {
        "name": x.name,
        "nodes": list(x.nodes),
        "start": x.start,
        "end": x.end,
        "users": list(x.users),
        "accounts": list(x.accounts),
        "flags": sorted(x.flags),
        "partition": x.partition,
    }


# ---------------------------------------------------------------------- what operators type
def test_parse_flags_any_case_and_refusals() -> None:
    assert r.parse_flags("maint,Ignore_Jobs") == {"MAINT", "IGNORE_JOBS"}
    with pytest.raises(ValueError, match="Error parsing flags BOGUS: supported flags are"):
        r.parse_flags("BOGUS")
    with pytest.raises(ValueError, match="Flags=DAILY is not supported here: recurring"):
        r.parse_flags("daily")
    assert r.format_flags({"SPEC_NODES", "MAINT"}) == "MAINT,SPEC_NODES"


def test_parse_names_and_names() -> None:
    assert r.parse_names("bob,alice,bob", "Users") == ("alice", "bob")
    with pytest.raises(ValueError, match="excluding users with '-' is not supported"):
        r.parse_names("-bob", "Users")
    assert r.check_name(" maint_rack3 ") == "maint_rack3"
    with pytest.raises(ValueError, match="invalid reservation name"):
        r.check_name("a b")


def test_check_times() -> None:
    r.check_times(NOW, NOW + 60, NOW)
    with pytest.raises(ValueError, match="must end after it starts"):
        r.check_times(NOW, NOW, NOW)
    with pytest.raises(ValueError, match="which has passed"):
        r.check_times(NOW - 120, NOW - 60, NOW)


def test_overlaps_busy_nodes_and_picking() -> None:
    a = resv("a", ("n1", "n2"))
    b = resv("b", ("n2", "n3"), start=NOW + 600)
    assert r.overlapping(b, [a], NOW) == [a]
    assert r.overlapping(resv("c", ("n3",)), [a], NOW) == []
    assert r.overlapping(resv("c", ("n2",), start=NOW + 3600), [a], NOW) == []  # after a
    assert r.overlapping(resv("m", ("n2",), flags=frozenset({"MAINT"})), [a], NOW) == []
    running = [{"nodes": ["n1"], "end": NOW + 100}, {"nodes": ["n3"], "end": None}]
    assert r.busy_nodes(resv("x", ("n1", "n3")), running) == ["n1", "n3"]
    assert r.busy_nodes(resv("x", ("n1", "n3"), start=NOW + 200), running) == ["n3"]
    assert r.busy_nodes(resv("x", ("n3",), flags=frozenset({"IGNORE_JOBS"})), running) == []
    assert r.pick_nodes(["n1", "n2", "n3", "n4"], 2, taken=["n1"], busy=["n2"]) == ["n3", "n4"]
    with pytest.raises(ValueError, match="NodeCnt=3: only 2 usable nodes"):
        r.pick_nodes(["n1", "n2", "n3"], 3, taken=["n3"])


def test_submit_refusal_in_slurms_words() -> None:
    x = resv(users=("alice",), accounts=("physics",))
    assert r.submit_refusal(x, "alice", "other", NOW) is None
    assert r.submit_refusal(x, "bob", "physics", NOW) is None
    denied = r.submit_refusal(x, "bob", "chem", NOW)
    assert denied and denied.startswith("Access denied to requested reservation ("), denied
    assert "users alice" in denied and "accounts physics" in denied
    missing = r.submit_refusal(None, "bob", None, NOW)
    assert missing and missing.startswith("Requested reservation is invalid")
    over = r.submit_refusal(resv(start=NOW - 7200), "alice", None, NOW)
    assert over and over.startswith("Requested reservation is invalid")


# ---------------------------------------------------------------------- the scheduling pass
def _snap(nodes: list[str], rows: list[Reservation], pending: list[dict[str, Any]]) -> Any:
    return small_cluster(nodes, pending, resv=[row(x) for x in rows])


def _job(jid: int, limit: int | None, nodes: int = 1, resv: str | None = None) -> dict[str, Any]:
    return small_job(jid, limit, nodes, reservation=resv)


def test_an_active_reservation_keeps_other_jobs_off_and_its_jobs_on_its_nodes() -> None:
    snap = _snap(
        ["n1", "n2", "n3"],
        [resv("r1", ("n2", "n3"))],
        [_job(1, 60), _job(2, 60), _job(3, 60, resv="r1"), _job(4, 60, nodes=2, resv="r1")],
    )
    plan = scheduling.plan(snap, NOW)
    where = {p.job_id: p.nodes for p in plan.starts}
    # job 1 takes n1 (the only node outside); job 2 waits though n2 and n3 are free
    assert where == {1: ("n1",), 3: ("n2",)}, plan
    assert plan.reasons[2].startswith("ReqNodeNotAvail, May be reserved for other job ("), plan
    assert "reservation r1 holds n[2-3] now" in plan.reasons[2]
    assert not plan.reasons[4].startswith("ReqNodeNotAvail")  # its own nodes are busy


def test_a_job_whose_limit_runs_into_a_later_reservation_is_kept_off() -> None:
    later = resv("later", ("n1",), start=NOW + 600, flags=frozenset({"MAINT"}))
    snap = _snap(["n1"], [later], [_job(1, 3600), _job(2, None)])
    plan = scheduling.plan(snap, NOW)
    assert not plan.starts
    assert plan.reasons[1].startswith("ReqNodeNotAvail, Reserved for maintenance ("), plan
    assert "from 14:10, which its time limit would reach" in plan.reasons[1]
    # one that ends before the reservation starts runs
    snap = _snap(["n1"], [later], [_job(3, 300)])
    assert [p.nodes for p in scheduling.plan(snap, NOW).starts] == [("n1",)]


def test_a_job_of_a_reservation_waits_for_its_start_and_for_a_deleted_one() -> None:
    later = resv("later", ("n1",), start=NOW + 600)
    snap = _snap(["n1", "n2"], [later], [_job(1, 60, resv="later"), _job(2, 60, resv="gone")])
    plan = scheduling.plan(snap, NOW)
    assert not plan.starts
    assert plan.reasons[1] == "Reservation (reservation later starts at 14:10)"
    assert plan.reasons[2].startswith("Reservation (reservation gone has ended or was deleted")
    # once it has started, the job runs there
    plan = scheduling.plan(snap, NOW + 601)
    assert [(p.job_id, p.nodes) for p in plan.starts] == [(1, ("n1",))]


def test_an_ended_reservation_keeps_nobody_off() -> None:
    over = resv("over", ("n1",), start=NOW - 7200)
    snap = _snap(["n1"], [over], [_job(1, None)])
    assert [p.nodes for p in scheduling.plan(snap, NOW).starts] == [("n1",)]


def test_a_job_in_one_reservation_is_kept_off_another() -> None:
    a = resv("a", ("n1",))
    b = resv("b", ("n1", "n2"), start=NOW + 600, flags=frozenset({"OVERLAP"}))
    snap = _snap(["n1", "n2"], [a, b], [_job(1, 3600, resv="a"), _job(2, 300, resv="a")])
    plan = scheduling.plan(snap, NOW)
    # job 1 would run into b on n1; job 2 ends before b starts
    assert [(p.job_id, p.nodes) for p in plan.starts] == [(2, ("n1",))], plan


# ---------------------------------------------------------------------- scontrol and sinfo
def test_scontrol_parses_keys_in_any_case() -> None:
    name, body = scontrol_resv.parse(
        [
            "reservationname=r1",
            "STARTTIME=now+1hour",
            "duration=1:30:00",
            "Nodes=n[1-2]",
            "users=bob,alice",
            "accounts=phys",
            "flags=maint,ignore_jobs",
            "PartitionName=batch",
        ],
        NOW,
        what="created",
    )
    assert name == "r1"
    assert body == {
        "start": NOW + 3600,
        "duration": 5400.0,
        "nodes": "n[1-2]",
        "users": ["alice", "bob"],
        "accounts": ["phys"],
        "flags": ["IGNORE_JOBS", "MAINT"],
        "partition": "batch",
    }
    _, body = scontrol_resv.parse(["NodeCnt=2", "Duration=60", "EndTime=15:00"], NOW, what="x")
    assert body["node_count"] == 2 and body["duration"] == 3600.0
    assert body["end"] == NOW + 3600


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("Bogus=1", "Unknown parameter Bogus=1.  No reservation created."),
        ("Groups=wheel", "Groups= is not supported here: reservations are for users"),
        ("CoreCnt=4", "CoreCnt= is not supported here: reservations here hold whole nodes"),
        ("Flags=BOGUS", "Flags=BOGUS: Error parsing flags BOGUS"),
        ("Users+=bob", "Users+=bob: adding to or taking from a list with +="),
        ("Duration=UNLIMITED", "Duration=UNLIMITED: a reservation needs an end here"),
        ("NodeCnt=0", "NodeCnt=0: give a node count"),
        ("StartTime=soon", "StartTime=soon: invalid start time"),
    ],
)
def test_scontrol_refuses_with_what_is_wrong(word: str, message: str) -> None:
    with pytest.raises(SlurmUsageError, match="^" + message.replace("+", r"\+")):
        scontrol_resv.parse(["ReservationName=r1", word], NOW, what="created")


def test_show_reservation_lines_are_slurms() -> None:
    view = {
        "name": "r1",
        "nodes": "n[1-2]",
        "node_names": ["n1", "n2"],
        "start": NOW,
        "end": NOW + 3600,
        "users": ["root"],
        "accounts": [],
        "flags": ["SPEC_NODES", "MAINT"],
        "partition": None,
    }
    lines = scontrol_resv.lines(view, {"n1": 4, "n2": 4}, NOW + 1)
    assert lines == [
        f"ReservationName=r1 StartTime={timestamp(NOW)} EndTime={timestamp(NOW + 3600)} "
        "Duration=01:00:00",
        "Nodes=n[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) "
        "Flags=MAINT,SPEC_NODES",
        "TRES=cpu=8",
        "Users=root Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE "
        "BurstBuffer=(null) Watts=n/a",
        "MaxStartDelay=(null)",
    ]
    later = {**view, "name": "b", "start": NOW + 90000, "end": NOW + 91800}
    text = scontrol_resv.sinfo_lines([view, later], NOW)
    # Slurm 22.05's `sinfo -T`, column for column
    assert text.splitlines() == [
        "RESV_NAME     STATE           START_TIME             END_TIME     DURATION  NODELIST",
        f"r1           ACTIVE  {timestamp(NOW)}  {timestamp(NOW + 3600)}     01:00:00  n[1-2]",
        f"b          INACTIVE  {timestamp(NOW + 90000)}  {timestamp(NOW + 91800)}     00:30:00"
        "  n[1-2]",
    ]


# ---------------------------------------------------------------------- the cluster duty
def test_due_phases_start_end_skip_and_close() -> None:
    P = r.Phase
    soon, on, over, gone = (
        resv("soon", start=NOW + 60),
        resv("on", start=NOW - 60),
        resv("over", start=NOW - 7200, end=NOW - 1),
        resv("gone", start=NOW - 7200, end=NOW - 10),
    )
    rows = [
        (soon, P.SCHEDULED),
        (on, P.SCHEDULED),
        (over, P.ACTIVE),
        (gone, P.SCHEDULED),
        (resv("ran", start=NOW - 7200, end=NOW - 5), P.ENDED),
        (resv("busy", start=NOW - 7200, end=NOW - 5), P.ENDED),
    ]
    moves = {
        c.reservation.name: (c.old, c.new, c.skipped) for c in r.due_phases(rows, NOW, ["busy"])
    }
    assert moves == {
        "on": (P.SCHEDULED, P.ACTIVE, False),
        "over": (P.ACTIVE, P.ENDED, False),
        "gone": (P.SCHEDULED, P.ENDED, True),  # ended before anyone recorded its start
        "ran": (P.ENDED, P.CLOSED, False),  # no job of it runs any more
    }
    # exactly at the start and at the end: due (a reservation is active from start to end)
    assert [c.new for c in r.due_phases([(soon, P.SCHEDULED)], soon.start)] == [P.ACTIVE]
    assert [c.new for c in r.due_phases([(on, P.ACTIVE)], on.end)] == [P.ENDED]
    assert r.due_phases([(on, P.ACTIVE)], on.end - 0.001) == []


def test_due_end_stops_at_the_end_plus_the_overrun_minus_the_grace() -> None:
    x = resv("r1", start=NOW - 3600, end=NOW + 100)
    jobs = [
        r.InReservation(1, 11, "r1", ("n1",), grace=30.0),
        r.InReservation(2, 12, "r1", ("n2",), grace=150.0),  # asked for more warning
        r.InReservation(3, 13, "other", ("n3",), grace=30.0),  # unknown reservation: left
        r.InReservation(4, 14, "r1", ("n3",), grace=30.0, stopping=True),  # stopped already
    ]
    by = {"r1": x}
    assert [s.job_id for s in r.due_end_stops(by, jobs, NOW, 0.0)] == [12]
    assert r.due_end_stops(by, jobs, NOW, 0.0)[0].at == x.end
    # the caller's tick: a signal due before its next tick goes out now
    assert [s.job_id for s in r.due_end_stops(by, jobs, NOW + 69.5, 0.0, early=1.0)] == [11, 12]
    assert [s.job_id for s in r.due_end_stops(by, jobs, NOW + 69.5, 0.0)] == [12]
    # an overrun moves the stop later; past it, everyone still running is stopped at once
    assert [s.job_id for s in r.due_end_stops(by, jobs, NOW + 100, 600.0)] == []
    late = r.due_end_stops(by, jobs, NOW + 5000, 600.0)
    assert [(s.job_id, s.at) for s in late] == [(11, x.end + 600), (12, x.end + 600)]
    # UNLIMITED (None): never stopped
    assert r.due_end_stops(by, jobs, NOW + 10**6, None) == []


def test_end_stop_reason_is_slurms_and_ends_the_job_timeout() -> None:
    from phalanx.domain.policy import FailurePolicy, after_attempt, is_timeout_stop
    from phalanx.domain.states import JobState

    x = resv("rack3.a@b", start=NOW - 3600, end=NOW)
    why = r.end_stop_reason(x, 0.0, NOW)
    assert why == (
        "timeout: Reservation rack3.a@b, which this job was running under, has ended (at 14:00)"
    )
    assert "reservation_overrun 600s" in r.end_stop_reason(x, 600.0, NOW)
    assert r.reservation_of_stop(why) == "rack3.a@b"
    assert r.reservation_of_stop("requeue: maintenance 3 on n1 at 15:00") is None
    assert is_timeout_stop(why)
    v = after_attempt(
        result=JobState.FAILED,  # SIGTERM at the end of its grace
        reason="task on n1 was killed by signal 15",
        stop_reason=why,
        requeue=True,
        lost_nodes=[],
        launch_failed=[],
        launch_failures=0,
        policy=FailurePolicy(),
    )
    assert (v.state, v.reason, v.retry) == (
        JobState.TIMEOUT,
        "Reservation rack3.a@b, which this job was running under, has ended (at 14:00)",
        False,
    )


def test_end_event_text_says_what_happens_to_the_jobs_still_in_it() -> None:
    x = resv("r1", start=NOW - 3600, end=NOW)
    assert r.end_event_text(x, NOW, [], 0.0, skipped=False) == (
        "reservation r1 on n[1-2] ended at 14:00"
    )
    text = r.end_event_text(x, NOW, [7, 8], 0.0, skipped=False)
    assert text.endswith(
        "jobs 7, 8 still in it are stopped at its end (reservation_overrun 0s) and end TIMEOUT"
    ), text
    assert "job 7 still in it is stopped at 14:10 (reservation_overrun 600s)" in (
        r.end_event_text(x, NOW, [7], 600.0, skipped=False)
    )
    assert "jobs 7, 8 still in it run on to their time limit (reservation_overrun UNLIMITED)" in (
        r.end_event_text(x, NOW, [7, 8], None, skipped=False)
    )
    assert "job 7 still in it runs on to its time limit" in (
        r.end_event_text(x, NOW, [7], None, skipped=False)
    )
    assert "(no controller recorded its start)" in r.end_event_text(x, NOW, [], 0, skipped=True)


def test_the_duty_gives_an_end_stop_the_time_left_as_its_grace() -> None:
    """On whichever controller answers the node: the stop time is the reservation's end plus
    this controller's overrun, looked up once per attempt; other stops are left as they are."""
    from phalanx.controller.reservations import ReservationDuty

    class Ends:
        asked: list[str] = []

        def reservation_end(self, name: str) -> float | None:
            self.asked.append(name)
            return {"r1": NOW + 100}.get(name)

    store = Ends()
    duty = ReservationDuty(
        store,  # type: ignore[arg-type]
        overrun=lambda: 20.0,
        grace=lambda: 30.0,
        tick=lambda: 1.0,
        fence=lambda: None,
        kick=lambda: None,
        notify=lambda _nodes: None,
    )
    why = r.end_stop_reason(resv("r1", start=NOW - 60, end=NOW + 100), 20.0, NOW)
    stops = [
        {"attempt_id": 1, "reason": why, "checkpoint_grace": 30.0},
        {"attempt_id": 2, "reason": "requeue: maintenance 1 on n1", "checkpoint_grace": 30.0},
        {"attempt_id": 3, "reason": why.replace("r1", "gone"), "checkpoint_grace": 30.0},
    ]
    duty.adjust_stops(stops, now=NOW)
    assert [s["checkpoint_grace"] for s in stops] == [120.0, 30.0, 30.0]
    duty.adjust_stops(stops, now=NOW + 119)
    duty.adjust_stops(stops, now=NOW + 500)  # past it: stopped at once
    assert stops[0]["checkpoint_grace"] == 0.0
    assert store.asked == ["r1", "gone", "gone", "gone"]  # r1's end read once
