"""The agent applies controller replies exactly once per attempt, with real shepherds.

The main heartbeat loop and the exit watcher both talk to the controller, so a reply computed
before an attempt ended (still saying "start") can arrive after the reply that said "forget"
and removed its task dir. Found by the 100-task array system test, where a fast task ran twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from phalanx.agent.agent import Agent
from phalanx.agent.resources import NodeResources
from phalanx.client import Client


def launch_item(root: Path, attempt_id: int, marker: Path) -> dict[str, Any]:
    return {
        "attempt_id": attempt_id,
        "token": "ab" * 8,
        "job_id": 1,
        "rank": 0,
        "node": "n1",
        "command": {"argv": ["/bin/sh", "-c", f"echo run >> {marker}"]},
        "env": {"PATH": "/usr/bin:/bin"},
        "cwd": str(root),
        "stdout": str(root / "out"),
        "stderr": None,
        "open_mode": "append",
        "time_limit_s": None,
        "kill_grace_s": 1.0,
        "signal": None,
    }


def test_a_stale_start_after_forget_does_not_run_the_job_again(tmp_path: Path) -> None:
    client = Client("http://127.0.0.1:9")  # never called: apply() is local
    agent = Agent(
        name="n1",
        state_dir=tmp_path / "state",
        client=client,
        resources=NodeResources(cpus=1, mem_mb=1024),
    )
    agent.tasks_dir.mkdir(parents=True)
    marker = tmp_path / "runs"
    start = launch_item(tmp_path, 7, marker)
    try:
        agent.apply({"start": [start]})
        exit_file = agent.tasks_dir / "7" / "exit.json"
        deadline = time.monotonic() + 30
        while not exit_file.exists():
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.02)
        agent.apply({"start": [start]})  # a repeated reply while the dir exists: nothing
        agent.apply({"forget": [7]})
        assert not (agent.tasks_dir / "7").exists()
        agent.apply({"start": [start]})  # the stale reply, after the forget
        assert not (agent.tasks_dir / "7").exists(), "the attempt was launched again"
        assert marker.read_text() == "run\n"
    finally:
        client.close()


def test_a_reply_that_only_repeats_a_stop_is_not_news(tmp_path: Path) -> None:
    """In a planned stop's grace the controller repeats the stop in every reply (level-
    triggered) and answers the long-poll at once; the agent marks such a reply
    `repeats_only` so its poller waits out the interval instead of spinning."""
    import signal as _signal

    from phalanx.agent import shepherd_control

    client = Client("http://127.0.0.1:9")  # never called: apply() is local
    agent = Agent(
        name="n1",
        state_dir=tmp_path / "state",
        client=client,
        resources=NodeResources(cpus=1, mem_mb=1024),
    )
    agent.tasks_dir.mkdir(parents=True)
    start = launch_item(tmp_path, 8, tmp_path / "runs")
    start["command"] = {"argv": ["/bin/sh", "-c", "trap 'exit 0' USR1; sleep 60 & wait"]}
    stop = {
        "attempt_id": 8,
        "token": "ab" * 8,
        "reason": "requeue: drained",
        "checkpoint_signal": int(_signal.SIGUSR1),
        "checkpoint_grace": 30.0,
    }
    d = agent.tasks_dir / "8"
    try:
        agent.apply({"start": [start]})
        assert agent.repeats_only is False
        deadline = time.monotonic() + 30
        while shepherd_control.read_status(d)["state"] != "running":
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.02)
        agent.apply({"stop": [stop]})
        assert agent.repeats_only is False  # a new stop: acted on
        agent.apply({"stop": [stop]})
        assert agent.repeats_only is True  # the same stop again: nothing new
        agent.apply({"stop": [stop], "start": [launch_item(tmp_path, 9, tmp_path / "r9")]})
        assert agent.repeats_only is False
        deadline = time.monotonic() + 30
        while shepherd_control.read_status(d)["state"] != "exited":
            assert time.monotonic() < deadline, "the job did not stop"
            time.sleep(0.02)
        # A long-poll woken by the attempt's end answers from the report it was sent with
        # (still running): a stop for an attempt the agent has meanwhile forgotten. Not a
        # repeat: waiting out the interval would leave no long-poll parked for the node's
        # next start (the slow mode of bench/submit.py's submit-to-start latency).
        agent.apply({"forget": [8]})
        agent.apply({"stop": [stop]})
        assert agent.repeats_only is False
        assert not d.exists()  # and the stop did not bring the forgotten attempt back
    finally:
        for aid in ("8", "9"):
            shepherd_control.request_stop(agent.tasks_dir / aid)
        client.close()
