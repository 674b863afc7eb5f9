"""Starting shepherds, on the agent's side: :func:`launch` and the pre-forked :class:`Launcher`.

Each task is run by a detached shepherd process (``shepherd.py``, the file this module
starts); this is how the agent gets one going, idempotently per task directory, and learns
its pid.  Why a launcher helper as well as plain :func:`launch`: a fresh interpreter per task
costs ~8-9 ms of CPU, a fork of a helper that has the shepherd imported already a fraction of
that (see shepherd.py).  Runs in the agent, never in the shepherd process; the standard
library only.
"""

from __future__ import annotations

import os
import select
import sys
import time

TYPE_CHECKING = False  # as in shepherd_files.py
if TYPE_CHECKING:
    import signal as _signal
    import subprocess
else:
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal


class ShepherdLaunchError(RuntimeError):
    """The shepherd daemon could not be started (task dir unusable, interpreter failure...)."""


# The shepherd's own file, started by :func:`launch` and the :class:`Launcher`.
_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shepherd.py")
# ``launch`` imports that file as top-level module ``shepherd`` instead of running it as a
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


def launch(task_dir: str | os.PathLike[str]) -> int:
    """Start a detached shepherd for ``task_dir`` (which must hold ``spec.json``).

    Spawns ``python -I -S -c <import shepherd> --daemonize TASK_DIR`` with ``subprocess`` (safe
    in a multi-threaded caller, unlike ``os.fork``); that intermediate forks the real shepherd,
    waits until it has installed its signal handlers and written ``shepherd.pid``, prints its
    pid and exits, and is reaped here.  So when this returns the shepherd is in its own session,
    is not our child, and already accepts ``shepherd_control.request_stop`` /
    ``forward_signal``.
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
