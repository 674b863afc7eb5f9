"""The watchdog rule (pure), the sd_notify sender, the hardware watchdog device, their config.

The device is exercised against a FIFO and a plain file standing in for /dev/watchdog: the
fake is at the hardware boundary only (what the daemon writes to the device), the code under
test is the real one.
"""

from __future__ import annotations

import os
import socket
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.config import WatchdogConfig, load_config
from phalanx.controller.server import StartupError, open_device
from phalanx.errors import ConfigError, PhalanxError
from phalanx.sdnotify import Notifier, format_message, socket_address, watchdog_seconds
from phalanx.watchdog import Beat, Beats, DeviceWatchdog, Watchdog, wedged

# ------------------------------------------------------------------ the rule


def test_every_loop_within_its_deadline_is_healthy() -> None:
    beats = {"scheduler": Beat(at=100.0, deadline=10.0), "leases": Beat(at=105.0, deadline=2.0)}
    assert wedged(106.0, beats) is None
    assert wedged(110.0, beats) == "leases"  # 5 s since its beat, 2 s allowed
    assert wedged(100.0 + 10.0, {"scheduler": Beat(100.0, 10.0)}) is None  # at the deadline


def test_the_most_overdue_loop_is_named_and_ties_go_by_name() -> None:
    beats = {
        "a": Beat(at=0.0, deadline=50.0),  # 50 s late at t=100
        "b": Beat(at=0.0, deadline=10.0),  # 90 s late
        "c": Beat(at=90.0, deadline=1.0),  # 9 s late
    }
    assert wedged(100.0, beats) == "b"
    tie = {"z": Beat(0.0, 1.0), "m": Beat(0.0, 1.0)}
    assert wedged(5.0, tie) == "m"
    assert wedged(5.0, {}) is None


def test_beats_record_progress_on_their_clock() -> None:
    now = [10.0]
    beats = Beats(clock=lambda: now[0])
    assert beats.age("poller") is None
    beats.beat("poller", 3.0)
    now[0] = 12.5
    assert beats.age("poller") == 2.5
    assert wedged(now[0], beats.snapshot()) is None
    now[0] = 13.5
    assert wedged(now[0], beats.snapshot()) == "poller"
    beats.forget("poller")
    assert wedged(now[0], beats.snapshot()) is None


# ------------------------------------------------------------------ sd_notify


class Listener:
    """A bound datagram socket in the abstract namespace, as systemd's notify socket."""

    def __init__(self) -> None:
        self.name = f"@phx-unit-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(self.name))
        self.sock.settimeout(5)

    def recv(self) -> dict[str, str]:
        data = self.sock.recv(65536).decode()
        return dict(line.split("=", 1) for line in data.splitlines())

    def pending(self) -> list[dict[str, str]]:
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(65536).decode()
                out.append(dict(line.split("=", 1) for line in data.splitlines()))
        except BlockingIOError:
            return out
        finally:
            self.sock.settimeout(5)


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    yield lst
    lst.sock.close()


def test_addresses_and_messages() -> None:
    assert socket_address("@abc") == b"\0abc"
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert format_message({"READY": "1", "STATUS": "a\nb"}) == b"READY=1\nSTATUS=a b"


def test_watchdog_timeout_is_for_this_process_only() -> None:
    assert watchdog_seconds({"WATCHDOG_USEC": "30000000"}, 42) == 30.0
    assert watchdog_seconds({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42"}, 42) == 30.0
    assert watchdog_seconds({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, 42) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "soon"}, 42) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "0"}, 42) is None
    assert watchdog_seconds({}, 42) is None


def test_the_variables_leave_the_environment(listener: Listener) -> None:
    env = {
        "NOTIFY_SOCKET": listener.name,
        "WATCHDOG_USEC": "2000000",
        "WATCHDOG_PID": str(os.getpid()),
        "PATH": "/bin",
    }
    n = Notifier.from_environment(env)
    assert env == {"PATH": "/bin"}  # children (shepherds, jobs) inherit none of them
    assert n.enabled and n.watchdog == 2.0
    assert n.ready("serving")
    assert listener.recv() == {"READY": "1", "STATUS": "serving"}
    assert n.stop("bye") and not n.stop("again")  # STOPPING=1 once
    assert listener.recv() == {"STOPPING": "1", "STATUS": "bye"}
    n.close()


def test_no_socket_is_a_quiet_no_op_and_a_dead_one_never_raises(tmp_path: Path) -> None:
    assert not Notifier.from_environment({}).send(READY="1")
    gone = Notifier(str(tmp_path / "nobody-listens"), None)
    assert not gone.ping()
    assert not gone.ping()


# ------------------------------------------------------------------ the watchdog thread's round


def test_pings_and_pets_only_while_healthy(listener: Listener, tmp_path: Path) -> None:
    now = [0.0]
    beats = Beats(clock=lambda: now[0])
    beats.beat("scheduler", 5.0)
    device_file = tmp_path / "fake-watchdog-device"  # a plain file in place of /dev/watchdog
    device_file.touch()
    device = DeviceWatchdog(str(device_file))
    assert device.open() is None  # no watchdog driver behind a plain file: no timeout known
    wd = Watchdog(
        Notifier(listener.name, 4.0),
        beats,
        status=lambda: "leases held: none",
        interval=9.0,
        device=device,
    )
    assert wd.interval == 2.0  # half of systemd's WatchdogSec, not the configured interval

    # before READY=1 (a long start): the device is petted, systemd gets no ping yet
    assert wd.check() is None
    assert listener.pending() == [{"STATUS": "leases held: none"}]
    assert device_file.read_bytes() == b"1"
    wd.ready("serving")
    assert listener.pending() == [{"READY": "1", "STATUS": "serving"}]

    assert wd.check() is None
    assert listener.pending() == [{"WATCHDOG": "1"}, {"STATUS": "leases held: none"}]

    now[0] = 6.0  # the scheduler is 1 s past its deadline
    assert wd.check() == "scheduler"
    (msg,) = listener.pending()
    assert msg["STATUS"].startswith("WEDGED: scheduler has not progressed for 6s")
    assert device_file.read_bytes() == b"11"  # petted in the healthy rounds only

    beats.beat("scheduler", 5.0)  # it moves again: pings resume
    assert wd.check() is None
    assert listener.pending()[0] == {"WATCHDOG": "1"}
    wd.stop(clean=True)
    assert device_file.read_bytes() == b"111V"  # magic close on a clean stop


def test_a_failing_summary_does_not_stop_the_pings(listener: Listener) -> None:
    beats = Beats()
    beats.beat("x", 60.0)

    def broken() -> str:
        raise RuntimeError("store gone")

    wd = Watchdog(Notifier(listener.name, 2.0), beats, status=broken, interval=1.0)
    wd.is_ready = True
    assert wd.check() is None
    assert listener.pending() == [{"WATCHDOG": "1"}, {"STATUS": "status unavailable: store gone"}]


def test_without_systemd_or_a_device_no_thread_runs() -> None:
    wd = Watchdog(Notifier(None, None), Beats(), status=lambda: "", interval=1.0)
    wd.start()
    assert not wd.needed and wd._thread is None
    wd.stop()


# ------------------------------------------------------------------ the device, faked by a FIFO


def fifo_reader(path: Path) -> int:
    """The read end of a FIFO standing in for the device: what the daemon writes stays in the
    pipe until read, so the test reads it all after the device is closed."""
    os.mkfifo(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def drain(fd: int) -> bytes:
    out = b""
    try:
        while chunk := os.read(fd, 64):
            out += chunk
    except BlockingIOError:
        pass
    os.close(fd)
    return out


def test_fifo_device_sees_pets_then_the_magic_close(tmp_path: Path) -> None:
    fifo = tmp_path / "fake-watchdog-fifo"
    reader = fifo_reader(fifo)
    device = DeviceWatchdog(str(fifo))
    assert device.open() is None  # no watchdog driver: no timeout to read
    device.pet()
    device.pet()
    device.close(disarm=True)
    assert drain(reader) == b"11V"


def test_a_crash_closes_without_disarming(tmp_path: Path) -> None:
    fifo = tmp_path / "fake-watchdog-fifo"
    reader = fifo_reader(fifo)
    device = DeviceWatchdog(str(fifo))
    device.open()
    device.pet()
    device.close(disarm=False)  # what a killed daemon leaves: the device stays armed
    assert drain(reader) == b"1"


def test_a_device_that_cannot_be_opened_stops_the_start_with_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "fake-watchdog-fifo"
    os.mkfifo(fifo)  # nobody reads it: opening for writing fails at once (ENXIO)
    with pytest.raises(StartupError, match=r"cannot open the watchdog device .*watchdog.device"):
        open_device(str(fifo), 5.0)
    with pytest.raises(StartupError, match="No such file"):
        open_device(str(tmp_path / "missing"), 5.0)
    assert open_device(None, 5.0) is None
    assert stat.S_ISFIFO(fifo.stat().st_mode)


# ------------------------------------------------------------------ configuration


def test_watchdog_defaults_and_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    w = load_config().watchdog
    assert (w.loop_timeout, w.store_timeout, w.interval, w.device) == (60.0, 0.0, 5.0, None)
    with pytest.raises(ConfigError, match=r"loop_timeout >= 5 \* timing.db_op_timeout"):
        load_config(overrides={"watchdog": {"loop_timeout": 5.0}})
    with pytest.raises(ConfigError, match=r"store_timeout > timing.renew_interval"):
        load_config(overrides={"watchdog": {"store_timeout": 2.0}})
    assert load_config(overrides={"watchdog": {"store_timeout": 120.0}}).watchdog.store_timeout
    with pytest.raises(ConfigError, match=r"watchdog\.interval"):
        load_config(overrides={"watchdog": {"interval": 0}})


def test_every_watchdog_key_is_documented() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for key in WatchdogConfig.model_fields:
        assert f"`watchdog.{key}`" in doc, key


# ------------------------------------------------------------------ the controller's store rule


def test_a_controller_counts_the_store_as_a_loop_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from phalanx.controller.runtime import Controller, partition_rows
    from phalanx.store.store import Store

    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    for store_timeout, counted in ((0.0, False), (30.0, True)):
        cfg = load_config(overrides={"watchdog": {"store_timeout": store_timeout}})
        state = tmp_path / f"state-{store_timeout:g}"
        state.mkdir()
        st = Store(f"sqlite:///{state}/phalanx.db", actor="t")
        st.migrate()
        st.sync_partitions(partition_rows(cfg))
        st.register_controller("t", None)
        ctl = Controller(st, cfg, cid="t")
        now = [1000.0]
        ctl.beats.clock = lambda now=now: now[0]
        ctl.presence_tick()  # the store answered
        assert ("store" in ctl.beats.snapshot()) is counted
        assert "store ok" in ctl.summary()

        # the store goes away: its directory is gone, SQLite cannot open it again
        st.close()
        for p in state.iterdir():
            p.unlink()
        state.rmdir()
        with pytest.raises(PhalanxError):
            ctl.presence_tick()
        assert "store DOWN" in ctl.summary()
        now[0] += 31.0
        assert wedged(now[0], ctl.beats.snapshot()) == ("store" if counted else None)
