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
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
from common import alive, busy_before, host_info, host_line, log, proc_stat, read_json, spread

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


@contextlib.contextmanager
def cluster(nodes: int, timing: dict[str, float], keep: bool) -> Iterator[tuple[str, Path, float]]:
    state = common.state_dir("phalanx-detect-")
    port = common.free_port()
    env = common.timing_env(timing, "PHALANX_TIMING_")
    env.pop("PHALANX_CONFIG", None)
    up_args = ["--port", str(port), *common.node_args(nodes)]
    with common.phalanx_up(state, up_args, f"port {port}", keep=keep, env=env, leftovers=True):
        yield f"http://127.0.0.1:{port}", state, time.time()


def one_run(args: argparse.Namespace, setting: str, k: int) -> dict[str, Any]:
    timing = SETTINGS[setting]
    with cluster(args.nodes, timing, args.keep) as (url, state, _t_up):
        api = common.Api(url, timeout=30.0)
        try:
            return measure(api, state, setting, k, args)
        except Exception:
            log(
                f"{setting} run {k} failed; controller log:\n{common.controller_log_tail(state, 25)}"
            )
            raise
        finally:
            api.http.close()


def measure(
    api: common.Api, state: Path, setting: str, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    tm = api.get("/v1/cluster")["this_controller"]["timing"]
    common.check_timing(tm, SETTINGS[setting])
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
    out = spread(runs, METRICS)
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
        lines.append(f"{setting}: {common.timing_text(t, SHOWN_TIMING)}  ({res['nruns']} runs)")
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

    timings = common.checked_timings(settings, SETTINGS, SHOWN_TIMING)

    load_before = busy_before()
    results: dict[str, dict[str, Any]] = {}
    for name in settings:
        runs = [one_run(args, name, k) for k in range(1, args.runs + 1)]
        results[name] = common.setting_result(timings[name], SETTINGS[name], runs, summarize(runs))
    load_after = os.getloadavg()[0]
    print(table(results))
    print(
        host_line(load_before, load_after)
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
            "host": host_info(load_before, load_after),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
