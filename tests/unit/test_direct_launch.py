"""An agent taking a directly handed-over step (agent/step_listener.py) over real TCP.

Only a launch its controller signed for this node starts anything; a step whose job has not
started here yet is answered ``wait`` (the node's heartbeat brings it later); a launch taken
twice starts once.  Starting the shepherd is replaced by a recorder: the system tests
(tests/system/test_steps.py) run the real ones.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.agent.agent import Agent
from phalanx.agent.resources import NodeResources
from phalanx.auth import launchcred
from phalanx.auth.keys import KeySet, derive, new_key
from phalanx.client import Client

CLUSTER = new_key("k1")
OTHER_CLUSTER = new_key("k1")  # same kid, another secret: a forger's key


def item(step_id: int = 0, attempt_id: int = 5) -> dict[str, object]:
    return {
        "attempt_id": attempt_id,
        "step_id": step_id,
        "token": "tok",
        "job_id": 9,
        "node": "node01",
        "argv": ["/bin/true"],
        "env": {},
        "cwd": "/",
        "io": {"host": "127.0.0.1", "port": 9, "cookie": "c" * 32},
        "tasks": [{"task_id": 0, "local_id": 0, "env": {}, "stdout": None, "stderr": None}],
        "time_limit_s": None,
        "signal": None,
        "kill_grace_s": 1.0,
        "user": "root",
    }


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(
        name="node01",
        state_dir=tmp_path / "state",
        client=Client("http://127.0.0.1:9"),  # never called
        resources=NodeResources(cpus=1, mem_mb=1024),
        launch_keys=KeySet([derive(CLUSTER, "node", "node01")]),
        steps_listen=("127.0.0.1", 0),
    )
    a.tasks_dir.mkdir(parents=True)
    a.launched = []  # type: ignore[attr-defined]
    a.steps._launch_dir = a.launched.append  # type: ignore[attr-defined]
    a._start_step_listener()
    assert a.steps_at is not None and a.steps_at.startswith("127.0.0.1:")
    yield a
    assert a._step_listener is not None
    a._step_listener.close()


def job_started_here(a: Agent, attempt_id: int = 5) -> None:
    d = a.tasks_dir / str(attempt_id)
    d.mkdir()
    (d / "spec.json").write_text(json.dumps({"cpus": [0]}))
    (d / "job.json").write_text(json.dumps({"pid": 1}))


def send(a: Agent, payload: bytes) -> str:
    host, _, port = (a.steps_at or "").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        with s.makefile("rb") as lines:
            return lines.readline().decode().strip()


def cred_line(cluster_key: object = CLUSTER, **kw: object) -> bytes:
    key = derive(cluster_key, "node", "node01")  # type: ignore[arg-type]
    cred = launchcred.sign(key, {**item(), **kw}, now=time.time(), ttl=60)
    return json.dumps(cred).encode() + b"\n"


def test_a_signed_launch_starts_the_step_once(agent: Agent) -> None:
    job_started_here(agent)
    assert send(agent, cred_line()) == "ok"
    assert [d.name for d in agent.launched] == ["5.0.0"]  # type: ignore[attr-defined]
    spec = json.loads((agent.steps.steps_dir / "5.0.0" / "spec.json").read_text())
    assert spec["argv"] == ["/bin/true"] and spec["step_id"] == 0
    assert send(agent, cred_line()) == "ok"  # again (a replay, or the heartbeat's copy)
    assert len(agent.launched) == 1  # type: ignore[attr-defined]
    # not held for the poller: no heartbeat answered it
    assert agent.steps.take_launched() == []


def test_a_step_before_its_job_waits_for_the_heartbeat(agent: Agent) -> None:
    assert send(agent, cred_line()) == "wait"
    assert agent.launched == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"not json\n", "not JSON"),
        (b'{"item": {}}\n', "needs item, kid and sig"),
        (None, "bad signature"),  # a forger's key with the right kid
    ],
)
def test_what_the_controller_did_not_sign_is_refused(
    agent: Agent, payload: bytes | None, reason: str
) -> None:
    job_started_here(agent)
    answer = send(agent, payload or cred_line(OTHER_CLUSTER))
    assert answer.startswith("refused") and reason in answer
    assert agent.launched == []  # type: ignore[attr-defined]
    assert not agent.steps.steps_dir.exists() or not list(agent.steps.steps_dir.iterdir())
