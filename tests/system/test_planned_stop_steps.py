"""Planned stops of a two-node job whose ranks run under `srun`: no rank loses work.

The job is the common training pattern: `sbatch -N 2 --requeue --signal=[B:]USR1@30`, the
batch script starts the ranks with `srun` and forwards the checkpoint signal to it. Rank 1,
on the node that is not the batch host, takes seconds to write its checkpoint. Each planned
stop (an operator's `drain --now`, a maintenance window, a preemption, a failing health
check) must let every rank save before anything of the job is stopped on any node: the job
comes back with each rank starting exactly where it saved (0 steps redone). Before the fix
the holder task on the other node was stopped at once and its cgroup went with it, killing
rank 1 some 70 ms into its grace.

`--signal=B:` sends the checkpoint signal to the batch shell only, which forwards it; without
`B:` the steps' tasks get it too (as Slurm does); both are covered.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, run_cli, wait_for
from system.test_preemption import CONFIG as PREEMPT_CONFIG

pytestmark = pytest.mark.system

BIN = str(Path(sys.executable).parent)  # srun and friends, first on the jobs' PATH
PATH = f"{BIN}:/usr/local/bin:/usr/bin:/bin"
TIMING = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 6.0,
    "fence_timeout": 3.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
    "maint_lead": 2.0,
}
SLOW_SAVE = 4.0  # seconds rank 1 takes to write its checkpoint
GRACE = 40  # the job's --signal=...@GRACE: far longer than the slow save

RANK = """\
import json, os, signal, sys, time

rank = int(os.environ["SLURM_PROCID"])
run = int(os.environ["SLURM_RESTART_COUNT"])
ckdir = {ckdir!r}
ckpt = os.path.join(ckdir, f"rank{{rank}}.json")
log = os.path.join(ckdir, f"rank{{rank}}.log")
stop = False


def note(line):
    with open(log, "a") as f:
        f.write(line + "\\n")
        f.flush()
        os.fsync(f.fileno())


def on_usr1(signum, frame):
    global stop
    stop = True


signal.signal(signal.SIGUSR1, on_usr1)
step = 0
if os.path.exists(ckpt):
    with open(ckpt) as f:
        step = json.load(f)["step"]
note(f"start {{run}} {{step}} {{os.environ['SLURMD_NODENAME']}}")
if run >= 1:
    sys.exit(0)  # back where it saved: that is all the test needs to see
open(os.path.join(ckdir, f"ready{{rank}}"), "w").close()
while True:
    time.sleep(0.05)
    step += 1
    if stop:
        if rank == 1:
            time.sleep({slow})  # a checkpoint that takes seconds to write
        tmp = ckpt + ".tmp"
        with open(tmp, "w") as f:
            json.dump({{"step": step}}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt)
        note(f"saved {{run}} {{step}}")
        sys.exit(0)
"""

BATCH = """#!/bin/bash
trap 'echo "batch got USR1"; kill -USR1 $SRUN 2>/dev/null' USR1
srun --ntasks-per-node=1 {python} {rank_py} &
SRUN=$!
while :; do
    wait $SRUN; rc=$?
    kill -0 $SRUN 2>/dev/null || break
done
echo "srun ended with $rc"
exit $rc
"""

HEALTH_SCRIPT = """#!/bin/sh
if [ -e "{flag}" ]; then echo "ERROR: scratch full"; exit 1; fi
echo "scratch ok"
"""


def rank_lines(ckdir: Path, rank: int) -> list[str]:
    path = ckdir / f"rank{rank}.log"
    return path.read_text().splitlines() if path.exists() else []


def start_cluster(cluster: Cluster, tmp_path: Path, trigger: str) -> int:
    """The cluster for `trigger`; returns how many nodes it has."""
    cluster.timing.update(TIMING)
    if trigger == "preemption":
        config = tmp_path / "phalanx.toml"
        config.write_text(PREEMPT_CONFIG)  # tiers low and high
        cluster.extra_env["PHALANX_CONFIG"] = str(config)
        cluster.start(nodes=2, cpus=2)  # no free node: the high job must preempt
        return 2
    cluster.start_controller()
    extra: list[str] = []
    if trigger == "health":
        script = tmp_path / "check.sh"
        script.write_text(HEALTH_SCRIPT.format(flag=tmp_path / "sick"))
        script.chmod(0o755)
        config = tmp_path / "health.toml"
        config.write_text(
            "[health]\ninterval = 1\npasses_to_recover = 100\ngpu = false\n"
            f'scripts = [{{path = "{script}", timeout = 10}}]\n'
        )
        extra = ["--health-config", str(config)]
    cluster.start_agent("node01", cpus=2, extra_args=extra, wait=False)
    for name in ("node02", "node03"):
        cluster.start_agent(name, cpus=2, wait=False)
    cluster.wait_agents(["node01", "node02", "node03"])
    return 3


def stop_the_job(cluster: Cluster, tmp_path: Path, trigger: str) -> int | None:
    """Make the planned stop happen; the id of a job that preempts, if any."""
    if trigger == "drain":
        res = run_cli(
            ["drain", "node01", "--reason", "PSU", "--now"], url=cluster.url, root=cluster.root
        )
        assert res.returncode == 0, res.stderr
    elif trigger == "maintenance":
        res = run_cli(
            [
                *("maint", "add", "--nodes", "node01", "--start", "now+15"),
                *("--duration", "8s", "--reason", "BIOS"),
            ],
            url=cluster.url,
            root=cluster.root,
        )
        assert res.returncode == 0, res.stderr
    elif trigger == "health":
        (tmp_path / "sick").touch()
    else:
        return cluster.submit_script(
            tmp_path,
            "urgent",
            "#!/bin/bash\necho urgent\n",
            partition="high",
            cpus_per_task=2,
        )
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("trigger", "signal"),
    [
        ("drain", f"B:USR1@{GRACE}"),
        ("maintenance", f"B:USR1@{GRACE}"),
        ("preemption", f"USR1@{GRACE}"),
        ("health", f"USR1@{GRACE}"),
    ],
)
def test_a_planned_stop_lets_every_srun_rank_checkpoint(
    cluster: Cluster, tmp_path: Path, trigger: str, signal: str
) -> None:
    start_cluster(cluster, tmp_path, trigger)
    ckdir = tmp_path / "ckpt"
    ckdir.mkdir()
    rank_py = tmp_path / "rank.py"
    rank_py.write_text(RANK.format(ckdir=str(ckdir), slow=SLOW_SAVE))
    jid = cluster.submit_script(
        tmp_path,
        "train",
        BATCH.format(python=sys.executable, rank_py=rank_py),
        nodes=2,
        cpus_per_task=2,  # whole nodes
        requeue=True,
        signal=signal,
        env={"PATH": PATH},
    )
    first = cluster.wait_state(jid, "RUNNING")
    assert first["nodelist"] in ("node[01-02]", "node01,node02"), first
    wait_for(
        lambda: all((ckdir / f"ready{r}").exists() for r in (0, 1)),
        what="both ranks to run",
        timeout=120,
    )
    preemptor = stop_the_job(cluster, tmp_path, trigger)

    def back() -> bool:
        return all(any(x.startswith("start 1 ") for x in rank_lines(ckdir, r)) for r in (0, 1))

    wait_for(back, what="both ranks to start again after the stop", timeout=180)
    for rank in (0, 1):
        lines = rank_lines(ckdir, rank)
        saved = [x for x in lines if x.startswith("saved 0 ")]
        assert saved, f"rank {rank} was stopped before it could save: {lines}"
        (restart,) = [x for x in lines if x.startswith("start 1 ")]
        saved_step = int(saved[0].split()[2])
        restart_step = int(restart.split()[2])
        assert restart_step == saved_step, f"rank {rank} redid {saved_step - restart_step} steps"
    job = cluster.client().job(jid)[0]
    assert re.match(r"^requeue: ", job["attempts"][0]["stop_reason"] or ""), job["attempts"]
    if preemptor is not None:
        assert cluster.wait_terminal([preemptor])[preemptor]["state"] == "COMPLETED"
    final = cluster.wait_terminal([jid], timeout=180)[jid]
    assert final["state"] == "COMPLETED", cluster.client().job(jid)[0]
