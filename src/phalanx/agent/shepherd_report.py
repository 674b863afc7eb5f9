"""The task's exit record: how the job ended, its CPU and memory use, whether the OOM killer
ended it, and the copy a step task sends to its ``srun``.

One part of the shepherd process (``shepherd._Shepherd``); the record is what
``exit.json`` holds (``shepherd_files`` describes its fields).
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # ``typing`` costs start-up (shepherd_files.py); annotations are strings
if TYPE_CHECKING:
    import signal as _signal
    from typing import Any

    from phalanx.agent import cgroups as _cgroups
    from phalanx.agent.shepherd_files import _dumps, _log
    from phalanx.agent.shepherd_start import _connect_stream, _LaunchError
    from phalanx.agent.shepherd_state import _TaskState
else:  # ``_signal`` avoids importing ``enum`` (shepherd.py)
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal
    # siblings: top-level modules in the shepherd process (see shepherd.py)
    if __package__:
        from . import cgroups as _cgroups
        from .shepherd_files import _dumps, _log
        from .shepherd_start import _connect_stream, _LaunchError
        from .shepherd_state import _TaskState
    else:
        import cgroups as _cgroups
        from shepherd_files import _dumps, _log
        from shepherd_start import _connect_stream, _LaunchError
        from shepherd_state import _TaskState


class _Report(_TaskState):
    """The shepherd's part that says how the task ended."""

    def _usage(self) -> dict[str, Any]:
        """CPU time and memory high-water mark of the job (``phalanx eff``, sacct's TotalCPU
        and MaxRSS), once it has ended and its process group is gone.

        From the attempt's own cgroup where there is one (it counts every process that ran in
        it, orphans and ``srun`` steps included); else from ``getrusage(RUSAGE_CHILDREN)``:
        the shepherd's only child is the job, so that is the job's processes that were waited
        for (the main one and whatever it reaped), and their largest resident set."""
        import resource  # a builtin extension: cheap, and only paid once the job has ended

        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        out: dict[str, Any] = {
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "max_rss_bytes": int(ru.ru_maxrss) * 1024,  # Linux reports KiB
            "source": "rusage",
        }
        plan = self.cgroup
        if plan is not None and not plan.get("join_only"):
            try:
                cg = _cgroups.usage(plan)
            except (OSError, KeyError, TypeError, ValueError) as exc:
                _log(f"cannot read the job's cgroup usage: {exc!r}")
                cg = {}
            if "cpu_s" in cg:
                # the cgroup also saw processes nobody waited for: never less than rusage
                out["cpu_s"] = round(max(out["cpu_s"], float(cg["cpu_s"])), 3)
            if "max_rss_bytes" in cg:
                out["max_rss_bytes"] = int(cg["max_rss_bytes"])
                out["source"] = "cgroup"
        return out

    def _killed_by_oom(self, status: int) -> bool:
        """True if the kernel's OOM killer ended the job.

        With a cgroup of its own (only the job's processes are in it): the job failed (a
        nonzero exit or a signal the shepherd did not send) and the OOM-kill counter of that
        cgroup went up.  Without one, the counter is the shared cgroup's, so the job must also
        have died of a SIGKILL (directly, or a shell reporting its child's as 137)."""
        if self.reason is not None or self.oom_base is None:
            return False
        if self.cgroup is not None:
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                return False
            now = _cgroups.oom_kills(self.cgroup)
            return now is not None and now > self.oom_base
        killed = (os.WIFSIGNALED(status) and os.WTERMSIG(status) == _signal.SIGKILL) or (
            os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + _signal.SIGKILL
        )
        if not killed:
            return False
        now = _oom_kills()
        return now is not None and now > self.oom_base

    def _result(
        self, status: int | None, *, error: str | None = None, launch_failed: bool = False
    ) -> dict[str, Any]:
        exit_code = signum = None
        if status is not None:
            if os.WIFEXITED(status):
                exit_code = os.WEXITSTATUS(status)
            elif os.WIFSIGNALED(status):
                signum = os.WTERMSIG(status)
        return {
            "exit_code": exit_code,
            "signal": signum,
            "timed_out": self.reason == "timed_out",
            # A job that exits by itself during its checkpoint grace was still stopped on request.
            "cancelled": self.reason == "cancelled"
            or (self.reason is None and self.stop_requested),
            "fenced": self.reason == "fenced",
            "launch_failed": launch_failed,
            "error": error,
            "started_at": self.started_at,
            "ended_at": time.time(),
            "stop_requested": self.stop_requested,
            "stop_reason": self.stop_reason,
            "checkpoint_signal_sent_at": self.checkpoint_sent_at,
            **({"hung": self.hung} if self.hung else {}),
            **({"prolog_failed": self.prolog_failed} if self.prolog_failed else {}),
        }


def _tell_exit(io: dict[str, Any], result: dict[str, Any]) -> None:
    """Send the task's exit record to its srun (best effort: srun may be gone; the agent
    reports the same record to the controllers)."""
    try:
        fd = _connect_stream(io, "exit")
    except _LaunchError as exc:
        _log(str(exc))
        return
    try:
        data = _dumps(result).encode() + b"\n"
        while data:
            data = data[os.write(fd, data) :]
    except OSError as exc:
        _log(f"cannot send the exit record to srun: {exc}")
    finally:
        os.close(fd)


def _oom_kills() -> int | None:
    """The OOM-kill counter of this process's memory cgroup (the job runs in it too), or None
    where there is none to read: ``memory.events`` (cgroup v2) or ``memory.oom_control``
    (cgroup v1, kernels since 4.13)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/memory{path}/memory.oom_control")
        elif controllers == "":
            candidates.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
    for file in candidates:
        try:
            with open(file, encoding="utf-8") as f:
                for row in f:
                    key, _, value = row.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        return int(value)
        except OSError:
            continue
    return None
