"""Recovery inside the allocation: a --no-kill job that lost a node goes on in its attempt.

`domain.elastic.keep_running` decides (pure); this writes it, in the transaction that found
the loss (a node declared DOWN: `Store.mark_down`; a task reported fenced), so the loss and
the regroup are one commit and no requeue or stop of the survivors is ever written:

* each task on a node that left stays LOST, marked ``left`` (and no longer held: the node's
  heartbeat and its capacity no longer see it); the attempt's outcome ignores it from now on;
* a spare that takes a lost rank becomes a rank task (`spare` false, that rank, STARTING): its
  agent starts the job's task there as for any start (the batch step's holder, or the script
  with --all-nodes), with the environment of the new node list;
* each running step's live task on a node that left moves to the node in its place, at the
  same position of the step's node list (same task ids): the agent there starts it, and it
  reports to the step's srun like the task it replaces; with nobody in its place it is lost;
* the attempt's node list and `membership` (generation, what changed) and the job's
  `nodelist_run` follow; events `job.node_left` and `job.node_joined`; every node of the job
  is woken (the survivors' agents write the new membership to the job's control file).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select, update

from phalanx.domain.elastic import Regroup, keep_running, move_steps
from phalanx.domain.states import AttemptState, JobState, TaskState
from phalanx.store import schema as s
from phalanx.store.sqlbits import unusable_nodes
from phalanx.store.steps import JobSteps

MEMBERSHIP_CHANGES_KEPT = 16  # the latest changes an attempt's membership lists


def left_job(t: dict[str, Any]) -> bool:
    """A task on a node that left its (still running) attempt: no part of its outcome."""
    return bool((t["detail"] or {}).get("left"))


def lost_node(t: dict[str, Any]) -> bool:
    """The task's node is gone from the job: lost, or the job stopped there by self-fencing."""
    return t["state"] == TaskState.LOST.value or bool((t["detail"] or {}).get("fenced"))


def _recovery_columns() -> list[Any]:
    spec = s.jobs.c.spec
    return [
        spec["no_kill"].as_boolean().label("no_kill"),
        spec["nodes_max"].as_integer().label("nodes_max"),
        spec["all_nodes"].as_boolean().label("all_nodes"),
        s.jobs.c.nodes,
    ]


class InPlaceRecovery(JobSteps):
    """--no-kill jobs regrouping in their allocation."""

    def _regroup(
        self,
        conn: Connection,
        job: dict[str, Any],
        att: dict[str, Any],
        tasks: list[dict[str, Any]],
        spare_tasks: list[dict[str, Any]],
        now: float,
    ) -> bool:
        """Keep a --no-kill job running after some of its rank nodes were lost (`tasks`: the
        attempt's rank tasks that have not left; `spare_tasks`: its spares). False, with
        nothing written, when the job is not --no-kill, is not simply running, or
        `keep_running` says it cannot go on (then the usual failure path applies)."""
        if (
            att["state"] != AttemptState.RUNNING.value
            or att["stop_reason"]
            or job["attempt_id"] != att["id"]
            or job["state"] != JobState.RUNNING.value
        ):
            return False
        gone = [t for t in tasks if lost_node(t)]
        if not gone:
            return False
        row = conn.execute(select(*_recovery_columns()).where(s.jobs.c.id == job["id"])).one()
        if not row.no_kill:
            return False
        unusable = {t["node"] for t in spare_tasks if t["state"] == TaskState.LOST.value}
        live_spares = [t["node"] for t in spare_tasks if t["node"] not in unusable]
        unusable |= unusable_nodes(conn, live_spares)
        elastic = row.nodes_max is not None
        plan = keep_running(
            [(int(t["rank"]), t["node"]) for t in sorted(tasks, key=lambda t: t["rank"])],
            [t["node"] for t in spare_tasks],
            {t["node"] for t in gone} | unusable,
            nodes_min=int(row.nodes) if elastic else 1,
            batch_host=not row.all_nodes,
        )
        if plan is None:
            return False
        reason = next(
            (str((t["detail"] or {}).get("error") or "") for t in gone if t["detail"]), ""
        ) or ("stopped by self-fencing" if any(t["state"] != "LOST" for t in gone) else "lost")
        self._write_regroup(conn, job, att, gone, plan, reason, now)
        return True

    def _write_regroup(
        self,
        conn: Connection,
        job: dict[str, Any],
        att: dict[str, Any],
        gone: list[dict[str, Any]],
        plan: Regroup,
        reason: str,
        now: float,
    ) -> None:
        aid, jid = int(att["id"]), int(job["id"])
        moves = plan.moves
        for t in gone:
            detail = {**(t["detail"] or {}), "left": True, "replaced_by": moves.get(t["node"])}
            conn.execute(
                update(s.tasks)
                .where(s.tasks.c.attempt_id == aid, s.tasks.c.node == t["node"])
                .values(detail=detail, held=False, ended_at=t["ended_at"] or now)
            )
        for spare, rank, _old in plan.joined:
            conn.execute(
                update(s.tasks)
                .where(s.tasks.c.attempt_id == aid, s.tasks.c.node == spare)
                .values(
                    spare=False,
                    rank=rank,
                    state=TaskState.STARTING.value,
                    started_at=None,
                    ended_at=None,
                    detail=None,
                )
            )
        old = att.get("membership") or {}
        gen = int(old.get("gen") or 0) + 1
        change = {
            "gen": gen,
            "at": now,
            "left": list(plan.left),
            "joined": [{"node": n, "rank": r, "replaces": o} for n, r, o in plan.joined],
            "nodes": plan.nodes,
            "reason": reason,
        }
        changes = [*(old.get("changes") or []), change][-MEMBERSHIP_CHANGES_KEPT:]
        membership = {"gen": gen, "nodes": plan.nodes, "changes": changes}
        conn.execute(
            update(s.attempts)
            .where(s.attempts.c.id == aid)
            .values(nodes=plan.nodes, membership=membership)
        )
        conn.execute(update(s.jobs).where(s.jobs.c.id == jid).values(nodelist_run=plan.nodes))
        att["nodes"], att["membership"] = plan.nodes, membership
        ended_steps = self._move_step_tasks(conn, aid, moves, now)
        joined_by = {o: (n, r) for n, r, o in plan.joined}
        for node in plan.left:
            took = joined_by.get(node)
            then = (
                f"{took[0]} (a spare) takes its rank {took[1]}"
                if took
                else "nobody takes its place"
            )
            self._event(
                conn,
                "job.node_left",
                f"{node} left the job ({reason}): {then}; the job goes on on "
                f"{','.join(plan.nodes)} (--no-kill, membership {gen})",
                job_id=jid,
                node=node,
                data={"gen": gen, "replaced_by": took[0] if took else None, "reason": reason},
            )
        for spare, rank, replaces in plan.joined:
            self._event(
                conn,
                "job.node_joined",
                f"{spare} joined the job as rank {rank} in place of {replaces} (membership {gen})",
                job_id=jid,
                node=spare,
                data={"gen": gen, "rank": rank, "replaces": replaces},
            )
        self._bump_gen(conn, [*plan.nodes, *plan.left, *plan.spares])
        if ended_steps:
            self._end_finished_steps(conn, ended_steps, now)

    def _move_step_tasks(
        self, conn: Connection, aid: int, moves: dict[str, str | None], now: float
    ) -> set[tuple[int, int]]:
        """Start the running steps' live tasks of the nodes that left again on the nodes in
        their place (`move_steps`); returns the steps that lost a task for good (each may have
        ended with it)."""
        sn = s.step_nodes.c
        live: dict[int, set[str]] = {}
        for r in conn.execute(
            select(sn.step_id, sn.node).where(
                sn.attempt_id == aid,
                sn.node.in_(list(moves)),
                sn.state.in_(("STARTING", "RUNNING")),
            )
        ):
            live.setdefault(int(r.step_id), set()).add(str(r.node))
        if not live:
            return set()
        steps = [
            (int(r.step_id), list(r.nodes), live[int(r.step_id)])
            for r in conn.execute(
                select(s.steps.c.step_id, s.steps.c.nodes).where(
                    s.steps.c.attempt_id == aid,
                    s.steps.c.step_id.in_(sorted(live)),
                    s.steps.c.state == "RUNNING",
                )
            )
        ]
        lost: set[tuple[int, int]] = set()
        for mv in move_steps(steps, moves):
            conn.execute(
                update(s.steps)
                .where(s.steps.c.attempt_id == aid, s.steps.c.step_id == mv.step_id)
                .values(nodes=list(mv.nodes))
            )
            for old, new in mv.moved:
                conn.execute(
                    update(s.step_nodes)
                    .where(sn.attempt_id == aid, sn.step_id == mv.step_id, sn.node == old)
                    .values(node=new, state="STARTING", started_at=None, ended_at=None, exits=None)
                )
            for node in mv.lost:
                conn.execute(
                    update(s.step_nodes)
                    .where(sn.attempt_id == aid, sn.step_id == mv.step_id, sn.node == node)
                    .values(state="LOST", ended_at=now)
                )
                lost.add((aid, mv.step_id))
        return lost
