"""Reads of jobs, attempts and events, and the purge of finished jobs.

What `squeue`, `sacct`, `scontrol show` and the dashboard read, the failure and checkpoint
history the policies learn from, and the purge that deletes a finished job's rows (children
before parents, `JOB_ROWS`) after carrying its figures into the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Table,
    and_,
    delete,
    func,
    or_,
    select,
)

from phalanx.domain import checkpointing
from phalanx.domain.states import (
    TERMINAL,
)
from phalanx.errors import NotFound
from phalanx.store import schema as s
from phalanx.store.metrics import MetricsQueries
from phalanx.store.sqlbits import JOB_SUMMARY as _JOB_SUMMARY
from phalanx.store.sqlbits import chunks as _chunks


def _by_job(table: Table) -> Any:
    """Rows of a table with a `job_id` column that belong to these jobs."""
    return lambda ids: table.c.job_id.in_(ids)


# What `purge_finished` deletes with a job, children before parents: (table, rows of these
# job ids). A new table of per-job rows (job steps: `(s.steps, _by_job(s.steps))`, before
# `attempts` if it refers to them) is one more line here.
JOB_ROWS: tuple[tuple[Table, Any], ...] = (
    (s.rendezvous, _by_job(s.rendezvous)),
    (
        s.step_nodes,
        lambda ids: s.step_nodes.c.attempt_id.in_(
            select(s.attempts.c.id).where(s.attempts.c.job_id.in_(ids))
        ),
    ),
    (s.steps, _by_job(s.steps)),
    (
        s.tasks,
        lambda ids: s.tasks.c.attempt_id.in_(
            select(s.attempts.c.id).where(s.attempts.c.job_id.in_(ids))
        ),
    ),
    (s.attempts, _by_job(s.attempts)),
    (s.events, _by_job(s.events)),
)


class History(MetricsQueries):
    """Reads of jobs, attempts and events, and the purge of finished jobs.."""

    def get_job(self, job_id: int) -> dict[str, Any]:
        with self.db.begin(write=False) as conn:
            row = conn.execute(select(s.jobs).where(s.jobs.c.id == job_id)).mappings().first()
            if row is None:
                raise NotFound(f"job {job_id} does not exist", job_id=job_id)
            return dict(row)

    def list_jobs(
        self,
        *,
        states: Sequence[str] | None = None,
        user: str | None = None,
        partition: str | None = None,
        name: str | None = None,
        ids: Sequence[int] | None = None,
        node: str | None = None,
        limit: int = 10_000,
        active_after: float | None = None,
        submitted_before: float | None = None,
        with_spec: bool = False,
    ) -> list[dict[str, Any]]:
        """Jobs by filters. `active_after`/`submitted_before` select the jobs that existed in a
        time window (sacct -S/-E): not ended before its start, submitted before its end.
        `with_spec` adds each job's spec (command, workdir, account: sacct's detail)."""
        cols = [*_JOB_SUMMARY, s.jobs.c.spec] if with_spec else _JOB_SUMMARY
        q = select(*cols).order_by(s.jobs.c.id)
        if active_after is not None:
            q = q.where(or_(s.jobs.c.end_time.is_(None), s.jobs.c.end_time >= active_after))
        if submitted_before is not None:
            q = q.where(s.jobs.c.submit_time <= submitted_before)
        if states:
            q = q.where(s.jobs.c.state.in_(list(states)))
        if user:
            q = q.where(s.jobs.c.user == user)
        if partition:
            q = q.where(s.jobs.c.partition == partition)
        if name:
            q = q.where(s.jobs.c.name == name)
        if ids is not None:
            q = q.where(s.jobs.c.id.in_(list(ids)))
        if not node:  # the node filter runs below, in Python: limit after it
            q = q.limit(limit)
        with self.db.begin(write=False) as conn:
            result = conn.execute(q)
            # all rows at once, each zipped with the keys read once: a listing of thousands
            # (squeue) spent half its time in row-by-row fetches and per-row key views
            keys = list(result.keys())
            rows = [dict(zip(keys, r, strict=True)) for r in result.all()]
        if node:
            rows = [r for r in rows if node in (r["nodelist_run"] or [])][:limit]
        return rows

    def attempts_of(self, job_id: int) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            atts = [
                dict(r)
                for r in conn.execute(
                    select(s.attempts)
                    .where(s.attempts.c.job_id == job_id)
                    .order_by(s.attempts.c.id)
                ).mappings()
            ]
            if atts:
                tasks = conn.execute(
                    select(s.tasks)
                    .where(s.tasks.c.attempt_id.in_([a["id"] for a in atts]))
                    .order_by(s.tasks.c.rank)
                ).mappings()
                by: dict[int, list[dict[str, Any]]] = {}
                for t in tasks:
                    by.setdefault(t["attempt_id"], []).append(dict(t))
                for a in atts:
                    a["tasks"] = by.get(a["id"], [])
            return atts

    def attempts_by_id(self, attempt_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """These attempts with their tasks (as `attempts_of` gives them), by id."""
        out: dict[int, dict[str, Any]] = {}
        with self.db.begin(write=False) as conn:
            for chunk in _chunks(sorted(set(attempt_ids)), 500):
                for r in conn.execute(
                    select(s.attempts).where(s.attempts.c.id.in_(chunk))
                ).mappings():
                    out[int(r["id"])] = {**dict(r), "tasks": []}
                for t in conn.execute(
                    select(s.tasks).where(s.tasks.c.attempt_id.in_(chunk)).order_by(s.tasks.c.rank)
                ).mappings():
                    out[int(t["attempt_id"])]["tasks"].append(dict(t))
        return out

    def purge_finished(self, older_than: float, batch: int = 500) -> int:
        """Delete up to `batch` jobs that ended before `older_than`, with their rows in
        `JOB_ROWS` (attempts, tasks, events); returns how many jobs went (accounting retention:
        the cluster duty calls this until it returns less than `batch`)."""
        with self.db.begin() as conn:
            ids = [
                int(r.id)
                for r in conn.execute(
                    # by ix_jobs_end_time: the old-enough range only, oldest end first. By
                    # the state index it read every finished job's row, to find none mostly;
                    # SQLite, which keeps no statistics, prefers an equality on an indexed
                    # column, so the state is tested as an expression (`state || ''`)
                    select(s.jobs.c.id)
                    .where(
                        s.jobs.c.end_time < older_than,
                        s.jobs.c.state.concat("").in_([t.value for t in TERMINAL]),
                    )
                    .order_by(s.jobs.c.end_time, s.jobs.c.id)
                    .limit(batch)
                )
            ]
            if not ids:
                return 0
            self.carry_purged(conn, ids)  # /metrics counters must not go down (store/metrics.py)
            for table, rows_of in JOB_ROWS:
                conn.execute(delete(table).where(rows_of(ids)))
            conn.execute(delete(s.jobs).where(s.jobs.c.id.in_(ids)))
        # the pending mirror's next sync checks its count at once (pending.COUNT_CHECK_EVERY):
        # a job it still lists may be among those gone (a cached property: none made yet, none
        # to tell)
        mirror = self.__dict__.get("pending_mirror")
        if mirror is not None:
            mirror.purged = True
        return len(ids)

    def add_event(self, kind: str, message: str, **kw: Any) -> None:
        with self.db.begin() as conn:
            self._event(conn, kind, message, **kw)

    def events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        since_id: int = 0,
        limit: int = 1000,
        newest: bool = False,
    ) -> list[dict[str, Any]]:
        """Events after `since_id`, oldest first: the first `limit` of them, or with `newest`
        the last `limit` (a node page's recent history: the first thousand of a busy node's
        events are weeks old)."""
        order = s.events.c.id.desc() if newest else s.events.c.id
        q = select(s.events).where(s.events.c.id > since_id).order_by(order).limit(limit)
        if job_id is not None:
            q = q.where(s.events.c.job_id == job_id)
        if node is not None:
            q = q.where(s.events.c.node == node)
        with self.db.begin(write=False) as conn:
            rows = [dict(r) for r in conn.execute(q).mappings()]
        return rows[::-1] if newest else rows

    def node_events_between(
        self, nodes: Sequence[str], since: float, until: float, limit: int = 200
    ) -> list[dict[str, Any]]:
        """Events of these nodes stamped in [since, until], oldest first (`phalanx explain`:
        the drains and failures around an attempt's end)."""
        if not nodes:
            return []
        q = (
            select(s.events)
            .where(
                s.events.c.node.in_(sorted(set(nodes))),
                s.events.c.ts >= since,
                s.events.c.ts <= until,
            )
            .order_by(s.events.c.id)
            .limit(limit)
        )
        with self.db.begin(write=False) as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def usage_rows(
        self, start: float, end: float
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[tuple[float, bool]]]]:
        """What a utilisation report of [start, end) is computed from (domain/usage_report.py):
        the attempts that held CPUs in it (their start, end, CPUs, job's account and user),
        the nodes (CPUs, first registration), and each node's DOWN (True) and back (False)
        events up to `end`, in time order."""
        cpus = (
            select(s.tasks.c.attempt_id, func.sum(s.tasks.c.cpus).label("cpus"))
            .group_by(s.tasks.c.attempt_id)
            .subquery()
        )
        attempts_q = (
            select(
                s.attempts.c.start_time,
                s.attempts.c.end_time,
                cpus.c.cpus,
                s.jobs.c.account,
                s.jobs.c.user,
            )
            .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
            .join(cpus, cpus.c.attempt_id == s.attempts.c.id)
            .where(
                s.attempts.c.start_time.is_not(None),
                s.attempts.c.start_time < end,
                or_(s.attempts.c.end_time.is_(None), s.attempts.c.end_time > start),
            )
        )
        first = (
            select(s.events.c.node, func.min(s.events.c.ts).label("ts"))
            .where(s.events.c.kind == "node.register")
            .group_by(s.events.c.node)
            .subquery()
        )
        nodes_q = select(
            s.nodes.c.name,
            s.nodes.c.cpus,
            func.coalesce(first.c.ts, s.nodes.c.registered_at).label("registered_at"),
        ).outerjoin(first, first.c.node == s.nodes.c.name)
        events_q = (
            select(s.events.c.node, s.events.c.ts, s.events.c.kind)
            .where(s.events.c.kind.in_(["node.down", "node.up"]), s.events.c.ts < end)
            .order_by(s.events.c.ts, s.events.c.id)
        )
        with self.db.begin(write=False) as conn:
            attempts = [dict(r) for r in conn.execute(attempts_q).mappings()]
            nodes = [dict(r) for r in conn.execute(nodes_q).mappings()]
            events: dict[str, list[tuple[float, bool]]] = {}
            for r in conn.execute(events_q):
                events.setdefault(r.node, []).append((float(r.ts), r.kind == "node.down"))
        return attempts, nodes, events

    def cluster_counts(self) -> dict[str, Any]:
        with self.db.begin(write=False) as conn:
            by_state = {
                r.state: int(r.n)
                for r in conn.execute(
                    select(s.jobs.c.state, func.count().label("n")).group_by(s.jobs.c.state)
                )
            }
            n_nodes = conn.execute(select(func.count()).select_from(s.nodes)).scalar_one()
            down = conn.execute(
                select(func.count()).select_from(s.nodes).where(s.nodes.c.down.is_(True))
            ).scalar_one()
            drain = conn.execute(
                select(func.count()).select_from(s.nodes).where(and_(s.nodes.c.drain.is_(True)))
            ).scalar_one()
        return {
            "jobs": by_state,
            "nodes": {"total": int(n_nodes), "down": int(down), "drain": int(drain)},
        }

    def ended_since(self, since: float) -> dict[str, int]:
        """Jobs (array tasks one each) that ended at or after `since`, by final state: sdiag's
        completed, canceled and failed."""
        with self.db.begin(write=False) as conn:
            rows = conn.execute(
                select(s.jobs.c.state, func.count().label("n"))
                .where(s.jobs.c.end_time >= since)
                .group_by(s.jobs.c.state)
            )
            return {r.state: int(r.n) for r in rows}

    def failure_history(
        self, now: float, window_s: float = checkpointing.FAILURE_WINDOW_S
    ) -> tuple[float, int]:
        """Node-seconds observed and node failures seen in the last `window_s` before `now`.

        Replayed from the node events (`checkpointing.node_history`): a node counts while it is
        registered and not DOWN; a failure is a DOWN transition (`mark_down`) or a health check
        turning to `fail` (the `node.drain` event `_apply_health` marks with `failure`).
        Operator and maintenance drains are not failures. Reads the events of the window (no
        index on kind): callers cache the result rather than ask per job per pass.
        """
        start = now - window_s
        state_kinds = sorted(checkpointing.UP_KINDS | {checkpointing.DOWN_KIND})
        cols = (s.events.c.id, s.events.c.ts, s.events.c.node, s.events.c.kind, s.events.c.data)
        latest = (
            select(func.max(s.events.c.id).label("id"))
            .where(
                s.events.c.kind.in_(state_kinds),
                s.events.c.ts < start,
                s.events.c.node.is_not(None),
            )
            .group_by(s.events.c.node)
            .subquery()
        )
        with self.db.begin(write=False) as conn:
            before = [
                dict(r)
                for r in conn.execute(
                    select(*cols).where(s.events.c.id.in_(select(latest.c.id)))
                ).mappings()
            ]
            during = [
                dict(r)
                for r in conn.execute(
                    select(*cols).where(
                        s.events.c.kind.in_(checkpointing.HISTORY_KINDS),
                        s.events.c.ts >= start,
                        s.events.c.ts <= now,
                        s.events.c.node.is_not(None),
                    )
                ).mappings()
            ]
        return checkpointing.node_history(before, during, start=start, now=now)

    def checkpoint_cost(
        self, job_id: int, samples: int = checkpointing.COST_SAMPLES
    ) -> float | None:
        """The job's measured checkpoint duration: the median over its latest `samples`
        checkpoints (`job.checkpoint` events, data `{path, finished_at, duration_s, seq}`),
        or the duration in jobs.checkpoint when no event has one; None when nothing was
        measured (a job that writes its marker by hand reports no duration)."""
        with self.db.begin(write=False) as conn:
            rows = [
                dict(r)
                for r in conn.execute(
                    select(s.events.c.data)
                    .where(s.events.c.job_id == job_id, s.events.c.kind == "job.checkpoint")
                    .order_by(s.events.c.id.desc())
                    .limit(samples * 16)  # a multi-node job may record one event per rank
                ).mappings()
            ]
            cost = checkpointing.median_cost(rows, samples)
            if cost is not None:
                return cost
            latest = conn.execute(
                select(s.jobs.c.checkpoint).where(s.jobs.c.id == job_id)
            ).scalar_one_or_none()
        return checkpointing.median_cost([{"data": latest}] if latest else [], samples)
