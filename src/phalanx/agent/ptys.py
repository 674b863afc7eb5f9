"""The task side of ``srun --pty``: task 0 of a step on a pseudo-terminal, relayed to srun.

The shepherd of task 0 opens the step's ``pty`` connection to srun (the same authenticated
connection as a task's ``out`` stream: first line ``COOKIE TASK pty``), opens a pty, and forks
a small relay process that copies bytes between the pty's master and that connection. The task
gets the pty's other end as its stdin, stdout and stderr and, being a session leader, as its
controlling terminal (``make_controlling``), so ``tty``, job control, ``^C`` and full-screen
programs behave as on a local terminal.

On the connection:

* srun -> task: frames, a type byte, a 4-byte big-endian length, the payload. ``d``: bytes typed
  at srun's terminal, written to the master (the line discipline turns ``^C`` into SIGINT for the
  task's foreground process group); ``w``: the window size, ``ROWS COLS`` in ASCII, set on the
  pty with TIOCSWINSZ (the kernel sends the foreground process group SIGWINCH). srun sends its
  window size first: the shepherd reads that frame before the task starts, so the task starts
  with srun's size.
* task -> srun: the raw bytes the pty writes (the task's output, echo included).

The relay ends when the master reports the end (every process holding the pty has ended: the
task is over), after sending what is left and closing its side; or when srun goes away, by
closing the master, which hangs the terminal up (SIGHUP to the task, as a closed ssh session).
Stdlib only and imported only for pty tasks (the shepherd's start-up stays lean).
"""

from __future__ import annotations

import os
import select
import struct
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

HEADER = struct.Struct(">cI")
MAX_FRAME = 1 << 20
MAX_BUFFER = 1 << 20  # stop reading a side while this much waits to be written to the other
FIRST_FRAME_TIMEOUT_S = 30.0


def winsize(payload: bytes) -> tuple[int, int] | None:
    """``ROWS COLS`` -> (rows, cols), or None when malformed."""
    parts = payload.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    rows, cols = int(parts[0]), int(parts[1])
    return (rows, cols) if 0 <= rows < 65536 and 0 <= cols < 65536 else None


def set_winsize(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def make_controlling(fd: int) -> None:
    """In the task's child after ``setsid``: the pty becomes its controlling terminal."""
    import fcntl
    import termios

    fcntl.ioctl(fd, termios.TIOCSCTTY, 0)


def _recv_exact(sock: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("srun closed the terminal connection")
        data += chunk
    return data


def task_terminal(io: dict[str, Any], connect: Callable[[dict[str, Any], str], int]) -> int:
    """Connect to srun, open the pty with srun's window size, start the relay; return the
    pty's task end (the caller makes it the task's stdin, stdout and stderr and closes it
    once the task has it). Raises OSError when srun cannot be reached or says nothing."""
    import _socket

    sock_fd = connect(io, "pty")
    sock = _socket.socket(fileno=sock_fd)
    try:
        sock.settimeout(FIRST_FRAME_TIMEOUT_S)
        kind, size = HEADER.unpack(_recv_exact(sock, HEADER.size))
        if kind != b"w" or size > 64:
            raise OSError("srun did not send the window size first")
        dims = winsize(_recv_exact(sock, size)) or (24, 80)
        sock.settimeout(None)
        master, slave = os.openpty()
        set_winsize(master, *dims)
        pid = os.fork()
    except BaseException:
        sock.close()
        raise
    if pid == 0:  # the relay: never returns
        code = 1
        try:
            os.close(slave)
            _reset_signals()
            code = relay(master, sock)
        finally:
            os._exit(code)
    os.close(master)
    sock.close()
    return slave


def _reset_signals() -> None:
    """The relay is forked from the shepherd: its handlers and wakeup fd are not ours."""
    import _signal

    _signal.set_wakeup_fd(-1)
    for signum in (_signal.SIGHUP, _signal.SIGINT, _signal.SIGUSR1, _signal.SIGUSR2):
        _signal.signal(signum, _signal.SIG_IGN)  # the task's business, not the relay's
    for signum in (_signal.SIGTERM, _signal.SIGCHLD):
        _signal.signal(signum, _signal.SIG_DFL)


def relay(master: int, sock: Any) -> int:
    """Copy between the pty master and srun's connection until one side ends."""
    os.set_blocking(master, False)
    sock.setblocking(False)
    to_sock = bytearray()
    to_master = bytearray()
    inbox = bytearray()  # srun's frames, not yet complete
    task_done = srun_gone = False
    poller = select.poll()
    while True:
        if task_done and not to_sock:
            break
        if srun_gone:
            break
        mflags = (select.POLLIN if len(to_sock) < MAX_BUFFER and not task_done else 0) | (
            select.POLLOUT if to_master else 0
        )
        sflags = (select.POLLIN if len(to_master) < MAX_BUFFER else 0) | (
            select.POLLOUT if to_sock else 0
        )
        poller = select.poll()
        if mflags and not task_done:
            poller.register(master, mflags)
        if sflags:
            poller.register(sock.fileno(), sflags)
        for fd, ev in poller.poll():
            if fd == master:
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    try:
                        data = os.read(master, 65536)
                    except BlockingIOError:
                        data = None
                    except OSError:  # EIO: no process holds the pty any more
                        data = b""
                    if data == b"":
                        task_done = True
                    elif data:
                        to_sock += data
                if ev & select.POLLOUT and to_master and not task_done:
                    try:
                        del to_master[: os.write(master, to_master)]
                    except BlockingIOError:
                        pass
                    except OSError:
                        task_done = True
            else:
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    try:
                        data = sock.recv(65536)
                    except BlockingIOError:
                        data = None
                    except OSError:
                        data = b""
                    if data == b"":
                        srun_gone = True
                    elif data:
                        inbox += data
                        _frames(inbox, to_master, master)
                if ev & select.POLLOUT and to_sock:
                    try:
                        del to_sock[: sock.send(to_sock)]
                    except BlockingIOError:
                        pass
                    except OSError:
                        srun_gone = True
    if task_done:
        try:
            import _socket

            sock.setblocking(True)
            sock.shutdown(_socket.SHUT_WR)  # srun sees the end of the output
        except OSError:
            pass
    os.close(master)  # srun gone: the task's terminal hangs up
    sock.close()
    return 0


def _frames(inbox: bytearray, to_master: bytearray, master: int) -> None:
    """Take the complete frames out of ``inbox``: typed bytes and window sizes."""
    while len(inbox) >= HEADER.size:
        kind, size = HEADER.unpack_from(inbox)
        if size > MAX_FRAME:
            inbox.clear()
            return
        if len(inbox) < HEADER.size + size:
            return
        payload = bytes(inbox[HEADER.size : HEADER.size + size])
        del inbox[: HEADER.size + size]
        if kind == b"d":
            to_master += payload
        elif kind == b"w":
            dims = winsize(payload)
            if dims is not None:
                try:
                    set_winsize(master, *dims)
                except OSError as exc:
                    sys.stderr.write(f"pty relay: cannot set the window size: {exc}\n")
