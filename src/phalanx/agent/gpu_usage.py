"""GPU usage of running tasks, sampled through NVML, for `phalanx eff` (docs/explain.md).

While a task runs, the agent's sampler thread reads every few seconds the utilisation and
memory in use of the GPUs the task was given (its ``meta.json`` lists them) and folds each
reading into ``gpu-usage.json`` in the task directory: a running sum for the mean utilisation
and the memory peak, per GPU. The file survives an agent restart; when the task's exit is
reported the agent sends its summary with it (the exit record's ``gpu``), and the store keeps it
per task. Where NVML does not work (no driver, no GPUs) nothing is sampled and `eff` says so.

`add_sample` and `summary` are pure; `GpuSampler` does the reads and the file writes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from phalanx.agent.files import read_json, write_json

log = logging.getLogger(__name__)

USAGE_FILE = "gpu-usage.json"
DEFAULT_INTERVAL_S = 10.0
INTERVAL_ENV = "PHX_GPU_SAMPLE_S"  # seconds between samples (tests sample faster)

Reading = tuple[int | None, int | None, int | None]  # (util %, bytes used, bytes total)


class NvmlUsage(Protocol):
    """The NVML probes sampling needs (`RealNvml` and `FakeNvml` have them)."""

    def refresh(self) -> None: ...

    def available(self) -> bool: ...

    def device_count(self) -> int: ...

    def utilization(self, index: int) -> int | None: ...

    def memory(self, index: int) -> tuple[int, int] | None: ...


def add_sample(acc: Mapping[str, Any] | None, readings: Mapping[int, Reading]) -> dict[str, Any]:
    """``acc`` with one more sample of these GPUs (index -> reading) folded in."""
    out: dict[str, Any] = {"samples": int((acc or {}).get("samples") or 0) + 1, "per_gpu": {}}
    old = (acc or {}).get("per_gpu") or {}
    for key, g in old.items():
        out["per_gpu"][str(key)] = dict(g)
    for idx, (util, used, total) in readings.items():
        g = out["per_gpu"].setdefault(str(idx), {"util_sum": 0.0, "util_n": 0})
        if util is not None:
            g["util_sum"] = float(g.get("util_sum") or 0.0) + float(util)
            g["util_n"] = int(g.get("util_n") or 0) + 1
        if used is not None:
            g["mem_peak_bytes"] = max(int(g.get("mem_peak_bytes") or 0), int(used))
        if total is not None:
            g["mem_total_bytes"] = int(total)
    return out


def summary(acc: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the exit report carries (efficiency.task_usage's ``gpu``), or None: no samples."""
    if not acc or not acc.get("samples"):
        return None
    per: dict[str, Any] = {}
    utils: list[float] = []
    peaks: list[int] = []
    for key, g in (acc.get("per_gpu") or {}).items():
        one: dict[str, Any] = {}
        if g.get("util_n"):
            one["util_mean"] = round(float(g["util_sum"]) / int(g["util_n"]), 1)
            utils.append(one["util_mean"])
        for k in ("mem_peak_bytes", "mem_total_bytes"):
            if g.get(k) is not None:
                one[k] = int(g[k])
        if "mem_peak_bytes" in one:
            peaks.append(one["mem_peak_bytes"])
        per[str(key)] = one
    out: dict[str, Any] = {"samples": int(acc["samples"]), "per_gpu": per}
    if utils:
        out["util_mean"] = round(sum(utils) / len(utils), 1)
    if peaks:
        out["mem_peak_bytes"] = max(peaks)
    return out


def read(task_dir: Path) -> dict[str, Any] | None:
    """The task's accumulated samples, or None (none yet; not a regular file the agent owns:
    files.read_json reads it as every file of a task directory, agent/jobfiles.py)."""
    return read_json(task_dir / USAGE_FILE)


def _write(task_dir: Path, acc: Mapping[str, Any]) -> None:
    write_json(task_dir / USAGE_FILE, dict(acc))


def interval_from_env() -> float:
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds; sampling every %gs", INTERVAL_ENV, raw,
                    DEFAULT_INTERVAL_S)  # fmt: skip
        return DEFAULT_INTERVAL_S
    return max(0.2, value)


class GpuSampler:
    """Reads the GPUs of running tasks and folds the readings into their task directories."""

    def __init__(self, nvml: NvmlUsage) -> None:
        self.nvml = nvml
        self._broken = False

    def sample(self, tasks: Iterable[tuple[Path, list[int]]]) -> int:
        """One sample of every task's GPUs; returns how many tasks got one."""
        tasks = [(d, ids) for d, ids in tasks if ids]
        if not tasks:
            return 0
        try:
            self.nvml.refresh()
            if not self.nvml.available():
                return 0
            count = self.nvml.device_count()
        except Exception as e:  # a driver in trouble: the health checks report it
            if not self._broken:
                log.warning("cannot sample GPU usage: %s", e)
            self._broken = True
            return 0
        self._broken = False
        wanted = sorted({i for _, ids in tasks for i in ids if 0 <= i < count})
        readings: dict[int, Reading] = {}
        for i in wanted:
            try:
                util = self.nvml.utilization(i)
                mem = self.nvml.memory(i)
            except Exception as e:  # a lost GPU: no reading from it
                log.debug("GPU %d: no usage reading: %s", i, e)
                continue
            readings[i] = (util, mem[0] if mem else None, mem[1] if mem else None)
        done = 0
        for d, ids in tasks:
            mine = {i: readings[i] for i in ids if i in readings}
            if not mine or (d / "exit.json").exists():
                continue
            try:
                _write(d, add_sample(read(d), mine))
                done += 1
            except OSError as e:  # the task dir went away (the attempt was forgotten)
                log.debug("cannot record GPU usage in %s: %s", d, e)
        return done
