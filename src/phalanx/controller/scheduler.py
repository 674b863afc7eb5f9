"""The scheduling pass: plan over the store's snapshot, then start, refuse and preempt.

`Scheduler.tick` runs one pass over the partitions whose `sched:<partition>` lease this
controller holds: it reads the snapshot, plans with the pure domain/scheduling.py (the same
options `phalanx explain` uses, `plan_options`), applies the starts in fenced writes (the fence
asked for again before each partition's write), preempts (controller/preemption.py) and
records why the others wait. Its own module so that the pass reads top to bottom.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from phalanx.config import Config
from phalanx.controller.fairshare import FairShare
from phalanx.controller.leases import LeaseKeeper
from phalanx.controller.metrics import (
    PASS_TIMES,
    SCHED_PASS_PLACEMENTS,
    SCHED_PASS_SECONDS,
    observe_placements,
)
from phalanx.controller.preemption import preempt_pass
from phalanx.controller.wakeups import Waiters
from phalanx.domain import scheduling
from phalanx.domain.states import JobState
from phalanx.errors import PhalanxError
from phalanx.store.store import Fence, Store

STARTED = Counter("phalanx_jobs_started_total", "Attempts started by this controller's scheduler")
SCHED_NOTICES = Counter(
    "phalanx_sched_notices_total",
    "Notifications this controller sent the scheduling lease holders of new work (PostgreSQL)",
)


def sched_lease(partition: str) -> str:
    """The lease whose holder schedules one partition's jobs."""
    return f"sched:{partition}"


class Scheduler:
    def __init__(
        self,
        store: Store,  # the whole store: preempt_pass takes it
        config: Config,
        leases: LeaseKeeper,
        fairshare: FairShare,
        *,
        topology: Any,
        waiters: Waiters,
    ) -> None:
        self.store = store
        self.config = config
        self.leases = leases
        self.fairshare = fairshare  # the queue policy: priority, fair share, limits
        self.topology = topology
        self.waiters = waiters  # the long-polls of nodes given work
        self.partition_names = [p.name for p in config.cluster.partitions]
        self.placed = 0  # attempts the current scheduling pass started (for /metrics)
        # new work since the last pass: the holders of the leases we lack are told
        # (store.notify_schedulers) instead of finding it at their next interval
        self._news = threading.Event()
        self.notices = 0  # notifications sent (store.notify_schedulers)
        # whether this controller runs the configuration version a snapshot saw as current
        # (controller/confversions.py): a pass is skipped until it does
        self.config_check: Callable[[int | None], bool] | None = None

    def news(self) -> None:
        """This controller committed something a pass may act on (a submission, a job's end,
        a node back): its next tick tells the other holders, if it lacks any lease."""
        self._news.set()

    def plan_options(self, snap: Any) -> dict[str, Any]:
        """What a scheduling pass over `snap` takes besides the snapshot (scheduling.plan's
        keywords): the queue policy (priority, limits), the licence totals, the topology. The
        scheduler and `phalanx explain` use the same, so an explanation agrees with the pass."""
        return {
            "policy": self.fairshare.policy(snap),
            "license_totals": self.config.cluster.license_totals(),
            "topo": self.topology,
            "queue_depth": self.config.cluster.queue_depth,
        }

    def tick(self) -> str:
        """One scheduling pass over the partitions whose `sched:<partition>` lease we hold.

        A job belongs to the lease of the first partition it lists (it may still be placed in
        another of its partitions); the write re-checks node capacity, so holders of different
        partitions that share nodes never double-book them.
        """
        fences = self._sched_fences()
        self._tell_the_holders(fences)
        if not fences:
            return "idle"
        start = time.perf_counter()
        self.placed = 0
        try:
            return self._schedule(fences)
        finally:
            took = time.perf_counter() - start
            SCHED_PASS_SECONDS.observe(took)
            PASS_TIMES.record(took)
            SCHED_PASS_PLACEMENTS.observe(self.placed)

    def _tell_the_holders(self, fences: dict[str, Fence]) -> None:
        """After news, one notification for the controllers holding the scheduling leases
        this one lacks (a burst of news between two ticks is one notification). Best effort:
        without it they find the work at their next interval."""
        if not self._news.is_set():
            return
        self._news.clear()
        if len(fences) == len(self.partition_names):
            return
        with contextlib.suppress(PhalanxError):
            if self.store.notify_schedulers():
                self.notices += 1
                SCHED_NOTICES.inc()

    def _sched_fences(self) -> dict[str, Fence]:
        out = {}
        for name in self.partition_names:
            fence = self.leases.fence(sched_lease(name))
            if fence is not None:
                out[name] = fence
        return out

    def _schedule(self, fences: dict[str, Fence]) -> str:
        now = time.time()
        snap = self.store.sched_snapshot(eligible_by=now)
        if snap.quiet:
            return "idle"
        if self.config_check is not None and not self.config_check(snap.config_version):
            return f"skipped: cluster configuration version {snap.config_version} not run yet"
        owner = {int(j["id"]): j["partitions"].split(",")[0] for j in snap.pending}
        snap.pending = [j for j in snap.pending if owner[int(j["id"])] in fences]
        snap.not_yet = [j for j in snap.not_yet if j["partitions"].split(",")[0] in fences]
        options = self.plan_options(snap)
        totals = options["license_totals"]
        plan = scheduling.plan(snap, now, **options)
        for jid, why in plan.never:
            self.store.end_pending(jid, JobState.CANCELLED, why, fences[owner[jid]])
        started: list[int] = []
        if plan.starts:
            exclusive = {int(j["id"]): bool(j["exclusive"]) for j in snap.pending}
            licensed = {int(j["id"]): j.get("licenses") for j in snap.pending}
            by_lease: dict[str, list[dict[str, Any]]] = {}
            for p in plan.starts:
                by_lease.setdefault(owner[p.job_id], []).append(
                    p.start_item(exclusive=exclusive[p.job_id], licenses=licensed.get(p.job_id))
                )
            for part, starts in sorted(by_lease.items()):
                # the lease deadline may pass mid-cycle: re-check before each write
                fence = self.leases.fence(sched_lease(part))
                if fence is None:
                    continue
                started += self.store.start_attempts(starts, fence, license_totals=totals)
            STARTED.inc(len(started))
            self.placed = len(started)
            self._observe_starts(snap.pending, started)
            self.waiters.notify(sorted({n for p in plan.starts for n in p.nodes}))
        plan.reasons.update(
            preempt_pass(
                self.store,
                self.config,
                snap,
                plan,
                fences,
                owner,
                self.topology,
                qos=self.fairshare.qos_source(),
            )
        )
        current = {int(j["id"]): j["reason"] for j in snap.pending}
        changed = {jid: r for jid, r in plan.reasons.items() if current.get(jid) != r}
        self.store.set_pending_reasons(changed)
        if not (plan.starts or plan.never):
            return "idle"
        return plan.sentence() + (
            f" (applied {len(started)})" if len(started) != len(plan.starts) else ""
        )

    def _observe_starts(self, pending: list[dict[str, Any]], started: list[int]) -> None:
        """Queue-wait and submit-to-start histograms of /metrics (controller/metrics.py)."""
        now = time.time()
        ids = set(started)
        rows = [j for j in pending if int(j["id"]) in ids]
        again = [int(j["id"]) for j in rows if int(j.get("restart_count") or 0) > 0]
        requeued_at: dict[int, float] = {}
        if again:
            with contextlib.suppress(PhalanxError):
                requeued_at = self.store.queue_entries(again)
        observe_placements(rows, now, requeued_at)
