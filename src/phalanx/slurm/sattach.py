"""`sattach [options] JOBID.STEPID`: attach to a running job step's I/O, as Slurm's sattach does.

A step's I/O flows through its srun (srun/command.py, StepIO), the hub Slurm's slurmstepd is:
sattach asks the controller where (``POST /v1/jobs/ID/steps/N/attach``: the job's owner or an
admin, as slurmstepd lets the owner, root and SlurmUser attach) and gets srun's address with a
token derived from the step's cookie (auth/attachcred.py), then connects there as a second
client (srun/attach.py): it gets the output srun keeps (as slurmstepd replays what it keeps
to a client that attaches) and then every line as the tasks print it, each task's exit, and
sends its own stdin to the tasks when they read srun's (``--input-filter``: to one task; the
end of its input is theirs, as under Slurm). Filtering (``--output-filter``,
``--error-filter``) and ``-l/--label`` are done here, as Slurm's are in sattach. When sattach
exits or is killed the step runs on, its srun unaffected.

What it prints and its exit status are those of Slurm 22.05's sattach in the lab
(../shared/slurm-lab): ``task N exited with exit code C`` for each task that fails while
attached, exit status their highest code; ``Node N: no tasks running`` for a node whose tasks
have all ended; ``Could not get job step info: Invalid job id specified`` (exit 1) for a step
that does not exist or has ended; ``Failed to parse stepid ...`` and ``too many parameters``
with the usage line. Another user's step is refused as Slurm's controller refuses it under
``PrivateData=jobs``: ``Could not get job step info: Access/permission denied``, exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from phalanx.domain.hostlist import compress_hostlist
from phalanx.errors import Forbidden, NotFound
from phalanx.slurm.common import SlurmFatal, SlurmParser, SlurmUsageError, client, run_command
from phalanx.slurm.srun import attach

PROG = "sattach"
USAGE = "Usage: sattach [options] <jobid.stepid>\n"
HELP = USAGE + (
    "      --input-filter=taskid  send stdin to only the specified task\n"
    "      --output-filter=taskid only print stdout from the specified task\n"
    "      --error-filter=taskid  only print stderr from the specified task\n"
    "  -l, --label        prepend task number to lines of stdout & stderr\n"
    "      --layout       print task layout info and exit (does not attach to tasks)\n"
    "  -Q, --quiet        quiet mode (suppress informational messages)\n"
    "  -v, --verbose      verbose mode (multiple -v's increase verbosity)\n"
    "  -V, --version      print the Slurm version and exit\n"
    "\n"
    "Help options:\n"
    "  -h, --help         print this help message\n"
    "  -u, --usage        print a brief usage message\n"
)
CONNECT_TIMEOUT_S = 10.0
NO_STEP = "Could not get job step info: Invalid job id specified"
DENIED = "Could not get job step info: Access/permission denied"
# steps that are no srun's: their output goes to the job's file, there is no I/O to attach to
NOT_SRUN = {
    "batch": "the batch step's output goes to the job's output file (slurm-%j.out unless "
    "-o named another): follow it with tail -f",
    "extern": "Phalanx runs no extern step (it has no I/O)",
    "interactive": "Phalanx runs no interactive step: attach to a step srun started",
}


class UsageError(SlurmUsageError):
    """A usage error Slurm's sattach follows with its usage line (on stdout)."""


def parser() -> SlurmParser:
    p = SlurmParser(PROG, add_help=False)
    a = p.add_argument
    a("-h", "--help", nargs=0, action=_Print, default=HELP)
    a("-u", "--usage", nargs=0, action=_Print, default=USAGE)
    a("-V", "--version", nargs=0, action=_Version)
    a("-l", "--label", action="store_true")
    a("-Q", "--quiet", action="count", default=0)
    a("-v", "--verbose", action="count", default=0)
    a("--layout", action="store_true")
    a("--input-filter", type=lambda v: _task_filter(v, "input-filter"))
    a("--output-filter", type=lambda v: _task_filter(v, "output-filter"))
    a("--error-filter", type=lambda v: _task_filter(v, "error-filter"))
    a("--pty", action="store_true")
    # getopt's "+": the options end at the first operand (`sattach 12.0 -l`: two operands)
    a("step", nargs="...")
    return p


class _Print(argparse.Action):
    """-h and -u: print the text (the option's default) and exit 0."""

    def __call__(self, p: Any, ns: Any, values: Any, option: str | None = None) -> None:
        sys.stdout.write(str(self.default))
        raise SystemExit(0)


class _Version(argparse.Action):
    def __call__(self, p: Any, ns: Any, values: Any, option: str | None = None) -> None:
        from phalanx.slurm.main import SLURM_RELEASE

        sys.stdout.write(f"slurm {SLURM_RELEASE}\n")
        raise SystemExit(0)


NO_FILTER = -1  # a filter given as "-": every task, as Slurm takes it


def _task_filter(text: str, what: str) -> int:
    """A task number as Slurm's sattach reads one (strtol, then only blanks; not negative)."""
    if text == "-":
        return NO_FILTER
    body = text.strip()
    digits = body[1:] if body[:1] in "+" and len(body) > 1 else body
    if not digits.isdecimal():
        raise SlurmUsageError(f'Invalid numeric value "{text}" for {what}.')
    value = int(digits)
    if value > 2**31 - 1:
        raise SlurmUsageError(f"Numeric argument {value} to big for {what}.")
    return value


def parse_step(text: str) -> tuple[str, int]:
    """JOBID.STEPID as sattach takes it: the job (an array task's `12_3` too) and the step."""
    job, dot, step = text.partition(".")
    job_ok = job.isdecimal() or ("_" in job and all(x.isdecimal() for x in job.split("_", 1)))
    if not dot or not job_ok:
        raise UsageError("Failed to parse stepid from command line options")
    if step in NOT_SRUN:
        raise SlurmUsageError(f"{text}: {NOT_SRUN[step]}")
    if not step.isdecimal() or int(step) >= 2**31:
        raise SlurmFatal(f"Bad step specified: {job}")
    return job, int(step)


def options(argv: list[str]) -> Any:
    opts = parser().parse_args(argv)
    if len(opts.step) != 1:
        raise UsageError("too many parameters")
    if opts.quiet and opts.verbose:
        raise SlurmUsageError("don't specify both --verbose (-v) and --quiet (-Q)")
    filtered = (opts.input_filter, opts.output_filter, opts.error_filter)
    if opts.pty and any(f is not None for f in filtered):
        raise SlurmUsageError("don't specify both --pty and I/O filtering")
    if opts.error_filter is None:
        opts.error_filter = opts.output_filter  # as Slurm's sattach: stderr follows stdout
    opts.job, opts.step_id = parse_step(opts.step[0])
    return opts


def layout_text(info: dict[str, Any]) -> str:
    """--layout: the step's tasks per node, as sattach prints slurm_step_layout_t."""
    nodes, task_ids = list(info["nodes"]), [list(ids) for ids in info["task_ids"]]
    total = sum(len(ids) for ids in task_ids)
    out = [
        "Job step layout:\n",
        f"\t{total} tasks, {len(nodes)} nodes ({compress_hostlist(nodes)})\n\n",
    ]
    for i, (node, ids) in enumerate(zip(nodes, task_ids, strict=True)):
        out.append(f"\tNode {i} ({node}), {len(ids)} task(s): " + "".join(f"{t} " for t in ids))
        out.append("\n")
    return "".join(out)


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    try:
        opts = options(argv)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        sys.stdout.write(USAGE)
        return 1
    with client() as c:
        try:
            info = c.post(f"/v1/jobs/{opts.job}/steps/{opts.step_id}/attach", {})
        except NotFound:
            raise SlurmUsageError(NO_STEP) from None
        except Forbidden:
            raise SlurmUsageError(DENIED) from None
    if info.get("state") != "RUNNING" or not info.get("attach"):
        raise SlurmUsageError(NO_STEP)  # ended: Slurm's controller has forgotten it
    if opts.layout:
        sys.stdout.write(layout_text(info))
        return 0
    return Session(opts, info).run()


class Session:
    """One attachment: frames in from the step's srun, output out; stdin to the tasks."""

    def __init__(
        self,
        opts: Any,
        info: dict[str, Any],
        *,
        out: BinaryIO | None = None,
        err: BinaryIO | None = None,
        stdin: int = 0,
    ) -> None:
        self.opts = opts
        self.info = info
        self.out = out if out is not None else sys.stdout.buffer
        self.err = err if err is not None else sys.stderr.buffer
        self.stdin = stdin
        self.tasks = [t for ids in info["task_ids"] for t in ids]
        self.ended: set[int] = set()  # tasks whose exit srun had, or has told us of
        self.code = 0
        self.partial: dict[tuple[bytes, int], bytes] = {}  # -l: a line's start per stream

    def say(self, text: str, *, info: bool = False) -> None:
        """A message on stderr (`info`: an informational one, which -Q silences)."""
        if info and self.opts.quiet:
            return
        self.err.write(f"{PROG}: {'' if info else 'error: '}{text}\n".encode())
        self.err.flush()

    def run(self) -> int:
        att = self.info["attach"]
        where = f"{att['host']}:{att['port']}"
        try:
            conn = socket.create_connection(
                (att["host"], int(att["port"])), timeout=CONNECT_TIMEOUT_S
            )
        except OSError as e:
            self.say(f"cannot reach the step's srun at {where}: {e.strerror or e}")
            return 1
        with conn, self._terminal():
            conn.settimeout(None)
            conn.sendall(f"{att['token']} - attach\n".encode())
            first = attach.read_frame(conn, limit=64 << 20)
            if first is None or first[0] != b"h":
                self.say(f"the step's srun at {where} did not take the attach")
                return 1
            if not self._hello(json.loads(first[2] or b"{}"), conn):
                return self.code
            for kind, task, data in self._frames(conn):
                if kind == b"z":
                    break
                self._take(kind, task, data)
            else:
                if set(self.tasks) - self.ended:
                    self.say(f"lost the connection to the step's srun at {where}")
                    self.code = self.code or 1
            self._flush_partial()
        return self.code

    def _hello(self, hello: dict[str, Any], conn: socket.socket) -> bool:
        """What srun had when we attached; False when no task is left to attach to."""
        self.ended |= {int(t) for t in (hello.get("exits") or {})}
        for node, ids in zip(self.info["nodes"], self.info["task_ids"], strict=True):
            if ids and all(t in self.ended for t in ids):
                self.say(f"Node {node}: no tasks running", info=True)
        if all(t in self.ended for t in self.tasks):
            return False
        if hello.get("stdin"):
            threading.Thread(target=self._send_stdin, args=(conn,), daemon=True).start()
        return True

    def _frames(self, conn: socket.socket) -> Iterator[tuple[bytes, int, bytes]]:
        while (got := attach.read_frame(conn, limit=64 << 20)) is not None:
            yield got

    def _take(self, kind: bytes, task: int, data: bytes) -> None:
        if kind == b"x":
            self._exit(task, json.loads(data or b"{}"))
            return
        if kind not in (b"o", b"e"):
            return
        wanted = self.opts.output_filter if kind == b"o" else self.opts.error_filter
        if wanted not in (None, NO_FILTER) and task != wanted:
            return
        sink = self.out if kind == b"o" else self.err
        if self.opts.label and not self.opts.pty:
            data = self._labelled(kind, task, data)
        if data:
            sink.write(data)
            sink.flush()

    def _labelled(self, kind: bytes, task: int, data: bytes) -> bytes:
        prefix = f"{task}: ".encode()
        lines = (self.partial.pop((kind, task), b"") + data).split(b"\n")
        if lines[-1]:
            self.partial[(kind, task)] = lines[-1]
        return b"".join(prefix + line + b"\n" for line in lines[:-1])

    def _flush_partial(self) -> None:
        for (kind, task), rest in sorted(self.partial.items()):
            sink = self.out if kind == b"o" else self.err
            sink.write(f"{task}: ".encode() + rest + b"\n")
            sink.flush()
        self.partial.clear()

    def _exit(self, task: int, record: dict[str, Any]) -> None:
        """A task's end while attached: its exit code counts, as sattach's exit handler
        takes it (a task killed by a signal is said with -v only and does not count)."""
        if task in self.ended:
            return
        self.ended.add(task)
        code, sig = record.get("exit_code"), record.get("signal")
        if sig:
            if self.opts.verbose:
                self.say(f"task {task} killed by signal {sig}", info=True)
            return
        if isinstance(code, int) and code != 0:
            self.say(f"task {task} exited with exit code {code}")
            self.code = max(self.code, code)

    def _send_stdin(self, conn: socket.socket) -> None:
        """Our stdin to the tasks (--input-filter: to one); its end is theirs. For a --pty
        step it is the keys of task 0's terminal, which has no end of input."""
        task = self.opts.input_filter
        target = attach.ALL if task in (None, NO_FILTER) else int(task)
        while True:
            try:
                data = os.read(self.stdin, 65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            try:
                conn.sendall(attach.frame(b"i", target, data))
            except OSError:
                return
            if not data:
                return

    @contextlib.contextmanager
    def _terminal(self) -> Iterator[None]:
        """--pty: our terminal raw while attached (keys go to the remote terminal as typed),
        and as it was afterwards; the window size is not passed on (Slurm's is not)."""
        if not self.opts.pty or not os.isatty(self.stdin):
            yield
            return
        import termios
        import tty

        saved = termios.tcgetattr(self.stdin)
        old = {}
        if threading.current_thread() is threading.main_thread():  # (a test runs it in one)
            old = {s: signal.signal(s, _end) for s in (signal.SIGTERM, signal.SIGHUP)}
        tty.setraw(self.stdin, termios.TCSANOW)
        try:
            yield
        finally:
            termios.tcsetattr(self.stdin, termios.TCSADRAIN, saved)
            for s, h in old.items():
                signal.signal(s, h)


def _end(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
