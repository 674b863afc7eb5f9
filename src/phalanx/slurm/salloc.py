"""``salloc``: an allocation, a command (by default the user's shell) run with it here, the
allocation released when the command ends, as Slurm's salloc does.

The allocation is a job like any other (every sbatch option is taken: ``-N``, ``-n``,
``--gres``, ``-t``, ``-p`` ...) whose batch script only holds it: it waits, and ends with
status 0 when salloc releases it, so ``sacct`` shows a released allocation COMPLETED as
Slurm does.  Once the job runs, the command runs on this host with the allocation's
``SLURM_*`` variables (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ...), so
``srun`` inside it starts steps in the allocation.  salloc's exit status is the command's.

salloc's own options: ``--no-shell`` (allocate, print the id, exit: the allocation stays
until ``scancel`` or its time limit), ``-K/--kill-command[=SIGNAL]`` (the signal the command
gets when the allocation ends under it; default SIGHUP), ``-Q/--quiet`` (no ``salloc:``
lines but errors), ``--bell``/``--no-bell`` (accepted, no effect).

Where Phalanx differs from Slurm on purpose: when the allocation ends under the command (its
time limit, a node failure, ``scancel``), Slurm's salloc says so and leaves the command
running unless ``-K`` was given; Phalanx's sends it the kill-command signal (SIGHUP by default,
as a closed terminal does) and SIGKILL after ``KILL_GRACE_S``, so a shell never goes on
believing it holds nodes.  If salloc itself is killed (SIGKILL), its allocation is held until
``scancel`` or the time limit, as Slurm's is until its controller notices.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from phalanx.domain.layout import compress_counts, tasks_per_node
from phalanx.slurm.common import TERMINAL_STATES, SlurmUsageError, client, run_command
from phalanx.slurm.scancel import parse_signal

PROG = "salloc"
DEFAULT_NAME = "interactive"  # Slurm 22.05's name for a salloc job (no-shell with --no-shell)
# the allocation's batch script: hold the nodes until released (SIGTERM: exit 0)
HOLD_SCRIPT = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"
WATCH_S = 1.0  # how often salloc checks that the allocation is still running
PENDING_SAY_S = 1.0  # a job not running after this long is reported pending (Slurm's lines)
KILL_GRACE_S = 10.0  # after the kill-command signal, how long the command has before SIGKILL

HELP = """Usage: salloc [OPTIONS...] [command [args...]]

Obtains a Phalanx job allocation, runs the command (default: your shell) on this host with it,
and releases it when the command ends. Options are sbatch's (-N, -n, -c, --mem, --gres, -t,
-p, -J ...). Also:
  --no-shell              allocate, print the job id and exit (release it with scancel)
  -K, --kill-command[=SIG]  signal for the command if the allocation ends under it (HUP)
  -Q, --quiet             print errors only
"""


@dataclass
class SallocFlags:
    no_shell: bool = False
    quiet: bool = False
    kill_signal: int = signal.SIGHUP


def split_salloc_flags(argv: list[str]) -> tuple[SallocFlags, list[str], list[str]]:
    """(salloc's flags, the allocation's sbatch options, the command) from the arguments."""
    from phalanx.domain.directives import split_cli_args

    opts, command = split_cli_args(argv)
    flags = SallocFlags()
    kept: list[str] = []
    for token in opts:
        if token == "--no-shell":
            flags.no_shell = True
        elif token in ("-Q", "--quiet"):
            flags.quiet = True
        elif token in ("--bell", "--no-bell"):
            pass
        elif token in ("-K", "--kill-command"):
            flags.kill_signal = signal.SIGTERM  # Slurm's default for a bare -K
        elif token.startswith("--kill-command="):
            flags.kill_signal = parse_signal(token.partition("=")[2])
        elif token.startswith("-K") and not token.startswith("--"):
            flags.kill_signal = parse_signal(token[2:])
        else:
            kept.append(token)
    return flags, kept, command


def allocation_environment(
    job: dict[str, Any], spec: dict[str, Any], cluster: str, cwd: str
) -> dict[str, str]:
    """The ``SLURM_*`` variables salloc gives its command (Slurm's names and forms), from the
    running allocation's record and the spec salloc submitted."""
    nodes = int(job.get("nodes_alloc") or job.get("nodes") or 1)
    ntasks, per_node = spec.get("ntasks"), spec.get("ntasks_per_node")
    try:
        counts = tasks_per_node(
            nodes,
            ntasks=int(ntasks) if ntasks is not None else None,
            ntasks_per_node=int(per_node) if per_node is not None else None,
        )
    except ValueError:
        counts = [1] * nodes
    cpus = int(job.get("cpus_per_node") or 1)
    hostlist = str(job.get("nodelist") or "")
    env = {
        "SLURM_JOB_ID": str(job["id"]),
        "SLURM_JOBID": str(job["id"]),
        "SLURM_JOB_NAME": str(job.get("name") or DEFAULT_NAME),
        "SLURM_JOB_NODELIST": hostlist,
        "SLURM_NODELIST": hostlist,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_CPUS_PER_NODE": compress_counts([cpus] * nodes),
        "SLURM_TASKS_PER_NODE": compress_counts(counts),
        "SLURM_JOB_PARTITION": str(job.get("partition") or ""),
        "SLURM_CLUSTER_NAME": cluster,
        "SLURM_SUBMIT_DIR": cwd,
        "SLURM_SUBMIT_HOST": socket.gethostname().split(".")[0],
    }
    if ntasks is not None:
        env["SLURM_NTASKS"] = env["SLURM_NPROCS"] = str(sum(counts))
    if spec.get("cpus_per_task"):
        env["SLURM_CPUS_PER_TASK"] = str(int(spec["cpus_per_task"]))
    if job.get("mem_per_node_mb"):
        env["SLURM_MEM_PER_NODE"] = str(int(job["mem_per_node_mb"]))
    return env


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _say(flags: SallocFlags, text: str) -> None:
    if not flags.quiet:
        sys.stderr.write(f"{PROG}: {text}\n")
        sys.stderr.flush()


def _main(argv: list[str]) -> int:
    if argv[:1] in (["--help"], ["-h"], ["--usage"]):
        sys.stdout.write(HELP)
        return 0
    from phalanx.submitting import build_spec

    flags, opts, command = split_salloc_flags(argv)
    spec, warnings, _ = build_spec([*opts, f"--wrap={HOLD_SCRIPT}", "--output=/dev/null"])
    if spec.get("name") in (None, "", "wrap"):
        spec["name"] = "no-shell" if flags.no_shell else DEFAULT_NAME
    for w in warnings:
        sys.stderr.write(f"{PROG}: warning: {w}\n")
    if not command and not flags.no_shell:
        command = [os.environ.get("SHELL") or "/bin/sh"]
    with client() as c:
        jid = int(c.submit(spec)["job_id"])
        try:
            job = _wait_running(c, jid, flags)
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):
                c.cancel([jid], reason="salloc interrupted while pending")
            sys.stderr.write(f"{PROG}: Job aborted due to signal\n")
            return 1
        if job is None:
            sys.stderr.write(f"{PROG}: Job allocation {jid} has been revoked.\n")
            return 1
        _say(flags, f"Granted job allocation {jid}")
        if flags.no_shell:
            return 0
        try:
            cluster = str(c.get("/v1/whoami").get("cluster") or "phalanx")
            env = {**os.environ, **allocation_environment(job, spec, cluster, os.getcwd())}
            code = _run_with_allocation(c, jid, command, env, flags)
        except KeyboardInterrupt:  # ^C before the command took the terminal
            sys.stderr.write(f"{PROG}: Job aborted due to signal\n")
            code = 1
        finally:
            _say(flags, f"Relinquishing job allocation {jid}")
            _release(c, jid)
    return code


def _wait_running(c: Any, jid: int, flags: SallocFlags) -> dict[str, Any] | None:
    """The allocation's record once it runs; None if it ended first."""
    delay, said, start = 0.1, False, time.monotonic()
    while True:
        job = c.job(jid)[0]
        if job["state"] == "RUNNING":
            if said:
                _say(flags, f"job {jid} has been allocated resources")
            return dict(job)
        if job["state"] in TERMINAL_STATES:
            return None
        if not said and time.monotonic() - start >= PENDING_SAY_S:
            _say(flags, f"Pending job allocation {jid}")
            _say(flags, f"job {jid} queued and waiting for resources")
            said = True
        time.sleep(delay)
        delay = min(delay * 2, WATCH_S)


def _run_with_allocation(
    c: Any, jid: int, command: list[str], env: dict[str, str], flags: SallocFlags
) -> int:
    """Run the command in its own process group (the terminal's foreground one, when there
    is a terminal); if the allocation ends first, signal it.  Its exit status, Slurm's way."""
    tty = _terminal()

    def own_group() -> None:  # in the child, before exec: no window where it reads the
        os.setpgid(0, 0)  # terminal from the background (and stops on SIGTTIN)
        if tty is not None:
            _give_terminal(tty, os.getpgrp())

    try:
        # one thread only here (the watcher starts after): preexec_fn is safe
        proc = subprocess.Popen(command, env=env, preexec_fn=own_group)
    except OSError as e:
        raise SlurmUsageError(f"cannot run {command[0]}: {e.strerror or e}") from None
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_S):
            try:
                state = c.job(jid)[0]["state"]
            except Exception:  # the controllers are unreachable for now: the next check
                continue
            if state != "RUNNING" and not done.is_set():
                sys.stderr.write(f"{PROG}: Job allocation {jid} has been revoked.\n")
                _signal_group(proc.pid, flags.kill_signal)
                if not done.wait(KILL_GRACE_S):
                    _signal_group(proc.pid, signal.SIGKILL)
                return

    watcher = threading.Thread(target=watch, name="salloc-watch", daemon=True)
    watcher.start()
    # signals meant for the command (a terminal's go to its group already) are passed on
    previous = {
        s: signal.signal(s, lambda n, _f: _signal_group(proc.pid, n))
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    }
    try:
        status = proc.wait()
    finally:
        done.set()
        watcher.join()  # its client is the one the release uses next: one thread at a time
        for s, h in previous.items():
            signal.signal(s, h)
        if tty is not None:
            _give_terminal(tty, os.getpgrp())
    if status < 0:
        return 128 - status
    return status


def _release(c: Any, jid: int) -> None:
    """End the allocation: SIGTERM to its holding script (it exits 0: COMPLETED); a job
    that is not running any more is left as it ended."""
    with contextlib.suppress(Exception):
        result = c.signal([jid], signal.SIGTERM, target="batch")
        if str(result.get(str(jid))) != "signalled":
            c.cancel([jid], reason="salloc released its allocation")


def _terminal() -> int | None:
    """stdin's descriptor when it is this process's controlling terminal and salloc runs in
    the foreground (then the command gets the terminal), else None."""
    try:
        if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
            return 0
    except OSError:
        pass
    return None


def _give_terminal(fd: int, pgid: int) -> None:
    """Make `pgid` the terminal's foreground process group (SIGTTOU ignored meanwhile)."""
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(fd, pgid)
    finally:
        signal.signal(signal.SIGTTOU, old)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
