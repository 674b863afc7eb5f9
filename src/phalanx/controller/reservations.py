"""The reservation part of the `cluster` duty, and the grace of stops at a reservation's end.

Each cluster tick (only the holder of the `cluster` lease acts) reads the reservations that
still have something to do (`phase` not closed) and, once one has started, the live attempts of
jobs that asked for it; asks `domain.reservations` what is due; and applies it in fenced
writes (the fence is asked for again before every write):

- jobs still running in a reservation whose end (plus `timing.reservation_overrun`, Slurm's
  ResvOverRun) comes within their grace get a planned stop (`timeout: Reservation r1, which
  this job was running under, has ended ...`): the agent delivers their checkpoint signal, and
  the job ends TIMEOUT at that time, as in Slurm;
- a reservation whose start or end has come moves to its next phase with its `resv.start` or
  `resv.end` event, a compare-and-set in the store, so each is written once whatever the
  number of controllers; an ended one with no job left running in it is closed.

The agent gives a planned stop a fixed grace; `adjust_stops` replaces it with the time left
until the stop time, so the job is stopped at the reservation's end (plus the overrun) and not
a grace after its signal, on whichever controller answers the node's heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from phalanx.domain import reservations as rules
from phalanx.domain.maintenance import format_when
from phalanx.store.sqlbits import Fence
from phalanx.store.surface import MaintenanceStore, ReservationStore

_GRACE_MEMO = 10_000  # attempts whose stop time is remembered (the heartbeat path)


class DutyStore(ReservationStore, MaintenanceStore, Protocol):
    """The reservations' reads and fenced writes, and the jobs' checkpoint graces."""


class ReservationDuty:
    def __init__(
        self,
        store: DutyStore,
        *,
        overrun: Callable[[], float | None],
        grace: Callable[[], float],
        tick: Callable[[], float],
        fence: Callable[[], Fence | None],
        kick: Callable[[], None],
        notify: Callable[[list[str]], None],
    ) -> None:
        self.store = store
        self.overrun = overrun  # timing.reservation_overrun in seconds; None: UNLIMITED
        self.grace = grace  # timing.checkpoint_grace: a job that asked for none gets it
        self.tick_interval = tick
        self.fence = fence
        self.kick = kick
        self.notify = notify
        self._graces: dict[int, float] = {}  # job id -> its own checkpoint grace (immutable)
        self._stop_at: dict[int, float] = {}  # attempt id -> when its end stop stops it

    def tick(self) -> str:
        """One pass: stops that are due, then reservations that start, end or close."""
        if self.fence() is None:
            return "idle"
        rows = self.store.watched_reservations()
        if not rows:
            return "idle"
        now = time.time()
        watched = [(rules.Reservation.from_row(r), rules.Phase(r["phase"]), r) for r in rows]
        by_name = {r.name: r for r, _, _ in watched}
        begun = sorted(r.name for r, _, _ in watched if r.start <= now)
        attempts = self.store.attempts_in_reservations(begun) if begun else []
        running = self._running(attempts)
        overrun = self.overrun()
        said: list[str] = []
        due = rules.due_end_stops(by_name, running, now, overrun, early=self.tick_interval())
        if due and overrun is not None:
            fence = self.fence()
            if fence is None:
                return "lost the cluster lease mid-cycle; nothing applied"
            stops = [
                (
                    d.attempt_id,
                    d.reservation.name,
                    rules.end_stop_reason(d.reservation, overrun, now),
                )
                for d in due
            ]
            stopped = self.store.stop_at_reservation_end(stops, fence)
            if stopped:
                on = sorted({n for r in running if r.job_id in stopped for n in r.nodes})
                self.notify(on)
                names = ", ".join(sorted({d.reservation.name for d in due}))
                said.append(f"stopping jobs {stopped}: reservation {names} ended")
        busy = {r.reservation for r in running}
        for change in rules.due_phases([(r, p) for r, p, _ in watched], now, busy):
            fence = self.fence()
            if fence is None:
                said.append("lost the cluster lease mid-cycle")
                break
            r = change.reservation
            jobs = sorted({a.job_id for a in running if a.reservation == r.name})
            message, data = self._event(change, jobs, overrun, now)
            rid = int(next(row["id"] for x, _, row in watched if x.name == r.name))
            moved = self.store.move_reservation(
                rid, change.old, change.new, fence, message=message, data=data
            )
            if moved and change.new is not rules.Phase.CLOSED:
                said.append(f"reservation {r.name} {change.new.value}")
                self.kick()  # its nodes open to others, or close to them
        return ", ".join(said) or "idle"

    def _running(self, attempts: list[dict[str, Any]]) -> list[rules.InReservation]:
        jobs = {int(a["job_id"]) for a in attempts}
        missing = sorted(jobs - self._graces.keys())
        if missing:
            self._graces.update(self.store.checkpoint_graces(missing))
        self._graces = {j: g for j, g in self._graces.items() if j in jobs}
        default = self.grace()
        return [
            rules.InReservation(
                attempt_id=int(a["attempt_id"]),
                job_id=int(a["job_id"]),
                reservation=str(a["reservation"]),
                nodes=tuple(a["nodes"]),
                grace=self._graces.get(int(a["job_id"])) or default,
                stopping=bool(a.get("stopping")),
            )
            for a in attempts
        ]

    @staticmethod
    def _event(
        change: rules.PhaseChange, jobs: list[int], overrun: float | None, now: float
    ) -> tuple[str | None, dict[str, Any]]:
        r = change.reservation
        data: dict[str, Any] = {
            "reservation": r.name,
            "nodes": list(r.nodes),
            "start": r.start,
            "end": r.end,
        }
        if change.new is rules.Phase.ACTIVE:
            when = format_when(r.end, now)
            return f"reservation {r.name} on {r.hostlist} started (until {when})", data
        if change.new is rules.Phase.ENDED:
            data.update(jobs=jobs, overrun=rules.format_overrun(overrun), skipped=change.skipped)
            return rules.end_event_text(r, now, jobs, overrun, skipped=change.skipped), data
        return None, data

    def adjust_stops(self, stops: list[dict[str, Any]], now: float | None = None) -> None:
        """Give each stop at a reservation's end the time left until its stop time as its
        grace (this controller's overrun: every controller runs the same version)."""
        for item in stops:
            name = rules.reservation_of_stop(item.get("reason"))
            if name is None or "checkpoint_grace" not in item:
                continue
            aid = int(item["attempt_id"])
            at = self._stop_at.get(aid)
            if at is None:
                end = self.store.reservation_end(name)
                overrun = self.overrun()
                if end is None or overrun is None:
                    continue
                if len(self._stop_at) >= _GRACE_MEMO:
                    self._stop_at.clear()
                at = self._stop_at[aid] = end + overrun
            item["checkpoint_grace"] = max(0.0, at - (time.time() if now is None else now))
