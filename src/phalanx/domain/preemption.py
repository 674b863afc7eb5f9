"""Preemption as pure decisions: which running jobs a blocked higher-tier job stops, and how.

Partitions and QOS carry a *priority tier* (Slurm's ``PriorityTier``) and a *preempt mode*
(Slurm's ``PreemptMode``: ``requeue``, the default, ``cancel`` or ``off``). A pending job that
cannot start for want of resources may stop running jobs of a strictly lower tier. Victims are
chosen to lose as little work as possible:

1. the time since each victim's last recorded checkpoint (since its start when it has none):
   the work a stop throws away;
2. then its size (node count, then CPUs): a smaller job costs less to redo;
3. then its age: the youngest first (Slurm's habit), it has the least invested.

Victims are whole jobs (every node of a multi-node job, spares too, or none of it: a gang job
is never half-stopped). A job that started less than ``exempt_s`` ago is not preempted
(Slurm's ``PreemptExemptTime``), nor is one already being stopped (a victim of an earlier pass
is not chosen twice).

Whether a set of victims frees enough is placement's question (``fits``): the shortest run of
candidates in loss order after which the job fits (by bisection), then every chosen victim the
job does not need after all is dropped, costliest first. Nothing here reads a clock or touches
I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from phalanx.domain.placement import place
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView, Placement


class Mode(StrEnum):
    """What happens to a victim (Slurm's PreemptMode)."""

    OFF = "off"  # never preempted
    REQUEUE = "requeue"  # checkpoint signal, grace, back to the queue; no retry spent
    CANCEL = "cancel"  # checkpoint signal, grace, ends CANCELLED (sacct: PREEMPTED)


MODES = tuple(m.value for m in Mode)

# The stop reasons a preemption writes on the victim's attempt. They start with "requeue" /
# "cancel", so the rest of the system treats them as the planned stop / the cancel they are
# (domain/policy.py); what follows names the preemptor.
REQUEUE_PREFIX = "requeue: preempted by job "
CANCEL_PREFIX = "cancel: preempted by job "


def stop_reason(mode: Mode, preemptor: int, why: str) -> str:
    """The victim attempt's stop reason: ``requeue: preempted by job 12 (tier 2 > 1)``."""
    prefix = CANCEL_PREFIX if mode is Mode.CANCEL else REQUEUE_PREFIX
    return f"{prefix}{preemptor} ({why})"


def is_preemption(stop: str | None) -> bool:
    """A stop reason written by a preemption (either mode)."""
    return (stop or "").startswith((REQUEUE_PREFIX, CANCEL_PREFIX))


def preemptor_of(stop: str | None) -> int | None:
    """The job whose preemption this stop reason records, or None."""
    text = stop or ""
    for prefix in (REQUEUE_PREFIX, CANCEL_PREFIX):
        if text.startswith(prefix):
            head = text[len(prefix) :].split(" ", 1)[0]
            return int(head) if head.isdecimal() else None
    return None


@dataclass(frozen=True)
class Tiers:
    """Tiers and modes per partition and per QOS (config ``[[cluster.partitions]]`` and
    ``[[fairshare.qos]]`` ``priority_tier``/``preempt_mode``).

    A job's tier is its QOS's when the QOS sets one, else that of its partition (the one it
    runs in; for a pending job, the first it lists). A victim's mode likewise: its QOS's, else
    its partition's, else ``requeue``.
    """

    partition_tier: Mapping[str, int] = field(default_factory=dict)
    partition_mode: Mapping[str, Mode] = field(default_factory=dict)
    qos_tier: Mapping[str, int] = field(default_factory=dict)
    qos_mode: Mapping[str, Mode] = field(default_factory=dict)

    def tier(self, partition: str | None, qos: str | None) -> int:
        if qos is not None and qos in self.qos_tier:
            return int(self.qos_tier[qos])
        return int(self.partition_tier.get(partition or "", 0))

    def mode(self, partition: str | None, qos: str | None) -> Mode:
        if qos is not None and qos in self.qos_mode:
            return self.qos_mode[qos]
        return self.partition_mode.get(partition or "", Mode.REQUEUE)

    @property
    def floor(self) -> int:
        """The lowest tier any job can have (0 unless every partition and QOS is above)."""
        tiers = list(self.partition_tier.values()) or [0]
        return min(min(tiers), *self.qos_tier.values()) if self.qos_tier else min(tiers)

    @property
    def active(self) -> bool:
        """Whether any two jobs can differ in tier (else preemption never happens)."""
        tiers = set(self.partition_tier.values()) | set(self.qos_tier.values()) | {0}
        return len(tiers) > 1


@dataclass(frozen=True)
class Running:
    """A running job as victim selection sees it."""

    job_id: int
    tier: int
    nodes: tuple[str, ...]  # every node it holds (spares included)
    cpus: int  # CPUs held over all its nodes
    start_time: float
    last_checkpoint: float | None  # when its latest checkpoint finished (None: never)
    mode: Mode = Mode.REQUEUE
    stopping: bool = False  # its attempt is already being stopped (any reason)
    requeue: bool = True  # requeue-able: a --no-requeue job is cancelled instead

    def work_at_risk(self, now: float) -> float:
        """Seconds of work a stop now throws away: since the last checkpoint, else the start."""
        since = self.last_checkpoint if self.last_checkpoint is not None else self.start_time
        return max(0.0, now - max(since, self.start_time))

    def loss_key(self, now: float) -> tuple[float, int, int, float, int]:
        """Order of preference as a victim (smallest first): work lost, size, age (youngest
        first), id (a stable tie-break)."""
        return (self.work_at_risk(now), len(self.nodes), self.cpus, -self.start_time, self.job_id)

    def effective_mode(self) -> Mode:
        """Requeue mode on a job that may not be requeued (--no-requeue) cancels it, as Slurm
        does."""
        if self.mode is Mode.REQUEUE and not self.requeue:
            return Mode.CANCEL
        return self.mode


def candidates(running: Iterable[Running], tier: int, now: float, exempt_s: float) -> list[Running]:
    """The jobs a job of ``tier`` may preempt, best victims first: strictly lower tier, mode
    not off, not already stopping, running at least ``exempt_s``."""
    out = [
        r
        for r in running
        if r.tier < tier
        and r.mode is not Mode.OFF
        and not r.stopping
        and now - r.start_time >= exempt_s
    ]
    out.sort(key=lambda r: r.loss_key(now))
    return out


def choose(
    pool: Sequence[Running], fits: Callable[[frozenset[int]], bool], now: float
) -> tuple[Running, ...] | None:
    """The victims (whole jobs) whose stop lets the job fit, or None if even all do not.

    ``fits(ids)``: whether the job fits once the jobs ``ids`` are gone (monotone: removing
    more never hurts). The shortest prefix of the loss order that fits (found by bisection,
    so a few placements however many candidates), then every victim not needed after all is
    given back, costliest first, so the set is minimal (no victim can be spared). None too when
    the job fits with no victim at all: nothing needs stopping."""
    if not pool or fits(frozenset()):
        return None
    order = sorted(pool, key=lambda r: r.loss_key(now))
    ids = [r.job_id for r in order]
    if not fits(frozenset(ids)):
        return None  # even every candidate would not free enough: one placement, not n
    # the shortest prefix of the loss order that fits (fits is monotone: binary search)
    lo, hi = 1, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(frozenset(ids[:mid])):
            hi = mid
        else:
            lo = mid + 1
    chosen = order[:lo]
    for r in sorted(chosen, key=lambda r: r.loss_key(now), reverse=True):
        rest = [c for c in chosen if c is not r]
        if rest and fits(frozenset(c.job_id for c in rest)):
            chosen = rest
    return tuple(sorted(chosen, key=lambda r: r.loss_key(now)))


@dataclass(frozen=True)
class Decision:
    """One preemption: ``job_id`` will start on ``placement``'s nodes once ``victims`` left."""

    job_id: int
    tier: int
    victims: tuple[Running, ...]
    placement: Placement

    def sentence(self, now: float) -> str:
        """``preempting jobs 3 (tier 0, 40s since its last checkpoint), 4 (...)``."""
        parts = []
        for v in self.victims:
            ck = "checkpoint" if v.last_checkpoint is not None else "start"
            parts.append(
                f"{v.job_id} (tier {v.tier}, {v.effective_mode().value}, "
                f"{v.work_at_risk(now):.0f}s since its {ck})"
            )
        return f"preempting job{'s' if len(parts) > 1 else ''} {', '.join(parts)}"


def holds(p: Placement, exclusive: bool) -> list[Allocation]:
    """What a decided (not yet started) placement will hold: so a second preemptor in the
    same pass does not count on the same freed capacity, and the pass's own starts count
    before the controller's preemption step looks for victims."""
    return [
        Allocation(
            job_id=p.job_id,
            node=n,
            cpus=p.cpus_per_node,
            mem_mb=p.mem_per_node_mb[i],
            gpu_ids=p.gpu_ids[i] if i < len(p.gpu_ids) else (),
            exclusive=exclusive,
            expected_end=None,
        )
        for i, n in enumerate(p.nodes)
    ]


def decide(
    blocked: Sequence[tuple[JobRequest, int]],
    running: Sequence[Running],
    views: Sequence[NodeView],
    allocs: Sequence[Allocation],
    now: float,
    *,
    exempt_s: float = 0.0,
    reserved_nodes: Mapping[str, int] | None = None,
    limit: int = 16,
) -> list[Decision]:
    """Preemptions for the ``blocked`` pending jobs ((request, tier), in the order they should
    be served: higher tier first, then queue order).

    ``allocs``: everything held now (running jobs and the starts of this pass). Each decision
    takes its victims out of the pool and adds its own future holds, so later jobs neither
    count on the same capacity nor pick a victim twice. ``reserved_nodes``: nodes other
    pending jobs hold reservations on (kept out of the trial placements). At most ``limit``
    decisions (a pass does not start a storm of stops).
    """
    out: list[Decision] = []
    taken: set[int] = set()
    extra: list[Allocation] = []
    for req, tier in blocked:
        if len(out) >= limit:
            break
        usable = {v.name for v in views if v.partitions & set(req.partitions)}
        pool = [
            r
            for r in candidates(running, tier, now, exempt_s)
            if r.job_id not in taken and usable.intersection(r.nodes)
        ]
        if not pool:
            continue
        trial = replace(req, reserved=())
        found: dict[frozenset[int], Placement] = {}

        base = [a for a in allocs if a.job_id not in taken] + extra

        def fits(
            ids: frozenset[int],
            trial: JobRequest = trial,
            base: list[Allocation] = base,
            found: dict[frozenset[int], Placement] = found,
        ) -> bool:
            left = [a for a in base if a.job_id not in ids]
            got = place([trial], views, left, now, backfill=False, reserved_nodes=reserved_nodes)
            if got:
                found[ids] = got[0]
            return bool(got)

        victims = choose(pool, fits, now)
        if victims is None:
            continue
        ids = frozenset(v.job_id for v in victims)
        p = found.get(ids)  # choose() ends on a set it saw fit
        if p is None:
            if not fits(ids):
                continue
            p = found[ids]
        taken |= ids
        extra += holds(p, req.exclusive)
        out.append(Decision(req.job_id, tier, victims, p))
    return out


def running_from_rows(rows: Iterable[Mapping[str, Any]], tiers: Tiers) -> list[Running]:
    """Running jobs from the store's preemption rows (Store.preemption_rows): job id,
    partition, qos, nodes, cpus, start_time, checkpoint (the job's latest), stopping,
    requeue."""
    out = []
    for r in rows:
        ck = r.get("checkpoint") or {}
        finished = ck.get("finished_at") if isinstance(ck, dict) else None
        start = float(r.get("start_time") or 0.0)
        # a checkpoint of an earlier attempt saved nothing of this one's work
        last = float(finished) if isinstance(finished, int | float) and finished >= start else None
        out.append(
            Running(
                job_id=int(r["job_id"]),
                tier=tiers.tier(r.get("partition"), r.get("qos")),
                nodes=tuple(r.get("nodes") or ()),
                cpus=int(r.get("cpus") or 0),
                start_time=start,
                last_checkpoint=last,
                mode=tiers.mode(r.get("partition"), r.get("qos")),
                stopping=bool(r.get("stopping")),
                requeue=bool(r.get("requeue", True)),
            )
        )
    return out
