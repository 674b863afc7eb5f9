"""What `scontrol show job` and `sacct` both read from a job's view: Slurm's words for it.

Pure functions over the plain dicts the API returns (`GET /v1/jobs`, `GET /v1/jobs/{ref}`), so
the exact text tools parse is tested without a cluster.
"""

from __future__ import annotations

import grp
import pwd
from dataclasses import dataclass
from typing import Any

from phalanx.slurm.common import acct_state

# A Phalanx end state -> the reason Slurm gives a job that ended so.
_END_REASONS = {
    "FAILED": "NonZeroExitCode",
    "TIMEOUT": "TimeLimit",
    "NODE_FAIL": "NodeDown",
    "OUT_OF_MEMORY": "OutOfMemory",
}


def reason_word(job: dict[str, Any]) -> str:
    """Slurm's one-word reason (`Reason=` of show job, sacct's Reason): the scheduler's reasons
    start with Slurm's word (`Resources`, `Priority`, `Dependency`, `BeginTime (...)`); a held
    job is `JobHeldUser` (or `JobHeldAdmin` when an operator held it is not known here); a
    running or completed job is `None`."""
    state = job.get("state") or ""
    if state == "HELD":
        return "JobHeldUser"
    if state in _END_REASONS:
        return _END_REASONS[state]
    if state != "PENDING":
        return "None"
    reason = (job.get("reason") or "").strip()
    word = reason.split(" ", 1)[0].split("(", 1)[0].rstrip(":,;")
    return word if word and word.isidentifier() else "None"


def exit_code_text(job: dict[str, Any]) -> str:
    """ExitCode as Slurm prints it, `code:signal` (`0:0`, `1:0`, `0:9`)."""
    return f"{int(job.get('exit_code') or 0)}:{int(job.get('exit_signal') or 0)}"


def null_text(value: Any) -> str:
    """A value as Slurm prints one that is unset: ``(null)``."""
    return "(null)" if value in (None, "", [], ()) else str(value)


@dataclass(frozen=True)
class Account:
    """A job user's ids on this host (a cluster's hosts share one user database)."""

    uid: int
    gid: int
    group: str  # the primary group's name, or its gid where it has none


def user_account(user: str) -> Account | None:
    """`user`'s uid, primary gid and group name from this host's user database; None for a
    user unknown here."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None
    try:
        group = grp.getgrgid(pw.pw_gid).gr_name
    except KeyError:
        group = str(pw.pw_gid)
    return Account(pw.pw_uid, pw.pw_gid, group)


def user_ids(user: str) -> tuple[str, str]:
    """`alice(1000)` and `alice(1000)` (the user's primary group) as show job prints them; a
    user unknown on this host shows its name with `(?)`."""
    acct = user_account(user)
    if acct is None:
        return f"{user}(?)", f"{user}(?)"
    return f"{user}({acct.uid})", f"{acct.group}({acct.gid})"


def mem_text(mb: int | float | None) -> str:
    """Memory as Slurm's TRES strings give it: the largest exact unit (`500M`, `4G`, `2T`)."""
    if not mb:
        return "0"
    n = int(mb)
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}T"
    if n % 1024 == 0:
        return f"{n // 1024}G"
    return f"{n}M"


def node_count(job: dict[str, Any]) -> int:
    """Nodes it holds (or held last), else the nodes it asks for."""
    return int(job.get("nodes_alloc") or job.get("nodes") or 1)


def cpu_count(job: dict[str, Any]) -> int:
    return node_count(job) * int(job.get("cpus_per_node") or 1)


def tres_text(job: dict[str, Any]) -> str:
    """`cpu=8,mem=16G,node=2,billing=8[,gres/gpu=4]` (show job TRES=, sacct AllocTRES)."""
    nodes = node_count(job)
    cpus = cpu_count(job)
    parts = [
        f"cpu={cpus}",
        f"mem={mem_text(int(job.get('mem_per_node_mb') or 0) * nodes)}",
        f"node={nodes}",
        f"billing={cpus}",
    ]
    gpus = int(job.get("gpus_per_node") or 0) * nodes
    if gpus:
        parts.append(f"gres/gpu={gpus}")
    return ",".join(parts)


def state_text(job: dict[str, Any], *, by_uid: bool = True) -> str:
    """sacct's State: Slurm's name; a cancelled job `CANCELLED by <uid>` when the canceller is
    known (the reason names them: `cancelled by alice`), `PREEMPTED` when a preemption in
    mode cancel ended it."""
    state = acct_state(job.get("state") or "")
    if state == "CANCELLED" and (job.get("reason") or "").startswith("preempted by job "):
        return "PREEMPTED"  # preempt mode cancel: Slurm's sacct shows PREEMPTED
    if state == "CANCELLED" and by_uid:
        reason = job.get("reason") or ""
        marker = " by "
        if marker in reason:
            who = reason.rsplit(marker, 1)[1].split()[0].strip(" ;,:")
            who = who.split("@", 1)[0]
            try:
                return f"CANCELLED by {pwd.getpwnam(who).pw_uid}"
            except KeyError:
                if who.isdecimal():
                    return f"CANCELLED by {who}"
    return state


def nodelist_text(job: dict[str, Any], missing: str = "None assigned") -> str:
    return str(job.get("nodelist") or missing)


def batch_host(job: dict[str, Any]) -> str | None:
    """The node the batch script runs on: the first (rank 0) of the allocation."""
    if job.get("batch_host"):
        return str(job["batch_host"])
    attempts = job.get("attempts") or []
    if attempts and attempts[-1].get("nodes"):
        return str(attempts[-1]["nodes"][0])
    nodelist = job.get("nodelist")
    if nodelist:
        from phalanx.domain.hostlist import expand_hostlist

        names = expand_hostlist(str(nodelist))
        return names[0] if names else None
    return None
