"""Dependency evaluation (Slurm's afterok/afterany/afternotok/after/singleton), pure."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from phalanx.domain.states import JobState


class DepVerdict(StrEnum):
    READY = "ready"
    WAIT = "wait"
    NEVER = "never"  # can never be satisfied: the job is cancelled with the reason


def evaluate(
    deps: list[dict[str, Any]],
    states: Mapping[int, JobState],
    *,
    started: Mapping[int, bool] | None = None,
    singleton_busy: bool = False,
) -> tuple[DepVerdict, str | None]:
    """Decide whether a job's dependencies let it start.

    `deps` is `[{"type": "afterok", "jobs": [12, 13]}, ...]` (all must hold: Slurm's comma).
    `states` maps every referenced job id to its current state; a missing id was purged and
    counts as never satisfiable for afterok/afternotok, satisfied for afterany/after.
    """
    started = started or {}
    waiting: list[str] = []
    for dep in deps:
        kind = dep["type"]
        if kind == "singleton":
            if singleton_busy:
                waiting.append("singleton: another job with this name and user is active")
            continue
        for jid in dep["jobs"]:
            state = states.get(int(jid))
            if kind == "after":
                if state is None or state.terminal or started.get(int(jid)):
                    continue
                waiting.append(f"after:{jid}")
                continue
            if state is None:
                if kind == "afterany":
                    continue
                return (
                    DepVerdict.NEVER,
                    f"dependency {kind}:{jid} can never be satisfied: job {jid} is unknown",
                )
            if not state.terminal:
                waiting.append(f"{kind}:{jid}")
                continue
            ok = state is JobState.COMPLETED
            if (kind == "afterok" and not ok) or (kind == "afternotok" and ok):
                return (
                    DepVerdict.NEVER,
                    f"dependency {kind}:{jid} can never be satisfied: job {jid} ended {state.value}",
                )
    if waiting:
        return DepVerdict.WAIT, "Dependency (" + ",".join(waiting) + ")"
    return DepVerdict.READY, None


def referenced_jobs(deps: list[dict[str, Any]]) -> set[int]:
    return {int(j) for d in deps for j in d.get("jobs", [])}
