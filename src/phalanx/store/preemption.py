"""The store's half of preemption (domain/preemption.py decides): what victim selection needs
to know of running jobs, and the one fenced transaction that stops the victims and gives the
preemptor its claim on their nodes.

A victim's attempt goes STOPPING with a stop reason that starts ``requeue: preempted by job
P`` (or ``cancel: ...``): to the rest of the system that is a planned stop (checkpoint signal,
grace, requeue without spending a retry) or a cancel. The preemptor keeps a restart-style
reservation (``reserved_nodes``/``reserved_until``) on the nodes its trial placement chose, so
no lower job backfills onto them while the victims checkpoint and leave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from phalanx.domain import maintenance, preemption
from phalanx.domain.states import AttemptState, JobState
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.sqlbits import JOB_SUMMARY, Fence, chunks
from phalanx.store.sqlbits import now as _now

_LIVE = (AttemptState.STARTING.value, AttemptState.RUNNING.value, AttemptState.STOPPING.value)


class Preemptions(StoreBase):
    """Running jobs as candidates, and the preemption transaction."""

    def preemption_rows(self) -> list[dict[str, Any]]:
        """One row per job whose current attempt holds nodes: job_id, partition (where it
        runs), qos, nodes (every task's node, spares too), cpus (summed), start_time (the
        attempt's, else its creation), checkpoint (the job's latest), requeue, stopping (the
        attempt is STOPPING, or not yet RUNNING), stop_reason, grace_s."""
        with self.db.begin(write=False) as conn:
            q = (
                select(
                    s.attempts.c.id,
                    s.attempts.c.job_id,
                    s.attempts.c.partition,
                    s.attempts.c.state,
                    s.attempts.c.start_time,
                    s.attempts.c.created_at,
                    s.attempts.c.stop_reason,
                    s.jobs.c.qos,
                    s.jobs.c.checkpoint,
                    s.jobs.c.requeue,
                    s.jobs.c.spec,
                )
                .select_from(s.attempts.join(s.jobs, s.jobs.c.id == s.attempts.c.job_id))
                .where(s.attempts.c.state.in_(_LIVE), s.jobs.c.attempt_id == s.attempts.c.id)
            )
            rows = {int(r.id): dict(r._mapping) for r in conn.execute(q)}
            nodes: dict[int, list[str]] = {}
            cpus: dict[int, int] = {}
            for chunk in chunks(sorted(rows), 500):
                tasks = select(s.tasks.c.attempt_id, s.tasks.c.node, s.tasks.c.cpus).where(
                    s.tasks.c.attempt_id.in_(chunk)
                )
                for t in conn.execute(tasks):
                    aid = int(t.attempt_id)
                    nodes.setdefault(aid, []).append(str(t.node))
                    cpus[aid] = cpus.get(aid, 0) + int(t.cpus or 0)
        out = []
        for aid, r in rows.items():
            out.append(
                {
                    "attempt_id": aid,
                    "job_id": int(r["job_id"]),
                    "partition": r["partition"],
                    "qos": r["qos"],
                    "nodes": nodes.get(aid, []),
                    "cpus": cpus.get(aid, 0),
                    "start_time": r["start_time"] or r["created_at"],
                    "checkpoint": r["checkpoint"],
                    "requeue": bool(r["requeue"]),
                    "stopping": r["state"] != AttemptState.RUNNING.value,
                    "stop_reason": r["stop_reason"],
                    # the checkpoint grace it asked for (0: the cluster's)
                    "grace_s": maintenance.job_checkpoint_grace(r["spec"]),
                }
            )
        return out

    def preempt(
        self,
        job_id: int,
        victims: Sequence[tuple[int, str]],
        nodes: Sequence[str],
        until: float,
        fence: Fence | None,
        *,
        why: str,
    ) -> list[int]:
        """Stop the ``victims`` ((job id, stop reason)) for pending job ``job_id`` and reserve
        ``nodes`` for it until ``until``, in one fenced transaction; returns the victims
        stopped. All or nothing: if the preemptor is no longer pending, or any victim's current
        attempt is no longer RUNNING (it ended, or something else is already stopping it),
        nothing changes and [] is returned (the next pass decides again)."""
        try:
            return self._preempt(job_id, victims, nodes, until, fence, why=why)
        except _Raced:
            return []

    def _preempt(
        self,
        job_id: int,
        victims: Sequence[tuple[int, str]],
        nodes: Sequence[str],
        until: float,
        fence: Fence | None,
        *,
        why: str,
    ) -> list[int]:
        now = _now()
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            term = fence.term if fence else None
            me = conn.execute(
                select(s.jobs.c.state).where(s.jobs.c.id == job_id)
            ).scalar_one_or_none()
            if me != JobState.PENDING.value:
                return []
            found = {
                int(r["id"]): dict(r)
                for r in conn.execute(
                    select(*JOB_SUMMARY).where(s.jobs.c.id.in_([v for v, _ in victims]))
                ).mappings()
            }
            atts: dict[int, dict[str, Any]] = {}
            for vid, _ in victims:
                job = found.get(vid)
                if job is None or job["attempt_id"] is None:
                    return []
                att = self._live_attempt(conn, int(job["attempt_id"]))
                if att is None or att["state"] != AttemptState.RUNNING.value:
                    return []
                atts[vid] = att
            for vid, reason in victims:
                att, job = atts[vid], found[vid]
                if not self._planned_stop(conn, att, job, reason, actor="scheduler", term=term):
                    raise _Raced()
                self._event(
                    conn,
                    "job.preempted",
                    f"preempted by job {job_id} ({why}): "
                    f"{'requeued' if reason.startswith('requeue') else 'cancelled'} after its "
                    "checkpoint grace",
                    job_id=vid,
                    actor="scheduler",
                    term=term,
                    data={"by": job_id, "attempt": int(att["id"]), "stop_reason": reason},
                )
            conn.execute(
                update(s.jobs)
                .where(s.jobs.c.id == job_id, s.jobs.c.state == JobState.PENDING.value)
                .values(reserved_nodes=list(nodes), reserved_until=until)
            )
            self._event(
                conn,
                "job.preempting",
                f"preempting job{'s' if len(victims) > 1 else ''} "
                f"{', '.join(str(v) for v, _ in victims)} ({why}); "
                f"nodes {','.join(nodes)} held for it until they are free",
                job_id=job_id,
                actor="scheduler",
                term=term,
                data={"victims": [v for v, _ in victims], "nodes": list(nodes), "at": now},
            )
        return [v for v, _ in victims]

    @staticmethod
    def _live_attempt(conn: Connection, attempt_id: int) -> dict[str, Any] | None:
        row = (
            conn.execute(select(s.attempts).where(s.attempts.c.id == attempt_id)).mappings().first()
        )
        return dict(row) if row is not None else None


class _Raced(Exception):
    """A victim's attempt changed between the check and the write (rolled back)."""


def victims_of(rows: Sequence[dict[str, Any]]) -> dict[int, list[int]]:
    """Preemptor job id -> its victims still stopping (from ``preemption_rows``)."""
    out: dict[int, list[int]] = {}
    for r in rows:
        by = preemption.preemptor_of(r.get("stop_reason"))
        if by is not None:
            out.setdefault(by, []).append(int(r["job_id"]))
    return out
