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
interpreter startup.  ``shepherd_launch.launch`` imports this file as a module (cached .pyc) rather than
running it as a script (recompiled every time) and exits the helper processes with
``os._exit``.  The job is started with ``fork`` + ``execve`` (``posix_spawn`` would be cheaper
but cannot change the uid or join a cgroup).  Measured on the 2-core dev box: ~120 trivial
tasks/s launched and completed.  The file still
works as a script: ``python -I -S shepherd.py [--daemonize] TASK_DIR``.

Even so, a fresh interpreter per task costs ~8-9 ms of CPU.  The agent therefore uses a
``shepherd_launch.Launcher``: one long-lived helper (``shepherd.py --launcher``, a "zygote") that has this
module imported already and forks the same double-forked, ``setsid`` shepherd per task on
request (a fork costs a fraction of an interpreter start).  Plain ``launch`` stays as the
fallback.  Launching is idempotent per task directory: a shepherd claims the directory by
creating ``shepherd.pid`` exclusively, and a second launch for the same directory reports the
first shepherd's pid instead of running the job again (which makes retrying after a helper
died mid-request safe).

The shepherd's modules (all standard library only, and loaded as top-level modules in the
shepherd process: this file appends its directory to ``sys.path``):

* ``shepherd.py`` (this file): the process: daemonizing, the launcher helper's loop, ``main``,
  and :class:`_Shepherd`, the main loop of one task from claiming ``shepherd.pid`` to writing
  ``exit.json``, assembled from ``shepherd_start.py`` (starting the job), ``shepherd_stop.py``
  (signals and stops), ``shepherd_hang.py`` (hang detection) and ``shepherd_report.py`` (the
  exit record) over ``shepherd_state.py`` (their shared state);
* ``shepherd_files.py``: the task directory's file protocol; ``checkpoint_requests.py``: the
  checkpoint request in the job's control directory;
* on the agent's side only: ``shepherd_launch.py`` (starting shepherds) and
  ``shepherd_control.py`` (status, stops, signals and checkpoints of a running one).
"""

from __future__ import annotations

import os
import select
import sys
import time

# ``typing`` costs ~7 ms of startup, so it is only imported for the type checker (which
# recognises a module-level ``TYPE_CHECKING`` by name); annotations are never evaluated.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from typing import Any, NoReturn

    from phalanx.agent import cgroups as _cgroups
    from phalanx.agent import jobfiles as _jobfiles
    from phalanx.agent import shepherd_files as _files
    from phalanx.agent.shepherd_files import (
        EXIT_FILE,
        JOB_FILE,
        LOG_FILE,
        PID_FILE,
        _claim_json,
        _log,
        _proc_stat,
        _write_json,
        _write_quiet,
    )
    from phalanx.agent.shepherd_hang import _HangDetection
    from phalanx.agent.shepherd_hooks import _Hooks
    from phalanx.agent.shepherd_report import _oom_kills, _Report, _tell_exit
    from phalanx.agent.shepherd_start import _JobStart, _LaunchError
else:  # ``_signal`` avoids importing ``enum`` (see above)
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal
    # The sibling modules: top-level ``shepherd_files`` and so on when this file is imported as
    # ``shepherd`` (the launcher, see shepherd_launch._BOOTSTRAP) or run as a script,
    # ``phalanx.agent.shepherd_files`` in the package.
    if __package__:
        from . import cgroups as _cgroups
        from . import jobfiles as _jobfiles
        from . import shepherd_files as _files
        from .shepherd_files import (
            EXIT_FILE,
            JOB_FILE,
            LOG_FILE,
            PID_FILE,
            _claim_json,
            _log,
            _proc_stat,
            _write_json,
            _write_quiet,
        )
        from .shepherd_hang import _HangDetection
        from .shepherd_hooks import _Hooks
        from .shepherd_report import _oom_kills, _Report, _tell_exit
        from .shepherd_start import _JobStart, _LaunchError
    else:
        _here = os.path.dirname(os.path.abspath(__file__))
        if _here not in sys.path:  # run as a script with -I: its directory is not on the path
            sys.path.append(_here)
        import cgroups as _cgroups
        import jobfiles as _jobfiles
        import shepherd_files as _files
        from shepherd_files import (
            EXIT_FILE,
            JOB_FILE,
            LOG_FILE,
            PID_FILE,
            _claim_json,
            _log,
            _proc_stat,
            _write_json,
            _write_quiet,
        )
        from shepherd_hang import _HangDetection
        from shepherd_hooks import _Hooks
        from shepherd_report import _oom_kills, _Report, _tell_exit
        from shepherd_start import _JobStart, _LaunchError

_FENCE_CHECK_INTERVAL_S = 1.0
# how often a planned stop's grace looks for the job's checkpoint marker (it ends the grace)
_MARKER_CHECK_INTERVAL_S = 0.2
_REKILL_INTERVAL_S = 5.0


class _Shepherd(_HangDetection, _JobStart, _Report, _Hooks):
    """State machine for one task: start the job, supervise it, record the outcome."""

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
            self._epilog(result)  # every process of the job here has ended
        except Exception as exc:
            _log(f"cannot run the epilog: {exc!r}")
            result["epilog_failed"] = f"epilog failed (could not run: {exc!r})"
        try:
            _write_json(self._path(EXIT_FILE), result)
        except Exception as exc:
            _log(f"cannot write {EXIT_FILE}: {exc!r}")
            return 1
        io = self.spec.get("io") if isinstance(self.spec, dict) else None
        if isinstance(io, dict):
            _tell_exit(io, result)
        return 0

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
            prolog_failed = self._prolog()  # as root, before anything of the job's runs here
            if prolog_failed:
                raise _LaunchError(f"{prolog_failed} on {spec.get('node') or 'this node'}")
            if self._fence_stale():  # the prolog may have taken long
                self.reason = "fenced"
                msg = "heartbeat file is stale (node fenced); job not started"
                self._write_stderr(msg)
                return self._result(None, error=msg)
            self._handle_pending()
            if self.reason is not None:
                return self._result(None, error="stopped before the job started")
            self._as_user(self._enter_workdir, spec)
            task_prolog_failed = self._task_prolog(spec["env"])
            if task_prolog_failed:
                raise _LaunchError(f"{task_prolog_failed} on {spec.get('node') or 'this node'}")
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
    _files._log_path = os.path.join(task_dir, LOG_FILE)  # made at the first line (_open_log)
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
