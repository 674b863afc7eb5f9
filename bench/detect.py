#!/usr/bin/env python3
"""Failure detection and requeue latency benchmark for Phalanx (a benchmark, not a test).

Each run starts a fresh local cluster with real processes

    python -m phalanx up --detach --state-dir TMP --port FREE --nodes 4 --cpus 8 --mem 16G

with the timing of one setting passed as PHALANX_TIMING_<NAME> environment variables (the
controller reads them; agents take the timing from the controller they register with), and
stops it with `phalanx down` in a `finally`. In each run:

  1. submit one requeue-able job (`sleep 600`, `"requeue": true`, no nodelist: a nodelist
     would pin every attempt) and wait until it is RUNNING and its process has started;
  2. wait until the `cluster` lease holder has held its lease for one full node_down_timeout
     (a new holder waits that long before it marks anything DOWN, so killing earlier would
     measure the start-up grace, not the failure detector);
  3. SIGKILL the agent of the node the job runs on (pid in `<state>/run/agent-NODE.pid`) and
     note the client's wall clock (the kill time);
  4. poll every 50 ms until the node is DOWN, the job is RUNNING again elsewhere and the first
     attempt's job process is gone. The agent is dead, so that process stops only when its
     shepherd self-fences (fence_timeout without a fresh agent heartbeat file).

Measured from the kill time:

  down        GET /v1/nodes first shows the node's state containing DOWN (client poll)
  down_event  the `ts` of the node's `node.down` event in GET /v1/events (server clock)
  running     GET /v1/jobs/{id} first shows RUNNING with restart_count >= 1 on another node
  restart     the job's own start_time of the new attempt
  old_gone    the first attempt's job process no longer exists (client poll of /proc)

`overlap` counts runs where the old process was still alive when the new attempt started
(the fence rules are meant to make that impossible).

Cleanup after each run, after `phalanx down`: any shepherd still alive (pid and start time in
`<state>/nodes/*/tasks/*/shepherd.pid`) and any job process group still alive (`job.json`) are
SIGKILLed, so nothing outlives the run.

Two settings by default: the built-in defaults and a tightened set (checked against the
timing rules of phalanx.config before the runs). Results are the median (min, max) over
`--runs` runs per setting, with the Slurm 22.05 reference and the bar. `--json FILE` also
writes them as JSON.

    .venv/bin/python bench/detect.py --runs 5
    .venv/bin/python bench/detect.py --quick
    .venv/bin/python bench/detect.py --only tight --ignore-sigterm   # job ignores SIGTERM
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from phalanx.config import Timing

SLEEP_JOB = "#!/bin/sh\nsleep 600\n"
# `trap '' TERM` makes the shell and (inherited) sleep ignore SIGTERM, so only SIGKILL stops it
STUBBORN_JOB = "#!/bin/sh\ntrap '' TERM\nsleep 600\n"
POLL_S = 0.05

# Timing overrides per setting (PHALANX_TIMING_<NAME>); everything else keeps its default.
SETTINGS: dict[str, dict[str, float]] = {
    "default": {},
    "tight": {
        "heartbeat_interval": 0.5,
        "node_down_timeout": 4.0,
        "fence_timeout": 2.0,
        "fence_kill_grace": 0.5,
        "fence_margin": 0.5,
    },
}
SHOWN_TIMING = (
    "heartbeat_interval",
    "node_down_timeout",
    "fence_timeout",
    "fence_kill_grace",
    "fence_margin",
    "kill_wait",
)

# name: (label, Slurm 22.05 reference with SlurmdTimeout=10 s, bar (default setting only))
METRICS: dict[str, tuple[str, float | None, float | None]] = {
    "down_s": ("kill -> node DOWN (client poll)", 19.0, None),
    "down_event_s": ("kill -> node.down event", 19.0, None),
    "running_s": ("kill -> RUNNING elsewhere (client)", 143.0, 15.0),
    "restart_s": ("kill -> new attempt start_time", 143.0, 15.0),
    "old_gone_s": ("kill -> old job process gone", None, None),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def busy_cpus(seconds: float = 1.0) -> float:
    """CPUs kept busy by anything on the host over a short sample (Linux /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return float("nan")
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, starttime: int | None = None) -> bool:
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return starttime is None or st[1] == starttime


def group_alive(pgid: int) -> bool:
    """A process group with a live (not zombie) member; zombies await a slow PID 1."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def kill_leftovers(state: Path) -> list[str]:
    """SIGKILL every shepherd and job process group of this cluster that is still alive."""
    killed = []
    for task in sorted(state.glob("nodes/*/tasks/*")):
        shep = read_json(task / "shepherd.pid")
        if isinstance(shep, dict) and isinstance(shep.get("pid"), int):
            start = shep.get("starttime")
            if alive(shep["pid"], start if isinstance(start, int) else None):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(shep["pid"], signal.SIGKILL)
                    killed.append(f"shepherd {shep['pid']} ({task.parent.parent.name})")
        job = read_json(task / "job.json")
        if isinstance(job, dict) and isinstance(job.get("pgid"), int):
            pgid = job["pgid"]
            if not group_alive(pgid):
                continue
            # only a group whose leader is still this task's job (its argv names the task dir),
            # or whose leader is gone (then the group id cannot have been reused)
            try:
                leader_cmd = Path(f"/proc/{pgid}/cmdline").read_bytes()
            except OSError:
                leader_cmd = None
            if leader_cmd is None or str(state).encode() in leader_cmd:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                    killed.append(f"job group {pgid} ({task.parent.parent.name})")
    return killed


@contextlib.contextmanager
def cluster(nodes: int, timing: dict[str, float], keep: bool) -> Iterator[tuple[str, Path, float]]:
    state = Path(tempfile.mkdtemp(prefix="phalanx-detect-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_TIMING_")}
    env.pop("PHALANX_CONFIG", None)
    for k, v in timing.items():
        env[f"PHALANX_TIMING_{k.upper()}"] = repr(float(v))
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "up",
        "--detach",
        "--state-dir",
        str(state),
        "--port",
        str(port),
        "--nodes",
        str(nodes),
        "--cpus",
        "8",
        "--mem",
        "16G",
    ]
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        log(f"cluster up in {time.monotonic() - t0:.1f}s (state {state}, port {port})")
        yield f"http://127.0.0.1:{port}", state, time.time()
    finally:
        subprocess.run(
            [sys.executable, "-m", "phalanx", "down", "--state-dir", str(state)],
            stdout=subprocess.DEVNULL,
            check=False,
            env=env,
        )
        # `down` asks every shepherd to stop; give them a moment, then kill what is left
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(
            group_alive(int(p["pgid"]))
            for p in (read_json(f) for f in state.glob("nodes/*/tasks/*/job.json"))
            if isinstance(p, dict) and isinstance(p.get("pgid"), int)
        ):
            time.sleep(0.1)
        killed = kill_leftovers(state)
        if killed:
            log(f"killed leftovers: {', '.join(killed)}")
        if keep:
            log(f"kept {state}")
        else:
            subprocess.run(["rm", "-rf", str(state)], check=False)


class Api:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(
            base_url=url,
            timeout=httpx.Timeout(30.0, connect=5.0),
            headers={"X-Phalanx-User": getpass.getuser()},
        )

    def post(self, path: str, body: Any) -> Any:
        r = self.http.post(path, json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params)
        if r.status_code >= 400:
            raise RuntimeError(f"GET {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def job(self, jid: int) -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{jid}")["jobs"][0])

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        since = 0
        while True:
            batch = self.get("/v1/events", since=since, limit=10_000)["events"]
            out += batch
            if len(batch) < 10_000:
                return out
            since = batch[-1]["id"]


def controller_log_tail(state: Path, lines: int = 25) -> str:
    out = []
    for f in sorted((state / "logs").glob("controller-*.log")):
        with contextlib.suppress(OSError):
            text = f.read_text().splitlines()[-lines:]
            out.append(f"--- {f.name} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(out)


def one_run(args: argparse.Namespace, setting: str, k: int) -> dict[str, Any]:
    timing = SETTINGS[setting]
    with cluster(args.nodes, timing, args.keep) as (url, state, _t_up):
        api = Api(url)
        try:
            return measure(api, state, setting, k, args)
        except Exception:
            log(f"{setting} run {k} failed; controller log:\n{controller_log_tail(state)}")
            raise
        finally:
            api.http.close()


def measure(
    api: Api, state: Path, setting: str, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    tm = api.get("/v1/cluster")["this_controller"]["timing"]
    for name, want in SETTINGS[setting].items():
        if abs(float(tm[name]) - want) > 1e-9:
            raise RuntimeError(f"controller runs {name}={tm[name]}, expected {want}")
    down_timeout = float(tm["node_down_timeout"])

    script = STUBBORN_JOB if args.ignore_sigterm else SLEEP_JOB
    jid = api.post(
        "/v1/jobs",
        {
            "script": script,
            "requeue": True,
            "output": "/dev/null",
            "workdir": "/tmp",
            "name": "detect",
        },
    )["job_id"]

    # 1. the first attempt runs, and its process exists
    deadline = time.monotonic() + 60
    while True:
        job = api.job(jid)
        if job["state"] == "RUNNING" and job["nodelist"]:
            node = job["nodelist"]
            # the task directory is named after the attempt id
            aids = [a["id"] for a in job.get("attempts") or [] if a["state"] == "RUNNING"]
            info = None
            for aid in aids:
                info = read_json(state / "nodes" / node / "tasks" / str(aid) / "job.json")
            if isinstance(info, dict) and isinstance(info.get("pid"), int):
                old_pid = int(info["pid"])
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {jid} not running after 60s: {job['state']} {job['reason']}")
        time.sleep(POLL_S)
    old_start = proc_stat(old_pid)
    old_starttime = old_start[1] if old_start else None

    # 2. the cluster lease holder is past its start-up grace (one node_down_timeout)
    took = [
        e["ts"]
        for e in api.events()
        if e["kind"] == "lease.take" and "cluster" in (e.get("message") or "")
    ]
    if took:
        wait = max(took) + down_timeout + 0.5 - time.time()
        if wait > 0:
            log(f"{setting} run {k}: waiting {wait:.1f}s for the cluster lease's start-up grace")
            time.sleep(wait)

    # 3. kill the agent of the node the job runs on
    agent_pid = int((state / "run" / f"agent-{node}.pid").read_text().strip())
    nodes_before = {n["name"]: n for n in api.get("/v1/nodes")["nodes"]}
    last_hb = nodes_before[node]["last_heartbeat"]
    t_kill = time.time()
    os.kill(agent_pid, signal.SIGKILL)
    log(f"{setting} run {k}: job {jid} on {node}; SIGKILLed agent pid {agent_pid}")

    # 4. poll
    res: dict[str, Any] = {"node": node, "job_id": jid}
    if isinstance(last_hb, int | float):
        res["last_heartbeat_age_s"] = t_kill - last_hb
    limit = down_timeout + float(tm["fence_timeout"]) + float(tm["kill_wait"]) + 60.0
    t_new_start: float | None = None
    while True:
        now = time.time()
        if "down_s" not in res:
            for n in api.get("/v1/nodes")["nodes"]:
                if n["name"] == node and "DOWN" in n["state"]:
                    res["down_s"] = time.time() - t_kill
                    res["down_reason"] = n["down_reason"]
        if "running_s" not in res:
            job = api.job(jid)
            if (
                job["state"] == "RUNNING"
                and job["restart_count"] >= 1
                and job["nodelist"]
                and job["nodelist"] != node
            ):
                res["running_s"] = time.time() - t_kill
                t_new_start = float(job["start_time"])
                res["restart_s"] = t_new_start - t_kill
                res["new_node"] = job["nodelist"]
                res["restart_count"] = job["restart_count"]
            elif job["state"] not in ("RUNNING", "PENDING", "STARTING", "COMPLETING"):
                raise RuntimeError(
                    f"job {jid} ended {job['state']} ({job['reason']}) instead of being requeued"
                )
        if "old_gone_s" not in res and not alive(old_pid, old_starttime):
            res["old_gone_s"] = now - t_kill
        if all(key in res for key in ("down_s", "running_s", "old_gone_s")):
            break
        if now - t_kill > limit:
            missing = [m for m in ("down_s", "running_s", "old_gone_s") if m not in res]
            job = api.job(jid)
            raise RuntimeError(
                f"after {limit:g}s still waiting for {missing}: job {jid} {job['state']} "
                f"on {job['nodelist']} restart_count={job['restart_count']} "
                f"reason={job['reason']}"
            )
        time.sleep(POLL_S)

    downs = [e for e in api.events() if e["kind"] == "node.down" and e["node"] == node]
    if downs:
        res["down_event_s"] = float(downs[0]["ts"]) - t_kill
    assert t_new_start is not None
    # the old process was seen alive at a poll after the new attempt started => overlap
    res["overlap"] = t_kill + res["old_gone_s"] - POLL_S > t_new_start
    log(
        f"{setting} run {k}: DOWN {res['down_s']:.2f}s (event {res.get('down_event_s', 0):.2f}s), "
        f"running on {res['new_node']} {res['running_s']:.2f}s (start_time "
        f"{res['restart_s']:.2f}s), old process gone {res['old_gone_s']:.2f}s"
        + (" OVERLAP" if res["overlap"] else "")
    )
    return res


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in METRICS:
        vals = [r[key] for r in runs if key in r]
        if vals:
            out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    out["overlap_runs"] = sum(1 for r in runs if r.get("overlap"))
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'setting':8} {'metric':36} {'median':>7} {'min':>7} {'max':>7}  "
        f"{'slurm':>6} {'bar':>6}  ok"
    )
    lines = ["Phalanx failure detection: seconds after SIGKILL of the job's agent", head]
    lines.append("-" * len(head))
    for setting, res in results.items():
        t = res["timing"]
        lines.append(
            f"{setting}: "
            + ", ".join(f"{k}={t[k]:g}" for k in SHOWN_TIMING)
            + f"  ({res['nruns']} runs)"
        )
        s = res["summary"]
        for key, (label, ref, bar) in METRICS.items():
            if key not in s:
                continue
            m = s[key]
            bar_here = bar if setting == "default" else None
            ok = "" if bar_here is None else ("yes" if m["median"] < bar_here else "NO")
            lines.append(
                f"{setting:8} {label:36} {m['median']:7.2f} {m['min']:7.2f} {m['max']:7.2f}  "
                f"{'-' if ref is None else f'{ref:.0f}':>6} "
                f"{'-' if bar_here is None else f'<{bar_here:g}':>6}  {ok}"
            )
        lines.append(
            f"{setting:8} {'runs where old process outlived start':36} "
            f"{s['overlap_runs']:>7d} of {res['nruns']}"
        )
    lines.append(
        "slurm: Slurm 22.05 on this kind of machine with SlurmdTimeout tuned to 10 s (default "
        "300 s): node DOWN after ~19 s, requeued job running again after ~143 s"
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="runs per setting (default 5; 2 quick)")
    p.add_argument("--quick", action="store_true", help="2 runs per setting")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument(
        "--only", choices=sorted(SETTINGS), action="append", help="only this setting (repeatable)"
    )
    p.add_argument(
        "--ignore-sigterm",
        action="store_true",
        help="the job ignores SIGTERM (shows which grace the self-fence uses before SIGKILL)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep each run's state dir (logs, DB)")
    args = p.parse_args()
    if args.runs is None:
        args.runs = 2 if args.quick else 5
    if args.nodes < 2:
        p.error("--nodes must be at least 2 (the job must be able to run elsewhere)")
    settings = args.only or list(SETTINGS)

    timings = {}
    for name in settings:
        t = Timing(**SETTINGS[name])  # raises if the set breaks a timing rule
        timings[name] = t.model_dump()
        log(
            f"setting {name}: "
            + ", ".join(f"{k}={timings[name][k]:g}" for k in SHOWN_TIMING)
            + " (rules of phalanx.config hold)"
        )

    load_before = busy_cpus()
    if load_before > 0.3:
        log(
            f"warning: {load_before:.1f} of {os.cpu_count()} CPUs already busy before the runs: "
            "other processes compete with the cluster"
        )
    results: dict[str, dict[str, Any]] = {}
    for name in settings:
        runs = [one_run(args, name, k) for k in range(1, args.runs + 1)]
        results[name] = {
            "timing": timings[name],
            "overrides": SETTINGS[name],
            "nruns": len(runs),
            "summary": summarize(runs),
            "runs": runs,
        }
    load_after = os.getloadavg()[0]
    print(table(results))
    print(
        f"host: {os.cpu_count()} CPUs, {load_before:.2f} busy before the runs (1 s sample); "
        f"load average at the end {load_after:.2f}"
        + ("; job ignores SIGTERM" if args.ignore_sigterm else "")
    )
    if args.json:
        doc = {
            "results": results,
            "params": {
                "runs": args.runs,
                "nodes": args.nodes,
                "ignore_sigterm": args.ignore_sigterm,
            },
            "reference": {
                k: {"label": v[0], "slurm_22_05_slurmd_timeout_10s": v[1], "bar_default": v[2]}
                for k, v in METRICS.items()
            },
            "host": {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "busy_cpus_before": load_before,
                "loadavg_after": load_after,
            },
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
