"""`phalanx drain NODE --now`: checkpoint, requeue and resume elsewhere, with the same result.

The job is a deterministic stand-in for a training run: a running value updated once per step.
It checkpoints ``{step, value}`` when it gets its checkpoint signal (``--signal USR1@5``, so the
grace before SIGTERM is 5 s) and exits 0; on start it resumes from its checkpoint. A drain
``--now`` must give it the signal, requeue it, and let it finish on another node with exactly the
value an uninterrupted run computes. A job that cannot be requeued keeps running on the drained
node until it ends.
"""

from __future__ import annotations

import getpass
import json
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, run_cli, wait_for

pytestmark = pytest.mark.system

FAST = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
}
PATH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
STEPS = 80  # 0.1 s each: 8 s uninterrupted
DRAIN_AFTER = 15  # steps done before the drain

TRAIN = """#!{python}
import json, os, signal, sys, time

STEPS = {steps}
ckdir = os.environ.get("PHX_CHECKPOINT_DIR") or os.path.join(
    os.environ["SLURM_SUBMIT_DIR"], "ckpt-" + os.environ["SLURM_JOB_ID"]
)
os.makedirs(ckdir, exist_ok=True)
ckpt = os.path.join(ckdir, "state.json")
run = int(os.environ["SLURM_RESTART_COUNT"])
stop = False


def on_usr1(signum, frame):
    global stop
    stop = True


signal.signal(signal.SIGUSR1, on_usr1)


def save(step, value):
    tmp = ckpt + ".tmp"
    with open(tmp, "w") as f:
        json.dump({{"step": step, "value": value}}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt)


def update(step, value):
    return (value * 31 + step * step + 7) % 1_000_000_007


step, value = 0, 1
if os.path.exists(ckpt):
    with open(ckpt) as f:
        state = json.load(f)
    step, value = state["step"], state["value"]
print(f"run {{run}} on {{os.environ['SLURMD_NODENAME']}} starts at step {{step}}", flush=True)
while step < STEPS:
    time.sleep(0.1)
    value = update(step, value)
    step += 1
    with open(os.path.join(ckdir, "progress.tmp"), "w") as f:
        f.write(f"{{run}} {{step}}")
    os.replace(os.path.join(ckdir, "progress.tmp"), os.path.join(ckdir, "progress"))
    if stop:
        save(step, value)
        print(f"run {{run}} checkpointed at step {{step}}", flush=True)
        sys.exit(0)
save(step, value)
print(f"run {{run}} finished: value {{value}}", flush=True)
"""


def uninterrupted_value(steps: int) -> int:
    value = 1
    for step in range(steps):
        value = (value * 31 + step * step + 7) % 1_000_000_007
    return value


@pytest.mark.timeout(180)
def test_drain_now_checkpoints_requeues_and_resumes(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    cluster.start_agent("node01", cpus=4)
    c = cluster.client()
    ckdir = tmp_path / "ckpt"
    train = int(
        c.submit(
            {
                "script": TRAIN.format(python=sys.executable, steps=STEPS),
                "name": "train",
                "submit_dir": str(tmp_path),
                "output": str(tmp_path / "train-%j.out"),
                "time_limit_s": 600,
                "requeue": True,
                "signal": "USR1@5",
                "checkpoint_dir": str(ckdir),
                "env": dict(PATH_ENV),
            }
        )["job_id"]
    )
    go = tmp_path / "go"
    keep = int(
        c.submit(
            {
                "script": (
                    "#!/bin/bash\n"
                    'echo "start on $SLURMD_NODENAME"\n'
                    f"while [ ! -e {go} ]; do sleep 0.2; done\n"
                    'echo "end on $SLURMD_NODENAME"\n'
                ),
                "name": "keep",
                "submit_dir": str(tmp_path),
                "output": str(tmp_path / "keep-%j.out"),
                "time_limit_s": 600,
                "requeue": False,
                "env": dict(PATH_ENV),
            }
        )["job_id"]
    )
    for jid in (train, keep):
        assert cluster.wait_state(jid, "RUNNING")["nodelist"] == "node01"
    cluster.start_agent("node02", cpus=4)

    def progress() -> tuple[int, int] | None:
        run, step = (ckdir / "progress").read_text().split()
        return int(run), int(step)

    wait_for(
        lambda: (p := progress()) is not None and p[1] >= DRAIN_AFTER,
        what=f"the job to do {DRAIN_AFTER} steps",
    )
    res = run_cli(["drain", "node01", "--reason", "x", "--now"], url=cluster.url, root=cluster.root)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"requeueing jobs: {train}" in res.stdout, res.stdout
    node = c.node("node01")
    assert node["drain"] and node["drain_by"] == getpass.getuser(), node
    assert node["drain_reason"] == "x", node

    # the job checkpoints, is requeued, resumes on node02 from its checkpoint, and finishes
    done = cluster.wait_terminal([train])[train]
    job = c.job(train)[0]
    assert done["state"] == "COMPLETED", job
    assert job["restart_count"] == 1, job
    assert [a["nodes"] for a in job["attempts"]] == [["node01"], ["node02"]], job["attempts"]
    assert job["attempts"][0]["exit_code"] == 0, job["attempts"][0]
    assert "job.requeue" in [e["kind"] for e in c.job_events(train)]
    lines = (tmp_path / f"train-{train}.out").read_text().splitlines()
    assert len(lines) == 4, lines
    assert lines[0] == "run 0 on node01 starts at step 0", lines
    k = int(lines[1].removeprefix("run 0 checkpointed at step "))
    assert DRAIN_AFTER <= k < STEPS, lines
    assert lines[2] == f"run 1 on node02 starts at step {k}", lines
    expected = uninterrupted_value(STEPS)
    assert lines[3] == f"run 1 finished: value {expected}", lines
    assert json.loads((ckdir / "state.json").read_text()) == {"step": STEPS, "value": expected}

    # the job that cannot be requeued still runs on the drained node, then ends normally
    kept = c.job(keep)[0]
    assert kept["state"] == "RUNNING" and kept["nodelist"] == "node01", kept
    assert c.node("node01")["state"] == "DRAINING"
    go.touch()
    kept = cluster.wait_terminal([keep])[keep]
    assert kept["state"] == "COMPLETED" and kept["restart_count"] == 0, c.job(keep)[0]
    assert len(c.job(keep)[0]["attempts"]) == 1
    out = (tmp_path / f"keep-{keep}.out").read_text().splitlines()
    assert out == ["start on node01", "end on node01"], out

    node = wait_for(
        lambda: (n := c.node("node01"))["state"] == "DRAINED" and n,
        what="node01 to be DRAINED",
    )
    assert node["drain_by"] == getpass.getuser() and node["drain_reason"] == "x", node
