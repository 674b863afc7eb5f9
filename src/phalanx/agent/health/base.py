"""Health-check results, the `Check` protocol, and the monitor that turns runs into a verdict.

The monitor is deliberately synchronous and clock-injected: the agent decides on which thread it
runs (see `HealthMonitor.start_thread`), and tests drive it with a fake clock.  The one rule
that matters to the controller lives here: a check that failed or warned keeps reporting that
status until it has passed `passes_to_recover` times in a row, so a flapping sensor cannot
bounce a node in and out of service, and the controller can resume any node whose summary is
"ok" without keeping its own history.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("phalanx.agent.health")


class Status(StrEnum):
    """Ordered severities: OK < WARN (stop new work) < FAIL (drain, requeue per policy)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2}


def worst(statuses: Iterable[Status]) -> Status:
    """The most severe status (OK for none)."""
    return max(statuses, key=lambda s: s.rank, default=Status.OK)


@dataclass(frozen=True)
class CheckResult:
    """One run of one check.  `reason` is one line an operator understands, because it becomes
    the node's drain reason verbatim (e.g. "GPU 3: XID 79 (GPU has fallen off the bus)")."""

    check: str
    status: Status
    reason: str


@runtime_checkable
class Check(Protocol):
    """Anything with a unique `name`, an `interval` in seconds and a `run()`.

    `run()` may block (a site script runs up to its timeout), may raise (the monitor reports a
    crash as FAIL), and may keep state between runs (cursors, counter baselines).  A check may
    also have a `timeout` attribute: the monitor then allows that long plus a margin before it
    declares a run hung.
    """

    name: str
    interval: float

    def run(self) -> CheckResult: ...


def one_line(text: str, limit: int = 300) -> str:
    """Collapse to one trimmed line: reasons end up in `squeue`-style tables and logs."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass
class _State:
    """What the monitor remembers about one check."""

    status: Status = Status.OK  # the reported (sticky) status
    reason: str | None = None
    since: float | None = None  # wall-clock time the reported status began
    passes: int = 0  # consecutive OK runs while reporting WARN/FAIL
    last_run: float | None = None  # monotonic start of the last run
    ran: bool = False


class HealthMonitor:
    """Runs checks on their intervals and keeps the per-check, recovery-aware verdicts.

    `clock` (monotonic) schedules runs and detects hung checks; `wall` stamps `since` so the
    controller can show "failing since 12:03" — monotonic time means nothing off this host.
    `hung_after` bounds how long a single run may take before `summary()` reports the check as
    FAIL even though it has not returned: a check stuck in an NFS write would otherwise freeze
    the last verdict at "ok" forever.
    """

    def __init__(
        self,
        checks: list[Check],
        *,
        passes_to_recover: int = 3,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        hung_after: float = 120.0,
    ) -> None:
        if passes_to_recover < 1:
            raise ValueError(f"passes_to_recover must be at least 1, not {passes_to_recover}")
        names = [c.name for c in checks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"health checks must have unique names; repeated: {', '.join(dupes)}")
        self.checks = list(checks)
        self.passes_to_recover = passes_to_recover
        self.clock = clock
        self.wall = wall
        self.hung_after = hung_after
        self._states = {c.name: _State() for c in self.checks}
        self._lock = threading.Lock()  # guards _states and _running (summary() vs run_due())
        self._run_lock = threading.Lock()  # one run_due()/preflight() at a time
        self._running: tuple[Check, float] | None = None
        # called with (check name, seconds) after every run: the agent's /metrics histogram
        self.observe: Callable[[str, float], None] | None = None

    def add_check(self, check: Check) -> None:
        """Add a check (before `preflight`); its name must be new."""
        with self._run_lock, self._lock:
            if check.name in self._states:
                raise ValueError(f"health checks must have unique names; repeated: {check.name}")
            self.checks.append(check)
            self._states[check.name] = _State()

    def replace_checks(
        self, checks: list[Check], *, passes_to_recover: int = 3, hung_after: float = 120.0
    ) -> None:
        """Run `checks` from now on (a new node configuration version, agent/nodeconf.py).
        A check kept by name keeps its verdict (a failing one still needs its passes to
        recover); a removed one leaves the summary; a new one runs at the monitor's next
        look, within its period."""
        if passes_to_recover < 1:
            raise ValueError(f"passes_to_recover must be at least 1, not {passes_to_recover}")
        names = [c.name for c in checks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"health checks must have unique names; repeated: {', '.join(dupes)}")
        with self._run_lock, self._lock:
            self.checks = list(checks)
            self._states = {n: self._states.get(n) or _State() for n in names}
            self.passes_to_recover = passes_to_recover
            self.hung_after = hung_after

    # ------------------------------------------------------------------ running
    def preflight(self) -> CheckResult:
        """Run every check once (before the node registers) and return the worst raw result.

        The results also count as normal runs, so a node that fails preflight joins drained
        and needs the usual passes to come back.
        """
        with self._run_lock:
            results = [self._run_one(c, self.clock()) for c in self.checks]
        if not results:
            return CheckResult("health", Status.OK, "no health checks configured")
        return _worst_result(results)

    def run_due(self, now: float | None = None) -> list[CheckResult]:
        """Run the checks whose interval has elapsed since their last start; return their raw
        results (the sticky verdicts are in `summary()`).

        Blocks for as long as the due checks take (a site script: up to its timeout), so call
        it from a thread of its own, not from the heartbeat loop — see `start_thread`.
        """
        with self._run_lock:
            t = self.clock() if now is None else now
            results = []
            for check in self.checks:
                last = self._states[check.name].last_run
                if last is None or t - last >= check.interval:
                    results.append(self._run_one(check, t))
            return results

    def start_thread(
        self, stop: threading.Event, period: float = 1.0, name: str = "phx-health"
    ) -> threading.Thread:
        """Call `run_due()` every `period` seconds on a daemon thread until `stop` is set.

        Health checks block (scripts, fsync, NVML), and the agent's heartbeat loop must not:
        a 30 s script there would miss the fence deadline and kill every task on the node.
        """

        def loop() -> None:
            while not stop.is_set():
                try:
                    self.run_due()
                except Exception:  # the monitor already contains check crashes; belt and braces
                    log.exception("health monitor loop failed; going on")
                stop.wait(period)

        thread = threading.Thread(target=loop, name=name, daemon=True)
        thread.start()
        return thread

    def _run_one(self, check: Check, started: float) -> CheckResult:
        with self._lock:
            self._states[check.name].last_run = started
            self._running = (check, started)
        began = time.monotonic()
        try:
            result = check.run()
            if not isinstance(result, CheckResult):
                raise TypeError(f"run() returned {type(result).__name__}, not CheckResult")
            if result.check != check.name:  # a check's results are always filed under its name
                result = CheckResult(check.name, result.status, result.reason)
        except Exception as e:
            log.warning("health check %s crashed", check.name, exc_info=True)
            result = CheckResult(
                check.name, Status.FAIL, one_line(f"check {check.name} crashed: {_exc(e)}")
            )
        with self._lock:
            self._running = None
            self._record(result)
        if self.observe is not None:
            self.observe(check.name, time.monotonic() - began)
        return result

    def _record(self, result: CheckResult) -> None:
        """Apply the recovery rule.  Called with the lock held."""
        st = self._states[result.check]
        first = not st.ran
        st.ran = True
        if result.status is Status.OK:
            if st.status is Status.OK:
                if first:
                    st.since = self.wall()
                st.reason = result.reason
                return
            st.passes += 1
            if st.passes >= self.passes_to_recover:
                log.info("health check %s recovered: %s", result.check, result.reason)
                st.status, st.reason, st.since, st.passes = Status.OK, result.reason, self.wall(), 0
            return
        st.passes = 0
        if result.status.rank >= st.status.rank:
            if result.status is not st.status or first:
                st.since = self.wall()
                log.warning("health check %s: %s: %s", result.check, result.status, result.reason)
            st.status, st.reason = result.status, result.reason
        # A milder problem while a worse one is still recovering keeps the worse verdict.

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """The heartbeat payload: the worst sticky status over checks, with its check and reason.

        ``{"status": "ok|warn|fail", "check": name|None, "reason": str|None,
        "checks": {name: {"status", "reason", "since"}}}`` — checks that never ran are left
        out; `since` is a Unix time.
        """
        with self._lock:
            self._note_hang()
            checks: dict[str, dict[str, Any]] = {}
            worst_name: str | None = None
            worst_status = Status.OK
            for check in self.checks:
                st = self._states[check.name]
                if not st.ran:
                    continue
                checks[check.name] = {
                    "status": st.status.value,
                    "reason": st.reason,
                    "since": st.since,
                }
                if st.status.rank > worst_status.rank:
                    worst_name, worst_status = check.name, st.status
        return {
            "status": worst_status.value,
            "check": worst_name,
            "reason": checks[worst_name]["reason"] if worst_name else None,
            "checks": checks,
        }

    def _note_hang(self) -> None:
        """Record a FAIL for a run that has outlived its allowance.  Called with the lock held.

        The FAIL goes through the normal rule, so a check that was stuck needs its usual
        passes before the node comes back."""
        if self._running is None:
            return
        check, started = self._running
        limit = max(self.hung_after, float(getattr(check, "timeout", 0) or 0) + 30.0)
        elapsed = self.clock() - started
        if elapsed > limit:
            st = self._states[check.name]
            if st.status is not Status.FAIL:
                self._record(
                    CheckResult(
                        check.name,
                        Status.FAIL,
                        f"check {check.name} hung: still running after {elapsed:.0f}s",
                    )
                )


def _worst_result(results: list[CheckResult]) -> CheckResult:
    top = worst(r.status for r in results)
    return next(r for r in results if r.status is top)


def _exc(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
