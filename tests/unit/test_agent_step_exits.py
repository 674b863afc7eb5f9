"""Who reports a step task's exit: the poller, on its next heartbeat, for the step tasks the
last reply started and that end within a short wait; the watcher for every other exit.

A trivial step (`srun true`) ends a few milliseconds after its launch; reported by the watcher,
its exit costs the controllers one more exchange per node and step (docs/slurm.md, "srun's
helper"). The watcher must still report at once whatever the poller did not take along.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from phalanx.agent import agent as agent_mod
from phalanx.agent.agent import Agent
from phalanx.agent.resources import NodeResources
from phalanx.client import Client


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    a = Agent(
        name="n1",
        state_dir=tmp_path / "state",
        client=Client("http://127.0.0.1:9"),  # never called: heartbeat() is replaced below
        resources=NodeResources(cpus=1, mem_mb=1024),
    )
    a.tasks_dir.mkdir(parents=True)
    a.steps.steps_dir.mkdir(parents=True)
    return a


def _step_dir(a: Agent, name: str) -> Path:
    d = a.steps.steps_dir / name
    d.mkdir()
    return d


def _exit_later(d: Path, after: float) -> threading.Thread:
    def write() -> None:
        time.sleep(after)
        (d / "exit.json").write_text('{"exit_code": 0}')

    t = threading.Thread(target=write)
    t.start()
    return t


def _watch(a: Agent, calls: list[float]) -> threading.Thread:
    a._registered = True
    a.heartbeat = lambda wait=0.0: calls.append(time.monotonic()) or {}  # type: ignore[method-assign]
    t = threading.Thread(target=a._watch, daemon=True)
    t.start()
    return t


def test_the_poller_takes_along_a_short_step_tasks_exit(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exit of a step task that ends within the wait is the poller's to report: the wait
    ends once it has appeared, and the watcher never sends an exchange of its own for it (the
    poller looks late here, so that the watcher sees the exit file first)."""
    monkeypatch.setattr(agent_mod, "STEP_EXIT_WAIT_S", 1.0)
    monkeypatch.setattr(agent_mod, "STEP_EXIT_POLL_S", 3 * agent_mod.WATCH_INTERVAL)
    d = _step_dir(agent, "5.0.0")
    agent.steps._launched = [d.name]
    calls: list[float] = []
    watcher = _watch(agent, calls)
    try:
        writer = _exit_later(d, 0.005)
        t0 = time.monotonic()
        agent._hold_step_exits()
        waited = time.monotonic() - t0
        writer.join()
        assert (d / "exit.json").exists()
        assert waited < 1.0
        assert "step:5.0.0" in agent._known_exited
        time.sleep(4 * agent_mod.WATCH_INTERVAL)  # the watcher looks a few times
        assert calls == [], "the watcher reported an exit the poller takes along"
    finally:
        agent._stop.set()
        watcher.join(5)


def test_the_watcher_reports_what_outlives_the_wait(agent: Agent) -> None:
    """A step task still running when the wait is over is the watcher's again: its exit is
    reported as soon as it happens, without waiting for the poller's long-poll."""
    d = _step_dir(agent, "5.1.0")
    agent.steps._launched = [d.name]
    calls: list[float] = []
    watcher = _watch(agent, calls)
    try:
        agent._hold_step_exits()  # nothing ends: the whole wait
        assert "step:5.1.0" not in agent._known_exited and not agent._held_steps
        ended = time.monotonic()
        (d / "exit.json").write_text('{"exit_code": 0}')
        deadline = ended + 10
        while not calls:
            assert time.monotonic() < deadline, "the watcher never reported the exit"
            time.sleep(0.01)
        assert "step:5.1.0" in agent._known_exited
    finally:
        agent._stop.set()
        watcher.join(5)


def test_no_wait_without_fresh_step_tasks(agent: Agent) -> None:
    t0 = time.monotonic()
    agent._hold_step_exits()
    assert time.monotonic() - t0 < agent_mod.STEP_EXIT_WAIT_S


def test_step_ends_wait_for_the_report_delay_job_ends_do_not(agent: Agent) -> None:
    """Right after a heartbeat, a step task's end waits until `step_report_delay` has passed
    since it (one exchange for a burst of short steps); a job task's end goes at once and
    takes the waiting step ends along."""
    agent.step_report_delay = 3600.0  # never over during this test
    agent._snapshot_at = time.monotonic()
    calls: list[float] = []
    watcher = _watch(agent, calls)
    try:
        d = _step_dir(agent, "6.0.0")
        (d / "exit.json").write_text('{"exit_code": 0}')
        time.sleep(6 * agent_mod.WATCH_INTERVAL)  # the watcher looks several times
        assert calls == [], "a step end was reported within the delay"
        job = agent.tasks_dir / "6"
        job.mkdir()
        (job / "exit.json").write_text('{"exit_code": 0}')
        deadline = time.monotonic() + 10
        while not calls:
            assert time.monotonic() < deadline, "the job task's end was never reported"
            time.sleep(0.01)
        assert {"6", "step:6.0.0"} <= agent._known_exited
    finally:
        agent._stop.set()
        watcher.join(5)


def test_a_step_end_goes_once_the_delay_is_over(agent: Agent) -> None:
    agent.step_report_delay = 0.3
    calls: list[float] = []
    watcher = _watch(agent, calls)
    try:
        t0 = agent._snapshot_at = time.monotonic()
        d = _step_dir(agent, "7.0.0")
        (d / "exit.json").write_text('{"exit_code": 0}')
        deadline = time.monotonic() + 10
        while not calls:
            assert time.monotonic() < deadline, "the step end was never reported"
            time.sleep(0.01)
        assert calls[0] - t0 >= 0.3, "reported before the delay was over"
        assert "step:7.0.0" in agent._known_exited
    finally:
        agent._stop.set()
        watcher.join(5)
