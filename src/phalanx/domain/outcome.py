"""How an attempt ended, read from its tasks' exit records: pure decisions the store applies in
its write transaction (and tests check without a database). A task row here is the store's
mapping: node, state, exit_code, exit_signal, started_at and the shepherd's `detail`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.domain.policy import TIMEOUT_STOP, TaskEnd, describe_hang, is_timeout_stop
from phalanx.domain.states import AttemptState, JobState, TaskState


def task_end(t: dict[str, Any]) -> TaskEnd:
    """A task row as the retry policy sees it."""
    return TaskEnd(
        node=t["node"],
        exit_code=t["exit_code"],
        signal=t["exit_signal"],
        lost=t["state"] == TaskState.LOST.value,
        detail=t["detail"] or {},
    )


def stopped_holder(t: dict[str, Any]) -> bool:
    """A non-batch node's task that ended because it was asked to (the batch step ended, or the
    job was stopped): not an outcome of its own.  Lost, fenced or failed launches still are."""
    if t["state"] == TaskState.LOST.value:
        return False
    d = t["detail"] or {}
    if d.get("fenced") or d.get("launch_failed") or d.get("job_error") or d.get("oom"):
        return False
    return bool(d.get("stop_requested") or d.get("cancelled") or d.get("never_started"))


def task_failed(t: dict[str, Any]) -> bool:
    """Whether a task ended badly: lost, never launched, out of time, hung, a non-zero exit or
    a signal."""
    if t["state"] == TaskState.LOST.value:
        return True
    d = t["detail"] or {}
    return bool(
        d.get("launch_failed")
        or d.get("timed_out")
        or d.get("hung")  # killed by the shepherd for making no progress
        or t["exit_code"] not in (0,)
        or t["exit_signal"]
    )


# A node's prolog or epilog failed (agent/shepherd_hooks.py): the shepherd's exit record says
# so with a sentence (exit status and the script's first output), and the node is drained by
# that hook, with that sentence as the reason, until an operator resumes it.
HOOK_FAILURES = (("prolog_failed", "prolog"), ("epilog_failed", "epilog"))


def hook_drain(detail: dict[str, Any] | None, job_id: int | None) -> tuple[str, str] | None:
    """(drain_by, reason) for a task whose prolog or epilog failed, or None. The reason names
    the job it ran for, so an operator can find the job's own account of it."""
    d = detail or {}
    failed = [(by, str(d[key])) for key, by in HOOK_FAILURES if d.get(key)]
    if not failed:
        return None
    reason = "; ".join(text for _, text in failed)
    if job_id is not None:
        reason += f" (job {job_id})"
    return failed[0][0], reason


def launch_error(t: dict[str, Any]) -> str | None:
    """Why a task never started (its launch failed), or None if it did start."""
    d = t["detail"] or {}
    if d.get("job_error"):
        return None  # the job's own problem (unknown user, a file it may not open): not the node's
    if d.get("prolog_failed"):
        return None  # the node is drained for it at once (hook_drain): no count of failures
    if d.get("launch_failed"):
        return str(d.get("error") or "launch failed")
    if (
        t["state"] == TaskState.LOST.value
        and t["started_at"] is None
        and "never started" in str(d.get("error") or "")
    ):
        return str(d["error"])
    return None


def describe_exit(t: dict[str, Any]) -> str:
    """How one task ended, as the rest of a sentence that starts "task on NODE ..."."""
    d = t["detail"] or {}
    if t["state"] == TaskState.LOST.value:
        return f"was lost ({d.get('error') or 'shepherd vanished'})"
    if d.get("job_error"):
        return f"could not start: {d.get('error')}"
    if d.get("prolog_failed"):
        return f"did not start: {d.get('error')}"
    if d.get("launch_failed"):
        return f"failed to launch: {d.get('error')}"
    if d.get("timed_out"):
        return "reached its time limit"
    if d.get("hung"):
        return describe_hang(t["node"], d["hung"]).replace(f" on {t['node']}", "")
    if t["exit_signal"]:
        return f"was killed by signal {t['exit_signal']}"
    return f"exited with code {t['exit_code']}"


def attempt_outcome(
    att: dict[str, Any], tasks: list[dict[str, Any]]
) -> tuple[JobState, str | None, int | None, int | None]:
    """The job state an attempt produced, from its tasks' exit records (pure)."""
    details = [t["detail"] or {} for t in tasks]
    stop = att["stop_reason"] or ""
    code = next((t["exit_code"] for t in tasks if t["exit_code"] not in (None, 0)), None)
    if code is None:
        code = next((t["exit_code"] for t in tasks if t["exit_code"] is not None), None)
    sig = next((t["exit_signal"] for t in tasks if t["exit_signal"]), None)
    if stop.startswith("cancel"):
        return JobState.CANCELLED, stop.removeprefix("cancel: "), code, sig
    if is_timeout_stop(stop):  # a planned stop that ends it TIMEOUT (its reservation ended)
        return JobState.TIMEOUT, stop.removeprefix(TIMEOUT_STOP), code, sig
    refused = next((d for d in details if d.get("job_error")), None)
    if refused is not None:  # e.g. "user alice is unknown on node01"
        return JobState.FAILED, str(refused.get("error") or "the job could not start"), code, sig
    if any(d.get("timed_out") for d in details):
        return JobState.TIMEOUT, "reached its time limit", code, sig
    fenced = [t for t in tasks if (t["detail"] or {}).get("fenced")]
    if fenced:
        # the node lost the controllers and stopped the job itself: a node failure, so a
        # requeue-able job runs again elsewhere
        node = fenced[0]["node"]
        return (
            JobState.NODE_FAIL,
            f"stopped on {node} by self-fencing (its agent lost the controllers)",
            code,
            sig,
        )
    lost = [t for t in tasks if t["state"] == TaskState.LOST.value]
    if lost:
        return JobState.NODE_FAIL, f"task on {lost[0]['node']} {describe_exit(lost[0])}", code, sig
    hung = [t for t in tasks if (t["detail"] or {}).get("hung")]
    if hung:
        return JobState.FAILED, describe_hang(hung[0]["node"], hung[0]["detail"]["hung"]), code, sig
    if any(d.get("oom") for d in details):
        return JobState.OUT_OF_MEMORY, "killed for exceeding its memory limit", code, sig
    bad = [t for t in tasks if task_failed(t)]
    if bad:
        return JobState.FAILED, f"task on {bad[0]['node']} {describe_exit(bad[0])}", code, sig
    return JobState.COMPLETED, None, 0, None


BATCH_ENDED = "batch script ended; releasing its nodes"
_DONE = (TaskState.EXITED.value, TaskState.LOST.value)


@dataclass(frozen=True)
class Ending:
    """An attempt whose every task is done: how it ended, and the tasks that decide it."""

    result: JobState
    reason: str | None
    exit_code: int | None
    exit_signal: int | None
    # what the outcome and the retry policy read: in batch mode the batch step and whatever
    # went wrong elsewhere, not the other nodes' holders being stopped
    deciding: tuple[dict[str, Any], ...]
    launch_failed: tuple[tuple[str, str], ...]  # (node, error) of tasks that never launched


@dataclass(frozen=True)
class Advance:
    """What an attempt's task rows call for; the store writes it in the same transaction."""

    start: float | None = None  # STARTING -> RUNNING from this time (the first task's start)
    stop: str | None = None  # STOPPING: the other nodes are stopped, for this reason
    end: Ending | None = None  # every task is done: the attempt ends so


def advance(
    state: str, tasks: Sequence[dict[str, Any]], *, stop_reason: str | None, batch: bool
) -> Advance:
    """Move an attempt forward from its (non-spare) task rows, ordered by rank.

    `state` is the attempt's state; `batch` whether the job runs Slurm's batch step on its
    first node (several nodes, not --all-nodes), so that the batch script's end is the job's
    end and the other nodes only held it."""
    started = [t["started_at"] for t in tasks if t["started_at"] is not None]
    start = min(started) if state == AttemptState.STARTING.value and started else None
    if start is not None:
        state = AttemptState.RUNNING.value
    finished = [t for t in tasks if t["state"] in _DONE]
    if not finished:
        return Advance(start)
    stopping = state == AttemptState.STOPPING.value
    if len(finished) < len(tasks):
        bad = [t for t in finished if task_failed(t)]
        if batch and not stopping and not bad and any(t["rank"] == 0 for t in finished):
            return Advance(start, stop=BATCH_ENDED)
        if bad and not stopping:
            t = bad[0]
            return Advance(
                start, stop=f"task on {t['node']} {describe_exit(t)}; stopping the other nodes"
            )
        return Advance(start)
    deciding = (
        [t for t in tasks if t["rank"] == 0 or not stopped_holder(t)] if batch else list(tasks)
    )
    result, reason, code, sig = attempt_outcome({"stop_reason": stop_reason}, deciding)
    failed = tuple((t["node"], err) for t in tasks if (err := launch_error(t)))
    return Advance(start, end=Ending(result, reason, code, sig, tuple(deciding), failed))
