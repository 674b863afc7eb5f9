"""srun's hand-over of a step's launches to the agents (slurm/srun/push.py), against real
sockets: the nodes whose agents did not take theirs come back, so srun can have their
long-polls woken instead."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from phalanx.slurm.srun import push as step_push


class Answering:
    """A listening socket that reads one line per connection and answers `reply` (None: reads
    and never answers)."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.got: list[bytes] = []
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn.makefile("rb") as lines:
                self.got.append(lines.readline())
            if self.reply is None:
                self.held.append(conn)  # never answered, kept open
                continue
            conn.sendall(self.reply)
            conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def servers() -> Iterator[dict[str, Answering]]:
    made = {
        "ok": Answering(b"ok\n"),
        "wait": Answering(b"wait\n"),
        "refused": Answering(b"refused bad signature\n"),
        "silent": Answering(None),
    }
    yield made
    for s in made.values():
        s.close()


def closed_port() -> int:
    s = socket.create_server(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def launch(node: str, at: str) -> dict[str, object]:
    return {
        "node": node,
        "at": at,
        "item": {"node": node, "env": {"X": "y" * 100_000}},
        "kid": "k:node:" + node,
        "sig": "s",
    }


def test_the_nodes_that_did_not_take_their_launch_come_back(
    servers: dict[str, Answering],
) -> None:
    launches = [launch(name, f"127.0.0.1:{srv.port}") for name, srv in servers.items()]
    launches += [launch("closed", f"127.0.0.1:{closed_port()}"), launch("garbled", "no-port")]
    t0 = time.monotonic()
    failed = step_push.hand_over(launches, timeout=1.0)
    took = time.monotonic() - t0
    assert sorted(failed) == ["closed", "garbled", "refused", "silent"]
    assert took < 10.0  # bounded by the timeout (generous: a busy machine)
    # each agent got exactly its credential, whole (a large environment included), one line
    for name in ("ok", "wait", "refused"):
        (line,) = servers[name].got
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line) == {k: launch(name, "")[k] for k in ("item", "kid", "sig")}


def test_ipv6_and_bracketed_addresses_parse() -> None:
    assert step_push.split_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert step_push.split_address("[::1]:7000") == ("::1", 7000)
    for bad in ("host", "host:", ":7000", "host:x"):
        with pytest.raises(ValueError):
            step_push.split_address(bad)


def test_nothing_to_hand_over() -> None:
    assert step_push.hand_over([], timeout=1.0) == []
