"""What happens to a job after one of its attempts ended: end, requeue (maybe later), or hold.

Pure: the store calls `after_attempt` inside the transaction that records the attempt's end
and applies the verdict. Every verdict's reason names the rule that fired, because "why did my
job (not) run again?" is the first question after a failure.

The rules, in the order they are checked:

* a cancelled attempt ends CANCELLED;
* an attempt that could not start because of the job itself (`job_error` from the node: its
  user is unknown there, it may not open its output file or enter its directory) ends FAILED
  with that reason: no retry, no backoff, no hold, and no blame on the node;
* a planned stop (`requeue: ...`: operator `drain --now`, a maintenance window, an operator
  requeue) requeues at once and never spends the job's retry budget: nothing went wrong;
* everything else is a *failure* of one kind (`FailureKind`): `node_fail` (a node died or
  fenced itself), `health` (a failing health check drained a node under the job), `launch`
  (the job never started), `hang` (no progress for `--progress-timeout`), `timeout`, `oom`,
  and `exit` (a plain nonzero exit code or a signal the scheduler did not send);
* a failure is retried only if its kind (or, for `exit`, its exit code) is in the job's
  `--retry-on` list, and only while the job has retries left (`--retries`, counted in
  `jobs.retries`). Node failures and health drains also need a requeue-able job (Slurm's
  `--requeue`, the cluster default), so `--no-requeue` keeps its Slurm meaning;
* launch failures keep their own counter and budget (`max_launch_failures`): they back off
  exponentially and then *hold* the job, since a job that cannot start never ran any code and
  needs someone to fix its environment rather than another try;
* other retries wait `retry_backoff` (base, doubling per retry, capped), except node failures
  and health drains, which restart at once: the job did nothing wrong and the failed node is
  avoided anyway;
* the nodes a failure happened on go on the job's avoid list (not for `timeout`/`oom`, which
  every node would repeat); the store drops the list when it would leave too few nodes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from phalanx.domain.states import JobState


class FailureKind(StrEnum):
    """Why an attempt failed, as `--retry-on` names it."""

    NODE_FAIL = "node_fail"
    HEALTH = "health"
    OOM = "oom"
    TIMEOUT = "timeout"
    LAUNCH = "launch"
    HANG = "hang"
    EXIT = "exit"


# Kinds that are the infrastructure's fault: they restart at once, without a backoff.
_NO_BACKOFF = frozenset({FailureKind.NODE_FAIL, FailureKind.HEALTH})
# Kinds that every node would repeat: the node is not put on the avoid list.
_NOT_THE_NODE = frozenset({FailureKind.TIMEOUT, FailureKind.OOM})

DEFAULT_RETRY_ON = "node_fail,health,launch,hang"
MAX_RETRIES_LIMIT = 10_000
_KIND_WORDS = ", ".join(k.value for k in FailureKind)
_RETRY_ON_HELP = (
    f"use a comma list of {_KIND_WORDS}, exit:N or exit:N-M (exit codes), all or none; "
    "e.g. node_fail,hang,exit:1,exit:137"
)


@dataclass(frozen=True)
class RetryOn:
    """Which failures retry: whole kinds, plus single exit codes when `exit` itself is not in."""

    kinds: frozenset[FailureKind] = frozenset()
    exit_codes: frozenset[int] = frozenset()

    def retries(self, kind: FailureKind, exit_code: int | None = None) -> bool:
        if kind in self.kinds:
            return True
        return kind is FailureKind.EXIT and exit_code is not None and exit_code in self.exit_codes

    def text(self) -> str:
        """The canonical spelling (what `parse_retry_on` reads back)."""
        words = [k.value for k in FailureKind if k in self.kinds]
        if FailureKind.EXIT not in self.kinds:
            words += [f"exit:{a}" if a == b else f"exit:{a}-{b}" for a, b in _runs(self.exit_codes)]
        return ",".join(words) or "none"


def _runs(codes: frozenset[int]) -> list[tuple[int, int]]:
    """Sorted codes as (first, last) runs of consecutive numbers."""
    runs: list[tuple[int, int]] = []
    for c in sorted(codes):
        if runs and runs[-1][1] == c - 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return runs


def parse_retry_on(text: str) -> RetryOn:
    """Parse `--retry-on`; raise ValueError saying what is wrong and what to write instead."""
    words = [w.strip().lower() for w in text.split(",")]
    words = [w if w.startswith("exit:") else w.replace("-", "_") for w in words]
    if not text.strip() or not all(words):
        raise ValueError(f"invalid --retry-on {text!r}: empty item; {_RETRY_ON_HELP}")
    if words == ["none"]:
        return RetryOn()
    if words == ["all"]:
        return RetryOn(frozenset(FailureKind))
    kinds: set[FailureKind] = set()
    codes: set[int] = set()
    for raw, word in zip(text.split(","), words, strict=True):
        if word in ("none", "all"):
            raise ValueError(f"invalid --retry-on {text!r}: {word} must stand alone")
        if word.startswith("exit:"):
            codes.update(_exit_codes(raw.strip(), word.removeprefix("exit:")))
            continue
        try:
            kinds.add(FailureKind(word))
        except ValueError:
            raise ValueError(
                f"invalid --retry-on {text!r}: unknown failure kind {raw.strip()!r}; "
                f"{_RETRY_ON_HELP}"
            ) from None
    return RetryOn(frozenset(kinds), frozenset(codes))


def _exit_codes(raw: str, spec: str) -> range:
    lo, dash, hi = spec.partition("-")
    ok = lo.isdecimal() and (not dash or hi.isdecimal())
    first, last = (int(lo), int(hi) if dash else int(lo)) if ok else (0, 0)
    if not ok or not 1 <= first <= last <= 255:
        raise ValueError(
            f"invalid --retry-on item {raw!r}: exit codes are whole numbers from 1 to 255, "
            "e.g. exit:1, exit:137 or exit:64-78 (exit 0 is success and never retried)"
        )
    return range(first, last + 1)


_SECONDS_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_seconds(text: str, what: str = "duration") -> float:
    """`5`, `2.5s`, `500ms`, `3m`, `1h` → seconds (a bare number is seconds)."""
    m = _SECONDS_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(
            f"invalid {what} {text!r}: use seconds, optionally with a unit, e.g. 10, 2.5s, 3m, 1h"
        )
    return float(m[1]) * _UNIT_S[(m[2] or "s").lower()]


def parse_backoff(text: str) -> tuple[float, float | None]:
    """`--retry-backoff=BASE[:MAX]` → (base, max or None for the cluster's maximum)."""
    base_text, colon, max_text = text.partition(":")
    base = parse_seconds(base_text, "--retry-backoff base")
    if not colon:
        return base, None
    cap = parse_seconds(max_text, "--retry-backoff maximum")
    if cap < base:
        raise ValueError(
            f"invalid --retry-backoff {text!r}: the maximum ({cap:g}s) is below the base "
            f"({base:g}s); write BASE:MAX with BASE <= MAX, e.g. 10:600"
        )
    return base, cap


def backoff(n: int, base: float, cap: float) -> float:
    """Wait before retry `n` (1 for the first): base, doubling per retry, at most `cap`."""
    if base <= 0 or n < 1:
        return 0.0
    exponent = min(n - 1, 64)  # 2**64 * base already exceeds any cap
    return float(min(cap, base * math.pow(2.0, exponent)))


@dataclass(frozen=True)
class RetryRules:
    """One job's retry rules: its own options where given, the cluster's defaults otherwise."""

    max_retries: int
    retry_on: RetryOn
    backoff_base: float
    backoff_max: float
    never: bool = False  # the job asked for --no-requeue: nothing retries, whatever the kind

    def delay(self, n: int) -> float:
        return backoff(n, self.backoff_base, self.backoff_max)

    def as_dict(self) -> dict[str, Any]:
        """For `phalanx show` and the API: the rules in force, as the options spell them."""
        return {
            "max_retries": self.max_retries,
            "retry_on": "none" if self.never else self.retry_on.text(),
            "backoff_base_s": self.backoff_base,
            "backoff_max_s": self.backoff_max,
        }


@dataclass(frozen=True)
class FailurePolicy:
    """Cluster-wide defaults (config `[retry]`, `[cluster]` and `[timing]`)."""

    max_launch_failures: int = 3  # failed launches before the job is held
    launch_backoff_base: float = 2.0  # seconds before the first retry; doubles each time
    launch_backoff_max: float = 60.0
    node_launch_failures_to_drain: int = 3  # failed launches in a row that drain a node
    max_retries: int = 5  # failure retries per job (Slurm's MaxBatchRequeue is 5 too)
    retry_on: str = DEFAULT_RETRY_ON
    retry_backoff_base: float = 10.0  # seconds before the first retry; doubles each time
    retry_backoff_max: float = 600.0

    def rules(
        self,
        *,
        retries: int | None = None,
        retry_on: str | None = None,
        retry_backoff: str | None = None,
        no_requeue: bool = False,
    ) -> RetryRules:
        """The rules for one job: what it asked for (spec fields, already validated at submit)
        over these defaults. `no_requeue`: the job itself said `--no-requeue`."""
        base, cap = self.retry_backoff_base, self.retry_backoff_max
        if retry_backoff is not None:
            base, given_cap = parse_backoff(retry_backoff)
            cap = given_cap if given_cap is not None else max(base, cap)
        return RetryRules(
            max_retries=self.max_retries if retries is None else retries,
            retry_on=parse_retry_on(retry_on if retry_on is not None else self.retry_on),
            backoff_base=base,
            backoff_max=cap,
            never=no_requeue,
        )

    def job_rules(self, spec: Mapping[str, Any] | None) -> RetryRules:
        """The rules for a stored job spec (`--retries`, `--retry-on`, `--retry-backoff`,
        `--no-requeue`); a spec whose values no longer parse gets the cluster's defaults
        rather than a crash (they were checked at submit)."""
        spec = spec or {}
        try:
            return self.rules(
                retries=spec.get("retries"),
                retry_on=spec.get("retry_on"),
                retry_backoff=spec.get("retry_backoff"),
                no_requeue=spec.get("requeue") is False,
            )
        except ValueError:
            return self.rules()


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
    retry: bool = False  # this requeue spends one of the job's retries
    kind: FailureKind | None = None  # the failure, if the attempt failed
    why: str | None = None  # the requeue's reason for /metrics when not `kind` (e.g. prolog)


@dataclass(frozen=True)
class TaskEnd:
    """How one task (one node) of the attempt ended, as the store recorded it."""

    node: str
    exit_code: int | None = None
    signal: int | None = None
    lost: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        d = self.detail
        return bool(
            self.lost
            or d.get("launch_failed")
            or d.get("timed_out")
            or d.get("hung")
            or d.get("oom")
            or self.exit_code not in (0,)
            or self.signal
        )

    @property
    def code(self) -> int | None:
        """The exit code as a shell reports it: a death by signal N counts as 128 + N."""
        if self.signal:
            return 128 + int(self.signal)
        return self.exit_code


@dataclass(frozen=True)
class Failure:
    """One classified failure: its kind, where it happened and a sentence saying what."""

    kind: FailureKind
    nodes: tuple[str, ...]
    cause: str
    exit_code: int | None = None


def describe_hang(node: str, hung: Mapping[str, Any]) -> str:
    """`hung: no progress for 30s since step 120 on n2` from a shepherd's `hung` record."""
    timeout = hung.get("timeout_s")
    step = hung.get("step")
    since = f" since step {step}" if step is not None else ""
    limit = f" for {float(timeout):g}s" if isinstance(timeout, int | float) else ""
    return f"hung: no progress{limit}{since} on {node}"


def health_node(stop_reason: str | None) -> str | None:
    """The node whose failing health check stopped the attempt (`requeue: N health check ...`,
    the store's wording in `apply_health`), or None for any other stop."""
    stop = stop_reason or ""
    m = re.match(r"requeue: (\S+) health check ", stop)
    return m[1] if m else None


def classify(
    *,
    result: JobState,
    reason: str | None,
    stop_reason: str | None,
    lost_nodes: Sequence[str],
    launch_failed: Sequence[tuple[str, str]],
    tasks: Sequence[TaskEnd],
) -> Failure | None:
    """The failure an ended attempt represents, or None (it succeeded, was cancelled, or a
    planned stop ended it)."""
    stop = stop_reason or ""
    if stop.startswith(("cancel", TIMEOUT_STOP)):
        return None
    node = health_node(stop)
    if node is not None:
        return Failure(FailureKind.HEALTH, (node,), stop.removeprefix("requeue: "))
    if stop.startswith("requeue"):
        return None
    if launch_failed:
        nd, error = launch_failed[0]
        nodes = tuple(sorted({n for n, _ in launch_failed}))
        return Failure(FailureKind.LAUNCH, nodes, f"launch failed on {nd} ({error})")
    if result is JobState.NODE_FAIL:
        return Failure(FailureKind.NODE_FAIL, tuple(sorted(set(lost_nodes))), reason or "")
    hung = [t for t in tasks if t.detail.get("hung")]
    if hung:
        t = hung[0]
        return Failure(
            FailureKind.HANG,
            tuple(sorted({h.node for h in hung})),
            describe_hang(t.node, t.detail["hung"]),
        )
    where = _first_failed(tasks)
    at = f" on {where.node}" if where else ""
    if result is JobState.TIMEOUT:
        return Failure(FailureKind.TIMEOUT, (), f"reached its time limit{at}")
    if result is JobState.OUT_OF_MEMORY:
        oom = next((t for t in tasks if t.detail.get("oom")), where)
        return Failure(FailureKind.OOM, (), f"out of memory{f' on {oom.node}' if oom else ''}")
    if result is JobState.FAILED or where is not None:
        if where is None:
            return Failure(FailureKind.EXIT, (), reason or "failed")
        if where.signal:
            cause = (
                f"task on {where.node} was killed by signal {where.signal} (exit code {where.code})"
            )
        else:
            cause = f"task on {where.node} exited with code {where.exit_code}"
        return Failure(FailureKind.EXIT, (where.node,), cause, where.code)
    return None


def _first_failed(tasks: Sequence[TaskEnd]) -> TaskEnd | None:
    """The task that failed first in rank order, skipping peers the scheduler stopped because
    of it (they report `cancelled`); those only if nothing else failed."""
    failed = [t for t in tasks if t.failed]
    own = [t for t in failed if not t.detail.get("cancelled")]
    return next(iter(own or failed), None)


# Stop reasons of a requeue asked for by a user (`scontrol requeue`/`requeuehold`, often the
# job itself from a signal trap). Both start with "requeue", so they are planned stops (never a
# failure, never a retry spent); a user's requeue also gets no checkpoint signal first (Slurm
# just terminates the job: the job asked for this and has saved what it needed).
USER_REQUEUE = "requeue: requested by "
USER_REQUEUE_HOLD = "requeue and hold: requested by "

# Stop reasons of a planned stop that ends the job TIMEOUT, not requeued and not a failure
# (Slurm's state for a job stopped when its reservation ends, ResvOverRun): the job gets its
# checkpoint signal first, like every planned stop, and ends with the rest of the reason.
TIMEOUT_STOP = "timeout: "


def is_timeout_stop(stop_reason: str | None) -> bool:
    return (stop_reason or "").startswith(TIMEOUT_STOP)


def user_requeue_reason(actor: str, *, hold: bool) -> str:
    """The stop reason recorded when `actor` requeues a running job."""
    return f"{USER_REQUEUE_HOLD if hold else USER_REQUEUE}{actor}"


def is_user_requeue(stop_reason: str | None) -> bool:
    """A stop a user asked for (scontrol requeue): no checkpoint signal before it."""
    return (stop_reason or "").startswith((USER_REQUEUE, USER_REQUEUE_HOLD))


def requeue_holds(stop_reason: str | None) -> bool:
    """The requeued job waits HELD for a release (scontrol requeuehold)."""
    return (stop_reason or "").startswith(USER_REQUEUE_HOLD)


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
    tasks: Sequence[TaskEnd] = (),
    retries: int = 0,
    rules: RetryRules | None = None,
) -> Verdict:
    """Decide the job's fate.

    `launch_failed`: (node, error) of tasks that never started; `launch_failures`: the job's
    failed launches before this one; `retries`: failure retries it used before this one;
    `requeue`: the job is requeue-able (its `--requeue`, or the cluster default); `rules`: its
    retry rules (the cluster's defaults if None).
    """
    stop = stop_reason or ""
    if stop.startswith("cancel: preempted by job "):  # preempt mode cancel: say who, why
        return Verdict(Action.END, JobState.CANCELLED, stop.removeprefix("cancel: "))
    if stop.startswith("cancel"):
        return Verdict(Action.END, JobState.CANCELLED, reason)
    if stop.startswith(TIMEOUT_STOP):  # e.g. its reservation ended: Slurm's TIMEOUT
        return Verdict(Action.END, JobState.TIMEOUT, stop.removeprefix(TIMEOUT_STOP))
    refused = next((t for t in tasks if t.detail.get("job_error")), None)
    if refused is not None:
        error = str(refused.detail.get("error") or f"the job could not start on {refused.node}")
        return Verdict(
            Action.END,
            JobState.FAILED,
            f"{error}; not retried: the job cannot run as submitted (not the node's fault)",
        )
    prolog = [t for t in tasks if t.detail.get("prolog_failed")]
    if prolog and not stop.startswith("requeue"):
        return after_prolog_failure(prolog, tasks, requeue=requeue)
    rules = rules or policy.rules()
    failure = classify(
        result=result,
        reason=reason,
        stop_reason=stop_reason,
        lost_nodes=lost_nodes,
        launch_failed=launch_failed,
        tasks=tasks,
    )
    if failure is None:
        if stop.startswith("requeue"):
            held = JobState.HELD if requeue_holds(stop) else JobState.PENDING
            return Verdict(Action.REQUEUE, held, stop)
        return Verdict(Action.END, result, reason)
    kind = failure.kind
    avoid = () if kind in _NOT_THE_NODE else failure.nodes
    if kind is FailureKind.LAUNCH:
        return _after_launch_failure(failure, launch_failed, launch_failures, policy, rules)
    end_state = JobState.NODE_FAIL if kind is FailureKind.HEALTH else result
    if end_state is JobState.COMPLETED:  # e.g. hung, then exited 0 on SIGTERM
        end_state = JobState.FAILED
    not_retried = _refusal(failure, rules, requeue=requeue, retries=retries)
    if not_retried is not None:
        cause = _cause_text(failure, requeued=False)
        return Verdict(
            Action.END,
            end_state,
            f"{cause}; not retried: {not_retried}",
            avoid=avoid,
            kind=kind,
        )
    n = retries + 1
    delay = 0.0 if kind in _NO_BACKOFF else rules.delay(n)
    when = f", starts in {delay:g}s at the earliest" if delay else ""
    return Verdict(
        Action.REQUEUE,
        JobState.PENDING,
        f"{_cause_text(failure, requeued=True)} (retry {n} of {rules.max_retries}{when})",
        retry_after=delay,
        avoid=avoid,
        retry=True,
        kind=kind,
    )


def after_prolog_failure(
    failed: Sequence[TaskEnd], tasks: Sequence[TaskEnd], *, requeue: bool
) -> Verdict:
    """A node's prolog failed (Slurm's rule): the job did not start there, the node is drained
    (the store does it from the task's exit record) and the job goes back to the queue at
    once, avoiding that node, without spending a retry or counting a launch failure: the fault
    is the node's, and the drain keeps it from repeating there.

    One exception: a job that is not requeue-able and whose processes had started on another
    of its nodes (nodes start independently) ends NODE_FAIL, since requeueing it would run
    its script again."""
    first = failed[0]
    nodes = tuple(sorted({t.node for t in failed}))
    cause = f"{first.detail.get('prolog_failed')} on {first.node}"
    started = [t for t in tasks if t.detail.get("started_at") and not t.detail.get("prolog_failed")]
    if started and not requeue:
        return Verdict(
            Action.END,
            JobState.NODE_FAIL,
            f"{cause}; not requeued: the job had started on {started[0].node} and is not "
            "requeue-able (--no-requeue, or the cluster's default_requeue)",
            avoid=nodes,
            why="prolog",
        )
    return Verdict(
        Action.REQUEUE,
        JobState.PENDING,
        f"{cause}; requeued without spending a retry ({', '.join(nodes)} drained)",
        avoid=nodes,
        why="prolog",
    )


def _cause_text(failure: Failure, *, requeued: bool) -> str:
    if failure.kind is FailureKind.NODE_FAIL:
        return f"{'requeued after ' if requeued else ''}node failure: {failure.cause}"
    if failure.kind is FailureKind.HEALTH:
        return f"{'requeued after ' if requeued else ''}failing health check on {failure.cause}"
    return f"{failure.cause}{'; requeued' if requeued else ''}"


def _refusal(failure: Failure, rules: RetryRules, *, requeue: bool, retries: int) -> str | None:
    """Why this failure is not retried, naming the rule; None if it is."""
    kind = failure.kind
    if rules.never:
        return "the job asked never to be requeued (--no-requeue)"
    if kind in (FailureKind.NODE_FAIL, FailureKind.HEALTH) and not requeue:
        return "the job is not requeue-able (--no-requeue, or the cluster's default_requeue)"
    listed = rules.retry_on.text()
    if not rules.retry_on.retries(kind, failure.exit_code):
        if kind is FailureKind.EXIT and failure.exit_code is not None:
            return f"exit code {failure.exit_code} is not in --retry-on ({listed})"
        return f"{kind.value} is not in --retry-on ({listed})"
    if retries >= rules.max_retries:
        if rules.max_retries == 0:
            return "the job allows no retries (--retries=0)"
        return f"all {rules.max_retries} retries used (--retries={rules.max_retries})"
    return None


def _after_launch_failure(
    failure: Failure,
    launch_failed: Sequence[tuple[str, str]],
    launch_failures: int,
    policy: FailurePolicy,
    rules: RetryRules,
) -> Verdict:
    """Launch failures have their own budget and end in HOLD, not in a terminal state."""
    n = launch_failures + 1
    node, error = launch_failed[0]
    nodes = failure.nodes
    if not rules.retry_on.retries(FailureKind.LAUNCH):
        return Verdict(
            Action.END,
            JobState.FAILED,
            f"launch failed on {node}: {error}; not retried: launch is not in --retry-on "
            f"({rules.retry_on.text()})",
            avoid=nodes,
            launch_failure=True,
            kind=FailureKind.LAUNCH,
        )
    if n >= policy.max_launch_failures:
        return Verdict(
            Action.HOLD,
            JobState.HELD,
            f"launch failed {n} times, last on {node}: {error}; "
            "fix the cause, then `phalanx release` the job",
            avoid=nodes,
            launch_failure=True,
            kind=FailureKind.LAUNCH,
        )
    delay = backoff(n, policy.launch_backoff_base, policy.launch_backoff_max)
    return Verdict(
        Action.REQUEUE,
        JobState.PENDING,
        f"launch failed on {node} ({error}); retry {n + 1} of "
        f"{policy.max_launch_failures} in {delay:g}s on another node",
        retry_after=delay,
        avoid=nodes,
        launch_failure=True,
        kind=FailureKind.LAUNCH,
    )
