"""The periodic checkpoint interval in force for a job, with its inputs.

`CheckpointIntervals` answers for the heartbeat replies (every running job, every heartbeat),
`phalanx show` and `/metrics`. Fixed intervals need no store; "auto" is Young/Daly
(domain/checkpointing.py) from the job's measured checkpoint cost and the cluster's node MTBF,
both read from the store and cached briefly here, since agents ask on every heartbeat.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from phalanx.config import Timing
from phalanx.domain import checkpointing
from phalanx.domain.checkpointing import IntervalDecision
from phalanx.errors import PhalanxError
from phalanx.store.surface import HistoryStore

CHECKPOINT_INPUT_TTL = 10.0  # seconds a job's measured checkpoint cost is reused
FAILURE_HISTORY_TTL = 60.0  # seconds the cluster's failure history (node MTBF) is reused


class CheckpointIntervals:
    def __init__(self, store: HistoryStore, timing: Callable[[], Timing]) -> None:
        self.store = store  # checkpoint costs and the failure history only
        self.timing = timing  # the timings in force (controller/timings.py)
        # --checkpoint-interval=auto inputs: job id -> (monotonic time, measured cost), and
        # (monotonic time, (node-seconds, failures)) of the cluster's failure history
        self._cost_cache: dict[int, tuple[float, float | None]] = {}
        self._failure_history: tuple[float, tuple[float, int]] | None = None

    def in_force(self, job_row: dict[str, Any]) -> IntervalDecision:
        """The periodic checkpoint interval in force for a job, with its inputs.

        `job_row`: a jobs row (get_job) or a node_work row. Fixed intervals need no store
        access; "auto" is Young/Daly from the job's measured checkpoint cost and the cluster's
        node MTBF (failure history blended with the configured prior), both cached briefly
        since agents ask on every heartbeat.
        """
        spec = job_row.get("spec") or {}
        setting = (spec.get("checkpoint_parsed") or {}).get("interval_s")
        nodes = (
            len(job_row["attempt_nodes"]) if job_row.get("attempt_nodes") else job_row.get("nodes")
        )
        t = self.timing()
        if setting != checkpointing.AUTO:
            return checkpointing.interval_in_force(
                setting,
                nodes=int(nodes or 1),
                measured_cost_s=None,
                default_cost_s=t.default_checkpoint_cost_s,
                node_mtbf_s=t.node_mtbf_prior_s,
                mtbf_source="prior",
            )
        job_id = int(job_row.get("job_id") or job_row["id"])
        now = time.monotonic()
        cached = self._cost_cache.get(job_id)
        if cached is None or now - cached[0] > CHECKPOINT_INPUT_TTL:
            cached = (now, self.store.checkpoint_cost(job_id))
            self._cost_cache[job_id] = cached
            if len(self._cost_cache) > 10_000:
                self._cost_cache.clear()
        history = self._failure_history
        if history is None or now - history[0] > FAILURE_HISTORY_TTL:
            history = (now, self.store.failure_history(time.time()))
            self._failure_history = history
        node_seconds, failures = history[1]
        mtbf, source = checkpointing.estimate_node_mtbf(
            node_seconds,
            failures,
            prior_s=t.node_mtbf_prior_s,
            prior_weight_s=t.node_mtbf_prior_weight_s,
        )
        return checkpointing.interval_in_force(
            checkpointing.AUTO,
            nodes=int(nodes or 1),
            measured_cost_s=cached[1],
            default_cost_s=t.default_checkpoint_cost_s,
            node_mtbf_s=mtbf,
            mtbf_source=source,
            minimum_s=t.checkpoint_interval_min_s,
        )

    def for_metrics(self, rows: list[dict[str, Any]]) -> list[float]:
        """Periodic checkpoint intervals in force for these running jobs (for /metrics)."""
        out = []
        for row in rows:
            with contextlib.suppress(PhalanxError, KeyError, TypeError, ValueError):
                seconds = self.in_force(row).seconds
                if seconds:
                    out.append(float(seconds))
        return out
