"""srun's resident helper: one per job per node, so that each ``srun`` in a job is a thin client.

Started by the job's first full srun on this node (``python -m phalanx.slurm.srun.helper PATH``) in
the job's process group, so it ends with the job (the shepherd stops whatever the batch step
leaves behind); it also exits after ``IDLE_S`` without a request, or once another helper has
taken its socket's name.  It runs steps exactly as srun.py does (the same code: options,
request body, step I/O, supervision, exit status) on behalf of the thin srun (srun/thin.py),
with the caller's environment and directory, writing the tasks' output to the caller's own
stdout and stderr (passed over the socket, with its stdin, which goes to the step's tasks),
and forwarding the signals the caller relays.

The socket lives in the job's own ``$TMPDIR``, is created mode 0600, and a connection whose
peer (``SO_PEERCRED``) is another user than the job's or root is answered ``refused ...`` and
closed before anything is read from it; the thin srun checks the same of the helper before it
sends anything (srun/thin.py, srun/thin.c).  Anything the helper cannot do as the full srun would
is answered ``fallback`` before a step is created, and the caller runs the full srun itself.
"""

from __future__ import annotations

import contextlib
import hmac  # noqa: F401  (srun's StepIO needs it per connection: imported once, here)
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from phalanx.errors import PhalanxError
from phalanx.lean_client import LeanClient
from phalanx.slurm.common import SlurmUsageError
from phalanx.slurm.srun import command as srun
from phalanx.slurm.srun.thin import PROTOCOL, SAME_ENV, peer_uid

IDLE_S = 300.0  # exit after this long without a request (a new srun starts another)
CHECK_S = 1.0  # how often an idle helper checks that its socket is still its own
MAX_PAYLOAD = 64 << 20  # a request's arguments and environment
READ_TIMEOUT_S = 30.0


class FdSink:
    """A caller's stdout or stderr, as StepIO writes to it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def flush(self) -> None:
        pass


class Helper:
    def __init__(self, path: str) -> None:
        self.path = path
        self.env = dict(os.environ)
        self.job = self.env.get("SLURM_JOB_ID") or self.env.get("PHX_JOB_ID") or ""
        self.lock = threading.Lock()
        self.active = 0
        self.last = time.monotonic()
        self._clients: list[LeanClient] = []
        self._host: str | None = None

    # ------------------------------------------------------------------ serving
    def serve(self) -> None:
        os.umask(0o077)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(tmp)
        server.listen(64)
        os.rename(tmp, self.path)  # atomic: replaces a dead helper's socket
        ino = os.stat(self.path).st_ino
        server.settimeout(CHECK_S)
        try:
            while True:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    with self.lock:
                        idle = self.active == 0
                        quiet = time.monotonic() - self.last
                    if idle and (quiet > IDLE_S or not self._ours(ino)):
                        return
                    continue
                threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
        finally:
            if self._ours(ino):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            server.close()

    def _ours(self, ino: int) -> bool:
        try:
            return os.stat(self.path).st_ino == ino
        except OSError:
            return False

    def handle(self, conn: socket.socket) -> None:
        with self.lock:
            self.active += 1
        fds: list[int] = []
        try:
            with conn:
                fds = self._serve(conn)
        except OSError:
            pass
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with self.lock:
                self.active -= 1
                self.last = time.monotonic()

    def _serve(self, conn: socket.socket) -> list[int]:
        conn.settimeout(READ_TIMEOUT_S)
        uid = peer_uid(conn)
        if uid not in (os.getuid(), 0):
            # another user's process: nothing of the job's is read from it or run for it
            conn.sendall(
                b"refused this srun helper serves uid %d (and root) only, not uid %d\n"
                % (os.getuid(), uid)
            )
            return []
        msg, fds, _flags, _addr = socket.recv_fds(conn, 4096, 4)
        head, _, data = msg.partition(b"\n")
        parts = head.split()
        if len(parts) != 2 or parts[0] != PROTOCOL or not parts[1].isdigit():
            return fds
        size = int(parts[1])
        if size > MAX_PAYLOAD:
            return fds
        while len(data) < size:
            chunk = conn.recv(min(1 << 20, size - len(data)))
            if not chunk:
                return fds
            data += chunk
        request = self._parse(data, fds)
        if request is None:
            conn.sendall(b"fallback\n")
            return fds
        argv, cwd, env = request
        try:
            opts = srun.prepare(argv, env)
        except (SlurmUsageError, SystemExit):
            conn.sendall(b"fallback\n")  # the full srun says what is wrong, as it always has
            return fds
        stdin = fds[0] if len(fds) == 3 else None  # a thin srun that passes none: /dev/null
        if opts.pty or opts.jobid or (stdin is not None and os.isatty(stdin)):
            # a terminal is srun's own: the helper is in none's foreground (for a stdin
            # that is one, only srun can tell whether it may read it)
            conn.sendall(b"fallback\n")
            return fds
        conn.sendall(b"ok\n")
        conn.settimeout(None)
        relay = SignalRelay(conn)
        forward = stdin if stdin is not None and srun.live_stdin(stdin) else None
        out, err = FdSink(fds[-2]), FdSink(fds[-1])
        caller = srun.Caller(env, cwd, out, err, relay.install, forward)
        code = self._run(opts, caller)
        for fd in fds:  # the caller's pipe readers see their end with srun's exit
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.sendall(b"exit %d\n" % code)
        return []

    def _parse(self, data: bytes, fds: list[int]) -> tuple[list[str], str, dict[str, str]] | None:
        fields = data.split(b"\0")
        if len(fds) not in (2, 3) or len(fields) < 3 or fields[0] != PROTOCOL:
            return None
        if not fields[2].isdigit():
            return None
        argc = int(fields[2])
        argv = [os.fsdecode(a) for a in fields[3 : 3 + argc]]
        env: dict[str, str] = {}
        for item in fields[3 + argc :]:
            key, eq, value = item.partition(b"=")
            if eq:
                env[os.fsdecode(key)] = os.fsdecode(value)
        if any(env.get(k) != self.env.get(k) for k in SAME_ENV):
            return None  # another job, controller or identity than ours
        if env.get(srun.ATTACH_ENV):
            return None
        return argv, os.fsdecode(fields[1]), env

    def _run(self, opts: object, caller: srun.Caller) -> int:
        client = self._client()
        try:
            if self._host is None:
                self._host = srun.advertised_host(client.urls, caller.env)
            return srun._step(client, self.job, opts, caller, host=self._host)
        except PhalanxError as e:
            caller.say(f"{srun.PROG}: error: {e.message}\n")
            return 1
        except SlurmUsageError as e:
            caller.say(f"{srun.PROG}: error: {e}\n")
            return 1
        finally:
            with self.lock:
                self._clients.append(client)

    def _client(self) -> LeanClient:
        """One client per step at a time (an HTTP connection is not shared between threads);
        kept for the next step, so a loop of srun reuses one connection."""
        with self.lock:
            if self._clients:
                return self._clients.pop()
        return LeanClient()


class SignalRelay:
    """The signals a thin srun relays (``sig N`` lines), delivered to the step's forwarder;
    those that arrive before the step has one are kept for it."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.forward: Callable[[int], None] | None = None
        self.pending: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def install(self, forward: Callable[[int], None]) -> Callable[[], None]:
        with self.lock:
            self.forward = forward
            pending, self.pending = self.pending, []
        for signum in pending:
            forward(signum)

        def undo() -> None:
            with self.lock:
                self.forward = None

        return undo

    def _read(self) -> None:
        data = b""
        while True:
            try:
                chunk = self.conn.recv(4096)
            except OSError:
                return
            if not chunk:
                return  # the caller is gone (or done): the step runs to its end
            data += chunk
            while b"\n" in data:
                line, data = data.split(b"\n", 1)
                if not line.startswith(b"sig ") or not line[4:].isdigit():
                    continue
                signum = int(line[4:])
                with self.lock:
                    forward = self.forward
                    if forward is None:
                        self.pending.append(signum)
                if forward is not None:
                    forward(signum)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m phalanx.slurm.srun.helper SOCKET_PATH\n")
        return 2
    # the job's signals are its tasks' business (srun forwards them); SIGTERM, the job's end
    # for everything it leaves behind, ends the helper too
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    try:
        Helper(argv[0]).serve()
    except OSError as e:
        sys.stderr.write(f"srund: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
