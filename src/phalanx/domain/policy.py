"""What happens to a job after one of its attempts ended: end, requeue (maybe later), or hold.

Pure: the store calls `after_attempt` inside the transaction that records the attempt's end
and applies the verdict. Launch failures back off exponentially and, after
`max_launch_failures`, hold the job with a reason that says what happened and where, so a job
that cannot start never spins in a requeue loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from phalanx.domain.states import JobState


@dataclass(frozen=True)
class FailurePolicy:
    max_launch_failures: int = 3  # failed launches before the job is held
    launch_backoff_base: float = 2.0  # seconds before the first retry; doubles each time
    launch_backoff_max: float = 60.0
    node_launch_failures_to_drain: int = 3  # failed launches in a row that drain a node


class Action(StrEnum):
    END = "end"
    REQUEUE = "requeue"
    HOLD = "hold"


@dataclass(frozen=True)
class Verdict:
    action: Action
    state: JobState  # the job's next state
    reason: str | None
    retry_after: float = 0.0  # seconds before the requeued job may start again
    avoid: tuple[str, ...] = field(default=())  # nodes this job should not use again
    launch_failure: bool = False


def after_attempt(
    *,
    result: JobState,
    reason: str | None,
    stop_reason: str | None,
    requeue: bool,
    lost_nodes: list[str],
    launch_failed: list[tuple[str, str]],
    launch_failures: int,
    policy: FailurePolicy,
) -> Verdict:
    """Decide the job's fate. `launch_failed`: (node, error) of tasks that never started;
    `launch_failures`: the job's failed launches before this one."""
    stop = stop_reason or ""
    if stop.startswith("cancel"):
        return Verdict(Action.END, JobState.CANCELLED, reason)
    if stop.startswith("requeue"):
        return Verdict(Action.REQUEUE, JobState.PENDING, stop)
    if launch_failed:
        n = launch_failures + 1
        node, error = launch_failed[0]
        nodes = tuple(sorted({nd for nd, _ in launch_failed}))
        if n >= policy.max_launch_failures:
            return Verdict(
                Action.HOLD,
                JobState.HELD,
                f"launch failed {n} times, last on {node}: {error}; "
                "fix the cause, then `phalanx release` the job",
                avoid=nodes,
                launch_failure=True,
            )
        delay = min(policy.launch_backoff_max, policy.launch_backoff_base * 2 ** (n - 1))
        return Verdict(
            Action.REQUEUE,
            JobState.PENDING,
            f"launch failed on {node} ({error}); retry {n + 1} of "
            f"{policy.max_launch_failures} in {delay:g}s on another node",
            retry_after=delay,
            avoid=nodes,
            launch_failure=True,
        )
    if result is JobState.NODE_FAIL and requeue:
        return Verdict(
            Action.REQUEUE,
            JobState.PENDING,
            f"requeued after node failure: {reason}",
            avoid=tuple(sorted(set(lost_nodes))),
        )
    return Verdict(Action.END, result, reason)
