"""Maintenance windows as pure decisions: parsing, validation, and what is due at ``now``.

A window reserves some nodes from ``start`` to ``end``. Before it, the scheduler keeps off those
nodes every job whose time limit would cross it (an UNLIMITED job crosses every upcoming
window); jobs already running there get their checkpoint signal a lead time before the start
and are requeued at the start; during it the nodes are drained (``drain_by = "maint:<id>"``);
after it they return. The controller's ``cluster`` duty reads the windows and the running
attempts, asks this module what is due, and applies that in fenced writes; the scheduler asks
which nodes a pending job may not use. Nothing here reads a clock or does I/O, so every rule is
a unit test on plain data.

Times are float seconds since the epoch; user-facing times (``HH:MM``, ``2026-12-02T15:00``) are
in the local time zone of the process that parses or formats them (the CLI parses, so the
operator's own zone counts).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, TypeVar

from phalanx.domain import values
from phalanx.domain.hostlist import compress_hostlist
from phalanx.domain.placement import place
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView, Placement

__all__ = [
    "DrainPlan",
    "KeepOff",
    "Running",
    "SignalDue",
    "Transition",
    "Window",
    "WindowState",
    "allocations_after",
    "blocking_windows",
    "check_window",
    "crosses",
    "drain_by",
    "drain_reason",
    "due_signals",
    "due_transitions",
    "format_when",
    "job_checkpoint_grace",
    "parse_start",
    "parse_window_duration",
    "pending_reason",
    "plan_drain",
    "resolve_times",
    "stop_grace",
    "stop_reason",
    "window_of_stop_reason",
]


class WindowState(StrEnum):
    SCHEDULED = "scheduled"  # in the future: keeps crossing jobs off its nodes
    ACTIVE = "active"  # started: its nodes are drained by it
    DONE = "done"  # ended: its nodes were returned
    REMOVED = "removed"  # removed by an operator (an active one returned its nodes)


LIVE = frozenset({WindowState.SCHEDULED, WindowState.ACTIVE})


@dataclass(frozen=True, slots=True)
class Window:
    id: int
    nodes: tuple[str, ...]
    start: float
    end: float
    reason: str | None = None
    state: WindowState = WindowState.SCHEDULED

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Window:
        """A window from a `maintenance` table row (or its API view)."""
        return cls(
            id=int(row["id"]),
            nodes=tuple(row["nodes"] or ()),
            start=float(row["start"]),
            end=float(row["end"]),
            reason=row.get("reason"),
            state=WindowState(row["state"]),
        )

    def live_at(self, now: float) -> bool:
        """Still to come or under way (not ended, not removed)."""
        return self.state in LIVE and now < self.end

    @property
    def hostlist(self) -> str:
        return compress_hostlist(self.nodes) if self.nodes else "(no nodes)"


# --------------------------------------------------------------------------------------------
# Parsing what operators type
# --------------------------------------------------------------------------------------------

_UNITS = {
    "s": 1,
    "sec": 1,
    "secs": 1,
    "second": 1,
    "seconds": 1,
    "m": 60,
    "min": 60,
    "mins": 60,
    "minute": 60,
    "minutes": 60,
    "h": 3600,
    "hr": 3600,
    "hrs": 3600,
    "hour": 3600,
    "hours": 3600,
    "d": 86400,
    "day": 86400,
    "days": 86400,
    "w": 604800,
    "week": 604800,
    "weeks": 604800,
}
_AMOUNT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)?", re.IGNORECASE)
_NOW_RE = re.compile(r"now\s*(?:\+\s*(.+))?", re.IGNORECASE)
_CLOCK_RE = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?")
_EPOCH_RE = re.compile(r"\d{9,}(?:\.\d+)?")
START_FORMS = (
    "use now, now+10min, now+90 (seconds), HH:MM[:SS] (today, or tomorrow once passed), "
    "2026-12-02T15:00[:00][+01:00], 2026-12-02, today, tomorrow, or seconds since the epoch"
)
DURATION_FORMS = (
    "use e.g. 90s, 10min, 4h, 2d, or a Slurm time: 30 (minutes), 45:00 (MM:SS), 2:00:00, 1-12:00:00"
)
MAX_WINDOW_S = 366 * 86400  # a longer "window" is a typo or a decommission (drain the nodes)
MAX_EPOCH = 253402300799.0  # 9999-12-31 23:59:59 UTC: later is no time a clock can show


def _amount(text: str, *, default_unit: str, what: str, forms: str) -> float:
    m = _AMOUNT_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"invalid {what} {text!r}: {forms}")
    unit = (m[2] or default_unit).lower()
    if unit not in _UNITS:
        raise ValueError(f"invalid {what} {text!r}: unknown unit {m[2]!r}; {forms}")
    return float(m[1]) * _UNITS[unit]


def parse_start(text: str, now: float) -> float:
    """When a window starts, from the forms Slurm's ``--begin`` and ``scontrol create
    reservation StartTime=`` take (``now``, ``now+10min``, ``HH:MM``, ISO dates, epoch seconds).

    ``now+N`` without a unit is seconds, as in Slurm. A time of day that has passed today means
    tomorrow. Naive dates and times are local time.
    """
    raw = text
    text = text.strip()
    if not text:
        raise ValueError(f"missing start time: {START_FORMS}")
    if m := _NOW_RE.fullmatch(text):
        if m[1] is None:
            return now
        return now + _amount(m[1], default_unit="s", what="start time", forms=START_FORMS)
    if _EPOCH_RE.fullmatch(text):
        return float(text)
    local = datetime.fromtimestamp(now)
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0)
    word = text.lower()
    if word == "today":
        return midnight.timestamp()
    if word in ("tomorrow", "midnight"):
        return (midnight + timedelta(days=1)).timestamp()
    if word == "noon":
        noon = midnight.replace(hour=12)
        return (noon if noon.timestamp() > now else noon + timedelta(days=1)).timestamp()
    if m := _CLOCK_RE.fullmatch(text):
        hour, minute, second = int(m[1]), int(m[2]), int(m[3] or 0)
        if hour > 23 or minute > 59 or second > 59:
            raise ValueError(f"invalid start time {raw!r}: no such time of day; {START_FORMS}")
        at = midnight.replace(hour=hour, minute=minute, second=second)
        if at.timestamp() <= now:
            at += timedelta(days=1)
        return at.timestamp()
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"invalid start time {raw!r}: {START_FORMS}") from None
    return parsed.timestamp()  # naive: local time


def parse_window_duration(text: str) -> int:
    """A window's length in whole seconds: ``90s``/``10min``/``4h``/``2d``, or any Slurm time
    form (a lone number is minutes, as in ``--time``). Zero, negative and UNLIMITED are refused:
    a window without an end would keep its nodes drained forever (drain them instead)."""
    raw = text
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE"):
        raise ValueError(
            f"invalid duration {raw!r}: a maintenance window needs an end; "
            "to take nodes out for good, drain them (`phalanx drain NODE --reason ...`)"
        )
    if text.startswith("-"):
        raise ValueError(f"invalid duration {raw!r}: it must be positive; {DURATION_FORMS}")
    m = _AMOUNT_RE.fullmatch(text)
    if m is not None and m[2] is not None:
        seconds = _amount(text, default_unit="s", what="duration", forms=DURATION_FORMS)
    else:
        try:
            parsed = values.parse_duration(text)
        except ValueError:
            raise ValueError(
                f"invalid duration {raw!r}: it must be positive; {DURATION_FORMS}"
            ) from None
        assert parsed is not None  # UNLIMITED handled above
        seconds = float(parsed)
    whole = round(seconds)
    if whole <= 0:
        raise ValueError(f"invalid duration {raw!r}: it must be positive; {DURATION_FORMS}")
    if whole > MAX_WINDOW_S:
        raise ValueError(
            f"invalid duration {raw!r}: longer than {MAX_WINDOW_S // 86400} days; "
            "to take nodes out for good, drain them instead"
        )
    return whole


def check_window(start: float, end: float, now: float) -> None:
    """Refuse a window that is over before it could matter, or that has no length; the
    message says what to change."""
    for label, t in (("start", start), ("end", end)):
        if not math.isfinite(t) or not 0 <= t <= MAX_EPOCH:
            raise ValueError(
                f"invalid {label} time {t!r}: give a real time (epoch seconds from 0 to "
                f"{MAX_EPOCH:.0f}, or text like now+10min)"
            )
    if end <= start:
        raise ValueError(
            f"the window must end after it starts (start {format_when(start, now)}, end "
            f"{format_when(end, now)}): give a positive --duration"
        )
    if end - start > MAX_WINDOW_S:
        raise ValueError(
            f"the window is longer than {MAX_WINDOW_S // 86400} days; "
            "to take nodes out for good, drain them instead"
        )
    if end <= now:
        raise ValueError(
            f"the window would end at {format_when(end, now)}, which has already passed: "
            "give a later --start (e.g. now+10min) or a longer --duration"
        )


def format_when(t: float, now: float | None = None) -> str:
    """A time for reasons and listings: ``15:00`` (``15:00:05`` off the minute), with the date
    in front when it is not the same local day as ``now``."""
    lt = time.localtime(t)
    clock = time.strftime("%H:%M" if lt.tm_sec == 0 else "%H:%M:%S", lt)
    if now is not None and time.strftime("%Y-%m-%d", time.localtime(now)) == time.strftime(
        "%Y-%m-%d", lt
    ):
        return clock
    return time.strftime("%Y-%m-%d ", lt) + clock


# --------------------------------------------------------------------------------------------
# Placement: which nodes a pending job may not use
# --------------------------------------------------------------------------------------------


def crosses(w: Window, now: float, time_limit_s: int | None) -> bool:
    """Whether a job started now with this time limit would still run when ``w`` starts
    (an UNLIMITED job crosses every window that has not ended)."""
    if not w.live_at(now):
        return False
    return time_limit_s is None or now + time_limit_s > w.start


def blocking_windows(
    windows: Iterable[Window], now: float, time_limit_s: int | None
) -> dict[str, Window]:
    """Node -> the earliest window that keeps a job with this time limit off it, now."""
    out: dict[str, Window] = {}
    for w in sorted(windows, key=lambda w: (w.start, w.id)):
        if not crosses(w, now, time_limit_s):
            continue
        for n in w.nodes:
            out.setdefault(n, w)
    return out


def pending_reason(blocked: Mapping[str, Window], now: float, time_limit_s: int | None) -> str:
    """Why a job waits when maintenance is what keeps it off the nodes it could use."""
    first = min(blocked.values(), key=lambda w: (w.start, w.id))
    nodes = compress_hostlist(n for n, w in blocked.items() if w.id == first.id)
    more = len({w.id for w in blocked.values()}) - 1
    others = f" (and {more} more window{'s' if more > 1 else ''})" if more > 0 else ""
    when = "now" if first.start <= now else f"at {format_when(first.start, now)}"
    limit = "an UNLIMITED job" if time_limit_s is None else "its time limit"
    return (
        f"Maintenance: nodes {nodes} have maintenance {when} (window {first.id}){others}, "
        f"which {limit} would cross"
    )


# --------------------------------------------------------------------------------------------
# The cluster duty: windows that start or end, running jobs to checkpoint and requeue
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Transition:
    window: Window
    action: str  # "start" | "end" | "skip" (over before any controller could start it)


def due_transitions(windows: Iterable[Window], now: float) -> list[Transition]:
    """Windows whose state must change at ``now``, in time order."""
    out: list[Transition] = []
    for w in sorted(windows, key=lambda w: (w.start, w.id)):
        if w.state is WindowState.SCHEDULED and now >= w.end:
            out.append(Transition(w, "skip"))
        elif w.state is WindowState.SCHEDULED and now >= w.start:
            out.append(Transition(w, "start"))
        elif w.state is WindowState.ACTIVE and now >= w.end:
            out.append(Transition(w, "end"))
    return out


@dataclass(frozen=True, slots=True)
class Running:
    """A live attempt as the maintenance duty sees it."""

    attempt_id: int
    job_id: int
    nodes: tuple[str, ...]
    end: float | None  # when its time limit ends it; None = UNLIMITED
    requeue: bool
    grace: float = 0.0  # the job's own checkpoint grace (it asked for this much warning)


@dataclass(frozen=True, slots=True)
class SignalDue:
    attempt_id: int
    job_id: int
    window: Window
    at: float  # when the signal was due (start minus the lead)


def due_signals(
    windows: Iterable[Window],
    running: Iterable[Running],
    now: float,
    lead: float,
    *,
    early: float = 0.0,
) -> tuple[list[SignalDue], list[Running]]:
    """Attempts to checkpoint and requeue now because a window on one of their nodes starts
    within ``max(lead, the job's own grace)`` and they would still be running then; and the
    attempts that would cross a window but cannot be requeued (they run on; the window's
    nodes stay DRAINING until they end).

    ``early``: the caller's tick interval. A signal due before the next tick goes out now, so
    a job gets at least its lead time (at most ``early`` more), never up to a tick less."""
    live = sorted((w for w in windows if w.live_at(now)), key=lambda w: (w.start, w.id))
    by_node: dict[str, list[Window]] = {}
    for w in live:
        for n in w.nodes:
            by_node.setdefault(n, []).append(w)
    due: list[SignalDue] = []
    kept: list[Running] = []
    for r in running:
        hit: Window | None = None
        for n in r.nodes:
            for w in by_node.get(n, ()):
                if r.end is not None and r.end <= w.start:
                    continue  # it ends before the window anyway
                if hit is None or (w.start, w.id) < (hit.start, hit.id):
                    hit = w
                break
        if hit is None:
            continue
        at = hit.start - max(lead, r.grace)
        if now + early < at:
            continue
        if r.requeue:
            due.append(SignalDue(r.attempt_id, r.job_id, hit, at))
        else:
            kept.append(r)
    return due, kept


def stop_reason(w: Window, now: float) -> str:
    """The attempt's stop reason: "requeue..." makes the agent deliver the checkpoint signal
    and the store requeue the job without counting it as a failure."""
    why = f" ({w.reason})" if w.reason else ""
    return f"requeue: maintenance {w.id}{why} on {w.hostlist} at {format_when(w.start, now)}"


_STOP_RE = re.compile(r"requeue: maintenance (\d+)\b")


def window_of_stop_reason(reason: str | None) -> int | None:
    """The window a stop reason made by `stop_reason` names, else None."""
    m = _STOP_RE.match(reason or "")
    return int(m[1]) if m else None


def stop_grace(window_start: float, now: float) -> float:
    """Checkpoint grace for a maintenance stop: the time left until the window starts, so
    the job is stopped (and requeued) at the start, not a fixed grace after the signal."""
    return max(0.0, window_start - now)


def drain_reason(w: Window, now: float) -> str:
    """How the window's nodes show while it lasts (`phalanx nodes`)."""
    why = f": {w.reason}" if w.reason else ""
    return f"maintenance {w.id}{why} until {format_when(w.end, now)}"


def drain_by(window_id: int) -> str:
    return f"maint:{window_id}"


@dataclass(frozen=True, slots=True)
class DrainPlan:
    drain: tuple[str, ...]  # nodes the window drains (its own drain)
    already: tuple[str, ...]  # nodes drained by someone else: left as they are


def plan_drain(w: Window, nodes: Sequence[Mapping[str, Any]]) -> DrainPlan:
    """At the start: drain every node of the window that is not drained already; a node an
    operator or a health check drained keeps that drain (and it outlives the window)."""
    rows = {str(n["name"]): n for n in nodes}
    drain, already = [], []
    for name in w.nodes:
        row = rows.get(name)
        if row is None:
            continue
        if row["drain"] and row["drain_by"] != drain_by(w.id):
            already.append(name)
        else:
            drain.append(name)
    return DrainPlan(tuple(drain), tuple(already))


def job_checkpoint_grace(spec: Mapping[str, Any] | None) -> float:
    """The warning a job asked for before a planned stop: its checkpoint grace, or the lead of
    ``--signal=SIG@N`` (the grace the agent gives it on a planned stop); 0 when it asked none."""
    spec = spec or {}
    best = 0.0
    for key in ("checkpoint_grace_s", "checkpoint_grace"):
        v = spec.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            best = max(best, float(v))
    for key, inner in (("signal_parsed", "before_s"), ("checkpoint_parsed", "grace_s")):
        sub = spec.get(key)
        if isinstance(sub, Mapping):
            v = sub.get(inner)
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                best = max(best, float(v))
    return best


# --------------------------------------------------------------------------------------------
# The scheduling pass's view: exclusions per job, and the reason for jobs they hold back
# --------------------------------------------------------------------------------------------

_REASON_CHECKS = 200  # per pass: explaining a wait costs one single-job placement each
T = TypeVar("T")


class KeepOff:
    """Maintenance as one scheduling pass sees it (``scheduling.plan`` builds one per pass).

    `restrict` adds to a job's ``exclude`` the nodes whose windows its time limit would cross,
    so placement (and its backfill reservation) simply never considers them; `reasons` then
    names the maintenance as the reason a job waits, when placing it without those exclusions
    would have started it.
    """

    def __init__(self, rows: Iterable[Mapping[str, Any]], now: float) -> None:
        self.now = now
        self.windows = [w for w in (Window.from_row(r) for r in rows) if w.live_at(now)]
        self._by_limit: dict[int | None, dict[str, Window]] = {}
        self.blocked: dict[int, tuple[JobRequest, dict[str, Window]]] = {}

    def restrict(self, req: JobRequest) -> JobRequest:
        if not self.windows:
            return req
        limit = req.time_limit_s
        if limit not in self._by_limit:
            self._by_limit[limit] = blocking_windows(self.windows, self.now, limit)
        blocked = self._by_limit[limit]
        if not blocked:
            return req
        self.blocked[req.job_id] = (req, blocked)
        return replace(req, exclude=tuple(sorted(set(req.exclude) | blocked.keys())))

    def reasons(
        self,
        current: Mapping[int, str],
        placed: Sequence[Placement],
        nodes: Sequence[NodeView],
        allocations: Sequence[Allocation],
        exclusive: Mapping[int, bool] | None = None,
    ) -> dict[int, str]:
        """Reasons to use instead of Resources/Priority for jobs maintenance holds back."""
        return held_back_reasons(
            self.blocked,
            current,
            placed,
            nodes,
            allocations,
            exclusive,
            self.now,
            lambda req, usable: pending_reason(usable, self.now, req.time_limit_s),
        )


def held_back_reasons(
    blocked: Mapping[int, tuple[JobRequest, Mapping[str, T]]],
    current: Mapping[int, str],
    placed: Sequence[Placement],
    nodes: Sequence[NodeView],
    allocations: Sequence[Allocation],
    exclusive: Mapping[int, bool] | None,
    now: float,
    describe: Callable[[JobRequest, Mapping[str, T]], str],
) -> dict[int, str]:
    """The reasons of jobs kept off some nodes (a maintenance window's, a reservation's, each
    node mapped to what holds it in `blocked`) that would have started on them this pass:
    `describe` names what holds them back, instead of Resources/Priority. A job placed, or
    waiting for something else, keeps its reason; at most _REASON_CHECKS trial placements."""
    if not blocked:
        return {}
    after = allocations_after(placed, allocations, exclusive)
    out: dict[int, str] = {}
    checks = 0
    for jid, (req, held) in blocked.items():
        if current.get(jid) not in ("Resources", "Priority"):
            continue  # placed, or waiting for something else
        if checks >= _REASON_CHECKS:
            break
        checks += 1
        if place([req], nodes, after, now, backfill=False):
            usable = {n: w for n, w in held.items() if n not in req.exclude}
            out[jid] = describe(req, usable or held)
    return out


def allocations_after(
    placed: Sequence[Placement],
    allocations: Sequence[Allocation],
    exclusive: Mapping[int, bool] | None = None,
) -> list[Allocation]:
    """What running work holds once this pass's starts are made: the allocations a check
    that places one more job, now, must fit beside (their ends do not matter to it)."""
    after = list(allocations)
    for p in placed:
        for node, mem, gpus in zip(p.nodes, p.mem_per_node_mb, p.gpu_ids, strict=True):
            after.append(
                Allocation(
                    job_id=p.job_id,
                    node=node,
                    cpus=p.cpus_per_node,
                    mem_mb=mem,
                    gpu_ids=tuple(gpus),
                    exclusive=bool((exclusive or {}).get(p.job_id, False)),
                    expected_end=None,
                )
            )
    return after


def resolve_times(
    start: float | str,
    duration: float | str | None,
    end: float | str | None,
    now: float,
) -> tuple[float, float]:
    """(start, end) from what a request gave: a start (epoch seconds or text) and either a
    duration (seconds or text) or an end (epoch seconds or text); checked by `check_window`."""
    start_t = float(start) if isinstance(start, int | float) else parse_start(start, now)
    if (duration is None) == (end is None):
        raise ValueError("give the window either a duration (--duration 2h) or an end (--end)")
    if duration is not None:
        if isinstance(duration, int | float):
            if not math.isfinite(duration) or duration <= 0:
                raise ValueError(
                    f"invalid duration {duration!r}: it must be positive; {DURATION_FORMS}"
                )
            length = float(duration)
        else:
            length = float(parse_window_duration(duration))
        end_t = start_t + length
    else:
        assert end is not None
        end_t = float(end) if isinstance(end, int | float) else parse_start(end, now)
    check_window(start_t, end_t, now)
    return start_t, end_t
