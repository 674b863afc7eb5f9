"""Per-task shepherd: a small detached process that owns one job task on one node.

Why a separate process: the node agent may crash, be upgraded or be SIGKILLed at any time, and
that must never kill or orphan a running job without a record of how it ended.  The shepherd is
started fully detached (new session, re-parented away from the agent), owns the job's process
group, enforces the time limit, forwards signals, self-fences when the agent's heartbeat goes
stale, and records the outcome in files.  The agent talks to it only through the task directory
and signals, so a restarted agent can re-adopt running tasks by reading those files.

Why stdlib only (and ``_json``/``_signal`` instead of ``json``/``signal``, no runtime
``typing``): a fresh ``python -I -S`` runs once per task and its startup dominates the cost of
trivial jobs; ``json``, ``signal`` and ``typing`` pull in ``re`` and ``enum`` and roughly double
interpreter startup.  :func:`launch` imports this file as a module (cached .pyc) rather than
running it as a script (recompiled every time) and exits the helper processes with
``os._exit``.  The job is started with ``fork`` + ``execve`` (``posix_spawn`` would be cheaper
but cannot change the uid or join a cgroup).  Measured on the 2-core dev box: ~120 trivial
tasks/s launched and completed.  The file still
works as a script: ``python -I -S shepherd.py [--daemonize] TASK_DIR``.

Even so, a fresh interpreter per task costs ~8-9 ms of CPU.  The agent therefore uses a
:class:`Launcher`: one long-lived helper (``shepherd.py --launcher``, a "zygote") that has this
module imported already and forks the same double-forked, ``setsid`` shepherd per task on
request (a fork costs a fraction of an interpreter start).  :func:`launch` stays as the
fallback.  Launching is idempotent per task directory: a shepherd claims the directory by
creating ``shepherd.pid`` exclusively, and a second launch for the same directory reports the
first shepherd's pid instead of running the job again (which makes retrying after a helper
died mid-request safe).

File protocol (all files written atomically: temporary file + ``os.replace``)
----------------------------------------------------------------------------
Written by the agent:

* ``spec.json``: the task specification (argv, env, cwd, output paths, limits, signal, fence).
* ``signal-<unique>.json``: ``{"signum": int, "batch_only": bool}``, a request to deliver a
  signal to the job, followed by SIGHUP to the shepherd (see :func:`forward_signal`).  The
  shepherd reads and deletes every pending request on SIGHUP (and once right after the job
  starts, so requests made while it was starting are not lost).  Unique names mean concurrent
  requests never overwrite each other.
* ``stop.json``: ``{"checkpoint_signal": int | null, "checkpoint_grace": float, "reason": str |
  null, "requested_at": float}``, written by :func:`request_stop` before it sends SIGTERM to the
  shepherd, which reads it when the SIGTERM arrives.  Created exclusively: the first request
  wins and later ones only re-send the SIGTERM (harmless; retrying a request whose signal was
  lost is safe).  A SIGTERM without the file is a plain stop.

Written by the shepherd:

* ``shepherd.pid``: ``{"pid": int, "starttime": int}``, written before :func:`launch` returns.
  ``starttime`` is field 22 of ``/proc/PID/stat`` so a recycled pid is never mistaken for the
  shepherd.
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
  own request could not be met (see "Who the job runs as" below).
* ``shepherd.log``: the shepherd's own diagnostics (stdout/stderr of the daemon), made when
  the first line is written (most shepherds write none).

The job's control directory ``control/`` (checkpoint protocol, docs/checkpoints.md): the
agent creates it; :func:`write_checkpoint_request` writes ``checkpoint-request.json`` (the
shepherd before every checkpoint signal of a planned stop and before the time limit, the agent
for periodic requests); the job writes ``checkpoint.json`` and ``progress.json``.  The job's
user owns ``control/`` and may put anything there (a link to a root-only file, a FIFO, a huge
file): every file the node side reads there goes through :mod:`jobfiles` (a regular file of the
job's user, never a link, never blocking, bounded), and the request is written through a new
temporary file and a rename, never through what the job put there.  The lock that serialises
requests is ``.request.lock`` in the task directory, which only root may write: in
``control/`` the job could hold it.

Signals understood by the shepherd:

* SIGTERM / SIGINT: stop the job, ``cancelled=true``.  The first one reads ``stop.json``; with a
  ``checkpoint_signal`` the shepherd first delivers it (to the group, or to the main process
  only if the spec's ``signal.batch_only`` is true, then SIGCONT to the group so a suspended
  job can act on it) and waits up to ``checkpoint_grace`` seconds for the job to exit by
  itself.  Then (or at once, without a checkpoint signal) the usual stop: SIGTERM to the group,
  SIGKILL after ``kill_grace_s``.  Further SIGTERMs neither restart nor cut short a running
  grace; the time limit and the fence still apply during it (and win, as the first reason).
* SIGHUP: process ``signal-*.json`` requests.
* SIGUSR1 / SIGUSR2: forwarded as-is to the job's whole process group.

Who the job runs as (spec ``user``): the user's uid, primary gid and supplementary groups from
the node's user database, with USER, LOGNAME and HOME set.  Output files are opened, the
checkpoint directory created and the working directory entered with that user's rights, so
``-o /etc/passwd`` fails ("cannot open output file /etc/passwd: Permission denied") without
touching the file.  An unknown user, or a file or directory the user may not use, ends the
launch with ``job_error: true`` in ``exit.json`` besides ``launch_failed``: the job's own
problem, which the controller does not blame on the node.  A shepherd that is not root runs
only its own user's jobs.  Without ``user`` in the spec the job runs as the shepherd does.

Containment (spec ``cgroup``, a plan made by the agent with :mod:`cgroups`, and ``cpus``):
the shepherd creates the attempt's cgroup, the child joins it before it drops root, sets its
CPU affinity, and the OOM-kill count read is that cgroup's.  When the job has ended (and its
process group been cleaned up), whatever is still in the cgroup, including processes that left
the process group, is killed and the cgroup removed, before ``exit.json`` is written.
"""

from __future__ import annotations

import errno  # builtin modules: free to import
import os
import pwd
import select
import sys
import time

# ``typing`` costs ~7 ms of startup, so it is only imported for the type checker (which
# recognises a module-level ``TYPE_CHECKING`` by name); annotations are never evaluated.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    import subprocess
    from typing import Any, NoReturn

    from phalanx.agent import cgroups as _cgroups
    from phalanx.agent import jobfiles as _jobfiles
else:  # ``_signal`` avoids importing ``enum`` (see module docstring).
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal
    # The sibling module: top-level ``cgroups`` when this file is imported as ``shepherd`` (the
    # launcher, see _BOOTSTRAP) or run as a script, ``phalanx.agent.cgroups`` in the package.
    if __package__:
        from . import cgroups as _cgroups
        from . import jobfiles as _jobfiles
    else:
        _here = os.path.dirname(os.path.abspath(__file__))
        if _here not in sys.path:  # run as a script with -I: its directory is not on the path
            sys.path.append(_here)
        import cgroups as _cgroups
        import jobfiles as _jobfiles

__all__ = [
    "Launcher",
    "ShepherdLaunchError",
    "forward_signal",
    "launch",
    "read_status",
    "request_stop",
]

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
STEPS_SIGNALLED = "steps-signalled"  # a step task of the attempt here got its --signal
# serialises the agent and the shepherd writing requests; in the task dir, which only root
# may write (in control/ the job's user could flock it for ever and wedge both)
REQUEST_LOCK_FILE = ".request.lock"

_SCRIPT = os.path.abspath(__file__)
# ``launch`` imports this file as top-level module ``shepherd`` instead of running it as a
# script: a script's source is recompiled on every start (~10 ms here, doubling startup), an
# imported module loads from its cached .pyc.  Appending (not prepending) the directory keeps
# sibling modules from shadowing the stdlib.
_BOOTSTRAP = (
    "import sys; sys.path.append(sys.argv[1]); import shepherd; "
    "sys.exit(shepherd.main(sys.argv[2:]))"
)
_LAUNCH_TIMEOUT_S = 60.0
# Launcher: how long to wait for the helper's reply, for it to exit when closed, and how long
# to use plain ``launch`` after a restarted helper failed too.
_LAUNCHER_REPLY_TIMEOUT_S = 10.0
_LAUNCHER_CLOSE_TIMEOUT_S = 2.0
_LAUNCHER_BACKOFF_S = 30.0
_FENCE_CHECK_INTERVAL_S = 1.0
# how often a planned stop's grace looks for the job's checkpoint marker (it ends the grace)
_MARKER_CHECK_INTERVAL_S = 0.2
_STRAGGLER_GRACE_CAP_S = 2.0
_REKILL_INTERVAL_S = 5.0
_PROGRESS_CHECK_MAX_S = 1.0
# Signals the shepherd catches; the job gets them reset to SIG_DFL before exec.
_HANDLED = (
    _signal.SIGTERM,
    _signal.SIGINT,
    _signal.SIGHUP,
    _signal.SIGUSR1,
    _signal.SIGUSR2,
    _signal.SIGCHLD,
)
# Python sets these to SIG_IGN at startup and SIG_IGN survives exec, so reset them for the job.
_RESTORE_DEFAULT = (_signal.SIGPIPE, _signal.SIGXFSZ)


class ShepherdLaunchError(RuntimeError):
    """The shepherd daemon could not be started (task dir unusable, interpreter failure...)."""


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
# Public API used by the agent.
# --------------------------------------------------------------------------------------------


def launch(task_dir: str | os.PathLike[str]) -> int:
    """Start a detached shepherd for ``task_dir`` (which must hold ``spec.json``).

    Spawns ``python -I -S -c <import shepherd> --daemonize TASK_DIR`` with ``subprocess`` (safe
    in a multi-threaded caller, unlike ``os.fork``); that intermediate forks the real shepherd,
    waits until it has installed its signal handlers and written ``shepherd.pid``, prints its
    pid and exits, and is reaped here.  So when this returns the shepherd is in its own session,
    is not our child, and already accepts :func:`request_stop` / :func:`forward_signal`.
    If ``task_dir`` already has (or had) a shepherd, returns that one's pid and starts nothing.
    """
    import subprocess

    td = os.path.abspath(os.fspath(task_dir))
    cmd = [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _BOOTSTRAP,
        os.path.dirname(_SCRIPT),
        "--daemonize",
        td,
    ]
    try:
        proc = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            start_new_session=True,
            timeout=_LAUNCH_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ShepherdLaunchError(f"cannot launch shepherd for {td}: {exc}") from exc
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip() or f"exit {proc.returncode}"
        raise ShepherdLaunchError(f"cannot launch shepherd for {td}: {detail}")
    try:
        return int(proc.stdout)
    except ValueError as exc:
        raise ShepherdLaunchError(f"shepherd for {td} printed {proc.stdout!r}") from exc


class _HelperFailed(Exception):
    """The launcher helper died, broke the pipe or answered garbage: restart it and retry."""


class Launcher:
    """Pre-forked shepherd launcher: :func:`launch` without an interpreter start per task.

    :meth:`start` spawns one helper, ``python -I -S shepherd.py --launcher``, in its own
    session.  :meth:`launch` writes the absolute task dir (NUL-terminated) to the helper's stdin;
    the helper forks an intermediate that runs exactly the ``--daemonize`` path (fork, ``setsid``,
    wait for ``shepherd.pid``), reaps it and answers ``ok PID`` or ``err MESSAGE``
    (NUL-terminated) on its stdout.  The helper is single-threaded and forks only from its main
    loop; the intermediate replaces the helper's pipes on fds 0-2 and closes every other fd, so
    no shepherd holds them and a dead helper is seen as EOF at once.

    Thread-safe (one request at a time).  If the helper is dead or the pipe breaks, it is
    restarted once and the request retried (safe: launching is idempotent per task dir), then
    plain :func:`launch` is used (and used alone for ``_LAUNCHER_BACKOFF_S``).  A helper that
    does not answer within ``reply_timeout`` is killed and the launch fails with
    :class:`ShepherdLaunchError`.  The helper exits on EOF of its stdin (the agent closed it or
    died); shepherds it started keep running.  After :meth:`close`, :meth:`launch` falls back to
    plain :func:`launch`.
    """

    def __init__(self, reply_timeout: float = _LAUNCHER_REPLY_TIMEOUT_S) -> None:
        import threading

        self.reply_timeout = reply_timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._closed = False
        self._fallback_until = 0.0

    @property
    def pid(self) -> int | None:
        """The helper's pid while it is started (for diagnostics and tests)."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the helper now (else the first :meth:`launch` does).  Raises OSError."""
        with self._lock:
            if self._closed:
                raise ShepherdLaunchError("launcher is closed")
            if self._proc is None or self._proc.poll() is not None:
                self._restart_locked()

    def launch(self, task_dir: str | os.PathLike[str]) -> int:
        """Like :func:`launch`: the pid of a running, detached shepherd for ``task_dir``."""
        td = os.path.abspath(os.fspath(task_dir))
        request = os.fsencode(td)
        if b"\0" in request:
            raise ShepherdLaunchError(f"cannot launch shepherd for {td!r}: NUL in the path")
        with self._lock:
            if not self._closed and time.monotonic() >= self._fallback_until:
                for _attempt in range(2):
                    try:
                        if self._proc is None or self._proc.poll() is not None:
                            self._restart_locked()
                        return self._request_locked(request + b"\0")
                    except (_HelperFailed, OSError):
                        self._discard_locked()
                self._fallback_until = time.monotonic() + _LAUNCHER_BACKOFF_S
        return launch(td)

    def close(self) -> None:
        """Close the helper's stdin (it exits on EOF) and wait for it briefly, then kill it."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
            self._buf = b""
        if proc is None:
            return
        import subprocess

        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            proc.wait(_LAUNCHER_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc)

    # -- internals (called with the lock held) -----------------------------------------------

    def _restart_locked(self) -> None:
        import subprocess

        self._discard_locked()
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, os.path.dirname(_SCRIPT), "--launcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,  # own process group: killing it takes in-flight forks along
        )

    def _discard_locked(self) -> None:
        """Forget the helper: kill it (and any launch it has in flight) and reap it."""
        proc, self._proc = self._proc, None
        self._buf = b""
        if proc is None:
            return
        _kill_group(proc)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def _request_locked(self, request: bytes) -> int:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            view = memoryview(request)
            while view:
                view = view[os.write(proc.stdin.fileno(), view) :]
        except OSError as exc:  # BrokenPipeError: the helper is gone
            raise _HelperFailed(f"cannot write to the launcher: {exc}") from exc
        out = proc.stdout.fileno()
        poller = select.poll()
        poller.register(out, select.POLLIN)
        deadline = time.monotonic() + self.reply_timeout
        while (end := self._buf.find(b"\0")) < 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._discard_locked()
                raise ShepherdLaunchError(
                    f"the shepherd launcher did not answer within {self.reply_timeout:g}s"
                )
            if not poller.poll(int(remaining * 1000) + 1):
                continue
            chunk = os.read(out, 4096)
            if not chunk:
                raise _HelperFailed("the launcher exited")
            self._buf += chunk
        reply, self._buf = self._buf[:end], self._buf[end + 1 :]
        if reply.startswith(b"ok "):
            try:
                return int(reply[3:])
            except ValueError:
                pass
        elif reply.startswith(b"err "):
            raise ShepherdLaunchError(reply[4:].decode(errors="replace"))
        raise _HelperFailed(f"garbled reply from the launcher: {reply!r}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the helper's process group (its pid, not yet reaped, so not reusable); reap it."""
    import contextlib

    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, _signal.SIGKILL)
        proc.wait()


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


def control_environment(task_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The job's PHX_CONTROL_DIR, PHX_CHECKPOINT_REQUEST/_MARKER and PHX_PROGRESS_FILE."""
    control = os.path.join(os.path.abspath(os.fspath(task_dir)), CONTROL_DIR)
    return {
        "PHX_CONTROL_DIR": control,
        "PHX_CHECKPOINT_REQUEST": os.path.join(control, CHECKPOINT_REQUEST_FILE),
        "PHX_CHECKPOINT_MARKER": os.path.join(control, CHECKPOINT_MARKER_FILE),
        "PHX_PROGRESS_FILE": os.path.join(control, PROGRESS_FILE),
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


# --------------------------------------------------------------------------------------------
# The shepherd process itself.
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


class _LaunchError(Exception):
    """The job could not be started; the message is meant for humans (and the job's stderr).

    ``job_error``: the job's own request is the cause (its user is unknown here, it may not
    open its output file or enter its directory), not the node: exit.json says
    ``job_error: true`` and the controller ends the job FAILED instead of retrying it.
    """

    def __init__(self, message: str, *, job_error: bool = False) -> None:
        super().__init__(message)
        self.job_error = job_error


# errno values that mean "this user may not": the job's fault, not the node's.
_DENIED = (1, 13)  # EPERM, EACCES


class _User:
    """Who the job runs as: name, uid, primary gid, supplementary groups, home."""

    def __init__(self, name: str, uid: int, gid: int, groups: list[int], home: str) -> None:
        self.name, self.uid, self.gid, self.groups, self.home = name, uid, gid, groups, home
        # switching identity needs root; a non-root shepherd only runs its own user's jobs
        self.switch = os.geteuid() == 0 and uid != 0


class _Shepherd:
    """State machine for one task: start the job, supervise it, record the outcome."""

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

    def _path(self, name: str) -> str:
        return os.path.join(self.task_dir, name)

    def _job_uids(self) -> tuple[int]:
        """Whose files the job's control files (marker, progress) must be: its user's, this
        process's own uid when the job runs as the shepherd does (:mod:`jobfiles`)."""
        user = self.user
        return (user.uid if user is not None else os.geteuid(),)

    # -- entry point ---------------------------------------------------------------------

    def run(self, ready_fd: int | None) -> int:
        """Run the task to completion; always try to leave an ``exit.json`` behind."""
        try:
            self._install_signals()
            st = _proc_stat("self")
            owner = _claim_json(
                self._path(PID_FILE),
                {"pid": os.getpid(), "starttime": st[2] if st else None},
            )
            if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
                raise ValueError(f"{PID_FILE} holds {owner!r}")
        except Exception as exc:
            _notify(ready_fd, f"shepherd setup failed in {self.task_dir}: {exc}")
            return 1
        _notify(ready_fd, None, owner["pid"])
        if owner["pid"] != os.getpid():  # launched twice: the first shepherd owns the task
            _log(f"task already has a shepherd (pid {owner['pid']}); exiting")
            return 0
        try:
            result = self._supervise()
        except BaseException as exc:
            import traceback

            _log("internal error:\n" + traceback.format_exc())
            self._emergency_kill()
            try:
                self._remove_cgroup()
            except Exception:
                _log("cannot remove the job's cgroup:\n" + traceback.format_exc())
            result = self._result(None, error=f"shepherd internal error: {exc!r}")
        try:
            _write_json(self._path(EXIT_FILE), result)
        except Exception as exc:
            _log(f"cannot write {EXIT_FILE}: {exc!r}")
            return 1
        io = self.spec.get("io") if isinstance(self.spec, dict) else None
        if isinstance(io, dict):
            _tell_exit(io, result)
        return 0

    def _install_signals(self) -> None:
        """Record signals in ``pending``; the wakeup fd interrupts ``poll`` when one arrives."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wake_r = r
        _signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for signum in _HANDLED:
            _signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    # -- lifecycle -------------------------------------------------------------------------

    def _supervise(self) -> dict[str, Any]:
        try:
            spec = self._load_spec()
            self.user = self._resolve_user(spec)
            self._as_user(self._open_outputs, spec)
            if self._fence_stale():
                self.reason = "fenced"
                msg = "heartbeat file is stale (node fenced); job not started"
                self._write_stderr(msg)
                return self._result(None, error=msg)
            self._handle_pending()
            if self.reason is not None:
                return self._result(None, error="stopped before the job started")
            self._as_user(self._enter_workdir, spec)
            self._setup_cgroup(spec)
            self.oom_base = (
                _cgroups.oom_kills(self.cgroup) if self.cgroup is not None else _oom_kills()
            )
            self._spawn(spec)
        except _LaunchError as exc:
            self._write_stderr(str(exc))
            _log(f"launch failed: {exc}")
            self._remove_cgroup()
            result = self._result(None, error=str(exc), launch_failed=True)
            if exc.job_error:
                result["job_error"] = True
            return result
        finally:
            for fd in {self.out_fd, self.err_fd} - {-1}:
                os.close(fd)
            self.out_fd = self.err_fd = -1
        _write_json(
            self._path(JOB_FILE),
            {"pid": self.pid, "pgid": self.pid, "started_at": self.started_at},
        )
        self._process_requests()
        status = self._wait_job()
        self._cleanup_stragglers()
        self._await_steps()
        oom = self._killed_by_oom(status)
        usage = self._usage()
        self._remove_cgroup()
        result = self._result(status)
        result["usage"] = usage
        if oom:
            result["oom"] = True
        return result

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

    def _load_spec(self) -> dict[str, Any]:
        try:
            spec = _read_json(self._path(SPEC_FILE))
        except (OSError, ValueError) as exc:
            raise _LaunchError(f"cannot read {SPEC_FILE}: {exc}") from exc
        if spec is None:
            raise _LaunchError(f"{SPEC_FILE} not found in {self.task_dir}")
        if not isinstance(spec, dict):
            raise _LaunchError(f"invalid {SPEC_FILE}: not a JSON object")
        argv, env = spec.get("argv"), spec.get("env")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise _LaunchError(f"invalid {SPEC_FILE}: argv must be a non-empty list of strings")
        if not (
            isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise _LaunchError(f"invalid {SPEC_FILE}: env must map strings to strings")
        if not isinstance(spec.get("stdout"), str):
            raise _LaunchError(f"invalid {SPEC_FILE}: stdout must be a path")
        grace = spec.get("kill_grace_s")
        self.grace = float(grace) if isinstance(grace, int | float) else 10.0
        self.spec = spec
        return spec

    def _open_outputs(self, spec: dict[str, Any]) -> None:
        """Open stdout/stderr files; the same file (even via symlink) shares one fd.

        Two separate truncating descriptions of one file would overwrite each other's output.
        """
        io = spec.get("io")
        if isinstance(io, dict) and io.get("pty"):
            return self._open_terminal(io)
        if isinstance(io, dict) and io.get("stdout"):
            # a step task whose output streams to its srun (files given with srun -o/-e win)
            self.out_fd = _connect_stream(io, "out")
            self.err_fd = _connect_stream(io, "err") if io.get("stderr") else self.out_fd
            if not io.get("stderr"):
                return self._open_one_output(spec)
            return
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_APPEND if spec.get("open_mode") == "append" else os.O_TRUNC
        cwd = spec.get("cwd") or "/"
        out_path = os.path.join(cwd, spec["stdout"])  # relative paths: to the job's cwd
        self.out_fd = _open_output(out_path, flags)
        err_path = spec.get("stderr")
        if isinstance(err_path, str):
            err_path = os.path.join(cwd, err_path)
        if not isinstance(err_path, str) or err_path == out_path:
            self.err_fd = self.out_fd
            return
        err_fd = _open_output(err_path, flags)
        a, b = os.fstat(self.out_fd), os.fstat(err_fd)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            os.close(err_fd)
            err_fd = self.out_fd
        self.err_fd = err_fd

    def _open_terminal(self, io: dict[str, Any]) -> None:
        """``srun --pty``: task 0 on a pseudo-terminal relayed to srun (agent/ptys.py); the
        other tasks' output goes nowhere, as Slurm's ``--pty`` does."""
        if io.get("task") != 0:
            self.out_fd = self.err_fd = os.open(os.devnull, os.O_WRONLY)
            return
        try:
            self.out_fd = self.err_fd = _ptys().task_terminal(io, _connect_stream)
        except OSError as exc:
            raise _LaunchError(f"cannot open the step's terminal: {exc}") from exc
        self.tty = True

    def _open_one_output(self, spec: dict[str, Any]) -> None:
        """A step task with its stdout streamed and its stderr to a file (srun -e FILE)."""
        err_path = spec.get("stderr")
        if not isinstance(err_path, str):
            self.err_fd = self.out_fd
            return
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_APPEND if spec.get("open_mode") == "append" else os.O_TRUNC
        err_path = os.path.join(spec.get("cwd") or "/", err_path)
        self.err_fd = _open_output(err_path, flags)

    def _write_stderr(self, msg: str) -> None:
        """Put launch errors where the user looks first: the job's own error file (Slurm does)."""
        fd = self.err_fd if self.err_fd >= 0 else self.out_fd
        if fd < 0:
            return
        _write_quiet(fd, f"phalanx-shepherd: error: {msg}\n")

    def _resolve_user(self, spec: dict[str, Any]) -> _User | None:
        """The job's user from the node's user database (None: the spec names none, run as
        the shepherd's own user).  Unknown here: a job error (the job ends FAILED)."""
        name = spec.get("user")
        if name is None:
            return None
        node = spec.get("node") or "this node"
        if not isinstance(name, str) or not name:
            raise _LaunchError(f"invalid {SPEC_FILE}: user must be a name")
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise _LaunchError(f"user {name} is unknown on {node}", job_error=True) from None
        euid = os.geteuid()
        if euid != 0 and pw.pw_uid != euid:
            try:
                me = pwd.getpwuid(euid).pw_name
            except KeyError:
                me = f"uid {euid}"
            raise _LaunchError(
                f"the agent on {node} runs as {me}, not root, so it cannot start jobs as {name}"
            )
        try:
            groups = os.getgrouplist(name, pw.pw_gid)
        except OSError as exc:
            raise _LaunchError(f"cannot read the groups of {name} on {node}: {exc}") from exc
        return _User(name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)

    def _as_user(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` with the job user's effective uid, gid and groups, so files are
        opened and directories entered with that user's rights (and created owned by the
        user).  The shepherd is single-threaded, so changing them for a moment is safe."""
        user = self.user
        if user is None or not user.switch:
            fn(*args)
            return
        saved = os.getgroups()
        os.setgroups(user.groups)
        os.setegid(user.gid)
        os.seteuid(user.uid)
        try:
            fn(*args)
        finally:
            os.seteuid(0)
            os.setegid(0)
            os.setgroups(saved)

    def _enter_workdir(self, spec: dict[str, Any]) -> None:
        """Create the checkpoint directory and enter the job's working directory, as the job's
        user (the shepherd's cwd becomes the job's, nothing else depends on it)."""
        cwd = spec.get("cwd") or "/"
        ck = spec.get("checkpoint")
        if isinstance(ck, dict) and ck.get("enabled") and isinstance(ck.get("dir"), str):
            try:
                os.makedirs(ck["dir"], exist_ok=True)
            except OSError as exc:  # the job may not need it; say why if it does
                self._write_stderr(f"cannot create checkpoint directory {ck['dir']}: {exc}")
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise _LaunchError(
                f"cannot change directory to {cwd}: {exc.strerror}",
                job_error=exc.errno in _DENIED,
            ) from exc

    def _setup_cgroup(self, spec: dict[str, Any]) -> None:
        """Create the attempt's cgroup from the agent's plan (spec ``cgroup``).  A failure ends
        the launch when the plan is required, else the job runs without (logged)."""
        cpus = spec.get("cpus")
        if isinstance(cpus, list) and all(isinstance(c, int) for c in cpus):
            self.cpus = cpus
        plan = spec.get("cgroup")
        if not isinstance(plan, dict):
            return
        if plan.get("join_only"):
            # a step task joins its job's cgroup on this node, which the job's own shepherd
            # made and removes: nothing to create, and never removed from here
            self.cgroup = plan
            return
        try:
            _cgroups.setup(plan)
        except OSError as exc:
            self.cgroup = plan  # remove what was made
            self._remove_cgroup()
            if plan.get("required", True):
                raise _LaunchError(f"cannot set up the job's cgroup: {exc}") from exc
            _log(f"running without a cgroup: {exc}")
            return
        self.cgroup = plan

    def _remove_cgroup(self) -> None:
        """Kill whatever is left in the job's cgroup and remove it."""
        plan, self.cgroup = self.cgroup, None
        if plan is None or plan.get("join_only"):
            return
        left = _cgroups.remove(plan)
        if left:
            _log(f"cannot remove cgroups {', '.join(left)} (the agent retries)")

    def _spawn(self, spec: dict[str, Any]) -> None:
        """Start the job as a new session (and process-group) leader, as its user.

        ``fork``, then in the child: new session, join the job's cgroup (while still root),
        CPU affinity, groups, gid, uid, stdio, ``execve``.  An exec error travels back on a
        close-on-exec pipe, so it is known before this returns (EOF = the exec happened).
        The working directory is already the job's (:meth:`_enter_workdir`).  SIG_IGN
        dispositions survive exec, so those Python set are reset to SIG_DFL; caught signals
        are reset by exec itself.
        """
        argv: list[str] = spec["argv"]
        env: dict[str, str] = dict(spec["env"])
        user = self.user
        if user is not None:
            env["USER"] = env["LOGNAME"] = user.name
            env["HOME"] = user.home
        devnull = os.open(os.devnull, os.O_RDONLY)
        err_r, err_w = os.pipe()  # both close-on-exec
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(err_r)
            os.close(err_w)
            os.close(devnull)
            raise _LaunchError(f"cannot fork the job: {exc.strerror}") from exc
        if pid == 0:  # the child: never returns
            self._exec_child(argv, env, devnull, err_w)
        os.close(err_w)
        os.close(devnull)
        chunks = []
        try:
            while chunk := os.read(err_r, 4096):
                chunks.append(chunk)
        finally:
            os.close(err_r)
        if chunks:
            os.waitpid(pid, 0)
            raise _LaunchError(b"".join(chunks).decode(errors="replace"))
        self.pid = pid
        self.started_at = time.time()
        self.start_mono = time.monotonic()

    def _exec_child(self, argv: list[str], env: dict[str, str], devnull: int, err_w: int) -> None:
        what = "cannot start a new session"
        try:
            os.setsid()
            if self.tty:
                what = "cannot make the step's terminal the controlling terminal"
                _ptys().make_controlling(self.out_fd)
            if self.cgroup is not None:
                what = "cannot join the job's cgroup"
                _cgroups.attach_self(self.cgroup)
            if self.cpus:
                what = f"cannot set the CPU affinity to {self.cpus}"
                os.sched_setaffinity(0, self.cpus)
            user = self.user
            if user is not None and user.switch:
                what = f"cannot switch to user {user.name}"
                os.setgroups(user.groups)
                os.setresgid(user.gid, user.gid, user.gid)
                os.setresuid(user.uid, user.uid, user.uid)
            what = "cannot set up the job's standard streams"
            os.dup2(self.out_fd if self.tty else devnull, 0)
            os.dup2(self.out_fd, 1)
            os.dup2(self.err_fd, 2)
            for signum in _RESTORE_DEFAULT:
                _signal.signal(signum, _signal.SIG_DFL)
            what = f"cannot execute {argv[0]}"
            os.execve(argv[0], argv, env)
        except OSError as exc:
            _write_quiet(err_w, f"{what}: {exc.strerror or exc}")
        except BaseException as exc:  # e.g. ValueError: NUL byte or "=" in a variable name
            _write_quiet(err_w, f"{what}: {exc}")
        finally:
            os._exit(127)

    def _wait_job(self) -> int:
        """Sleep until the job exits, a signal arrives or the next deadline; return its status."""
        spec = self.spec
        limit = spec.get("time_limit_s")
        limit_at = self.start_mono + float(limit) if isinstance(limit, int | float) else None
        sig = spec.get("signal")
        signal_at: float | None = None
        if isinstance(sig, dict) and limit_at is not None:
            signal_at = limit_at - float(sig.get("before_s") or 0)
        fence_at = self.start_mono if isinstance(spec.get("fence"), dict) else None
        ckpt_at = self._checkpoint_before_limit(limit_at)
        hang_at = self._first_progress_check()
        marker_at = 0.0  # next look at the checkpoint marker during a planned stop's grace

        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(self.pid)
            poller.register(pidfd, select.POLLIN)
        except (AttributeError, OSError):
            pidfd = None  # SIGCHLD through the wakeup fd still wakes us
        try:
            while True:
                wpid, status = os.waitpid(self.pid, os.WNOHANG)
                if wpid == self.pid:
                    self.reaped = True
                    return status
                self._handle_pending()
                now = time.monotonic()
                if self.reason is not None:
                    # already stopping; the fence still watches, and shortens a long grace
                    signal_at = limit_at = self.checkpoint_until = ckpt_at = None
                if self.checkpoint_until is not None and now >= self.checkpoint_until:
                    self.checkpoint_until = None
                    _log("checkpoint grace over: the job is still running")
                    self._stop("cancelled")
                if self.checkpoint_until is not None and now >= marker_at and self._grace_done():
                    self.checkpoint_until = None
                    self._stop("cancelled")
                if self.checkpoint_until is not None and now >= marker_at:
                    marker_at = now + _MARKER_CHECK_INTERVAL_S
                if ckpt_at is not None and now >= ckpt_at and limit_at is not None:
                    ckpt_at = None
                    self._checkpoint_at_limit(limit_at)
                if signal_at is not None and now >= signal_at:
                    signal_at = None
                    assert isinstance(sig, dict)
                    self._time_signal(sig)
                if limit_at is not None and now >= limit_at:
                    limit_at = None
                    self._stop("timed_out")
                if fence_at is not None and now >= fence_at:
                    fence_at = now + _FENCE_CHECK_INTERVAL_S
                    if self._fence_stale():
                        if self.reason is None:
                            self._stop("fenced")
                        else:
                            self._hurry_for_fence(now)
                if hang_at is not None and now >= hang_at:
                    hang_at = self._check_progress(now)
                if self.kill_at is not None and now >= self.kill_at:
                    _log("grace period over: SIGKILL to the job's process group")
                    self._killpg(_signal.SIGKILL)
                    self.kill_at = now + _REKILL_INTERVAL_S
                candidates = (
                    signal_at,
                    limit_at,
                    fence_at,
                    self.checkpoint_until,
                    marker_at if self.checkpoint_until is not None else None,
                    self.kill_at,
                    ckpt_at,
                    hang_at,
                )
                deadlines = [t for t in candidates if t is not None]
                timeout_ms = None
                if deadlines:
                    timeout_ms = max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)
                poller.poll(timeout_ms)
                self._drain_wakeup()
        finally:
            if pidfd is not None:
                os.close(pidfd)

    # -- hang detection (--progress-timeout) --------------------------------------------------

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

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self.wake_r, 256):
                pass
        except BlockingIOError:
            pass

    def _handle_pending(self) -> None:
        pending, self.pending = self.pending, []
        for signum in pending:
            if signum in (_signal.SIGTERM, _signal.SIGINT):
                self._stop_requested()
            elif signum == _signal.SIGHUP:
                self._process_requests()
            elif signum in (_signal.SIGUSR1, _signal.SIGUSR2):
                self._deliver(signum, batch_only=False)

    def _stop_requested(self) -> None:
        """A stop request: checkpoint signal and grace first if ``stop.json`` asks for them.

        Only the first request is read.  Later ones leave a running grace alone and are
        otherwise plain stops (no-ops once the stop sequence has begun).
        """
        if not self.stop_requested and not self.reaped:
            self.stop_requested = True
            signum, grace, self.stop_reason, wait = self._read_stop_request()
            if signum is None and wait and grace > 0 and self.reason is None and self.pid:
                # a planned stop whose signal goes elsewhere: the grace, without a signal
                what = "the job's steps here" if self.spec.get("holder") else "the task"
                _log(
                    f"stop requested ({self.stop_reason or 'no reason given'}): waiting up to"
                    f" {grace:g}s for {what} to end before stopping"
                )
                self.marker_before = self._marker_stamp()
                if self.spec.get("holder"):  # ranks here poll the request file it writes
                    self.stop_request_seq = self._write_request(
                        self.stop_reason or "stop", time.time() + grace
                    )
                self.checkpoint_until = time.monotonic() + grace
                self.grace_ends_at = self.checkpoint_until
                return
            if signum is not None and self.reason is None and self.pid:
                sig = self.spec.get("signal")
                batch_only = isinstance(sig, dict) and bool(sig.get("batch_only"))
                _log(
                    f"stop requested ({self.stop_reason or 'no reason given'}): checkpoint"
                    f" signal {signum}{' to the main process' if batch_only else ''},"
                    f" stopping in {grace:g}s unless the job exits"
                )
                self.marker_before = self._marker_stamp()
                self.stop_request_seq = self._write_request(
                    self.stop_reason or "stop", time.time() + grace
                )
                self.checkpoint_sent_at = time.time()  # before: the job may answer at once
                self._deliver(signum, batch_only)
                self._killpg(_signal.SIGCONT)  # a suspended job must run to checkpoint
                self.checkpoint_until = time.monotonic() + grace
                self.grace_ends_at = self.checkpoint_until
                return
        if self.checkpoint_until is None:
            self._stop("cancelled")

    def _time_signal(self, sig: dict[str, Any]) -> None:
        """``--signal=[B:]SIG@N`` is due.  With ``B:``: the batch shell alone.  Without: as in
        Slurm, the job's steps and not the batch shell, while it has any running here (their
        own shepherds deliver it to them); a job with none gets it in its whole process group
        (a Phalanx extension: scripts that run their work without srun still hear it)."""
        signum, batch_only = sig.get("signum"), bool(sig.get("batch_only"))
        if "step_id" in self.spec:
            _mark_steps_signalled(self.spec)
        elif not batch_only and _steps_running(self.spec, self.task_dir):
            _log(f"time limit approaching: signal {signum} is for the job's running steps")
            return
        _log(f"time limit approaching: delivering signal {signum}")
        self._deliver(signum, batch_only)

    def _write_request(self, reason: str, deadline: float | None) -> int | None:
        """Tell the job in its request file, too (for jobs that poll rather than trap)."""
        try:
            seq = write_checkpoint_request(self.task_dir, reason, deadline=deadline, stop=True)
            _log(f"checkpoint request {seq}: {reason}")
            return seq
        except (OSError, ValueError) as exc:
            _log(f"cannot write the checkpoint request: {exc!r}")
            return None

    def _grace_done(self) -> bool:
        """Whether a planned stop's grace may end before its deadline: for a holder, once
        the job's steps on this node have ended (they live in its cgroup, so it must not go
        before them, and has nothing else to wait for); for a task, once the job reported
        the checkpoint the stop asked for."""
        if self.spec.get("holder"):
            if _live_step_tasks(self.spec):
                return False
            _log("the job's steps on this node have ended: stopping the holder")
            return True
        if self._checkpoint_reported():
            _log("checkpoint reported: the grace ends early, stopping the job")
            return True
        return False

    def _await_steps(self) -> None:
        """After a planned stop ended this task's main process, keep the job's cgroup (which
        this shepherd removes) while the job's steps on this node still run, until the
        stop's grace and then their own kill grace are over: a batch shell that exits on the
        checkpoint signal, or a holder whose grace ran out, must not kill a rank that is
        still writing its checkpoint. Steps' own shepherds stop them at the grace's end."""
        if self.grace_ends_at is None or self.reason == "fenced" or "step_id" in self.spec:
            return
        plan = self.cgroup
        if plan is None or plan.get("join_only"):
            return
        deadline = self.grace_ends_at + self.grace
        if _live_step_tasks(self.spec) and time.monotonic() < deadline:
            _log("the job's steps on this node still run: keeping its cgroup until they end")
        while _live_step_tasks(self.spec) and time.monotonic() < deadline:
            if self._fence_stale():
                _log("fenced while waiting for the job's steps: removing the cgroup now")
                return
            time.sleep(0.1)

    def _checkpoint_reported(self) -> bool:
        """Whether the job reported a checkpoint that answers the planned stop's request
        (the marker's ``request_seq`` reaches it, or a marker written since the signal): its
        grace then ends at once, since work after the checkpoint would be lost anyway."""
        path = os.path.join(self.task_dir, CONTROL_DIR, CHECKPOINT_MARKER_FILE)
        stamp = self._marker_stamp()
        if stamp is None or stamp == self.marker_before:
            return False  # no marker, or the one there before the request
        got = _jobfiles.read_or_none(path, self._job_uids())  # the job's: never a link, a FIFO
        if got is None:
            return False
        text = got[0].decode("utf-8", errors="replace")
        try:
            data = _loads(text)
        except ValueError:
            data = None
        sent = self.checkpoint_sent_at or 0.0
        if isinstance(data, dict):
            seq = data.get("request_seq")
            if (
                isinstance(seq, int)
                and not isinstance(seq, bool)
                and self.stop_request_seq is not None
            ):
                return seq >= self.stop_request_seq
            done = data.get("finished_at")
            if isinstance(done, int | float) and not isinstance(done, bool):
                return float(done) >= sent
        # a plain path (a script's `echo PATH > $PHX_CHECKPOINT_MARKER`): written since the
        # request (its mtime comes from the kernel's coarse clock, which may lag the signal's
        # time.time() by a tick, so a change of the file is what counts)
        return bool(text.strip())

    def _marker_stamp(self) -> tuple[int, int, int] | None:
        """(inode, mtime ns, size) of the checkpoint marker, None when there is none (or it
        is not a regular file of the job's user: :mod:`jobfiles`)."""
        path = os.path.join(self.task_dir, CONTROL_DIR, CHECKPOINT_MARKER_FILE)
        st = _jobfiles.stat_or_none(path, self._job_uids())
        if st is None:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _checkpoint_before_limit(self, limit_at: float | None) -> float | None:
        """When (monotonic) to ask for a checkpoint before the time limit, or None.

        Only for jobs with a checkpoint spec, and only when the grace fits in the limit.
        """
        ck = self.spec.get("checkpoint")
        if limit_at is None or not isinstance(ck, dict) or not ck.get("enabled"):
            return None
        grace = ck.get("grace_s")
        if not isinstance(grace, int | float) or grace < 0:
            return None
        at = limit_at - float(grace)
        return at if at > self.start_mono else None

    def _checkpoint_at_limit(self, limit_at: float) -> None:
        """The time limit is a planned stop: request a checkpoint and send the signal."""
        ck = self.spec["checkpoint"]
        wall_limit = time.time() + max(0.0, limit_at - time.monotonic())
        self._write_request("time limit", wall_limit)
        sig = self.spec.get("signal")
        same = isinstance(sig, dict) and sig.get("signum") == ck.get("signum")
        if (
            same
            and isinstance(sig, dict)
            and float(sig.get("before_s") or 0) == float(ck.get("grace_s") or 0)
        ):
            return  # --signal delivers the same signal at the same moment
        _log(f"time limit approaching: checkpoint signal {ck.get('signum')}")
        self._deliver(ck.get("signum"), bool(ck.get("batch_only")))
        self.checkpoint_sent_at = time.time()

    def _read_stop_request(self) -> tuple[int | None, float, str | None, bool]:
        """(checkpoint signal, grace, reason, wait) from ``stop.json``; a plain stop if
        absent or bad. ``wait``: give the grace even without a signal (`request_stop`)."""
        try:
            req = _read_json(self._path(STOP_FILE))
        except (OSError, ValueError) as exc:
            _log(f"unreadable {STOP_FILE} ({exc}): stopping without a checkpoint")
            return None, 0.0, None, False
        if not isinstance(req, dict):
            return None, 0.0, None, False
        reason = req.get("reason")
        reason = reason if isinstance(reason, str) else None
        wait = req.get("wait") is True
        grace = req.get("checkpoint_grace")
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
            grace = 0.0
        grace = min(float(grace), 1e9)
        signum = req.get("checkpoint_signal")
        if signum is None:
            return None, grace if wait else 0.0, reason, wait
        if isinstance(signum, bool) or not isinstance(signum, int) or not 0 < signum < _signal.NSIG:
            _log(f"invalid checkpoint signal {signum!r}: stopping without a checkpoint")
            return None, 0.0, reason, False
        return signum, grace, reason, wait

    def _stop(self, reason: str) -> None:
        """Begin graceful termination; the first reason wins (a timed-out job stays timed out)."""
        if self.reason is not None:
            return
        self.reason = reason
        if not self.pid or self.reaped:
            return
        grace = self.grace
        fence = self.spec.get("fence")
        if reason == "fenced" and isinstance(fence, dict) and fence.get("kill_grace_s") is not None:
            # self-fencing must finish before the controller may requeue the job elsewhere
            # (fence_timeout + fence_kill_grace + margin < node_down_timeout)
            grace = min(grace, float(fence["kill_grace_s"]))
        _log(f"stopping job ({reason}): SIGTERM, SIGKILL in {grace:g}s")
        self._killpg(_signal.SIGTERM)
        self._killpg(_signal.SIGCONT)  # a stopped job must run to see its SIGTERM
        self.kill_at = time.monotonic() + grace

    def _hurry_for_fence(self, now: float) -> None:
        """Fenced while already stopping (a cancel, the time limit): never wait longer than the
        fence's kill grace, or the job could outlive the moment it is requeued elsewhere."""
        fence = self.spec.get("fence")
        if not isinstance(fence, dict) or fence.get("kill_grace_s") is None:
            return
        deadline = now + float(fence["kill_grace_s"])
        if self.kill_at is None or self.kill_at > deadline:
            _log("fenced while stopping: SIGKILL moved forward")
            self.kill_at = deadline

    def _killpg(self, signum: int) -> bool:
        """Signal the job's process group; False if the group no longer exists."""
        if not self.pid:
            return False
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def _deliver(self, signum: Any, batch_only: bool) -> None:
        if not isinstance(signum, int) or not 0 < signum < _signal.NSIG:
            _log(f"ignoring invalid signal number {signum!r}")
            return
        if not self.pid or self.reaped:
            return
        try:
            if batch_only:
                os.kill(self.pid, signum)  # still our unreaped child, so the pid is ours
            else:
                os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def _process_requests(self) -> None:
        """Deliver and delete ``signal-*.json`` requests (in the order they were made)."""
        if not self.pid or self.reaped:
            return
        try:
            names = sorted(
                n
                for n in os.listdir(self.task_dir)
                if n.startswith(SIGNAL_REQUEST_PREFIX) and n.endswith(".json")
            )
        except OSError as exc:
            _log(f"cannot list signal requests: {exc}")
            return
        for name in names:
            path = self._path(name)
            try:
                req = _read_json(path)
                os.unlink(path)
            except (OSError, ValueError) as exc:
                _log(f"bad signal request {name}: {exc}")
                continue
            if isinstance(req, dict):
                self._deliver(req.get("signum"), bool(req.get("batch_only")))

    def _fence_stale(self) -> bool:
        """True if the agent's heartbeat is older than the fence timeout.

        A missing file only counts as stale once the shepherd itself has run for the timeout,
        so an agent that writes the heartbeat just after launching is not fenced at once.
        """
        fence = self.spec.get("fence")
        if not isinstance(fence, dict):
            return False
        timeout = float(fence.get("timeout_s") or 30.0)
        try:
            mtime = os.stat(fence["heartbeat_file"]).st_mtime
        except OSError:
            return time.monotonic() - self.start_mono > timeout
        return time.time() - mtime > timeout

    def _cleanup_stragglers(self) -> None:
        """Terminate whatever the main process left in its process group, as Slurm does.

        The main process is already reaped; its pgid stays reserved while any member lives, so
        ``killpg`` cannot hit an unrelated group.  Zombie members (orphans awaiting a slow
        PID 1) still make ``killpg(pgid, 0)`` succeed, hence the /proc scan.
        """
        if not self._group_alive():
            return
        if self.kill_at is None:
            self._killpg(_signal.SIGTERM)
            self._killpg(_signal.SIGCONT)
            deadline = time.monotonic() + min(self.grace, _STRAGGLER_GRACE_CAP_S)
        else:
            deadline = self.kill_at
        while time.monotonic() < deadline:
            if not self._group_alive():
                return
            time.sleep(0.05)
        _log("stragglers survived SIGTERM: SIGKILL to the process group")
        self._killpg(_signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def _group_alive(self) -> bool:
        """True if a non-zombie process is still in the job's process group."""
        if not self.pid:
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _proc_stat(name)
                if st is not None and st[1] == self.pid and st[0] not in ("Z", "X", "x"):
                    return True
        return False

    def _emergency_kill(self) -> None:
        """After an internal error, never leave an unsupervised job behind."""
        if self.pid and not self.reaped:
            self._killpg(_signal.SIGKILL)
            try:
                os.waitpid(self.pid, 0)
                self.reaped = True
            except ChildProcessError:
                pass

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
        }


def _open_output(path: str, flags: int) -> int:
    """Open one of the job's output files (the caller runs it as the job's user, so the user's
    rights decide what may be opened).  ``O_NONBLOCK``: a FIFO without a reader fails at once
    instead of blocking the shepherd for ever (it could then neither stop nor fence its job);
    the descriptor is made blocking again for the job.  ``O_NOCTTY``: a terminal named as the
    output never becomes the shepherd's controlling terminal."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise _LaunchError(
                f"cannot open output file {path}: a FIFO with no reader", job_error=True
            ) from exc
        raise _LaunchError(
            f"cannot open output file {path}: {exc.strerror}", job_error=exc.errno in _DENIED
        ) from exc
    os.set_blocking(fd, True)
    return fd


def _ptys() -> Any:
    """agent/ptys.py, imported only for ``srun --pty`` tasks (as ``cgroups`` is found)."""
    if __package__:
        from . import ptys
    else:
        import ptys  # type: ignore[no-redef]
    return ptys


def _steps_running(spec: dict[str, Any], task_dir: str) -> bool:
    """True when this attempt's steps (srun) take ``--signal`` here: a step task directory
    ``<attempt>.<step>.<task>`` in ``steps_dir`` without ``exit.json`` (one still starting
    counts: its own shepherd delivers the signal once it runs), or a step task that already
    got it (``STEPS_SIGNALLED`` in the job's task directory): a step's shepherd times the
    same signal itself, from a limit rounded to whole seconds, and its task may have exited
    on it a moment before the batch shell's is due."""
    steps_dir, attempt = spec.get("steps_dir"), spec.get("attempt_id")
    if not isinstance(steps_dir, str) or "step_id" in spec or attempt is None:
        return False
    if os.path.exists(os.path.join(task_dir, STEPS_SIGNALLED)):
        return True
    prefix = f"{attempt}."
    try:
        names = [n for n in os.listdir(steps_dir) if n.startswith(prefix)]
    except OSError:
        return False
    return any(not os.path.exists(os.path.join(steps_dir, n, EXIT_FILE)) for n in names)


def _live_step_tasks(spec: dict[str, Any]) -> int:
    """How many step tasks of this attempt on this node have not ended: a task directory
    ``<attempt>.<step>.<task>`` in ``steps_dir`` without ``exit.json`` whose shepherd is alive
    (one that vanished without a word ends nothing more by being waited for)."""
    steps_dir, attempt = spec.get("steps_dir"), spec.get("attempt_id")
    if not isinstance(steps_dir, str) or "step_id" in spec or attempt is None:
        return 0
    prefix = f"{attempt}."
    try:
        names = [n for n in os.listdir(steps_dir) if n.startswith(prefix)]
    except OSError:
        return 0
    live = 0
    for name in names:
        d = os.path.join(steps_dir, name)
        if not os.path.exists(os.path.join(d, EXIT_FILE)) and _live_shepherd(d) is not None:
            live += 1
    return live


def _mark_steps_signalled(spec: dict[str, Any]) -> None:
    """A step task's ``--signal`` is due: say so in its job's task directory (above)."""
    job_dir = spec.get("job_dir")
    if not isinstance(job_dir, str):
        return
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        os.close(os.open(os.path.join(job_dir, STEPS_SIGNALLED), flags, 0o600))
    except OSError as exc:
        _log(f"cannot mark the job's steps signalled: {exc}")


def _connect_stream(io: dict[str, Any], what: str) -> int:
    """A connection to the step's srun carrying one stream of one task, as a plain fd.

    The first line names the step's cookie (so nobody else can inject output), the task and
    the stream (``out``, ``err`` or ``exit``); the task then writes straight into the socket.
    ``_socket`` rather than ``socket``: the latter imports ``enum`` (startup cost, see top).
    """
    import _socket

    try:
        sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect((str(io["host"]), int(io["port"])))
        sock.settimeout(None)
        sock.sendall(f"{io['cookie']} {int(io['task'])} {what}\n".encode())
        return int(sock.detach())
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise _LaunchError(
            f"cannot reach srun at {io.get('host')}:{io.get('port')}: {exc}"
        ) from exc


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


def _write_quiet(fd: int, msg: str) -> bool:
    """Best-effort write for diagnostics: failing to report must not become a new failure."""
    try:
        os.write(fd, msg.encode(errors="replace"))
    except OSError:
        return False
    return True


def _notify(fd: int | None, error: str | None, pid: int = 0) -> None:
    """Tell the daemonizing parent the task's shepherd is ready (``ok PID``) or why we failed."""
    if fd is None:
        if error:
            _log(error)
        return
    _write_quiet(fd, f"ok {pid}" if error is None else error)
    os.close(fd)


def _daemonize(task_dir: str) -> NoReturn:
    """Intermediate process: fork the shepherd, relay its pid once it is ready, and exit.

    The shepherd calls ``setsid`` and outlives us, so it is re-parented (to PID 1 or a
    subreaper) and is never a child of the agent.  Both processes leave with ``os._exit``:
    there is nothing to flush, and interpreter finalisation costs ~2 ms per task.  The pid
    printed is the one the shepherd reports: another's if the task dir was already claimed.
    Also the child side of the :class:`Launcher` helper's fork (fds 0-2 set up by the caller).
    """
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        chunks = []
        while chunk := os.read(ready_r, 4096):
            chunks.append(chunk)
        answer = b"".join(chunks)
        if answer.startswith(b"ok ") and answer[3:].isdigit():
            os.write(1, answer[3:] + b"\n")
            os._exit(0)
        os.write(2, answer or b"shepherd exited before it was ready")
        os._exit(1)
    try:
        os.close(ready_r)
        os.setsid()
        os.chdir("/")
        if not (os.path.isdir(task_dir) and os.access(task_dir, os.W_OK | os.X_OK)):
            raise OSError(f"{task_dir} is not a writable directory")
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
    except OSError as exc:
        _write_quiet(ready_w, f"cannot set up shepherd in {task_dir}: {exc}")
        os._exit(1)
    global _log_path
    _log_path = os.path.join(task_dir, LOG_FILE)  # made at the first line (_open_log)
    _jobfiles.warn = _log  # refused job files are reported in shepherd.log
    try:
        code = _Shepherd(task_dir).run(ready_w)
    except BaseException:
        import traceback

        _log("internal error:\n" + traceback.format_exc())
        code = 1
    os._exit(code)


def _fork_daemonize(task_dir: str) -> bytes:
    """Launcher helper: run the ``--daemonize`` path in a forked child; return the reply.

    The child gets /dev/null on fd 0 and a result pipe on fds 1 and 2 and closes every other
    fd, so neither it nor the shepherd it forks keeps the helper's pipes to the agent open.
    It never returns into the helper's loop, whatever happens.  Errors read like
    :func:`launch`'s.
    """
    prefix = f"err cannot launch shepherd for {task_dir}: ".encode(errors="replace")
    try:
        res_r, res_w = os.pipe()
    except OSError as exc:
        return prefix + str(exc).encode(errors="replace")
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(res_r)
        os.close(res_w)
        return prefix + str(exc).encode(errors="replace")
    if pid == 0:
        try:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(res_w, 1)
            os.dup2(res_w, 2)
            os.closerange(3, 1 << 20)  # close_range(2): one syscall
            _daemonize(task_dir)
        except BaseException as exc:
            _write_quiet(2, repr(exc))
        finally:
            os._exit(1)
    os.close(res_w)
    chunks = []
    try:
        while chunk := os.read(res_r, 4096):
            chunks.append(chunk)
    finally:
        os.close(res_r)
        _, status = os.waitpid(pid, 0)
    answer = b"".join(chunks).strip()
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and answer.isdigit():
        return b"ok " + answer
    return prefix + (answer or f"exit status {status}".encode()).replace(b"\0", b" ")


def _preload() -> None:
    """Load here, once, what every shepherd would otherwise load after its fork: the ASCII
    codec (cgroup files are opened with encoding="ascii"; looking a codec up the first time
    imports its module, ~1 ms of every shepherd's CPU), ``resource`` and ``_socket``.
    Forked shepherds inherit them.  Cheap built-ins, so the one-shot ``--daemonize`` path
    keeps loading them lazily."""
    import _socket  # noqa: F401
    import codecs
    import resource  # noqa: F401

    codecs.lookup("ascii")


def _serve_launcher() -> int:
    """Launcher helper main loop: NUL-terminated task dirs on fd 0, replies on fd 1.

    Single-threaded; forks only here.  Exits on EOF (the agent closed the pipe or died) or
    when the reply cannot be written; shepherds already started are unaffected.
    """
    try:
        os.fstat(2)
    except OSError:  # keep fds 0-2 taken so pipes made later never land on them
        os.open(os.devnull, os.O_RDWR)
    os.chdir("/")
    _preload()
    buf = b""
    while True:
        try:
            chunk = os.read(0, 65536)
        except OSError:
            return 1
        if not chunk:
            return 0
        buf += chunk
        while (end := buf.find(b"\0")) >= 0:
            task_dir, buf = os.fsdecode(buf[:end]), buf[end + 1 :]
            view = memoryview(_fork_daemonize(task_dir) + b"\0")
            try:
                while view:
                    view = view[os.write(1, view) :]
            except OSError:
                return 0


def main(argv: list[str]) -> int:
    """``shepherd.py [--daemonize] TASK_DIR | --launcher``; plain TASK_DIR runs in the foreground."""
    if len(argv) == 2 and argv[0] == "--daemonize":
        _daemonize(os.path.abspath(argv[1]))
    if argv == ["--launcher"]:
        return _serve_launcher()
    if len(argv) == 1 and not argv[0].startswith("-"):
        _jobfiles.warn = _log
        return _Shepherd(os.path.abspath(argv[0])).run(None)
    os.write(2, b"usage: shepherd.py [--daemonize] TASK_DIR | --launcher\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
