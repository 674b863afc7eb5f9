"""Counts for `/metrics`: cluster-level figures read from the store in one read transaction.

A mixin of `Store` (store/store.py), kept apart so the store's main module does not grow. Every
figure here is derived from rows all controllers share (jobs, attempts, nodes, leases, events),
so whichever controller is scraped answers the same numbers, and counters derived from events
(GPU XIDs, ECC errors, requeues, lease takeovers) survive a controller's failover.

Aggregation happens in SQL (GROUP BY, bucket sums with CASE), so a store of 100,000 jobs
returns a few hundred rows; JSON fields of events are read with SQLAlchemy's JSON index
operators (json_extract on SQLite, ->> on PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, case, func, select, update

from phalanx.domain.states import JobState
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.sqlbits import active_tasks

# Event kinds this module counts (their `data` carries the labels).
GPU_XID = "gpu.xid"  # data {"gpu": index, "xid": code, "key": dedup key}
# data {"gpu", "count": new errors, "total": NVML's volatile counter (since boot), "boot", "key"}
GPU_ECC = "gpu.ecc"
REQUEUE_KINDS = ("job.requeue", "job.restart", "job.held")  # data {"why": kind, "retry": bool}
CHECKPOINT = "job.checkpoint"  # data {"duration_s": seconds, ...}
# One event (no job) holding what purged jobs' events had added to the requeue and checkpoint
# figures, so accounting retention never makes those counters go down (purge_finished).
CARRY = "metrics.carry"
CHECKPOINT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)

ACTIVE_JOB_STATES = (
    JobState.PENDING.value,
    JobState.HELD.value,
    JobState.STARTING.value,
    JobState.RUNNING.value,
    JobState.COMPLETING.value,
)


@dataclass
class Histo:
    """A cumulative histogram read from the store: counts[i] observations <= bounds[i]."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: int
    sum: float


@dataclass
class StoreFigures:
    """What one refresh of the metrics cache reads (see controller/metrics.py)."""

    db_now: float
    jobs: list[tuple[str, str, int]] = field(default_factory=list)  # state, first partition, n
    pending_reasons: list[tuple[str | None, int]] = field(default_factory=list)
    users: list[tuple[str, str, int]] = field(default_factory=list)  # user, state, n
    checkpoint_durations: Histo | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    busy_nodes: dict[str, int] = field(default_factory=dict)  # node -> cpus in use
    leases: list[dict[str, Any]] = field(default_factory=list)
    requeues: list[tuple[str, str, bool, int]] = field(default_factory=list)  # kind, why, retry, n
    gpu_xid: list[tuple[str, int, int, int]] = field(default_factory=list)  # node, gpu, xid, n
    gpu_ecc: list[tuple[str, int, int]] = field(default_factory=list)  # node, gpu, errors
    checkpointing: list[dict[str, Any]] = field(default_factory=list)  # running jobs' rows


def _histogram(
    conn: Connection, value: Any, where: Any, bounds: Sequence[float], source: Any = None
) -> Histo:
    """One scan: how many `value`s fall at or under each bound, their count and sum."""
    cols: list[Any] = [func.sum(case((value <= b, 1), else_=0)) for b in bounds]
    cols += [func.count(), func.coalesce(func.sum(value), 0.0)]
    q = select(*cols)
    if source is not None:
        q = q.select_from(source)
    row = conn.execute(q.where(where)).one()
    return Histo(
        bounds=tuple(bounds),
        counts=[int(x or 0) for x in row[: len(bounds)]],
        total=int(row[len(bounds)] or 0),
        sum=float(row[len(bounds) + 1] or 0.0),
    )


class MetricsQueries(StoreBase):
    """`metrics_figures()`: the store's half of `/metrics`."""

    def metrics_figures(
        self,
        *,
        checkpoint_bounds: Sequence[float],
    ) -> StoreFigures:
        """Every store-derived figure of `/metrics`, read in one transaction."""
        j = s.jobs
        with self.db.begin(write=False) as conn:
            db_now = float(conn.execute(select(self.db.db_now_sql())).scalar_one())
            out = StoreFigures(db_now=db_now)
            # one scan of ix_jobs_state_partitions_user (covering): jobs by state, the
            # partition they were submitted to (the first they list) and user
            for r in conn.execute(
                select(j.c.state, j.c.partitions, j.c.user, func.count().label("n")).group_by(
                    j.c.state, j.c.partitions, j.c.user
                )
            ):
                part = (r.partitions or "").split(",")[0] or "-"
                out.jobs.append((r.state, part, int(r.n)))
                if r.state in ACTIVE_JOB_STATES:
                    out.users.append((r.user, r.state, int(r.n)))
            out.pending_reasons = [
                (r.reason, int(r.n))
                for r in conn.execute(
                    select(j.c.reason, func.count().label("n"))
                    .where(j.c.state == JobState.PENDING.value)
                    .group_by(j.c.reason)
                )
            ]
            out.nodes = [dict(r) for r in conn.execute(select(s.nodes)).mappings()]
            for r in conn.execute(
                active_tasks(s.tasks.c.node, func.sum(s.tasks.c.cpus).label("cpus")).group_by(
                    s.tasks.c.node
                )
            ):
                out.busy_nodes[r.node] = int(r.cpus or 0)
            valid = s.leases.c.expires_at > self.db.db_now_sql()
            out.leases = [
                dict(r)
                for r in conn.execute(
                    select(s.leases, valid.label("valid")).order_by(s.leases.c.name)
                ).mappings()
            ]
            interval = j.c.spec["checkpoint_parsed"]["interval_s"]
            out.checkpointing = [
                dict(r)
                for r in conn.execute(
                    select(j.c.id, j.c.spec, j.c.nodes, j.c.nodelist_run).where(
                        j.c.state == JobState.RUNNING.value,
                        interval.as_string().is_not(None),
                    )
                ).mappings()
            ]
            self._event_counts(conn, out, checkpoint_bounds)
        return out

    def _event_counts(
        self,
        conn: Connection,
        out: StoreFigures,
        checkpoint_bounds: Sequence[float],
        job_ids: Sequence[int] | None = None,
    ) -> None:
        """Requeues, GPU events and checkpoint durations: one scan of the events table (the
        JSON fields are read only from the rows of these kinds), grouped in SQL; plus what
        purged jobs carried over (`CARRY`). With `job_ids`: only these jobs' events."""
        e = s.events
        fields = {
            "why": e.c.data["why"].as_string(),
            "retry": e.c.data["retry"].as_boolean(),
            "gpu": e.c.data["gpu"].as_integer(),
            "xid": e.c.data["xid"].as_integer(),
            "boot": e.c.data["boot"].as_string(),
            # GPU events are per node; the others are counted cluster-wide
            "node": case((e.c.kind.in_((GPU_XID, GPU_ECC)), e.c.node), else_=None),
        }
        total = e.c.data["total"].as_integer()
        duration = e.c.data["duration_s"].as_float()
        aggs: list[Any] = [
            func.count().label("n"),
            func.max(total).label("total"),
            func.count(duration).label("d_n"),
            func.coalesce(func.sum(duration), 0.0).label("d_sum"),
        ]
        aggs += [
            func.sum(case((duration <= b, 1), else_=0)).label(f"d_{i}")
            for i, b in enumerate(checkpoint_bounds)
        ]
        kinds = (*REQUEUE_KINDS, GPU_XID, GPU_ECC, CHECKPOINT)
        where = e.c.kind.in_(kinds) if job_ids is None else e.c.job_id.in_(job_ids)
        q = (
            select(e.c.kind, *(c.label(k) for k, c in fields.items()), *aggs)
            .where(where)
            .group_by(e.c.kind, *fields.values())
        )
        ecc: dict[tuple[str, int], int] = {}
        ckpt = Histo(tuple(checkpoint_bounds), [0] * len(checkpoint_bounds), 0, 0.0)
        for r in conn.execute(q).mappings():
            kind, n = r["kind"], int(r["n"])
            node = r["node"] or "-"
            gpu = int(r["gpu"]) if r["gpu"] is not None else -1
            if kind in REQUEUE_KINDS:
                out.requeues.append((kind, r["why"] or "other", bool(r["retry"]), n))
            elif kind == GPU_XID:
                out.gpu_xid.append((node, gpu, int(r["xid"] or 0), n))
            elif kind == GPU_ECC:  # the volatile counter's largest total per boot, summed
                ecc[(node, gpu)] = ecc.get((node, gpu), 0) + int(r["total"] or 0)
            elif kind == CHECKPOINT:
                ckpt.total += int(r["d_n"] or 0)
                ckpt.sum += float(r["d_sum"] or 0.0)
                for k in range(len(checkpoint_bounds)):
                    ckpt.counts[k] += int(r[f"d_{k}"] or 0)
        out.gpu_ecc = [(node, g, n) for (node, g), n in sorted(ecc.items())]
        out.checkpoint_durations = ckpt
        if job_ids is None:
            carry = self._carry_row(conn)
            if carry is not None:
                _add_carry(out, carry[1])

    def _carry_row(self, conn: Connection) -> tuple[int, dict[str, Any]] | None:
        e = s.events
        row = conn.execute(
            select(e.c.id, e.c.data).where(e.c.kind == CARRY).order_by(e.c.id).limit(1)
        ).first()
        return (int(row.id), dict(row.data or {})) if row is not None else None

    def carry_purged(self, conn: Connection, job_ids: Sequence[int]) -> None:
        """Before these jobs' events are deleted (accounting retention): add what they count
        in the requeue and checkpoint figures to the one `CARRY` event, so the counters of
        /metrics never go down when old jobs are purged."""
        gone = StoreFigures(db_now=0.0)
        self._event_counts(conn, gone, CHECKPOINT_BUCKETS, job_ids)
        ck = gone.checkpoint_durations
        if not gone.requeues and (ck is None or not ck.total):
            return
        have = self._carry_row(conn)
        data = have[1] if have is not None else {}
        merged = StoreFigures(db_now=0.0, checkpoint_durations=None)
        _add_carry(merged, data)
        merged.requeues += gone.requeues
        _add_histo(merged, ck)
        new = {
            "requeues": [list(r) for r in _sum_requeues(merged.requeues)],
            "checkpoint": _histo_data(merged.checkpoint_durations),
        }
        if have is None:
            self._event(conn, CARRY, "counts kept from purged jobs (for /metrics)", data=new)
        else:
            conn.execute(update(s.events).where(s.events.c.id == have[0]).values(data=new))

    def queue_entries(self, job_ids: Sequence[int]) -> dict[int, float]:
        """When these (requeued) jobs entered the queue again: their last attempt's end."""
        a = s.attempts
        out: dict[int, float] = {}
        with self.db.begin(write=False) as conn:
            for r in conn.execute(
                select(a.c.job_id, func.max(a.c.end_time).label("ended"))
                .where(a.c.job_id.in_(list(job_ids)))
                .group_by(a.c.job_id)
            ):
                if r.ended is not None:
                    out[int(r.job_id)] = float(r.ended)
        return out

    def record_gpu_events(self, node: str, items: Sequence[dict[str, Any]]) -> int:
        """Store an agent's GPU events (XIDs, new uncorrectable ECC errors) as events of the
        node; return how many were new. Agents resend until a heartbeat reply confirms them,
        so each carries a key and a key already stored for the node is skipped."""
        if not items:
            return 0
        keys = [str(i.get("key")) for i in items]
        e = s.events
        with self.db.begin() as conn:
            have = {
                str(k)
                for (k,) in conn.execute(
                    select(e.c.data["key"].as_string()).where(
                        e.c.node == node,
                        e.c.kind.in_((GPU_XID, GPU_ECC)),
                        e.c.data["key"].as_string().in_(keys),
                    )
                )
            }
            new = 0
            for item, key in zip(items, keys, strict=True):
                if key in have:
                    continue
                have.add(key)
                gpu = int(item.get("gpu", -1))
                if "xid" in item:
                    xid = int(item["xid"])
                    kind, msg = GPU_XID, f"GPU {gpu}: XID {xid}"
                    data = {"gpu": gpu, "xid": xid, "key": key}
                else:
                    n, tot = int(item.get("count", 0)), int(item.get("total", 0))
                    kind = GPU_ECC
                    msg = f"GPU {gpu}: {n} new uncorrectable ECC errors ({tot} since boot)"
                    boot = str(item.get("boot") or "")[:64]
                    data = {"gpu": gpu, "count": n, "total": tot, "boot": boot, "key": key}
                self._event(conn, kind, msg, node=node, actor=node, data=data, ts=item.get("ts"))
                new += 1
        return new


def _sum_requeues(rows: Sequence[tuple[str, str, bool, int]]) -> list[tuple[str, str, bool, int]]:
    sums: dict[tuple[str, str, bool], int] = {}
    for kind, why, retry, n in rows:
        sums[(kind, why, retry)] = sums.get((kind, why, retry), 0) + n
    return [(k, w, r, n) for (k, w, r), n in sorted(sums.items())]


def _histo_data(h: Histo | None) -> dict[str, Any] | None:
    if h is None:
        return None
    return {"bounds": list(h.bounds), "counts": h.counts, "total": h.total, "sum": h.sum}


def _add_histo(out: StoreFigures, h: Histo | None) -> None:
    """Add `h` to out.checkpoint_durations (bounds must agree; otherwise only +Inf and sum)."""
    if h is None:
        return
    cur = out.checkpoint_durations
    if cur is None:
        out.checkpoint_durations = Histo(h.bounds, list(h.counts), h.total, h.sum)
        return
    if tuple(cur.bounds) == tuple(h.bounds):
        cur.counts = [a + b for a, b in zip(cur.counts, h.counts, strict=True)]
    cur.total += h.total
    cur.sum += h.sum


def _add_carry(out: StoreFigures, data: Mapping[str, Any]) -> None:
    """Add a `CARRY` event's counts to figures read from the events still stored."""
    for kind, why, retry, n in data.get("requeues") or []:
        out.requeues.append((str(kind), str(why), bool(retry), int(n)))
    ck = data.get("checkpoint")
    if ck:
        bounds = tuple(float(b) for b in ck.get("bounds") or ())
        counts = [int(c) for c in ck.get("counts") or ()]
        if len(bounds) == len(counts):
            _add_histo(
                out, Histo(bounds, counts, int(ck.get("total") or 0), float(ck.get("sum") or 0))
            )
