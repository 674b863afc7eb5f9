"""torchrun's rendezvous backend, the job's side (phalanx/rendezvous.py) without torch: the
calls it makes (failover-safe ones marked idempotent; an `add` not), a blocking get that
waits for its key, dropping the participants the controllers say left, and the entry point
torchrun finds it by."""

from __future__ import annotations

import base64
import pickle
import sys
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from phalanx import rendezvous
from phalanx.errors import PhalanxError
from phalanx.rendezvous import RendezvousClient, drop_departed

REPO = Path(__file__).resolve().parents[2]


class FakeLean:
    def __init__(self, replies: list[Any]) -> None:
        self.replies = replies
        self.calls: list[tuple[str, str, Any, bool]] = []

    def request(self, method: str, path: str, body: Any, *, idempotent: bool) -> Any:
        self.calls.append((method, path, body, idempotent))
        return self.replies.pop(0)


def test_calls_and_their_retry_safety() -> None:
    lean = FakeLean(
        [
            {"state": None, "token": None, "departed": []},
            {"state": base64.b64encode(b"s").decode(), "token": 3, "set": True, "departed": []},
            {"value": 2},
            {"ok": True},
        ]
    )
    c = RendezvousClient("job:1", job="42", client=lean)  # type: ignore[arg-type]
    assert c.get_state() == (None, None, [])
    assert c.set_state(b"s", None, desc="h_1_0", node="n1") == (b"s", 3, True, [])
    assert c.kv("add", ["n"], delta=1) == {"value": 2}
    c.kv("set", ["k"], [b"\x00"])
    base = "/v1/jobs/42/rendezvous/job%3A1"
    assert [(m, p, i) for m, p, _b, i in lean.calls] == [
        ("GET", f"{base}/state", True),
        ("PUT", f"{base}/state", True),  # a compare-and-set: a repeat changes nothing
        ("POST", f"{base}/kv", False),  # an add repeated would count twice
        ("POST", f"{base}/kv", True),
    ]
    assert lean.calls[1][2] == {"state": "cw==", "token": None, "desc": "h_1_0", "node": "n1"}
    assert lean.calls[3][2]["values"] == ["AA=="]


def test_a_blocking_get_waits_for_its_key_and_gives_up_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rendezvous.time, "sleep", lambda s: None)
    lean = FakeLean([{"values": {}}, {"values": {}}, {"values": {"k": "eA=="}}])
    c = RendezvousClient("r", job="1", client=lean)  # type: ignore[arg-type]
    assert c.wait_for(["k"], timeout=60) == {"k": b"x"}
    assert len(lean.calls) == 3
    lean = FakeLean([{"values": {}}] * 1000)
    c = RendezvousClient("r", job="1", client=lean)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="'k'"):
        c.wait_for(["k"], timeout=0.0)


def test_outside_a_job_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in rendezvous.JOB_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PhalanxError, match="inside a Phalanx job"):
        RendezvousClient("r", client=FakeLean([]))  # type: ignore[arg-type]


class Node:
    """Stands for torch's _NodeDesc (its repr is addr_pid_localid)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and other.name == self.name


class State:
    """Stands for torch's _RendezvousState: the fields drop_departed reads."""

    def __init__(self) -> None:
        now = datetime.now(UTC)
        self.participants = {Node("a_1_0"): 0, Node("b_2_0"): 1}
        self.wait_list = {Node("c_3_0")}
        self.redundancy_list: set[Node] = set()
        self.last_heartbeats = {Node("a_1_0"): now, Node("c_3_0"): now}


def test_departed_participants_look_long_dead_to_torch() -> None:
    bits = pickle.dumps(State())
    assert drop_departed(bits, []) == bits
    assert drop_departed(bits, ["z_9_9"]) == bits  # none of them: unchanged
    got = pickle.loads(drop_departed(bits, ["b_2_0", "c_3_0"]))
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    # b had no keep-alive entry at all: it gets one, from long ago, as c does
    assert got.last_heartbeats[Node("b_2_0")] == epoch
    assert got.last_heartbeats[Node("c_3_0")] == epoch
    assert got.last_heartbeats[Node("a_1_0")] > epoch
    assert got.participants == {Node("a_1_0"): 0, Node("b_2_0"): 1}  # torch drops them


def test_torchrun_finds_the_backend_by_its_entry_point() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    handlers = meta["project"]["entry-points"]["torchrun.handlers"]
    assert handlers == {"phalanx": "phalanx.rendezvous:handler"}
    assert rendezvous.handler() is rendezvous.create_handler
    # importing it costs nothing of torch (torchrun imports every registered plugin)
    assert "torch" not in sys.modules


def test_small_jobs_look_at_the_state_more_often_than_torch_large_ones_as_often() -> None:
    assert rendezvous.sync_interval(2) == 0.2
    assert rendezvous.sync_interval(100) == 0.2
    assert rendezvous.sync_interval(250) == 0.5
    assert rendezvous.sync_interval(500) == 1.0 == rendezvous.sync_interval(10_000)
