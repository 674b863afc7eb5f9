"""srun's side of ``srun --pty``: the local terminal, and the relay to task 0's pseudo-terminal.

While the step runs, srun's terminal is in raw mode (keys go to the remote pty as typed: ``^C``
becomes SIGINT there, not here), and is put back as it was on every way out: a normal end, an
error, or a signal that ends srun (SIGHUP, SIGQUIT, SIGPIPE raise ``SystemExit`` here so the
restoring ``finally`` runs; SIGINT, SIGTERM and SIGUSR1/2 keep being forwarded to the step).
srun's own messages are written with ``\\r\\n`` line ends meanwhile, so they stay readable.

Task 0's shepherd opens a ``pty`` connection to srun with the step's cookie (StepIO checks it,
as for ``out`` and ``err``); this module answers it: first the window size, then every byte
typed (frames, see agent/ptys.py for the format), a new window size on each SIGWINCH, and
the remote output copied to srun's stdout as it comes. Only task 0 has a terminal: the other
tasks' output goes nowhere (Slurm's ``--pty`` does the same).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

HEADER = struct.Struct(">cI")  # agent/ptys.py's frame header: type, payload length
ENDING = (signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE)  # signals that end srun here


class CRLFWriter(io.RawIOBase):
    """srun's stderr while the terminal is raw: ``\\n`` written as ``\\r\\n``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raw = bytes(data)
        out = memoryview(raw.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
        while out:
            out = out[os.write(self.fd, out) :]
        return len(raw)


class Terminal:
    """The local end of a ``--pty`` step: use as a context manager around the step."""

    def __init__(self, stdin: int = 0, stdout: int = 1) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self.saved: list[Any] | None = None  # termios attributes to restore
        self.conn: Any = None  # the pty connection being served
        self.tap: Callable[[bytes], None] | None = None  # the output to sattach too (StepIO)
        self.send_lock = threading.Lock()
        self._old_handlers: dict[int, Any] = {}
        self._old_stderr: Any = None

    # ------------------------------------------------------------------ local terminal
    def size(self) -> tuple[int, int]:
        """(rows, cols) of srun's terminal; $LINES/$COLUMNS or 24x80 without one."""
        for fd in (self.stdin, self.stdout, 2):
            try:
                cols, rows = os.get_terminal_size(fd)
                return rows, cols
            except OSError:
                continue
        env = os.environ
        rows = int(env["LINES"]) if env.get("LINES", "").isdecimal() else 24
        cols = int(env["COLUMNS"]) if env.get("COLUMNS", "").isdecimal() else 80
        return rows, cols

    def __enter__(self) -> Terminal:
        self._old_handlers[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, self._on_winch)
        for signum in ENDING:
            self._old_handlers[signum] = signal.signal(signum, _end)
        if os.isatty(self.stdin):
            import termios
            import tty

            self.saved = termios.tcgetattr(self.stdin)
            tty.setraw(self.stdin, termios.TCSANOW)
            self._old_stderr = sys.stderr
            sys.stderr = io.TextIOWrapper(
                io.BufferedWriter(CRLFWriter(2)), line_buffering=True, errors="replace"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the terminal and the handlers back (idempotent)."""
        if self.saved is not None:
            import termios

            with contextlib.suppress(OSError, termios.error):
                termios.tcsetattr(self.stdin, termios.TCSADRAIN, self.saved)
            self.saved = None
        if self._old_stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            sys.stderr, self._old_stderr = self._old_stderr, None
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers = {}

    # ------------------------------------------------------------------ the relay
    def serve(self, conn: Any) -> None:
        """Task 0's pty connection (a StepIO thread): window size, keys in, output out."""
        if self.conn is not None:
            return  # one terminal per step
        self.conn = conn
        try:
            self._send(b"w", "{} {}".format(*self.size()).encode())
        except OSError:
            return
        threading.Thread(target=self._pump_stdin, name="srun-pty-stdin", daemon=True).start()
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                return
            if self.tap is not None:
                self.tap(chunk)
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(self.stdout, view) :]
            except OSError:
                return  # our stdout is gone; the task keeps its terminal until it ends

    def send_keys(self, data: bytes) -> None:
        """Keys typed elsewhere (`sattach`) for the remote terminal, once it is connected."""
        if self.conn is not None:
            self._send(b"d", data)

    def _send(self, kind: bytes, payload: bytes) -> None:
        with self.send_lock:
            self.conn.sendall(HEADER.pack(kind, len(payload)) + payload)

    def _pump_stdin(self) -> None:
        """Keys to the remote terminal. A terminal never ends here (its hang-up is SIGHUP):
        a read that returns nothing or fails is tried again; stdin that is no terminal sends
        the remote terminal its EOF key (``^D``) at its end."""
        tty = os.isatty(self.stdin)
        while True:
            try:
                data = os.read(self.stdin, 65536)
            except BlockingIOError:
                data = None
            except OSError:
                if not tty:
                    return
                data = None
            if not data and tty:
                time.sleep(0.05)
                continue
            try:
                if not data:
                    self._send(b"d", b"\x04")
                    return
                self._send(b"d", data)
            except OSError:
                return

    def _on_winch(self, _signum: int, _frame: FrameType | None) -> None:
        if self.conn is None:
            return
        with contextlib.suppress(OSError):
            self._send(b"w", "{} {}".format(*self.size()).encode())


def _end(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def maybe(enabled: bool) -> Iterator[Terminal | None]:
    """A Terminal around the step when ``--pty`` was given, else nothing."""
    if not enabled:
        yield None
        return
    with Terminal() as term:
        yield term
