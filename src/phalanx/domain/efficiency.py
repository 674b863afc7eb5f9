"""What a job used against what it asked for (`phalanx eff`, like Slurm's ``seff``), pure.

The agent measures each task when it ends (the shepherd reads the attempt's cgroup, or its
children's rusage; the agent adds NVML samples of the task's GPUs) and sends the figures in
the task's exit record; the store keeps them per task (`task_usage` picks and checks them) and
`attempt_usage` sums an attempt's tasks. `report` turns a job and its attempts into the seff
lines; `total_cpu` and `max_rss` are sacct's TotalCPU and MaxRSS forms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.domain.values import format_duration

__all__ = [
    "attempt_usage",
    "job_usage",
    "max_rss",
    "report",
    "task_usage",
    "total_cpu",
]

_MAX_BYTES = 2**62  # beyond any machine: a corrupt report, not a measurement


def _num(value: Any, *, most: float = float(_MAX_BYTES)) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    if not math.isfinite(v) or v < 0 or v > most:
        return None
    return v


def _gpu_usage(raw: Any) -> dict[str, Any] | None:
    """A task's GPU samples as the agent sends them, checked: {"samples": n, "util_mean": %,
    "mem_peak_bytes": b, "per_gpu": {"0": {"util_mean", "mem_peak_bytes", "mem_total_bytes"}}}."""
    if not isinstance(raw, Mapping):
        return None
    samples = _num(raw.get("samples"))
    if not samples:
        return None
    out: dict[str, Any] = {"samples": int(samples)}
    util = _num(raw.get("util_mean"), most=100.0)
    if util is not None:
        out["util_mean"] = round(util, 1)
    peak = _num(raw.get("mem_peak_bytes"))
    if peak is not None:
        out["mem_peak_bytes"] = int(peak)
    per: dict[str, Any] = {}
    for idx, g in (
        (raw.get("per_gpu") or {}).items() if isinstance(raw.get("per_gpu"), Mapping) else ()
    ):
        if not isinstance(g, Mapping) or not str(idx).isdecimal():
            continue
        one = {
            k: (round(v, 1) if k == "util_mean" else int(v))
            for k in ("util_mean", "mem_peak_bytes", "mem_total_bytes")
            if (v := _num(g.get(k), most=100.0 if k == "util_mean" else float(_MAX_BYTES)))
            is not None
        }
        per[str(idx)] = one
    if per:
        out["per_gpu"] = per
    return out


def task_usage(exit_record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `tasks` columns for a task's usage, from its exit record (values that are missing
    or not plausible numbers are left None: a report is never refused for its usage)."""
    ex = exit_record or {}
    usage = ex.get("usage") if isinstance(ex.get("usage"), Mapping) else {}
    assert isinstance(usage, Mapping)
    cpu = _num(usage.get("cpu_s"), most=1e12)
    rss = _num(usage.get("max_rss_bytes"))
    return {
        "cpu_time_s": None if cpu is None else round(cpu, 3),
        "max_rss_bytes": None if rss is None else int(rss),
        "gpu_usage": _gpu_usage(ex.get("gpu")),
    }


def attempt_usage(attempt: Mapping[str, Any], now: float) -> dict[str, Any]:
    """One attempt's usage over its (non-spare) tasks: CPU seconds summed, memory peaks
    summed (each node's own peak; ``max_rss_bytes`` is the largest of them), GPU utilisation
    averaged over the GPUs sampled, the largest GPU memory peak."""
    tasks = [t for t in attempt.get("tasks") or [] if not t.get("spare")]
    start = attempt.get("start_time")
    wall = max(0.0, (attempt.get("end_time") or now) - start) if start else 0.0
    cpus = sum(int(t.get("cpus") or 0) for t in tasks)
    mem_req = sum(int(t.get("mem_mb") or 0) for t in tasks) * 1024 * 1024
    gpus = sum(len(t.get("gpu_ids") or ()) for t in tasks)
    measured = [t for t in tasks if t.get("cpu_time_s") is not None]
    rss = [int(t["max_rss_bytes"]) for t in tasks if t.get("max_rss_bytes") is not None]
    out: dict[str, Any] = {
        "attempt_id": attempt.get("id"),
        "seq": attempt.get("seq"),
        "state": attempt.get("state"),
        "result": attempt.get("result"),
        "nodes": len(tasks),
        "cpus": cpus,
        "wall_s": round(wall, 3),
        "core_wall_s": round(wall * cpus, 3),
        "mem_requested_bytes": mem_req,
        "gpus": gpus,
        "measured_tasks": len(measured),
        "cpu_time_s": round(sum(float(t["cpu_time_s"]) for t in measured), 3) if measured else None,
        "mem_used_bytes": sum(rss) if rss else None,
        "max_rss_bytes": max(rss) if rss else None,
        "gpu_util_mean": None,
        "gpu_mem_peak_bytes": None,
        "gpu_samples": 0,
    }
    utils: list[float] = []
    peaks: list[int] = []
    for t in tasks:
        g = t.get("gpu_usage") or {}
        out["gpu_samples"] += int(g.get("samples") or 0)
        per = g.get("per_gpu") or {}
        if per:
            utils += [float(x["util_mean"]) for x in per.values() if "util_mean" in x]
        elif "util_mean" in g:
            utils.append(float(g["util_mean"]))
        peaks += [int(x["mem_peak_bytes"]) for x in per.values() if "mem_peak_bytes" in x]
        if "mem_peak_bytes" in g:
            peaks.append(int(g["mem_peak_bytes"]))
    if utils:
        out["gpu_util_mean"] = round(sum(utils) / len(utils), 1)
    if peaks:
        out["gpu_mem_peak_bytes"] = max(peaks)
    return out


def job_usage(attempts: Sequence[Mapping[str, Any]], now: float) -> dict[str, Any] | None:
    """The usage of the job's last attempt that started (what `eff` and sacct show), or None
    if none started yet."""
    ran = [a for a in attempts if a.get("start_time")]
    return attempt_usage(ran[-1], now) if ran else None


# --------------------------------------------------------------------------------------------
# Forms
# --------------------------------------------------------------------------------------------


def total_cpu(seconds: float | None) -> str:
    """sacct's TotalCPU: ``MM:SS.mmm`` under an hour, ``HH:MM:SS`` and ``D-HH:MM:SS`` above."""
    if seconds is None:
        return ""
    if seconds < 3600:
        minutes, secs = divmod(seconds, 60)
        return f"{int(minutes):02d}:{secs:06.3f}"
    return format_duration(seconds)


def max_rss(nbytes: int | None) -> str:
    """sacct's MaxRSS: kibibytes with a K, as sacct prints it without --units."""
    if nbytes is None:
        return ""
    return f"{(int(nbytes) + 1023) // 1024}K"


def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1024:.2f} KB"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole > 0 else "n/a"


def report(job: Mapping[str, Any], attempts: Sequence[Mapping[str, Any]], now: float) -> list[str]:
    """seff's lines for a job (its view from GET /v1/jobs/{ref}, with its attempts)."""
    shown = job.get("job_id") or job.get("id")
    state = str(job.get("state"))
    lines = [f"Job ID: {shown}", f"User: {job.get('user')}"]
    code, sig = job.get("exit_code"), job.get("exit_signal")
    ended = f" (exit code {code})" if code is not None else ""
    if sig:
        ended = f" (signal {sig})"
    lines.append(f"State: {state}{ended}")
    u = job_usage(attempts, now)
    if u is None:
        lines.append("Efficiency: the job has not run yet")
        return lines
    if int(job.get("restart_count") or 0):
        lines.append(f"Attempt: {int(u['seq'] or 0) + 1} (the last one that ran)")
    per_node = u["cpus"] // u["nodes"] if u["nodes"] else 0
    lines += [f"Nodes: {u['nodes']}", f"Cores per node: {per_node}"]
    running = u["state"] != "ENDED"
    wall = u["wall_s"]
    if u["cpu_time_s"] is None:
        why = (
            "measured when the job ends"
            if running
            else "not measured (its agent sent no usage with the exit)"
        )
        lines.append(f"CPU Utilized: {why}")
    else:
        lines.append(f"CPU Utilized: {format_duration(u['cpu_time_s'])}")
        lines.append(
            f"CPU Efficiency: {_pct(u['cpu_time_s'], u['core_wall_s'])} of "
            f"{format_duration(u['core_wall_s'])} core-walltime"
        )
    limit = job.get("time_limit_s")
    wall_line = f"Job Wall-clock time: {format_duration(wall)}"
    if limit:
        wall_line += f" ({_pct(wall, float(limit))} of the {format_duration(limit)} time limit)"
    lines.append(wall_line)
    if u["mem_used_bytes"] is None:
        lines.append("Memory Utilized: " + ("measured when the job ends" if running else "n/a"))
    else:
        used = u["mem_used_bytes"]
        extra = f" (largest node: {_size(u['max_rss_bytes'])})" if u["nodes"] > 1 else ""
        lines.append(f"Memory Utilized: {_size(used)}{extra}")
        req = u["mem_requested_bytes"]
        lines.append(
            f"Memory Efficiency: {_pct(used, req)} of {_size(req)}"
            + (f" ({_size(req / u['nodes'])} per node)" if u["nodes"] > 1 else "")
        )
    if u["gpus"]:
        kind = f" ({job.get('gpu_type')})" if job.get("gpu_type") else ""
        lines.append(f"GPUs: {u['gpus']}{kind}")
        if u["gpu_samples"]:
            if u["gpu_util_mean"] is not None:
                lines.append(
                    f"GPU Utilization: {u['gpu_util_mean']:.1f}% "
                    f"(mean of {u['gpu_samples']} samples)"
                )
            if u["gpu_mem_peak_bytes"] is not None:
                lines.append(f"GPU Memory Utilized: {_size(u['gpu_mem_peak_bytes'])} (peak)")
        else:
            lines.append("GPU Utilization: not sampled (NVML unavailable on its nodes)")
    return lines
