#!/usr/bin/env python3
"""Recovery time after a node failure: requeue vs elastic vs spare (a benchmark, not a test).

Each run starts a fresh local cluster of real processes

    python -m phalanx up --detach --state-dir TMP --port FREE --nodes 5 --cpus 8 --mem 16G

with fast failure detection (the timing below, passed as PHALANX_TIMING_<NAME>; checked
against the rules of phalanx.config first), and stops it with `phalanx down` in a `finally`
(then SIGKILLs any shepherd or job process group still alive). In each run:

  1. submit one multi-node job (`sleep 600`) in the run's mode and wait until it is RUNNING
     and its processes have started:
       requeue  `--nodes=2 --requeue`: a plain job, requeued through the queue
       elastic  `--nodes=2-4`: restarts at once on the survivors (plus free nodes)
       spare    `--nodes=2 --spares=1`: the spare takes the failed rank, no queue wait
  2. wait until the `cluster` lease holder is past its start-up grace (one node_down_timeout:
     killing earlier would measure that grace, not the failure detector);
  3. SIGKILL, on the node of the job's rank 1, the agent, every shepherd and every job process
     group (a power loss: nothing on the node reports anything again), noting the client's
     wall clock (the kill time);
  4. poll every 50 ms until the job is RUNNING again (restart_count >= 1).

With `--busy SECONDS` the cluster is full and has a queue: it has exactly the nodes the job
holds (requeue 2, elastic 4, spare 3), every rank takes a whole node (8 CPUs), two competing
one-node jobs (`sleep SECONDS`, priority 100) wait in the queue, and the killed node's agent
is started again as soon as the node is DOWN (a quick reboot). A requeued job then goes back
behind the competitors; an elastic or spare job restarts on its reserved nodes at once.

Measured from the kill time:

  recovery   the new attempt's start_time (server clock: its first rank reported running)
  running    the job first seen RUNNING again (client poll)
  down       the node's `node.down` event (server clock): failure detection alone

`recovery` is what `measure(mode, runs)` returns (seconds per run), for bench/goodput.py.
The table gives median and max over `--runs` runs per mode, and the share of `recovery`
after detection (restart overhead: stopping the survivors, placing, launching).

    .venv/bin/python bench/recovery.py --runs 3
    .venv/bin/python bench/recovery.py --mode spare --runs 1 --json out.json

With `--torchrun`, the job is real training instead (issue 28's bar): `-N 2 --spares=1`, its
batch script runs `srun torchrun --nnodes=1:2 --max-restarts=3 --rdzv-backend=phalanx` (PyTorch
CPU from .venv-tools, or $TOOLS_VENV; the backend installed there as `pip install --no-deps`
would, pointing at this checkout), a DDP model on gloo that checkpoints every 10 steps and
resumes from its latest checkpoint. Rank 1's node is killed whole (agent, shepherds, every
process of the job there: the holder, srun's task, torchrun, its worker) once it has trained
and saved a checkpoint, and the time to the first training step of a new group is measured:

  nokill   `--no-kill`: the job regroups in its attempt (the spare takes rank 1, its srun task
           starts torchrun there, the survivor's torchrun re-forms the group: no requeue)
  restart  without it (today's path): the whole job restarts on its reserved nodes (the spare
           in rank 1's place), batch script, srun, torchrun and workers anew

    .venv/bin/python bench/recovery.py --torchrun --runs 3

Measured from the kill: `down` (node.down), `regroup` (job.node_left or job.restart),
`launcher` (torchrun's first worker start seen after the kill, i.e. the new group formed
and its workers running the script), `training` (the new group's first step done: the bar).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
from common import busy_before, host_info, host_line, log, read_json

MODES: dict[str, dict[str, Any]] = {
    "requeue": {"nodes": 2, "requeue": True},
    "elastic": {"nodes": 2, "nodes_max": 4, "requeue": True},
    "spare": {"nodes": 2, "spares": 1, "requeue": True},
}
EXPECTED_EVENT = {"requeue": "job.requeue", "elastic": "job.restart", "spare": "job.restart"}
NODES = 5
POLL_S = 0.05
# Fast failure detection (a valid set: phalanx.config checks it before the runs).
TIMING: dict[str, float] = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
    "kill_wait": 2.0,
}
SHOWN_TIMING = ("heartbeat_interval", "node_down_timeout", "kill_wait", "restart_reservation")
SCRIPT = "#!/bin/sh\nsleep 600\n"


BUSY_NODES = {"requeue": 2, "elastic": 4, "spare": 3}  # exactly the job's allocation
COMPETITORS = 2


@contextlib.contextmanager
def cluster(keep: bool = False, nodes: int = NODES) -> Iterator[tuple[str, Path]]:
    state = common.state_dir("phalanx-recovery-")
    port = common.free_port()
    env = common.timing_env(TIMING, "PHALANX_TIMING_")
    env.pop("PHALANX_CONFIG", None)
    up_args = ["--port", str(port), *common.node_args(nodes)]
    with common.phalanx_up(state, up_args, f"port {port}", keep=keep, env=env, leftovers=True):
        yield f"http://127.0.0.1:{port}", state


def kill_node(state: Path, node: str) -> tuple[float, list[str], dict[str, str]]:
    """SIGKILL the node's agent, shepherds and job process groups.

    Returns the kill time and the agent's command line and environment (to start it again)."""
    agent_pid = int((state / "run" / f"agent-{node}.pid").read_text().strip())
    # NUL-terminated arguments; an argument may be empty (e.g. `--gpus ""`)
    argv = [a.decode() for a in Path(f"/proc/{agent_pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    env = dict(
        kv.decode().split("=", 1)
        for kv in Path(f"/proc/{agent_pid}/environ").read_bytes().split(b"\0")
        if b"=" in kv
    )
    t_kill = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent_pid, signal.SIGKILL)
    for task in sorted((state / "nodes" / node / "tasks").glob("*")):
        shep = read_json(task / "shepherd.pid")
        if isinstance(shep, dict) and isinstance(shep.get("pid"), int):
            start = shep.get("starttime")
            if common.alive(shep["pid"], start if isinstance(start, int) else None):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(shep["pid"], signal.SIGKILL)
        job = read_json(task / "job.json")
        if isinstance(job, dict) and isinstance(job.get("pgid"), int):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job["pgid"], signal.SIGKILL)
    return t_kill, argv, env


def restart_agent(state: Path, node: str, argv: list[str], env: dict[str, str]) -> None:
    """Start the node's agent again as `phalanx up` did (its pid file lets `down` stop it)."""
    log_path = state / "logs" / f"agent-{node}.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    (state / "run" / f"agent-{node}.pid").write_text(f"{proc.pid}\n")


def _started(state: Path, job: dict[str, Any]) -> bool:
    """Every rank of the job's current attempt has its process (job.json written)."""
    att = (job.get("attempts") or [None])[-1]
    if not att or att["state"] != "RUNNING":
        return False
    return all(
        isinstance(read_json(state / "nodes" / n / "tasks" / str(att["id"]) / "job.json"), dict)
        for n in att["nodes"]
    )


def one_run(mode: str, k: int, keep: bool = False, busy: float = 0.0) -> dict[str, Any]:
    """One cluster, one job in `mode`, one node killed; the measured times."""
    with cluster(keep, BUSY_NODES[mode] if busy else NODES) as (url, state):
        api = common.Api(url, timeout=30.0)
        try:
            return _run(api, state, mode, k, busy)
        except Exception:
            log(f"{mode} run {k} failed; controller log:\n{common.controller_log_tail(state, 25)}")
            raise
        finally:
            api.http.close()


def _run(api: common.Api, state: Path, mode: str, k: int, busy: float) -> dict[str, Any]:
    tm = api.get("/v1/cluster")["this_controller"]["timing"]
    common.check_timing(tm, TIMING)
    down_timeout = float(tm["node_down_timeout"])
    spec = {
        "script": SCRIPT,
        "output": "/dev/null",
        "workdir": "/tmp",
        "name": f"recovery-{mode}",
        **MODES[mode],
    }
    if busy:
        spec["cpus_per_task"] = 8  # a whole node per rank
    jid = int(api.post("/v1/jobs", spec)["job_id"])

    deadline = time.monotonic() + 60
    while True:
        job = api.job(jid)
        if job["state"] == "RUNNING" and _started(state, job):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {jid} not running after 60s: {job['state']} {job['reason']}")
        time.sleep(POLL_S)
    before = job["attempts"][-1]["nodes"]
    victim = before[1]
    rivals = []
    if busy:
        for i in range(COMPETITORS):
            rival = {
                "script": f"#!/bin/sh\nsleep {busy:g}\n",
                "output": "/dev/null",
                "workdir": "/tmp",
                "name": f"competitor-{i}",
                "cpus_per_task": 8,
                "priority": 100,
            }
            rivals.append(int(api.post("/v1/jobs", rival)["job_id"]))

    took = [
        e["ts"]
        for e in api.events()
        if e["kind"] == "lease.take" and "cluster" in (e.get("message") or "")
    ]
    if took:
        wait = max(took) + down_timeout + 0.5 - time.time()
        if wait > 0:
            time.sleep(wait)

    t_kill, agent_argv, agent_env = kill_node(state, victim)
    res: dict[str, Any] = {"mode": mode, "job_id": jid, "victim": victim, "before": before}
    limit = down_timeout + float(tm["kill_wait"]) + 60.0 + COMPETITORS * busy
    rebooted = not busy
    while True:
        if not rebooted and any(
            n["name"] == victim and n["down"] for n in api.get("/v1/nodes")["nodes"]
        ):
            restart_agent(state, victim, agent_argv, agent_env)
            rebooted = True
        job = api.job(jid)
        if job["state"] == "RUNNING" and job["restart_count"] >= 1:
            res["running_s"] = time.time() - t_kill
            att = job["attempts"][-1]
            res["recovery_s"] = float(att["start_time"]) - t_kill
            res["after"] = att["nodes"]
            break
        if job["state"] not in ("RUNNING", "PENDING", "STARTING", "COMPLETING"):
            raise RuntimeError(f"job {jid} ended {job['state']} ({job['reason']})")
        if time.time() - t_kill > limit:
            raise RuntimeError(
                f"job {jid} not running again {limit:g}s after the kill: {job['state']} "
                f"({job['reason']})"
            )
        time.sleep(POLL_S)
    if rivals:
        ahead = [
            r for r in rivals if (api.job(r).get("start_time") or 1e18) < t_kill + res["recovery_s"]
        ]
        res["competitors_first"] = len(ahead)
    events = api.events()
    downs = [e for e in events if e["kind"] == "node.down" and e["node"] == victim]
    if downs:
        res["down_s"] = float(downs[0]["ts"]) - t_kill
    kinds = [e["kind"] for e in events if e.get("job_id") == jid]
    if EXPECTED_EVENT[mode] not in kinds:
        raise RuntimeError(f"{mode}: job {jid} restarted without a {EXPECTED_EVENT[mode]} event")
    log(
        f"{mode} run {k}: killed {victim}; DOWN {res.get('down_s', float('nan')):.2f}s, running "
        f"again on {','.join(res['after'])} {res['recovery_s']:.2f}s after the kill"
    )
    return res


# --- torchrun: real elastic training (--torchrun) -----------------------------------------------

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(os.environ.get("TOOLS_VENV") or REPO / ".venv-tools")
TORCH_MODES: dict[str, dict[str, Any]] = {
    "nokill": {"nodes": 2, "spares": 1, "requeue": True, "no_kill": True},
    "restart": {"nodes": 2, "spares": 1, "requeue": True},
}
TORCH_STEPS = 400
TORCH_PACE = 0.03
TORCH_TRAIN = """\
import json, os, sys, time
import torch
import torch.distributed as dist

out, total = sys.argv[1], int(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
node = os.environ.get("PHX_NODENAME", "?")


def note(**kv):
    kv.update(t=time.time(), node=node, rank=rank, world=world, pid=os.getpid())
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(kv) + "\\n")


dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
latest = os.path.join(out, "latest")
step = 0
if os.path.exists(latest):
    state = torch.load(open(latest).read().strip())
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
note(ev="start", step=step)
first = True
while step < total:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    loss = ((ddp(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if first:
        note(ev="trained", step=step)
        first = False
    if step % 10 == 0 and rank == 0:
        path = os.path.join(out, f"ckpt-{step}.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                   path + ".tmp")
        os.replace(path + ".tmp", path)
        with open(latest + ".tmp", "w") as f:
            f.write(path)
        os.replace(latest + ".tmp", latest)
        note(ev="saved", step=step)
    time.sleep(float(os.environ.get("PACE", "0")))
note(ev="done", step=step)
dist.barrier()
dist.destroy_process_group()
"""
TORCH_BATCH = """#!/bin/bash
srun --ntasks-per-node=1 torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 \\
    --rdzv-backend=phalanx --rdzv-id=$SLURM_JOB_ID {train} {out} {steps}
"""


def backend_site(where: Path) -> str:
    """The backend's distribution metadata as `pip install --no-deps phalanx` leaves it (its
    torchrun.handlers entry point), and a PYTHONPATH with it and this checkout's source."""
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    version = meta["project"]["version"]
    info = where / f"phalanx-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: phalanx\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
            for group, items in meta["project"]["entry-points"].items()
        )
    )
    return f"{where}:{REPO / 'src'}"


def kill_node_whole(state: Path, node: str) -> float:
    """`kill_node`, plus the node's step tasks (srun's): their shepherds and every process
    whose PHX_TASK_DIR is under the node's state dir (srun's task, torchrun, its workers)."""
    t_kill, _argv, _env = kill_node(state, node)
    root = state / "nodes" / node
    for task in sorted((root / "steps").glob("*.*.*")):
        shep = read_json(task / "shepherd.pid")
        if isinstance(shep, dict) and isinstance(shep.get("pid"), int):
            with contextlib.suppress(ProcessLookupError):
                os.kill(shep["pid"], signal.SIGKILL)
    marker = f"PHX_TASK_DIR={root}/".encode()
    for _ in range(3):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if marker in env:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry), signal.SIGKILL)
    return t_kill


def _train_events(out: Path) -> list[dict[str, Any]]:
    try:
        lines = (out / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out_: list[dict[str, Any]] = []
    for ln in lines:
        with contextlib.suppress(ValueError):
            out_.append(json.loads(ln))
    return out_


def torch_run(mode: str, k: int, keep: bool = False) -> dict[str, Any]:
    """One cluster (3 nodes), one torchrun job in `mode`, rank 1's node killed."""
    with cluster(keep, 3) as (url, state):
        api = common.Api(url, timeout=30.0)
        try:
            return _torch_run(api, state, mode, k)
        except Exception:
            log(f"{mode} run {k} failed; controller log:\n{common.controller_log_tail(state, 25)}")
            raise
        finally:
            api.http.close()


def _torch_run(api: common.Api, state: Path, mode: str, k: int) -> dict[str, Any]:
    tm = api.get("/v1/cluster")["this_controller"]["timing"]
    common.check_timing(tm, TIMING)
    work = state / "bench-torchrun"
    out = work / "out"
    out.mkdir(parents=True)
    train = work / "train.py"
    train.write_text(TORCH_TRAIN)
    bin_dir = str(Path(sys.executable).parent)
    spec = {
        "script": TORCH_BATCH.format(train=train, out=out, steps=TORCH_STEPS),
        "output": str(work / "job.out"),
        "workdir": str(work),
        "name": f"torchrun-{mode}",
        "cpus_per_task": 8,  # a whole node per rank
        "env": {
            "PATH": f"{bin_dir}:{TOOLS / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": backend_site(work / "site"),
            "PACE": str(TORCH_PACE),
        },
        **TORCH_MODES[mode],
    }
    jid = int(api.post("/v1/jobs", spec)["job_id"])
    deadline = time.monotonic() + 240
    while not any(e["ev"] == "saved" and e["step"] >= 20 for e in _train_events(out)):
        job = api.job(jid)
        if job["state"] not in ("PENDING", "STARTING", "RUNNING"):
            raise RuntimeError(f"job {jid} ended {job['state']} ({job['reason']}) before training")
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {jid} not training after 240s")
        time.sleep(0.2)
    before = api.job(jid)["attempts"][-1]["nodes"]
    victim = before[1]
    t_kill = kill_node_whole(state, victim)
    res: dict[str, Any] = {"mode": mode, "job_id": jid, "victim": victim, "before": before}
    limit = time.monotonic() + 180
    while True:
        again = [e for e in _train_events(out) if e["ev"] == "trained" and e["t"] > t_kill]
        if again:
            res["training_s"] = min(e["t"] for e in again) - t_kill
            break
        job = api.job(jid)
        if job["state"] not in ("PENDING", "STARTING", "RUNNING", "COMPLETING"):
            raise RuntimeError(f"job {jid} ended {job['state']} ({job['reason']})")
        if time.monotonic() > limit:
            raise RuntimeError(f"job {jid}: no training 180s after the kill")
        time.sleep(POLL_S)
    starts = [e["t"] for e in _train_events(out) if e["ev"] == "start" and e["t"] > t_kill]
    if starts:
        res["workers_s"] = min(starts) - t_kill
    events = [e for e in api.events() if e.get("job_id") in (jid, None)]
    firsts = {}
    for e in events:
        if e["ts"] >= t_kill:
            firsts.setdefault(e["kind"], float(e["ts"]) - t_kill)
    downs = [e for e in api.events() if e["kind"] == "node.down" and e["node"] == victim]
    if downs:
        res["down_s"] = float(downs[0]["ts"]) - t_kill
    kinds = [e["kind"] for e in api.events() if e.get("job_id") == jid]
    want = "job.node_left" if mode == "nokill" else "job.restart"
    if want not in kinds:
        raise RuntimeError(f"{mode}: job {jid} recovered without a {want} event: {kinds}")
    if mode == "nokill" and ("job.requeue" in kinds or "job.restart" in kinds):
        raise RuntimeError(f"nokill: job {jid} was requeued: {kinds}")
    res["regroup_s"] = firsts.get(want)
    job = api.job(jid)
    res["after"] = job["attempts"][-1]["nodes"]
    res["attempts"] = len(job["attempts"])
    log(
        f"torchrun {mode} run {k}: killed {victim}; DOWN {res.get('down_s', float('nan')):.2f}s, "
        f"workers {res.get('workers_s', float('nan')):.2f}s, training again "
        f"{res['training_s']:.2f}s after the kill on {','.join(res['after'])}"
    )
    api.post("/v1/jobs/cancel", {"jobs": [str(jid)]})
    return res


def torch_table(results: dict[str, list[dict[str, Any]]], timing: dict[str, Any]) -> str:
    head = (
        f"{'mode':8} {'runs':>4} {'training median':>16} {'max':>7} {'down':>6} "
        f"{'regroup':>8} {'workers':>8}  attempts  nodes after"
    )
    lines = [
        "Phalanx recovery of a torchrun job (DDP, CPU, gloo): seconds from SIGKILL of rank 1's "
        "node to the new group's first training step (medians)",
        f"timing: {common.timing_text(timing, SHOWN_TIMING)}",
        head,
        "-" * len(head),
    ]

    def med(runs: list[dict[str, Any]], key: str) -> float:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    for mode, runs in results.items():
        rec = _stats([r["training_s"] for r in runs])
        lines.append(
            f"{mode:8} {len(runs):>4} {rec['median']:>16.2f} {rec['max']:>7.2f} "
            f"{med(runs, 'down_s'):>6.2f} {med(runs, 'regroup_s'):>8.2f} "
            f"{med(runs, 'workers_s'):>8.2f}  {runs[-1]['attempts']:>8}  {','.join(runs[-1]['after'])}"
        )
    lines.append(
        "nokill: --no-kill, the job regroups in its attempt (spare in rank 1's place, survivor's "
        "torchrun re-forms the group); restart: the whole job restarts on its reserved nodes"
    )
    return "\n".join(lines)


def measure(mode: str, runs: int, busy: float = 0.0) -> list[float]:
    """Seconds from a node failure to the job running again, one value per run.

    ``busy``: 0 for a cluster with free nodes; else competitors run this long (see the module
    doc)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    return [one_run(mode, k, busy=busy)["recovery_s"] for k in range(1, runs + 1)]


def _stats(vals: list[float]) -> dict[str, float]:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def table(results: dict[str, list[dict[str, Any]]], timing: dict[str, Any], busy: float) -> str:
    head = (
        f"{'mode':8} {'runs':>4} {'recovery median':>16} {'max':>7} {'detect median':>14} "
        f"{'restart after DOWN':>19}  nodes before -> after"
    )
    lines = [
        "Phalanx recovery: seconds from SIGKILL of a node (agent + job processes) to the job "
        "running again",
        f"timing: {common.timing_text(timing, SHOWN_TIMING)}",
        (
            f"busy cluster: no free node, {COMPETITORS} competitors (priority 100, sleep "
            f"{busy:g}s) queued, the failed node back as soon as it is DOWN"
            if busy
            else f"idle cluster: {NODES} nodes, free nodes to restart on"
        ),
        head,
        "-" * len(head),
    ]
    for mode, runs in results.items():
        rec = _stats([r["recovery_s"] for r in runs])
        downs = [r["down_s"] for r in runs if "down_s" in r]
        det = statistics.median(downs) if downs else float("nan")
        after = statistics.median([r["recovery_s"] - r["down_s"] for r in runs if "down_s" in r])
        sizes = f"{len(runs[-1]['before'])} -> {len(runs[-1]['after'])}"
        if busy:
            ahead = statistics.median([r.get("competitors_first", 0) for r in runs])
            sizes += f"; competitors started first: {ahead:g}"
        lines.append(
            f"{mode:8} {len(runs):>4} {rec['median']:>16.2f} {rec['max']:>7.2f} {det:>14.2f} "
            f"{after:>19.2f}  {sizes}"
        )
    lines.append(
        "requeue: a plain --requeue job goes back through the queue; elastic (--nodes=2-4) and "
        "spare (--spares=1) restart on reserved nodes with no queue wait"
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    p.add_argument(
        "--mode",
        choices=sorted({*MODES, *TORCH_MODES}),
        action="append",
        help="only this mode (repeatable)",
    )
    p.add_argument(
        "--torchrun",
        action="store_true",
        help="a real torchrun job (modes nokill, restart): time to training again",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep each run's state dir (logs, DB)")
    p.add_argument(
        "--busy",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="a full cluster with a queue of competitors that run this long (default 0: idle)",
    )
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.busy < 0:
        p.error("--busy must not be negative")
    timing = common.checked_timings(["fast"], {"fast": TIMING}, SHOWN_TIMING)["fast"]
    if args.torchrun:
        return torch_main(args, timing)
    modes = args.mode or list(MODES)
    if any(m not in MODES for m in modes):
        p.error(f"modes {', '.join(TORCH_MODES)} need --torchrun")
    load_before = busy_before()
    results = {
        m: [one_run(m, k, args.keep, args.busy) for k in range(1, args.runs + 1)] for m in modes
    }
    load_after = os.getloadavg()[0]
    print(table(results, timing, args.busy))
    print(host_line(load_before, load_after))
    if args.json:
        doc = {
            "results": {
                m: {"summary": _stats([r["recovery_s"] for r in runs]), "runs": runs}
                for m, runs in results.items()
            },
            "timing": timing,
            "params": {
                "runs": args.runs,
                "nodes": NODES,
                "busy": args.busy,
                "modes": {m: MODES[m] for m in modes},
            },
            "host": host_info(load_before, load_after),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def torch_main(args: argparse.Namespace, timing: dict[str, Any]) -> int:
    modes = args.mode or list(TORCH_MODES)
    unknown = [m for m in modes if m not in TORCH_MODES]
    if unknown:
        raise SystemExit(f"--torchrun takes the modes {', '.join(TORCH_MODES)}, not {unknown}")
    py = TOOLS / "bin" / "python"
    if not py.exists() or subprocess.run([py, "-c", "import torch"]).returncode:
        raise SystemExit(f"no PyTorch in {py}: `bash scripts/ensure-tools.sh` installs it")
    load_before = busy_before()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for k in range(1, args.runs + 1):  # interleaved: both modes see the same host load
        for m in modes:
            results[m].append(torch_run(m, k, args.keep))
    load_after = os.getloadavg()[0]
    print(torch_table(results, timing))
    print(host_line(load_before, load_after))
    if args.json:
        doc = {
            "results": {
                m: {"summary": _stats([r["training_s"] for r in runs]), "runs": runs}
                for m, runs in results.items()
            },
            "timing": timing,
            "params": {"runs": args.runs, "steps": TORCH_STEPS, "modes": TORCH_MODES},
            "host": host_info(load_before, load_after),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
