"""Nodes: registration, drain and resume, health verdicts, and a node's death.

A node declared DOWN and the end of every task it ran are one transaction (`mark_down`), which
checks the node's silence again inside it: a heartbeat another controller wrote after the
detector read keeps the node up.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Connection,
    func,
    insert,
    select,
    update,
)

from phalanx.domain.detector import heard_horizon
from phalanx.domain.states import (
    AttemptState,
    TaskState,
)
from phalanx.errors import InvalidSpec, InvalidTransition, NotFound
from phalanx.store import schema as s
from phalanx.store.attempts import _JOB_SUMMARY_BY_ID, AttemptProgress
from phalanx.store.engine import Engines
from phalanx.store.sqlbits import Fence
from phalanx.store.sqlbits import active_tasks as _active_tasks
from phalanx.store.sqlbits import now as _now


class NodeRecords(AttemptProgress):
    """Nodes."""

    def register_node(
        self,
        name: str,
        *,
        cpus: int,
        mem_mb: int,
        gpus: list[list[Any]],
        features: list[str],
        addr: str | None,
        boot_id: str | None,
        version: str | None,
        health: dict[str, Any] | None = None,
        topology: dict[str, str] | None = None,
        steps_at: str | None = None,
    ) -> dict[str, Any]:
        now = _now()
        values = {
            "topology": topology or None,
            "registered": True,
            "cpus": cpus,
            "mem_mb": mem_mb,
            "gpus": gpus,
            "features": sorted(set(features)),
            "addr": addr,
            "boot_id": boot_id,
            "agent_version": version,
            "registered_at": now,
            "last_heartbeat": now,
            "steps_at": steps_at,
        }
        with self.db.begin() as conn:
            values["last_heartbeat"] = float(
                conn.execute(select(self.db.db_now_sql())).scalar_one()
            )
            row = conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().first()
            if row is None:
                conn.execute(
                    insert(s.nodes).values(name=name, down=False, drain=False, work_gen=0, **values)
                )
                self._event(
                    conn,
                    "node.register",
                    f"node {name} registered: {cpus} cpus, {mem_mb} MB, {len(gpus)} gpus",
                    node=name,
                    actor=name,
                )
            else:
                if row["down"]:
                    values.update(down=False, down_reason=None)
                    self._event(
                        conn,
                        "node.up",
                        f"node {name} is back (was DOWN: {row['down_reason']})",
                        node=name,
                        actor=name,
                    )
                else:
                    self._event(
                        conn, "node.register", f"node {name} re-registered", node=name, actor=name
                    )
                conn.execute(update(s.nodes).where(s.nodes.c.name == name).values(**values))
            if health:
                # in the same transaction: a node failing its preflight is never schedulable
                self._apply_health(conn, name, health)
            return dict(
                conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().one()
            )

    def fail_node_tasks(self, node: str, reason: str, fence: Fence | None) -> list[int]:
        """Every unfinished task on a node that is DOWN is LOST; its attempts end (requeue or
        NODE_FAIL). `mark_down` already does this in the transaction that marks the node; this
        is the repair for a DOWN node found still holding live tasks (`down_nodes_with_tasks`:
        rows written by an older version that split the two, or by a hand edit)."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            return self._fail_node_tasks(conn, node, reason, fence)

    def _fail_node_tasks(
        self, conn: Connection, node: str, reason: str, fence: Fence | None
    ) -> list[int]:
        rows = conn.execute(
            select(s.tasks.c.attempt_id, s.tasks.c.spare, s.attempts.c.job_id)
            .join(s.attempts, s.attempts.c.id == s.tasks.c.attempt_id)
            .where(
                s.tasks.c.node == node,
                s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                s.attempts.c.state != AttemptState.ENDED.value,
            )
        ).all()
        aids = sorted({int(r.attempt_id) for r in rows})
        for r in rows:
            if r.spare:  # the job runs on; a later failure has one spare less
                self._event(
                    conn,
                    "job.spare_lost",
                    f"spare node {node} lost: {reason}",
                    job_id=int(r.job_id),
                    node=node,
                    term=fence.term if fence else None,
                )
        if aids:
            conn.execute(
                update(s.tasks)
                .where(
                    s.tasks.c.node == node,
                    s.tasks.c.attempt_id.in_(aids),
                    s.tasks.c.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                )
                .values(state=TaskState.LOST.value, ended_at=_now(), detail={"error": reason})
            )
        for aid in aids:
            self._advance_attempt(conn, aid)
        return aids

    def down_nodes_with_tasks(self) -> list[str]:
        """DOWN nodes that still hold a live task of a live attempt: none, unless rows were
        written apart from `mark_down` (an older version marked a node DOWN and failed its
        tasks in two transactions, and a controller dying between them left a ghost job
        holding its resources forever). The failure detector repairs them every tick."""
        t, a, n = s.tasks.c, s.attempts.c, s.nodes.c
        with self.db.begin(write=False) as conn:
            return [
                str(r.node)
                for r in conn.execute(
                    select(t.node)
                    .distinct()
                    .join(s.attempts, a.id == t.attempt_id)
                    .join(s.nodes, n.name == t.node)
                    .where(
                        n.down.is_(True),
                        t.state.in_([TaskState.STARTING.value, TaskState.RUNNING.value]),
                        a.state != AttemptState.ENDED.value,
                    )
                    .order_by(t.node)
                )
            ]

    def node_count(self) -> int:
        """Node rows, registered or only configured: the size the heartbeat rule scales the
        timings for (Controller.rescale_timing). Rows are never deleted, so it never falls,
        which is what makes the rule safe to apply while the cluster runs."""
        with self.db.begin(write=False) as conn:
            return int(conn.execute(select(func.count()).select_from(s.nodes)).scalar_one())

    def heard_horizon(self, window: float) -> tuple[float, float]:
        """(database now, the time through which the store holds every heartbeat that the
        controllers live within `window` seconds answered): domain/detector.py says why."""
        with self.db.begin(write=False) as conn:
            return _heard_horizon(self.db, conn, window)

    def silent_node_rows(self, heard_before: float) -> list[dict[str, Any]]:
        """Registered, not-DOWN nodes whose last heartbeat in the store is older than
        `heard_before` (database clock): the failure detector's candidates (name, registered,
        down, last_heartbeat). The filter runs in the database, so a detector tick on a
        healthy 10,000-node cluster reads no rows instead of all of them with their usage."""
        n = s.nodes.c
        with self.db.begin(write=False) as conn:
            return [
                dict(r)
                for r in conn.execute(
                    select(n.name, n.registered, n.down, n.last_heartbeat)
                    .where(
                        n.registered.is_(True), n.down.is_(False), n.last_heartbeat < heard_before
                    )
                    .order_by(n.name)
                ).mappings()
            ]

    def list_nodes(self) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            nodes = [
                dict(r) for r in conn.execute(select(s.nodes).order_by(s.nodes.c.name)).mappings()
            ]
            usage: dict[str, dict[str, Any]] = {}
            spare_for: dict[str, list[int]] = {}
            for r in conn.execute(
                _active_tasks(
                    s.tasks.c.node,
                    s.tasks.c.cpus,
                    s.tasks.c.mem_mb,
                    s.tasks.c.gpu_ids,
                    s.attempts.c.job_id,
                    s.tasks.c.spare,
                )
            ).mappings():
                u = usage.setdefault(r["node"], {"cpus": 0, "mem_mb": 0, "gpus": 0, "jobs": []})
                u["cpus"] += r["cpus"]
                u["mem_mb"] += r["mem_mb"]
                u["gpus"] += len(r["gpu_ids"] or [])
                u["jobs"].append(int(r["job_id"]))
                if r["spare"]:  # held for the job as a hot spare (counts as used)
                    spare_for.setdefault(r["node"], []).append(int(r["job_id"]))
        for n in nodes:
            n["used"] = usage.get(n["name"], {"cpus": 0, "mem_mb": 0, "gpus": 0, "jobs": []})
            n["spare_for"] = sorted(spare_for.get(n["name"], []))
        return nodes

    def step_addresses(self, names: list[str]) -> dict[str, str]:
        """node -> the host:port its agent registered for step launches and usage requests
        (absent: none registered)."""
        if not names:
            return {}
        with self.db.begin(write=False) as conn:
            rows = conn.execute(
                select(s.nodes.c.name, s.nodes.c.steps_at).where(s.nodes.c.name.in_(names))
            )
            return {r.name: r.steps_at for r in rows if r.steps_at}

    def get_node(self, name: str) -> dict[str, Any]:
        for n in self.list_nodes():
            if n["name"] == name:
                return n
        raise NotFound(f"node {name} does not exist", node=name)

    def drain(self, name: str, reason: str, actor: str, *, now: bool = False) -> list[int]:
        """No new work on the node. With `now`, its requeue-able jobs also get their
        checkpoint signal and are requeued; the others run to their end. Returns the jobs
        being requeued."""
        if not reason.strip():
            raise InvalidSpec("drain needs a reason (--reason)", field="reason")
        with self.db.begin() as conn:
            row = conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().first()
            if row is None:
                raise NotFound(f"node {name} does not exist", node=name)
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == name)
                .values(drain=True, drain_reason=reason, drain_by=actor, drain_time=_now())
            )
            self._event(
                conn,
                "node.drain",
                f"drained{' now' if now else ''} by {actor}: {reason}",
                node=name,
                actor=actor,
            )
            if not now:
                return []
            return self._requeue_running_on(
                conn, name, f"requeue: node {name} drained by {actor}: {reason}", actor
            )

    def _requeue_running_on(self, conn: Connection, node: str, why: str, actor: str) -> list[int]:
        """Planned stop of the requeue-able jobs with a task on `node` (checkpoint, then requeue).

        A hot spare on the node is no reason to stop its job: nothing runs there, and a drained
        node is never used when the job restarts."""
        rows = conn.execute(
            select(s.attempts.c.id, s.attempts.c.state, s.attempts.c.nodes, s.attempts.c.job_id)
            .join(s.tasks, s.tasks.c.attempt_id == s.attempts.c.id)
            .where(
                s.tasks.c.node == node,
                s.tasks.c.spare.is_(False),
                s.attempts.c.state.in_([AttemptState.STARTING.value, AttemptState.RUNNING.value]),
            )
        ).all()
        requeued = []
        for r in rows:
            job = _JOB_SUMMARY_BY_ID.one(conn, {"id": r.job_id})
            if not job["requeue"] or job["attempt_id"] != r.id:
                continue
            if self._planned_stop(conn, dict(r._mapping), job, why, actor=actor):
                requeued.append(int(r.job_id))
        return requeued

    def apply_health(self, node: str, summary: dict[str, Any]) -> str | None:
        """Act on an agent's health summary; return a sentence when something changed.

        fail: drain (by `health:<check>`) and requeue its requeue-able jobs with a checkpoint;
        warn: drain only (no new work); ok: a node drained by a health check resumes. A node
        an operator drained stays drained whatever the checks say.
        """
        with self.db.begin() as conn:
            return self._apply_health(conn, node, summary)

    def _apply_health(self, conn: Connection, node: str, summary: dict[str, Any]) -> str | None:
        status = summary.get("status") or "ok"
        row = conn.execute(select(s.nodes).where(s.nodes.c.name == node)).mappings().first()
        if row is None:
            return None
        prev = (row["health"] or {}).get("status") or "ok"
        conn.execute(update(s.nodes).where(s.nodes.c.name == node).values(health=summary))
        by_health = (row["drain_by"] or "").startswith("health:")
        said = None
        if status in ("fail", "warn"):
            check = summary.get("check") or "health"
            reason = f"health check {check}: {summary.get('reason') or status}"
            if not row["drain"] or (by_health and row["drain_reason"] != reason):
                conn.execute(
                    update(s.nodes)
                    .where(s.nodes.c.name == node)
                    .values(
                        drain=True,
                        drain_reason=reason,
                        drain_by=f"health:{check}",
                        drain_time=_now(),
                    )
                )
                self._event(
                    conn,
                    "node.drain",
                    f"drained: {reason}",
                    node=node,
                    actor=node,
                    # a check turning to `fail` is a node failure (failure_history counts it)
                    data={
                        "drain_by": f"health:{check}",
                        "status": status,
                        "failure": status == "fail" and prev != "fail",
                    },
                )
                said = f"{node} drained: {reason}"
            if status == "fail" and prev != "fail":
                jobs = self._requeue_running_on(conn, node, f"requeue: {node} {reason}", node)
                if jobs:
                    said = f"{said or node}; requeueing jobs {jobs}"
        elif row["drain"] and by_health:
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == node)
                .values(drain=False, drain_reason=None, drain_by=None, drain_time=None)
            )
            self._event(
                conn,
                "node.resume",
                f"resumed: health checks pass again (was: {row['drain_reason']})",
                node=node,
                actor=node,
            )
            said = f"{node} resumed by its health checks"
        return said

    def resume(self, name: str, actor: str) -> None:
        with self.db.begin() as conn:
            row = conn.execute(select(s.nodes).where(s.nodes.c.name == name)).mappings().first()
            if row is None:
                raise NotFound(f"node {name} does not exist", node=name)
            if not row["drain"] and not row["down"]:
                raise InvalidTransition(f"node {name} is neither drained nor down", node=name)
            conn.execute(
                update(s.nodes)
                .where(s.nodes.c.name == name)
                .values(
                    drain=False,
                    drain_reason=None,
                    drain_by=None,
                    drain_time=None,
                    down=False,
                    down_reason=None,
                )
            )
            self._event(conn, "node.resume", f"resumed by {actor}", node=name, actor=actor)

    def mark_down(
        self,
        name: str,
        reason: str,
        fence: Fence | None,
        *,
        silent_for: float | None = None,
        heard_window: float | None = None,
    ) -> bool:
        """Declare a node DOWN and, in the same transaction, fail every task it runs (LOST;
        each attempt requeued or ended by its policy). One transaction, so no controller
        death, lost lease or store error between the two can leave a DOWN node with RUNNING
        tasks that nothing would ever fail. False (nothing written) when it already was DOWN.

        `silent_for` (the failure detector's verdict): only if the node's last heartbeat is
        still older than this many seconds before the heard horizon (`heard_horizon`) when
        the write happens. The detector reads the silent nodes first; a heartbeat another
        controller writes between that read and this write (a slow tick, a busy database),
        or one a live controller has answered but not yet written, must keep the node up, as
        its agent's fence was freshened by that heartbeat's reply. `heard_window`: how long a
        controller's mark holds the horizon back (Timing.heard_window; default `silent_for`)."""
        n = s.nodes.c
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            q = update(s.nodes).where(n.name == name, n.down.is_(False))
            if silent_for is not None:
                window = silent_for if heard_window is None else heard_window
                _, horizon = _heard_horizon(self.db, conn, window)
                q = q.where(n.last_heartbeat < horizon - silent_for)
            res = conn.execute(q.values(down=True, down_reason=reason))
            if res.rowcount != 1:
                return False
            self._event(
                conn, "node.down", f"DOWN: {reason}", node=name, term=fence.term if fence else None
            )
            self._fail_node_tasks(conn, name, f"node {name} is DOWN: {reason}", fence)
            return True

    def stale_starting_attempts(self, older_than: float) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            return [
                dict(r)
                for r in conn.execute(
                    select(s.attempts).where(
                        s.attempts.c.state == AttemptState.STARTING.value,
                        s.attempts.c.created_at < older_than,
                    )
                ).mappings()
            ]


def _heard_horizon(db: Engines, conn: Connection, window: float) -> tuple[float, float]:
    """(database now, heard horizon) read in the caller's transaction."""
    db_now = float(conn.execute(select(db.db_now_sql())).scalar_one())
    marks = conn.execute(select(s.controllers.c.flushed_through)).scalars().all()
    return db_now, heard_horizon(db_now, marks, window)
