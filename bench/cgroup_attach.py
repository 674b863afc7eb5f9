#!/usr/bin/env python3
"""How long a freshly forked task takes to join its cgroups (a benchmark, not a test).

The shepherd's child joins its job's cgroups between fork and exec (agent/cgroups.py). Two
ways on cgroup v1, timed here in the child for every v1 hierarchy this process is in:

  procs   its pid to each hierarchy's cgroup.procs (cgroups.attach): the kernel takes its
          global threadgroup lock, whose write side waits for an RCU grace period when
          attaches are sporadic, as a step's tasks are;
  tasks0  0 to each hierarchy's tasks (cgroups.attach_self): the calling thread alone, which
          the kernel moves without that lock.

Each sample forks a child that joins a cgroup made for the benchmark (one per hierarchy,
removed afterwards), `--gap` seconds apart (sporadic attaches: a loop of short steps).
Printed: the median (min, max) milliseconds per attach over `--runs` runs of `--samples`
samples each, and the ratio. Needs root and cgroup v1 hierarchies.

    sudo .venv/bin/python bench/cgroup_attach.py --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

from common import busy_before, host_line


def _hierarchies() -> dict[str, Path]:
    """This process's cgroup in every v1 hierarchy mounted the usual way (controllers only)."""
    out: dict[str, Path] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if not names or names.startswith("name="):
            continue
        for name in names.split(","):
            d = Path(f"/sys/fs/cgroup/{name}{path}")
            if (d / "tasks").exists():
                out[name] = d
                break
    return out


def _make(parents: dict[str, Path]) -> list[Path]:
    made = []
    for name, parent in parents.items():
        d = parent / f"phx-bench-attach-{os.getpid()}"
        d.mkdir()
        made.append(d)
        if name == "cpuset":  # an empty cpuset takes no tasks
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((parent / f).read_text())
    return made


def _sample(dirs: list[Path], how: str) -> float:
    """Fork a child that joins `dirs` the `how` way; its time to do so, in ms."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            t0 = time.perf_counter()
            for d in dirs:
                name, value = ("tasks", b"0") if how == "tasks0" else ("cgroup.procs", None)
                fd = os.open(d / name, os.O_WRONLY)
                os.write(fd, value or str(os.getpid()).encode())
                os.close(fd)
            os.write(w, f"{(time.perf_counter() - t0) * 1000:.4f}".encode())
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    return float(data)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--gap", type=float, default=0.05, help="seconds between attaches")
    args = p.parse_args()
    parents = _hierarchies()
    if os.geteuid() != 0 or not parents:
        print("needs root and cgroup v1 hierarchies", file=sys.stderr)
        return 2
    before = busy_before("the attaches compete for CPU")
    dirs = _make(parents)
    medians: dict[str, list[float]] = {"procs": [], "tasks0": []}
    try:
        for _ in range(args.runs):
            for how in medians:
                samples = []
                for _ in range(args.samples):
                    samples.append(_sample(dirs, how))
                    time.sleep(args.gap)
                medians[how].append(statistics.median(samples))
    finally:
        for d in dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
    print(f"cgroup attach of a forked child, {len(dirs)} v1 hierarchies ({', '.join(parents)}),")
    print(f"{args.samples} attaches {args.gap:g}s apart per run, medians over {args.runs} runs")
    for how, label in (("procs", "cgroup.procs, by pid"), ("tasks0", "tasks, 0 (itself)")):
        v = medians[how]
        print(f"  {label:24} {statistics.median(v):8.3f} ms  (runs {min(v):.3f}-{max(v):.3f})")
    ratio = statistics.median(medians["procs"]) / max(statistics.median(medians["tasks0"]), 1e-9)
    print(f"  ratio procs/tasks0: {ratio:.1f}x")
    print(host_line(before, os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
