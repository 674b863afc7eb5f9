"""A real PyTorch DistributedDataParallel job under `srun` survives planned stops with no work
lost: the bar of issue 28 ("0 steps redone, final weights equal to an uninterrupted run's").

The job is what an ML engineer writes: `sbatch -N 2 --requeue --signal=B:USR1@GRACE`, the
batch script starts one rank a node with `srun python train.py` and forwards the checkpoint
signal to srun; the ranks (CPU, gloo, fixed seeds) agree at the next step that a stop was
asked for, rank 0 saves the model, the optimiser and the step, and the requeued job loads
it and goes on. An operator's `drain --now` of the rank-0 node, a maintenance window and a
preemption (the last two with the long runs, `make soak`) each stop it once; the final
weights must equal, bit for bit, those of the same script run uninterrupted (two processes
started here, no scheduler), and the restart must begin at the step that was saved.

PyTorch (CPU) is in `.venv-tools` (tests/tools-requirements.txt, scripts/ensure-tools.sh);
without it the test is skipped, except in CI (CI=true), where it fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, wait_for
from system.test_planned_stop_steps import start_cluster, stop_the_job

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]
TOOLS_PY = Path(os.environ.get("TOOLS_VENV") or REPO / ".venv-tools") / "bin" / "python"
BIN = str(Path(sys.executable).parent)  # srun and friends
PATH = f"{BIN}:/usr/local/bin:/usr/bin:/bin"
STEPS = 250
GRACE = 40  # the job's --signal=...@GRACE

TRAIN = """\
import os, signal, sys, time
import torch
import torch.distributed as dist

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
out, total = sys.argv[1], int(sys.argv[2])
ckpt = os.path.join(out, "ckpt.pt")
stop = False


def note(line):
    if rank == 0:
        with open(os.path.join(out, "train.log"), "a") as f:
            f.write(line + "\\n")


def on_usr1(signum, frame):
    global stop
    stop = True


signal.signal(signal.SIGUSR1, on_usr1)
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
step = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
note(f"start {run} {step}")
while step < total:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    loss = ((ddp(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step == 20 and run == 0:
        note("ready")
    flag = torch.tensor([1.0 if stop else 0.0])
    dist.all_reduce(flag)  # every rank stops at the same step
    if flag.item():
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            note(f"saved {run} {step}")
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(0)
    if run == 0 and "PHX_TEST_PACE" in os.environ:
        time.sleep(float(os.environ["PHX_TEST_PACE"]))  # time for the stop to land mid-run
if rank == 0:
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))
    note(f"done {run} {step}")
dist.barrier()  # leave together: rank 0 hosts the rendezvous store the others still use
dist.destroy_process_group()
"""

BATCH = """#!/bin/bash
# a port of its own for each start: the first rendezvous's may still be in TIME_WAIT
PORTS=({ports})
export MASTER_ADDR=127.0.0.1 MASTER_PORT=${{PORTS[${{SLURM_RESTART_COUNT:-0}}]}}
export PHX_TEST_PACE=0.1
trap 'kill -USR1 $SRUN 2>/dev/null' USR1
srun --ntasks-per-node=1 {python} {train} {out} {steps} &
SRUN=$!
while :; do
    wait $SRUN; rc=$?
    kill -0 $SRUN 2>/dev/null || break
done
exit $rc
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The training script, and the weights of its uninterrupted run (two ranks started
    here, as torchrun would, without a scheduler)."""
    if not TOOLS_PY.exists() or subprocess.run([TOOLS_PY, "-c", "import torch"]).returncode:
        why = f"no PyTorch in {TOOLS_PY}: `bash scripts/ensure-tools.sh` installs it"
        if os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}:
            pytest.fail(f"the DDP test must run in CI: {why}", pytrace=False)
        pytest.skip(why)
    base = tmp_path_factory.mktemp("ddp")
    train = base / "train.py"
    train.write_text(TRAIN)
    out = base / "reference"
    out.mkdir()
    env = {
        "PATH": PATH,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "SLURM_NTASKS": "2",
    }
    ranks = [
        subprocess.Popen([TOOLS_PY, train, out, str(STEPS)], env={**env, "SLURM_PROCID": str(r)})
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=300) for p in ranks] == [0, 0]
    finally:
        for p in ranks:  # a rank left waiting for its peer must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    return train, out / "final.pt"


def same_weights(a: Path, b: Path) -> bool:
    code = (
        "import sys, torch\n"
        "x, y = torch.load(sys.argv[1]), torch.load(sys.argv[2])\n"
        "sys.exit(0 if x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) else 1)\n"
    )
    return subprocess.run([TOOLS_PY, "-c", code, a, b], timeout=120).returncode == 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "trigger",
    [
        "drain",
        # the same path behind another trigger, 30-40 s each: with the long runs (make soak)
        pytest.param("maintenance", marks=pytest.mark.soak),
        pytest.param("preemption", marks=pytest.mark.soak),
    ],
)
def test_a_planned_stop_of_an_srun_ddp_job_redoes_no_step_and_ends_with_the_same_weights(
    cluster: Cluster, tmp_path: Path, reference: tuple[Path, Path], trigger: str
) -> None:
    train, ref = reference
    start_cluster(cluster, tmp_path, trigger)
    out = tmp_path / "run"
    out.mkdir()
    ports = " ".join(str(free_port()) for _ in range(3))
    script = BATCH.format(ports=ports, python=TOOLS_PY, train=train, out=out, steps=STEPS)
    jid = cluster.submit_script(
        tmp_path,
        "ddp",
        script,
        env={"PATH": PATH},
        nodes=2,
        requeue=True,
        signal=f"B:USR1@{GRACE}",
        cpus_per_task=2,  # whole nodes (a preemptor needs a node of them)
    )
    log = out / "train.log"
    wait_for(
        lambda: log.exists() and "ready" in log.read_text(),
        what="the ranks to train",
        timeout=180,
    )
    stop_the_job(cluster, tmp_path, trigger)
    wait_for(
        lambda: "done" in log.read_text(),
        what="the job to finish after its restart",
        timeout=300,
    )
    lines = log.read_text().splitlines()
    saved = [ln for ln in lines if ln.startswith("saved ")]
    starts = [ln for ln in lines if ln.startswith("start ")]
    assert len(saved) == 1 and len(starts) == 2, lines
    at = int(saved[0].split()[2])
    assert 20 <= at < STEPS, lines  # stopped mid-run, after the ready mark
    assert starts == ["start 0 0", f"start 1 {at}"], lines  # 0 steps redone
    assert lines[-1] == f"done 1 {STEPS}", lines
    assert same_weights(out / "final.pt", ref), "the weights differ from the uninterrupted run's"
    job = cluster.wait_terminal([jid], timeout=120)[jid]
    if job["state"] != "COMPLETED":  # say why: the job's output and its story
        events = cluster.client().get("/v1/events", limit=1000)["events"]
        story = "\n".join(f"{e['kind']}: {e['message']}" for e in events if e["job_id"] == jid)
        output = (tmp_path / f"ddp-{jid}.out").read_text(errors="replace")
        pytest.fail(f"job {job}\n--- events\n{story}\n--- output\n{output}")
