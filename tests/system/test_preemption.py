"""Preemption end to end (docs/preemption.md): real controller, agents, shepherds and jobs.

* a checkpointing job of the low tier is preempted by a high-tier job: it gets its checkpoint
  request (kind ``preempted``), saves, is requeued without spending a retry, waits while the
  high job runs on its node, and resumes from its checkpoint with no step computed twice;
* a gang (two-node) job is preempted whole for a one-node job, and its grace ends as soon as
  it reports its checkpoint (not after the long grace it asked for);
* preempt mode cancel (on a QOS) ends the victim CANCELLED "preempted by job N", which sacct
  shows as PREEMPTED.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, run_cli, wait_for
from system.test_checkpoint import (
    PATH_ENV,
    output,
    redone,
    reference_digest,
    steps_done,
    train_script,
)
from system.test_slurm_acct import slurm

pytestmark = pytest.mark.system

CONFIG = """
[[cluster.partitions]]
name = "low"
default = true
nodes = "*"

[[cluster.partitions]]
name = "high"
nodes = "*"
priority_tier = 1

[[fairshare.qos]]
name = "scavenger"
preempt_mode = "cancel"
"""

FAST = {"heartbeat_interval": 0.5}


def configured(cluster: Cluster, tmp_path: Path) -> Cluster:
    config = tmp_path / "phalanx.toml"
    config.write_text(CONFIG)
    cluster.extra_env["PHALANX_CONFIG"] = str(config)
    cluster.timing.update(FAST)
    return cluster


def events(cluster: Cluster, jid: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in cluster.client().job_events(jid) if e["kind"] == kind]


def submit_high(cluster: Cluster, tmp_path: Path, cpus: int = 2) -> int:
    return cluster.submit_script(
        tmp_path,
        "urgent",
        "#!/bin/bash\nsleep 2\necho urgent done\n",
        partition="high",
        cpus_per_task=cpus,
    )


@pytest.mark.timeout(300)
def test_preempted_checkpointing_job_resumes_with_nothing_redone_and_no_retry(
    cluster: Cluster, tmp_path: Path
) -> None:
    steps = 240
    expected = reference_digest(tmp_path, steps)
    configured(cluster, tmp_path).start_controller()
    cluster.start_agent("node01", cpus=2)
    low = cluster.submit_script(
        tmp_path,
        "train",
        train_script(steps, 1000, tmp_path / "steps.log"),  # saves only when asked
        requeue=True,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_grace_s=60,
        cpus_per_task=2,
        env=dict(PATH_ENV),
    )
    cluster.wait_state(low, "RUNNING")
    log = tmp_path / "steps.log"
    wait_for(lambda: steps_done(log) >= 30, what="the low job to do 30 steps")

    high = submit_high(cluster, tmp_path)
    done = cluster.wait_terminal([high], timeout=120)[high]
    assert done["state"] == "COMPLETED", done
    final = cluster.wait_terminal([low], timeout=180)[low]
    job = cluster.client().job(low)[0]
    assert final["state"] == "COMPLETED", job
    assert job["retries"] == 0, job  # a preemption is a planned stop: no retry spent
    assert len(job["attempts"]) == 2, job["attempts"]

    lines = output(tmp_path, low)
    ck = [x for x in lines if x.startswith("checkpoint step=")]
    assert len(ck) == 1, lines
    assert f"reason=requeue: preempted by job {high}" in ck[0] and "kind=preempted" in ck[0]
    k = int(ck[0].split()[1].removeprefix("step="))
    assert f"start restart=1 node=node01 step={k}" in lines, lines
    assert lines[-1] == f"done restart=1 step={steps} digest={expected}", lines
    assert redone(log) == 0, f"steps computed twice: {redone(log)}"

    # the high job ran while the low one waited: after the low one's first attempt, before its
    # second
    first, second = job["attempts"]
    h = cluster.client().job(high)[0]
    assert first["end_time"] <= h["start_time"] <= second["start_time"], (first, h, second)

    # explained: the victim's events say by whom, the preemptor's whom
    (pre,) = events(cluster, low, "job.preempted")
    assert pre["data"]["by"] == high and f"preempted by job {high}" in pre["message"]
    (ing,) = events(cluster, high, "job.preempting")
    assert ing["data"]["victims"] == [low]
    requeue = events(cluster, low, "job.requeue")
    assert requeue and requeue[0]["data"]["why"] == "planned", requeue


GANG = """#!/bin/bash
# checkpoint on the signal and keep running: the grace must end when the marker says so
trap 'echo "$PHX_CHECKPOINT_DIR/state" > "$PHX_CHECKPOINT_MARKER"; echo saved' USR1
echo "start restart=$PHX_RESTART_COUNT"
for i in $(seq 1 600); do sleep 0.2; done
"""


@pytest.mark.timeout(300)
def test_gang_job_is_preempted_whole_and_its_grace_ends_at_its_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    configured(cluster, tmp_path).start_controller()
    cluster.start_agent("node01", cpus=2)
    cluster.start_agent("node02", cpus=2)
    gang = cluster.submit_script(
        tmp_path,
        "gang",
        GANG,
        nodes=2,
        cpus_per_task=2,
        requeue=True,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_grace_s=240,  # far longer than the test waits: the marker must end it
        time_limit_s=900,
    )
    cluster.wait_state(gang, "RUNNING")
    wait_for(
        lambda: (
            (tmp_path / f"gang-{gang}.out").exists()
            and "start restart=0" in (tmp_path / f"gang-{gang}.out").read_text()
        ),
        what="the gang job to start its script",
    )
    asked = time.time()
    high = submit_high(cluster, tmp_path)  # one node of two
    h = cluster.wait_state(high, "RUNNING", timeout=120)
    assert h["start_time"] - asked < 120, "the victim's grace did not end at its checkpoint"
    job = cluster.client().job(gang)[0]
    first = job["attempts"][0]
    assert sorted(first["nodes"]) == ["node01", "node02"], first
    # gang-atomic: the whole attempt ended, on both nodes, not just the one the job needed
    assert first["state"] == "ENDED", first
    tasks = [t for t in first["tasks"] if t.get("rank", 0) >= 0]
    assert sorted(t["node"] for t in tasks) == ["node01", "node02"], first
    assert all(t["state"] == "EXITED" for t in tasks), first
    (pre,) = events(cluster, gang, "job.preempted")
    assert pre["data"]["by"] == high
    assert "saved" in (tmp_path / f"gang-{gang}.out").read_text()

    done = cluster.wait_terminal([high], timeout=120)[high]
    assert done["state"] == "COMPLETED"
    # the gang job comes back on both nodes once the high job left; no retry spent
    cluster.wait_state(gang, "RUNNING", timeout=120)
    job = cluster.client().job(gang)[0]
    assert len(job["attempts"]) == 2 and sorted(job["attempts"][1]["nodes"]) == [
        "node01",
        "node02",
    ], job["attempts"]
    assert job["retries"] == 0, job
    cluster.client().cancel([gang])
    cluster.wait_terminal([gang], timeout=120)


@pytest.mark.timeout(240)
def test_preempt_mode_cancel_ends_the_victim_preempted(cluster: Cluster, tmp_path: Path) -> None:
    configured(cluster, tmp_path).start_controller()
    cluster.start_agent("node01", cpus=2)
    low = cluster.submit_script(
        tmp_path,
        "scav",
        # ignores its checkpoint signal: it is stopped when its grace is over
        "#!/bin/bash\ntrap 'echo asked' USR1\nfor i in $(seq 1 1500); do sleep 0.2; done\n",
        qos="scavenger",
        cpus_per_task=2,
        checkpoint_grace_s=20,
    )
    cluster.wait_state(low, "RUNNING")
    high = submit_high(cluster, tmp_path)

    # while the victim has its grace, `phalanx explain` says what the high job waits for
    def explained() -> str | None:
        res = run_cli(["explain", str(high)], url=cluster.url, root=cluster.root)
        return res.stdout if "Preempting" in res.stdout else None

    text = wait_for(explained, timeout=60, what="the high job's explanation to name its victim")
    assert f"waits for job {low} to checkpoint" in text and f"preempting job {low}" in text, text
    done = cluster.wait_terminal([low], timeout=120)[low]
    assert done["state"] == "CANCELLED", done
    assert done["reason"].startswith(f"preempted by job {high}"), done
    assert cluster.wait_terminal([high], timeout=120)[high]["state"] == "COMPLETED"
    res = slurm(cluster, "sacct", "-j", str(low), "-X", "-n", "-o", "JobID,State", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split()[:2] == [str(low), "PREEMPTED"], res.stdout
    res = run_cli(["explain", str(low)], url=cluster.url, root=cluster.root)
    assert f"job.preempted: preempted by job {high}" in res.stdout, res.stdout
