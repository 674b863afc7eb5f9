"""The simulator's bars (issue 12): placements onto free capacity, and heartbeats at scale.

    python bench/sim.py placements --nodes 1000 --minutes 2 --runs 3
    python bench/sim.py heartbeats --nodes 10000 --minutes 2 --runs 3

Both run real controllers on a real store (`--store sqlite` or a database URL) with virtual
nodes (`phalanx sim`'s, sim/nodes.py) speaking the agent protocol; see docs/sim.md.

* placements: N nodes, a queue kept `--backlog` jobs deep with short single-CPU jobs (so
  capacity frees as fast as it is taken); the rate of attempts started per minute window. Bars:
  >= 2,000 jobs/s, and the last window's rate within 10% of the first's (the issue asks for 30
  minutes: `--minutes 30`).
* heartbeats: N nodes and no jobs, heartbeating at the interval the heartbeat rule gives
  (`Timing.for_cluster`); bars: no node falsely declared DOWN in the period (30 minutes in the
  issue), and the controllers below 70% of this machine's CPU.

Every run starts a fresh cluster. Printed: each run, medians over the runs, the load average
beside them (timings taken on a loaded machine are noisy: controller CPU seconds are printed
too), and as the last line

    sim: nodes=N jobs=M placements_per_s=Z false_down=K controller_cpu=P% detect_timeout=Ts
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.sim import workload as wl
from phalanx.sim.run import Options, Sim

WORKLOAD = {
    "seed": 1,
    "nodes": [{"share": 1.0, "cpus": 64, "mem": "256G"}],
    "users": [{"name": "bench", "account": "bench"}],
    "jobs": [{"count": 1}],
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_run(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    timing = {} if args.heartbeat_budget is None else {"heartbeat_budget": args.heartbeat_budget}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-sim-") as d:
        sim = Sim(
            Options(
                nodes=args.nodes,
                workload=wl.parse(WORKLOAD),
                controllers=args.controllers,
                store=args.store,
                state_dir=Path(d),
                timing=timing,
                progress=log,
            )
        )
        try:
            sim.start()
            if kind == "heartbeats":
                out = sim.idle(args.minutes * 60)
                out["placements_per_s"] = 0.0
                out["jobs"] = 0
            else:
                spec = {
                    "name": "fill",
                    "cpus_per_task": 1,
                    "mem_mb": 100,
                    "time_limit_s": 600,
                    "workdir": "/tmp",
                    "output": "/dev/null",
                    "wrap": f"sleep {args.job_seconds}; exit 0",
                }
                out = sim.sustain(args.minutes * 60, spec, args.backlog, window=args.window)
                out["jobs"] = out["placements"]
            out["heartbeat_interval"] = sim.timing.heartbeat_interval
            out["detect_timeout"] = sim.timing.node_down_timeout
            out["load"] = os.getloadavg()[0]
            return out
        finally:
            sim.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("placements", "heartbeats"))
    ap.add_argument("--nodes", type=int, default=None, help="1000 (placements), 10000")
    ap.add_argument("--minutes", type=float, default=2.0, help="length of one run (30: the bar)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--controllers", type=int, default=1)
    ap.add_argument("--store", default="sqlite", help="'sqlite' or a database URL")
    ap.add_argument("--backlog", type=int, default=5000, help="placements: jobs kept pending")
    ap.add_argument("--job-seconds", type=float, default=1.0, help="placements: job run time")
    ap.add_argument("--window", type=float, default=60.0, help="placements: seconds per window")
    ap.add_argument("--heartbeat-budget", type=float, default=None)
    args = ap.parse_args()
    if args.nodes is None:
        args.nodes = 10_000 if args.kind == "heartbeats" else 1000
    runs = []
    for i in range(args.runs):
        r = one_run(args, args.kind)
        runs.append(r)
        windows = " ".join(f"{w:.0f}" for w in r.get("per_window", []))
        log(
            f"run {i + 1}: placements/s {r['placements_per_s']:.0f}"
            + (f" (per window: {windows})" if windows else "")
            + (
                (
                    f", {r['heartbeats_per_s']:.0f} heartbeats/s, "
                    f"{r['cpu_ms_per_heartbeat'] or 0:.2f} ms controller CPU each"
                    if r["heartbeats_per_s"] is not None
                    else ", heartbeats/s unknown (/metrics did not answer)"
                )
                if "heartbeats_per_s" in r
                else ""
            )
            + f", controller CPU {r['controller_cpu_pct']:.0f}%, false DOWN {r['false_down']}, "
            f"heartbeat interval {r['heartbeat_interval']:g}s, detect timeout "
            f"{r['detect_timeout']:g}s, load {r['load']:.1f}"
        )

    def med(key: str) -> float:
        return float(statistics.median(float(r[key]) for r in runs))

    if args.kind == "placements":
        firsts = [r["per_window"][0] for r in runs if r["per_window"]]
        lasts = [r["per_window"][-1] for r in runs if r["per_window"]]
        if firsts and lasts and statistics.median(firsts) > 0:
            drift = statistics.median(lasts) / statistics.median(firsts) - 1
            print(
                f"first window {statistics.median(firsts):.0f}/s, last {statistics.median(lasts):.0f}/s "
                f"({drift:+.0%}; bar: within 10%); bar >= 2,000 jobs/s"
            )
    else:
        print(f"bars: false DOWN 0 over {args.minutes:g} min; controllers < 70% CPU")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(
        f"sim: nodes={args.nodes} jobs={int(med('jobs'))} "
        f"placements_per_s={med('placements_per_s'):.0f} false_down={int(med('false_down'))} "
        f"controller_cpu={med('controller_cpu_pct'):.0f}% detect_timeout={med('detect_timeout'):g}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
