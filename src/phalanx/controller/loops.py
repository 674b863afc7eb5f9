"""Running the controller's loops: one thread per duty, ticking until the controller stops.

`LoopRunner` owns the threads, the stop and scheduler-kick events, each loop's last tick and
its watchdog beat. A tick returns one sentence for the log; an unexpected exception is logged
at the tick boundary and the loop goes on. Kept apart from the duties so that every duty is a
plain `tick()` the runner calls, testable without threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import Counter

from phalanx.config import Config, Timing
from phalanx.controller.metrics import FENCED_REFUSED
from phalanx.errors import Fenced, StoreUnavailable
from phalanx.faulthooks import maybe_wedge
from phalanx.watchdog import Beats

log = logging.getLogger("phalanx.controller")

LOOP_ERRORS = Counter("phalanx_loop_errors_total", "Ticks that ended in an error", ["loop"])

# a loop's name, its tick, and the seconds between two ticks (read after every tick)
Loop = tuple[str, Callable[[], str], Callable[[], float]]


class LoopRunner:
    def __init__(self, config: Config, timing: Callable[[], Timing], beats: Beats) -> None:
        self.config = config
        self.timing = timing  # the timings in force (controller/timings.py)
        # progress of every loop, for the systemd watchdog (watchdog.py)
        self.beats = beats
        self.last_tick: dict[str, float] = {}  # loop -> monotonic time its last tick ended
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, loops: list[Loop]) -> None:
        for name, fn, interval in loops:
            self.beats.beat(name, self.deadline(interval()))
            t = threading.Thread(
                target=self._loop, args=(name, fn, interval), name=f"phx-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stopping(self) -> None:
        """Tell every loop to end after its tick (`join` waits for them)."""
        self._stop.set()
        self._kick.set()

    def join(self) -> None:
        for t in self._threads:
            t.join(timeout=5)

    def kick(self) -> None:
        """Run the scheduler's next pass now (after its minimum gap)."""
        self._kick.set()

    def deadline(self, interval: float) -> float:
        """How long a loop may go without progress before the watchdog calls it wedged: its
        own interval twice (a tick, then the wait) plus `watchdog.loop_timeout`."""
        return self.config.watchdog.loop_timeout + 2 * interval

    def stuck(self) -> list[str]:
        """Loops that have not completed a tick for longer than lease_ttl (a stuck controller
        must be restarted; its leases have lapsed already)."""
        now = time.monotonic()
        timing = self.timing()
        limit = 3 * timing.lease_ttl + timing.scheduler_interval
        return sorted(
            name for name, t in self.last_tick.items() if now - t > limit and name != "presence"
        )

    def _loop(self, name: str, fn: Callable[[], str], interval: Callable[[], float]) -> None:
        quiet = {"leases unchanged", "", "idle"}
        while not self._stop.is_set():
            maybe_wedge(name, self._stop)  # a test-only fault hook; nothing unless asked
            start = time.monotonic()
            try:
                sentence = fn()
                if sentence not in quiet:
                    log.info("%s: %s", name, sentence)
            except StoreUnavailable as e:
                LOOP_ERRORS.labels(name).inc()
                log.warning("%s: store unavailable: %s", name, e.message)
            except Fenced as e:
                LOOP_ERRORS.labels(name).inc()
                FENCED_REFUSED.labels(name).inc()
                log.warning("%s: fenced, stepping down: %s", name, e.message)
            except Exception:
                LOOP_ERRORS.labels(name).inc()
                log.exception("%s: unexpected error; the loop goes on", name)
            self.last_tick[name] = time.monotonic()
            self.beats.beat(name, self.deadline(interval()))
            took = time.monotonic() - start
            wait = interval() - took
            if name == "scheduler":
                # at least scheduler_min_gap between passes, so a burst of submissions or
                # exits is handled by one pass instead of hundreds
                self._stop.wait(max(0.0, self.timing().scheduler_min_gap - took))
                self._kick.wait(max(0.0, wait))
                self._kick.clear()
            elif wait > 0:
                self._stop.wait(wait)
