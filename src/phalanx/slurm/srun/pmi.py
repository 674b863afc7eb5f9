"""`srun --mpi=pmi2`: the PMI server an MPI library's start-up talks to, hosted by srun.

An MPI program started by srun, not by `mpiexec`, finds its peers through the launcher's PMI
(process management interface) server: each rank learns its rank and the job's size, puts
its address ("business card") in a key-value space, waits at a barrier for everyone's, and
reads the others'. Slurm's `--mpi=pmi2` serves that from slurmstepd; here srun serves it for
its step, over TCP, because the step's tasks run on other hosts than srun's (docs/slurm.md,
"MPI programs under srun").

The wire is PMI-1's (MPICH's `src/pmi/maint/pmi-1.1.txt`): one line a message,
``cmd=NAME key=value ...``, which MPICH-family libraries built with their "simple" PMI client
(Debian's and most distributions' MPICH, MVAPICH, Intel MPI with I_MPI_PMI_LIBRARY unset) speak when
``PMI_PORT`` names the server. Slurm's pmi2 plugin serves the same wire to those clients.
The PMI-2 wire (length-prefixed ``cmd=fullinit;...``) is refused with a message that says
so; Open MPI's PMIx is not served (srun refuses ``--mpi=pmix`` by name).

Each task's environment (controller/launch.py) carries ``PMI_PORT`` (srun's host and this
server's port), ``PMI_SIZE``, ``PMI_RANK`` and ``PMI_ID``, the rank plus a random base that
only this step's tasks are told: a connection's first message must be ``cmd=initack
pmiid=ID`` with an ID of this step, else it is closed having learnt nothing. That keeps other
users on the network out of the step's key-value space, where Slurm relies on a local socket.

`PmiState` holds the protocol's decisions (pure: lines in, lines out); `PmiServer` is the I/O.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from phalanx.slurm.srun.listener import Listener

#: the limits announced by `get_maxes` (MPICH's own server, hydra, announces the same)
KVSNAME_MAX = 256
KEYLEN_MAX = 64
VALLEN_MAX = 1024
MAX_LINE = 64 * 1024  # a longer line is not PMI-1: the connection is closed
#: how long a rank's first message waits for srun to learn the step's layout (its tasks can
#: start, through a direct launch, before the controller's answer reaches srun's thread)
LAYOUT_WAIT_S = 30.0


def parse_line(line: str) -> dict[str, str]:
    """``cmd=put kvsname=k key=a value=b`` -> {"cmd": "put", "kvsname": "k", ...}. A value
    runs to the next space (PMI-1 values have none)."""
    out: dict[str, str] = {}
    for word in line.split():
        key, eq, value = word.partition("=")
        if eq:
            out[key] = value
    return out


def format_reply(cmd: str, **fields: object) -> str:
    return " ".join([f"cmd={cmd}", *(f"{k}={v}" for k, v in fields.items())]) + "\n"


def process_mapping(task_ids: Sequence[Sequence[int]]) -> str:
    """MPICH's ``PMI_process_mapping`` for a block layout: ``(vector,(first node, nodes,
    ranks per node),...)``, consecutive nodes with the same count in one triple.
    [[0, 1], [2, 3]] -> ``(vector,(0,2,2))``."""
    blocks: list[list[int]] = []
    for node, ids in enumerate(task_ids):
        if blocks and blocks[-1][2] == len(ids):
            blocks[-1][1] += 1
        else:
            blocks.append([node, 1, len(ids)])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


@dataclass
class Conn:
    """One rank's connection, as the protocol sees it."""

    rank: int | None = None  # set by a valid `initack`


@dataclass
class PmiState:
    """The step's PMI server, without sockets: `handle` takes one message of one connection
    and returns what to send, to whom. Thread-safe (one lock): connections are served by
    threads of their own."""

    id_base: int
    kvsname: str
    #: srun's step layout (global task ids per node), once the controller has answered
    task_ids: list[list[int]] | None = None
    size: int = 0  # the step's tasks, with the layout
    kvs: dict[str, str] = field(default_factory=dict)
    published: dict[str, str] = field(default_factory=dict)
    at_barrier: list[Conn] = field(default_factory=list)
    #: (rank, exit code, message) of a rank's `abort`
    aborted: tuple[int | None, int, str] | None = None
    lock: threading.Condition = field(default_factory=threading.Condition)

    def set_layout(self, task_ids: list[list[int]]) -> None:
        with self.lock:
            self.task_ids = [list(ids) for ids in task_ids]
            self.size = sum(len(ids) for ids in task_ids)
            self.lock.notify_all()

    def handle(self, conn: Conn, msg: dict[str, str]) -> list[tuple[Conn, str]] | None:
        """The replies to `msg` from `conn` (a barrier's last arrival answers every waiting
        rank), or None: close this connection (an unknown peer, or a PMI-2 client)."""
        cmd = msg.get("cmd", "")
        with self.lock:
            if conn.rank is None:
                return self._first(conn, cmd, msg)
            if cmd == "barrier_in":
                self.at_barrier.append(conn)
                if len(self.at_barrier) < self.size:
                    return []
                waiting, self.at_barrier = self.at_barrier, []
                return [(c, format_reply("barrier_out", rc=0)) for c in waiting]
            reply = self._answer(conn, cmd, msg)
        return [(conn, reply)] if reply is not None else []

    def _first(self, conn: Conn, cmd: str, msg: dict[str, str]) -> list[tuple[Conn, str]] | None:
        """A connection's first message must name a task of this step (`initack pmiid=`).
        Called with the lock held."""
        if cmd != "initack":
            return None
        try:
            rank = int(msg.get("pmiid", "")) - self.id_base
        except ValueError:
            return None
        self.lock.wait_for(lambda: self.task_ids is not None, timeout=LAYOUT_WAIT_S)
        if not 0 <= rank < self.size:
            return None
        conn.rank = rank
        # the v1 "initack" reply: four lines, the way MPICH's client reads them
        lines = (
            format_reply("initack", rc=0)
            + format_reply("set", size=self.size)
            + format_reply("set", rank=rank)
            + format_reply("set", debug=0)
        )
        return [(conn, lines)]

    def _answer(self, conn: Conn, cmd: str, msg: dict[str, str]) -> str | None:
        if cmd == "init":
            version = msg.get("pmi_version", "1")
            if version != "1":
                return format_reply(
                    "response_to_init", rc=-1, pmi_version=1, pmi_subversion=1,
                    msg=f"PMI-{version}_is_not_served:_this_srun_serves_PMI-1",
                )  # fmt: skip
            return format_reply("response_to_init", pmi_version=1, pmi_subversion=1, rc=0)
        if cmd == "get_maxes":
            return format_reply(
                "maxes", kvsname_max=KVSNAME_MAX, keylen_max=KEYLEN_MAX, vallen_max=VALLEN_MAX,
                rc=0,
            )  # fmt: skip
        if cmd == "get_universe_size":
            return format_reply("universe_size", size=self.size, rc=0)
        if cmd == "get_appnum":
            return format_reply("appnum", appnum=0, rc=0)
        if cmd == "get_my_kvsname":
            return format_reply("my_kvsname", kvsname=self.kvsname, rc=0)
        if cmd == "put":
            key, value = msg.get("key", ""), msg.get("value", "")
            if not key or len(key) > KEYLEN_MAX or len(value) > VALLEN_MAX:
                return format_reply("put_result", rc=-1, msg="bad_key_or_value_length")
            self.kvs[key] = value
            return format_reply("put_result", rc=0, msg="success")
        if cmd == "get":
            return self._get(msg.get("key", ""))
        if cmd == "publish_name":
            self.published[msg.get("service", "")] = msg.get("port", "")
            return format_reply("publish_result", rc=0, msg="success")
        if cmd == "unpublish_name":
            found = self.published.pop(msg.get("service", ""), None) is not None
            return format_reply("unpublish_result", rc=0 if found else -1)
        if cmd == "lookup_name":
            port = self.published.get(msg.get("service", ""))
            if port is None:
                return format_reply("lookup_result", rc=-1, msg="service_not_found")
            return format_reply("lookup_result", port=port, rc=0)
        if cmd == "finalize":
            return format_reply("finalize_ack", rc=0)
        if cmd == "abort":
            try:
                code = int(msg.get("exitcode", "1"))
            except ValueError:
                code = 1
            self.aborted = self.aborted or (conn.rank, code, msg.get("message", ""))
            self.lock.notify_all()
            return None
        if cmd == "spawn" or msg.get("mcmd") == "spawn":
            return format_reply("spawn_result", rc=-1, msg="MPI_Comm_spawn_is_not_supported")
        return format_reply(cmd or "unknown", rc=-1, msg="unknown_command")

    def _get(self, key: str) -> str:
        if key == "PMI_process_mapping" and self.task_ids is not None:
            value = process_mapping(self.task_ids)
            return format_reply("get_result", rc=0, msg="success", value=value)
        if key == "PMI_dead_processes":  # asked by MPICH's fault tolerance: none is known
            return format_reply("get_result", rc=0, msg="success", value="")
        if key in self.kvs:
            return format_reply("get_result", rc=0, msg="success", value=self.kvs[key])
        return format_reply("get_result", rc=-1, msg=f"key_{key}_not_found", value="unknown")


class PmiServer:
    """`PmiState` on a TCP port: one thread a connection (a step's ranks, at most a few
    hundred per srun). `on_abort(rank, code, message)` is called once, from a connection's
    thread, when a rank calls MPI_Abort."""

    def __init__(self, *, on_abort: Callable[[int | None, int, str], None] | None = None) -> None:
        # rank + id_base stays below 2**31 (MPICH reads PMI_ID with atoi) for any step
        self.id_base = 1 + int.from_bytes(os.urandom(4), "big") % (2**30)
        self.state = PmiState(id_base=self.id_base, kvsname=f"phx_{os.getpid()}")
        self.on_abort = on_abort
        self.step_id: int | None = None  # once the controller has answered
        self._abort_told = False
        self._conns: list[socket.socket] = []
        self._send_lock = threading.Lock()
        self._socks: dict[int, socket.socket] = {}  # id(Conn) -> its socket
        self.listener = Listener(self._serve, name="srun-pmi")
        self.port = self.listener.port

    def start(self, step_id: int, task_ids: list[list[int]]) -> None:
        """The step exists: its id and layout (and so its size) are known."""
        self.step_id = step_id
        self.state.set_layout(task_ids)

    def close(self) -> None:
        """Stop listening, and end the ranks' connections (their threads see the end)."""
        self.listener.close()
        for s in list(self._conns):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns.append(sock)
        conn = Conn()
        self._socks[id(conn)] = sock
        buf = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, _, buf = buf.partition(b"\n")
                    if not self._one(conn, line.decode(errors="replace")):
                        return
                if len(buf) > MAX_LINE or (conn.rank is None and buf[:1].isdigit()):
                    return  # not a PMI-1 line (a PMI-2 client's length prefix): say nothing
        except OSError:
            return
        finally:
            self._socks.pop(id(conn), None)
            with contextlib.suppress(ValueError):
                self._conns.remove(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _one(self, conn: Conn, line: str) -> bool:
        msg = parse_line(line)
        replies = self.state.handle(conn, msg)
        if replies is None:
            return False
        aborted = self.state.aborted
        if aborted is not None and not self._abort_told and self.on_abort is not None:
            self._abort_told = True
            self.on_abort(*aborted)
        with self._send_lock:
            for to, text in replies:
                sock = self._socks.get(id(to))
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.sendall(text.encode())
        return True
