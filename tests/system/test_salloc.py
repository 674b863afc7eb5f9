"""salloc end to end (slurm/salloc.py): an allocation on a real local cluster, a command (or an
interactive shell in a pseudo-terminal) run with it, srun inside it, the allocation released
when the command ends, and the command stopped when the allocation ends under it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, wait_for
from system.test_pty import BIN, Screen, user_env

pytestmark = pytest.mark.system

SALLOC = [sys.executable, "-m", "phalanx.slurm", "salloc"]
SRUN = f"{BIN}/srun"


def _granted(stderr: str) -> int:
    m = re.search(r"^salloc: Granted job allocation (\d+)$", stderr, re.M)
    assert m, stderr
    return int(m.group(1))


@pytest.mark.timeout(300)
def test_salloc_runs_the_command_with_the_allocation_and_releases_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=2, cpus=2)
    inner = (
        'echo "id=$SLURM_JOB_ID nodes=$SLURM_NNODES list=$SLURM_JOB_NODELIST '
        'tasks=$SLURM_TASKS_PER_NODE name=$SLURM_JOB_NAME"; '
        f'{SRUN} -N 2 bash -c "echo step on \\$SLURMD_NODENAME" | sort; exit 4'
    )
    p = subprocess.run(
        [*SALLOC, "-N", "2", "bash", "-c", inner],
        env=user_env(cluster),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    jid = _granted(p.stderr)
    assert p.returncode == 4, (p.stdout, p.stderr)  # the command's status is salloc's
    lines = p.stdout.splitlines()
    assert lines[0] == f"id={jid} nodes=2 list=node[01-02] tasks=1(x2) name=interactive", lines
    assert lines[1:] == ["step on node01", "step on node02"], lines  # srun used the allocation
    assert p.stderr.splitlines()[-1] == f"salloc: Relinquishing job allocation {jid}", p.stderr
    # released, not cancelled: the allocation ends COMPLETED, as Slurm's does
    assert cluster.wait_terminal([jid])[jid]["state"] == "COMPLETED"


@pytest.mark.timeout(300)
def test_salloc_no_shell_keeps_the_allocation_and_bad_options_are_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=1, cpus=2)
    env = user_env(cluster)
    p = subprocess.run(
        [*SALLOC, "--no-shell", "-J", "held"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    jid = _granted(p.stderr)
    assert p.returncode == 0 and p.stdout == "", (p.stdout, p.stderr)
    job = cluster.client().job(jid)[0]
    assert job["state"] == "RUNNING" and job["name"] == "held", job
    cluster.client().cancel([jid])
    for argv, words in (
        (["--time=soon", "true"], "time"),
        (["--kill-command=NOTASIG", "true"], "Invalid job signal"),
        (["--no-such-option", "true"], "no-such-option"),
    ):
        p = subprocess.run(
            [*SALLOC, *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 1 and "Traceback" not in p.stderr, (argv, p.stderr)
        assert p.stderr.startswith("salloc: ") and words in p.stderr, (argv, p.stderr)


@pytest.mark.timeout(300)
def test_the_command_is_stopped_when_the_allocation_ends_under_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """scancel (as a time limit or a node failure would): salloc says the allocation is
    revoked and the command gets SIGHUP, so nothing goes on believing it holds nodes."""
    cluster.start(nodes=1, cpus=2)
    marker, started = tmp_path / "hup", tmp_path / "started"
    command = f"trap 'echo hup > {marker}; exit 9' HUP; touch {started}; sleep 300 & wait"
    proc = subprocess.Popen(
        [*SALLOC, "bash", "-c", command],
        env=user_env(cluster),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(started.exists, what="the command to run in the allocation")
        (job,) = cluster.client().jobs()
        jid = int(job["id"])
        cluster.client().cancel([jid])
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"salloc: Job allocation {jid} has been revoked." in err, err
    assert marker.read_text() == "hup\n"
    assert proc.returncode == 9, (out, err)


def _session(sid: int) -> list[tuple[int, str, int, int]]:
    """(pid, command, process group, the terminal's foreground group) of the processes of
    session `sid`, from /proc/PID/stat."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        # after the command: state, ppid, pgrp, session, tty_nr, tpgid
        if int(fields[3]) == sid:
            out.append((int(stat.parent.name), comm, int(fields[2]), int(fields[5])))
    return out


def _masks(sid: int) -> dict[int, tuple[str, str, str]]:
    """The session's processes: command, blocked and ignored signals (/proc/PID/status)."""
    out = {}
    for pid, comm, _, _ in _session(sid):
        try:
            status = dict(
                line.split(":\t", 1)
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
        except (OSError, ValueError):
            continue
        out[pid] = (comm, status.get("SigBlk", "?"), status.get("SigIgn", "?"))
    return out


def _foreground_sleep(sid: int) -> bool:
    """True once a `sleep` of session `sid` is its terminal's foreground group; else the
    session's processes, raised for wait_for's failure message."""
    procs = _session(sid)
    if any(comm == "sleep" and pgrp == tpgid for _, comm, pgrp, tpgid in procs):
        return True
    raise LookupError(f"(pid, command, pgrp, foreground pgrp): {procs}")


@pytest.mark.timeout(300)
def test_salloc_without_a_command_is_an_interactive_shell(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=1, cpus=2)
    env = {**user_env(cluster), "SHELL": "/bin/bash", "HOME": str(tmp_path)}  # no ~/.bashrc
    screen = Screen([*SALLOC, "-J", "shell"], env, tmp_path, rows=30, cols=100)
    try:
        m = screen.must(rb"Granted job allocation (\d+)")
        jid = int(m.group(1))
        screen.must(rb"[#$>] ")  # the shell's prompt (Debian's bash.bashrc sets its own)
        # the shell owns the terminal: it reads what is typed, and ^C goes to it, not salloc
        started = tmp_path / "sleeping"
        screen.send(f"sh -c 'touch {started}; exec sleep 100'\n")
        wait_for(started.exists, what="the shell to run sleep")
        # ^C goes to the terminal's foreground process group: send it once the sleep is that
        # group (the marker alone came a moment before; two suite runs in three lost the ^C)
        wait_for(
            lambda: _foreground_sleep(screen.proc.pid),
            what="sleep 100 to be the terminal's foreground group",
        )
        screen.send("\x03")  # ends the sleep; salloc and the allocation stay
        if screen.expect(rb"[#$>] ") is None:
            raise AssertionError(f"^C did not end the sleep: {_masks(screen.proc.pid)}")
        screen.send('echo "in $SLURM_JOB_ID as $SLURM_JOB_NAME"\n')
        screen.must(f"in {jid} as shell".encode())
        assert cluster.client().job(jid)[0]["state"] == "RUNNING"
        screen.send("exit 3\n")
        screen.must(f"Relinquishing job allocation {jid}".encode())
        assert screen.proc.wait(timeout=60) == 3
    finally:
        screen.close()
    assert cluster.wait_terminal([jid])[jid]["state"] == "COMPLETED"
