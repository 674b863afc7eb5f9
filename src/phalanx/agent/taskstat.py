"""Live usage of a node's running tasks, for `sstat` (Slurm's jobacct_gather on the slurmd).

`sstat` asks for the CPU time, memory and I/O of a running job's steps while they run. Step
tasks share their job's cgroup on the node, so the cgroup cannot tell one step from another;
each task's processes can: a task is the process its shepherd exec'd (``job.json``) and that
process's descendants. `sample(task_dir)` reads them through psutil:

* ``cpu_s``: user + system seconds of the live processes, plus what each has reaped from its
  children (so a shell's finished commands count);
* ``rss``, ``vms``: resident and virtual bytes now, summed over the processes;
* ``pages``: major page faults (``/proc/PID/stat``), summed;
* ``read_bytes``, ``write_bytes``: bytes the processes read and wrote (``/proc/PID/io``);
* ``max_rss``, ``max_vms``, ``max_pages``: the largest sums seen by any sample so far.

The maxima live in ``usage.json`` in the task directory: the agent's sampler thread folds in
a sample every ``accounting.gather_interval`` seconds (Slurm's JobAcctGatherFrequency, 30 s),
and every `sstat` request samples once more, so a maximum is never below what is running now.
A process that left the task's tree (a daemon that double-forked) is not counted, as Slurm's
own /proc gatherer does not count it either.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import psutil

from phalanx.agent import shepherd_files
from phalanx.agent.files import read_json, write_json

log = logging.getLogger("phalanx.agent")

USAGE_FILE = "usage.json"
_PEAKS = (("rss", "max_rss"), ("vms", "max_vms"), ("pages", "max_pages"))


def _major_faults(pid: int) -> int:
    """Major page faults of `pid` (field 12 of /proc/PID/stat), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return 0
    fields = text[text.rfind(b")") + 2 :].split()  # after "(comm)": state is field 3
    return int(fields[9]) if len(fields) > 9 else 0


def tree_usage(pid: int) -> dict[str, Any] | None:
    """What `pid` and its descendants use now; None when `pid` is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    out: dict[str, Any] = {
        "cpu_s": 0.0, "rss": 0, "vms": 0, "pages": 0, "read_bytes": 0, "write_bytes": 0
    }  # fmt: skip
    for p in procs:
        try:
            with p.oneshot():
                t = p.cpu_times()
                m = p.memory_info()
                out["cpu_s"] += t.user + t.system + t.children_user + t.children_system
                out["rss"] += m.rss
                out["vms"] += m.vms
                try:
                    io = p.io_counters()
                    out["read_bytes"] += io.read_bytes
                    out["write_bytes"] += io.write_bytes
                except (psutil.AccessDenied, AttributeError):
                    pass
            out["pages"] += _major_faults(p.pid)
        except psutil.Error:
            continue  # ended between the listing and the reading
    out["cpu_s"] = round(out["cpu_s"], 3)
    out["pids"] = [p.pid for p in procs]
    return out


def sample(task_dir: Path) -> dict[str, Any] | None:
    """The task's usage now with its maxima so far (kept in ``usage.json``); None when the
    task is not running (not started, or exited)."""
    if (task_dir / shepherd_files.EXIT_FILE).exists():
        return None
    job = read_json(task_dir / shepherd_files.JOB_FILE)
    if not isinstance(job, dict) or not isinstance(job.get("pid"), int):
        return None
    now = tree_usage(int(job["pid"]))
    if now is None:
        return None
    kept = read_json(task_dir / USAGE_FILE)
    kept = kept if isinstance(kept, dict) else {}
    for cur, peak in _PEAKS:
        now[peak] = max(int(kept.get(peak) or 0), now[cur])
    if any(now[peak] != kept.get(peak) for _, peak in _PEAKS):
        try:
            write_json(task_dir / USAGE_FILE, {peak: now[peak] for _, peak in _PEAKS})
        except OSError as e:  # a full disk must not fail the sample itself
            log.debug("cannot record usage in %s: %s", task_dir, e)
    return now


def running_task_dirs(tasks_dir: Path, steps_dir: Path) -> list[Path]:
    """Every task directory of the node whose task has not exited (jobs' and steps')."""
    out = []
    for base in (tasks_dir, steps_dir):
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for e in entries:
            if e.name.startswith(".") or not e.is_dir():
                continue
            d = Path(e.path)
            if not (d / shepherd_files.EXIT_FILE).exists():
                out.append(d)
    return out


def step_usage(
    tasks_dir: Path, steps_dir: Path, attempt_id: int, step_ids: list[int] | None, batch: bool
) -> list[dict[str, Any]]:
    """One entry per running task of the attempt here: its steps' tasks (`step_ids`, None:
    every step) and, with `batch`, the batch script's task (step "batch", task 0). Each
    entry is a `sample` with ``step`` and ``task`` (the task's rank in its step)."""
    out: list[dict[str, Any]] = []
    if batch:
        d = tasks_dir / str(attempt_id)
        spec = read_json(d / "spec.json")
        if not (isinstance(spec, dict) and spec.get("holder")):  # a holder runs no script
            got = sample(d)
            if got is not None:
                out.append({"step": "batch", "task": 0, **got})
    try:
        names = sorted(os.listdir(steps_dir))
    except OSError:
        names = []
    for name in names:
        parts = name.split(".")
        if len(parts) != 3 or not all(x.isdecimal() for x in parts):
            continue
        aid, sid, task = (int(x) for x in parts)
        if aid != attempt_id or (step_ids is not None and sid not in step_ids):
            continue
        got = sample(steps_dir / name)
        if got is not None:
            out.append({"step": sid, "task": task, **got})
    return out
