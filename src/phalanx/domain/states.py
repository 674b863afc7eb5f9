"""Job and node lifecycles as explicit enums with a transition table.

An illegal edge raises InvalidTransition, so a bug that would move a COMPLETED job back to RUNNING
fails loudly instead of corrupting history.
"""

from __future__ import annotations

from enum import StrEnum

from phalanx.errors import InvalidTransition


class JobState(StrEnum):
    PENDING = "PENDING"
    HELD = "HELD"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def active(self) -> bool:
        """Holds resources on nodes."""
        return self in ACTIVE


TERMINAL = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.OUT_OF_MEMORY,
    }
)
ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.COMPLETING})
_ENDINGS = TERMINAL

JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.HELD, JobState.STARTING, JobState.CANCELLED}),
    JobState.HELD: frozenset({JobState.PENDING, JobState.CANCELLED}),
    # STARTING -> PENDING: the launch failed or the node went away before the job ran (requeue).
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.COMPLETING, JobState.PENDING, JobState.HELD}
    )
    | _ENDINGS,
    JobState.RUNNING: frozenset({JobState.COMPLETING, JobState.PENDING, JobState.HELD}) | _ENDINGS,
    JobState.COMPLETING: frozenset({JobState.PENDING, JobState.HELD}) | _ENDINGS,
}
for _t in TERMINAL:
    JOB_TRANSITIONS[_t] = frozenset()


def check_job_transition(job_id: int, old: JobState, new: JobState) -> None:
    if new not in JOB_TRANSITIONS[old]:
        raise InvalidTransition(
            f"job {job_id} cannot go from {old} to {new}",
            job_id=job_id,
            old=str(old),
            new=str(new),
        )


class AttemptState(StrEnum):
    """One launch of a job on a set of nodes. A requeue is a new attempt of the same job."""

    STARTING = "STARTING"  # allocated; waiting for every node's agent to say it started
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"  # asked to stop (cancel, a failed peer, requeue); waiting for exits
    ENDED = "ENDED"

    @property
    def holds_resources(self) -> bool:
        return self is not AttemptState.ENDED


class TaskState(StrEnum):
    """The part of an attempt on one node (one shepherd)."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    LOST = "LOST"  # the node lost it (shepherd vanished, never started)

    @property
    def finished(self) -> bool:
        return self in (TaskState.EXITED, TaskState.LOST)


class NodeState(StrEnum):
    """A node's allocation state, derived from what runs on it; DOWN/DRAIN are flags beside it."""

    UNKNOWN = "UNKNOWN"  # never registered, or not heard from since the controller started
    IDLE = "IDLE"
    MIXED = "MIXED"
    ALLOCATED = "ALLOCATED"


def node_display_state(
    *, registered: bool, down: bool, drain: bool, used_cpus: int, total_cpus: int, busy: bool
) -> str:
    """The one-word state an operator sees, Slurm style (DOWN, DRAINING, DRAINED, MIXED...)."""
    if not registered:
        base = NodeState.UNKNOWN.value
    elif not busy:
        base = NodeState.IDLE.value
    elif used_cpus >= total_cpus:
        base = NodeState.ALLOCATED.value
    else:
        base = NodeState.MIXED.value
    if down:
        return "DOWN+DRAIN" if drain else "DOWN"
    if drain:
        return "DRAINING" if busy else "DRAINED"
    return base
