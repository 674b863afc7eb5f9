"""A SIGKILLed agent leaves its jobs running; the restarted agent re-adopts them and reports exits.

The controller gets a long fence timeout here (and a node-down timeout to match) so that a slow
restart on a loaded machine tests re-adoption, not self-fencing.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, alive, wait_for

pytestmark = pytest.mark.system

TIMING = {"fence_timeout": 30.0, "node_down_timeout": 40.0}


def _start(cluster: Cluster) -> None:
    cluster.timing.update(TIMING)
    cluster.start_controller()
    cluster.start_agent("node01")


def _submit(cluster: Cluster, tmp_path: Path, body: str) -> tuple[int, Path]:
    out = tmp_path / "job.out"
    res = cluster.client().submit(
        {
            "script": "#!/bin/bash\n" + body,
            "name": "survivor",
            "submit_dir": str(tmp_path),
            "output": str(out),
            "time_limit_s": 120,
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
        }
    )
    return int(res["job_id"]), out


def _running_task(cluster: Cluster, job_id: int) -> Path:
    """Wait until the job runs and its task dir knows both the shepherd and the job process."""
    cluster.wait_state(job_id, "RUNNING")

    def task() -> Path | None:
        dirs = cluster.task_dirs_of(job_id)
        if len(dirs) == 1 and cluster.shepherd_alive(dirs[0]) and (dirs[0] / "job.json").exists():
            return dirs[0]
        return None

    return wait_for(task, what=f"the task of job {job_id} to be running")


def _one_attempt(job: dict[str, Any]) -> None:
    assert job["restart_count"] == 0
    assert len(job["attempts"]) == 1, job["attempts"]


@pytest.mark.timeout(180)
def test_job_survives_agent_sigkill(cluster: Cluster, tmp_path: Path) -> None:
    _start(cluster)
    marker = tmp_path / "marker"
    job_id, out = _submit(
        cluster, tmp_path, f"echo begin\nsleep 8\necho done > {marker}\necho end\n"
    )
    task = _running_task(cluster, job_id)
    shepherd_pid, starttime = cluster.shepherd_of(task)  # type: ignore[misc]

    agent = cluster.agent("node01")
    agent.kill(signal.SIGKILL)
    assert not alive(agent.pid)
    assert alive(shepherd_pid, starttime), "the shepherd died with the agent"
    assert cluster.job_pid_alive(task), "the job died with the agent"
    assert not marker.exists(), "the job ended before the agent was killed: make it longer"

    cluster.restart(agent)
    jobs = cluster.wait_terminal([job_id])
    job = cluster.client().job(job_id)[0]
    assert jobs[job_id]["state"] == "COMPLETED", job
    assert job["exit_code"] == 0
    _one_attempt(job)
    assert marker.read_text() == "done\n"
    assert out.read_text().splitlines() == ["begin", "end"]
    wait_for(lambda: not alive(shepherd_pid, starttime), what="the shepherd to exit")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("code", "state"), [(0, "COMPLETED"), (5, "FAILED")])
def test_exit_while_agent_down_is_reported(
    cluster: Cluster, tmp_path: Path, code: int, state: str
) -> None:
    _start(cluster)
    go = tmp_path / "go"
    # the job ends only once the test says so, i.e. surely while the agent is dead
    job_id, out = _submit(
        cluster,
        tmp_path,
        f"echo begin\nwhile [ ! -e {go} ]; do sleep 0.1; done\necho end\nexit {code}\n",
    )
    task = _running_task(cluster, job_id)
    shepherd_pid, starttime = cluster.shepherd_of(task)  # type: ignore[misc]

    agent = cluster.agent("node01")
    agent.kill(signal.SIGKILL)
    go.touch()
    exit_file = task / "exit.json"
    wait_for(exit_file.exists, what=f"{exit_file} to appear")
    wait_for(lambda: not alive(shepherd_pid, starttime), what="the shepherd to exit")
    # nobody has told the controller yet
    assert cluster.client().job(job_id)[0]["state"] == "RUNNING"

    cluster.restart(agent)
    cluster.wait_terminal([job_id])
    job = cluster.client().job(job_id)[0]
    assert job["state"] == state, job
    assert job["exit_code"] == code
    _one_attempt(job)
    assert out.read_text().splitlines() == ["begin", "end"]
