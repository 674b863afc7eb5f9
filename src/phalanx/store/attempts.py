"""Attempt progression: writing what `domain.outcome` and `domain.policy` decide.

An attempt moves forward when its tasks change (a report, a node declared DOWN, a launch
nobody confirmed). The rules are pure (`outcome.advance`, `policy.after_attempt`,
`elastic.restart_layout`); this module reads the rows they need and writes what they decided
in the caller's transaction, so a task's end, its attempt's end and its job's next state are
one commit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    func,
    select,
    update,
)

from phalanx.domain.elastic import restart_layout
from phalanx.domain.outcome import (
    BATCH_ENDED,
    advance,
    hook_drain,
    task_end,
)
from phalanx.domain.policy import (
    TIMEOUT_STOP,
    Action,
    FailureKind,
    RetryRules,
    after_attempt,
)
from phalanx.domain.states import (
    AttemptState,
    JobState,
    TaskState,
)
from phalanx.store import schema as s
from phalanx.store.prebuilt import Prebuilt, only, select_where, update_where
from phalanx.store.regroup import InPlaceRecovery, left_job, lost_node
from phalanx.store.sqlbits import JOB_SUMMARY as _JOB_SUMMARY
from phalanx.store.sqlbits import Fence, unusable_nodes
from phalanx.store.sqlbits import now as _now

_DRAIN_REASON_MAX = 1000  # a hook's sentence is bounded already (shepherd_hooks.py); a cap here

# the report path's statements, built once (store/prebuilt.py says why)
_JOB_SUMMARY_BY_ID = Prebuilt(select(*_JOB_SUMMARY).where(s.jobs.c.id == bindparam("id")))


@dataclass
class Prefetched:
    """The rows `_advance_attempt` reads (the attempt, its tasks by rank, its job's summary),
    read for many attempts at once (`AttemptProgress._prefetch`): three statements for an
    exchange's dozen attempts instead of three each. Each attempt's rows are taken once."""

    attempts: dict[int, dict[str, Any]] = field(default_factory=dict)
    tasks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)  # attempts already ENDED: nothing to do

    def take(
        self, attempt_id: int
    ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]] | None:
        att = self.attempts.pop(attempt_id, None)
        if att is None:
            return None
        return att, self.tasks.pop(attempt_id, []), self.jobs.pop(att["job_id"])


def _elastic_columns() -> list[Any]:
    """A job's elastic maximum and spare count, read from its stored spec (no own columns)."""
    return [
        s.jobs.c.spec["nodes_max"].as_integer().label("nodes_max"),
        s.jobs.c.spec["spares"].as_integer().label("spares"),
    ]


class AttemptProgress(InPlaceRecovery):
    """Attempt progression."""

    def _prefetch(self, conn: Connection, attempt_ids: Iterable[int]) -> Prefetched:
        """The rows `_advance_attempt` reads, for these attempts, in three statements; read
        after their tasks' changes are written. Attempts of a job that has another of them
        here are left out (read one by one), since moving one of them forward may change
        the rows of the other."""
        ids = sorted(set(attempt_ids))
        out = Prefetched()
        if len(ids) < 2:
            return out
        atts = [
            dict(r)
            for r in conn.execute(select(s.attempts).where(s.attempts.c.id.in_(ids))).mappings()
        ]
        per_job = Counter(a["job_id"] for a in atts)
        out.ended = {a["id"] for a in atts if a["state"] == AttemptState.ENDED.value}
        atts = [a for a in atts if per_job[a["job_id"]] == 1 and a["id"] not in out.ended]
        if not atts:
            return out
        out.attempts = {a["id"]: a for a in atts}
        for t in conn.execute(
            select(s.tasks)
            .where(s.tasks.c.attempt_id.in_(list(out.attempts)))
            .order_by(s.tasks.c.attempt_id, s.tasks.c.rank)
        ).mappings():
            out.tasks.setdefault(t["attempt_id"], []).append(dict(t))
        out.jobs = {
            j["id"]: dict(j)
            for j in conn.execute(
                select(*_JOB_SUMMARY).where(s.jobs.c.id.in_([a["job_id"] for a in atts]))
            ).mappings()
        }
        return out

    def _advance_attempt(
        self, conn: Connection, attempt_id: int, pre: Prefetched | None = None
    ) -> None:
        """Move an attempt (and its job) forward after its tasks changed: `outcome.advance`
        decides, this writes what it decided. `pre`: its rows, when read with others'."""
        if pre is not None and attempt_id in pre.ended:
            return
        got = pre.take(attempt_id) if pre is not None else None
        if got is not None:
            att, rows, job = got
        else:
            att = only(select_where(conn, s.attempts, {"id": attempt_id}))
            if att["state"] == AttemptState.ENDED.value:
                return
            rows = select_where(conn, s.tasks, {"attempt_id": attempt_id}, order_by="rank")
            job = _JOB_SUMMARY_BY_ID.one(conn, {"id": att["job_id"]})
        # hot spares run nothing: they never decide an attempt's progress or outcome; nor do
        # the tasks of nodes that left a --no-kill job that went on without them
        spare_tasks = [t for t in rows if t["spare"]]
        tasks = [t for t in rows if not t["spare"] and not left_job(t)]
        now = _now()
        if any(lost_node(t) for t in tasks) and self._regroup(
            conn, job, att, tasks, spare_tasks, now
        ):
            rows = select_where(conn, s.tasks, {"attempt_id": attempt_id}, order_by="rank")
            spare_tasks = [t for t in rows if t["spare"]]
            tasks = [t for t in rows if not t["spare"] and not left_job(t)]
        batch = (
            len(tasks) > 1
            and any(t["state"] in (TaskState.EXITED.value, TaskState.LOST.value) for t in tasks)
            and not self._runs_on_all_nodes(conn, att["job_id"])
        )
        step = advance(att["state"], tasks, stop_reason=att["stop_reason"], batch=batch)
        if step.start is not None:
            self._attempt_running(conn, att, job, step.start, bool(spare_tasks))
        if step.stop is not None:
            values: dict[str, Any] = {"state": AttemptState.STOPPING.value}
            if step.stop != BATCH_ENDED:
                values["stop_reason"] = step.stop
            update_where(conn, s.attempts, {"id": attempt_id}, values)
            if job["state"] in (JobState.STARTING.value, JobState.RUNNING.value):
                self._set_job_state(conn, job, JobState.COMPLETING, step.stop)
            self._bump_gen(conn, att["nodes"])
        end = step.end
        if end is None:
            return
        started = [t["started_at"] for t in tasks if t["started_at"] is not None]
        update_where(
            conn,
            s.attempts,
            {"id": attempt_id},
            {
                "state": AttemptState.ENDED.value,
                "end_time": now,
                "result": end.result.value,
                "exit_code": end.exit_code,
                "exit_signal": end.exit_signal,
                "start_time": att["start_time"] or min(started, default=None),
            },
        )
        # its tasks leave the heartbeat's reads (tasks.held, migration 0011)
        update_where(conn, s.tasks, {"attempt_id": attempt_id}, {"held": False})
        self._bump_gen(conn, att["nodes"])
        self._end_steps_of_attempt(conn, attempt_id, end.result, now)
        if spare_tasks:
            self._release_spares(conn, attempt_id, now)
        launch_failed = list(end.launch_failed)
        if launch_failed:
            self._count_node_launch_failures(conn, launch_failed)
        result, reason, code, sig = end.result, end.reason, end.exit_code, end.exit_signal
        all_tasks, tasks = tasks, list(end.deciding)
        if job["attempt_id"] != attempt_id or JobState(job["state"]).terminal:
            return
        if (
            result is JobState.NODE_FAIL
            and not launch_failed
            and self._fast_restart(conn, job, att, all_tasks, spare_tasks, reason, now)
        ):
            return
        verdict = after_attempt(
            result=result,
            reason=reason,
            stop_reason=att["stop_reason"],
            requeue=bool(job["requeue"]),
            lost_nodes=[
                t["node"]
                for t in tasks
                if t["state"] == TaskState.LOST.value or (t["detail"] or {}).get("fenced")
            ],
            launch_failed=launch_failed,
            launch_failures=int(job["launch_failures"] or 0),
            policy=self.policy,
            tasks=[task_end(t) for t in tasks],
            retries=int(job["retries"] or 0),
            rules=(
                self._retry_rules(conn, job["id"])
                if result is not JobState.COMPLETED or att["stop_reason"]
                else None
            ),
        )
        extra: dict[str, Any] = {"exit_code": code, "exit_signal": sig}
        if verdict.launch_failure:
            extra["launch_failures"] = int(job["launch_failures"] or 0) + 1
        if verdict.retry:  # a failure retry spends the job's budget; planned requeues do not
            extra["retries"] = int(job["retries"] or 0) + 1
        if verdict.avoid:
            extra["avoid_nodes"] = self._avoidable(conn, job, verdict.avoid)
        if verdict.action is Action.END:
            extra.update(end_time=now, start_time=job["start_time"] or att["start_time"])
            self._set_job_state(conn, job, verdict.state, verdict.reason, extra=extra)
            return
        extra["restart_count"] = job["restart_count"] + 1
        if verdict.retry_after:
            extra["eligible_time"] = now + verdict.retry_after
        self._set_job_state(
            conn,
            job,
            verdict.state,
            verdict.reason,
            extra=extra,
            event_kind="job.requeue" if verdict.action is Action.REQUEUE else "job.held",
            # why, for /metrics (requeues and retries by reason): the failure kind, or planned
            data={
                "why": verdict.why or (verdict.kind.value if verdict.kind else "planned"),
                "retry": verdict.retry,
            },
        )

    def _attempt_running(
        self,
        conn: Connection,
        att: dict[str, Any],
        job: dict[str, Any],
        start: float,
        spares: bool,
    ) -> None:
        """A STARTING attempt's first task started: the attempt (and a STARTING job) runs from
        `start`; `att` and `job` are updated in place for what the caller writes next (a task
        that also exited in this report ends the job)."""
        tl = job["time_limit_s"]
        update_where(
            conn,
            s.attempts,
            {"id": att["id"]},
            {
                "state": AttemptState.RUNNING.value,
                "start_time": start,
                "expected_end": (start + tl) if tl else None,
            },
        )
        att["state"] = AttemptState.RUNNING.value
        att["start_time"] = start
        if spares:  # spares hold their nodes while the job runs
            conn.execute(
                update(s.tasks)
                .where(
                    s.tasks.c.attempt_id == att["id"],
                    s.tasks.c.spare.is_(True),
                    s.tasks.c.state == TaskState.STARTING.value,
                )
                .values(state=TaskState.RUNNING.value)
            )
        if job["state"] == JobState.STARTING.value:
            self._set_job_state(
                conn,
                job,
                JobState.RUNNING,
                None,
                extra={"start_time": start},
                message=f"running on {','.join(att['nodes'])}",
            )
            job["state"] = JobState.RUNNING.value
            job["start_time"] = start

    def _runs_on_all_nodes(self, conn: Connection, job_id: int) -> bool:
        """The job asked for its script on every node (--all-nodes), not Slurm's batch step."""
        spec = only(select_where(conn, s.jobs, {"id": job_id}, cols=["spec"]))["spec"]
        return bool((spec or {}).get("all_nodes"))

    def _release_spares(self, conn: Connection, attempt_id: int, now: float) -> None:
        """The attempt ended: its spare tasks (which never ran anything) end with it."""
        conn.execute(
            update(s.tasks)
            .where(
                s.tasks.c.attempt_id == attempt_id,
                s.tasks.c.spare.is_(True),
                s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
            )
            .values(state=TaskState.EXITED.value, ended_at=now)
        )

    def _fast_restart(
        self,
        conn: Connection,
        job: dict[str, Any],
        att: dict[str, Any],
        tasks: list[dict[str, Any]],
        spare_tasks: list[dict[str, Any]],
        reason: str | None,
        now: float,
    ) -> bool:
        """An elastic or spare job lost a node: back to PENDING with its nodes reserved.

        The job restarts at once on its surviving nodes (a spare in place of the failed rank,
        rank layout kept; an elastic job may shrink to MIN and grow with free nodes) without
        going back through the queue: the scheduler places a job with a live reservation first
        and closes its nodes to everyone else until `reserved_until`. It spends one retry of
        the job's budget (as any node-failure requeue does) and sets no backoff. False when the
        job is not elastic or spare, is not requeue-able, was being stopped on purpose, its
        retry rules do not retry node failures or its budget is spent, or too few nodes are
        left (then the usual policy decides).
        """
        stop = att["stop_reason"] or ""
        if not job["requeue"] or stop.startswith(("cancel", "requeue", TIMEOUT_STOP)):
            return False
        nodes_max, spares = self._elastic_of(conn, int(job["id"]))
        if nodes_max is None and not spares:
            return False
        # A node failure is a failure whatever the job's shape: the restart spends a retry like
        # any node-failure requeue, so a job whose nodes keep dying cannot restart forever.
        rules = self._retry_rules(conn, int(job["id"]))
        used = int(job["retries"] or 0)
        if (
            rules.never
            or not rules.retry_on.retries(FailureKind.NODE_FAIL)
            or used >= rules.max_retries
        ):
            return False
        failed = {
            t["node"]
            for t in tasks
            if t["state"] == TaskState.LOST.value or (t["detail"] or {}).get("fenced")
        }
        failed |= {t["node"] for t in spare_tasks if t["state"] == TaskState.LOST.value}
        ranks = [t["node"] for t in sorted(tasks, key=lambda t: t["rank"])]
        spare_nodes = [t["node"] for t in spare_tasks]
        candidates = sorted(set(ranks + spare_nodes) - failed)
        failed |= unusable_nodes(conn, candidates)
        layout = restart_layout(
            ranks,
            spare_nodes,
            failed,
            nodes_min=int(job["nodes"]),
            elastic=nodes_max is not None,
        )
        if layout is None:
            return False
        until = now + self.restart_reservation
        lost = sorted(failed & set(ranks))
        why = (
            f"restarting on {len(layout)} reserved nodes after losing {','.join(lost) or 'a node'}"
            f" ({reason or 'node failure'}); retry {used + 1} of {rules.max_retries}"
        )
        extra: dict[str, Any] = {
            "restart_count": job["restart_count"] + 1,
            "retries": used + 1,
            "reserved_nodes": layout,
            "reserved_until": until,
            "eligible_time": None,
        }
        avoid = self._avoidable(conn, job, sorted(failed))
        if avoid:
            extra["avoid_nodes"] = avoid
        return self._set_job_state(
            conn,
            job,
            JobState.PENDING,
            why,
            extra=extra,
            event_kind="job.restart",
            data={"why": "node_fail", "retry": True},
            message=f"{job['state']} -> PENDING: {why}; reserved {','.join(layout)} for "
            f"{self.restart_reservation:g}s",
        )

    def _elastic_of(self, conn: Connection, job_id: int) -> tuple[int | None, int]:
        """(elastic MAX or None, spare count) of a job, from its stored spec."""
        row = conn.execute(select(*_elastic_columns()).where(s.jobs.c.id == job_id)).one()
        nodes_max = int(row.nodes_max) if row.nodes_max else None
        return nodes_max, int(row.spares or 0)

    def _retry_rules(self, conn: Connection, job_id: int) -> RetryRules:
        """The job's retry rules: its own --retries/--retry-on/--retry-backoff (kept in its
        spec, checked at submit) over the cluster's defaults."""
        spec = only(select_where(conn, s.jobs, {"id": job_id}, cols=["spec"]))["spec"]
        return self.policy.job_rules(spec)

    def _avoidable(
        self, conn: Connection, job: dict[str, Any], failed: Sequence[str]
    ) -> list[str] | None:
        """Nodes the job should avoid from now on, unless that would leave too few to run it:
        its nodes and its spares (a job with --spares=1 on three nodes that avoided two of them
        would wait for ever, "Resources", on a healthy cluster). A node the job asks for by
        name (-w/--nodelist) is never avoided: the job could run nowhere else."""
        required = set(job["nodelist"] or [])
        avoid = sorted((set(job["avoid_nodes"] or []) | set(failed)) - required)
        _, spares = self._elastic_of(conn, int(job["id"]))
        usable = conn.execute(
            select(func.count())
            .select_from(s.nodes)
            .where(
                s.nodes.c.registered.is_(True),
                s.nodes.c.name.not_in(avoid + list(job["exclude"] or [])),
            )
        ).scalar_one()
        return avoid if usable >= int(job["nodes"]) + spares else None

    def _count_node_launch_failures(self, conn: Connection, failed: list[tuple[str, str]]) -> None:
        """Failed launches in a row on one node drain it: something there is broken."""
        limit = self.policy.node_launch_failures_to_drain
        for node, error in failed:
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == node)
                .values(launch_failures=s.nodes.c.launch_failures + 1)
            )
            row = conn.execute(
                select(s.nodes.c.launch_failures, s.nodes.c.drain).where(s.nodes.c.name == node)
            ).first()
            if row is not None and row.launch_failures >= limit and not row.drain:
                reason = f"{row.launch_failures} launch failures in a row, last: {error}"
                conn.execute(
                    update(s.nodes)
                    .where(s.nodes.c.name == node)
                    .values(drain=True, drain_reason=reason, drain_by="phalanx", drain_time=_now())
                )
                self._event(conn, "node.drain", f"drained by phalanx: {reason}", node=node)

    def _drain_for_hook(
        self, conn: Connection, node: str, attempt_id: int, detail: dict[str, Any]
    ) -> None:
        """A task's prolog or epilog failed on `node` (`outcome.hook_drain`): drain the node
        with the hook's sentence as the reason, in the report's transaction, until an operator
        resumes it. A node already drained keeps its drain (an operator's reason is not
        overwritten); the job's own history still says what happened."""
        job_id = conn.execute(
            select(s.attempts.c.job_id).where(s.attempts.c.id == attempt_id)
        ).scalar()
        drain = hook_drain(detail, job_id)
        if drain is None:
            return
        by, reason = drain
        row = conn.execute(select(s.nodes.c.drain).where(s.nodes.c.name == node)).first()
        if row is None or row.drain:
            return
        conn.execute(
            update(s.nodes)
            .where(s.nodes.c.name == node)
            .values(
                drain=True, drain_reason=reason[:_DRAIN_REASON_MAX], drain_by=by, drain_time=_now()
            )
        )
        self._event(
            conn,
            "node.drain",
            f"drained by {by}: {reason}",
            node=node,
            actor=node,
            data={"drain_by": by, "job_id": job_id},
        )

    def requeue_lost_launch(self, attempt_id: int, reason: str, fence: Fence | None) -> bool:
        """A STARTING attempt nobody confirmed: mark its tasks lost and advance (used by the reaper)."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            att = (
                conn.execute(select(s.attempts).where(s.attempts.c.id == attempt_id))
                .mappings()
                .first()
            )
            if att is None or att["state"] == AttemptState.ENDED.value:
                return False
            conn.execute(
                update(s.tasks)
                .where(
                    s.tasks.c.attempt_id == attempt_id,
                    s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                )
                .values(state=TaskState.LOST.value, ended_at=_now(), detail={"error": reason})
            )
            self._advance_attempt(conn, attempt_id)
            return True
