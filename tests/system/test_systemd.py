"""The daemons under systemd's notify protocol, against a real NOTIFY_SOCKET.

The test binds the datagram socket systemd would (one in the abstract namespace, one a path),
starts a real controller and a real agent with NOTIFY_SOCKET and WATCHDOG_USEC set, and reads
what they send: READY=1 only once they serve, periodic WATCHDOG=1, a STATUS= that says
something true, pings that stop when a loop is wedged, STOPPING=1 on SIGTERM.

A loop is wedged through the test-only fault hook (faulthooks.FAULT_WEDGE_LOOP): one thread of
the real daemon blocks for good while the others go on, as a deadlock would. SIGSTOP cannot do
that (it stops the watchdog thread too, which proves nothing about the rule).
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from phalanx.faulthooks import FAULT_WEDGE_FILE, FAULT_WEDGE_LOOP
from system.harness import Cluster, read_json, wait_for

pytestmark = pytest.mark.system

WATCHDOG_USEC = 4_000_000  # systemd's WatchdogSec=4s: a ping every 2 s
# short enough to see a wedge within seconds; db_op_timeout lowered to keep the config rule
# loop_timeout >= 5 * db_op_timeout
CONFIG = """
[timing]
db_op_timeout = 0.5

[watchdog]
loop_timeout = 3.0
"""

Message = dict[str, str]


class NotifySocket:
    """What systemd binds for a Type=notify service: a Unix datagram socket. Every datagram a
    daemon sends is kept, in order, with the time it was read."""

    def __init__(self, *, abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._dir: Path | None = None
        if abstract:
            self.name = f"@phx-test-notify-{uuid.uuid4().hex}"
            self.sock.bind(b"\0" + self.name[1:].encode())
        else:  # short: a Unix socket path must fit in 108 bytes
            self._dir = Path(tempfile.mkdtemp(prefix="phx-sd-", dir="/tmp"))
            self.name = str(self._dir / "notify")
            self.sock.bind(self.name)
        self.sock.setblocking(False)
        self.messages: list[tuple[float, Message]] = []

    def poll(self) -> list[tuple[float, Message]]:
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return self.messages
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def wait(
        self, pred: Callable[[Message], bool], what: str, *, after: int = 0, timeout: float = 90
    ) -> int:
        """Wait for a message (the `after`-th or later) that satisfies `pred`; its index."""

        def found() -> int | None:
            for i, (_, m) in enumerate(self.poll()[after:], start=after):
                if pred(m):
                    return i + 1  # 1-based: 0 is "not yet"
            return None

        return wait_for(found, timeout=timeout, what=what, interval=0.05) - 1

    def statuses(self, after: int = 0) -> list[str]:
        return [m["STATUS"] for _, m in self.poll()[after:] if "STATUS" in m]

    def close(self) -> None:
        self.sock.close()
        if self._dir is not None:
            for p in self._dir.iterdir():
                p.unlink()
            self._dir.rmdir()


@pytest.fixture
def notify_sockets() -> Iterator[Callable[..., NotifySocket]]:
    made: list[NotifySocket] = []

    def make(*, abstract: bool) -> NotifySocket:
        s = NotifySocket(abstract=abstract)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def systemd_env(sock: NotifySocket, root: Path, wedge_loop: str) -> dict[str, str]:
    config = root / "watchdog.toml"
    config.write_text(CONFIG)
    return {
        "NOTIFY_SOCKET": sock.name,
        "WATCHDOG_USEC": str(WATCHDOG_USEC),
        "PHALANX_CONFIG": str(config),
        FAULT_WEDGE_LOOP: wedge_loop,
        FAULT_WEDGE_FILE: str(root / f"wedge-{wedge_loop}"),
    }


def ping_gaps(sock: NotifySocket, start: int, end: int | None = None) -> list[float]:
    times = [t for t, m in sock.poll()[start:end] if m.get("WATCHDOG") == "1"]
    return [b - a for a, b in itertools.pairwise(times)]


def assert_pings_stopped(sock: NotifySocket, loop: str) -> None:
    """After the daemon says `loop` is wedged, two more watchdog rounds pass without a ping."""
    first = sock.wait(
        lambda m: m.get("STATUS", "").startswith(f"WEDGED: {loop} "), f"{loop} wedged"
    )
    second = sock.wait(lambda m: "WEDGED" in m.get("STATUS", ""), "a round", after=first + 1)
    third = sock.wait(lambda m: "WEDGED" in m.get("STATUS", ""), "a round", after=second + 1)
    window = [m for _, m in sock.poll()[first : third + 1]]
    assert not [m for m in window if m.get("WATCHDOG") == "1"], window


def test_controller_ready_pings_status_wedge_and_stopping(
    make_cluster: Callable[..., Cluster], notify_sockets: Callable[..., NotifySocket]
) -> None:
    c = make_cluster()
    sock = notify_sockets(abstract=True)
    env = systemd_env(sock, c.root, "scheduler")
    ctl = c.start_controller(wait=False, env=env)

    ready = sock.wait(lambda m: m.get("READY") == "1", "READY=1 from the controller")
    # READY=1 means serving: the API and the store answer at once, and nothing pinged before
    r = httpx.get(c.url + "/healthz/ready", timeout=5)
    assert r.status_code == 200, r.text
    before = [m for _, m in sock.poll()[:ready]]
    assert not [m for m in before if "WATCHDOG" in m], before
    status = sock.poll()[ready][1]["STATUS"]
    assert status.startswith(f"serving {c.url}; leases held: ") and "store ok" in status, status

    # STATUS= tells the truth: the node that registers is counted, the leases are named
    c.start_agent("node01")
    sock.wait(lambda m: "nodes up: 1/1" in m.get("STATUS", ""), "STATUS with the node up")
    terms = httpx.get(c.url + "/healthz", timeout=5).json()["leases"]
    assert terms, "the only controller holds the leases"
    latest = sock.statuses()[-1]
    for lease in terms:
        assert f"{lease}(term " in latest, (lease, latest)

    # periodic pings, about every WATCHDOG_USEC / 2 (never faster: the thread waits that long)
    start = len(sock.poll())
    sock.wait(lambda _m: len(ping_gaps(sock, start)) >= 3, "four WATCHDOG=1 pings", after=start)
    gaps = ping_gaps(sock, start)
    assert min(gaps) >= WATCHDOG_USEC / 2e6 * 0.9, gaps
    assert statistics.median(gaps) < WATCHDOG_USEC / 1e6, gaps

    # a wedged scheduler loop stops the pings; the others go on (the API still answers)
    (c.root / "wedge-scheduler").touch()
    assert_pings_stopped(sock, "scheduler")
    assert httpx.get(c.url + "/healthz", timeout=5).status_code == 200
    log = ctl.log.read_text()
    assert "scheduler has not progressed" in log and "maybe_wedge" in log, log[-3000:]

    # SIGTERM: STOPPING=1, then a clean exit
    before_stop = len(sock.poll())
    os.kill(ctl.pid, signal.SIGTERM)
    sock.wait(lambda m: m.get("STOPPING") == "1", "STOPPING=1", after=before_stop)
    assert ctl.proc is not None
    assert ctl.proc.wait(timeout=60) == 0


def test_agent_ready_only_when_registered_then_pings_status_wedge_and_stopping(
    make_cluster: Callable[..., Cluster],
    notify_sockets: Callable[..., NotifySocket],
    tmp_path: Path,
) -> None:
    c = make_cluster()
    sock = notify_sockets(abstract=False)
    env = systemd_env(sock, c.root, "watcher")
    agent = c.start_agent("node01", wait=False, env=env)

    # no controller yet: the agent says so, and is not ready
    sock.wait(lambda m: "registering" in m.get("STATUS", ""), "a 'registering' STATUS")
    wait_for(
        lambda: agent.log.read_text().count("controllers unreachable") >= 2,
        what="the agent to fail to register twice",
    )
    assert not [m for _, m in sock.poll() if "READY" in m], sock.poll()

    c.start_controller()
    ready = sock.wait(lambda m: m.get("READY") == "1", "READY=1 from the agent")
    nodes = {n["name"]: n for n in c.client().nodes()}
    assert nodes["node01"]["registered_at"] >= agent.started_wall, nodes  # registered first
    status = sock.poll()[ready][1]["STATUS"]
    assert "node node01 registered" in status and "controller reachable" in status, status

    # STATUS= counts the running job
    jid = c.submit_script(tmp_path, "sleeper", "#!/bin/sh\nsleep 600\n")
    c.wait_state(jid, "RUNNING")
    sock.wait(lambda m: "jobs running: 1;" in m.get("STATUS", ""), "STATUS with 1 job running")
    # the shepherd did not inherit systemd's variables (the agent took them out at start)
    (task,) = c.task_dirs_of(jid)
    shepherd = read_json(task / "shepherd.pid")
    assert shepherd is not None
    environ = Path(f"/proc/{shepherd['pid']}/environ").read_bytes().split(b"\0")
    assert not [v for v in environ if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))]

    start = len(sock.poll())
    sock.wait(lambda _m: len(ping_gaps(sock, start)) >= 3, "four WATCHDOG=1 pings", after=start)
    assert statistics.median(ping_gaps(sock, start)) < WATCHDOG_USEC / 1e6

    # a wedged exit watcher stops the pings
    (c.root / "wedge-watcher").touch()
    assert_pings_stopped(sock, "watcher")

    before_stop = len(sock.poll())
    os.kill(agent.pid, signal.SIGTERM)
    sock.wait(lambda m: m.get("STOPPING") == "1", "STOPPING=1", after=before_stop)
    assert agent.proc is not None
    assert agent.proc.wait(timeout=60) == 0
    assert c.shepherd_alive(task), "jobs keep running when the agent stops"
