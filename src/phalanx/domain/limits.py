"""Limits per account, user association and QOS, as Slurm's accounting limits.

Two kinds:

* run-time limits (running jobs, GPUs in use, wall time per job) keep a job PENDING with a
  reason in Slurm's words, which `squeue -o %r` shows;
* submit-time limits (jobs submitted, pending and running together) refuse the submission.

Account limits are group limits (Slurm's ``Grp*``): they count the jobs of the account and of
every account below it. A user association's limits count that user's jobs in that account.
QOS limits count one user's jobs in that QOS (Slurm's ``Max*PerUser``). Pure: the caller counts
the active and submitted jobs (`Usage`) and asks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Limit:
    max_running_jobs: int | None = None
    max_submit_jobs: int | None = None
    max_gpus: int | None = None
    max_wall_s: int | None = None


@dataclass(frozen=True)
class Limits:
    accounts: Mapping[str, Limit] = field(default_factory=dict)
    assocs: Mapping[tuple[str, str], Limit] = field(default_factory=dict)  # (account, user)
    qos: Mapping[str, Limit] = field(default_factory=dict)
    parents: Mapping[str, str] = field(default_factory=dict)  # account -> parent

    def any(self) -> bool:
        return bool(self.accounts or self.assocs or self.qos)

    def lineage(self, account: str) -> list[str]:
        """The account and its ancestors (root excluded), nearest first."""
        out = []
        seen = set()
        a: str | None = account
        while a and a != "root" and a not in seen:
            out.append(a)
            seen.add(a)
            a = self.parents.get(a)
        return out


# Slurm's reason words, per (kind of limit, what it limits)
REASONS = {
    ("account", "jobs"): "AssocGrpJobsLimit",
    ("account", "gpus"): "AssocGrpGRES",
    ("account", "wall"): "AssocMaxWallDurationPerJobLimit",
    ("account", "submit"): "AssocGrpSubmitJobsLimit",
    ("assoc", "jobs"): "AssocMaxJobsLimit",
    ("assoc", "gpus"): "AssocGrpGRES",
    ("assoc", "wall"): "AssocMaxWallDurationPerJobLimit",
    ("assoc", "submit"): "AssocMaxSubmitJobLimit",
    ("qos", "jobs"): "QOSMaxJobsPerUserLimit",
    ("qos", "gpus"): "QOSMaxGRESPerUser",
    ("qos", "wall"): "QOSMaxWallDurationPerJobLimit",
    ("qos", "submit"): "QOSMaxSubmitJobPerUserLimit",
}


def job_gpus(job: Mapping[str, Any]) -> int:
    return int(job["nodes"]) * int(job["gpus_per_node"])


@dataclass
class Usage:
    """Jobs and GPUs counted per limited thing: ("account", name), ("assoc", account, user),
    ("qos", name, user)."""

    jobs: Counter[tuple[str, ...]] = field(default_factory=Counter)
    gpus: Counter[tuple[str, ...]] = field(default_factory=Counter)

    def add(self, job: Mapping[str, Any], limits: Limits) -> None:
        g = job_gpus(job)
        for key in keys(job, limits):
            self.jobs[key] += 1
            self.gpus[key] += g


def keys(job: Mapping[str, Any], limits: Limits) -> list[tuple[str, ...]]:
    account = str(job.get("account") or "")
    user = str(job["user"])
    out: list[tuple[str, ...]] = [("account", a) for a in limits.lineage(account)]
    out.append(("assoc", account, user))
    if job.get("qos"):
        out.append(("qos", str(job["qos"]), user))
    return out


def _limit_of(key: tuple[str, ...], limits: Limits) -> Limit | None:
    if key[0] == "account":
        return limits.accounts.get(key[1])
    if key[0] == "assoc":
        return limits.assocs.get((key[1], key[2]))
    return limits.qos.get(key[1])


def _say(key: tuple[str, ...], what: str, detail: str) -> str:
    who = {"account": f"account {key[1]}", "assoc": f"user {key[-1]} in account {key[1]}"}.get(
        key[0], f"QOS {key[1]} per user"
    )
    return f"{REASONS[(key[0], what)]} ({who}: {detail})"


def run_blocker(job: Mapping[str, Any], usage: Usage, limits: Limits) -> str | None:
    """Why `job` may not start now given what already runs (`usage`), or None."""
    if not limits.any():
        return None
    wall = job.get("time_limit_s")
    g = job_gpus(job)
    for key in keys(job, limits):
        lim = _limit_of(key, limits)
        if lim is None:
            continue
        if lim.max_wall_s is not None and (not wall or int(wall) > lim.max_wall_s):
            asked = f"{int(wall)} s" if wall else "UNLIMITED"
            return _say(key, "wall", f"time limit {asked} > MaxWall {lim.max_wall_s} s")
        if lim.max_running_jobs is not None and usage.jobs[key] + 1 > lim.max_running_jobs:
            return _say(key, "jobs", f"{usage.jobs[key]} running, at most {lim.max_running_jobs}")
        if lim.max_gpus is not None and g and usage.gpus[key] + g > lim.max_gpus:
            return _say(
                key, "gpus", f"{usage.gpus[key]} GPUs in use + {g} > at most {lim.max_gpus}"
            )
    return None


def submit_refusal(
    job: Mapping[str, Any], submitted: Usage, limits: Limits, count: int = 1
) -> str | None:
    """Why submitting `count` more jobs like `job` is refused (`submitted`: the jobs pending
    or running now), or None."""
    for key in keys(job, limits):
        lim = _limit_of(key, limits)
        if lim is None or lim.max_submit_jobs is None:
            continue
        if submitted.jobs[key] + count > lim.max_submit_jobs:
            return (
                _say(
                    key,
                    "submit",
                    f"{submitted.jobs[key]} pending or running + {count} > at most "
                    f"{lim.max_submit_jobs}",
                )
                + "; wait for some to end or cancel some"
            )
    return None
