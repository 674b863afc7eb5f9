"""The checkpoint request a job reads in its control directory, and where that directory is.

Both sides write requests: the agent for periodic checkpoints (``shepherd_control.
request_checkpoint``), the shepherd before the checkpoint signal of a planned stop and before
the time limit (``shepherd_stop``).  So this module is shared, and, like everything the
shepherd imports, standard library only and cheap to load (see shepherd.py): imported as
``phalanx.agent.checkpoint_requests`` or, in the shepherd process, as top-level
``checkpoint_requests``.  The protocol is docs/checkpoints.md; the files are named in
``shepherd_files``.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # as in shepherd_files.py: ``typing`` costs start-up
if TYPE_CHECKING:
    from typing import Any

    from phalanx.agent import jobfiles as _jobfiles
    from phalanx.agent.shepherd_files import (
        CHECKPOINT_MARKER_FILE,
        CHECKPOINT_REQUEST_FILE,
        CONTROL_DIR,
        MEMBERSHIP_FILE,
        PROGRESS_FILE,
        REQUEST_LOCK_FILE,
        _read_json,
        _write_json,
    )
elif __package__:
    from . import jobfiles as _jobfiles
    from .shepherd_files import (
        CHECKPOINT_MARKER_FILE,
        CHECKPOINT_REQUEST_FILE,
        CONTROL_DIR,
        MEMBERSHIP_FILE,
        PROGRESS_FILE,
        REQUEST_LOCK_FILE,
        _read_json,
        _write_json,
    )
else:  # the shepherd process: top-level siblings (see shepherd.py)
    import jobfiles as _jobfiles
    from shepherd_files import (
        CHECKPOINT_MARKER_FILE,
        CHECKPOINT_REQUEST_FILE,
        CONTROL_DIR,
        MEMBERSHIP_FILE,
        PROGRESS_FILE,
        REQUEST_LOCK_FILE,
        _read_json,
        _write_json,
    )


def control_environment(task_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The job's PHX_CONTROL_DIR, PHX_CHECKPOINT_REQUEST/_MARKER, PHX_PROGRESS_FILE and
    PHX_MEMBERSHIP_FILE (a --no-kill job's node changes: agent/membership.py)."""
    control = os.path.join(os.path.abspath(os.fspath(task_dir)), CONTROL_DIR)
    return {
        "PHX_CONTROL_DIR": control,
        "PHX_CHECKPOINT_REQUEST": os.path.join(control, CHECKPOINT_REQUEST_FILE),
        "PHX_CHECKPOINT_MARKER": os.path.join(control, CHECKPOINT_MARKER_FILE),
        "PHX_PROGRESS_FILE": os.path.join(control, PROGRESS_FILE),
        "PHX_MEMBERSHIP_FILE": os.path.join(control, MEMBERSHIP_FILE),
    }


def write_checkpoint_request(
    task_dir: str | os.PathLike[str], reason: str, *, deadline: float | None, stop: bool
) -> int:
    """Write the next checkpoint request for the job; return its sequence number.

    ``{"seq", "reason", "kind", "requested_at", "deadline", "stop"}``: ``kind`` is the reason
    in one word (`request_kind`: ``preempted``, ``time limit``, ``interval``, ``cancel``,
    ``requeue``, ``stop``); ``seq`` grows by one per request
    (a lock file serialises the agent and the shepherd, which both write requests), ``deadline``
    is when a planned stop happens (null for periodic requests) and ``stop`` says whether the
    job will be stopped then.  Atomic: the job never reads a partial request.
    """
    import fcntl

    td = os.fspath(task_dir)
    control = os.path.join(td, CONTROL_DIR)
    os.makedirs(control, exist_ok=True)
    path = os.path.join(control, CHECKPOINT_REQUEST_FILE)
    fd = os.open(
        os.path.join(td, REQUEST_LOCK_FILE),
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        0o600,
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        old = read_checkpoint_request(td)
        seq = old.get("seq") if isinstance(old, dict) else None
        seq = (seq if isinstance(seq, int) and not isinstance(seq, bool) else 0) + 1
        _write_json(
            path,
            {
                "seq": seq,
                "reason": reason,
                "kind": request_kind(reason, stop),
                "requested_at": time.time(),
                "deadline": deadline,
                "stop": bool(stop),
            },
        )
        return seq
    finally:
        os.close(fd)


def request_kind(reason: str, stop: bool) -> str:
    """The reason of a checkpoint request in one word, for jobs that act on it: a preemption
    (``requeue: preempted by job 12 ...``/``cancel: preempted by ...``) is ``preempted``."""
    if not stop:
        return "interval"
    if reason == "time limit":
        return reason
    head, _, rest = reason.partition(": ")
    if head == "timeout":  # the end of the job's reservation: it ends TIMEOUT, as at its limit
        return "time limit"
    if head in ("requeue", "cancel") and rest.startswith("preempted by job "):
        return "preempted"
    return head if head in ("requeue", "cancel") else "stop"


def read_checkpoint_request(task_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job's latest checkpoint request, or None (absent, unreadable, refused)."""
    td = os.fspath(task_dir)
    control = os.path.join(td, CONTROL_DIR)
    try:  # written by the node side, but control/ is the job user's: they may replace it
        owners: tuple[int, ...] = (os.geteuid(), _jobfiles.dir_owner(control))
    except OSError:
        owners = (os.geteuid(),)
    try:
        req = _read_json(os.path.join(control, CHECKPOINT_REQUEST_FILE), owners)
    except (OSError, ValueError):
        return None
    return req if isinstance(req, dict) else None
