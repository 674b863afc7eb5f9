"""sattach (slurm/sattach.py) and the step's I/O hub in srun it attaches to (srun/attach.py,
srun/command.py StepIO), against real sockets: tasks are plain connections that speak the
shepherd's side (a header line with the step's cookie, then the stream; their stdin comes
back on their stdout connection), sattach a Session in a thread.

Options and messages are those of Slurm 22.05's sattach (its man page's options in
tests/data/slurm-22.05/sattach-options.txt, its words as the lab printed them)."""

from __future__ import annotations

import io
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from phalanx.auth.attachcred import attach_token
from phalanx.slurm import sattach
from phalanx.slurm.common import SlurmFatal, SlurmUsageError
from phalanx.slurm.srun import attach
from phalanx.slurm.srun.command import StepIO

DATA = Path(__file__).parents[1] / "data" / "slurm-22.05" / "sattach-options.txt"
DEADLINE = 30.0


def test_every_sattach_option_slurm_documents_is_handled() -> None:
    listed = [x for x in DATA.read_text().splitlines() if x and not x.startswith("#")]
    assert len(listed) == 11
    known = {o[2:] for a in sattach.parser()._actions for o in a.option_strings}
    assert set(listed) <= known  # every one is sattach's own: none is refused


@pytest.mark.parametrize(
    ("argv", "error", "usage"),
    [
        ([], "too many parameters", True),
        (["1.0", "2.0"], "too many parameters", True),
        (["12.0", "-l"], "too many parameters", True),  # getopt's "+": options come first
        (["abc"], "Failed to parse stepid from command line options", True),
        (["12"], "Failed to parse stepid from command line options", True),
        (["--output-filter=x", "1.0"], 'Invalid numeric value "x" for output-filter.', False),
        (["--input-filter=-1", "1.0"], 'Invalid numeric value "-1" for input-filter.', False),
        (["-Q", "-v", "1.0"], "don't specify both --verbose (-v) and --quiet (-Q)", False),
        (["--pty", "--output-filter=1", "1.0"], "don't specify both --pty and I/O filtering", 0),
        (["1.batch"], "1.batch: the batch step's output goes to the job's output file", False),
    ],
)
def test_usage_errors_are_slurms(
    argv: list[str], error: str, usage: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sattach.main(argv) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"sattach: error: {error}"), err
    assert out == (sattach.USAGE if usage else "")


@pytest.mark.parametrize("argv", [["12.x"], ["12.-3"], ["12."]])
def test_a_bad_step_is_fatal_naming_the_job(argv: list[str]) -> None:
    with pytest.raises(SlurmFatal, match=r"^Bad step specified: 12$"):
        sattach.options(argv)


def test_options_and_their_forms() -> None:
    o = sattach.options(["-l", "--out=1", "--layout", "12_3.4"])  # a unique prefix will do
    assert (o.label, o.layout, o.output_filter, o.error_filter) == (True, True, 1, 1)
    assert (o.job, o.step_id) == ("12_3", 4)
    o = sattach.options(["--output-filter", "1", "--error-filter=2", "--input-filter", "-", "9.0"])
    assert (o.output_filter, o.error_filter, o.input_filter) == (1, 2, sattach.NO_FILTER)
    with pytest.raises(SlurmUsageError, match="ambiguous"):
        sattach.options(["--la", "9.0"])  # --label or --layout: getopt refuses it


@pytest.mark.parametrize(("flag", "text"), [("-h", sattach.HELP), ("--usage", sattach.USAGE)])
def test_help_and_usage_are_slurms(
    flag: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        sattach.options([flag])
    assert done.value.code == 0 and capsys.readouterr().out == text


def test_layout_is_printed_as_slurms() -> None:
    info = {"nodes": ["node01", "node02"], "task_ids": [[0, 1], [2]]}
    assert sattach.layout_text(info) == (
        "Job step layout:\n"
        "\t3 tasks, 2 nodes (node[01-02])\n\n"
        "\tNode 0 (node01), 2 task(s): 0 1 \n"
        "\tNode 1 (node02), 1 task(s): 2 \n"
    )


# ------------------------------------------------------------------ the hub, end to end
class Task:
    """A task's stdout connection, as its shepherd opens it (its stdin comes back on it)."""

    def __init__(self, step: StepIO, task: int, what: str = "out") -> None:
        self.sock = socket.create_connection(("127.0.0.1", step.port), timeout=DEADLINE)
        self.sock.sendall(f"{step.cookie} {task} {what}\n".encode())
        self.got = b""

    def print(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_until(self, want: bytes) -> bytes:
        """Its stdin up to `want` (or its end: b"" then)."""
        while want not in self.got:
            chunk = self.sock.recv(4096)
            if not chunk:
                return b""
            self.got += chunk
        return self.got


def exit_record(step: StepIO, task: int, **record: Any) -> None:
    with socket.create_connection(("127.0.0.1", step.port), timeout=DEADLINE) as s:
        s.sendall(f"{step.cookie} {task} exit\n".encode() + json.dumps(record).encode())


class Watched(io.BytesIO):
    """A sink whose content a test can wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()

    def write(self, data: Any) -> int:
        with self.cond:
            n = super().write(data)
            self.cond.notify_all()
            return n

    def wait_for(self, want: bytes) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: want in self.getvalue(), DEADLINE), self.getvalue()
            return self.getvalue()


class Attached:
    """sattach's Session on a step, in a thread; its stdin a pipe the test writes."""

    def __init__(self, step: StepIO, argv: list[str], tasks: list[int]) -> None:
        info = {
            "nodes": ["node01"],
            "task_ids": [tasks],
            "attach": {
                "host": "127.0.0.1",
                "port": step.port,
                "token": attach_token(step.cookie),
            },
        }
        self.out, self.err = Watched(), Watched()
        self.stdin_r, self.stdin_w = os.pipe()
        self.session = sattach.Session(
            sattach.options([*argv, "9.0"]), info, out=self.out, err=self.err, stdin=self.stdin_r
        )
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.session.run()

    def type(self, data: bytes) -> None:
        os.write(self.stdin_w, data)

    def end_input(self) -> None:
        os.close(self.stdin_w)

    def wait(self) -> int | None:
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive()
        os.close(self.stdin_r)
        return self.code


@pytest.fixture
def hub() -> Iterator[Callable[..., StepIO]]:
    made: list[StepIO] = []

    def make(**kw: Any) -> StepIO:
        step = StepIO(label=False, out=Watched(), err=Watched(), **kw)
        made.append(step)
        return step

    yield make
    for step in made:
        step.close()


def test_sattach_gets_the_output_kept_then_live_labelled_and_exits_with_the_worst_code(
    hub: Callable[..., StepIO],
) -> None:
    step = hub()
    t0, t1 = Task(step, 0), Task(step, 1)
    e1 = Task(step, 1, "err")
    step.expect([0, 1])
    t0.print(b"before 0\n")
    step.out.wait_for(b"before 0\n")  # type: ignore[attr-defined]
    a = Attached(step, ["-l"], [0, 1])
    a.out.wait_for(b"0: before 0\n")  # what srun kept, as slurmstepd replays it
    t1.print(b"after 1\npart")
    e1.print(b"oops 1\n")
    a.out.wait_for(b"1: after 1\n")
    a.err.wait_for(b"1: oops 1\n")
    exit_record(step, 0, exit_code=0)
    exit_record(step, 1, exit_code=3)
    a.err.wait_for(b"sattach: error: task 1 exited with exit code 3\n")
    for t in (t0, t1, e1):
        t.sock.close()
    step.close()  # srun is done with the step: the client gets its end
    assert a.wait() == 3
    assert a.out.getvalue() == b"0: before 0\n1: after 1\n1: part\n"
    assert b"task 0" not in a.err.getvalue()


def test_output_filters_apply_locally_and_stderr_follows_stdout(
    hub: Callable[..., StepIO],
) -> None:
    step = hub()
    tasks = [(Task(step, t), Task(step, t, "err")) for t in (0, 1)]
    step.expect([0, 1])
    a = Attached(step, ["--output-filter=1"], [0, 1])
    for t, (out, err) in enumerate(tasks):
        out.print(f"out {t}\n".encode())
        err.print(f"err {t}\n".encode())
    a.out.wait_for(b"out 1\n")
    a.err.wait_for(b"err 1\n")
    step.out.wait_for(b"out 0\n")  # type: ignore[attr-defined]
    step.err.wait_for(b"err 0\n")  # type: ignore[attr-defined]
    for t in (0, 1):
        exit_record(step, t, exit_code=0)
    step.close()
    assert a.wait() == 0
    assert (a.out.getvalue(), a.err.getvalue()) == (b"out 1\n", b"err 1\n")


def test_stdin_from_srun_and_sattach_reaches_the_tasks_and_ends_with_srun_s(
    hub: Callable[..., StepIO],
) -> None:
    srun_r, srun_w = os.pipe()
    step = hub(stdin=srun_r)
    t0, t1 = Task(step, 0), Task(step, 1)
    step.expect([0, 1])
    os.write(srun_w, b"from srun\n")
    assert t0.read_until(b"from srun\n") and t1.read_until(b"from srun\n")
    a = Attached(step, [], [0, 1])
    one = Attached(step, ["--input-filter=1"], [0, 1])
    a.type(b"from sattach\n")
    assert t0.read_until(b"from sattach\n") and t1.read_until(b"from sattach\n")
    one.type(b"to one\n")
    assert t1.read_until(b"to one\n")
    os.write(srun_w, b"mark\n")
    assert t0.read_until(b"mark\n") == b"from srun\nfrom sattach\nmark\n"  # not "to one"
    os.close(srun_w)  # srun's stdin ends: so does every task's
    assert t0.read_until(b"never") == b"" and t1.read_until(b"never") == b""
    for t in (0, 1):
        exit_record(step, t, exit_code=0)
    step.close()
    assert a.wait() == 0 and one.wait() == 0
    os.close(srun_r)


def test_a_sattach_end_of_input_ends_the_tasks_input_and_one_killed_changes_nothing(
    hub: Callable[..., StepIO],
) -> None:
    srun_r, srun_w = os.pipe()
    step = hub(stdin=srun_r)
    t0, t1 = Task(step, 0), Task(step, 1)
    step.expect([0, 1])
    # a client that goes away without an end of input (killed): the tasks' stdin stays open
    gone = socket.create_connection(("127.0.0.1", step.port), timeout=DEADLINE)
    gone.sendall(f"{attach_token(step.cookie)} - attach\n".encode())
    hello = attach.read_frame(gone)
    assert hello is not None and hello[0] == b"h" and json.loads(hello[2])["stdin"] is True
    gone.sendall(attach.frame(b"i", 0, b"half"))
    gone.close()
    assert t0.read_until(b"half") == b"half"
    os.write(srun_w, b" still open\n")
    assert t0.read_until(b"still open\n") and t1.read_until(b"still open\n")
    # --input-filter=0 and its end of input: task 0's stdin ends, task 1's does not
    a = Attached(step, ["--input-filter=0"], [0, 1])
    a.type(b"last\n")
    a.end_input()
    assert t0.read_until(b"never") == b""
    os.write(srun_w, b"more\n")
    assert t1.read_until(b"more\n").endswith(b"still open\nmore\n")
    os.close(srun_w)
    for t in (0, 1):
        exit_record(step, t, exit_code=0)
    step.close()
    assert a.wait() == 0
    os.close(srun_r)


def test_a_step_whose_tasks_have_ended_has_nothing_to_attach_to(
    hub: Callable[..., StepIO],
) -> None:
    step = hub()
    Task(step, 0)
    step.expect([0])
    exit_record(step, 0, exit_code=5)
    with step.cond:
        assert step.cond.wait_for(lambda: 0 in step.exits, DEADLINE)
    a = Attached(step, [], [0])
    assert a.wait() == 0  # the exit came before: it does not count, as under Slurm
    assert a.err.getvalue() == b"sattach: Node node01: no tasks running\n"
    q = Attached(step, ["-Q"], [0])
    assert q.wait() == 0 and q.err.getvalue() == b""


def test_a_wrong_token_or_the_cookie_itself_attaches_to_nothing(
    hub: Callable[..., StepIO],
) -> None:
    step = hub()
    Task(step, 0)
    step.expect([0])
    for token in ("0" * 64, step.cookie):
        with socket.create_connection(("127.0.0.1", step.port), timeout=DEADLINE) as s:
            s.sendall(f"{token} - attach\n".encode())
            assert s.recv(100) == b""  # hung up on, having said nothing


def test_a_client_that_does_not_read_is_dropped_and_the_step_goes_on(
    hub: Callable[..., StepIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attach, "QUEUE_LIMIT", 64 * 1024)
    step = hub()
    t0 = Task(step, 0)
    step.expect([0])
    stuck = socket.create_connection(("127.0.0.1", step.port), timeout=DEADLINE)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(f"{attach_token(step.cookie)} - attach\n".encode())
    line = b"x" * 1023 + b"\n"
    for _ in range(4096):  # 4 MiB: far past what the client's socket and queue hold
        t0.print(line)
    step.out.wait_for(line * 2)  # type: ignore[attr-defined]
    with step.out.cond:  # type: ignore[attr-defined]
        assert step.out.cond.wait_for(  # type: ignore[attr-defined]
            lambda: len(step.out.getvalue()) == 4096 * 1024,
            DEADLINE,  # type: ignore[attr-defined]
        )
    with step.hub.lock:
        assert step.hub.clients == [] or all(c.dropped for c in step.hub.clients)
    stuck.close()


def test_a_pty_steps_terminal_output_is_task_0s_and_sattach_types_into_it(
    hub: Callable[..., StepIO],
) -> None:
    """srun --pty: task 0's terminal connection carries frames to it (the window size, keys)
    and raw output from it (agent/ptys.py); sattach sees that output as task 0's and its
    input goes to the terminal as keys."""
    from phalanx.slurm.srun import pty_relay

    keys_r, keys_w = os.pipe()  # srun's own stdin: nothing typed there
    screen_r, screen_w = os.pipe()  # srun's own stdout
    term = pty_relay.Terminal(stdin=keys_r, stdout=screen_w)
    step = hub(pty=term)
    task = Task(step, 0, "pty")
    step.expect([0])
    size = attach.read_exactly(task.sock, pty_relay.HEADER.size)
    assert size is not None and pty_relay.HEADER.unpack(size)[0] == b"w"
    _kind, length = pty_relay.HEADER.unpack(size)
    assert attach.read_exactly(task.sock, length)
    task.print(b"$ ")
    a = Attached(step, [], [0])
    a.out.wait_for(b"$ ")
    a.type(b"ls\n")
    head = attach.read_exactly(task.sock, pty_relay.HEADER.size)
    assert head is not None and pty_relay.HEADER.unpack(head) == (b"d", 3)
    assert attach.read_exactly(task.sock, 3) == b"ls\n"
    task.print(b"file\n")
    a.out.wait_for(b"$ file\n")
    assert os.read(screen_r, 100).startswith(b"$ ")  # srun's terminal has it too
    exit_record(step, 0, exit_code=0)
    task.sock.close()
    step.close()
    assert a.wait() == 0
    for fd in (keys_w, screen_r, screen_w):  # keys_r: srun's key pump reads it to its end
        os.close(fd)


def test_sattach_pty_holds_its_terminal_raw_while_attached_and_puts_it_back(
    hub: Callable[..., StepIO],
) -> None:
    import termios

    step = hub()
    task = Task(step, 0)
    step.expect([0])
    task.print(b"x\n")
    step.out.wait_for(b"x\n")  # type: ignore[attr-defined]
    master, slave = os.openpty()
    before = termios.tcgetattr(slave)
    info = {
        "nodes": ["node01"],
        "task_ids": [[0]],
        "attach": {"host": "127.0.0.1", "port": step.port, "token": attach_token(step.cookie)},
    }
    out = Watched()
    session = sattach.Session(
        sattach.options(["--pty", "9.0"]), info, out=out, err=Watched(), stdin=slave
    )
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(session.run()), daemon=True)
    thread.start()
    out.wait_for(b"x\n")  # attached: the terminal is raw meanwhile
    assert not termios.tcgetattr(slave)[3] & (termios.ICANON | termios.ECHO | termios.ISIG)
    exit_record(step, 0, exit_code=0)
    step.close()
    thread.join(DEADLINE)
    assert done == [0]
    assert termios.tcgetattr(slave) == before
    os.close(master)
    os.close(slave)
