"""``GET /v1/diag``: this controller's scheduler and API statistics since it started, what
Slurm's ``sdiag`` prints (slurm/sdiag.py formats them).

Counters are this process's (as slurmctld's are its own since its start): submissions it
accepted, attempts its scheduler started, its scheduling passes (count, mean, last, longest),
its API calls by route (count and time).  Jobs completed, cancelled and failed since then, and
jobs pending and running now, come from the store, so they are the cluster's.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from phalanx.controller.metrics import PASS_TIMES, SINCE
from phalanx.domain.states import JobState
from phalanx.store.surface import HistoryStore

# final states sdiag counts under each of its three words
COMPLETED = (JobState.COMPLETED.value,)
CANCELED = (JobState.CANCELLED.value,)
FAILED = tuple(
    s.value for s in (JobState.FAILED, JobState.TIMEOUT, JobState.NODE_FAIL, JobState.OUT_OF_MEMORY)
)


def diag_view(
    store: HistoryStore, registry: CollectorRegistry = REGISTRY, now: float | None = None
) -> dict[str, Any]:
    now = time.time() if now is None else now
    value = registry.get_sample_value
    by_state = store.cluster_counts()["jobs"]
    ended = store.ended_since(SINCE)
    passes = int(value("phalanx_scheduling_pass_seconds_count") or 0)
    pass_s = float(value("phalanx_scheduling_pass_seconds_sum") or 0.0)
    return {
        "now": now,
        "since": SINCE,
        "server_threads": threading.active_count(),
        "jobs_submitted": int(value("phalanx_jobs_submitted_total") or 0),
        "jobs_started": int(value("phalanx_jobs_started_total") or 0),
        "jobs_completed": sum(ended.get(s, 0) for s in COMPLETED),
        "jobs_canceled": sum(ended.get(s, 0) for s in CANCELED),
        "jobs_failed": sum(ended.get(s, 0) for s in FAILED),
        "jobs_pending": int(by_state.get(JobState.PENDING.value, 0)),
        "jobs_running": int(by_state.get(JobState.RUNNING.value, 0)),
        "passes": passes,
        "pass_last_s": PASS_TIMES.last_s,
        "pass_max_s": PASS_TIMES.max_s,
        "pass_mean_s": pass_s / passes if passes else 0.0,
        "rpcs": _rpcs(registry),
    }


def _rpcs(registry: CollectorRegistry) -> list[dict[str, Any]]:
    """API calls by route and method: count and total seconds (all statuses together)."""
    count: dict[tuple[str, str], float] = defaultdict(float)
    total: dict[tuple[str, str], float] = defaultdict(float)
    for family in registry.collect():
        if family.name != "phalanx_http_request_duration_seconds":
            continue
        for sample in family.samples:
            key = (sample.labels.get("route", ""), sample.labels.get("method", ""))
            if sample.name.endswith("_count"):
                count[key] += sample.value
            elif sample.name.endswith("_sum"):
                total[key] += sample.value
    return [
        {"route": r, "method": m, "count": int(n), "total_s": total[(r, m)]}
        for (r, m), n in count.items()
        if n
    ]
