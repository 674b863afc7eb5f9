"""The task side of `srun --pty` (agent/ptys.py) on real ptys and sockets, and the shepherd's
rule for `--signal` without `B:` (steps running here take it) on real directories."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from phalanx.agent import ptys, shepherd_files, shepherd_stop


def frame(kind: bytes, payload: bytes) -> bytes:
    return ptys.HEADER.pack(kind, len(payload)) + payload


def test_frames_carry_keys_and_window_sizes_and_wait_for_the_rest() -> None:
    master, slave = os.openpty()
    try:
        inbox = bytearray(frame(b"w", b"33 77") + frame(b"d", b"ls\r") + frame(b"d", b"xy")[:6])
        to_master = bytearray()
        ptys._frames(inbox, to_master, master)
        assert os.get_terminal_size(slave) == os.terminal_size((77, 33))
        assert bytes(to_master) == b"ls\r"
        assert bytes(inbox) == frame(b"d", b"xy")[:6]  # incomplete: kept for the next read
        inbox += frame(b"d", b"xy")[6:]
        ptys._frames(inbox, to_master, master)
        assert bytes(to_master) == b"ls\rxy" and not inbox
        # a malformed size is ignored, never applied
        ptys._frames(bytearray(frame(b"w", b"big x")), to_master, master)
        assert os.get_terminal_size(slave) == os.terminal_size((77, 33))
    finally:
        os.close(master)
        os.close(slave)


def _read_until(sock: socket.socket, want: bytes) -> bytes:
    data = b""
    while want not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_relay_copies_both_ways_and_ends_when_the_task_closes_its_terminal() -> None:
    master, slave = os.openpty()
    ours, theirs = socket.socketpair()
    ours.settimeout(30)
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(ptys.relay(master, theirs)), daemon=True)
    t.start()
    # the task writes: srun receives (the pty's output processing turns \n into \r\n)
    os.write(slave, b"hello\n")
    assert _read_until(ours, b"hello\r\n").endswith(b"hello\r\n")
    # srun types: the task reads it (a whole line: the terminal is in canonical mode)
    ours.sendall(frame(b"d", b"typed\n"))
    got = b""
    while b"\n" not in got:
        got += os.read(slave, 100)
    assert got == b"typed\n"
    # the task ends (its terminal closes): the rest arrives, then srun sees the end
    os.write(slave, b"bye\n")
    os.close(slave)
    rest = b""
    while chunk := ours.recv(4096):
        rest += chunk
    assert rest.endswith(b"bye\r\n"), rest
    t.join(30)
    assert done == [0]
    ours.close()


def test_relay_hangs_the_terminal_up_when_srun_goes_away() -> None:
    master, slave = os.openpty()
    ours, theirs = socket.socketpair()
    t = threading.Thread(target=ptys.relay, args=(master, theirs), daemon=True)
    t.start()
    ours.close()
    t.join(30)
    assert not t.is_alive()
    try:  # the master is closed: reading the task's end reports the hang-up
        data = os.read(slave, 10)
    except OSError:
        data = b""
    assert data == b""
    os.close(slave)


def test_steps_running_rule(tmp_path: Path) -> None:
    """The batch shepherd leaves `--signal` to the steps while one of its attempt's step tasks
    here has not ended, or one already got it; otherwise the batch process group gets it."""
    steps, job = tmp_path / "steps", tmp_path / "tasks" / "7"
    steps.mkdir()
    job.mkdir(parents=True)
    spec = {"attempt_id": 7, "steps_dir": str(steps)}
    assert not shepherd_stop._steps_running(spec, str(job))
    (steps / "8.0.0").mkdir()  # another attempt's step
    assert not shepherd_stop._steps_running(spec, str(job))
    (steps / "7.0.0").mkdir()  # ours, not ended (starting or running)
    assert shepherd_stop._steps_running(spec, str(job))
    (steps / "7.0.0" / shepherd_files.EXIT_FILE).write_text("{}")
    assert not shepherd_stop._steps_running(spec, str(job))
    # a step task that got the signal itself (and may have exited on it) says so
    shepherd_stop._mark_steps_signalled({"job_dir": str(job)})
    assert shepherd_stop._steps_running(spec, str(job))
    # a step task never defers to anything (it is a step); a spec without steps_dir neither
    assert not shepherd_stop._steps_running({**spec, "step_id": 0}, str(job))
    assert not shepherd_stop._steps_running({"attempt_id": 7}, str(job))
