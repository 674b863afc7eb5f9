"""The command server: Slurm's commands without an interpreter's start-up per call.

Shell loops and workflow engines call ``sbatch``, ``squeue``, ``sacct`` one process at a
time, and a Python command spends 50-70 ms starting (the interpreter, its imports) for a
millisecond or two of work; Slurm's C commands answer in a few.  This server is a Python
process that has imported the commands once.  The compiled commands (slurm/commands.c,
installed by ``phalanx slurm-commands --install``) connect to its socket and pass their
arguments, directory, umask, environment and stdin, stdout and stderr; the server forks a
worker per call that becomes the caller (its uid and gid from the kernel, SO_PEERCRED, never
from the request), takes all of that, and runs the same Python code ``python -m phalanx.slurm
COMMAND`` would.  Output goes straight to the caller's descriptors; the exit status goes back
over the socket.  So what a command prints and returns does not depend on the path it took,
and one source of truth (the Python commands) parses every option and formats every field.

Run as root it serves every local user, each worker dropping to the caller's uid, primary
gid and groups (initgroups) before it reads anything of the request but strings; run as
another user it serves that user only.  It holds no secrets (it imports modules, nothing
more), so a worker that becomes a user inherits nothing that user could not read.  Each worker
closes every descriptor but its own connection and the caller's three.

What differs from a process the caller starts, by design: the worker is the server's child
(its cgroup, its resource limits, its session: the caller's terminal is its stdin but not its
controlling terminal), and the interpreter's own start-up variables (``PYTHONPATH``,
``PYTHONWARNINGS``, ...) do not apply.  The compiled command sends a worker SIGINT, SIGTERM,
SIGHUP and SIGQUIT it receives, and ends the way the worker ended (an exit status, or the
same signal).  A request the server does not serve (another installation's interpreter,
another user's on a non-root server, too many running) is answered "fallback", and the
compiled command runs the Python command itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import pwd
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from phalanx.auth.localsock import peer_credentials

log = logging.getLogger("phalanx.slurm.cmdserver")

DEFAULT_SOCKET = Path("/run/phalanx/commands.sock")
SERVED = (
    *("sbatch", "squeue", "scancel", "sinfo", "scontrol", "sacct", "sshare", "sprio", "sdiag"),
    "sstat",
    "sreport",
    "sacctmgr",
)
# modules a call imports after its command module (found with `python -X importtime`):
# imported once here, so no worker pays for them
PRELOAD = (
    "phalanx.lean_client",
    "phalanx.auth.localsock",
    "encodings.idna",
    "json",
    "orjson",  # lean_client parses a large reply (squeue, sacct of thousands) with it
    "shutil",
    "selectors",
    "logging",
    "threading",
    "random",
    "datetime",
    "textwrap",
    "traceback",
)
MAX_WORKERS = 64  # calls running at once; beyond, a caller runs the Python command itself
REUSE_CALLS = 200  # calls one worker serves (all of one caller) before it exits
MAX_IDLE = 8  # workers waiting for their caller's next call
IDLE_TIMEOUT_S = 30.0  # how long one waits
POLL_S = 0.02  # how often workers are checked where the kernel has no pidfd_open
REQUEST_TIMEOUT_S = 10.0  # a caller that connected but sends no whole request by then: dropped
MAX_REQUEST = 4 << 20  # bytes: arguments and environment (Linux's ARG_MAX is 2 MiB)
PROTOCOL = "cmd1"


class BadRequest(ValueError):
    """A request that is not the protocol: the worker drops it."""


@dataclasses.dataclass(frozen=True)
class Request:
    python: str  # the interpreter of the installation that built the compiled command
    command: str
    cwd: str
    umask: int
    args: list[str]
    env: dict[str, str]


def parse_request(payload: bytes) -> Request:
    """``cmd1\\0PYTHON\\0COMMAND\\0CWD\\0UMASK\\0ARGC\\0ARG...\\0KEY=VALUE...`` (slurm/commands.c)."""
    fields = payload.split(b"\0")
    if len(fields) < 6 or fields[0] != PROTOCOL.encode():
        raise BadRequest("not a command request")
    try:
        text = [os.fsdecode(f) for f in fields]
        umask = int(text[4], 8)
        argc = int(text[5])
    except ValueError as e:
        raise BadRequest(f"bad umask or argument count: {e}") from None
    if not 0 <= argc <= len(text) - 6 or not 0 <= umask <= 0o777:
        raise BadRequest("bad umask or argument count")
    env: dict[str, str] = {}
    for item in text[6 + argc :]:
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    return Request(
        python=text[1],
        command=text[2],
        cwd=text[3],
        umask=umask,
        args=text[6 : 6 + argc],
        env=env,
    )


def refusal(request: Request, peer_uid: int, server_uid: int, python: str) -> str | None:
    """Why this server does not run `request` for the peer (the caller runs the Python
    command itself), or None: it does."""
    if request.command not in SERVED:
        return f"{request.command!r} is not a command served here"
    if os.path.realpath(request.python) != os.path.realpath(python):
        return f"another installation's command ({request.python}; this server: {python})"
    if server_uid != 0 and peer_uid != server_uid:
        return f"uid {peer_uid}: this server runs as uid {server_uid} and serves only it"
    return None


def exit_line(status: int) -> bytes:
    """How a worker ended, for the compiled command: ``exit N`` or ``signal N``."""
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}\n".encode()
    return f"exit {os.waitstatus_to_exitcode(status) & 0xFF}\n".encode()


@dataclasses.dataclass
class _Worker:
    """A forked worker as the server sees it: the caller it serves, the call it runs now."""

    pid: int
    ctrl: socket.socket  # the server's end of the worker's control pair
    key: tuple[int, int]  # the (uid, gid) it runs as, and so serves
    conn: socket.socket | None  # the call in progress (the server's copy); None: idle
    idle_since: float = 0.0
    pidfd: int | None = None  # None: watched by polling (no pidfd_open)


class CommandServer:
    """Accepts calls on `path` and gives each to a worker (the module's docstring).

    A worker serves one caller (uid and gid) and, after its call, waits for the next call of
    the same caller (`reuse` calls at most, `idle_timeout` seconds at most): forking a
    worker, and the copy-on-write faults of its first call, cost more CPU than a call's own
    work (bench/cli.py, docs/slurm.md). At most `max_idle` wait; `max_workers` run at once.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_workers: int = MAX_WORKERS,
        request_timeout: float = REQUEST_TIMEOUT_S,
        reuse: int = REUSE_CALLS,
        max_idle: int = MAX_IDLE,
        idle_timeout: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.path = path
        self.max_workers = max_workers
        self.request_timeout = request_timeout
        self.reuse = reuse
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self._listener: socket.socket | None = None
        self._workers: dict[int, _Worker] = {}  # pid -> worker
        self._idle: dict[tuple[int, int], list[_Worker]] = {}
        self._sel: selectors.BaseSelector | None = None
        self._stop = False

    def bind(self) -> None:
        from phalanx.auth.localsock import listen_at

        # anyone may call: a worker only ever acts as the caller's own uid
        self._listener = listen_at(self.path, 0o666 if os.geteuid() == 0 else 0o600)

    def stop(self) -> None:
        self._stop = True

    def serve(self) -> None:
        """Until stop(): accept calls, hand them to workers, report how each call ended."""
        assert self._listener is not None, "bind() first"
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        try:
            while not self._stop:
                polled = any(w.pidfd is None for w in self._workers.values())
                for key, _ in sel.select(timeout=POLL_S if polled else 0.5):
                    if key.data is None:
                        self._accept()
                    elif key.data[0] == "ctrl":
                        self._from_worker(key.data[1])
                    else:
                        self._ended(key.data[1])
                for w in [w for w in self._workers.values() if w.pidfd is None]:
                    done, status = os.waitpid(w.pid, os.WNOHANG)
                    if done:
                        self._ended(w.pid, status)
                self._retire_idle(time.monotonic() - self.idle_timeout)
        finally:
            self._retire_idle(float("inf"))
            sel.close()
            self._listener.close()
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _accept(self) -> None:
        assert self._listener is not None and self._sel is not None
        try:
            conn, _ = self._listener.accept()
            _, uid, gid = peer_credentials(conn)
        except OSError:
            return
        key = (uid, gid)
        waiting = self._idle.get(key) or []
        while waiting:  # the caller's own idle worker, if it has one
            w = waiting.pop()
            try:
                socket.send_fds(w.ctrl, [b"c"], [conn.fileno()])
            except OSError:
                continue  # it died while idle: its end is reported on its own
            w.conn = conn
            return
        if sum(1 for w in self._workers.values() if w.conn is not None) >= self.max_workers:
            with contextlib.suppress(OSError):
                conn.sendall(b"fallback\n")
            conn.close()
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            ours.close()
            _worker(conn, theirs, self.request_timeout, self.reuse)
        theirs.close()
        w = _Worker(pid, ours, key, conn)
        self._workers[pid] = w
        self._sel.register(ours, selectors.EVENT_READ, ("ctrl", pid))
        try:
            w.pidfd = os.pidfd_open(pid)
        except OSError:  # an older kernel: watched by polling
            return
        self._sel.register(w.pidfd, selectors.EVENT_READ, ("pidfd", pid))

    def _from_worker(self, pid: int) -> None:
        """A worker's control line: ``idle N`` (its call ended with N), or its end (EOF)."""
        assert self._sel is not None
        w = self._workers.get(pid)
        if w is None:  # its end was handled first, in the same round of events
            return
        try:
            line = w.ctrl.recv(64)
        except OSError:
            line = b""
        if not line.startswith(b"idle"):
            self._sel.unregister(w.ctrl)  # exiting: its process end comes next
            return
        log.debug("call in worker %d ended: exit %s", pid, line[5:].decode().strip())
        if w.conn is not None:
            w.conn.close()
            w.conn = None
        if sum(len(ws) for ws in self._idle.values()) >= self.max_idle:
            self._retire(w)
            return
        w.idle_since = time.monotonic()
        self._idle.setdefault(w.key, []).append(w)

    def _retire(self, w: _Worker) -> None:
        """Tell an idle worker to exit (its control pair closes; it was given no call)."""
        assert self._sel is not None
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(w.ctrl)
        w.ctrl.close()

    def _retire_idle(self, before: float) -> None:
        for key, ws in list(self._idle.items()):
            for w in [w for w in ws if w.idle_since < before]:
                ws.remove(w)
                self._retire(w)
            if not ws:
                del self._idle[key]

    def _ended(self, pid: int, status: int | None = None) -> None:
        """A worker's process ended: reap it and, if it was running a call, tell the caller
        how (a worker killed by a signal said nothing itself)."""
        assert self._sel is not None
        w = self._workers.pop(pid, None)
        if w is None:
            return
        if w.pidfd is not None:
            self._sel.unregister(w.pidfd)
            os.close(w.pidfd)
        if status is None:
            _, status = os.waitpid(pid, 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(w.ctrl)
        w.ctrl.close()
        with contextlib.suppress(ValueError):
            self._idle.get(w.key, []).remove(w)
        if w.conn is not None:
            self._report(pid, status, w.conn)

    def _report(self, pid: int, status: int, conn: socket.socket) -> None:
        line = exit_line(status)
        log.debug("call in worker %d ended: %s", pid, line.decode().strip())
        # the worker said "exit N" itself unless it was killed; a second line is ignored
        with contextlib.suppress(OSError):
            conn.sendall(line)
        conn.close()


def _worker(conn: socket.socket, ctrl: socket.socket, request_timeout: float, reuse: int) -> None:
    """In the forked child: run the call on `conn`, then the same caller's next ones as the
    server hands them over on `ctrl` (at most `reuse` in all); always ends in os._exit."""
    code = 1
    try:
        keep = sorted((conn.fileno(), ctrl.fileno()))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 16)
        served = 0
        while True:
            code = _take_call(conn, request_timeout)
            conn.close()
            _release_caller_streams()
            served += 1
            if served >= reuse:
                break
            ctrl.sendall(f"idle {code}\n".encode())
            _, fds, _, _ = socket.recv_fds(ctrl, 16, 1)
            if not fds:  # the server retired this worker
                code = 0
                break
            conn = socket.socket(fileno=fds[0])
    except BaseException:  # a worker must end in os._exit, whatever happened
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    os._exit(code)


def _release_caller_streams() -> None:
    """Let go of the caller's stdin, stdout and stderr: a worker waiting for its next call
    must not hold them open (`out=$(squeue)` waits for the end of its pipe)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _receive(conn: socket.socket, timeout: float) -> tuple[bytes, list[int]]:
    conn.settimeout(timeout)
    data, fds, _, _ = socket.recv_fds(conn, 4096, 3)
    try:
        head, nl, rest = data.partition(b"\n")
        word, _, length = head.partition(b" ")
        if not nl or word != PROTOCOL.encode() or not length.isdigit():
            raise BadRequest("no request header")
        size = int(length)
        if size > MAX_REQUEST or len(fds) != 3:
            raise BadRequest("request too large, or not three descriptors")
        chunks = [rest]
        have = len(rest)
        while have < size:
            part = conn.recv(min(size - have, 1 << 16))
            if not part:
                raise BadRequest("the caller went away mid-request")
            chunks.append(part)
            have += len(part)
        return b"".join(chunks)[:size], fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _become(uid: int, gid: int) -> None:
    """Drop root to the caller: groups, gid, then uid (after which there is no way back)."""
    if os.geteuid() != 0 or uid == 0:
        return
    try:
        name = pwd.getpwuid(uid).pw_name
        os.initgroups(name, gid)
    except KeyError:
        os.setgroups([])  # a uid with no name: its primary gid only
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise PermissionError("could not become the caller")


def _take_call(conn: socket.socket, request_timeout: float) -> int:
    """One call, from its request to its exit line: the call's exit status."""
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)  # as a fresh process has them (a call may change them)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        payload, fds = _receive(conn, request_timeout)
        request = parse_request(payload)
    except (BadRequest, OSError) as e:
        log.debug("dropped a call: %s", e)
        with contextlib.suppress(OSError):
            conn.sendall(b"exit 1\n")  # nothing ran
        return 1
    _, uid, gid = peer_credentials(conn)
    why = refusal(request, uid, os.geteuid(), sys.executable)
    if why is None and os.geteuid() != 0 and (uid, gid) != (os.getuid(), os.getgid()):
        why = f"a worker of uid {os.getuid()} cannot serve uid {uid}"  # (the server routes)
    if why is None:
        try:
            _become(uid, gid)
            os.chdir(request.cwd)
        except OSError as e:
            why = f"cannot act as uid {uid} in {request.cwd}: {e}"
    if why is not None:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(b"fallback\n")
        return 0
    os.umask(request.umask)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    conn.settimeout(None)
    conn.sendall(f"pid {os.getpid()}\n".encode())
    code = _run(request)
    with contextlib.suppress(OSError):
        conn.sendall(f"exit {code & 0xFF}\n".encode())
    return code


def _streams() -> None:
    """New sys.stdin/stdout/stderr on the caller's descriptors, as the interpreter would make
    them (stdout line-buffered on a terminal; stderr always)."""
    enc = sys.__stdout__.encoding if sys.__stdout__ else "utf-8"
    errors = sys.__stdout__.errors if sys.__stdout__ else "strict"
    sys.stdin = open(0, encoding=enc, errors=errors, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding=enc, errors=errors, closefd=False)  # noqa: SIM115
    sys.stderr = open(  # noqa: SIM115
        2, "w", buffering=1, encoding=enc, errors="backslashreplace", closefd=False
    )


def _run(request: Request) -> int:
    """Run the command as ``python -m phalanx.slurm`` would: its exit status, or (^C) dies of
    SIGINT after the traceback, as the interpreter does."""
    import atexit

    from phalanx.slurm.main import run

    os.environ.clear()
    os.environ.update(request.env)
    sys.argv = [request.command, *request.args]
    _streams()
    try:
        code = run(request.command, list(request.args))
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # the interpreter prints it and exits 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    atexit._clear()  # the worker's next call registers its own
    return 120 if not _flush() and code == 0 else code


def _flush() -> bool:
    """Flush stdout and stderr as the interpreter does at exit; False where stdout failed
    (a closed pipe: the interpreter says so and exits 120)."""
    ok = True
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        ok = False
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(
                "Exception ignored on flushing sys.stdout:\nBrokenPipeError: [Errno 32] Broken pipe\n"
            )
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    return ok


def preload() -> None:
    """Import the commands and what a call imports later, once, before any fork."""
    import importlib

    for command in SERVED:
        importlib.import_module(f"phalanx.slurm.{command}")
    for module in PRELOAD:
        importlib.import_module(module)
    # what is loaded now is never collected: out of the collector's sight, so a worker's
    # collections do not touch (and copy, page by page) the server's memory
    gc.collect()
    gc.freeze()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="phalanx command-server",
        description="Serve the compiled Slurm commands on this host (docs/slurm.md).",
    )
    ap.add_argument("--socket", type=Path, default=None, help=f"default: {DEFAULT_SOCKET}")
    ap.add_argument(
        "--max-workers",
        type=int,
        default=MAX_WORKERS,
        help=f"calls running at once; more run as Python commands (default {MAX_WORKERS})",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT_S,
        help="seconds a caller has to send its whole request once connected "
        f"(default {REQUEST_TIMEOUT_S:g})",
    )
    ap.add_argument(
        "--reuse",
        type=int,
        default=REUSE_CALLS,
        help="calls one worker serves, all of one caller, before it exits; 1: a new worker "
        f"for every call (default {REUSE_CALLS})",
    )
    ap.add_argument(
        "--max-idle",
        type=int,
        default=MAX_IDLE,
        help=f"workers kept waiting for their caller's next call (default {MAX_IDLE})",
    )
    ap.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="seconds a worker waits for its caller's next call before it exits "
        f"(default {IDLE_TIMEOUT_S:g})",
    )
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s cmdserver %(levelname)s %(message)s"
    )
    if args.max_workers < 1:
        ap.error(f"--max-workers {args.max_workers}: must be at least 1")
    if not 0 < args.request_timeout <= 3600:
        ap.error(f"--request-timeout {args.request_timeout:g}: must be above 0 s, at most 3600 s")
    if args.reuse < 1:
        ap.error(f"--reuse {args.reuse}: must be at least 1")
    if args.max_idle < 0:
        ap.error(f"--max-idle {args.max_idle}: must be 0 or more")
    if not 0 < args.idle_timeout <= 3600:
        ap.error(f"--idle-timeout {args.idle_timeout:g}: must be above 0 s, at most 3600 s")
    path = args.socket or Path(os.environ.get("PHALANX_COMMAND_SOCKET") or DEFAULT_SOCKET)
    preload()
    server = CommandServer(
        path,
        max_workers=args.max_workers,
        request_timeout=args.request_timeout,
        reuse=args.reuse,
        max_idle=args.max_idle,
        idle_timeout=args.idle_timeout,
    )
    try:
        server.bind()
    except OSError as e:
        print(f"phalanx command-server: cannot serve on {path}: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    log.info("serving the Slurm commands on %s", path)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
