"""What the agent asks of a running shepherd: its status, a stop, a signal, a checkpoint.

The agent never talks to a shepherd except through its task directory and signals
(``shepherd_files`` has the protocol): a request is a file written there, then a signal to the
shepherd, which it may only get while it is still the process ``shepherd.pid`` names.  Runs in
the agent (and tools that look at task directories), never in the shepherd process.
"""

from __future__ import annotations

import os
import time
from typing import Any

from phalanx.agent.checkpoint_requests import write_checkpoint_request
from phalanx.agent.shepherd_files import (
    EXIT_FILE,
    JOB_FILE,
    PID_FILE,
    SIGNAL_REQUEST_PREFIX,
    STOP_FILE,
    _claim_json,
    _is_alive,
    _live_shepherd,
    _read_json,
    _signal_process,
    _write_json,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:  # as the shepherd's own modules do (shepherd_files.py)
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal


def read_status(task_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Classify the task: exited / running / starting / lost / absent.

    ``exit.json`` is authoritative.  Otherwise liveness is judged by pid *and* start time, and
    zombies count as dead (our detached shepherd is reaped by PID 1, possibly late).
    ``exit.json`` is re-read after finding the shepherd dead because it may have finished
    between the two checks.
    """
    td = os.fspath(task_dir)
    exit_path = os.path.join(td, EXIT_FILE)
    result = _read_json(exit_path)
    if isinstance(result, dict):
        return {"state": "exited", **result}
    info = _read_json(os.path.join(td, PID_FILE))
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return {"state": "absent"}
    pid = info["pid"]
    starttime = info.get("starttime")
    if not _is_alive(pid, starttime if isinstance(starttime, int) else None):
        result = _read_json(exit_path)
        if isinstance(result, dict):
            return {"state": "exited", **result}
        return {
            "state": "lost",
            "reason": f"shepherd (pid {pid}) is gone and left no {EXIT_FILE}",
        }
    job = _read_json(os.path.join(td, JOB_FILE))
    if not isinstance(job, dict):
        return {"state": "starting", "shepherd_pid": pid}
    return {
        "state": "running",
        "shepherd_pid": pid,
        "started_at": job.get("started_at"),
        "job_pid": job.get("pid"),
        "pgid": job.get("pgid"),
    }


def request_stop(
    task_dir: str | os.PathLike[str],
    *,
    checkpoint_signal: int | None = None,
    checkpoint_grace: float = 0.0,
    reason: str | None = None,
    wait: bool = False,
) -> bool:
    """Ask the shepherd to stop the job; ``cancelled=true`` (and ``stop_requested=true``).

    Without ``checkpoint_signal``: SIGTERM to the job's group, SIGKILL after its grace.  With
    one ("checkpoint, then stop", for drains, failing health checks, preemption): the shepherd
    first delivers ``checkpoint_signal`` (to the main process only if the spec's
    ``signal.batch_only`` is true) and gives the job up to ``checkpoint_grace`` seconds to exit
    by itself, then stops it as above.  ``wait`` gives the grace without a signal: a planned
    stop of a job whose signal goes elsewhere (``--signal=B:``: the batch shell forwards it to
    the steps), and of a holder, which stops as soon as the job's steps on its node have
    ended (they live in its cgroup).  ``reason`` ends up in ``exit.json`` as ``stop_reason``.

    The request is written to ``stop.json`` (created exclusively, so the first request wins),
    then the shepherd gets SIGTERM.  Repeating a request, with or without a checkpoint signal,
    is safe: it neither restarts nor cuts short a grace already running.  Returns False when
    there is nothing to stop: the shepherd is gone or already wrote ``exit.json``.  Raises
    ValueError for an invalid signal number or grace.
    """
    if checkpoint_signal is not None and (
        isinstance(checkpoint_signal, bool)
        or not isinstance(checkpoint_signal, int)
        or not 0 < checkpoint_signal < _signal.NSIG
    ):
        raise ValueError(f"invalid checkpoint signal {checkpoint_signal!r}")
    grace = float(checkpoint_grace)
    if not 0.0 <= grace < float("inf"):
        raise ValueError(f"invalid checkpoint grace {checkpoint_grace!r}")
    td = os.fspath(task_dir)
    if os.path.exists(os.path.join(td, EXIT_FILE)):
        return False
    live = _live_shepherd(td)
    if live is None:
        return False
    request = {
        "checkpoint_signal": None if checkpoint_signal is None else int(checkpoint_signal),
        "checkpoint_grace": grace,
        "wait": bool(wait),
        "reason": None if reason is None else str(reason),
        "requested_at": time.time(),
    }
    import contextlib

    # An unwritable dir or a corrupt earlier request: the shepherd does a plain stop.
    with contextlib.suppress(OSError, ValueError):
        _claim_json(os.path.join(td, STOP_FILE), request)
    return _signal_process(live[0], live[1], _signal.SIGTERM)


def request_checkpoint(
    task_dir: str | os.PathLike[str], reason: str, signum: int, *, batch_only: bool = False
) -> int | None:
    """Ask a running job for a checkpoint without stopping it (periodic checkpoints).

    Writes the request file, then has the shepherd deliver ``signum``.  Returns the request's
    seq, or None (nothing written) when the job is not running.
    """
    td = os.fspath(task_dir)
    if os.path.exists(os.path.join(td, EXIT_FILE)) or _live_shepherd(td) is None:
        return None
    seq = write_checkpoint_request(td, reason, deadline=None, stop=False)
    forward_signal(td, signum, batch_only)
    return seq


_request_counter = 0


def forward_signal(task_dir: str | os.PathLike[str], signum: int, batch_only: bool = False) -> bool:
    """Have the shepherd deliver ``signum`` to the job's process group (or main process only).

    Writes a uniquely named ``signal-*.json`` request, then SIGHUPs the shepherd.  Returns False
    (and withdraws the request) if the shepherd is not alive or the job already finished.
    """
    global _request_counter
    td = os.fspath(task_dir)
    if os.path.exists(os.path.join(td, EXIT_FILE)):
        return False
    live = _live_shepherd(td)
    if live is None:
        return False
    _request_counter += 1
    name = f"{SIGNAL_REQUEST_PREFIX}{time.time_ns()}-{os.getpid()}-{_request_counter}.json"
    path = os.path.join(td, name)
    _write_json(path, {"signum": int(signum), "batch_only": bool(batch_only)})
    if _signal_process(live[0], live[1], _signal.SIGHUP):
        return True
    try:
        os.unlink(path)
    except OSError:
        return False
    return False
