"""A step's I/O hub in srun: the tasks' streams fanned out to `sattach` clients, and their stdin.

A step's I/O flows through its srun (command.StepIO): each task's shepherd connects its
stdout and stderr there, and with srun's stdin forwarded, the task reads its stdin from its
stdout connection (agent/shepherd_start.py).  Slurm's slurmstepd is that hub on each node, and
`sattach` is a second client of it; here srun is, so a second client attaches to srun:

* `sattach` asks the controller (``POST /v1/jobs/ID/steps/N/attach``: the step's owner or an
  admin) for srun's address and a token derived from the step's cookie (auth/attachcred.py),
  connects, and sends ``TOKEN - attach`` as its header line (a task sends ``COOKIE TASK
  out``).
* srun answers with frames (``FRAME``: a kind byte, the task, the payload's length): first
  ``h``, a JSON hello (the step's task ids, the exit records already in, whether the tasks
  read stdin, whether task 0 has a terminal); then the output it keeps (``REPLAY_BYTES``, as
  slurmstepd replays the messages it keeps to a client that attaches); then, as they come,
  ``o`` and ``e`` (a task's stdout, stderr), ``x`` (a task's exit record, JSON), and ``z``
  when srun is done with the step.
* The client sends ``i`` frames: stdin for one task or for all (``ALL``); an empty one is the
  end of its input, which closes the tasks' stdin, as a client's end of input does under
  Slurm.  A client that goes away without it changes nothing for the step.

Nothing a client does can hold the step up: srun never waits on a client's socket.  Each
client has a queue and a thread of its own that sends from it; one that falls ``QUEUE_LIMIT``
bytes behind (stopped, or on a slow link) is dropped, and the step runs on.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading

FRAME = struct.Struct(">cII")  # kind, task (ALL: every task), payload length
ALL = 0xFFFFFFFF
MAX_FRAME = 1 << 20  # a client's frame is stdin: srun reads at most this much a frame
REPLAY_BYTES = 128 * 1024  # slurmstepd keeps its last 128 messages of up to 1 KiB each
QUEUE_LIMIT = 8 << 20  # a client this far behind is dropped


def frame(kind: bytes, task: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(kind, task, len(payload)) + payload


def read_exactly(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes from `sock`, or None at its end (or an error) before them."""
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def read_frame(sock: socket.socket, limit: int = MAX_FRAME) -> tuple[bytes, int, bytes] | None:
    """The next frame, or None at the end of the connection (or a frame past `limit`)."""
    head = read_exactly(sock, FRAME.size)
    if head is None:
        return None
    kind, task, size = FRAME.unpack(head)
    if size > limit:
        return None
    payload = read_exactly(sock, size) if size else b""
    if payload is None:
        return None
    return kind, task, payload


class Client:
    """One attached client: what is queued for it, sent by a thread of its own."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.queue: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.closing = False  # no more frames: send what is queued, then hang up
        self.dropped = False
        threading.Thread(target=self._send, name="srun-attach-send", daemon=True).start()

    def offer(self, data: bytes) -> None:
        """Queue `data`, never waiting; a client too far behind is dropped."""
        with self.cond:
            if self.closing or self.dropped:
                return
            if self.queued + len(data) > QUEUE_LIMIT:
                self.dropped = True
                self.queue.clear()
                self.cond.notify_all()
            else:
                self.queue.append(data)
                self.queued += len(data)
                self.cond.notify_all()
                return
        self._hang_up()  # wakes the sender if it is stuck in a send

    def finish(self) -> None:
        """Send what is queued, then hang up."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def _send(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.closing or self.dropped)
                if self.dropped or not self.queue:
                    break  # dropped, or closing with nothing left to send
                data = self.queue.popleft()
                self.queued -= len(data)
            try:
                self.conn.sendall(data)
            except OSError:
                with self.cond:
                    self.dropped = True
                    self.queue.clear()
                break
        self._hang_up()

    def _hang_up(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)


class Hub:
    """The output fan-out: every frame to every attached client, the last ones kept for a
    client that attaches later (slurmstepd's replay)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clients: list[Client] = []
        self.kept: collections.deque[tuple[bytes, int, bytes]] = collections.deque()
        self.kept_bytes = 0

    def publish(self, kind: bytes, task: int, data: bytes, *, keep: bool = True) -> None:
        """A task's output (`keep`: also for clients that attach later) or exit record."""
        with self.lock:
            if keep:
                self.kept.append((kind, task, data))
                self.kept_bytes += len(data)
                while self.kept_bytes > REPLAY_BYTES and len(self.kept) > 1:
                    self.kept_bytes -= len(self.kept.popleft()[2])
            if self.clients:
                out = frame(kind, task, data)
                for client in self.clients:
                    client.offer(out)

    def attach(self, client: Client, hello: bytes) -> None:
        """Send `client` the hello and the output kept, then every frame from now on."""
        with self.lock:
            client.offer(frame(b"h", ALL, hello))
            for kind, task, data in self.kept:
                client.offer(frame(kind, task, data))
            self.clients.append(client)

    def detach(self, client: Client) -> None:
        with self.lock, contextlib.suppress(ValueError):
            self.clients.remove(client)

    def finish(self) -> None:
        """The step is over for srun: each client gets ``z`` after what it has queued."""
        with self.lock:
            clients, self.clients = self.clients, []
        for client in clients:
            client.offer(frame(b"z", ALL))
            client.finish()


class Inputs:
    """The tasks' stdin: each task's stdout connection, which its shepherd made its stdin
    too.  Written by srun's own stdin and by attached clients; an end of input from either
    shuts the connections' sending side (the tasks read their end of file)."""

    def __init__(self) -> None:
        self.conns: dict[int, socket.socket] = {}
        self.locks: dict[int, threading.Lock] = {}
        self.shut: set[int] = set()
        self.ended = False  # every task's input has ended (srun's own stdin did)
        self.lock = threading.Lock()

    def add(self, task: int, conn: socket.socket) -> None:
        with self.lock:
            self.conns[task] = conn
            self.locks[task] = threading.Lock()
            shut = self.ended or task in self.shut
            if shut:
                self.shut.add(task)
        if shut:  # its input had ended before it connected
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)

    def tasks(self) -> set[int]:
        with self.lock:
            return set(self.conns)

    def _targets(self, tasks: list[int] | None) -> list[tuple[int, socket.socket, threading.Lock]]:
        with self.lock:
            wanted = sorted(self.conns) if tasks is None else [t for t in tasks if t in self.conns]
            return [(t, self.conns[t], self.locks[t]) for t in wanted if t not in self.shut]

    def send(self, tasks: list[int] | None, data: bytes) -> None:
        """`data` to the stdin of `tasks` (None: all). A task that does not read blocks the
        sender, as a pipe to it would: srun reads no more of its stdin meanwhile."""
        for task, conn, lock in self._targets(tasks):
            with lock:
                try:
                    conn.sendall(data)
                except OSError:  # the task is gone, or its input was closed meanwhile
                    with self.lock:
                        self.shut.add(task)

    def end(self, tasks: list[int] | None) -> None:
        """The end of input for `tasks` (None: all, including those yet to connect)."""
        with self.lock:
            self.ended = self.ended or tasks is None
            wanted = sorted(self.conns) if tasks is None else list(tasks)
            conns = [self.conns[t] for t in wanted if t in self.conns and t not in self.shut]
            self.shut.update(wanted)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
