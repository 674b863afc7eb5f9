"""``srun``: run a job step (inside an allocation), or a job of one step (outside one).

Inside a job (``SLURM_JOB_ID`` set), srun listens on a TCP port, asks the controllers for a
step in the job (``POST /v1/jobs/ID/steps``) and gets from every task a connection for its
stdout, one for its stderr and one for its exit record, each opened by the task's shepherd
with the step's cookie.  Output is copied through as it comes (``-l`` puts ``TASK: `` before
every line), and to any `sattach` attached to the step (srun/attach.py).  srun's stdin goes to
every task, as Slurm's srun forwards it: each task reads it from its stdout connection, and
srun's end of input is theirs (a batch script's srun has /dev/null: its tasks get /dev/null,
as before).  srun exits with the worst task exit code once every task has reported, and
forwards SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 to the step's tasks.  With ``--kill-on-bad-exit``
a task that fails stops the step.  Should a node die, the controllers end the step and srun,
which also watches the step's record, stops waiting for the tasks that were there.

Outside a job, srun submits a job whose batch step is ``srun`` itself with the same options,
told (``PHX_SRUN_ATTACH``) to send the step's streams back to this srun: the terminal sees the
tasks' output as Slurm's srun shows it (its stdin is not forwarded there: the tasks get
/dev/null).  ``--pty`` runs task 0 on a pseudo-terminal relayed to
this srun's terminal (pty_relay.py); ``--jobid`` runs a step in a job from outside it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.domain import hostlist
from phalanx.errors import ControllerUnavailable, PhalanxError
from phalanx.lean_client import LeanClient
from phalanx.netaddr import local_address
from phalanx.slurm.common import SlurmParser, SlurmUsageError, run_command
from phalanx.slurm.srun import attach, pty_relay
from phalanx.slurm.srun import push as step_push
from phalanx.slurm.srun.listener import Listener
from phalanx.slurm.srun.refused import add_refused

if TYPE_CHECKING:
    from phalanx.slurm.srun.pmi import PmiServer

PROG = "srun"
ATTACH_ENV = "PHX_SRUN_ATTACH"  # host:port:cookie of the srun a job's inner srun reports to
POLL_S = 0.5  # how often srun checks the step's record while it waits for its tasks
DRAIN_S = 2.0  # after the last exit record, how long to wait for output still in flight
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
USAGE = "Usage: srun [OPTIONS(0)... [executable(0) [args(0)...]]]\n"


@functools.cache
def parser() -> SlurmParser:
    """srun's parser, built once a process: with srun(1)'s refused options it has about 130,
    and building it took 2 ms of every step the job's helper runs (parsing leaves it as it
    was)."""
    p = SlurmParser(PROG, add_help=True)
    a = p.add_argument
    a("-N", "--nodes", type=_nodes)
    a("-n", "--ntasks", type=_positive)
    a("--ntasks-per-node", type=_positive)
    a("-c", "--cpus-per-task", type=_positive, default=None)
    a("--gpus-per-task", type=_gpus)
    a("--gpus-per-node", type=_gpus)
    a("--gres", type=_gres)
    a("-w", "--nodelist")
    a("-x", "--exclude")
    a("-l", "--label", action="store_true")
    a("-K", "--kill-on-bad-exit", nargs="?", const="1", default=None)
    # the job's: a step of a --no-kill job has its task on a lost node started again where
    # a spare takes that node's place (docs/elastic.md); outside a job, the new job's option
    a("-k", "--no-kill", nargs="?", const="on", default=None)
    a("-o", "--output")
    a("-e", "--error")
    a("--open-mode", type=open_mode)
    a("-J", "--job-name")
    a("-D", "--chdir")
    a("--export", default="ALL")
    a("--pty", action="store_true")
    a("--jobid")
    # placement and binding hints: accepted, the allocation's cgroup and CPU set apply
    for name in ("--cpu-bind", "--gpu-bind", "--distribution", "-m", "--hint"):
        a(name, dest=name.lstrip("-").replace("-", "_") + "_hint")
    a("--mpi", dest="mpi")  # checked in prepare(): MPI_TYPES
    for flag in ("-u", "--unbuffered", "--exact", "--overlap", "--exclusive", "-Q", "--quiet"):
        a(flag, action="store_true", dest="flag_" + flag.lstrip("-").replace("-", "_"))
    a("-v", "--verbose", action="count", default=0)
    # used when srun makes its own job (outside an allocation)
    a("-p", "--partition")
    a("-t", "--time")
    a("--mem")
    a("--mem-per-cpu")
    a("-A", "--account")
    a("-q", "--qos")
    a("-C", "--constraint")
    a("--usage", nargs=0, action=_Usage)
    add_refused(p)  # the rest of srun(1)'s options, each refused with why (srun/refused.py)
    a("command", nargs="...")
    return p


class _Usage(argparse.Action):
    def __call__(self, p: Any, ns: Any, values: Any, option: str | None = None) -> None:
        sys.stdout.write(USAGE)
        raise SystemExit(0)


def _positive(text: str) -> int:
    if not text.isdecimal() or int(text) < 1:
        raise SlurmUsageError(f"invalid number {text!r}: give a whole number of at least 1")
    return int(text)


def open_mode(text: str) -> str:
    """--open-mode (or $SLURM_OPEN_MODE): append or truncate, as Slurm spells them."""
    mode = text.strip().lower()
    if mode in ("a", "append"):
        return "append"
    if mode in ("t", "truncate"):
        return "truncate"
    raise SlurmUsageError(f"invalid --open-mode {text!r}: use append or truncate")


def _nodes(text: str) -> int:
    low = text.split("-")[0]
    return _positive(low)


def _gpus(text: str) -> int:
    count = text.rsplit(":", 1)[-1]
    if not count.isdecimal():
        raise SlurmUsageError(f"invalid GPU count {text!r}: use N or TYPE:N")
    return int(count)


def _gres(text: str) -> int:
    parts = text.split(":")
    if parts[0] != "gpu":
        raise SlurmUsageError(f"unsupported --gres={text}: only gpu[:TYPE]:N is known")
    return int(parts[-1]) if len(parts) > 1 and parts[-1].isdecimal() else 1


def main(argv: Sequence[str]) -> int:
    return run_command(PROG, _main, argv)


def prepare(argv: list[str], env: Mapping[str, str] | None = None) -> Any:
    """srun's options, checked: SlurmUsageError for anything srun refuses. `env`: the
    caller's environment, where srun's input variables are read (default: this process's;
    the job's srun helper passes its caller's)."""
    opts = parser().parse_args(argv)
    opts.mpi = mpi_type(opts.mpi, (os.environ if env is None else env).get("SLURM_MPI_TYPE"))
    if opts.mpi == "list":
        sys.stdout.write(MPI_LIST)
        raise SystemExit(0)
    if not opts.command:
        raise SlurmUsageError("no command given: srun [OPTIONS] COMMAND [ARGS...]")
    if opts.exclude:
        raise SlurmUsageError("--exclude is not supported inside an allocation; use --nodelist")
    return opts


# what srun --mpi may name: "pmi2" starts srun's PMI server for the step's tasks (srun/pmi.py:
# the PMI-1 wire, which MPICH-family libraries speak, as Slurm's pmi2 plugin also serves it)
MPI_TYPES = ("none", "pmi2")
MPI_LIST = "MPI plugin types are...\n\tnone\n\tpmi2\n"
# Slurm's other types, refused by name: an MPI program launched without the server it
# expects would die in MPI_Init with no word from us
MPI_REFUSED = {
    "pmix": "Open MPI's PMIx is not served; launch Open MPI programs with mpirun inside the "
    "allocation (it starts its daemons through srun), or use an MPICH-family MPI with "
    "--mpi=pmi2",
    "cray_shasta": "Cray's PMI is not served",
}


def mpi_type(option: str | None, env: str | None) -> str:
    """The step's MPI type: --mpi, else $SLURM_MPI_TYPE, else "none" ("list": print them).
    A type srun does not serve is refused by name, as Slurm refuses an unknown one."""
    for given, where in ((option, "--mpi"), (env, "SLURM_MPI_TYPE")):
        if given is None or not given.strip():
            continue
        kind = given.strip().lower()
        base = kind.split("_v", 1)[0] if kind.startswith("pmix") else kind
        if kind in MPI_TYPES or (kind == "list" and where == "--mpi"):
            return kind
        if base in MPI_REFUSED:
            raise SlurmUsageError(f"{where}={given} is not supported: {MPI_REFUSED[base]}")
        raise SlurmUsageError(f"Invalid MPI type '{given}', --mpi=list for acceptable types")
    return "none"


def _main(argv: list[str]) -> int:
    opts = prepare(argv)
    if opts.jobid:  # the step's tasks know their job, as under Slurm's srun --jobid
        os.environ["SLURM_JOB_ID"] = os.environ["SLURM_JOBID"] = opts.jobid
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("PHX_JOB_ID")
    attached = bool(os.environ.get(ATTACH_ENV))  # the batch step of an outer srun's job
    with LeanClient() as client:
        if job:
            if not attached and not opts.jobid:  # (not on a host outside the job)
                from phalanx.slurm.srun import thin as srun_fast

                srun_fast.start_helper()  # later sruns of this job go through it
            with pty_relay.maybe(opts.pty and not attached) as term:
                return _step(client, job, opts, Caller.this_process(), term=term)
        with pty_relay.maybe(opts.pty) as term:
            return _outside(client, argv, opts, term)


class Sink(Protocol):
    def write(self, data: bytes, /) -> Any: ...
    def flush(self) -> Any: ...


@dataclass
class Caller:
    """Who runs a step: the srun process itself, or a thin srun served by the job's helper
    (srun/helper.py), which passes its environment, directory and stdout/stderr along."""

    env: Mapping[str, str]
    cwd: str
    out: Sink
    err: Sink
    # install a signal forwarder for the step's life; returns what undoes it
    on_signals: Callable[[Callable[[int], None]], Callable[[], None]] = field(repr=False)
    stdin: int | None = None  # the caller's stdin when srun forwards it to the tasks

    @classmethod
    def this_process(cls) -> Caller:
        def install(forward: Callable[[int], None]) -> Callable[[], None]:
            old = {s: signal.signal(s, lambda n, _f: forward(n)) for s in FORWARDED}

            def undo() -> None:
                for s, h in old.items():
                    signal.signal(s, h)

            return undo

        stdin = 0 if live_stdin(0) else None
        return cls(os.environ, os.getcwd(), sys.stdout.buffer, sys.stderr.buffer, install, stdin)

    def say(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.err.write(text.encode(errors="replace"))
            self.err.flush()


# ----------------------------------------------------------------------------- step I/O
class StepIO:
    """The listening end of a step: task streams in, exit records collected; the step's I/O
    hub for `sattach` clients and, with `stdin` (a descriptor of srun's caller), the tasks'
    stdin (srun/attach.py)."""

    def __init__(
        self,
        *,
        label: bool,
        host: str | None = None,
        out: Sink | None = None,
        err: Sink | None = None,
        pty: pty_relay.Terminal | None = None,
        stdin: int | None = None,
    ) -> None:
        self.pty = pty  # --pty: task 0's terminal connection is served by it
        self.hub = attach.Hub()  # the streams to attached clients (sattach)
        if pty is not None:
            pty.tap = lambda data: self.hub.publish(b"o", 0, data)
        self.stdin_fd = stdin
        self.inputs = attach.Inputs() if stdin is not None else None
        self.tasks: list[int] | None = None  # the step's tasks, once it exists (expect)
        self.closing = False
        self._wake: tuple[int, int] | None = None  # the stdin pump's wake-up pipe
        self._pump: threading.Thread | None = None
        self.out: Sink = out if out is not None else sys.stdout.buffer
        self.err: Sink = err if err is not None else sys.stderr.buffer
        self.cookie = os.urandom(16).hex()  # (not `secrets`: ~10 ms of imports per srun)
        self.label = label
        self.host = host or ""
        self.exits: dict[int, dict[str, Any]] = {}
        self.open_streams = 0
        self.closed_streams = 0  # output connections that reached their end
        self.cond = threading.Condition()
        self.out_lock = threading.Lock()
        self.listener = Listener(self._serve, name="srun-accept")
        self.port = self.listener.port

    def drain(self, opts: Any, timeout: float = DRAIN_S) -> None:
        """Wait until the output of every task that started has arrived: each opened its
        streams before it ran (stdout, and stderr unless -e), and an exit record can come in
        before a stream's last bytes. Bounded: a lost task's streams may never close."""
        per_task = 0 if opts.output else (1 if opts.error else 2)
        with self.cond:
            started = sum(1 for rec in self.exits.values() if rec.get("started_at"))
            want = started * per_task
            if self.pty is not None:  # one stream, task 0's terminal
                want = 1 if (self.exits.get(0) or {}).get("started_at") else 0
            self.cond.wait_for(
                lambda: self.closed_streams >= want and self.open_streams == 0, timeout=timeout
            )

    def close(self) -> None:
        """Stop listening for good (the resident helper runs step after step); attached
        clients get what is queued for them and the step's end, and srun stops reading its
        stdin (the helper's caller's stdin is not the helper's to read after the step)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
            wake = self._wake
        if wake is not None:
            with contextlib.suppress(OSError):
                os.write(wake[1], b"x")
            if self._pump is not None:
                self._pump.join(timeout=2.0)  # before the helper closes its caller's stdin
            if self._pump is None or not self._pump.is_alive():
                for end in wake:
                    with contextlib.suppress(OSError):
                        os.close(end)
        self.hub.finish()
        self.listener.close()

    def expect(self, tasks: list[int]) -> None:
        """The step exists with these tasks: srun's stdin goes to them once each has
        connected (or ended), read only as they take it."""
        with self.cond:
            self.tasks = list(tasks)
            self.cond.notify_all()
        if self.inputs is not None and self.stdin_fd is not None:
            self._wake = os.pipe()
            self._pump = threading.Thread(target=self._pump_stdin, name="srun-stdin", daemon=True)
            self._pump.start()

    def _inputs_ready(self) -> bool:
        """Every task's stdin is connected, or the task has ended (or never will start)."""
        if self.closing:
            return True
        if self.tasks is None or self.inputs is None:
            return False
        have = self.inputs.tasks() | set(self.exits)
        return all(t in have for t in self.tasks)

    def _pump_stdin(self) -> None:
        """srun's stdin to every task, as Slurm's srun forwards it by default; its end is
        theirs. A terminal is read only while srun is in its foreground (a background srun
        would be stopped by SIGTTIN), as Slurm's srun leaves a terminal it is not in front
        of alone."""
        assert self.inputs is not None and self.stdin_fd is not None and self._wake is not None
        import select

        fd, wake = self.stdin_fd, self._wake[0]  # (close() closes the wake-up pipe)
        with self.cond:
            self.cond.wait_for(self._inputs_ready)
        tty = os.isatty(fd)
        both, alone = select.poll(), select.poll()
        both.register(fd, select.POLLIN)
        for poller in (both, alone):
            poller.register(wake, select.POLLIN)
        while not self.closing:
            if tty and not _in_foreground(fd):
                if alone.poll(200):
                    return
                continue
            if any(ready == wake for ready, _ in both.poll()):
                return
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                self.inputs.end(None)
                return
            self.inputs.send(None, data)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30.0)
            try:
                head = _read_line(conn)
            except OSError:
                return
            parts = head.split()
            import hmac  # here, off srun's start-up path

            if len(parts) == 3 and parts[2] == "attach":
                if hmac.compare_digest(parts[0], self._attach_token()):
                    self._attach(conn)
                return
            if len(parts) != 3 or not hmac.compare_digest(parts[0], self.cookie):
                return  # not one of ours: say nothing
            task, what = int(parts[1]), parts[2]
            conn.settimeout(None)
            if what == "exit":
                data = b""
                with contextlib.suppress(OSError):
                    while chunk := conn.recv(65536):
                        data += chunk
                try:
                    record = json.loads(data.decode() or "{}")
                except ValueError:
                    record = {"error": "unreadable exit record"}
                with self.cond:
                    self.exits[task] = record
                    self.cond.notify_all()
                self.hub.publish(b"x", task, json.dumps(record).encode(), keep=False)
                return
            sink = self.err if what == "err" else self.out
            with self.cond:
                self.open_streams += 1
                if what == "out" and self.inputs is not None:
                    self.inputs.add(task, conn)  # its stdin too (agent/shepherd_start.py)
                    self.cond.notify_all()
            try:
                if what == "pty" and self.pty is not None:
                    self.pty.serve(conn)
                else:
                    self._copy(conn, sink, task, b"e" if what == "err" else b"o")
            finally:
                with self.cond:
                    self.open_streams -= 1
                    self.closed_streams += 1
                    self.cond.notify_all()

    def _attach_token(self) -> str:
        from phalanx.auth.attachcred import attach_token

        return attach_token(self.cookie)

    def _attach(self, conn: socket.socket) -> None:
        """A `sattach` client (srun/attach.py): the hello, the output kept, every frame from
        now on; its stdin to the tasks. Its going away changes nothing for the step."""
        conn.settimeout(None)
        with self.cond:
            exits = {str(t): rec for t, rec in self.exits.items()}
        hello = {
            "exits": exits,
            "stdin": self.inputs is not None or self.pty is not None,
            "pty": self.pty is not None,
        }
        client = attach.Client(conn)
        self.hub.attach(client, json.dumps(hello).encode())
        try:
            while (got := attach.read_frame(conn)) is not None:
                kind, task, data = got
                if kind != b"i":
                    continue
                if self.pty is not None:  # keys for task 0's terminal; it has no end of input
                    if data and task in (attach.ALL, 0):
                        with contextlib.suppress(OSError):
                            self.pty.send_keys(data)
                    continue
                if self.inputs is None:
                    continue
                with self.cond:
                    self.cond.wait_for(self._inputs_ready, timeout=30.0)
                tasks = None if task == attach.ALL else [task]
                if data:
                    self.inputs.send(tasks, data)
                else:
                    self.inputs.end(tasks)
        finally:
            self.hub.detach(client)
            client.finish()

    def _copy(self, conn: socket.socket, sink: Sink, task: int, kind: bytes = b"o") -> None:
        prefix = f"{task}: ".encode()
        partial = b""
        publish = self.hub.publish
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                chunk = b""
            if chunk:
                publish(kind, task, chunk)
            if not chunk:
                if partial:
                    self._write(sink, (prefix + partial + b"\n") if self.label else partial)
                return
            if not self.label:
                self._write(sink, chunk)
                continue
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            if lines:
                self._write(sink, b"".join(prefix + line + b"\n" for line in lines))

    def _write(self, sink: Sink, data: bytes) -> None:
        with self.out_lock:
            try:
                sink.write(data)
                sink.flush()
            except (OSError, ValueError):
                pass  # the reader went away (srun | head): the tasks run on


def _in_foreground(fd: int) -> bool:
    """Whether this process is in the foreground of the terminal `fd`."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return True  # not its controlling terminal: reading it stops nobody


def live_stdin(fd: int) -> bool:
    """Whether srun forwards the stdin it has on `fd`: not closed, not /dev/null (a batch
    script's: its end would be the tasks' at once, as their own /dev/null is)."""
    import stat

    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return not (stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3))


def _read_line(conn: socket.socket, limit: int = 512) -> str:
    """The connection's header line, and not a byte of what follows it (the task's stream):
    peek at what has arrived, then take up to the newline (two system calls for a header that
    came in one segment, where reading byte by byte took one per byte)."""
    data = b""
    while True:
        peeked = conn.recv(limit + 1 - len(data), socket.MSG_PEEK)
        if not peeked:
            raise OSError("short header")
        end = peeked.find(b"\n")
        take = conn.recv(end + 1 if end >= 0 else len(peeked))
        data += take
        if end >= 0 and data.endswith(b"\n"):
            return data.decode(errors="replace").strip()
        if len(data) > limit:
            raise OSError("short header")


def advertised_host(urls: list[str], env: Mapping[str, str] | None = None) -> str:
    """The address tasks on other nodes reach this srun at: $PHX_SRUN_HOST, else the local
    address this host uses to reach the first controller (no packet is sent)."""
    given = (os.environ if env is None else env).get("PHX_SRUN_HOST")
    if given:
        return given
    return local_address(urls[0]) or "127.0.0.1"


def _body(
    opts: Any,
    host: str,
    cookie: str,
    port: int,
    caller: Caller | None = None,
    *,
    stdin: bool = False,
) -> dict[str, Any]:
    caller = caller or Caller.this_process()
    env = dict(caller.env)
    export = (opts.export or "ALL").split(",")
    if export[0].upper() == "NONE":
        keep = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TERM", "SHELL"}
        env = {k: v for k, v in env.items() if k in keep or k.startswith(("SLURM_", "PHX_"))}
        export = export[1:]
    elif export[0].upper() == "ALL":
        export = export[1:]
    for item in export:
        name, eq, value = item.partition("=")
        if eq:
            env[name] = value
    env.pop(ATTACH_ENV, None)
    gpus_per_node = opts.gpus_per_node if opts.gpus_per_node is not None else opts.gres
    body: dict[str, Any] = {
        "argv": list(opts.command),
        "env": env,
        "cwd": opts.chdir or caller.cwd,
        "name": opts.job_name,
        "nodes": opts.nodes,
        "ntasks": opts.ntasks,
        "ntasks_per_node": opts.ntasks_per_node,
        "cpus_per_task": opts.cpus_per_task or 1,
        "gpus_per_task": opts.gpus_per_task,
        "gpus_per_node": gpus_per_node,
        "nodelist": hostlist.expand_hostlist(opts.nodelist) if opts.nodelist else [],
        "output": opts.output,
        "error": opts.error,
        "label": bool(opts.label),
        "open_mode": opts.open_mode
        or (
            open_mode(caller.env["SLURM_OPEN_MODE"]) if caller.env.get("SLURM_OPEN_MODE") else None
        ),
        "host": host,
        "port": port,
        "cookie": cookie,
    }
    if opts.pty:
        body["pty"] = True
    if stdin:
        body["stdin"] = True  # the tasks read their stdin from their stdout connections
    return body


# ----------------------------------------------------------------------------- inside a job
def _step(
    client: LeanClient,
    job: str,
    opts: Any,
    caller: Caller,
    host: str | None = None,
    term: pty_relay.Terminal | None = None,
) -> int:
    attach = caller.env.get(ATTACH_ENV)
    if attach:
        return _inner(client, job, opts, attach)
    forward = caller.stdin if opts.output is None and not opts.pty else None
    io = StepIO(label=bool(opts.label), out=caller.out, err=caller.err, pty=term, stdin=forward)
    pmi = _pmi_server(opts, client, job, caller)
    try:
        host = host or advertised_host(client.urls, caller.env)
        body = _body(opts, host, io.cookie, io.port, caller, stdin=forward is not None)
        step = _start_with_pmi(client, job, body, pmi)
        io.expect([t for ids in step["task_ids"] for t in ids])
        return _abort_code(pmi, _supervise(client, job, step, io, opts, caller))
    finally:
        io.close()
        if pmi is not None:
            pmi.close()


def _pmi_server(opts: Any, client: LeanClient, job: str, caller: Caller) -> PmiServer | None:
    """srun --mpi=pmi2: the step's PMI server (srun/pmi.py). A rank's MPI_Abort ends the step,
    as Slurm's does: the other ranks would wait on it for ever."""
    if opts.mpi != "pmi2":
        return None
    from phalanx.slurm.srun.pmi import PmiServer

    def aborted(rank: int | None, code: int, message: str) -> None:
        told = f": {message}" if message else ""
        caller.say(f"{PROG}: error: task {rank}: MPI_Abort with exit code {code}{told}\n")
        sid = server.step_id
        if sid is None:
            return
        with contextlib.suppress(PhalanxError), LeanClient(",".join(client.urls)) as own:
            reason = f"MPI_Abort by task {rank} (exit code {code})"
            own.post(f"/v1/jobs/{job}/steps/cancel", {"step_id": sid, "reason": reason})

    server = PmiServer(on_abort=aborted)
    return server


def _start_with_pmi(
    client: LeanClient, job: str, body: dict[str, Any], pmi: PmiServer | None
) -> dict[str, Any]:
    """start_step, telling the tasks where the PMI server is and the server the step's layout."""
    if pmi is None:
        return start_step(client, job, body)
    step = start_step(client, job, {**body, "pmi_port": pmi.port, "pmi_id_base": pmi.id_base})
    pmi.start(int(step["step_id"]), [list(ids) for ids in step["task_ids"]])
    return step


def start_step(client: LeanClient, job: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create the step and, where the controller answers with direct launches, hand them to
    the nodes' agents (srun/push.py); the nodes that did not take theirs are woken through
    the controller, whose long-poll carries the same step."""
    step = client.post(f"/v1/jobs/{job}/steps", {**body, "direct": True})
    launches = step.pop("launch", None)
    if launches:
        failed = step_push.hand_over(launches, float(step.pop("push_timeout", 2.0)))
        if failed:
            with contextlib.suppress(PhalanxError):  # their heartbeats bring it anyway
                client.post(f"/v1/jobs/{job}/steps/{step['step_id']}/wake", {"nodes": failed})
    return step


def _inner(client: LeanClient, job: str, opts: Any, attach: str) -> int:
    """The batch step of a job made by an outer srun: start the step with the outer srun's
    address, then wait for the step's end and exit with its code."""
    host, port, cookie = attach.rsplit(":", 2)
    body = _body(opts, host, cookie, int(port))
    pmi = _pmi_server(opts, client, job, Caller.this_process())
    try:
        step = _start_with_pmi(client, job, body, pmi)
        sid = int(step["step_id"])
        while True:
            st = client.get(f"/v1/jobs/{job}/steps/{sid}")
            if st["state"] != "RUNNING":
                return _abort_code(pmi, _step_code(st))
            time.sleep(POLL_S)
    finally:
        if pmi is not None:
            pmi.close()


def _step_code(step: dict[str, Any]) -> int:
    """srun's exit status from the step's record, as worst_exit makes it from the tasks':
    the exit code, 128+N for a task killed by signal N."""
    code, sig = step.get("exit_code"), step.get("exit_signal")
    if isinstance(sig, int) and 0 < sig < 128 and not code:
        return 128 + sig
    return int(code) if isinstance(code, int) and 0 <= code < 256 else 1


def _abort_code(pmi: PmiServer | None, code: int) -> int:
    """srun's exit status: the step's, or after a rank's MPI_Abort its code (as mpiexec's)."""
    aborted = pmi.state.aborted if pmi is not None else None
    return aborted[1] & 0xFF if aborted is not None else code


def _supervise(
    client: LeanClient, job: str, step: dict[str, Any], io: StepIO, opts: Any, caller: Caller
) -> int:
    sid = int(step["step_id"])
    expected = {t for ids in step["task_ids"] for t in ids}
    nodes_of = {t: n for n, ids in zip(step["nodes"], step["task_ids"], strict=False) for t in ids}
    kill_on_bad = opts.kill_on_bad_exit not in (None, "0")
    state = {"last_int": 0.0, "killed": False}

    def forward(signum: int) -> None:
        now = time.monotonic()
        # A client of its own, always: this runs in the helper's relay thread or in srun's
        # signal handler, while the loop below may be in the middle of a request on
        # `client`; sharing that connection made a forward fail ("Request-sent") whenever
        # the signal interrupted a request, and a lost USR1 is a lost checkpoint.
        own = LeanClient(",".join(client.urls))
        try:
            if signum == signal.SIGINT and now - state["last_int"] < 1.0:
                own.post(f"/v1/jobs/{job}/steps/cancel", {"step_id": sid, "reason": "srun ^C"})
            else:
                own.post(f"/v1/jobs/{job}/steps/signal", {"step_id": sid, "signal": signum})
        except PhalanxError as e:
            caller.say(f"{PROG}: error: cannot forward signal {signum}: {e.message}\n")
        finally:
            own.close()
        if signum == signal.SIGINT:
            state["last_int"] = now

    undo = caller.on_signals(forward)
    try:
        reported: set[int] = set()
        next_poll = time.monotonic() + POLL_S
        ended_at: float | None = None
        while True:
            with io.cond:
                io.cond.wait_for(
                    lambda: set(io.exits) - reported or set(io.exits) >= expected, timeout=POLL_S
                )
                fresh = {t: io.exits[t] for t in set(io.exits) - reported}
            for task, rec in sorted(fresh.items()):
                reported.add(task)
                bad = _describe(rec)
                if bad:
                    caller.say(f"{PROG}: error: {nodes_of.get(task, '?')}: task {task}: {bad}\n")
                    if kill_on_bad and not state["killed"]:
                        state["killed"] = True
                        caller.say(f"{PROG}: error: terminating step {job}.{sid}\n")
                        with contextlib.suppress(PhalanxError):
                            client.post(
                                f"/v1/jobs/{job}/steps/cancel",
                                {
                                    "step_id": sid,
                                    "reason": f"task {task} failed (--kill-on-bad-exit)",
                                },
                            )
            if reported >= expected:
                break
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + POLL_S
                try:
                    st = client.get(f"/v1/jobs/{job}/steps/{sid}")
                except PhalanxError:
                    continue
                if st["state"] != "RUNNING":
                    ended_at = ended_at or time.monotonic()
                    if time.monotonic() - ended_at > DRAIN_S:
                        missing = sorted(expected - reported)
                        caller.say(
                            f"{PROG}: error: step {job}.{sid} ended {st['state']}; no exit from "
                            f"task(s) {','.join(map(str, missing))}\n"
                        )
                        for t in missing:
                            io.exits.setdefault(t, {"exit_code": None, "lost": True})
                        break
        io.drain(opts)
        return worst_exit(io.exits.values())
    finally:
        undo()


def _describe(rec: dict[str, Any]) -> str | None:
    if rec.get("launch_failed") or (
        rec.get("error") and rec.get("exit_code") is None and not rec.get("signal")
    ):
        return f"could not start: {rec.get('error')}"
    if rec.get("lost"):
        return "lost (its node failed)"
    sig = rec.get("signal")
    if sig:
        try:
            name = signal.Signals(int(sig)).name
        except ValueError:
            name = str(sig)
        return f"Killed by signal {name}" if name != "SIGKILL" else "Killed"
    code = rec.get("exit_code")
    if isinstance(code, int) and code != 0:
        return f"Exited with exit code {code}"
    return None


def worst_exit(records: Any) -> int:
    """srun's exit status: the highest task exit code; a task killed by signal N counts as
    128+N, one that never started or was lost as 1.  Tasks stopped because the step was
    cancelled (--kill-on-bad-exit) do not hide the failure that caused it."""
    records = list(records)
    own = [r for r in records if not (r.get("cancelled") or r.get("stop_requested"))]
    if any(_value(r) for r in own):
        records = own
    return min(max((_value(r) for r in records), default=0), 255)


def _value(rec: dict[str, Any]) -> int:
    code = rec.get("exit_code")
    sig = rec.get("signal")
    if sig:
        return 128 + int(sig)
    if isinstance(code, int):
        return code
    return 1


# ----------------------------------------------------------------------------- outside a job
def _outside(
    client: LeanClient, argv: list[str], opts: Any, term: pty_relay.Terminal | None = None
) -> int:
    """Make a job of one step: its batch step is srun itself, attached back to us."""
    io = StepIO(label=bool(opts.label), pty=term)
    try:
        host = advertised_host(client.urls)
        env = dict(os.environ)
        env[ATTACH_ENV] = f"{host}:{io.port}:{io.cookie}"
        env.setdefault("PHALANX_URL", ",".join(client.urls))
        spec: dict[str, Any] = {
            "name": opts.job_name or os.path.basename(opts.command[0]),
            "argv": [sys.executable, "-m", "phalanx.slurm", "srun", *argv],
            "env": env,
            "submit_dir": os.getcwd(),
            "workdir": opts.chdir or os.getcwd(),
            "output": os.devnull,
            "nodes": opts.nodes or 1,
            "cpus_per_task": opts.cpus_per_task or 1,
        }
        for key, value in (
            ("ntasks", opts.ntasks),
            ("ntasks_per_node", opts.ntasks_per_node),
            ("partition", opts.partition),
            ("account", opts.account),
            ("qos", opts.qos),
            ("constraint", opts.constraint),
        ):
            if value is not None:
                spec[key] = value
        if opts.no_kill is not None:
            spec["no_kill"] = opts.no_kill.strip().lower() not in ("off", "no", "0")
        if opts.gpus_per_task is not None:
            spec["gpus_per_task"] = opts.gpus_per_task
        elif opts.gpus_per_node is not None or opts.gres is not None:
            spec["gpus_per_node"] = (
                opts.gpus_per_node if opts.gpus_per_node is not None else opts.gres
            )
        if opts.time or opts.mem or opts.mem_per_cpu:
            from phalanx.domain import values

            try:
                if opts.time:
                    spec["time_limit_s"] = values.parse_duration(opts.time) or 0
                if opts.mem:
                    spec["mem_mb"] = values.parse_memory_mb(opts.mem)
                if opts.mem_per_cpu:
                    spec["mem_per_cpu_mb"] = values.parse_memory_mb(opts.mem_per_cpu)
            except ValueError as e:
                raise SlurmUsageError(str(e)) from None
        try:
            res = client.post("/v1/jobs", spec)
        except ControllerUnavailable as e:
            raise PhalanxError(
                f"not inside a job (no SLURM_JOB_ID) and no controller to make one: {e.message}; "
                "set PHALANX_URL to the cluster's controllers"
            ) from None
        jid = str(res["job_id"])
        return _follow(client, jid, io, opts)
    finally:
        io.close()


def _follow(client: LeanClient, jid: str, io: StepIO, opts: Any) -> int:
    said_queued = False
    started = time.monotonic()
    last_int = {"at": 0.0}

    def forward(signum: int, _frame: object) -> None:
        """Signals go to the job's step (its tasks), as an attached srun's do; a second ^C
        within a second cancels the whole job."""
        now = time.monotonic()
        # a connection of its own: the loop below may be in the middle of a request
        with contextlib.suppress(PhalanxError), LeanClient(",".join(client.urls)) as own:
            if signum == signal.SIGINT and now - last_int["at"] < 1.0:
                own.post("/v1/jobs/cancel", {"jobs": [jid], "reason": "srun ^C ^C"})
            else:
                own.post(f"/v1/jobs/{jid}/steps/signal", {"signal": signum})
        if signum == signal.SIGINT:
            last_int["at"] = now

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            (job,) = client.get(f"/v1/jobs/{jid}")["jobs"]
            st = job["state"]
            if st in ("PENDING", "HELD") and not said_queued and time.monotonic() - started > 1.0:
                sys.stderr.write(f"{PROG}: job {jid} queued and waiting for resources\n")
                said_queued = True
            if st in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            with io.cond:
                io.cond.wait(timeout=POLL_S)
        io.drain(opts)
        if io.exits:
            for task, rec in sorted(io.exits.items()):
                bad = _describe(rec)
                if bad:
                    sys.stderr.write(f"{PROG}: error: task {task}: {bad}\n")
            code = job.get("exit_code")
            if st in ("COMPLETED", "FAILED") and isinstance(code, int) and 0 <= code < 256:
                # the job's batch step is an srun (_inner) whose status is srun's: the tasks'
                # worst, or after an MPI_Abort the abort's code (the tasks then died of the
                # step's cancel, which says nothing of why)
                return code
            return worst_exit(io.exits.values())
        sys.stderr.write(
            f"{PROG}: error: job {jid} ended {st} before its step ran: {job.get('reason') or ''}\n"
        )
        code = job.get("exit_code")
        return int(code) if isinstance(code, int) and 0 < code < 256 else 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
