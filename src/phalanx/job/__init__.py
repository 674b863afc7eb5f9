"""Job-side helper: talk to the scheduler's checkpoint protocol from inside a job.

Standard library only, so a job can import it from any interpreter that has ``phalanx/job``
on its path (or a copy of this one file) without installing the scheduler's dependencies.
Outside a Phalanx job (no ``PHX_*`` variables) every call is a harmless no-op, so the same
training script runs on a laptop.

The protocol (docs/checkpoints.md) is a handful of files in a node-local control directory:

* the node side writes ``$PHX_CHECKPOINT_REQUEST`` (``{"seq", "reason", "requested_at",
  "deadline", "stop"}``) whenever it wants a checkpoint, and also sends the checkpoint signal
  (``$PHX_CHECKPOINT_SIGNAL``, e.g. ``USR1``); :func:`checkpoint_requested` sees either;
* the job writes ``$PHX_CHECKPOINT_MARKER`` when a checkpoint is complete
  (:func:`report_checkpoint`) and ``$PHX_PROGRESS_FILE`` as it makes progress
  (:func:`report_progress`); the agent reports both to the controller, which records them.

Checkpoints themselves live in ``$PHX_CHECKPOINT_DIR``, which is the same directory for every
attempt of a job: :func:`save_atomic` writes a file so that it is either complete or absent,
and :func:`latest_checkpoint` finds the newest complete one when an attempt starts.

Typical loop::

    from phalanx import job

    job.install_signal_handler()
    start = job.latest_checkpoint()
    state = load(start) if start else fresh()
    for step in range(state.step, total):
        train_one_step(state)
        job.report_progress(step)
        if step % 1000 == 0 or job.checkpoint_requested():
            path = job.save_atomic(job.checkpoint_dir() / f"step-{step:08d}.ckpt", state.dumps())
            job.report_checkpoint(path)
            if job.stop_requested():
                break
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "checkpoint_dir",
    "checkpoint_request",
    "checkpoint_requested",
    "install_signal_handler",
    "latest_checkpoint",
    "preempted",
    "report_checkpoint",
    "report_progress",
    "restart_count",
    "save_atomic",
    "stop_requested",
]

ENV_CONTROL_DIR = "PHX_CONTROL_DIR"
ENV_REQUEST = "PHX_CHECKPOINT_REQUEST"
ENV_MARKER = "PHX_CHECKPOINT_MARKER"
ENV_PROGRESS = "PHX_PROGRESS_FILE"
ENV_DIR = "PHX_CHECKPOINT_DIR"
ENV_SIGNAL = "PHX_CHECKPOINT_SIGNAL"
ENV_RESTART = "PHX_RESTART_COUNT"

# report_checkpoint also records the latest reported checkpoint here (inside the checkpoint
# dir, so it survives the attempt), which is what latest_checkpoint() trusts first.
LATEST_POINTER = ".phalanx-latest.json"
_TMP_PREFIX = "."  # temporary files are hidden, so latest_checkpoint never picks one
# The node side writes a request's file, then has its signal delivered.  A job that read the
# file (and answered it) before the signal arrived must not take that signal for a second,
# file-less request: a signal that comes at most this long after the newest request was
# written, when that request is already answered, belongs to it.
SIGNAL_LAG_S = 30.0


class _State:
    """What this process has seen of the protocol (one job process = one set of these)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # A request is answered by the next report_checkpoint only once the job has seen it
        # (through checkpoint_request/checkpoint_requested): one that arrives while a
        # checkpoint is being written stays pending, so the job checkpoints again for it.
        self.signals = 0  # checkpoint signals received
        self.signals_seen = 0  # ... of which checkpoint_request() has reported
        self.signals_acked = 0  # ... of which a report_checkpoint has answered
        self.last_signal_at = 0.0  # wall clock of the newest checkpoint signal
        self.seen_seq = 0  # newest request seq checkpoint_request() has reported
        self.acked_seq = 0  # newest request seq a report_checkpoint has answered
        self.request_cache: tuple[tuple[int, int], dict[str, Any] | None] | None = None
        self.last_save: tuple[str, float] | None = None  # (path, seconds) of the last save_atomic


_state = _State()


# ------------------------------------------------------------------ environment
def checkpoint_dir() -> Path | None:
    """``$PHX_CHECKPOINT_DIR``: where checkpoints go, the same for every attempt of the job."""
    value = os.environ.get(ENV_DIR)
    return Path(value) if value else None


def restart_count() -> int:
    """``$PHX_RESTART_COUNT``: 0 for the first attempt, then 1, 2, ... (0 outside Phalanx)."""
    try:
        return int(os.environ.get(ENV_RESTART, "0"))
    except ValueError:
        return 0


def _signal_number(name: str | None) -> int | None:
    """``USR1``/``SIGUSR1``/``10`` -> the signal number; None if unknown."""
    if not name:
        return None
    text = name.strip().upper()
    if text.isdecimal():
        return int(text)
    key = text if text.startswith("SIG") else "SIG" + text
    try:
        return int(signal.Signals[key])
    except KeyError:
        return None


# ------------------------------------------------------------------ requests
def _read_request() -> dict[str, Any] | None:
    """The node side's latest request, re-read only when the file changed (one stat a call)."""
    path = os.environ.get(ENV_REQUEST)
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_mtime_ns, st.st_size)
    cached = _state.request_cache
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # being replaced right now: the next call sees it
    req = data if isinstance(data, dict) and isinstance(data.get("seq"), int) else None
    _state.request_cache = (key, req)
    return req


def checkpoint_request() -> dict[str, Any] | None:
    """The pending request (``seq``, ``reason``, ``deadline``, ``stop``), or None.

    Pending means not answered by a :func:`report_checkpoint` after it was seen here.  A
    request known only from the signal (no request file) reads as
    ``{"seq": None, "reason": "signal", ...}``; the late signal of a request already
    answered from its file is not one (`SIGNAL_LAG_S`).
    """
    req = _read_request()
    with _state.lock:
        signals = _state.signals
        if req is not None and req["seq"] > _state.acked_seq:
            _state.seen_seq = max(_state.seen_seq, req["seq"])
            _state.signals_seen = signals
            return req
        if signals > _state.signals_acked:
            _state.signals_seen = signals
            if _late_signal_of_answered_request(req):
                _state.signals_acked = signals
                return None
            return {"seq": None, "reason": "signal", "deadline": None, "stop": None}
    return None


def _late_signal_of_answered_request(req: dict[str, Any] | None) -> bool:
    """True when the newest signal is the one that came with ``req``, already answered.

    Only a signal with no visible request (a job whose control dir is not shared, a signal
    sent by hand) is a request of its own; see `SIGNAL_LAG_S`.  Caller holds the lock.
    """
    if req is None or req["seq"] > _state.acked_seq:
        return False
    at = req.get("requested_at")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        return False
    return -1.0 <= _state.last_signal_at - at <= SIGNAL_LAG_S


def checkpoint_requested() -> bool:
    """True when the scheduler asked for a checkpoint that has not been reported yet.

    Cheap enough to call every step: one ``stat`` of the request file.
    """
    return checkpoint_request() is not None


def stop_requested() -> bool:
    """True when the pending (or just answered) request says the job will be stopped.

    Planned stops (drain, maintenance, preemption, the time limit) set ``stop``; periodic
    requests do not.  A job that gets ``True`` should checkpoint and exit: it is requeued
    and resumes from that checkpoint, and anything it does after the deadline is lost.
    """
    req = _read_request()
    return bool(req and req.get("stop"))


def preempted() -> bool:
    """True when the pending (or just answered) request is a preemption's: a job of a higher
    priority tier needs the nodes (request ``kind`` ``preempted``). Checkpoint and exit; with
    the default preempt mode (requeue) the job comes back and resumes from that checkpoint.
    """
    req = _read_request()
    return bool(req and req.get("kind") == "preempted")


def install_signal_handler(signum: int | None = None) -> int | None:
    """Turn the checkpoint signal (``$PHX_CHECKPOINT_SIGNAL``, default SIGUSR1) into a flag.

    Afterwards :func:`checkpoint_requested` is also true once the signal arrived, which covers
    jobs whose request file is not visible (and keeps the default action, termination, from
    killing the job).  Must be called from the main thread.  Returns the signal number.
    """
    if signum is None:
        signum = _signal_number(os.environ.get(ENV_SIGNAL)) or int(signal.SIGUSR1)

    def on_signal(_signum: int, _frame: object) -> None:
        _state.last_signal_at = time.time()
        _state.signals += 1

    signal.signal(signum, on_signal)
    return signum


# ------------------------------------------------------------------ reports
def _write_atomic(path: str, data: bytes, *, durable: bool) -> None:
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(
        directory,
        f"{_TMP_PREFIX}{os.path.basename(path)}.tmp.{os.getpid()}.{threading.get_ident()}",
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def report_checkpoint(path: str | os.PathLike[str], duration_s: float | None = None) -> bool:
    """Tell the scheduler a checkpoint is complete at ``path`` (call after it is on disk).

    ``duration_s`` is how long writing it took; when omitted and ``path`` was just written by
    :func:`save_atomic`, that call's duration is used.  The scheduler records each checkpoint
    (time, duration, path) in the job's events, shows the latest in ``phalanx show`` and uses
    the durations for ``--checkpoint-interval=auto``.  Also answers the requests the job has
    seen through :func:`checkpoint_request`/:func:`checkpoint_requested` (not one that came
    in since).  Returns False outside a Phalanx job (nothing to tell).
    """
    full = os.path.abspath(os.fspath(path))
    if duration_s is None and _state.last_save is not None and _state.last_save[0] == full:
        duration_s = _state.last_save[1]
    with _state.lock:
        seq = _state.seen_seq if _state.seen_seq > _state.acked_seq else None
        _state.acked_seq = max(_state.acked_seq, _state.seen_seq)
        _state.signals_acked = max(_state.signals_acked, _state.signals_seen)
    record = {
        "path": full,
        "finished_at": time.time(),
        "duration_s": None if duration_s is None else float(duration_s),
        "request_seq": seq,  # the request this checkpoint answers, if any
    }
    data = (json.dumps(record) + "\n").encode()
    ckdir = checkpoint_dir()
    if ckdir is not None and ckdir.is_dir():
        # on failure latest_checkpoint falls back to the newest file
        with contextlib.suppress(OSError):
            _write_atomic(str(ckdir / LATEST_POINTER), data, durable=True)
    marker = os.environ.get(ENV_MARKER)
    if not marker:
        return False
    _write_atomic(marker, data, durable=False)
    return True


def report_progress(step: int | None = None) -> bool:
    """Record that the job is making progress (``step``: its own counter, e.g. the batch).

    Cheap (no fsync); call it every step.  Hang detection (``--progress-timeout``) watches
    this file: once a job has reported progress, a silence longer than the timeout means
    it is stuck.  Returns False outside a Phalanx job.
    """
    path = os.environ.get(ENV_PROGRESS)
    if not path:
        return False
    record = {"step": None if step is None else int(step), "ts": time.time()}
    _write_atomic(path, (json.dumps(record) + "\n").encode(), durable=False)
    return True


# ------------------------------------------------------------------ checkpoint files
def save_atomic(
    path: str | os.PathLike[str], data: bytes | str | Callable[[IO[bytes]], Any]
) -> Path:
    """Write a checkpoint so that ``path`` is either the complete new file or untouched.

    ``data`` is bytes/str, or a function that writes to a binary file object (e.g.
    ``lambda f: torch.save(state, f)``).  Writes a hidden temporary file in the same
    directory, fsyncs it, renames it over ``path`` and fsyncs the directory, so a crash at
    any point leaves either the old checkpoint or the new one, never a torn file.  Creates
    the directory if needed.  Returns the absolute path; the time it took is remembered for
    :func:`report_checkpoint`.
    """
    started = time.monotonic()
    target = Path(os.path.abspath(os.fspath(path)))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{_TMP_PREFIX}{target.name}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(str(target.parent))
    _state.last_save = (str(target), time.monotonic() - started)
    return target


def latest_checkpoint(
    directory: str | os.PathLike[str] | None = None, pattern: str = "*"
) -> Path | None:
    """The newest complete checkpoint in ``directory`` (default ``$PHX_CHECKPOINT_DIR``).

    Only names matching the glob ``pattern`` count (e.g. ``"step-*.pt"``, so results or logs
    kept in the same directory are never mistaken for checkpoints).  The checkpoint last given
    to :func:`report_checkpoint` wins if it still exists, matches and is at least as new as
    every other file; otherwise the newest visible regular file (hidden names, such as
    :func:`save_atomic`'s temporaries and the pointer itself, never count).  None when there
    is nothing to resume from.
    """
    base = Path(directory) if directory is not None else checkpoint_dir()
    if base is None or not base.is_dir():
        return None
    newest: tuple[int, str] | None = None
    for entry in os.scandir(base):
        if entry.name.startswith(_TMP_PREFIX) or not fnmatch.fnmatchcase(entry.name, pattern):
            continue
        try:
            if not entry.is_file():
                continue
            key = (entry.stat().st_mtime_ns, entry.name)
        except OSError:
            continue
        if newest is None or key > newest:
            newest = key
    reported: Path | None = None
    try:
        with open(base / LATEST_POINTER, encoding="utf-8") as f:
            pointer = json.load(f)
        candidate = Path(pointer["path"])
        if candidate.exists() and fnmatch.fnmatchcase(candidate.name, pattern):
            reported = candidate
    except (OSError, ValueError, KeyError, TypeError):
        reported = None
    if reported is not None:
        if newest is None or reported.is_dir():
            return reported
        try:
            if (reported.stat().st_mtime_ns, reported.name) >= newest:
                return reported
        except OSError:
            pass
    return base / newest[1] if newest is not None else None
