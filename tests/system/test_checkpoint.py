"""The checkpoint protocol end to end, with the deterministic training example.

`examples/train_pure.py` fits a linear model with SGD whose every minibatch depends only on
(seed, step), and checkpoints its exact state with the job-side helper (`phalanx.job`). Each
test checks that what the scheduler does around checkpoints keeps the final weights identical
to an uninterrupted run's, and that little work is lost:

* a drain `--now` (planned): the job gets its checkpoint request (file and signal), checkpoints
  at once, is requeued and resumes on the other node from exactly that step: nothing redone;
* a dead node (unplanned: agent, shepherd and job SIGKILLed): the job resumes from its last
  periodic checkpoint on the other node, redoing at most one checkpoint interval of steps;
* `--checkpoint-interval`: the scheduler asks for checkpoints on its own, the store records
  each one (`job.checkpoint` events) and `phalanx show` shows the latest and the interval;
* the time limit: the job gets its request a grace before the limit, checkpoints, and ends
  TIMEOUT.

Steps are counted from the job's step log ("RESTART STEP" per finished step).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, read_json, run_cli, wait_for

pytestmark = pytest.mark.system

FAST = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_pure.py"
PATH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
STEP_TIME = 0.05


def train_script(steps: int, every: int, step_log: Path) -> str:
    return (
        "#!/bin/bash\n"
        f"exec {sys.executable} {EXAMPLE} --steps {steps} --step-time {STEP_TIME} "
        f"--checkpoint-every {every} --step-log {step_log}\n"
    )


def reference_digest(tmp_path: Path, steps: int) -> str:
    """The result of an uninterrupted run (no sleeps, so it takes a fraction of a second)."""
    ref = tmp_path / "reference"
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--steps",
            str(steps),
            "--step-time",
            "0",
            "--checkpoint-dir",
            str(ref),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, **PATH_ENV},
        timeout=120,
    )
    digest = (read_json(ref / "result.json") or {}).get("digest")
    assert isinstance(digest, str), "the reference run wrote no result"
    return digest


def step_log(path: Path) -> list[tuple[int, int]]:
    """(restart, step) per finished step, in order."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        restart, step = line.split()
        out.append((int(restart), int(step)))
    return out


def steps_done(path: Path) -> int:
    return max((s for _, s in step_log(path)), default=0)


def redone(path: Path) -> int:
    """Steps that were computed more than once (the work lost to interruptions)."""
    counts = Counter(s for _, s in step_log(path))
    return sum(n - 1 for n in counts.values())


def checkpoint_events(cluster: Cluster, jid: int) -> list[dict[str, Any]]:
    return [e for e in cluster.client().job_events(jid) if e["kind"] == "job.checkpoint"]


def submit_train(cluster: Cluster, tmp_path: Path, steps: int, every: int, **extra: Any) -> int:
    return cluster.submit_script(
        tmp_path,
        "train",
        train_script(steps, every, tmp_path / "steps.log"),
        requeue=True,
        checkpoint_dir=str(tmp_path / "ckpt"),
        env=dict(PATH_ENV),
        **extra,
    )


def output(tmp_path: Path, jid: int) -> list[str]:
    return (tmp_path / f"train-{jid}.out").read_text().splitlines()


# ---------------------------------------------------------------------- planned: drain --now
@pytest.mark.timeout(240)
def test_drain_now_checkpoints_on_request_and_resumes_without_lost_work(
    cluster: Cluster, tmp_path: Path
) -> None:
    steps, every = 240, 1000  # no periodic checkpoints: only the drain's request saves
    expected = reference_digest(tmp_path, steps)
    cluster.timing.update(FAST)
    cluster.start_controller()
    cluster.start_agent("node01", cpus=2)
    jid = submit_train(cluster, tmp_path, steps, every, checkpoint_grace_s=20)
    assert cluster.wait_state(jid, "RUNNING")["nodelist"] == "node01"
    cluster.start_agent("node02", cpus=2)
    log = tmp_path / "steps.log"
    wait_for(lambda: steps_done(log) >= 30, what="the job to do 30 steps")

    res = run_cli(
        ["drain", "node01", "--reason", "disk", "--now"], url=cluster.url, root=cluster.root
    )
    assert res.returncode == 0, res.stdout + res.stderr
    done = cluster.wait_terminal([jid], timeout=180)[jid]
    job = cluster.client().job(jid)[0]
    assert done["state"] == "COMPLETED", job
    assert [a["nodes"] for a in job["attempts"]] == [["node01"], ["node02"]], job["attempts"]

    lines = output(tmp_path, jid)
    assert lines[0] == "start restart=0 node=node01 step=0", lines
    # the request came through the file (its reason is the drain's), not only as a signal
    ck = [x for x in lines if x.startswith("checkpoint step=")]
    assert len(ck) == 1 and "reason=requeue" in ck[0], lines
    k = int(ck[0].split()[1].removeprefix("step="))
    assert 30 <= k < steps, lines
    assert f"stop restart=0 step={k}" in lines, lines
    assert f"start restart=1 node=node02 step={k}" in lines, lines
    assert lines[-1] == f"done restart=1 step={steps} digest={expected}", lines
    assert redone(log) == 0, f"steps computed twice: {redone(log)}"
    assert steps_done(log) == steps

    # the store recorded the checkpoints: the drain's (attempt 0) and the final one
    events = checkpoint_events(cluster, jid)
    first = [e["data"] for e in events if e["data"]["seq"] == 0]
    assert first and first[0]["path"].endswith(f"step-{k:08d}.json"), events
    assert first[0]["duration_s"] is not None and first[0]["node"] == "node01", first
    assert job["checkpoint"]["seq"] == 1 and job["checkpoint"]["path"].endswith(
        f"step-{steps:08d}.json"
    ), job["checkpoint"]


# ---------------------------------------------------------------------- unplanned: dead node
@pytest.mark.timeout(240)
def test_dead_node_resumes_from_the_last_periodic_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    steps, every = 240, 25
    expected = reference_digest(tmp_path, steps)
    cluster.timing.update(FAST)
    cluster.start_controller()
    cluster.start_agent("node01", cpus=2)
    jid = submit_train(cluster, tmp_path, steps, every)
    assert cluster.wait_state(jid, "RUNNING")["nodelist"] == "node01"
    cluster.start_agent("node02", cpus=2)
    log = tmp_path / "steps.log"
    wait_for(lambda: steps_done(log) >= 2 * every + 5, what="two periodic checkpoints")

    # the node dies: its agent, the job's shepherd and the job itself, all at once
    (task,) = cluster.task_dirs_of(jid)
    shep = cluster.shepherd_of(task)
    job_info = read_json(task / "job.json")
    assert shep is not None and job_info is not None
    cluster.agent("node01").kill(signal.SIGKILL)
    os.kill(shep[0], signal.SIGKILL)
    os.killpg(int(job_info["pgid"]), signal.SIGKILL)
    died_at = steps_done(log)

    done = cluster.wait_terminal([jid], timeout=180)[jid]
    job = cluster.client().job(jid)[0]
    assert done["state"] == "COMPLETED", job
    assert job["attempts"][-1]["nodes"] == ["node02"], job["attempts"]
    lines = output(tmp_path, jid)
    resumed = [x for x in lines if x.startswith("start restart=1 node=node02")]
    assert resumed, lines
    start = int(resumed[0].split()[-1].removeprefix("step="))
    assert start % every == 0 and died_at - every <= start <= died_at, (start, died_at)
    assert lines[-1] == f"done restart=1 step={steps} digest={expected}", lines
    lost = redone(log)
    assert lost <= every, f"{lost} steps redone, more than one checkpoint interval ({every})"
    # the store saw the periodic checkpoints of the first attempt as they happened: up to the
    # one it resumed from, or the one before when the node died within a heartbeat of the last
    # save (the agent that would have reported it was killed with it)
    first = [e["data"]["path"] for e in checkpoint_events(cluster, jid) if e["data"]["seq"] == 0]
    assert any(p.endswith(f"step-{s:08d}.json") for p in first for s in (start, start - every)), (
        start,
        first,
    )
    assert not any(p.endswith(f"step-{start + every:08d}.json") for p in first), (start, first)


# ---------------------------------------------------------------------- periodic requests
@pytest.mark.timeout(240)
def test_checkpoint_interval_requests_checkpoints_and_show_displays_them(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    cluster.start_agent("node01", cpus=2)
    script = tmp_path / "train.sh"
    script.write_text(train_script(100_000, 0, tmp_path / "steps.log"))  # saves on request only
    res = run_cli(
        [
            "submit",
            "--checkpoint-interval=2s",
            f"--checkpoint-dir={tmp_path / 'ckpt'}",
            f"--output={tmp_path / 'train-%j.out'}",
            "--time=10",
            str(script),
        ],
        url=cluster.url,
        root=cluster.root,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    jid = int(res.stdout.split()[-1])
    cluster.wait_state(jid, "RUNNING")
    events = wait_for(
        lambda: len(e := checkpoint_events(cluster, jid)) >= 3 and e,
        what="three periodic checkpoints",
        timeout=120,
    )
    times = [e["data"]["finished_at"] for e in events]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # every 2 s (plus up to a heartbeat and a step), never back to back
    assert all(1.5 <= g <= 10 for g in gaps), gaps
    lines = output(tmp_path, jid)
    assert all("reason=interval" in x for x in lines if x.startswith("checkpoint ")), lines

    shown = run_cli(["show", str(jid)], url=cluster.url, root=cluster.root)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "CheckpointSignal=USR1" in text and "CheckpointInterval=2s (fixed)" in text, text
    last = next(x for x in text.splitlines() if "LastCheckpoint=" in x)
    assert "Took=" in last and f"Path={tmp_path / 'ckpt'}" in last, last
    assert "Progress=step " in text, text
    view = cluster.client().job(jid)[0]
    assert view["checkpoint_interval"]["mode"] == "fixed", view
    assert view["checkpoint_interval"]["seconds"] == 2, view
    assert view["progress"]["step"] > 0, view
    cluster.client().cancel([jid])
    cluster.wait_terminal([jid])


# ---------------------------------------------------------------------- the time limit
@pytest.mark.timeout(240)
def test_time_limit_gives_a_checkpoint_request_its_grace_before(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update({**FAST, "kill_wait": 2.0})
    cluster.start_controller()
    cluster.start_agent("node01", cpus=2)
    limit, grace = 14, 6
    jid = submit_train(cluster, tmp_path, 100_000, 0, time_limit_s=limit, checkpoint_grace_s=grace)
    running = cluster.wait_state(jid, "RUNNING")
    done = cluster.wait_terminal([jid], timeout=120)[jid]
    job = cluster.client().job(jid)[0]
    assert done["state"] == "TIMEOUT", job
    lines = output(tmp_path, jid)
    ck = [x for x in lines if x.startswith("checkpoint step=")]
    assert len(ck) == 1 and "reason=time limit" in ck[0], lines
    assert not [x for x in lines if x.startswith("stop ")], lines  # trains on until the limit
    (event,) = checkpoint_events(cluster, jid)
    started = job["attempts"][0]["start_time"] or running["start_time"]
    at = event["data"]["finished_at"] - started
    assert limit - grace - 1 <= at <= limit, f"checkpoint {at:.1f}s after the start"
