"""The controller's preemption step, after each scheduling pass (docs/preemption.md).

The pass (domain/scheduling.plan) has started what fits. Pending jobs it left waiting for
resources whose tier is above some running job's are offered to victim selection
(domain/preemption.decide, with placement as the oracle of "frees enough"); each decision is
applied in one fenced store transaction (Store.preempt): the victims get a planned stop (their
checkpoint signal and grace; requeued without spending a retry, or cancelled in mode cancel)
and the preemptor a reservation on the nodes it will get, so no lower job backfills there.

Nothing happens when no two partitions or QOS differ in tier: clusters that do not configure
preemption pay one comparison a pass.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from phalanx.config import Config
from phalanx.domain import maintenance, preemption, reservations, scheduling
from phalanx.domain.placement_types import Allocation
from phalanx.errors import PhalanxError
from phalanx.store.preemption import victims_of
from phalanx.store.store import Fence, Store

log = logging.getLogger("phalanx.controller")

# The pass's reasons of jobs that wait for nodes (not for a dependency, a limit, a begin time)
_FOR_NODES = ("Resources", "Priority")
WAITING = "Preempting (waits for job{s} {ids} to checkpoint and leave its nodes)"


def waiting_reason(victims: list[int]) -> str:
    """The pending reason of a preemptor whose victims are still stopping."""
    ids = ", ".join(str(v) for v in sorted(victims))
    return WAITING.format(s="s" if len(victims) > 1 else "", ids=ids)


def preempt_pass(
    store: Store,
    config: Config,
    snap: Any,
    plan: scheduling.Plan,
    fences: dict[str, Fence],
    owner: dict[int, str],
    topo: Any,
    qos: Any = None,
) -> dict[int, str]:
    """Decide and apply this pass's preemptions; returns pending reasons to record (the
    preemptors waiting for their victims). ``owner``: job id -> the partition whose lease
    schedules it; ``fences``: the leases held."""
    # `qos`: the store's QOS (FairShare.qos_source: sacctmgr changes them), else the file's
    tiers = config.preemption.tiers(config.cluster, qos or config.fairshare)
    if not tiers.active:
        return {}
    now = time.time()
    floor = tiers.floor
    # without a pending job above the lowest tier waiting for nodes, or one waiting for its
    # victims, there is nothing to do: no store query (the common pass)
    maybe: list[tuple[dict[str, Any], int]] = []
    preempting = False
    for job in snap.pending:
        jid = int(job["id"])
        if str(job.get("reason") or "").startswith("Preempting"):
            preempting = True
        if plan.reasons.get(jid) not in _FOR_NODES:
            continue
        if scheduling.live_reservation(job, now):
            continue  # it already holds nodes (a restart, or an earlier preemption)
        tier = tiers.tier(str(job["partitions"]).split(",")[0], job.get("qos"))
        if tier > floor:
            maybe.append((job, tier))
    if not maybe and not preempting:
        return {}
    rows = store.preemption_rows()
    waiting = victims_of([r for r in rows if r["stopping"]])
    reasons = {jid: waiting_reason(v) for jid, v in waiting.items() if jid in owner}
    running = preemption.running_from_rows(rows, tiers)
    if not running:
        return reasons
    lowest = min(r.tier for r in running)
    views = scheduling.node_views(snap.nodes, snap.partitions, topo)
    # the trial placements keep off the nodes the pass keeps the job off (maintenance windows,
    # reservations): a victim stopped for a node the preemptor may not use frees nothing
    keep_off = maintenance.KeepOff(getattr(snap, "maintenance", None) or [], now)
    gate = reservations.Gate(getattr(snap, "resv", None) or [], now, [v.name for v in views])
    blocked = []
    for job, tier in maybe:
        if tier <= lowest or int(job["id"]) in waiting:
            continue
        req, waits = gate.admit(
            keep_off.restrict(scheduling.job_request(job)), job.get("reservation")
        )
        if waits is None:
            blocked.append((req, tier))
    if not blocked:
        return reasons
    blocked.sort(key=lambda b: -b[1])  # stable: queue order within a tier
    allocs = scheduling.allocations(snap.allocations) + _started(plan, snap)
    others: dict[str, int] = {}
    for r in getattr(snap, "reservations", None) or []:
        for name in scheduling.live_reservation(r, now):
            others.setdefault(name, int(r["id"]))
    decisions = preemption.decide(
        blocked,
        running,
        views,
        allocs,
        now,
        exempt_s=config.preemption.exempt_time,
        reserved_nodes=others,
        limit=config.preemption.max_per_pass,
    )
    graces = {int(r["job_id"]): float(r["grace_s"]) for r in rows}
    default_grace = config.timing.checkpoint_grace
    for d in decisions:
        fence = fences.get(owner.get(d.job_id, ""))
        if fence is None:
            continue
        why = f"tier {d.tier} over tier {max(v.tier for v in d.victims)}"
        stops = [
            (v.job_id, preemption.stop_reason(v.effective_mode(), d.job_id, why)) for v in d.victims
        ]
        grace = max((graces.get(v.job_id) or default_grace) for v in d.victims)
        until = now + grace + config.preemption.reserve_margin
        try:
            done = store.preempt(d.job_id, stops, d.placement.nodes, until, fence, why=why)
        except PhalanxError as e:
            log.warning("preemption for job %s not applied: %s", d.job_id, e)
            continue
        if done:
            log.info("job %s: %s", d.job_id, d.sentence(now))
            reasons[d.job_id] = waiting_reason(done)
    return reasons


def _started(plan: scheduling.Plan, snap: Any) -> list[Allocation]:
    """What this pass's starts hold (not in the snapshot's allocations yet)."""
    exclusive = {int(j["id"]): bool(j["exclusive"]) for j in snap.pending}
    return [a for p in plan.starts for a in preemption.holds(p, exclusive.get(p.job_id, False))]
