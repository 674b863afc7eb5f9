"""What one shepherd knows about its task: the state every part of the shepherd shares.

The shepherd process (``shepherd._Shepherd``) is one object assembled from parts,
one module each: starting the job (``shepherd_start``), signals and stops (``shepherd_stop``),
hang detection (``shepherd_hang``) and the exit record (``shepherd_report``).  Each part
derives from :class:`_TaskState`, so the attributes they read and set are defined once, here,
and the type checker sees them in every part.  Standard library only and cheap to load, like
everything the shepherd imports (see shepherd.py).
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # ``typing`` costs start-up (shepherd_files.py); annotations are strings
if TYPE_CHECKING:
    from typing import Any


class _User:
    """Who the job runs as: name, uid, primary gid, supplementary groups, home."""

    def __init__(self, name: str, uid: int, gid: int, groups: list[int], home: str) -> None:
        self.name, self.uid, self.gid, self.groups, self.home = name, uid, gid, groups, home
        # switching identity needs root; a non-root shepherd only runs its own user's jobs
        self.switch = os.geteuid() == 0 and uid != 0


class _TaskState:
    """The task's state: its spec, the job's pid, why and when it is being stopped, and the
    descriptors, user, cgroup and CPUs it is started with."""

    def __init__(self, task_dir: str) -> None:
        self.task_dir = task_dir
        self.start_mono = time.monotonic()
        self.pending: list[int] = []
        self.wake_r = -1
        self.spec: dict[str, Any] = {}
        self.pid = 0  # job main pid == pgid; 0 until started
        self.reaped = False
        self.started_at: float | None = None
        self.reason: str | None = None  # "timed_out" | "cancelled" | "fenced"
        self.kill_at: float | None = None
        self.grace = 10.0
        self.stop_requested = False
        self.stop_reason: str | None = None
        self.checkpoint_sent_at: float | None = None  # wall clock, for exit.json
        self.checkpoint_until: float | None = None  # monotonic end of a running grace
        self.grace_ends_at: float | None = None  # a planned stop's grace end, kept after it
        self.stop_request_seq: int | None = None  # the planned stop's checkpoint request
        self.marker_before: tuple[int, int, int] | None = None  # the marker at the request
        self.hung: dict[str, Any] | None = None  # set when hang detection stopped the job
        self.oom_base: int | None = None  # the cgroup's OOM-kill count when the job started
        self.out_fd = -1
        self.err_fd = -1
        self.user: _User | None = None  # None: run as the shepherd's own user (no "user")
        self.cgroup: dict[str, Any] | None = None  # the attempt's cgroup plan, once set up
        self.cpus: list[int] = []  # CPU affinity for the job (empty: inherit)
        self.tty = False  # out_fd is a pty (srun --pty): stdin and controlling terminal too
        self.stdin_fd = -1  # the task's stdin when its srun forwards one (else /dev/null)
        # the node's hooks (shepherd_hooks.py): why the prolog failed, and whether the
        # epilog is still to run (a prolog ran and succeeded, or there is none)
        self.prolog_failed: str | None = None
        self.epilog_due = False

    def _path(self, name: str) -> str:
        return os.path.join(self.task_dir, name)

    def _job_uids(self) -> tuple[int]:
        """Whose files the job's control files (marker, progress) must be: its user's, this
        process's own uid when the job runs as the shepherd does (:mod:`jobfiles`)."""
        user = self.user
        return (user.uid if user is not None else os.geteuid(),)
