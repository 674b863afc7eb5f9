"""The task directory of one shepherd: its file names, JSON, atomic writes and checked reads,
the identity of a shepherd process, and the shepherd's own log.

Why one module: the agent (``shepherd_launch``, ``shepherd_control``) and the shepherd process
(``shepherd.py`` and its parts) only ever talk through these files and signals, so
both sides share this one definition of them.  Standard library only, and cheap to import (the
shepherd's start-up cost, see ``shepherd.py``): ``_json`` without ``json``, ``_signal`` without
``signal`` (they import ``re`` and ``enum``), no runtime ``typing``.  Imported as
``phalanx.agent.shepherd_files`` or, in the shepherd process, as top-level ``shepherd_files``.

File protocol (all files written atomically: temporary file + ``os.replace``)
----------------------------------------------------------------------------
Written by the agent:

* ``spec.json``: the task specification (argv, env, cwd, output paths, limits, signal, fence).
* ``signal-<unique>.json``: ``{"signum": int, "batch_only": bool}``, a request to deliver a
  signal to the job, followed by SIGHUP to the shepherd (see
  :func:`shepherd_control.forward_signal`).  The shepherd reads and deletes every pending
  request on SIGHUP (and once right after the job starts, so requests made while it was
  starting are not lost).  Unique names mean concurrent requests never overwrite each other.
* ``stop.json``: ``{"checkpoint_signal": int | null, "checkpoint_grace": float, "reason": str |
  null, "requested_at": float}``, written by :func:`shepherd_control.request_stop` before it
  sends SIGTERM to the shepherd, which reads it when the SIGTERM arrives.  Created
  exclusively: the first request wins and later ones only re-send the SIGTERM (harmless;
  retrying a request whose signal was lost is safe).  A SIGTERM without the file is a plain
  stop.

Written by the shepherd:

* ``shepherd.pid``: ``{"pid": int, "starttime": int}``, written before
  :func:`shepherd_launch.launch` returns.  ``starttime`` is field 22 of ``/proc/PID/stat`` so a
  recycled pid is never mistaken for the shepherd.
* ``job.json``: ``{"pid": int, "pgid": int, "started_at": float}`` once the job has exec'd.
  The job is a session and process-group leader (``pgid == pid``); an agent that finds the
  shepherd "lost" can clean up with ``os.killpg(pgid, SIGKILL)``.
* ``exit.json``: the final record (exit_code, signal, timed_out, cancelled, fenced,
  launch_failed, error, started_at, ended_at, stop_requested, stop_reason,
  checkpoint_signal_sent_at).  Its presence means the task is over and every process of the
  job's process group has been terminated.  ``cancelled`` is true for any requested stop that
  was not preceded by the time limit or the fence, including a job that exited by itself during
  its checkpoint grace (``exit_code``/``signal`` then say how it really ended);
  ``stop_requested`` is true whenever a stop request (SIGTERM/SIGINT) reached the shepherd while
  the job had not ended; ``stop_reason`` is ``stop.json``'s reason;
  ``checkpoint_signal_sent_at`` is the wall-clock time the checkpoint signal went out, or null.
  ``hung`` is present only when hang detection stopped the job: ``{"last_progress_at": mtime
  of the progress file, "timeout_s", "idle_s", "step": the file's step or null}``.  With
  ``progress_timeout_s`` in the spec, a job whose progress file (``progress_file``, else
  ``PHX_PROGRESS_FILE``, else ``control/progress.json``) exists but has not changed for that
  long is stopped like a cancel (SIGTERM, SIGKILL after ``kill_grace_s``).
  ``oom`` is present (true) only when the kernel's OOM killer ended the job: with a cgroup of
  its own, the job failed and that cgroup's OOM-kill counter went up; without one, it died of
  a SIGKILL the shepherd did not send (or exited 137) while the counter of the shepherd's
  memory cgroup went up.  ``job_error`` is present (true) with ``launch_failed`` when the job's
  own request could not be met (see "Who the job runs as" in shepherd_start.py).
* ``shepherd.log``: the shepherd's own diagnostics (stdout/stderr of the daemon), made when
  the first line is written (most shepherds write none).

The job's control directory ``control/`` (checkpoint protocol, docs/checkpoints.md): the
agent creates it; :func:`checkpoint_requests.write_checkpoint_request` writes
``checkpoint-request.json`` (the shepherd before every checkpoint signal of a planned stop and
before the time limit, the agent for periodic requests); the job writes ``checkpoint.json``
and ``progress.json``.  The job's user owns ``control/`` and may put anything there (a link to
a root-only file, a FIFO, a huge file): every file the node side reads there goes through
:mod:`jobfiles` (a regular file of the job's user, never a link, never blocking, bounded), and
the request is written through a new temporary file and a rename, never through what the job
put there.  The lock that serialises requests is ``.request.lock`` in the task directory,
which only root may write: in ``control/`` the job could hold it.
"""

from __future__ import annotations

import os
import time

# ``typing`` costs ~7 ms of startup, so it is only imported for the type checker (which
# recognises a module-level ``TYPE_CHECKING`` by name); annotations are never evaluated.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from typing import Any, NoReturn

    from phalanx.agent import jobfiles as _jobfiles
else:  # ``_signal`` avoids importing ``enum`` (see shepherd.py)
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal
    # the sibling module: top-level ``jobfiles`` in the shepherd process (see shepherd.py)
    if __package__:
        from . import jobfiles as _jobfiles
    else:
        import jobfiles as _jobfiles

SPEC_FILE = "spec.json"
PID_FILE = "shepherd.pid"
JOB_FILE = "job.json"
EXIT_FILE = "exit.json"
STOP_FILE = "stop.json"
LOG_FILE = "shepherd.log"
SIGNAL_REQUEST_PREFIX = "signal-"
# The job's control directory and its files (the checkpoint protocol, docs/checkpoints.md).
CONTROL_DIR = "control"
CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"  # node side -> job
CHECKPOINT_MARKER_FILE = "checkpoint.json"  # job -> node side: latest finished checkpoint
PROGRESS_FILE = "progress.json"  # job -> node side: latest progress (its mtime counts)
MEMBERSHIP_FILE = "membership.json"  # node side -> job: a --no-kill job's node changes
STEPS_SIGNALLED = "steps-signalled"  # a step task of the attempt here got its --signal
# serialises the agent and the shepherd writing requests; in the task dir, which only root
# may write (in control/ the job's user could flock it for ever and wedge both)
REQUEST_LOCK_FILE = ".request.lock"


# --------------------------------------------------------------------------------------------
# Minimal JSON: ``_json`` C accelerators without importing ``json`` (and thus ``re``).
# --------------------------------------------------------------------------------------------


class _ScanContext:
    """Duck-typed context for ``_json.make_scanner`` (the attributes ``JSONDecoder`` has)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> NoReturn:
        raise ValueError(f"invalid JSON constant {name}")


try:
    import _json

    _scan: Any = _json.make_scanner(_ScanContext)  # type: ignore[arg-type]
    _encode_str: Any = _json.encode_basestring_ascii
except (ImportError, AttributeError, TypeError):  # pragma: no cover - non-CPython
    _scan = None
    _encode_str = None


def _loads(text: str) -> Any:
    """Parse JSON; the fast C scanner first, the full ``json`` module for errors/fallback."""
    if _scan is not None:
        stripped = text.strip()
        try:
            value, end = _scan(stripped, 0)
            if end == len(stripped):
                return value
        except Exception:
            pass  # any failure: let ``json`` produce the real error (or succeed)
    import json

    return json.loads(text)


def _dumps(obj: Any) -> str:
    """Serialise the simple values the shepherd writes (dict/list/str/int/float/bool/None)."""
    if _encode_str is None:  # pragma: no cover - non-CPython
        import json

        return json.dumps(obj)
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, str):
        return str(_encode_str(obj))
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            return "null"
        return float.__repr__(obj)
    if isinstance(obj, dict):
        items = (f"{_encode_str(str(k))}: {_dumps(v)}" for k, v in obj.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(obj, list | tuple):
        return "[" + ", ".join(_dumps(v) for v in obj) + "]"
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _write_tmp(path: str, obj: Any) -> str:
    """Write ``obj`` to a fresh temporary file next to ``path``; return its name. control/
    belongs to the job's user, who could plant a link at a predictable name: :func:`jobfiles.
    write_new` never writes through one, and its name is unique to this thread and call."""
    return _jobfiles.write_new(path, (_dumps(obj) + "\n").encode())


def _write_json(path: str, obj: Any) -> None:
    """Atomically replace ``path`` so readers never see a partial file."""
    tmp = _write_tmp(path, obj)
    try:
        os.replace(tmp, path)
    except OSError:  # e.g. the job made control/'s request file a directory
        try:  # noqa: SIM105  (no contextlib: it costs start-up)
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _claim_json(path: str, obj: Any) -> Any:
    """Atomically create ``path`` holding ``obj`` unless it exists; return what it holds.

    ``link`` fails if the target exists, so of two racing writers exactly one wins and readers
    still never see a partial file.  Filesystems without hard links get a plain replace.
    """
    tmp = _write_tmp(path, obj)
    try:
        os.link(tmp, path)
    except FileExistsError:
        os.unlink(tmp)
        return _read_json(path)
    except OSError:
        os.replace(tmp, path)
        return obj
    os.unlink(tmp)
    return obj


def _read_json(path: str, owners: tuple[int, ...] | None = None) -> Any:
    """Return the parsed file, or None if it does not exist or is refused (:mod:`jobfiles`:
    not a regular file of one of ``owners``, or larger than it reads; reported once).

    ``owners``: whose the file may be; by default this process's own uid, for the files the
    node side writes itself (spec, pid, job, exit and stop records, signal requests)."""
    try:
        data, _st = _jobfiles.read_bytes(
            path, (os.geteuid(),) if owners is None else owners, _jobfiles.MAX_NODE_FILE
        )
    except FileNotFoundError:
        return None
    except _jobfiles.Refused as exc:
        _jobfiles.warn_once(exc.path, exc.reason)
        return None
    return _loads(data.decode("utf-8"))


# --------------------------------------------------------------------------------------------
# /proc helpers: process identity and liveness.
# --------------------------------------------------------------------------------------------


def _proc_stat(pid: int | str) -> tuple[str, int, int] | None:
    """Return (state, pgrp, starttime) from /proc/PID/stat, or None if the process is gone.

    The command name (field 2) may contain spaces and parentheses, so split after the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _is_alive(pid: int, starttime: int | None) -> bool:
    """True if ``pid`` runs, is not a zombie, and (if given) started at ``starttime``."""
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return starttime is None or st[2] == starttime


def _signal_process(pid: int, starttime: int | None, signum: int) -> bool:
    """Send ``signum`` to the process only if it is still the one identified by starttime.

    A pidfd pins the process before the identity check, which makes check-then-signal race
    free against pid reuse; plain ``kill`` is the fallback where pidfds are unsupported.
    """
    pidfd: int | None = None
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        pidfd = None
    try:
        if not _is_alive(pid, starttime):
            return False
        if pidfd is not None:
            _signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _live_shepherd(task_dir: str) -> tuple[int, int | None] | None:
    """(pid, starttime) of the task's shepherd if it is alive, else None."""
    try:
        info = _read_json(os.path.join(task_dir, PID_FILE))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return None
    pid, starttime = info["pid"], info.get("starttime")
    if not _is_alive(pid, starttime if isinstance(starttime, int) else None):
        return None
    return pid, starttime


# --------------------------------------------------------------------------------------------
# The shepherd's own diagnostics.
# --------------------------------------------------------------------------------------------


_log_path: str | None = None  # a daemonized shepherd's LOG_FILE, until its first line


def _log(msg: str) -> None:
    """Append one line to the shepherd's stderr (``shepherd.log`` when daemonized)."""
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} shepherd[{os.getpid()}] {msg}\n"
    _open_log()
    _write_quiet(2, line)


def _open_log() -> None:
    """A daemonized shepherd's stdout and stderr go to ``shepherd.log`` from its first line
    on: the file is made then, not at every start, since most shepherds never write one and
    each file made is part of a step's cost (on ext4 without a journal, a scan of the inodes
    deleted in the last minutes; docs/slurm.md "What a step costs")."""
    global _log_path
    path, _log_path = _log_path, None
    if path is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError:
        return
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _write_quiet(fd: int, msg: str) -> bool:
    """Best-effort write for diagnostics: failing to report must not become a new failure."""
    try:
        os.write(fd, msg.encode(errors="replace"))
    except OSError:
        return False
    return True
