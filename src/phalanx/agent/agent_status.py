"""What the agent tells about its node besides the heartbeat's task list: jobs running and
the one-line status systemd shows, the GPUs' events and readings, the GPU usage of running
tasks (``phalanx eff``), the live usage of every running task (``sstat``), and the checkpoint marker and progress each job reports.

A part of :class:`agent.Agent` (a mixin); the job's own reports are read through
``jobfiles`` (the job's user owns the files), the figures served by ``metrics.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from phalanx.agent import gpu_usage, jobfiles, shepherd_files, taskstat
from phalanx.agent.agent_timing import heartbeat_grace
from phalanx.agent.files import read_json as _read_json
from phalanx.agent.health import GpuCheck, HealthMonitor
from phalanx.agent.steps import StepRunner
from phalanx.domain import job_reports

log = logging.getLogger("phalanx.agent")

MAX_GPU_EVENTS = 256  # GPU events one heartbeat carries (controller/agentwork.py takes as many)


class AgentStatus:
    """The agent's reports on its node: status line, GPU events and readings, GPU usage."""

    name: str
    tasks_dir: Path
    health: HealthMonitor | None
    timing: dict[str, Any]
    last_reply_at: float | None
    last_error: str | None
    gpu_sampler: gpu_usage.GpuSampler | None
    gpu_sample_s: float
    usage_sample_s: float
    steps: StepRunner
    _registered: bool
    _stop: threading.Event

    def jobs_running(self) -> int:
        """Task directories of this node whose job has not exited (batch steps and holders)."""
        if not self.tasks_dir.is_dir():
            return 0
        return sum(
            1
            for d in self.tasks_dir.iterdir()
            if d.is_dir()
            and not d.name.startswith(".")
            and not (d / shepherd_files.EXIT_FILE).exists()
        )

    def summary(self) -> str:
        """One line for systemd's STATUS=: node state, jobs running, controller reachable."""
        state = "registered" if self._registered else "registering"
        if self.health is not None:
            h = self.health.summary()
            if h.get("status") not in (None, "ok"):
                state += f", health {h['status']}: {h.get('check')}: {h.get('reason')}"
            else:
                state += ", health ok"
        interval = float(self.timing["heartbeat_interval"])
        seen = self.last_reply_at
        if seen is not None and time.monotonic() - seen <= 2 * interval + heartbeat_grace(interval):
            reach = "controller reachable"
        else:
            ago = f" for {time.monotonic() - seen:.0f}s" if seen is not None else ""
            reach = f"controller UNREACHABLE{ago}" + (
                f": {self.last_error}" if self.last_error else ""
            )
        return f"node {self.name} {state}; jobs running: {self.jobs_running()}; {reach}"

    # ------------------------------------------------------------------ metrics
    def _gpu_checks(self) -> list[GpuCheck]:
        return [c for c in (self.health.checks if self.health else []) if isinstance(c, GpuCheck)]

    def gpu_events(self) -> list[dict[str, Any]]:
        """GPU events (XIDs, ECC increases) no controller has confirmed yet."""
        return [e for c in self._gpu_checks() for e in c.pending_events()][:MAX_GPU_EVENTS]

    def _confirm_gpu_events(self, keys: set[str]) -> None:
        for c in self._gpu_checks():
            c.confirm(keys)

    def gpu_readings(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for c in self._gpu_checks():
            out.update(c.readings)
        return out

    def _sample_gpus(self) -> None:
        """Sample the GPUs of running tasks every `gpu_sample_s` (agent/gpu_usage.py)."""
        assert self.gpu_sampler is not None
        while not self._stop.wait(self.gpu_sample_s):
            try:
                if not self.tasks_dir.is_dir():
                    continue
                tasks = []
                for d in self.tasks_dir.iterdir():
                    if d.name.startswith(".") or (d / "exit.json").exists():
                        continue
                    meta = _read_json(d / "meta.json")
                    if meta and meta.get("gpu_ids") and (d / "job.json").exists():
                        tasks.append((d, [int(i) for i in meta["gpu_ids"]]))
                self.gpu_sampler.sample(tasks)
            except Exception:
                log.exception("GPU usage sampler error; going on")

    def _sample_usage(self) -> None:
        """Fold a sample of every running task's processes into its maxima every
        `usage_sample_s` (agent/taskstat.py: `sstat`'s MaxRSS, MaxVMSize, MaxPages)."""
        while not self._stop.wait(self.usage_sample_s):
            try:
                for d in taskstat.running_task_dirs(self.tasks_dir, self.steps.steps_dir):
                    taskstat.sample(d)
            except Exception:
                log.exception("task usage sampler error; going on")


def read_job_reports(task_dir: Path) -> dict[str, Any]:
    """The job's checkpoint marker and progress, as reported in heartbeats (absent: omitted).

    The job's user owns ``control/`` and may put anything there: each file is read only when
    it is a regular file of that user (the directory's owner), at most 64 KiB, without
    following a link or blocking on a FIFO (agent/jobfiles.py); anything else is absent, and
    the reason (never the content) is logged once."""
    out: dict[str, Any] = {}
    control = task_dir / shepherd_files.CONTROL_DIR
    try:
        owner = jobfiles.dir_owner(control)
    except jobfiles.Refused as e:  # the task dir is root's: never expected, said if so
        jobfiles.warn_once(e.path, e.reason)
        return out
    except OSError:
        return out
    for key, name, parse in (
        ("checkpoint", shepherd_files.CHECKPOINT_MARKER_FILE, job_reports.parse_checkpoint_marker),
        ("progress", shepherd_files.PROGRESS_FILE, job_reports.parse_progress),
    ):
        got = jobfiles.read_or_none(control / name, (owner,), jobfiles.MAX_JOB_FILE)
        if got is None:
            continue
        data, st = got
        value = parse(data.decode("utf-8", errors="replace"), st.st_mtime)
        if value is not None:
            out[key] = value
    return out
