"""Self-fencing tells a control plane that is down from one that cannot be reached.

With the default timing (fence_timeout 5 s), a job must survive its only controller being
dead for longer than the fence timeout: every controller host refuses the connection, so no
controller can requeue the job and stopping it would turn an outage into lost work. A
controller that is frozen (SIGSTOP: connections are accepted but never answered) looks like a
network partition to the agent, so there the job is stopped by its shepherd (fenced).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from system.harness import Cluster, read_json, wait_for

pytestmark = pytest.mark.system

FENCE_TIMEOUT = 5.0  # the default: this test runs with the default timing


def _start_long_job(cluster: Cluster, tmp_path: Path) -> tuple[int, Path]:
    c = cluster.client()
    res = c.submit(
        {
            "script": "#!/bin/bash\necho started\nsleep 600\necho finished\n",
            "name": "long",
            "submit_dir": str(tmp_path),
            "output": str(tmp_path / "long-%j.out"),
            "time_limit_s": 900,
        }
    )
    jid = int(res["job_id"])
    cluster.wait_state(jid, "RUNNING")
    task = wait_for(
        lambda: next((d for d in cluster.task_dirs_of(jid) if (d / "job.json").exists()), None),
        what="the job's task dir",
    )
    return jid, task


def _fence_file(cluster: Cluster) -> Path:
    return cluster.agent_dir("node01") / "heartbeat"


@pytest.mark.timeout(180)
def test_job_survives_controller_down_past_fence_timeout(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=1, cpus=2)
    jid, task = _start_long_job(cluster, tmp_path)
    ctl = cluster.controller
    ctl.kill(signal.SIGKILL)
    down_at = time.time()
    fence = _fence_file(cluster)

    # the agent keeps the fence file fresh while every controller refuses the connection: wait
    # until it has done so for twice the fence timeout (the shepherd checks about every second)
    def kept_fresh() -> bool:
        stopped = read_json(task / "exit.json")
        assert stopped is None, f"the job was stopped while the controller was down: {stopped}"
        return fence.stat().st_mtime > down_at + FENCE_TIMEOUT * 2

    wait_for(
        kept_fresh,
        what="the agent to keep the fence fresh for twice the fence timeout",
        interval=0.5,
    )
    assert not (task / "exit.json").exists(), (
        f"the job was stopped: {read_json(task / 'exit.json')}"
    )
    assert cluster.job_pid_alive(task)
    cluster.restart(ctl)
    job = cluster.wait_state(jid, "RUNNING")
    assert job["restart_count"] == 0
    cluster.client().cancel([jid])
    done = cluster.wait_terminal([jid])[jid]
    assert done["state"] == "CANCELLED"


@pytest.mark.timeout(180)
def test_job_is_fenced_when_the_controller_hangs(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=1, cpus=2)
    _jid, task = _start_long_job(cluster, tmp_path)
    ctl = cluster.controller
    os.kill(ctl.pid, signal.SIGSTOP)
    try:
        exit_record = wait_for(
            lambda: read_json(task / "exit.json"),
            what="the shepherd to fence the job",
            timeout=60,
        )
    finally:
        os.kill(ctl.pid, signal.SIGCONT)
    assert exit_record["fenced"] is True
    assert not cluster.job_pid_alive(task)
