"""How often a job should checkpoint: a fixed interval, or Young/Daly from measured inputs.

Young's first-order optimum for the time between checkpoints is `sqrt(2 * C * M)`, where C is
the time one checkpoint takes and M the mean time between failures of what the job runs on.
A job on N nodes fails when any of them does, so its M is the per-node MTBF divided by N.
The per-node MTBF comes from the cluster's own history (node-seconds observed over failures
seen), blended with a configured prior so a young cluster with no failures yet does not get
an infinite interval. Pure: the controller supplies the measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

AUTO = "auto"


@dataclass(frozen=True)
class IntervalDecision:
    """The checkpoint interval in force for one job, with the inputs that produced it."""

    mode: str  # "off" | "fixed" | "auto"
    seconds: float | None  # None: no periodic checkpoints
    cost_s: float | None = None  # C: measured (or assumed) duration of one checkpoint
    cost_source: str | None = None  # "measured" | "default"
    job_mtbf_s: float | None = None  # M for this job: node MTBF / nodes
    node_mtbf_s: float | None = None
    mtbf_source: str | None = None  # "prior" | "history"

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """`sqrt(2 * C * M)`: the interval that minimises expected lost work plus checkpoint cost."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError("checkpoint cost must be >= 0 and MTBF > 0")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def estimate_node_mtbf(
    node_seconds: float, failures: int, *, prior_s: float, prior_weight_s: float
) -> tuple[float, str]:
    """Per-node MTBF from history, starting from a prior worth `prior_weight_s` node-seconds.

    The estimate is (prior_weight + observed node time) / (prior failures + observed failures),
    with the prior counting as `prior_weight_s / prior_s` failures: with no history it is the
    prior, and history outweighs the prior as node time accumulates.
    """
    if prior_s <= 0 or prior_weight_s <= 0:
        raise ValueError("the MTBF prior and its weight must be > 0")
    prior_failures = prior_weight_s / prior_s
    mtbf = (prior_weight_s + max(0.0, node_seconds)) / (prior_failures + max(0, failures))
    return mtbf, ("history" if failures > 0 else "prior")


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
    """The interval a job gets from its `--checkpoint-interval` setting (seconds, "auto" or None)."""
    if setting is None or setting == 0:
        return IntervalDecision("off", None)
    if setting != AUTO:
        return IntervalDecision("fixed", max(minimum_s, float(setting)))
    cost = measured_cost_s if measured_cost_s is not None else default_cost_s
    job_mtbf = node_mtbf_s / max(1, nodes)
    return IntervalDecision(
        "auto",
        max(minimum_s, young_daly(cost, job_mtbf)),
        cost_s=cost,
        cost_source="measured" if measured_cost_s is not None else "default",
        job_mtbf_s=job_mtbf,
        node_mtbf_s=node_mtbf_s,
        mtbf_source=mtbf_source,
    )
