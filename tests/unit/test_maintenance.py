"""Maintenance windows as pure logic: parsing what operators type, which windows keep which jobs
off which nodes, and what the cluster duty must do at a given time."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from explain_cluster import small_cluster, small_job

from phalanx.domain import maintenance as m
from phalanx.domain import scheduling
from phalanx.domain.maintenance import Running, Window, WindowState
from phalanx.store.store import SchedSnapshot

NOW = datetime(2026, 12, 2, 14, 0, 0).timestamp()  # local time, like operators type it


def win(
    wid: int = 1,
    nodes: tuple[str, ...] = ("n1", "n2"),
    start: float = NOW + 3600,
    end: float | None = None,
    state: WindowState = WindowState.SCHEDULED,
    reason: str | None = "firmware",
) -> Window:
    return Window(wid, nodes, start, end if end is not None else start + 3600, reason, state)


# ---------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now", NOW),
        ("now+90", NOW + 90),
        ("now+10min", NOW + 600),
        ("NOW + 2h", NOW + 7200),
        ("now+1.5hours", NOW + 5400),
        ("now+1d", NOW + 86400),
        ("15:00", datetime(2026, 12, 2, 15, 0).timestamp()),
        ("15:00:30", datetime(2026, 12, 2, 15, 0, 30).timestamp()),
        ("13:00", datetime(2026, 12, 3, 13, 0).timestamp()),  # passed today: tomorrow
        ("2026-12-02T15:00", datetime(2026, 12, 2, 15, 0).timestamp()),
        ("2026-12-02 15:00:00", datetime(2026, 12, 2, 15, 0).timestamp()),
        ("2026-12-05", datetime(2026, 12, 5).timestamp()),
        ("2026-12-02T15:00:00+00:00", 1796223600.0),
        ("2026-12-02T15:00:00Z", 1796223600.0),
        ("1796223600", 1796223600.0),
        ("1796223600.5", 1796223600.5),
        ("tomorrow", datetime(2026, 12, 3).timestamp()),
        ("today", datetime(2026, 12, 2).timestamp()),
    ],
)
def test_parse_start_accepts_slurm_and_iso_forms(text: str, expected: float) -> None:
    assert m.parse_start(text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "soon", "now+", "now+10parsecs", "25:00", "12:61", "12/02"])
def test_parse_start_refuses_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="now\\+10min"):
        m.parse_start(text, NOW)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("10min", 600),
        ("4h", 14400),
        ("2d", 172800),
        ("1.5h", 5400),
        ("30", 1800),  # a lone number is minutes, as in --time
        ("0:08", 8),  # MM:SS
        ("2:00:00", 7200),
        ("1-12:00:00", 129600),
    ],
)
def test_parse_window_duration(text: str, seconds: int) -> None:
    assert m.parse_window_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("0", "must be positive"),
        ("0s", "must be positive"),
        ("-5min", "must be positive"),
        ("0:00", "must be positive"),
        ("UNLIMITED", "needs an end"),
        ("5 fortnights", "unknown unit"),
        ("abc", "10min"),
        ("400d", "drain them"),
    ],
)
def test_parse_window_duration_refuses_bad_values(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        m.parse_window_duration(text)


def test_check_window() -> None:
    m.check_window(NOW + 60, NOW + 120, NOW)
    m.check_window(NOW - 60, NOW + 60, NOW)  # already started: active at once, fine
    with pytest.raises(ValueError, match=r"already passed.*later --start"):
        m.check_window(NOW - 120, NOW - 60, NOW)
    with pytest.raises(ValueError, match="end after it starts"):
        m.check_window(NOW + 60, NOW + 60, NOW)
    with pytest.raises(ValueError, match="real time"):
        m.check_window(float("nan"), NOW + 60, NOW)


def test_format_when_shows_the_date_only_for_another_day() -> None:
    assert m.format_when(datetime(2026, 12, 2, 15, 0).timestamp(), NOW) == "15:00"
    assert m.format_when(datetime(2026, 12, 2, 15, 0, 5).timestamp(), NOW) == "15:00:05"
    assert m.format_when(datetime(2026, 12, 3, 9, 30).timestamp(), NOW) == "2026-12-03 09:30"


# ---------------------------------------------------------------------- placement rule
def test_a_job_whose_limit_crosses_the_window_is_kept_off_its_nodes() -> None:
    w = win(start=NOW + 3600)
    assert m.crosses(w, NOW, 3601)
    assert not m.crosses(w, NOW, 3600)  # ends exactly at the start: fine
    assert m.crosses(w, NOW, None)  # UNLIMITED crosses every upcoming window
    assert not m.crosses(w, NOW + 7200, None)  # over
    active = win(start=NOW - 10, state=WindowState.ACTIVE)
    assert m.crosses(active, NOW, 1)  # under way: nothing starts there
    assert not m.crosses(win(state=WindowState.REMOVED), NOW, None)
    assert not m.crosses(win(state=WindowState.DONE), NOW, None)


def test_blocking_windows_names_the_earliest_window_per_node() -> None:
    a = win(1, ("n1", "n2"), start=NOW + 3600)
    b = win(2, ("n2", "n3"), start=NOW + 600)
    assert m.blocking_windows([a, b], NOW, 60) == {}
    got = m.blocking_windows([a, b], NOW, 1800)
    assert {n: w.id for n, w in got.items()} == {"n2": 2, "n3": 2}
    got = m.blocking_windows([a, b], NOW, None)
    assert {n: w.id for n, w in got.items()} == {"n1": 1, "n2": 2, "n3": 2}


def test_pending_reason_says_which_nodes_and_when() -> None:
    w = win(3, ("n1", "n2", "n3", "n4"), start=datetime(2026, 12, 2, 15, 0).timestamp())
    blocked = m.blocking_windows([w], NOW, 7200)
    why = m.pending_reason(blocked, NOW, 7200)
    assert why.startswith("Maintenance: nodes n[1-4] have maintenance at 15:00 (window 3)"), why
    assert "its time limit would cross" in why
    assert "UNLIMITED" in m.pending_reason(blocked, NOW, None)


def _snap(nodes: list[str], windows: list[Window], pending: list[dict[str, Any]]) -> SchedSnapshot:
    rows = [
        {
            "id": w.id,
            "nodes": list(w.nodes),
            "start": w.start,
            "end": w.end,
            "reason": w.reason,
            "state": w.state.value,
        }
        for w in windows
    ]
    return small_cluster(nodes, pending, maintenance=rows)


_job = small_job


def test_plan_keeps_crossing_jobs_off_window_nodes_and_says_why() -> None:
    w = win(1, ("n1", "n2"), start=NOW + 600)
    snap = _snap(
        ["n1", "n2", "n3"],
        [w],
        [_job(1, 3600), _job(2, 300), _job(3, None), _job(4, 3600)],
    )
    plan = scheduling.plan(snap, NOW)
    where = {p.job_id: p.nodes for p in plan.starts}
    # job 1 crosses: only n3; job 2 ends before the window: n1 (first free); job 3 is UNLIMITED
    # and n3 is taken; job 4 crosses and n3 is taken: both wait for the maintenance
    assert where == {1: ("n3",), 2: ("n1",)}, plan
    assert plan.reasons[3].startswith("Maintenance: nodes n[1-2] have maintenance at 14:10")
    assert "UNLIMITED" in plan.reasons[3]
    assert plan.reasons[4].startswith("Maintenance:"), plan.reasons


def test_plan_without_windows_or_with_ended_ones_is_unchanged() -> None:
    over = win(1, ("n1",), start=NOW - 7200, end=NOW - 3600, state=WindowState.ACTIVE)
    removed = win(2, ("n1",), start=NOW + 60, state=WindowState.REMOVED)
    snap = _snap(["n1"], [over, removed], [_job(1, None)])
    assert [p.nodes for p in scheduling.plan(snap, NOW).starts] == [("n1",)]


def test_a_job_busy_nodes_keep_out_waits_for_resources_not_maintenance() -> None:
    w = win(1, ("n1",), start=NOW + 600)
    snap = _snap(["n1", "n2"], [w], [_job(1, 3600, nodes=2)])
    snap.allocations = [
        {
            "job_id": 9,
            "node": "n2",
            "cpus": 4,
            "mem_mb": 1024,
            "gpu_ids": [],
            "exclusive": False,
            "expected_end": NOW + 100,
        }
    ]
    plan = scheduling.plan(snap, NOW)
    assert not plan.starts
    # without the window it would still not fit (n2 is busy): maintenance is not the reason
    assert not plan.reasons[1].startswith("Maintenance"), plan.reasons


# ---------------------------------------------------------------------- the cluster duty
def test_due_transitions() -> None:
    a = win(1, start=NOW - 10, end=NOW + 10)  # scheduled, now inside: start
    b = win(2, start=NOW - 20, end=NOW - 5, state=WindowState.ACTIVE)  # over: end
    c = win(3, start=NOW - 20, end=NOW - 5)  # never started, already over: skip
    d = win(4, start=NOW + 5)  # not yet
    e = win(5, start=NOW - 5, end=NOW + 5, state=WindowState.ACTIVE)  # under way
    f = win(6, start=NOW - 20, end=NOW - 5, state=WindowState.REMOVED)
    got = [(t.window.id, t.action) for t in m.due_transitions([a, b, c, d, e, f], NOW)]
    assert got == [(2, "end"), (3, "skip"), (1, "start")]


def run(aid: int, nodes: tuple[str, ...], end: float | None, **kw: Any) -> Running:
    return Running(aid, aid * 10, nodes, end, kw.pop("requeue", True), **kw)


def test_due_signals_lead_time_and_who_is_spared() -> None:
    w = win(1, ("n1", "n2"), start=NOW + 30)
    running = [
        run(1, ("n1",), None),  # UNLIMITED: crosses
        run(2, ("n2", "n3"), NOW + 3600),  # crosses on one of its nodes
        run(3, ("n1",), NOW + 20),  # ends before the window: left alone
        run(4, ("n3",), None),  # not on the window's nodes
        run(5, ("n1",), None, requeue=False),  # cannot be requeued: runs on, reported
    ]
    due, kept = m.due_signals([w], running, NOW, lead=30.0)
    assert [d.attempt_id for d in due] == [1, 2]
    assert all(d.window.id == 1 and d.at == NOW for d in due)
    assert [k.attempt_id for k in kept] == [5]
    # earlier than the lead: nothing yet
    assert m.due_signals([w], running, NOW - 1, lead=30.0) == ([], [])
    # unless it falls due before the caller's next tick: at least the lead, never less
    due, _ = m.due_signals([w], running, NOW - 1, lead=30.0, early=1.0)
    assert [d.attempt_id for d in due] == [1, 2]
    assert m.due_signals([w], running, NOW - 1.5, lead=30.0, early=1.0) == ([], [])
    # a job that asked for a longer grace is told earlier
    long = [run(6, ("n1",), None, grace=120.0)]
    due, _ = m.due_signals([w], long, NOW - 90, lead=30.0)
    assert [(d.attempt_id, d.at) for d in due] == [(6, NOW - 90)]
    # a window that started already (late: the controller was away) still stops it
    due, _ = m.due_signals([win(1, ("n1",), start=NOW - 5)], [run(7, ("n1",), None)], NOW, 30)
    assert [d.attempt_id for d in due] == [7]
    # removed and finished windows stop nobody
    gone = [win(1, ("n1",), start=NOW + 5, state=WindowState.REMOVED)]
    assert m.due_signals(gone, running, NOW, 30.0) == ([], [])


def test_due_signals_picks_the_earliest_crossing_window() -> None:
    late = win(1, ("n1",), start=NOW + 25)
    early = win(2, ("n2",), start=NOW + 10)
    due, _ = m.due_signals([late, early], [run(1, ("n1", "n2"), None)], NOW, 30.0)
    assert [d.window.id for d in due] == [2]


def test_stop_reason_round_trip_and_grace() -> None:
    w = win(12, ("n1", "n2", "n3"), start=datetime(2026, 12, 2, 15, 0).timestamp())
    reason = m.stop_reason(w, NOW)
    assert reason == "requeue: maintenance 12 (firmware) on n[1-3] at 15:00"
    assert reason.startswith("requeue")  # a planned requeue: no retry budget spent
    assert m.window_of_stop_reason(reason) == 12
    assert m.window_of_stop_reason("requeue: node n1 drained by ops: x") is None
    assert m.window_of_stop_reason(None) is None
    assert m.stop_grace(NOW + 25, NOW) == 25
    assert m.stop_grace(NOW - 5, NOW) == 0


def test_drain_reason_and_plan() -> None:
    w = win(4, ("n1", "n2", "n3"), start=NOW, end=datetime(2026, 12, 2, 16, 0).timestamp())
    assert m.drain_reason(w, NOW) == "maintenance 4: firmware until 16:00"
    assert m.drain_by(4) == "maint:4"
    nodes = [
        {"name": "n1", "drain": False, "drain_by": None},
        {"name": "n2", "drain": True, "drain_by": "ops"},
        {"name": "n3", "drain": True, "drain_by": "maint:4"},  # a retry of our own drain
    ]
    plan = m.plan_drain(w, nodes)
    assert plan.drain == ("n1", "n3") and plan.already == ("n2",)


def test_job_checkpoint_grace() -> None:
    assert m.job_checkpoint_grace(None) == 0
    assert m.job_checkpoint_grace({"signal_parsed": {"signum": 10, "before_s": 120}}) == 120
    assert m.job_checkpoint_grace({"checkpoint_grace_s": 300, "signal_parsed": None}) == 300
    assert m.job_checkpoint_grace({"checkpoint_parsed": {"grace_s": 90, "signum": 10}}) == 90
    assert m.job_checkpoint_grace({"checkpoint_grace": True}) == 0


def test_window_from_row() -> None:
    row = {
        "id": 3,
        "nodes": ["n1"],
        "start": NOW,
        "end": NOW + 1,
        "reason": None,
        "state": "active",
    }
    w = Window.from_row(row)
    assert w.state is WindowState.ACTIVE and w.nodes == ("n1",) and w.live_at(NOW)
    assert not w.live_at(NOW + 1)


def test_times_are_local(monkeypatch: pytest.MonkeyPatch) -> None:
    # "15:00" means the operator's wall clock, whatever the zone
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        now = datetime(2026, 12, 2, 9, 0).timestamp()
        at = m.parse_start("15:00", now)
        assert at - now == pytest.approx(timedelta(hours=6).total_seconds())
        assert m.format_when(at, now) == "15:00"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_resolve_times() -> None:
    assert m.resolve_times("now+60", "90s", None, NOW) == (NOW + 60, NOW + 150)
    assert m.resolve_times(NOW + 10, 20, None, NOW) == (NOW + 10, NOW + 30)
    assert m.resolve_times("now", None, "now+1h", NOW) == (NOW, NOW + 3600)
    with pytest.raises(ValueError, match="either a duration"):
        m.resolve_times("now", None, None, NOW)
    with pytest.raises(ValueError, match="either a duration"):
        m.resolve_times("now", "1h", "now+2h", NOW)
    with pytest.raises(ValueError, match="must be positive"):
        m.resolve_times("now", 0, None, NOW)
    with pytest.raises(ValueError, match="must be positive"):
        m.resolve_times("now", -5.0, None, NOW)
    with pytest.raises(ValueError, match="already passed"):
        m.resolve_times(NOW - 100, "10s", None, NOW)


def test_maint_lead_is_a_checked_timing_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.config import load_config
    from phalanx.errors import ConfigError

    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    assert load_config().timing.maint_lead == 30.0
    monkeypatch.setenv("PHALANX_TIMING_MAINT_LEAD", "5")
    assert load_config().timing.maint_lead == 5.0
    monkeypatch.setenv("PHALANX_TIMING_MAINT_LEAD", "-1")
    with pytest.raises(ConfigError, match="maint_lead"):
        load_config()
