"""The agent protocol's decision: given what the store wants and what the agent has, what to do.

Level-triggered (DESIGN.md §4): the reply lists tasks to start, tasks to stop and finished tasks
the agent may forget. Replaying a reply, or losing one, is harmless: the next heartbeat
reconciles again. Pure functions over plain data.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.controller.launch import checkpoint_settings
from phalanx.domain import job_reports
from phalanx.domain.policy import is_timeout_stop, is_user_requeue
from phalanx.domain.preemption import CANCEL_PREFIX
from phalanx.domain.states import AttemptState, TaskState
from phalanx.store.steps import StepReport
from phalanx.store.store import TaskReport

_ALIVE = ("starting", "running")


@dataclass
class Reply:
    start: list[dict[str, Any]] = field(default_factory=list)  # work rows to launch
    stop: list[dict[str, Any]] = field(default_factory=list)  # {"attempt_id", "token", "reason"}
    forget: list[int] = field(default_factory=list)
    # Periodic checkpoints in force for this node's running attempts (level-triggered: the
    # agent replaces its whole list with each reply that has one); not work, so not in `empty`.
    checkpoint: list[dict[str, Any]] | None = None
    # Signals (scancel --signal) this node has not delivered yet: {"attempt_id", "seq",
    # "signum", "target"}. Listed until the agent reports their seq done, so they are work.
    signals: list[dict[str, Any]] = field(default_factory=list)
    # A --no-kill job's node changes the node has not written to the job's control file yet
    # ({"attempt_id", "gen", "nodes", "node_rank", "changes"}): work, like signals.
    members: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.start or self.stop or self.signals or self.members)


def needs_write(
    work: list[dict[str, Any]], reports: list[TaskReport], taken_at: float | None
) -> bool:
    """Whether the agent's report says anything the store does not already know."""
    return state_changes(work, reports, taken_at) or job_report_news(work, reports)


def job_report_news(work: list[dict[str, Any]], reports: list[TaskReport]) -> bool:
    """A task reports a new checkpoint, or progress due for its (throttled) write."""
    by_id = {w["attempt_id"]: w for w in work}
    for r in reports:
        if r.checkpoint is None and r.progress is None:
            continue
        w = by_id.get(r.attempt_id)
        if w is not None and w["token"] == r.token and _job_report_is_news(w, r):
            return True
    return False


def state_changes(
    work: list[dict[str, Any]], reports: list[TaskReport], taken_at: float | None
) -> bool:
    """Whether the report changes a task's state (which is worth a scheduling pass; a job's
    checkpoint or progress is not)."""
    by_id = {w["attempt_id"]: w for w in work}
    reported = set()
    for r in reports:
        reported.add(r.attempt_id)
        w = by_id.get(r.attempt_id)
        if w is None or w["token"] != r.token:
            continue
        ts = w["task_state"]
        if r.state == "running" and ts == TaskState.STARTING.value:
            return True
        if r.state in ("exited", "lost") and ts in (
            TaskState.STARTING.value,
            TaskState.RUNNING.value,
        ):
            return True
    if taken_at is None:
        return False
    for w in work:
        if w["attempt_id"] in reported:
            continue
        if w["task_state"] == TaskState.RUNNING.value:
            return True
        if (
            w["task_state"] == TaskState.STARTING.value
            and w["attempt_state"] == AttemptState.STOPPING.value
        ):
            return True
    return False


def _job_report_is_news(w: dict[str, Any], r: TaskReport) -> bool:
    """A new checkpoint, or progress due for its (throttled) write."""
    rank = int(w.get("rank") or 0)
    return job_reports.is_new_checkpoint(
        w.get("job_checkpoint"), r.checkpoint, rank=rank
    ) or job_reports.progress_due(w.get("attempt_progress"), r.progress, rank=rank)


def stop_item(w: dict[str, Any], checkpoint_grace: float) -> dict[str, Any]:
    """A stop request; planned stops (requeue, and the end of a reservation: timeout) first
    give the job its checkpoint signal."""
    reason = w["stop_reason"] or "stop"
    item: dict[str, Any] = {"attempt_id": w["attempt_id"], "token": w["token"], "reason": reason}
    planned = (reason.startswith("requeue") and not is_user_requeue(reason)) or is_timeout_stop(
        reason
    )
    if planned or reason.startswith(CANCEL_PREFIX):
        # a user's own requeue (scontrol requeue) just stops the job, as Slurm's does; other
        # planned stops, and a preemption in mode cancel, first give it its checkpoint signal:
        # --checkpoint-signal/--checkpoint-grace, else --signal's, else USR1 and the cluster's
        settings = checkpoint_settings(w, checkpoint_grace=checkpoint_grace)
        item["checkpoint_signal"] = settings["signum"]
        item["checkpoint_grace"] = settings["grace_s"]
        # --signal=B:: the batch shell's alone; the steps get the grace, not the signal
        item["batch_only"] = settings["batch_only"]
    return item


def checkpoint_items(
    work: list[dict[str, Any]], interval_of: Callable[[dict[str, Any]], float | None]
) -> list[dict[str, Any]]:
    """The periodic checkpoint interval of each running attempt on the node that has one.

    `interval_of(work_row)` is the interval in force in seconds (None: no periodic requests);
    the agent asks for a checkpoint when that long has passed since the attempt started, its
    last checkpoint or its last request.
    """
    items = []
    for w in work:
        if w["attempt_state"] != AttemptState.RUNNING.value:
            continue
        if "checkpoint_interval_s" in w:  # a node-work row: selected apart from the spec
            setting = w["checkpoint_interval_s"]
        else:
            setting = ((w.get("spec") or {}).get("checkpoint_parsed") or {}).get("interval_s")
        if not setting:
            continue
        seconds = interval_of(w)
        if seconds is None:
            continue
        settings = checkpoint_settings(w, checkpoint_grace=0.0)
        items.append(
            {
                "attempt_id": w["attempt_id"],
                "token": w["token"],
                "interval_s": float(seconds),
                "signal": settings["signum"],
                "batch_only": settings["batch_only"],
            }
        )
    return items


def signal_items(work: list[dict[str, Any]], reports: list[TaskReport]) -> list[dict[str, Any]]:
    """The signals each live attempt on the node still has to deliver (level-triggered).

    An agent reports, per task, the highest signal seq it has handled (``signals_done``); the
    reply lists the attempt's signals above it. A ``batch`` signal is for the batch shell,
    which runs on the batch host (rank 0) only, so other nodes are not sent it (their
    ``signals_done`` moves past it with the next signal they do get). Agents that do not
    report ``signals_done`` cannot deliver signals and are sent none.
    """
    reported = {r.attempt_id: r for r in reports}
    items: list[dict[str, Any]] = []
    live = (AttemptState.STARTING.value, AttemptState.RUNNING.value)
    for w in work:
        signals = w.get("attempt_signals") or []
        r = reported.get(w["attempt_id"])
        if not signals or w["attempt_state"] not in live or r is None:
            continue
        if r.token != w["token"] or r.signals_done is None or r.state not in _ALIVE:
            continue
        for sig in signals:
            if int(sig["seq"]) <= r.signals_done:
                continue
            if sig["target"] == "batch" and int(w.get("rank") or 0) != 0:
                continue
            items.append(
                {
                    "attempt_id": w["attempt_id"],
                    "seq": int(sig["seq"]),
                    "signum": int(sig["signum"]),
                    "target": str(sig["target"]),
                }
            )
    return items


def membership_items(work: list[dict[str, Any]], reports: list[TaskReport]) -> list[dict[str, Any]]:
    """The node changes of each running --no-kill attempt on the node that its agent has not
    written to the job's control file yet (level-triggered, as signals: the agent reports per
    task the generation it wrote, ``members_gen``; None from agents that cannot write it)."""
    reported = {r.attempt_id: r for r in reports}
    items: list[dict[str, Any]] = []
    for w in work:
        members = w.get("attempt_membership")
        r = reported.get(w["attempt_id"])
        if not members or r is None or r.members_gen is None:
            continue
        if r.token != w["token"] or r.state not in _ALIVE:
            continue
        if w["attempt_state"] not in (AttemptState.STARTING.value, AttemptState.RUNNING.value):
            continue
        gen = int(members.get("gen") or 0)
        if gen <= r.members_gen:
            continue
        items.append(
            {
                "attempt_id": w["attempt_id"],
                "gen": gen,
                "nodes": list(members.get("nodes") or w["attempt_nodes"]),
                "node_rank": int(w["rank"]),
                "changes": list(members.get("changes") or []),
            }
        )
    return items


def decide(
    work: list[dict[str, Any]],
    reports: list[TaskReport],
    *,
    checkpoint_grace: float = 30.0,
) -> Reply:
    """What the agent must do, from the node's work as the store has it (`Store.node_work`).

    An exit or loss is forgotten once its attempt is no longer in the work with the reported
    token: the work lists every task of the node's not-ended attempts, so an attempt missing
    from it is ENDED (fully recorded) or unknown, and one still in it is still running on
    another node, so the agent keeps reporting its task until the attempt ends."""
    reply = Reply()
    by_id = {w["attempt_id"]: w for w in work}
    reported = {r.attempt_id: r for r in reports}
    for w in work:
        aid = w["attempt_id"]
        r = reported.get(aid)
        if w["attempt_state"] in (AttemptState.STARTING.value, AttemptState.RUNNING.value):
            if r is None and w["task_state"] == TaskState.STARTING.value:
                reply.start.append(w)
        elif (
            w["attempt_state"] == AttemptState.STOPPING.value
            and r is not None
            and r.state in _ALIVE
        ):
            reply.stop.append(stop_item(w, checkpoint_grace))
    for r in reports:
        row = by_id.get(r.attempt_id)
        stale = row is None or row["token"] != r.token
        if stale and r.state in _ALIVE:
            reply.stop.append(
                {
                    "attempt_id": r.attempt_id,
                    "token": r.token,
                    "reason": "attempt is no longer current",
                }
            )
        elif r.state in ("exited", "lost") and stale:
            reply.forget.append(r.attempt_id)
    return reply


@dataclass
class StepReply:
    """The step half of a heartbeat reply (same rules as for tasks: level-triggered)."""

    start: list[dict[str, Any]] = field(default_factory=list)  # step work rows to launch here
    stop: list[dict[str, Any]] = field(default_factory=list)  # {"attempt_id","step_id",...}
    signal: list[dict[str, Any]] = field(default_factory=list)  # {"attempt_id","step_id","signals"}
    forget: list[list[int]] = field(default_factory=list)  # [attempt_id, step_id]

    @property
    def empty(self) -> bool:
        return not (self.start or self.stop or self.signal)


def steps_to_decide(work: list[dict[str, Any]], step_reports: list[StepReport]) -> bool:
    """Whether a heartbeat's step half needs the node's step work read from the store.

    Not when the node has no task of a live attempt (`work`, Store.node_work, is empty) and
    reports no step: a step runs only on nodes of its live attempt, so any step row left for
    this node belongs to an ended attempt, and with nothing reported decide_steps would neither
    start, stop, signal nor forget anything. An idle node's heartbeat saves one query.
    """
    return bool(work) or bool(step_reports)


def decide_steps(
    work: list[dict[str, Any]],
    reports: list[StepReport],
    ended: set[tuple[int, int]],
    checkpoint_grace: float = 30.0,
) -> StepReply:
    """What the agent must do about job steps. `work`: Store.node_step_work rows of the
    node; `ended`: reported (attempt, step) pairs the store has recorded as over there.

    A step's tasks stop when the step is cancelled or ended, or when its attempt stops (with
    the attempt's checkpoint signal first, for planned stops: a training step checkpoints).
    Signals are the step's whole request list; the agent delivers each sequence number once.
    """
    reply = StepReply()
    by_key = {(w["attempt_id"], w["step_id"]): w for w in work}
    reported = {(r.attempt_id, r.step_id): r for r in reports}
    for key, w in by_key.items():
        r = reported.get(key)
        alive = r is not None and r.state in _ALIVE
        attempt_live = w["attempt_state"] in (
            AttemptState.STARTING.value,
            AttemptState.RUNNING.value,
        )
        step_live = w["step_state"] == "RUNNING" and not w["step_stop_reason"]
        if attempt_live and step_live:
            if r is None and w["node_state"] == TaskState.STARTING.value:
                reply.start.append(w)
            elif alive and w["signals"]:
                reply.signal.append(
                    {"attempt_id": key[0], "step_id": key[1], "signals": list(w["signals"])}
                )
        elif alive:
            if not attempt_live and w["attempt_state"] == AttemptState.STOPPING.value:
                item = stop_item(w, checkpoint_grace)  # the attempt's own stop, for its steps
                if w["signals"]:
                    # signals still reach tasks in a planned stop's grace: the batch shell
                    # forwards the checkpoint signal (--signal=B:) through srun this way
                    reply.signal.append(
                        {"attempt_id": key[0], "step_id": key[1], "signals": list(w["signals"])}
                    )
            else:
                item = {"reason": w["step_stop_reason"] or "step ended"}
            reply.stop.append({**item, "attempt_id": key[0], "step_id": key[1]})
    for key, r in reported.items():
        row = by_key.get(key)
        stale = row is None or row["token"] != r.token
        if stale and r.state in _ALIVE:
            reply.stop.append(
                {"attempt_id": key[0], "step_id": key[1], "reason": "step is no longer current"}
            )
        elif r.state in ("exited", "lost") and (stale or key in ended):
            reply.forget.append([key[0], key[1]])
    return reply


class StepReportMemo:
    """Which step reports of each node this controller has recorded already, so that a repeated
    one costs no store transaction.

    Agents repeat their whole step list on every heartbeat (level-triggered), and a short
    `srun` loop makes each node report the same ended steps several times (the long-poll that
    carried an exit is computed again when the next step wakes it).  What a report can do to
    a node's step is monotonic (STARTING -> RUNNING -> EXITED/LOST, never back): once a
    report "running" or "exited" of a (node, attempt, step, token) has been applied, the same
    report again changes nothing, and a step recorded as ended there stays ended.  Bounded:
    the oldest entries go first (a forgotten one only costs the transaction again)."""

    MAX = 65536

    def __init__(self, limit: int = MAX) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, int, int, str], str] = OrderedDict()

    @staticmethod
    def _level(state: str) -> str | None:
        if state in ("exited", "lost"):
            return "ended"
        return "running" if state == "running" else None

    def fresh(self, node: str, reports: Sequence[StepReport]) -> list[StepReport]:
        """The reports that may still change something in the store ("starting" never does)."""
        out = []
        with self._lock:
            for r in reports:
                level = self._level(r.state)
                if level is None:
                    continue
                seen = self._seen.get((node, r.attempt_id, r.step_id, r.token))
                if seen == "ended" or seen == level:
                    continue
                out.append(r)
        return out

    def applied(self, node: str, reports: Sequence[StepReport]) -> None:
        """These reports are recorded in the store (after the transaction committed)."""
        with self._lock:
            for r in reports:
                level = self._level(r.state)
                if level is None:
                    continue
                key = (node, r.attempt_id, r.step_id, r.token)
                if self._seen.get(key) != "ended":
                    self._seen[key] = level
                self._seen.move_to_end(key)
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)

    def ended(self, node: str, keys: Sequence[tuple[int, int, str]]) -> set[tuple[int, int]]:
        """Of these (attempt, step, token) reported ended, those recorded as ended here."""
        with self._lock:
            return {
                (aid, sid)
                for aid, sid, token in keys
                if self._seen.get((node, aid, sid, token)) == "ended"
            }
