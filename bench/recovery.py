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
        "--mode", choices=sorted(MODES), action="append", help="only this mode (repeatable)"
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
    modes = args.mode or list(MODES)
    timing = common.checked_timings(["fast"], {"fast": TIMING}, SHOWN_TIMING)["fast"]
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


if __name__ == "__main__":
    sys.exit(main())
