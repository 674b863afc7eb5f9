"""``scancel``: cancel jobs, or with ``--signal`` only signal them, as Slurm does.

Ids are Slurm's: ``12``, ``12_3``, ``12_[1-3]``, ``12_[1,3-5]`` (an array id alone means every
task). Filters (``-u``, ``-t``, ``-p``, ``-n``) select the caller's visible active jobs, alone
or narrowing the listed ids. Errors are Slurm's lines with exit code 1:
``scancel: error: Kill job error on job id 99: Invalid job id specified``.

``--signal`` never ends a job: without ``--batch``/``--full`` it goes to the job's steps only
(not the batch shell), ``--batch`` to the batch shell only, ``--full`` to the batch shell, its
children and every step. A pending job is refused ("Job is pending execution"), a finished or
completing one too ("Job/step already completing or completed"). SIGKILL is a cancel.
"""

from __future__ import annotations

import re
import signal as _signal
import sys
from typing import Any

from phalanx.errors import NotFound
from phalanx.slurm.common import (
    SlurmParser,
    SlurmUsageError,
    add_clusters,
    check_clusters,
    client,
    parse_states,
    phalanx_states,
    refuse,
    run_command,
    split_list,
)

PROG = "scancel"
INVALID = "Invalid job id specified"
PENDING = "Job is pending execution"
DONE = "Job/step already completing or completed"
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"}
_ID_RE = re.compile(r"^(\d+)(?:_(\d+|\[[0-9,\-]+\]))?$")


def parse_signal(text: str) -> int:
    """``USR1``, ``SIGUSR1``, ``usr1`` or ``10`` -> the signal number; refuses others."""
    word = text.strip().upper()
    if word.isdecimal():
        num = int(word)
        if 1 <= num <= 64:
            return num
        raise SlurmUsageError(f"Invalid job signal: {text}")
    name = word if word.startswith("SIG") else "SIG" + word
    try:
        return int(_signal.Signals[name])
    except KeyError:
        raise SlurmUsageError(f"Invalid job signal: {text}") from None


def expand_job_ids(text: str) -> list[str]:
    """One scancel id to the refs the API takes: ``12_[1,3-5]`` -> ``12_1 12_3 12_4 12_5``.

    Raises SlurmUsageError for what is not a job id (``12.0`` steps are named as such).
    """
    word = text.strip()
    if re.match(r"^\d+(_\d+)?\.", word):
        raise SlurmUsageError(
            f"job step ids such as {word} are not supported here; cancel or signal the job"
        )
    m = _ID_RE.match(word)
    if m is None:
        raise SlurmUsageError(f"Invalid job id {word}")
    job, task = m.group(1), m.group(2)
    if task is None:
        return [job]
    if not task.startswith("["):
        return [f"{job}_{task}"]
    out: list[str] = []
    for part in task[1:-1].split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdecimal() or (dash and not hi.isdecimal()) or (dash and int(hi) < int(lo)):
            raise SlurmUsageError(f"Invalid job id {word}")
        for i in range(int(lo), int(hi if dash else lo) + 1):
            out.append(f"{job}_{i}")
    return out


def parser() -> SlurmParser:
    p = SlurmParser(PROG)
    p.add_argument("-s", "--signal")
    p.add_argument("-b", "--batch", action="store_true")
    p.add_argument("-f", "--full", action="store_true")
    p.add_argument("-n", "--name", "--jobname", dest="name", action="append")
    p.add_argument("-u", "--user", action="append")
    p.add_argument("-t", "--state", action="append")
    p.add_argument("-p", "--partition", action="append")
    p.add_argument("--me", action="store_true")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-Q", "--quiet", action="store_true")
    p.add_argument("-H", "--hurry", action="store_true")  # no stage-out here: nothing to hurry
    p.add_argument("--ctld", action="store_true")  # always through the controller here
    refuse(p, "-i", "--interactive", why="scancel cannot ask here; list the jobs instead", nargs=0)
    refuse(p, "-A", "--account", why="jobs are not selected by account here")
    refuse(p, "-q", "--qos", why="jobs are not selected by QOS here")
    refuse(p, "-R", "--reservation", why="reservations do not exist here")
    refuse(p, "-w", "--nodelist", why="jobs are not selected by node here; give their ids")
    refuse(p, "-W", "--wckey", why="wckeys do not exist here")
    add_clusters(p)
    refuse(p, "--sibling", why="federations do not exist here")
    p.add_argument("job_ids", nargs="*")
    return p


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _error(ref: str, why: str) -> None:
    sys.stderr.write(f"{PROG}: error: Kill job error on job id {ref}: {why}\n")


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    signum = parse_signal(args.signal) if args.signal is not None else None
    if signum == int(_signal.SIGKILL):
        signum = None  # SIGKILL is what a cancel sends: cancel
    target = "full" if args.full else "batch" if args.batch else "steps"
    ids = [ref for text in args.job_ids for ref in expand_job_ids(text)]
    filters = bool(args.user or args.state or args.partition or args.name or args.me)
    if not ids and not filters:
        raise SlurmUsageError("No job identification provided")
    rc = 0
    with client() as c:
        check_clusters(c, args.clusters)
        if filters:
            picked = _select(c, args, ids)
            if ids and not picked:
                return 0  # the listed jobs do not match the filters: nothing to do, as Slurm
            ids = picked
        for ref in ids:
            rc |= _act(c, ref, signum, target, verbose=args.verbose)
    return rc


def _select(c: Any, args: Any, ids: list[str]) -> list[str]:
    """The jobs the filters pick (within ``ids`` when given), by their Slurm ids."""
    users = split_list(args.user)
    if args.me:
        users.append(str(c.get("/v1/whoami")["user"]))
    states = parse_states(",".join(split_list(args.state))) if args.state else ACTIVE
    jobs = c.jobs(state=phalanx_states(states), job=ids or None, limit=100_000)
    parts, names = set(split_list(args.partition)), set(split_list(args.name))
    out = []
    for j in jobs:
        if users and j["user"] not in users:
            continue
        if parts and j.get("partition") not in parts:
            continue
        if names and j.get("name") not in names:
            continue
        out.append(str(j["job_id"]))
    return out


def _act(c: Any, ref: str, signum: int | None, target: str, *, verbose: int) -> int:
    """Cancel or signal one job; prints Slurm's error line and returns 1 when it fails."""
    try:
        results = c.cancel([ref]) if signum is None else c.signal([ref], signum, target)
    except NotFound:
        _error(ref, INVALID)
        return 1
    outcomes = set(results.values())
    if signum is None:
        if outcomes and all(o.startswith("already") for o in outcomes):
            if verbose:  # Slurm ignores a finished job when cancelling, unless asked to talk
                _error(ref, DONE)
        elif verbose:
            sys.stderr.write(f"{PROG}: Terminating job {ref}\n")
        return 0
    if "signalled" in outcomes:
        if verbose:
            sys.stderr.write(f"{PROG}: Signal {signum} to job {ref}\n")
        return 0
    _error(ref, PENDING if "pending" in outcomes else DONE if "done" in outcomes else INVALID)
    return 1
