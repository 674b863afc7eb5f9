"""The daemons' watchdog: is every loop still making progress, and who is told.

Each loop of a daemon (a controller's scheduler, lease keeper, HTTP event loop...; an agent's
poller and exit watcher) records a beat when it progresses, with the deadline within which it
must progress again. `wedged` (pure) says whether every loop is within its deadline, or which
one is not. A `Watchdog` thread asks it every `interval` seconds and, only while the answer is
"healthy", sends ``WATCHDOG=1`` to systemd and pets the optional hardware watchdog; it also sends
``STATUS=`` with the daemon's one-line summary. A wedged loop stops the pings, so systemd kills
and restarts the daemon after ``WatchdogSec`` (deploy/systemd/*.service), and a host whose whole
userspace hangs is reset by the hardware watchdog after the device's own timeout.

A loop that fails (a store outage, a refused connection) still progresses: its tick ends with
an error and the next one starts. Restarting a daemon does not bring a database back, so only a
loop that stops turning counts, plus, for controllers that ask for it
(``watchdog.store_timeout``), a store that has not answered for that long (docs/configuration.md).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from phalanx.sdnotify import Notifier

log = logging.getLogger("phalanx.watchdog")

WDIOC_GETTIMEOUT = 0x80045707  # _IOR('W', 7, int), linux/watchdog.h


@dataclass(frozen=True)
class Beat:
    """A loop's last progress (monotonic seconds) and how long it may go without another."""

    at: float
    deadline: float


def wedged(now: float, beats: Mapping[str, Beat]) -> str | None:
    """None when every loop progressed within its deadline; otherwise the name of the loop that
    is most overdue (ties broken by name, so the answer is stable)."""
    late = [(now - b.at - b.deadline, name) for name, b in beats.items() if now - b.at > b.deadline]
    if not late:
        return None
    return min(late, key=lambda x: (-x[0], x[1]))[1]


class Beats:
    """Thread-safe record of each loop's progress."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._beats: dict[str, Beat] = {}
        self._lock = threading.Lock()

    def beat(self, name: str, deadline: float) -> None:
        """`name` progressed now and must progress again within `deadline` seconds."""
        with self._lock:
            self._beats[name] = Beat(self.clock(), deadline)

    def forget(self, name: str) -> None:
        with self._lock:
            self._beats.pop(name, None)

    def snapshot(self) -> dict[str, Beat]:
        with self._lock:
            return dict(self._beats)

    def age(self, name: str) -> float | None:
        """Seconds since `name` last progressed (None: never)."""
        b = self.snapshot().get(name)
        return None if b is None else self.clock() - b.at


class DeviceWatchdog:
    """The Linux watchdog device API (/dev/watchdog): open arms it, every write pets it, and
    writing the magic character 'V' just before closing disarms it (a clean stop). Closing
    without it (the daemon crashed or was killed by systemd) leaves it armed, so the host is
    reset unless a new instance opens and pets it within the device's timeout."""

    MAGIC = b"V"

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._warned = False

    def open(self) -> float | None:
        """Arm the device and return its timeout in seconds (None: the file is no watchdog
        driver, e.g. a FIFO standing in for one in tests); OSError if it cannot be opened."""
        # O_NONBLOCK: a missing reader on a fake device (a FIFO) fails at once instead of
        # hanging the daemon's start; the real device ignores it. CLOEXEC: no job or shepherd
        # ever holds it open.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(self._fd, WDIOC_GETTIMEOUT, buf, True)
        except OSError:
            return None
        return float(buf[0]) if buf[0] > 0 else None

    def pet(self) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, b"1")
            self._warned = False
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("cannot pet the watchdog device %s: %s", self.path, e)

    def close(self, *, disarm: bool) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if disarm:
                with contextlib.suppress(OSError):
                    os.write(fd, self.MAGIC)
        finally:
            os.close(fd)


def thread_stack(name: str) -> str | None:
    """The current stack of the thread called `name` (for the log of a wedged loop)."""
    frames = sys._current_frames()
    for t in threading.enumerate():
        if t.name == name and t.ident in frames:
            return "".join(traceback.format_stack(frames[t.ident]))
    return None


class Watchdog:
    """Pings systemd (and pets the device) while `wedged` says healthy; sends STATUS= always.

    It runs from the daemon's start: the hardware device is armed then and must be petted
    through a long start (an agent waiting for its controllers). systemd gets WATCHDOG=1 only
    after `ready` has sent READY=1.

    `interval`: half of systemd's WatchdogSec when systemd asks for pings (sd_watchdog_enabled
    semantics), else the configured `watchdog.interval` (STATUS updates, the hardware device).
    A wedged loop's stack is logged once, from the thread named ``phx-<loop>`` (the daemons'
    convention for loop threads).
    """

    def __init__(
        self,
        notifier: Notifier,
        beats: Beats,
        *,
        status: Callable[[], str],
        interval: float,
        device: DeviceWatchdog | None = None,
    ) -> None:
        self.notifier = notifier
        self.beats = beats
        self.status = status
        self.device = device
        self.interval = notifier.watchdog / 2 if notifier.watchdog else interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: str | None = None  # the wedged loop already logged
        self.pings = 0
        self.is_ready = False

    def ready(self, status: str) -> None:
        """READY=1 with a status line; WATCHDOG=1 pings follow from the next round on."""
        self.notifier.ready(status)
        self.is_ready = True

    @property
    def needed(self) -> bool:
        """Whether anyone listens: systemd (STATUS=, WATCHDOG=1) or a hardware device."""
        return self.notifier.enabled or self.device is not None

    def check(self) -> str | None:
        """One round: decide, ping or not, say the status. Returns the wedged loop, if any."""
        stuck = wedged(self.beats.clock(), self.beats.snapshot())
        if stuck is None:
            if self.notifier.watchdog and self.is_ready:
                self.notifier.ping()
            if self.device is not None:
                self.device.pet()
            self.pings += 1
            self._reported = None
            text = self._summary()
        else:
            age = self.beats.age(stuck) or 0.0
            text = (
                f"WEDGED: {stuck} has not progressed for {age:.0f}s; watchdog pings stopped "
                f"({self._summary()})"
            )
            if self._reported != stuck:
                self._reported = stuck
                stack = thread_stack(f"phx-{stuck}")
                log.error(
                    "%s has not progressed for %.0fs: watchdog pings stop, so systemd restarts "
                    "this daemon%s",
                    stuck,
                    age,
                    f"; its stack:\n{stack}" if stack else "",
                )
        self.notifier.status(text)
        return stuck

    def _summary(self) -> str:
        try:
            return self.status()
        except Exception as e:  # a summary must never stop the pings of a healthy daemon
            return f"status unavailable: {e}"

    def start(self) -> None:
        if not self.needed or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="phx-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:
                log.exception("watchdog round failed; going on")
            self._stop.wait(self.interval)

    def stop(self, *, clean: bool = True) -> None:
        """Stop pinging; a clean stop disarms the hardware device (magic close)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.device is not None:
            self.device.close(disarm=clean)
