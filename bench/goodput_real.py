"""The real goodput benchmark: a PyTorch DDP job on a local cluster, faults injected at a scaled
rate, its effective training time ratio and recovery times beside the model's (bench/goodput.py
`--real`; the books and the model are in bench/ettr.py).

Each run starts a fresh local cluster of real processes

    python -m phalanx up --detach --nodes 4 --cpus 2 --mem 16G --config (two partitions)

with bench/recovery.py's fast failure detection (node_down_timeout 4 s; the rest of the
timing as there), and submits what an ML engineer writes (bench/goodput_real.py writes both
files into the run's directory):

    sbatch -N 2 --ntasks-per-node=1 --cpus-per-task=2 --requeue --signal=B:USR1@30 \\
        --retries=1000 batch.sh        # batch.sh: srun python train.py, USR1 forwarded to srun

train.py is tests/system/test_ddp.py's DistributedDataParallel job (CPU, gloo, fixed seeds,
SGD with momentum, one rank a node) with a paced step (`--pace`, the accelerator's share of a
real step: the tiny model computes in milliseconds), a checkpoint every `--interval` seconds of
training (rank 0 decides, the ranks agree in the step's all-reduce; the model, the optimiser and
a `--payload-mb` tensor standing for the rest of a larger model's state, written to a temporary
file, fsynced, renamed), a checkpoint on the signal followed by exit (the job is requeued), and
its rank 0 writes the step log bench/ettr.py reads.

While the job trains, faults arrive at random: the gap from the job's first training step after
the previous fault (or its first step) to the next fault is exponential with mean `--mtbf`
seconds, so faults hit only a training job, and each kind in `--faults` takes its turn:

    node     SIGKILL of a node's agent, shepherds and job process groups (bench/recovery.py's
             kill_node: a power loss); the agent is started again once the node is DOWN
    agent    SIGKILL of the agent alone; started again once the node is DOWN
    drain    `drain --now` (POST /v1/nodes/N/drain now=true); resumed once the job trains again
    preempt  a job of a higher-tier partition asks for the node (`--nodelist`, `sleep 5`)

always on one of the job's two nodes (chosen at random). A fault with fewer than MARGIN_STEPS
steps left to train is not injected. Every random draw comes from `--seed` and the run number.

Per run it reports the books (bench/ettr.py `account`) and the model's predictions with the
run's own measured checkpoint cost C and recovery R (`predictions`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import ettr
from common import log

REPO = Path(__file__).resolve().parents[1]
TOOLS_PY = Path(os.environ.get("TOOLS_VENV") or REPO / ".venv-tools") / "bin" / "python"
BIN = Path(sys.executable).parent  # sbatch, srun, phalanx
PATH = f"{BIN}:/usr/local/bin:/usr/bin:/bin"
NODES = 4
KINDS = ("node", "agent", "drain", "preempt")
MARGIN_STEPS = 20
POLL_S = 0.1
GRACE = 30  # --signal=B:USR1@GRACE
PORTS = 64  # MASTER_PORT = base + restart count % PORTS: a fresh port for each attempt
TIMING: dict[str, float] = {  # bench/recovery.py's fast detection
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
    "kill_wait": 2.0,
}
CONFIG = """
[[cluster.partitions]]
name = "low"
default = true
nodes = "*"

[[cluster.partitions]]
name = "high"
nodes = "*"
priority_tier = 1
"""

TRAIN = """\
import os, signal, sys, time
T_PROC = time.time()
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
out, total = sys.argv[1], int(sys.argv[2])
interval, pace, payload_mb = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
log = open(os.path.join(out, "steps.log"), "a", buffering=1) if rank == 0 else None


def note(line):
    if log is not None:
        log.write(line + "\\n")  # one write a line: a kill never tears one


note(f"proc {run} {T_PROC:.4f}")
stop = False


def on_usr1(signum, frame):
    global stop
    stop = True


signal.signal(signal.SIGUSR1, on_usr1)
import torch
import torch.distributed as dist

note(f"mark {run} imported {time.time():.4f}")
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=world)
note(f"mark {run} group {time.time():.4f}")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
ckpt = os.path.join(out, "ckpt.pt")
step = 0
payload = None
if os.path.exists(ckpt):
    state = torch.load(ckpt, mmap=rank != 0)  # rank 0 reads it all, as it will write it all
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
    payload = state["payload"] if rank == 0 else None
if rank == 0 and payload is None:
    payload = torch.rand(payload_mb * 262144, generator=torch.Generator().manual_seed(1))


def save():
    tmp = ckpt + ".tmp"
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "payload": payload}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


note(f"start {run} {step} {time.time():.4f}")
since = 0.0  # seconds of training since this attempt began or its last checkpoint
while step < total:
    t0 = time.time()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    loss = ((ddp(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(pace)  # the accelerator's share of a real step
    step += 1
    due = rank == 0 and since + time.time() - t0 >= interval
    flag = torch.tensor([1.0 if stop else 0.0, 1.0 if due else 0.0])
    dist.all_reduce(flag)  # every rank checkpoints, or stops, at the same step
    t1 = time.time()
    note(f"step {run} {step} {t0:.4f} {t1:.4f}")
    since += t1 - t0
    if flag[0].item() or flag[1].item():
        kind = "stop" if flag[0].item() else "periodic"
        if rank == 0:
            save()
        dist.barrier()
        note(f"save {run} {step} {t1:.4f} {time.time():.4f} {kind}")
        since = 0.0
        if kind == "stop":
            dist.destroy_process_group()
            sys.exit(0)  # requeued: the next attempt resumes here
if rank == 0:
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))
dist.barrier()  # leave together: rank 0 hosts the rendezvous store the others still use
note(f"done {run} {step} {time.time():.4f}")
dist.destroy_process_group()
"""

BATCH = """#!/bin/bash
# a port of its own for each attempt: the last one's may still be in TIME_WAIT
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$(( {base} + ${{SLURM_RESTART_COUNT:-0}} % {ports} ))
trap 'kill -USR1 $SRUN 2>/dev/null' USR1
srun --ntasks-per-node=1 {python} {train} {out} {steps} {interval} {pace} {payload}  &
SRUN=$!
while :; do
    wait $SRUN; rc=$?
    kill -0 $SRUN 2>/dev/null || break
done
exit $rc
"""


@dataclass(frozen=True)
class Settings:
    train_s: float = 180.0  # seconds of training the job needs (steps = train_s / pace)
    pace_s: float = 0.1
    interval_s: float = 15.0
    mtbf_s: float = 60.0  # mean training (up) time between faults
    payload_mb: int = 128
    faults: tuple[str, ...] = KINDS
    seed: int = 1
    timeout_s: float = 1200.0

    @property
    def steps(self) -> int:
        return max(1, round(self.train_s / self.pace_s))

    @property
    def unplanned_share(self) -> float:
        return sum(k not in ettr.PLANNED for k in self.faults) / len(self.faults)


class StepTail:
    """The step log as it grows: whole lines only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.buf = b""
        self.lines: list[str] = []

    def poll(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        self.buf += data
        *whole, self.buf = self.buf.split(b"\n")
        new = [w.decode(errors="replace") for w in whole]
        self.lines += new
        return new


def _agent_cmd(state: Path, node: str) -> tuple[int, list[str], dict[str, str]]:
    pid = int((state / "run" / f"agent-{node}.pid").read_text().strip())
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    env = dict(
        kv.decode().split("=", 1)
        for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"=" in kv
    )
    return pid, argv, env


class Run:
    """One cluster, one job, faults until it has trained `steps` steps."""

    def __init__(self, k: int, s: Settings, state: Path, url: str, first_kind: int) -> None:
        self.k, self.s, self.state, self.url = k, s, state, url
        self.api = common.Api(url, timeout=30.0)
        self.rng = random.Random(f"goodput-real-{s.seed}-{k}")
        self.kind_i = first_kind
        self.dir = state / "job"
        self.dir.mkdir()
        self.tail = StepTail(self.dir / "steps.log")
        self.faults: list[ettr.Fault] = []
        self.chores: list[tuple[str, str, Any]] = []  # (what, node, data)
        self.skipped = 0

    # -- the job ------------------------------------------------------------------------------

    def submit(self) -> int:
        train = self.dir / "train.py"
        train.write_text(TRAIN)
        batch = self.dir / "batch.sh"
        batch.write_text(
            BATCH.format(
                base=common.free_ports(PORTS),
                ports=PORTS,
                python=TOOLS_PY,
                train=train,
                out=self.dir,
                steps=self.s.steps,
                interval=self.s.interval_s,
                pace=self.s.pace_s,
                payload=self.s.payload_mb,
            )
        )
        cmd = [
            str(BIN / "sbatch"),
            "--parsable",
            *("-N", "2", "--ntasks-per-node=1", "--cpus-per-task=2"),
            "--requeue",
            f"--signal=B:USR1@{GRACE}",
            "--retries=1000",
            "--job-name=goodput",
            f"--output={self.dir}/job-%j.out",
            f"--chdir={self.dir}",
            str(batch),
        ]
        env = {**os.environ, "PHALANX_URL": self.url, "PATH": PATH}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed: {res.stderr.strip()}")
        return int(res.stdout.strip().split(";")[0])

    # -- faults -------------------------------------------------------------------------------

    def inject(self, jid: int) -> ettr.Fault:
        kind = self.s.faults[self.kind_i % len(self.s.faults)]
        self.kind_i += 1
        nodes = self.api.job(jid)["attempts"][-1]["nodes"]
        node = self.rng.choice(sorted(nodes))
        if kind == "node":
            import recovery  # bench/recovery.py: the same power loss it measures

            t, argv, env = recovery.kill_node(self.state, node)
            self.chores.append(("reboot", node, (argv, env)))
        elif kind == "agent":
            pid, argv, env = _agent_cmd(self.state, node)
            t = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.chores.append(("reboot", node, (argv, env)))
        elif kind == "drain":
            t = time.time()
            self.api.post(f"/v1/nodes/{node}/drain", {"reason": "goodput bench", "now": True})
            self.chores.append(("resume", node, None))
        else:  # preempt
            t = time.time()
            self.api.post(
                "/v1/jobs",
                {
                    "script": "#!/bin/sh\nsleep 5\n",
                    "name": "urgent",
                    "partition": "high",
                    "nodelist": [node],
                    "cpus_per_task": 2,
                    "output": "/dev/null",
                    "workdir": "/tmp",
                },
            )
        f = ettr.Fault(t=t, kind=kind, node=node)
        log(f"run {self.k}: {kind} on {node}")
        return f

    def do_chores(self, job: dict[str, Any]) -> None:
        """Reboot a killed node's agent once the node is DOWN; resume a drained node once the
        job has left it (sooner than an operator would: a node the job avoids after failures
        elsewhere must not keep it waiting)."""
        if not self.chores:
            return
        down = {n["name"] for n in self.api.get("/v1/nodes")["nodes"] if n.get("down")}
        att = (job.get("attempts") or [{}])[-1]
        live = job["state"] != "PENDING" and att.get("state") != "ENDED"
        holding = set(att.get("nodes") or ()) if live else set()
        left = []
        for what, node, data in self.chores:
            if what == "reboot" and node in down:
                import recovery

                recovery.restart_agent(self.state, node, *data)
            elif what == "resume" and node not in holding:
                self.api.post(f"/v1/nodes/{node}/resume", None)
            else:
                left.append((what, node, data))
        self.chores = left

    # -- the run ------------------------------------------------------------------------------

    def go(self) -> dict[str, Any]:
        jid = self.submit()
        deadline = time.monotonic() + self.s.timeout_s
        up_since: float | None = None  # the first step after the last fault (or the first)
        gap = self.rng.expovariate(1.0 / self.s.mtbf_s)
        hit_run: int | None = None  # the attempt the last fault hit, until a later one steps
        last_step = 0
        run_now = -1
        next_check = 0.0
        while True:
            now = time.time()
            for line in self.tail.poll():
                w = line.split()
                if len(w) == 5 and w[0] == "step":
                    run_now, last_step = int(w[1]), int(w[2])
                    if up_since is None and (hit_run is None or run_now > hit_run):
                        up_since, hit_run = float(w[3]), None
                        gap = self.rng.expovariate(1.0 / self.s.mtbf_s)
            if time.monotonic() > next_check:
                next_check = time.monotonic() + 1.0
                job = self.api.job(jid)
                if job["state"] in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT"):
                    break
                self.do_chores(job)
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {jid} not done after {self.s.timeout_s:g}s")
            if up_since is not None and now >= up_since + gap:
                if self.s.steps - last_step < MARGIN_STEPS:
                    self.skipped += 1
                    up_since = None  # nothing more to inject
                    hit_run = 10**9
                else:
                    self.faults.append(self.inject(jid))
                    up_since, hit_run = None, run_now
            time.sleep(POLL_S)
        job = self.api.job(jid)
        self.do_chores(job)
        if job["state"] != "COMPLETED":
            raise RuntimeError(f"job {jid} ended {job['state']} ({job.get('reason')})")
        for _ in range(20):  # the last lines may land after the job's end is recorded
            self.tail.poll()
            if any(x.startswith("done ") for x in self.tail.lines):
                break
            time.sleep(0.1)
        runs = ettr.parse_log(self.tail.lines)
        books = ettr.account(runs, float(job["submit_time"]), float(job["end_time"]), self.faults)
        downs: dict[str, list[float]] = {}
        for e in self.api.events():
            if e["kind"] == "node.down":
                downs.setdefault(e["node"], []).append(float(e["ts"]))
        for pf in books["per_fault"]:
            after = [t for t in downs.get(pf["node"], []) if t >= pf["t"]]
            if pf["kind"] in ("node", "agent") and after:
                pf["detect_s"] = min(after) - pf["t"]
        pred = ettr.predictions(books, self.s.interval_s, self.s.mtbf_s, self.s.unplanned_share)
        res = {
            "run": self.k,
            "job_id": jid,
            "books": books,
            "model": pred,
            "skipped_faults": self.skipped,
            "next_kind": self.kind_i,
        }
        log(
            f"run {self.k}: ETTR {books['ettr']:.3f}, model {pred['realized']:.3f} "
            f"(+edges {pred['with_edges']:.3f}); {books['faults']} faults, "
            f"C {books['cost_s'] or 0:.2f}s, R {books['recovery_s'] or 0:.1f}s, "
            f"wall {books['wall_s']:.0f}s"
        )
        return res


def one_run(k: int, s: Settings, first_kind: int, keep: bool = False) -> dict[str, Any]:
    state = common.state_dir("phalanx-goodput-")
    cfg = state / "phalanx.toml"
    cfg.write_text(CONFIG)
    port = common.free_port()
    env = common.timing_env(TIMING, "PHALANX_TIMING_")
    env.pop("PHALANX_CONFIG", None)
    up_args = ["--port", str(port), "--nodes", str(NODES), "--cpus", "2", "--mem", "16G"]
    up_args += ["--config", str(cfg)]
    with common.phalanx_up(state, up_args, f"port {port}", keep=keep, env=env, leftovers=True):
        url = f"http://127.0.0.1:{port}"
        r = Run(k, s, state, url, first_kind)
        try:
            tm = r.api.get("/v1/cluster")["this_controller"]["timing"]
            common.check_timing(tm, TIMING)
            return r.go()
        except Exception:
            log(f"run {k} failed; controller log:\n{common.controller_log_tail(state, 25)}")
            out = sorted(r.dir.glob("job-*.out"))
            if out:
                log(f"--- {out[-1].name}\n{out[-1].read_text(errors='replace')[-3000:]}")
            raise
        finally:
            r.api.http.close()


def check_tools() -> str | None:
    """Why the real mode cannot run here, or None."""
    if not TOOLS_PY.exists():
        return f"no {TOOLS_PY}: `bash scripts/ensure-tools.sh` installs PyTorch (CPU) there"
    res = subprocess.run([TOOLS_PY, "-c", "import torch"], capture_output=True, timeout=120)
    if res.returncode:
        return f"{TOOLS_PY} cannot import torch: {res.stderr.decode(errors='replace')[-300:]}"
    return None


def _med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    books = [r["books"] for r in runs]
    models = [r["model"] for r in runs]
    per_fault = [pf for b in books for pf in b["per_fault"]]
    by_kind: dict[str, list[float]] = {}
    for pf in per_fault:
        if pf["recovery_s"] is not None:
            by_kind.setdefault(pf["kind"], []).append(pf["recovery_s"])
    out: dict[str, Any] = {
        "runs": len(runs),
        "ettr": _med([b["ettr"] for b in books]),
        "model_realized": _med([m["realized"] for m in models]),
        "model_nominal": _med([m["nominal"] for m in models]),
        "model_with_edges": _med([m["with_edges"] for m in models]),
        "young_daly": _med([m["young_daly"] for m in models]),
        "diff_realized": _med([r["books"]["ettr"] - r["model"]["realized"] for r in runs]),
        "diff_nominal": _med([r["books"]["ettr"] - r["model"]["nominal"] for r in runs]),
        "diff_min": min(r["books"]["ettr"] - r["model"]["realized"] for r in runs),
        "diff_max": max(r["books"]["ettr"] - r["model"]["realized"] for r in runs),
        "noise_sd": _med([m["noise_sd"] for m in models]),
        "diff_with_edges": _med([r["books"]["ettr"] - r["model"]["with_edges"] for r in runs]),
        "cost_s": _med([b["cost_s"] for b in books]),
        "recovery_s": _med([b["recovery_s"] for b in books]),
        "lost_per_failure_s": _med([b["lost_per_failure_s"] for b in books]),
        "start_s": _med([b["start_s"] for b in books]),
        "end_s": _med([b["end_s"] for b in books]),
        "wall_s": _med([b["wall_s"] for b in books]),
        "faults": _med([b["faults"] for b in books]),
        "pooled": ettr.pooled([(r["books"], r["model"]) for r in runs]),
        "faults_total": sum(b["faults"] for b in books),
        "up_total_s": sum(b["up_s"] for b in books),
        "recovery_by_kind": {
            k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
            for k, v in sorted(by_kind.items())
        },
        "detect_s": _med([pf.get("detect_s") for pf in per_fault]),
        "phases": {
            kind: {
                ph: _med([pf["phases"].get(ph) for pf in per_fault if pf["kind"] == kind])
                for ph in ("launch", "import", "group", "load", "first")
            }
            for kind in sorted(by_kind)
        },
        "framework_s": _med([pf.get("framework_s") for pf in per_fault]),
    }
    return out


def print_report(runs: list[dict[str, Any]], summ: dict[str, Any], s: Settings) -> None:
    t_c = f"{s.interval_s:g}s"
    print(
        f"Real goodput: PyTorch DDP (CPU, gloo) on 2 of {NODES} local nodes, sbatch -N 2 "
        f"--requeue --signal=B:USR1@{GRACE}, srun python train.py; {s.steps} steps of "
        f"{s.pace_s:g}s (~{s.train_s:g}s of training), a checkpoint every {t_c} of training "
        f"({s.payload_mb} MB written), faults ({','.join(s.faults)} in turn) every "
        f"{s.mtbf_s:g}s of training on average; node_down_timeout "
        f"{TIMING['node_down_timeout']:g}s"
    )
    head = (
        f"{'run':>3} {'wall':>6} {'faults':>9} {'C':>6} {'R':>6} {'lost/f':>7} {'start':>6} "
        f"{'end':>5} {'ETTR':>6} {'model':>6} {'diff':>7} {'+edges':>7} {'diff':>7} "
        f"{'nominal':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in runs:
        b, m = r["books"], r["model"]
        lost = b["lost_per_failure_s"]
        print(
            f"{r['run']:>3} {b['wall_s']:5.0f}s {b['unplanned']:>3}u+{b['planned']}p "
            f"{(b['cost_s'] or 0):5.2f}s {(b['recovery_s'] or 0):5.1f}s "
            f"{'-' if lost is None else f'{lost:.1f}s':>7} {b['start_s']:5.1f}s {b['end_s']:4.1f}s "
            f"{b['ettr']:6.3f} {m['realized']:6.3f} {b['ettr'] - m['realized']:+7.3f} "
            f"{m['with_edges']:7.3f} {b['ettr'] - m['with_edges']:+7.3f} {m['nominal']:7.3f}"
        )
    x = summ

    def f3(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    print(
        f"medians (each column over the runs; the differences run by run): ETTR "
        f"{f3(x['ettr'])}; model {f3(x['model_realized'])} (ETTR - model "
        f"{x['diff_realized']:+.3f}), with start/end {f3(x['model_with_edges'])} "
        f"({x['diff_with_edges']:+.3f}), at the nominal rate {f3(x['model_nominal'])} "
        f"({x['diff_nominal']:+.3f}); Young/Daly T/2 form {f3(x['young_daly'])}"
    )
    pl = x["pooled"]
    print(
        f"pooled (all runs' kept time / their wall time): ETTR {pl['ettr']:.3f}; model "
        f"{pl['realized']:.3f} ({pl['ettr'] - pl['realized']:+.3f}), with start/end "
        f"{pl['with_edges']:.3f} ({pl['ettr'] - pl['with_edges']:+.3f})"
    )
    print(
        f"faults met: {x['faults_total']} in {x['up_total_s']:.0f}s of up time, "
        f"{x['up_total_s'] / s.mtbf_s:.1f} expected at the nominal rate (the nominal model "
        "assumes that many)"
    )
    rk = ", ".join(
        f"{k} {v['median']:.1f}s (n={v['n']}, {v['min']:.1f}-{v['max']:.1f})"
        for k, v in x["recovery_by_kind"].items()
    )
    print(f"recovery (fault to the first training step after it), median by kind: {rk}")
    det = x["detect_s"]
    print(f"  node DOWN after a node or agent fault: {'-' if det is None else f'{det:.1f}s'}")
    for kind, ph in x["phases"].items():
        parts = ", ".join(f"{k} {'-' if v is None else f'{v:.1f}s'}" for k, v in ph.items())
        print(f"  {kind}: {parts}")
    print(
        "  launch: the fault to the new rank 0's process (detection or the stop's checkpoint, "
        "requeue, start, srun); import: torch; group: init_process_group (the other rank's "
        "start); load: the checkpoint; first: to the first step"
    )
    bar = abs(x["diff_realized"]) <= 0.01
    print(
        f"bar (issue 28): |ETTR - model| <= 0.01 at the same rates: "
        f"{'met' if bar else 'NOT met'} (median {x['diff_realized']:+.3f}, runs "
        f"{x['diff_min']:+.3f} to {x['diff_max']:+.3f}; the model uses each run's measured C "
        "and R and the rate of faults it met; chance alone, the phase of the unplanned faults "
        f"in their checkpoint cycle, moves one run by +-{x['noise_sd']:.3f} (1 sd))"
    )
    print(
        "model (bench/ettr.py): faults while the job trains, exponential gaps of mean M up "
        "time, each costing R; an unplanned one loses the partial cycle of T training + C "
        "checkpoint, ~(T+C)/2; to first order T/(T+C) * (1 - (q (T+C)/2 + R) / (M + R)); "
        "model: at the rate, mix and R each run met (M = its up time / its faults) with its "
        "measured C; +edges: the same over the wall time less the measured start (submit to "
        "the first step) and end (the last step to the job's end), which the model leaves out; "
        "nominal: at the injected rate and mix"
    )


def measure(runs: int, s: Settings, keep: bool = False) -> dict[str, Any]:
    """`runs` real runs; their results and summary (medians)."""
    why = check_tools()
    if why:
        raise RuntimeError(why)
    load_before = common.busy_before("the job's steps and recoveries will be slower")
    out = []
    kind_i = 0
    for k in range(1, runs + 1):
        res = one_run(k, s, kind_i, keep)
        kind_i = res["next_kind"]
        out.append(res)
    summ = summarize(out, s)
    return {
        "settings": {**s.__dict__, "steps": s.steps, "faults": list(s.faults)},
        "timing": TIMING,
        "summary": summ,
        "runs": out,
        "host": common.host_info(load_before, os.getloadavg()[0]),
    }


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, default=str)
