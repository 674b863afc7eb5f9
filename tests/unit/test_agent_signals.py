"""The agent delivers each requested signal (scancel --signal) once, with real shepherds.

Replies are level-triggered, so the same signal is listed again until a heartbeat reports it
done; the agent must not deliver it twice, neither within one run nor after a restart (a new
Agent over the same state dir).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from phalanx.agent import shepherd_control, shepherd_files
from phalanx.agent.agent import Agent
from phalanx.agent.agent_stops import signals_done
from phalanx.agent.resources import NodeResources
from phalanx.client import Client

TOKEN = "cd" * 8


def _agent(root: Path, client: Client) -> Agent:
    return Agent(
        name="n1",
        state_dir=root / "state",
        client=client,
        resources=NodeResources(cpus=1, mem_mb=1024),
    )


def _launch(root: Path, marker: Path, ready: Path) -> dict[str, Any]:
    body = f"trap 'echo usr1 >> {marker}' USR1; echo ok > {ready}; while true; do sleep 0.05; done"
    return {
        "attempt_id": 9,
        "token": TOKEN,
        "job_id": 1,
        "rank": 0,
        "node": "n1",
        "command": {"argv": ["/bin/bash", "-c", body]},
        "env": {"PATH": "/usr/bin:/bin"},
        "cwd": str(root),
        "stdout": str(root / "out"),
        "stderr": None,
        "open_mode": "append",
        "time_limit_s": None,
        "kill_grace_s": 1.0,
        "signal": None,
    }


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _lines(p: Path) -> int:
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_each_signal_is_delivered_once_even_across_an_agent_restart(tmp_path: Path) -> None:
    client = Client("http://127.0.0.1:9")  # never called: apply() is local
    agent = _agent(tmp_path, client)
    agent.tasks_dir.mkdir(parents=True)
    marker, ready = tmp_path / "trapped", tmp_path / "ready"
    task = agent.tasks_dir / "9"
    batch = {"attempt_id": 9, "seq": 1, "signum": 10, "target": "batch"}
    try:
        agent.apply({"start": [_launch(tmp_path, marker, ready)]})
        _wait(ready.exists, "the trap to be set")
        assert signals_done(task) == 0
        agent.apply({"signal": [batch]})
        _wait(lambda: _lines(marker) == 1, "the batch shell's trap")
        assert signals_done(task) == 1
        reported = {r["attempt_id"]: r for r in agent.snapshot()}
        assert reported[9]["signals_done"] == 1
        # the same reply again (level-triggered), then from a restarted agent: nothing new
        agent.apply({"signal": [batch]})
        again = _agent(tmp_path, client)
        again.apply({"signal": [batch]})
        # a "steps" signal: a job without steps gets nothing, but the seq is done
        steps = {"attempt_id": 9, "seq": 2, "signum": 10, "target": "steps"}
        again.apply({"signal": [batch, steps]})
        assert signals_done(task) == 2
        # "full": the whole process group, the batch shell included
        full = {"attempt_id": 9, "seq": 3, "signum": 10, "target": "full"}
        again.apply({"signal": [full]})
        _wait(lambda: _lines(marker) == 2, "the full signal")
        time.sleep(0.5)  # time for a wrongly repeated delivery to show
        assert _lines(marker) == 2, marker.read_text()
        assert signals_done(task) == 3
    finally:
        shepherd_control.request_stop(task, reason="test over")
        _wait(lambda: (task / shepherd_files.EXIT_FILE).exists(), "the job to stop")
        client.close()


def test_a_signal_for_a_job_that_has_exited_is_done_without_delivery(tmp_path: Path) -> None:
    client = Client("http://127.0.0.1:9")
    agent = _agent(tmp_path, client)
    agent.tasks_dir.mkdir(parents=True)
    task = agent.tasks_dir / "9"
    item = _launch(tmp_path, tmp_path / "m", tmp_path / "r")
    item["command"] = {"argv": ["/bin/true"]}
    try:
        agent.apply({"start": [item]})
        _wait(lambda: (task / shepherd_files.EXIT_FILE).exists(), "the job to exit")
        agent.apply({"signal": [{"attempt_id": 9, "seq": 1, "signum": 10, "target": "batch"}]})
        assert signals_done(task) == 1
        # and one for an attempt this node does not have is ignored
        agent.apply({"signal": [{"attempt_id": 77, "seq": 1, "signum": 10, "target": "full"}]})
        assert not (agent.tasks_dir / "77").exists()
    finally:
        client.close()
