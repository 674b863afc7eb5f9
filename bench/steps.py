#!/usr/bin/env python3
"""Job step benchmark: how fast `srun` starts a step inside an allocation (a benchmark, not a test).

Each run starts a fresh local cluster of 4 nodes with real processes

    python -m phalanx up --detach --state-dir TMP --port FREE --nodes 4 --cpus 8 --mem 16G

and submits one 4-node job (`-N 4`, one task per node) whose batch script, on the first node,
measures with the shell's own clock (`$EPOCHREALTIME`) and writes what it saw to a file:

  start     time from just before `srun -N 4 ...` to the moment every one of its 4 tasks is
            running (each task writes `$EPOCHREALTIME` first thing; the latest of the four,
            minus the time before srun), `--samples` times per run. This includes srun's own
            start-up (a Python process, the thin client), the job's srun helper, the step's
            creation on the controller, the agents' wakeup (long-poll), one shepherd per task
            and the task's exec.
  loop      trivial steps per second: a loop of `--loop` x `srun true` (4 tasks, one per node,
            the job's layout), each srun waited for; and the same with `srun -n 1 true`.

The job's first srun (`srun -n 1 true`, not measured) also starts the job's srun helper on the
batch host (docs/slurm.md, "srun's helper"): every measured srun is the thin client that hands
its step to it.  For each loop the benchmark also reports the CPU time spent per step by each
kind of process, read from /proc around the loop (the script waits for a go file before each
loop, so the sampling is outside the timed part): the controller, the 4 agents, the srun helper,
and "srun+shell" (the batch shell and the sruns it waited for).  The shepherds and tasks are not
in it (they are new processes each step); "machine" is every CPU's busy time from /proc/stat
(those processes, the shepherds, the tasks and the kernel's work for them, plus whatever else
runs: measure on a quiet machine).  The controller and the agents also spend CPU when
no step runs (heartbeats, exit watchers, scheduler ticks); that idle rate is sampled for
`--idle` seconds before each loop, and the "net of idle" figures take it away for the loop's
duration, so that runs at different rates compare (a slow run on a loaded machine pays more
seconds of idle cost per step).  On a shared machine these CPU figures are what to compare;
the rates are the idle-machine figures the bars are about.

Results are the median (min, max) over `--runs` runs beside the bars of issue 10 (a step on 4
nodes starts in under 0.2 s; at least 20 trivial steps/s). Slurm 22.05 was not measured here
(no slurmctld on this machine); the method is the one to use for it: the same script run by
Slurm's sbatch on 4 nodes.

    .venv/bin/python bench/steps.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import busy_before, host_line, log

BARS = {"start_s": (0.2, False), "loop_per_s": (20.0, True), "loop1_per_s": (20.0, True)}
LABELS = {
    "start_s": ("srun -N 4: all tasks running", "s"),
    "loop_per_s": ("srun true (4 tasks) loop", "steps/s"),
    "loop1_per_s": ("srun -n 1 true loop", "steps/s"),
}

SCRIPT = """#!/bin/bash
#SBATCH -N 4
#SBATCH --ntasks-per-node=1
out={out}
echo $$ > $out/shell
srun -n 1 true   # warm the nodes' page cache, start the srun helper: not measured
for i in $(seq {samples}); do
  d=$out/start.$i; mkdir -p $d
  t0=$EPOCHREALTIME
  srun -N 4 bash -c 'echo $EPOCHREALTIME > '$d'/$SLURM_PROCID'
  echo "$t0" > $d/t0
done
await() {{ touch $out/ready.$1; while [ ! -e $out/go.$1 ]; do sleep 0.02; done; }}
await 1
t0=$EPOCHREALTIME
for i in $(seq {loop}); do srun true; done
t1=$EPOCHREALTIME
await 2
t1b=$EPOCHREALTIME
for i in $(seq {loop}); do srun -n 1 true; done
t2=$EPOCHREALTIME
echo "$t0 $t1 $t1b $t2" > $out/loop
await 3   # alive until its CPU time is read
"""

KINDS = ("controller", "agents", "srun helper", "srun+shell")
IDLE_KINDS = ("controller", "agents", "machine")  # what runs when no step does
MACHINE = "machine"  # every CPU's busy time: the above, shepherds, tasks and the kernel


def _machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, children: bool) -> float:
    """utime+stime (and the waited-for children's, for the batch shell) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def _cluster_processes(state: Path) -> dict[str, list[int]]:
    """The cluster's processes by kind, found by the state dir in their command lines."""
    found: dict[str, list[int]] = {k: [] for k in KINDS}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(state) not in cmd:
            continue
        if " controller " in cmd:
            found["controller"].append(int(d))
        elif " agent " in cmd:
            found["agents"].append(int(d))
        elif "phalanx.slurm.srun.helper" in cmd:
            found["srun helper"].append(int(d))
    return found


def _cpu_by_kind(procs: dict[str, list[int]]) -> dict[str, float]:
    by_kind = {k: sum(_cpu_s(p, k == "srun+shell") for p in pids) for k, pids in procs.items()}
    return {**by_kind, MACHINE: _machine_cpu_s()}


def _await_file(path: Path, deadline: float, what: str) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def _loop_cpu(
    out: Path, state: Path, loop: int, deadline: float, idle_s: float
) -> dict[str, dict[str, float]]:
    """Release each loop of the script in turn; CPU ms per step by kind, and the load.

    Before each loop, the idle CPU rate of the controller and the agents is sampled for
    `idle_s` (heartbeats, the agents' exit watchers, the scheduler's ticks: a cost per second,
    not per step); "net" figures take that rate times the loop's duration away, so that runs
    at different rates (a loaded machine) compare."""
    res: dict[str, dict[str, float]] = {}
    for n, name in ((1, "loop"), (2, "loop1")):
        _await_file(out / f"ready.{n}", deadline, f"the job's loop {n}")
        procs = _cluster_processes(state)
        procs["srun+shell"] = [int((out / "shell").read_text())]  # the batch shell
        idle0 = _cpu_by_kind(procs)
        time.sleep(idle_s)
        before = _cpu_by_kind(procs)
        rate = {k: (before[k] - idle0[k]) / idle_s for k in IDLE_KINDS}
        t0 = time.monotonic()
        (out / f"go.{n}").touch()
        _await_file(out / f"ready.{n + 1}", deadline, f"the end of the job's loop {n}")
        took = time.monotonic() - t0
        after = _cpu_by_kind(procs)
        res[name] = {k: (after[k] - before[k]) / loop * 1000 for k in (*KINDS, MACHINE)}
        res[name]["load"] = os.getloadavg()[0]
        res[name]["idle_ms_per_s"] = (rate["controller"] + rate["agents"]) * 1000
        for k in (*KINDS, MACHINE):
            idle = rate[k] * took if k in IDLE_KINDS else 0.0
            res[name][f"net {k}"] = max(0.0, after[k] - before[k] - idle) / loop * 1000
    (out / "go.3").touch()
    return res


def one_run(i: int, args: argparse.Namespace, bindir: str) -> dict[str, Any]:
    state = common.state_dir("phalanx-bench-steps-")
    port = common.free_ports(1)
    out = state / "out"
    out.mkdir()
    up = ["--port", str(port), *common.node_args(4)]
    with common.phalanx_up(state, up, f"port {port}", keep=args.keep, leftovers=True):
        url = f"http://127.0.0.1:{port}"
        script = state / "steps.sh"
        script.write_text(SCRIPT.format(out=out, samples=args.samples, loop=args.loop))
        env = {
            **os.environ,
            "PHALANX_URL": url,
            "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        sub = subprocess.run(
            [f"{bindir}/sbatch", "--parsable", "-o", str(out / "job.out"), str(script)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if sub.returncode != 0:
            sub = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "phalanx",
                    "submit",
                    "-o",
                    str(out / "job.out"),
                    str(script),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
        jid = sub.stdout.strip().split()[-1]
        api = common.Api(url, timeout=30.0)
        deadline = time.monotonic() + args.timeout
        cpu = _loop_cpu(out, state, args.loop, deadline, args.idle)
        while True:
            job = api.job(int(jid))
            if job["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"run {i}: job {jid} still {job['state']} after {args.timeout}s")
            time.sleep(0.5)
        if job["state"] != "COMPLETED":
            raise SystemExit(
                f"run {i}: job {jid} ended {job['state']}: {(out / 'job.out').read_text()[-2000:]}"
            )
        starts = []
        for k in range(1, args.samples + 1):
            d = out / f"start.{k}"
            t0 = float((d / "t0").read_text())
            tasks = [float((d / str(t)).read_text()) for t in range(4)]
            starts.append(max(tasks) - t0)
        t0, t1, t1b, t2 = (float(x) for x in (out / "loop").read_text().split())
        res = {
            "start_s": statistics.median(starts),
            "start_samples": starts,
            "loop_per_s": args.loop / (t1 - t0),
            "loop1_per_s": args.loop / (t2 - t1b),
            "cpu_ms_per_step": cpu,
        }
        log(
            f"run {i}: start median {res['start_s']:.3f}s (min {min(starts):.3f}), "
            f"{res['loop_per_s']:.1f} steps/s (4 tasks), {res['loop1_per_s']:.1f} steps/s (1 task)"
        )
        for name, per in cpu.items():
            log(
                f"  {name}: CPU ms/step "
                + ", ".join(f"{k} {per[k]:.1f}" for k in KINDS)
                + f" (load average {per['load']:.1f}); net of idle "
                + ", ".join(f"{k} {per['net ' + k]:.1f}" for k in KINDS)
                + f" (idle {per['idle_ms_per_s']:.0f} ms/s); machine {per[MACHINE]:.1f}, "
                + f"net {per['net ' + MACHINE]:.1f}"
            )
        return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--samples", type=int, default=10, help="step start samples per run")
    p.add_argument("--loop", type=int, default=40, help="trivial steps per loop")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--idle", type=float, default=2.0, help="seconds of idle CPU sampled before each loop"
    )
    p.add_argument("--keep", action="store_true", help="keep the state dirs")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    bindir = str(Path(sys.executable).parent)
    before = busy_before()
    runs = [one_run(i + 1, args, bindir) for i in range(args.runs)]
    after = os.getloadavg()[0]
    print(f"Phalanx job step benchmark: medians over {args.runs} run(s), 4-node allocation")
    print(f"{'metric':36} {'median':>8} {'min':>8} {'max':>8}  {'unit':8} {'bar':>8}  ok")
    print("-" * 84)
    out: dict[str, Any] = {}
    for key, (label, unit) in LABELS.items():
        vals = [r[key] for r in runs]
        med = statistics.median(vals)
        bar, higher = BARS[key]
        ok = med >= bar if higher else med < bar
        sign = ">=" if higher else "<"
        print(
            f"{label:36} {med:8.3f} {min(vals):8.3f} {max(vals):8.3f}  {unit:8} "
            f"{sign}{bar:>6g}  {'yes' if ok else 'NO'}"
        )
        out[key] = {"median": med, "min": min(vals), "max": max(vals), "bar": bar, "ok": ok}
    for name, label in (("loop", "srun true (4 tasks)"), ("loop1", "srun -n 1 true")):
        for prefix, what in (("", ""), ("net ", " net of idle")):
            per = {
                k: statistics.median(r["cpu_ms_per_step"][name][prefix + k] for r in runs)
                for k in KINDS
            }
            print(
                f"CPU ms per step{what}, {label}: "
                + ", ".join(f"{k} {v:.1f}" for k, v in per.items())
                + f" (total {sum(per.values()):.1f}, shepherds and tasks not counted)"
            )
            machine = statistics.median(r["cpu_ms_per_step"][name][prefix + MACHINE] for r in runs)
            print(
                f"machine CPU ms per step{what}, {label}: {machine:.1f} "
                "(every process and the kernel: shepherds and tasks too)"
            )
    loads = [r["cpu_ms_per_step"][n]["load"] for r in runs for n in ("loop", "loop1")]
    print(f"load average during the loops: median {statistics.median(loads):.1f}")
    print("Slurm 22.05: not measured on this machine (no slurmctld); run the same script there")
    print(host_line(before, after))
    if args.json:
        args.json.write_text(json.dumps({"results": out, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
