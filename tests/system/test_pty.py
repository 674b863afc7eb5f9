"""`srun --pty`: an interactive shell on a job's node, driven through a real terminal.

The test is the user at a terminal: it opens a pty, runs the installed `srun --pty bash` with
the pty's other end as its terminal (its controlling terminal, so a resize sends srun SIGWINCH
as a terminal emulator's would), types commands, and reads what comes back. It checks that the
remote shell has a terminal (`tty`), that typing is echoed and ^C interrupts the remote command,
that the window size reaches the task (`stty size`) and follows a resize, that srun exits with
the task's exit code, and that srun's terminal is raw while the step runs and exactly as before
afterwards (also when srun is ended by SIGHUP).
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from system.harness import Cluster, wait_for

pytestmark = pytest.mark.system

BIN = str(Path(sys.executable).parent)  # where srun, sbatch, ... are installed
PROMPT = b"PHX-PROMPT> "


def _take_terminal() -> None:
    """In srun's child (after setsid): stdin, the test's pty, becomes its controlling tty."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Screen:
    """The test's terminal: a pty whose other end is srun's stdin, stdout and stderr."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, rows: int, cols: int):
        self.master, self.slave = os.openpty()
        self.resize(rows, cols)
        self.before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen(
            argv,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_take_terminal,
        )
        self.seen = b""  # everything read, for failure messages
        self.buf = b""

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: bytes, timeout: float = 90.0) -> re.Match[bytes] | None:
        """Read until `pattern` (a regex) shows; consume through it. None at the deadline."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.buf)
            if m:
                self.buf = self.buf[m.end() :]
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                data = os.read(self.master, 65536)
                self.buf += data
                self.seen += data

    def must(self, pattern: bytes, timeout: float = 90.0) -> re.Match[bytes]:
        m = self.expect(pattern, timeout)
        assert m is not None, (pattern, self.seen[-2000:])
        return m

    def mode(self) -> list:
        return termios.tcgetattr(self.slave)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


def user_env(cluster: Cluster) -> dict[str, str]:
    """A user's shell on a cluster host: the node's credential socket, the commands on PATH."""
    return cluster.env(
        PHALANX_URL=cluster.url,
        PHALANX_AUTH_SOCKET=str(cluster.agent_socket("node01")),
        PATH=f"{BIN}:{os.environ['PATH']}",
        PS1=PROMPT.decode(),
        TERM="xterm",
    )


def run_command(cluster: Cluster, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """One installed command (`sstat`, `sreport`, ...) run in a user's shell (`user_env`)."""
    return subprocess.run(
        [f"{BIN}/{command}", *args],
        env=user_env(cluster),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def is_raw(mode: list) -> bool:
    return not mode[3] & (termios.ICANON | termios.ECHO | termios.ISIG)


@pytest.mark.timeout(300)
def test_srun_pty_outside_an_allocation_is_an_interactive_shell(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=1, cpus=2)
    argv = [f"{BIN}/srun", "-n", "2", "--pty", "bash", "--norc", "--noprofile"]
    screen = Screen(argv, user_env(cluster), tmp_path, rows=30, cols=100)
    try:
        assert not is_raw(screen.before)
        screen.must(PROMPT, timeout=150)  # the job is scheduled, task 0's shell prompts
        assert is_raw(screen.mode()), "srun's terminal is not raw while the step runs"
        # a terminal, echo, the window size srun had, task 0 of two
        screen.send("tty; stty size; echo $((6*7)) task=$SLURM_PROCID of $SLURM_NTASKS\r")
        screen.must(rb"tty; stty size; echo")  # echoed as typed
        screen.must(rb"/dev/pts/\d+\r\n")
        screen.must(rb"30 100\r\n")
        screen.must(rb"42 task=0 of 2\r\n")
        screen.must(PROMPT)
        # ^C is a key for the remote terminal: it interrupts the remote command only
        # (once the command runs in the foreground: it says so, the typed line shows RE""ADY)
        screen.send("""sh -c 'echo RE""ADY; exec sleep 300'\r""")
        screen.must(rb"READY\r\n")
        screen.send("\x03")
        screen.must(PROMPT, timeout=30)
        screen.send("echo after=$?\r")
        screen.must(rb"after=130\r\n")
        screen.must(PROMPT)
        # a resize reaches the task (SIGWINCH to srun, the new size to the remote pty)
        screen.resize(40, 120)
        for _ in range(10):  # the resize and the keys race: ask until the new size shows
            screen.send("stty size\r")
            m = screen.must(rb"(\d+ \d+)\r\n")
            screen.must(PROMPT)
            if m.group(1) == b"40 120":
                break
        else:
            raise AssertionError(f"the new window size never reached the task: {screen.seen!r}")
        # the task's exit code is srun's; the terminal is as it was
        screen.send("exit 3\r")
        assert screen.proc.wait(timeout=60) == 3, screen.seen[-2000:]
        assert screen.mode() == screen.before
    finally:
        screen.close()


@pytest.mark.timeout(300)
def test_srun_pty_in_a_running_job_and_terminal_restored_on_sighup(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=1, cpus=2)
    env = user_env(cluster)
    r = subprocess.run(
        [f"{BIN}/sbatch", "--parsable", "--wrap", "sleep 600"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    jid = int(r.stdout.strip())
    client = cluster.client()
    wait_for(lambda: client.job(jid)[0]["state"] == "RUNNING", what="the job to run", timeout=120)
    # a shell in the running job (Slurm's `srun --jobid=N --pty bash`): a step of that job
    argv = [f"{BIN}/srun", f"--jobid={jid}", "--pty", "bash", "--norc", "--noprofile"]
    screen = Screen(argv, env, tmp_path, rows=25, cols=90)
    try:
        screen.must(PROMPT, timeout=120)
        screen.send("echo job=$SLURM_JOB_ID step=$SLURM_STEP_ID; tty; stty size\r")
        screen.must(rb"job=%d step=0\r\n" % jid)
        screen.must(rb"/dev/pts/\d+\r\n")
        screen.must(rb"25 90\r\n")
        screen.must(PROMPT)
        assert is_raw(screen.mode())
        # the terminal closes under srun: it puts the terminal back and exits 128+SIGHUP
        screen.proc.send_signal(signal.SIGHUP)
        assert screen.proc.wait(timeout=60) == 128 + signal.SIGHUP
        assert screen.mode() == screen.before
        # the remote shell has lost its terminal (hung up): the step ends, the job runs on
        wait_for(
            lambda: [s["state"] for s in client.job(jid)[0]["steps"]] not in ([], ["RUNNING"]),
            what="the step to end",
            timeout=90,
        )
        assert client.job(jid)[0]["state"] == "RUNNING"
    finally:
        screen.close()
        client.cancel([str(jid)])
