"""Hang detection (``--progress-timeout``): stop a job whose progress file stopped changing.

One part of the shepherd process (``shepherd._Shepherd``), built on the stopping
part (a hung job is stopped like a cancel, ``hung`` in ``exit.json`` says why).  The progress
file is the job's (``control/progress.json`` by default, docs/checkpoints.md), so it is read
through :mod:`jobfiles` like every file the job controls.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # ``typing`` costs start-up (shepherd_files.py); annotations are strings
if TYPE_CHECKING:
    from typing import Any

    from phalanx.agent import jobfiles as _jobfiles
    from phalanx.agent.shepherd_files import CONTROL_DIR, PROGRESS_FILE, _loads, _log
    from phalanx.agent.shepherd_stop import _Stopping
elif __package__:
    from . import jobfiles as _jobfiles
    from .shepherd_files import CONTROL_DIR, PROGRESS_FILE, _loads, _log
    from .shepherd_stop import _Stopping
else:  # the shepherd process: top-level siblings (see shepherd.py)
    import jobfiles as _jobfiles
    from shepherd_files import CONTROL_DIR, PROGRESS_FILE, _loads, _log
    from shepherd_stop import _Stopping

_PROGRESS_CHECK_MAX_S = 1.0


class _HangDetection(_Stopping):
    """The shepherd's part that watches the job's progress file."""

    def _progress_timeout(self) -> float | None:
        timeout = self.spec.get("progress_timeout_s")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            return None
        return float(timeout)

    def _progress_path(self) -> str:
        """The job's progress file: the spec's, else its PHX_PROGRESS_FILE, else the
        protocol's place (``<task_dir>/control/progress.json``)."""
        path = self.spec.get("progress_file")
        if isinstance(path, str) and path:
            return path
        env = self.spec.get("env")
        if isinstance(env, dict) and isinstance(env.get("PHX_PROGRESS_FILE"), str):
            return str(env["PHX_PROGRESS_FILE"])
        return os.path.join(self.task_dir, CONTROL_DIR, PROGRESS_FILE)

    def _first_progress_check(self) -> float | None:
        timeout = self._progress_timeout()
        return None if timeout is None else time.monotonic() + _progress_interval(timeout)

    def _check_progress(self, now: float) -> float | None:
        """Stop the job as hung when its progress file, once it exists, has not changed for
        the progress timeout; return when to look again (None: never).

        A job that never reported progress is not judged (it may not use the protocol), and a
        job inside its checkpoint grace is busy saving, not hung.  The file's mtime is compared
        with the wall clock: the job writes it on this node, so both come from one clock.
        """
        timeout = self._progress_timeout()
        if timeout is None or self.reason is not None or self.reaped:
            return None
        interval = _progress_interval(timeout)
        if self.checkpoint_until is not None:
            return now + interval
        path = self._progress_path()
        # the job's user owns control/: a link, a FIFO or another's file there is no progress
        st = _jobfiles.stat_or_none(path, self._job_uids())
        if st is None:
            return now + interval
        mtime = st.st_mtime
        idle = time.time() - mtime
        if idle < timeout:
            return now + min(interval, max(0.01, timeout - idle))
        step = _progress_step(path, self._job_uids())
        self.hung = {
            "last_progress_at": mtime,
            "timeout_s": int(timeout) if timeout.is_integer() else timeout,
            "idle_s": round(idle, 3),
            "step": step,
        }
        _log(
            f"no progress for {idle:.1f}s (timeout {timeout:g}s"
            f"{f', last step {step}' if step is not None else ''}): the job is hung"
        )
        self._stop("hung")
        return None


def _progress_interval(timeout: float) -> float:
    """How often hang detection looks at the progress file: a quarter of the timeout, at most
    once a second and at least every 50 ms (a stat is cheap, but the loop should sleep)."""
    return min(_PROGRESS_CHECK_MAX_S, max(0.05, timeout / 4))


def _progress_step(path: str, owners: tuple[int, ...]) -> Any:
    """The ``step`` of a ``{"step": ...}`` progress file, or None (plain text, unreadable,
    refused: the file must be a regular file of ``owners``, :mod:`jobfiles`)."""
    got = _jobfiles.read_or_none(path, owners)
    if got is None:
        return None
    try:
        report = _loads(got[0].decode("utf-8", errors="replace"))
    except ValueError:
        return None
    step = report.get("step") if isinstance(report, dict) else None
    return step if isinstance(step, int | float | str) and not isinstance(step, bool) else None
