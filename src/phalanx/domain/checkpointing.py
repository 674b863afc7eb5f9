"""How often a job should checkpoint: a fixed interval, or Young/Daly from measured inputs.

Young's first-order optimum for the time between checkpoints is `sqrt(2 * C * M)`, where C is
the time one checkpoint takes and M the mean time between failures of what the job runs on:
checkpointing more often wastes time writing checkpoints, less often loses more work (on
average half an interval) at each failure, and the sum of the two is smallest there.

A job on N nodes fails when any of them does, so its M is the per-node MTBF divided by N.
The per-node MTBF comes from the cluster's own history (node-seconds observed over failures
seen), blended with a configured prior so a young cluster with no failures yet does not get an
infinite interval (see `estimate_node_mtbf`). C is the job's own measured checkpoint duration,
or a configured default until it has reported one.

Pure: the store supplies the events (`node_history` turns them into node time and failures)
and the measured durations (`median_cost`); docs/checkpoint-interval.md explains the choices.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

AUTO = "auto"

# History older than this does not count: hardware ages and is replaced, firmware is fixed,
# and a cluster's failure rate a year ago says little about next week.
FAILURE_WINDOW_S = 30 * 86400.0

# How many recent checkpoints the measured cost C is the median of (one slow write to a busy
# file system must not double the interval; a lasting change shows within a few checkpoints).
COST_SAMPLES = 5

# Node events that change whether a node is up (counted as observed node time) or mark a
# failure. `node.register` (first registration), `node.up` (back after DOWN) and `node.resume`
# (an operator resumed it, which also clears DOWN) start an up period; `node.down` ends one and
# is a failure; a `node.drain` whose data says `"failure": true` (a health check turned to
# `fail` and stopped its jobs) is a failure of a node that stays up (drained).
UP_KINDS = frozenset({"node.register", "node.up", "node.resume"})
DOWN_KIND = "node.down"
DRAIN_KIND = "node.drain"
HISTORY_KINDS = tuple(sorted(UP_KINDS | {DOWN_KIND, DRAIN_KIND}))


@dataclass(frozen=True)
class IntervalDecision:
    """The checkpoint interval in force for one job, with the inputs that produced it."""

    mode: str  # "off" | "fixed" | "auto"
    seconds: float | None  # None: no periodic checkpoints
    cost_s: float | None = None  # C: measured (or assumed) duration of one checkpoint
    cost_source: str | None = None  # "measured" | "default"
    job_mtbf_s: float | None = None  # M for this job: node MTBF / nodes
    node_mtbf_s: float | None = None
    mtbf_source: str | None = None  # "prior" | "prior+history" | "history"
    nodes: int | None = None  # the N that divides the node MTBF

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (`phalanx show --json`, the API): inputs that do not apply are left out."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """`sqrt(2 * C * M)`: the interval that minimises expected lost work plus checkpoint cost."""
    if not (cost_s >= 0 and mtbf_s > 0) or math.isinf(cost_s) or math.isinf(mtbf_s):
        raise ValueError(
            f"checkpoint cost must be a finite number >= 0 and MTBF finite and > 0 "
            f"(got cost {cost_s!r}, MTBF {mtbf_s!r})"
        )
    return math.sqrt(2.0 * cost_s * mtbf_s)


def estimate_node_mtbf(
    node_seconds: float, failures: int, *, prior_s: float, prior_weight_s: float
) -> tuple[float, str]:
    """Per-node MTBF from history, starting from a prior worth `prior_weight_s` node-seconds.

    The estimate is (prior weight + observed node time) / (prior failures + observed failures),
    with the prior counting as `prior_weight_s / prior_s` failures seen in `prior_weight_s` of
    node time. That is the posterior mean failure rate of a Poisson process under a Gamma prior,
    inverted: with no history it is exactly the prior; the prior's pull fades as observed node
    time grows past its weight; failures pull it down at once, and a long time without any
    pushes it up (never to infinity).

    The source says which side carries more weight: "prior" (nothing observed yet),
    "prior+history" (less node time observed than the prior is worth) or "history".
    """
    if not (prior_s > 0 and prior_weight_s > 0) or math.isinf(prior_s):
        raise ValueError(
            f"the MTBF prior and its weight must be finite and > 0 "
            f"(got prior {prior_s!r} s, weight {prior_weight_s!r} s)"
        )
    observed = max(0.0, node_seconds) if math.isfinite(node_seconds) else 0.0
    failures = max(0, failures)
    if observed <= 0 and failures == 0:
        return prior_s, "prior"  # exactly, not a rounding of weight / (weight / prior)
    prior_failures = prior_weight_s / prior_s
    mtbf = (prior_weight_s + observed) / (prior_failures + failures)
    return mtbf, ("prior+history" if observed < prior_weight_s else "history")


def parse_setting(setting: str | float | None) -> float | str | None:
    """A `--checkpoint-interval` value as stored: None/0/"off" -> None, "auto", or seconds > 0.

    Raises ValueError with what is wrong for anything else (negative, not a number).
    """
    if setting is None:
        return None
    if isinstance(setting, str):
        text = setting.strip().lower()
        if text in ("", "off", "none", "0"):
            return None
        if text == AUTO:
            return AUTO
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"checkpoint interval {setting!r} is not 'auto', 'off' or a number of seconds"
            ) from None
    elif isinstance(setting, bool):
        raise ValueError(f"checkpoint interval {setting!r} is not 'auto', 'off' or seconds")
    else:
        value = float(setting)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"checkpoint interval {setting!r} must be 'auto', 'off' or seconds >= 0")
    return None if value == 0 else value


def interval_in_force(
    setting: str | float | None,
    *,
    nodes: int,
    measured_cost_s: float | None,
    default_cost_s: float,
    node_mtbf_s: float,
    mtbf_source: str,
    minimum_s: float = 1.0,
) -> IntervalDecision:
    """The interval a job gets from its `--checkpoint-interval` setting (seconds, "auto" or None).

    A fixed interval is the user's explicit choice and is taken as given. "auto" is Young/Daly
    with the job's measured cost (or `default_cost_s` until it has one) and M = node MTBF /
    nodes, never below `minimum_s`: the formula gives absurdly short intervals from tiny
    measurements (a 10 ms checkpoint), and the floor keeps such jobs from writing continuously.
    """
    parsed = parse_setting(setting)
    if parsed is None:
        return IntervalDecision("off", None)
    if parsed != AUTO:
        return IntervalDecision("fixed", float(parsed))
    measured = measured_cost_s is not None and math.isfinite(measured_cost_s)
    cost = max(0.0, measured_cost_s or 0.0) if measured else default_cost_s
    n = max(1, nodes)
    job_mtbf = node_mtbf_s / n
    return IntervalDecision(
        "auto",
        max(minimum_s, young_daly(cost, job_mtbf)),
        cost_s=cost,
        cost_source="measured" if measured else "default",
        job_mtbf_s=job_mtbf,
        node_mtbf_s=node_mtbf_s,
        mtbf_source=mtbf_source,
        nodes=n,
    )


def node_history(
    before: Iterable[Mapping[str, Any]],
    during: Iterable[Mapping[str, Any]],
    *,
    start: float,
    now: float,
) -> tuple[float, int]:
    """Node-seconds up and node failures in the window [start, now], replayed from node events.

    `before`: for each node, its latest event of an `UP_KINDS` or `DOWN_KIND` kind before the
    window (says whether it was up when the window opened); `during`: the `HISTORY_KINDS`
    events inside the window. Each event is a mapping with `ts`, `node`, `kind` and `data`.
    A node counts as observed while it is up (registered and not DOWN; drained counts, it is
    still running its checks); a node never registered counts nothing.
    """
    up_since: dict[str, float | None] = {}
    for e in before:
        node = e.get("node")
        if node is None:
            continue
        up_since[node] = start if e["kind"] in UP_KINDS else None
    node_seconds = 0.0
    failures = 0
    for e in sorted(during, key=lambda e: (e["ts"], e.get("id") or 0)):
        node, kind = e.get("node"), e["kind"]
        if node is None or e["ts"] > now:
            continue
        ts = max(start, float(e["ts"]))
        since = up_since.get(node)
        if kind == DOWN_KIND:
            failures += 1
            if since is not None:
                node_seconds += max(0.0, ts - since)
            up_since[node] = None
        elif kind in UP_KINDS:
            if since is None:
                up_since[node] = ts
        elif kind == DRAIN_KIND and (e.get("data") or {}).get("failure") is True:
            failures += 1
    for since in up_since.values():
        if since is not None:
            node_seconds += max(0.0, now - since)
    return node_seconds, failures


def median_cost(events: Sequence[Mapping[str, Any]], samples: int = COST_SAMPLES) -> float | None:
    """The median checkpoint duration over the latest `samples` checkpoints, or None.

    `events`: `job.checkpoint` events, newest first, each with data `{duration_s, seq, ...}`.
    Several events with one `seq` (one per rank of a multi-node job) are one checkpoint, and
    it took as long as its slowest rank. Events without a usable duration (a job that wrote its
    marker file by hand) are skipped.
    """
    by_seq: dict[Any, float] = {}
    order: list[Any] = []
    for i, e in enumerate(events):
        data = e.get("data") or {}
        d = data.get("duration_s")
        if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d) or d < 0:
            continue
        seq = data.get("seq")
        key = ("seq", seq) if seq is not None else ("event", i)
        if key not in by_seq:
            if len(order) == samples:
                continue
            order.append(key)
            by_seq[key] = float(d)
        else:
            by_seq[key] = max(by_seq[key], float(d))
    if not order:
        return None
    return float(statistics.median(by_seq[k] for k in order))


def human_seconds(seconds: float) -> str:
    """A short duration for people: 4.1s, 95s, 12.6m, 3.2h, 30d."""
    s = abs(seconds)
    if s < 10:
        return f"{seconds:.2g}s" if s < 1 else f"{seconds:.1f}s"
    if s < 120:
        return f"{seconds:.0f}s"
    if s < 7200:
        return f"{seconds / 60:.1f}m"
    if s < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def describe(decision: Mapping[str, Any]) -> str:
    """One line for `phalanx show`, from an `IntervalDecision.as_dict()` (as the API returns it).

    auto:  `auto 612s (C=4.1s measured, M=21.1m = node MTBF 0.9d from history / 64 nodes)`
    fixed: `600s (fixed)`; off: `off`.
    """
    mode = decision.get("mode") or "off"
    seconds = decision.get("seconds")
    if mode == "off" or seconds is None:
        return "off"
    if mode == "fixed":
        return f"{seconds:.0f}s (fixed)"
    parts = []
    if decision.get("cost_s") is not None:
        parts.append(f"C={human_seconds(decision['cost_s'])} {decision.get('cost_source', '')}")
    if decision.get("job_mtbf_s") is not None:
        m = f"M={human_seconds(decision['job_mtbf_s'])}"
        if decision.get("node_mtbf_s") is not None:
            m += f" = node MTBF {human_seconds(decision['node_mtbf_s'])}"
            if decision.get("mtbf_source"):
                m += f" from {decision['mtbf_source']}"
            if decision.get("nodes"):
                n = decision["nodes"]
                m += f" / {n} node{'s' if n != 1 else ''}"
        parts.append(m)
    inputs = f" ({', '.join(p.strip() for p in parts)})" if parts else ""
    return f"{mode} {seconds:.0f}s{inputs}"


def cluster_mtbf(
    node_seconds: float,
    failures: int,
    *,
    prior_s: float,
    prior_weight_s: float,
    window_s: float = FAILURE_WINDOW_S,
) -> dict[str, Any]:
    """The cluster's node MTBF estimate with its inputs, for `/v1/cluster` and `phalanx cluster`."""
    mtbf, source = estimate_node_mtbf(
        node_seconds, failures, prior_s=prior_s, prior_weight_s=prior_weight_s
    )
    return {
        "node_mtbf_s": mtbf,
        "source": source,
        "node_seconds": node_seconds,
        "failures": failures,
        "window_s": window_s,
        "prior_s": prior_s,
        "prior_weight_s": prior_weight_s,
    }


def describe_cluster_mtbf(d: Mapping[str, Any]) -> str:
    """`Node MTBF: 1.4d from history (64.0 node-days up, 64 failures in the last 30.0d; prior
    30.0d worth 30.0d of node time)`."""
    return (
        f"Node MTBF: {human_seconds(d['node_mtbf_s'])} from {d['source']} "
        f"({d['node_seconds'] / 86400:.1f} node-days up, {d['failures']} "
        f"failure{'s' if d['failures'] != 1 else ''} in the last {human_seconds(d['window_s'])}; "
        f"prior {human_seconds(d['prior_s'])} worth {human_seconds(d['prior_weight_s'])} "
        "of node time)"
    )
