"""Reservations (Slurm's `scontrol create reservation`) as pure decisions.

A reservation sets some nodes aside from ``start`` to ``end`` for some users or accounts. Only
a job that asks for it (``--reservation=NAME``), submitted by one of its users or charged to one
of its accounts, may run on its nodes while it lasts, and such a job runs only there and only
once it has started. Every other job is kept off its nodes while it is active, and also before
it when the job's time limit would run into it (an UNLIMITED job runs into every reservation
still to come), as Slurm does. A reservation that has ended is gone.

``MAINT`` (Slurm's maintenance flag) changes what a waiting job is told
(``ReqNodeNotAvail, Reserved for maintenance``) and lets the reservation overlap others. It
neither drains the nodes nor stops the jobs on them: `phalanx maint add` (domain/maintenance.py)
is the maintenance window that checkpoints, requeues and drains.

A job running in a reservation when it ends is stopped ``reservation_overrun`` seconds after
the end (Slurm's ResvOverRun, 0 by default; UNLIMITED lets it run on to its own time limit):
it gets its checkpoint signal its grace before that (`due_end_stops`) and ends TIMEOUT, as in
Slurm (``Reservation r1, which this job was running under, has ended``). Slurm lets such a job
start whatever its time limit, and so does `Gate`.

The store keeps the rows, the controller's scheduling pass asks `Gate` which nodes each job may
use, and the submit path asks `submit_refusal`; the `cluster` duty asks `due_phases` which
reservations start or end (one `resv.start` and one `resv.end` event each) and
`due_end_stops` which jobs to stop. Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from phalanx.domain.hostlist import compress_hostlist
from phalanx.domain.maintenance import format_when, held_back_reasons
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView, Placement
from phalanx.domain.policy import TIMEOUT_STOP

__all__ = [
    "FLAGS",
    "REFUSED_FLAGS",
    "EndStop",
    "Gate",
    "InReservation",
    "Phase",
    "PhaseChange",
    "Reservation",
    "busy_nodes",
    "check_name",
    "check_times",
    "due_end_stops",
    "due_phases",
    "end_stop_reason",
    "format_flags",
    "overlapping",
    "parse_flags",
    "parse_names",
    "pick_nodes",
    "reservation_of_stop",
    "submit_refusal",
]

# Slurm's words (sbatch's errors, squeue's reasons), kept as Slurm writes them
INVALID = "Requested reservation is invalid"
DENIED = "Access denied to requested reservation"
IN_USE = "Requested reservation is in use"
WAITING = "Reservation"  # a job waiting for its reservation to start
MAINT_REASON = "ReqNodeNotAvail, Reserved for maintenance"
OTHER_REASON = "ReqNodeNotAvail, May be reserved for other job"

# flags Phalanx honours; SPEC_NODES is what Slurm shows on a reservation made with Nodes=
FLAGS = {
    "MAINT": "maintenance: waiting jobs are told so; may overlap other reservations",
    "OVERLAP": "may overlap other reservations",
    "IGNORE_JOBS": "may be made on nodes whose running jobs would run into it",
    "SPEC_NODES": "made with Nodes= (set by itself)",
}
_RECURRING = "recurring reservations are not supported: create one for each window"
_CORES = "reservations here hold whole nodes"
REFUSED_FLAGS = {
    "ANY_NODES": "a reservation here holds nodes, not licences or burst buffers",
    "DAILY": _RECURRING,
    "HOURLY": _RECURRING,
    "WEEKDAY": _RECURRING,
    "WEEKEND": _RECURRING,
    "WEEKLY": _RECURRING,
    "FIRST_CORES": _CORES,
    "STATIC_ALLOC": "nodes are fixed when the reservation is made already",
    "FLEX": "a job in a reservation runs on its nodes only",
    "MAGNETIC": "a job uses a reservation only when it asks for it (--reservation)",
    "LICENSE_ONLY": "a reservation here holds nodes, not licences",
    "NO_HOLD_JOBS_AFTER_END": "jobs are never held when a reservation ends",
    "PART_NODES": "give Nodes= or NodeCnt= (with PartitionName= to choose among its nodes)",
    "PURGE_COMP": "a reservation lasts until its end or its deletion",
    "REPLACE": "the nodes of a reservation are fixed when it is made",
    "REPLACE_DOWN": "the nodes of a reservation are fixed when it is made",
    "TIME_FLOAT": "give StartTime=now+N: the start is fixed when the reservation is made",
    "USER_DELETE": "reservations are deleted by operators",
}

NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}")
_NAME_LIST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@$-]{0,63}")


@dataclass(frozen=True, slots=True)
class Reservation:
    name: str
    nodes: tuple[str, ...]
    start: float
    end: float
    users: tuple[str, ...] = ()
    accounts: tuple[str, ...] = ()
    flags: frozenset[str] = frozenset()
    partition: str | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Reservation:
        """A reservation from a `reservations` table row (or its API view)."""
        return cls(
            name=str(row["name"]),
            nodes=tuple(row.get("node_names", row.get("nodes")) or ()),
            start=float(row["start"]),
            end=float(row["end"]),
            users=tuple(row.get("users") or ()),
            accounts=tuple(row.get("accounts") or ()),
            flags=frozenset(row.get("flags") or ()),
            partition=row.get("partition") or None,
        )

    @property
    def maint(self) -> bool:
        return "MAINT" in self.flags

    @property
    def hostlist(self) -> str:
        return compress_hostlist(self.nodes) if self.nodes else "(null)"

    def live_at(self, now: float) -> bool:
        return now < self.end

    def active_at(self, now: float) -> bool:
        return self.start <= now < self.end

    def state(self, now: float) -> str:
        """Slurm's State= of `scontrol show reservation`."""
        return "ACTIVE" if self.active_at(now) else "INACTIVE"

    def allows(self, user: str, account: str | None) -> bool:
        """Whether a job of `user` charged to `account` may use it (Users= or Accounts=)."""
        return user in self.users or (account is not None and account in self.accounts)

    def crossed_by(self, now: float, time_limit_s: int | None) -> bool:
        """Whether a job started now with this limit would run while it is active."""
        if not self.live_at(now):
            return False
        return time_limit_s is None or now + time_limit_s > self.start


# --------------------------------------------------------------------------------------------
# What operators type
# --------------------------------------------------------------------------------------------


def check_name(name: str) -> str:
    name = name.strip()
    if not NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid reservation name {name!r}: use letters, digits and _ . - @ + "
            "(at most 128 characters), e.g. ReservationName=maint_rack3"
        )
    return name


def parse_flags(text: str) -> frozenset[str]:
    """`Flags=MAINT,IGNORE_JOBS` (any case) to the flag set; a flag Slurm has but Phalanx
    cannot honour is refused with why, an unknown one as Slurm refuses it."""
    out: set[str] = set()
    for word in text.split(","):
        flag = word.strip().upper()
        if not flag:
            continue
        if flag in REFUSED_FLAGS:
            raise ValueError(f"Flags={flag} is not supported here: {REFUSED_FLAGS[flag]}")
        if flag not in FLAGS:
            raise ValueError(
                f"Error parsing flags {word.strip()}: supported flags are "
                f"{', '.join(sorted(FLAGS))}"
            )
        out.add(flag)
    return frozenset(out)


def format_flags(flags: Iterable[str]) -> str:
    order = list(FLAGS)
    return ",".join(sorted(set(flags), key=lambda f: (order.index(f) if f in order else 99, f)))


def parse_names(text: str, what: str) -> tuple[str, ...]:
    """`Users=alice,bob` / `Accounts=physics` to a sorted tuple; Slurm's `-name` (everyone
    but) is refused with what to do instead."""
    out: list[str] = []
    for word in text.split(","):
        name = word.strip()
        if not name:
            continue
        if name.startswith("-"):
            raise ValueError(
                f"{what}={text}: excluding {what.lower()} with '-' is not supported here; "
                f"list the {what.lower()} that may use the reservation"
            )
        if not _NAME_LIST_RE.fullmatch(name):
            raise ValueError(f"{what}={text}: invalid name {name!r}")
        if name not in out:
            out.append(name)
    return tuple(sorted(out))


def check_times(start: float, end: float, now: float) -> None:
    """Refuse a reservation that has no length or is over already (what to change)."""
    if end <= start:
        raise ValueError(
            "the reservation must end after it starts: give a positive Duration= "
            "(minutes, or HH:MM:SS) or a later EndTime="
        )
    if end <= now:
        raise ValueError(
            f"the reservation would end at {format_when(end, now)}, which has passed: give a "
            "later StartTime= or a longer Duration="
        )


# --------------------------------------------------------------------------------------------
# Making one: which nodes, and what it may not collide with
# --------------------------------------------------------------------------------------------


def overlapping(new: Reservation, others: Iterable[Reservation], now: float) -> list[Reservation]:
    """Live reservations sharing a node and some time with `new` (MAINT and OVERLAP on
    either side allow it, as in Slurm)."""
    if new.flags & {"MAINT", "OVERLAP"}:
        return []
    nodes = set(new.nodes)
    return [
        r
        for r in others
        if r.name != new.name
        and r.live_at(now)
        and not (r.flags & {"MAINT", "OVERLAP"})
        and r.start < new.end
        and new.start < r.end
        and nodes.intersection(r.nodes)
    ]


def busy_nodes(new: Reservation, running: Iterable[Mapping[str, Any]]) -> list[str]:
    """Nodes of `new` with a running job that would still run at its start (``end`` None:
    no time limit); IGNORE_JOBS accepts them, as Slurm does."""
    if "IGNORE_JOBS" in new.flags:
        return []
    nodes = set(new.nodes)
    out: set[str] = set()
    for job in running:
        if job.get("end") is not None and float(job["end"]) <= new.start:
            continue
        out.update(n for n in job["nodes"] if n in nodes)
    return sorted(out)


def pick_nodes(
    candidates: Sequence[str],
    count: int,
    *,
    taken: Iterable[str] = (),
    busy: Iterable[str] = (),
) -> list[str]:
    """`NodeCnt=N`: the first N usable candidates (in the order given) that no overlapping
    reservation holds, preferring nodes without a job that would run into it. ValueError
    says how many there were."""
    held = set(taken)
    free = [n for n in candidates if n not in held]
    busy_set = set(busy)
    ordered = [n for n in free if n not in busy_set] + [n for n in free if n in busy_set]
    if len(ordered) < count:
        raise ValueError(
            f"NodeCnt={count}: only {len(ordered)} usable node{'s' if len(ordered) != 1 else ''}"
            " (up, not drained, not in an overlapping reservation) for that time; ask for "
            "fewer or give Nodes="
        )
    return ordered[:count]


# --------------------------------------------------------------------------------------------
# Submission
# --------------------------------------------------------------------------------------------


def submit_refusal(
    resv: Reservation | None, user: str, account: str | None, now: float
) -> str | None:
    """Why a job of `user` (charged to `account`) may not ask for this reservation, in
    Slurm's words plus what to do; None when it may."""
    if resv is None or not resv.live_at(now):
        return f"{INVALID} (`scontrol show reservation` lists them)"
    if not resv.allows(user, account):
        who = ", ".join(
            x
            for x in (
                f"users {','.join(resv.users)}" if resv.users else "",
                f"accounts {','.join(resv.accounts)}" if resv.accounts else "",
            )
            if x
        )
        return (
            f"{DENIED} ({resv.name} is for {who}; {user} with account {account or '(none)'} "
            "is not one of them)"
        )
    return None


# --------------------------------------------------------------------------------------------
# The scheduling pass
# --------------------------------------------------------------------------------------------


class Gate:
    """Reservations as one scheduling pass sees them (``scheduling.plan`` builds one).

    `admit` gives each job the nodes it may use: a job with ``--reservation`` only its
    reservation's nodes once it has started (else it waits, with Slurm's reason), every job
    none of the nodes of another reservation its time limit would run into. `reasons` then
    names the reservation as the reason a job waits, when placing it without that exclusion
    would have started it.
    """

    def __init__(
        self, rows: Iterable[Mapping[str, Any]], now: float, node_names: Sequence[str]
    ) -> None:
        self.now = now
        self.live = {r.name: r for r in (Reservation.from_row(x) for x in rows) if r.live_at(now)}
        self._names = node_names
        self._by_key: dict[tuple[int | None, str | None], dict[str, Reservation]] = {}
        self.blocked: dict[int, tuple[JobRequest, dict[str, Reservation]]] = {}

    def _blocking(self, limit: int | None, own: str | None) -> dict[str, Reservation]:
        key = (limit, own)
        if key not in self._by_key:
            out: dict[str, Reservation] = {}
            for r in sorted(self.live.values(), key=lambda r: (r.start, r.name)):
                if r.name == own or not r.crossed_by(self.now, limit):
                    continue
                for n in r.nodes:
                    out.setdefault(n, r)
            self._by_key[key] = out
        return self._by_key[key]

    def admit(self, req: JobRequest, wanted: str | None) -> tuple[JobRequest, str | None]:
        """The request restricted to the nodes it may use, or a reason it waits now."""
        if wanted:
            resv = self.live.get(wanted)
            if resv is None:
                return req, (
                    f"{WAITING} (reservation {wanted} has ended or was deleted: cancel the job "
                    "and submit it again without --reservation, or with another)"
                )
            if self.now < resv.start:
                return req, f"{WAITING} (reservation {wanted} starts at " + (
                    f"{format_when(resv.start, self.now)})"
                )
            inside = set(resv.nodes)
            outside = {n for n in self._names if n not in inside}
            if outside:
                req = replace(req, exclude=tuple(sorted(set(req.exclude) | outside)))
        if not self.live:
            return req, None
        blocked = self._blocking(req.time_limit_s, wanted or None)
        if not blocked:
            return req, None
        self.blocked[req.job_id] = (req, blocked)
        return replace(req, exclude=tuple(sorted(set(req.exclude) | blocked.keys()))), None

    def reasons(
        self,
        current: Mapping[int, str],
        placed: Sequence[Placement],
        nodes: Sequence[NodeView],
        allocations: Sequence[Allocation],
        exclusive: Mapping[int, bool] | None = None,
    ) -> dict[int, str]:
        """Reasons to use instead of Resources/Priority for jobs a reservation holds back."""
        return held_back_reasons(
            self.blocked,
            current,
            placed,
            nodes,
            allocations,
            exclusive,
            self.now,
            lambda _req, usable: self.reason(usable),
        )

    def reason(self, blocked: Mapping[str, Reservation]) -> str:
        first = min(blocked.values(), key=lambda r: (not r.maint, r.start, r.name))
        nodes = compress_hostlist(n for n, r in blocked.items() if r.name == first.name)
        when = (
            "now"
            if first.start <= self.now
            else f"from {format_when(first.start, self.now)}, which its time limit would reach"
        )
        head = MAINT_REASON if first.maint else OTHER_REASON
        return f"{head} (reservation {first.name} holds {nodes} {when})"


# --------------------------------------------------------------------------------------------
# The cluster duty: reservations that start or end, jobs to stop at the end
# --------------------------------------------------------------------------------------------


class Phase(StrEnum):
    """How far the cluster duty has taken a reservation (`reservations.phase`)."""

    SCHEDULED = "scheduled"  # its start not yet recorded
    ACTIVE = "active"  # `resv.start` written
    ENDED = "ended"  # `resv.end` written; jobs of it may still run (overrun)
    CLOSED = "closed"  # ended, and no job of it left running: nothing more to do


@dataclass(frozen=True, slots=True)
class PhaseChange:
    reservation: Reservation
    old: Phase
    new: Phase
    skipped: bool = False  # it ended before any controller recorded its start


def due_phases(
    rows: Iterable[tuple[Reservation, Phase]], now: float, running: Iterable[str] = ()
) -> list[PhaseChange]:
    """The moves due at ``now``, in time order: a reservation whose start has come becomes
    active, one whose end has come ended (from scheduled too, `skipped`), and an ended one
    with no job of it running (`running`: names of reservations with a live attempt)
    closed."""
    busy = set(running)
    out: list[PhaseChange] = []
    for r, phase in sorted(rows, key=lambda x: (x[0].start, x[0].name)):
        if phase in (Phase.SCHEDULED, Phase.ACTIVE) and now >= r.end:
            out.append(PhaseChange(r, phase, Phase.ENDED, skipped=phase is Phase.SCHEDULED))
        elif phase is Phase.SCHEDULED and now >= r.start:
            out.append(PhaseChange(r, phase, Phase.ACTIVE))
        elif phase is Phase.ENDED and r.name not in busy:
            out.append(PhaseChange(r, phase, Phase.CLOSED))
    return out


@dataclass(frozen=True, slots=True)
class InReservation:
    """A live (starting, running or being stopped) attempt of a job that asked for a
    reservation."""

    attempt_id: int
    job_id: int
    reservation: str
    nodes: tuple[str, ...] = ()
    grace: float = 0.0  # the warning its planned stops give it (its own, else the cluster's)
    stopping: bool = False  # asked to stop already (this stop or another): left alone


@dataclass(frozen=True, slots=True)
class EndStop:
    attempt_id: int
    job_id: int
    reservation: Reservation
    at: float  # when the job is stopped: the reservation's end plus the overrun


def stop_time(resv: Reservation, overrun: float | None) -> float | None:
    """When jobs still running in `resv` are stopped (None: UNLIMITED, never)."""
    return None if overrun is None else resv.end + overrun


def due_end_stops(
    reservations: Mapping[str, Reservation],
    running: Iterable[InReservation],
    now: float,
    overrun: float | None,
    *,
    early: float = 0.0,
) -> list[EndStop]:
    """Attempts to stop now because their reservation ends (plus `overrun`) within their
    grace: they get their checkpoint signal now and SIGTERM at that time (an attempt whose
    grace is longer than what is left gets what is left). None when `overrun` is None
    (UNLIMITED). ``early``: the caller's tick interval, so that no job gets up to a tick less
    warning than its grace. An attempt being stopped already, or whose reservation is unknown
    (never: a reservation a job uses cannot be deleted), is left alone."""
    if overrun is None:
        return []
    out: list[EndStop] = []
    for r in running:
        resv = reservations.get(r.reservation)
        if resv is None or r.stopping:
            continue
        at = resv.end + overrun
        if now + early >= at - r.grace:
            out.append(EndStop(r.attempt_id, r.job_id, resv, at))
    return out


def format_overrun(overrun: float | None) -> str:
    return "UNLIMITED" if overrun is None else f"{overrun:g}s"


_END_STOP = TIMEOUT_STOP + "Reservation "
_END_STOP_RE = re.compile(re.escape(_END_STOP) + r"(\S+?), which this job was running under")


def end_stop_reason(resv: Reservation, overrun: float, now: float) -> str:
    """The attempt's stop reason, which ends the job TIMEOUT with the rest of it (Slurm's
    words: ``Reservation r1, which this job was running under, has ended``)."""
    at = f"at {format_when(resv.end, now)}"
    if overrun:
        at += f"; reservation_overrun {format_overrun(overrun)}"
    return f"{_END_STOP}{resv.name}, which this job was running under, has ended ({at})"


def reservation_of_stop(reason: str | None) -> str | None:
    """The reservation an `end_stop_reason` names, else None."""
    m = _END_STOP_RE.match(reason or "")
    return m[1] if m else None


def end_event_text(resv: Reservation, now: float, jobs: Sequence[int], overrun: float | None,
                   *, skipped: bool) -> str:  # fmt: skip
    """The `resv.end` event's message: when, and what happens to the jobs still in it."""
    head = f"reservation {resv.name} on {resv.hostlist} ended at {format_when(resv.end, now)}"
    if skipped:
        head += " (no controller recorded its start)"
    if not jobs:
        return head
    listed = ", ".join(map(str, jobs[:20])) + (" ..." if len(jobs) > 20 else "")
    plural = "s" if len(jobs) > 1 else ""
    at = stop_time(resv, overrun)
    if at is None:
        return (
            f"{head}; job{plural} {listed} still in it {'run' if plural else 'runs'} on to "
            f"{'their' if plural else 'its'} time limit (reservation_overrun UNLIMITED)"
        )
    when = "at its end" if overrun == 0 else f"at {format_when(at, now)}"
    return (
        f"{head}; job{plural} {listed} still in it {'are' if plural else 'is'} stopped {when} "
        f"(reservation_overrun {format_overrun(overrun)}) and end TIMEOUT"
    )
