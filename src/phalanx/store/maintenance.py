"""Maintenance windows in the store: adding, listing and removing them, and the cluster duty's
fenced transitions (planned stops before a window, drain at its start, return after its end).

A mixin of `Store` (its methods take `self`): one class for callers, one file per topic.
The pure rules (which window blocks which job, what is due when) are in domain/maintenance.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, insert, select, update

from phalanx.domain import maintenance
from phalanx.domain.hostlist import compress_hostlist, expand_hostlist, hostname_sort_key
from phalanx.domain.states import AttemptState
from phalanx.errors import InvalidSpec, InvalidTransition, NotFound
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.prebuilt import Prebuilt
from phalanx.store.sqlbits import Fence, literal_in
from phalanx.store.sqlbits import active_tasks as _active_tasks
from phalanx.store.sqlbits import chunks as _chunks
from phalanx.store.sqlbits import now as _now

# read by every scheduling pass (store/scheduling.py): built once, run through the driver
_LIVE_WINDOWS = Prebuilt(
    select(s.maintenance)
    .where(literal_in(s.maintenance.c.state, (x.value for x in maintenance.LIVE)))
    .order_by(s.maintenance.c.start, s.maintenance.c.id)
)


class MaintenanceWindows(StoreBase):
    """The `maintenance` table's operations (see the module docstring)."""

    def _live_windows(self, conn: Connection) -> list[dict[str, Any]]:
        """Windows still to come or under way, earliest first."""
        return _LIVE_WINDOWS.rows(conn, {})

    def add_window(
        self,
        nodes_expr: str,
        start: float,
        end: float,
        reason: str | None,
        actor: str,
    ) -> dict[str, Any]:
        """Schedule a maintenance window on known nodes; InvalidSpec (422) says what to fix."""
        try:
            names = expand_hostlist(nodes_expr)
        except ValueError as e:
            raise InvalidSpec(f"nodes: {e}", field="nodes") from None
        if not names:
            raise InvalidSpec("nodes: no node given; use e.g. node[01-04]", field="nodes")
        now = _now()
        try:
            maintenance.check_window(start, end, now)
        except ValueError as e:
            raise InvalidSpec(str(e), field="start") from None
        reason = (reason or "").strip() or None
        with self.db.begin() as conn:
            known: set[str] = set()
            for i in range(0, len(names), 500):
                chunk = names[i : i + 500]
                known.update(
                    r.name
                    for r in conn.execute(select(s.nodes.c.name).where(s.nodes.c.name.in_(chunk)))
                )
            unknown = [n for n in names if n not in known]
            if unknown:
                listed = compress_hostlist(unknown)
                raise InvalidSpec(
                    f"nodes: unknown node{'s' if len(unknown) > 1 else ''} {listed}; "
                    "`phalanx nodes` lists the nodes of this cluster",
                    field="nodes",
                    unknown=unknown,
                )
            row = {
                "nodes_expr": nodes_expr.strip(),
                "nodes": names,
                "start": float(start),
                "end": float(end),
                "reason": reason,
                "state": maintenance.WindowState.SCHEDULED.value,
                "created_by": actor,
                "created_at": now,
            }
            pk = conn.execute(insert(s.maintenance).values(**row)).inserted_primary_key
            assert pk is not None
            wid = int(pk[0])
            w = maintenance.Window(wid, tuple(names), float(start), float(end), reason)
            self._event(
                conn,
                "maint.add",
                f"maintenance {wid} on {w.hostlist} from {maintenance.format_when(start, now)} "
                f"to {maintenance.format_when(end, now)} added by {actor}"
                + (f": {reason}" if reason else ""),
                actor=actor,
                data={"window": wid, "nodes": names, "start": start, "end": end},
            )
            return {"id": wid, **row}

    def list_windows(
        self, *, include_past: bool = False, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Scheduled and active windows (earliest first); with `include_past` also the latest
        done and removed ones."""
        with self.db.begin(write=False) as conn:
            live = self._live_windows(conn)
            if not include_past:
                return live
            past = [
                dict(r)
                for r in conn.execute(
                    select(s.maintenance)
                    .where(s.maintenance.c.state.not_in([str(x) for x in maintenance.LIVE]))
                    .order_by(s.maintenance.c.id.desc())
                    .limit(limit)
                ).mappings()
            ]
            return sorted(past, key=lambda r: (r["start"], r["id"])) + live

    def get_window(self, wid: int) -> dict[str, Any]:
        with self.db.begin(write=False) as conn:
            row = conn.execute(select(s.maintenance).where(s.maintenance.c.id == wid)).mappings()
            found = row.first()
        if found is None:
            raise NotFound(
                f"maintenance window {wid} does not exist (`phalanx maint list` shows them)",
                window=wid,
            )
        return dict(found)

    def remove_window(self, wid: int, actor: str) -> dict[str, Any]:
        """Remove a window; an active one returns the nodes it drained at once. Returns the row
        with `returned`: the nodes resumed."""
        with self.db.begin() as conn:
            row = (
                conn.execute(select(s.maintenance).where(s.maintenance.c.id == wid))
                .mappings()
                .first()
            )
            if row is None:
                raise NotFound(
                    f"maintenance window {wid} does not exist (`phalanx maint list` shows them)",
                    window=wid,
                )
            if row["state"] not in maintenance.LIVE:
                raise InvalidTransition(
                    f"maintenance window {wid} is already {row['state']}: nothing to remove",
                    window=wid,
                )
            res = conn.execute(
                update(s.maintenance)
                .where(s.maintenance.c.id == wid, s.maintenance.c.state == row["state"])
                .values(state=maintenance.WindowState.REMOVED.value)
            )
            if res.rowcount != 1:
                raise InvalidTransition(
                    f"maintenance window {wid} changed state meanwhile; try again", window=wid
                )
            returned = self._return_window_nodes(conn, wid, f"maintenance {wid} removed", actor)
            w = maintenance.Window.from_row(dict(row))
            self._event(
                conn,
                "maint.remove",
                f"maintenance {wid} on {w.hostlist} removed by {actor} (was {row['state']})"
                + (f"; returned {compress_hostlist(returned)}" if returned else ""),
                actor=actor,
                data={"window": wid, "was": row["state"], "returned": returned},
            )
            return {
                **dict(row),
                "state": maintenance.WindowState.REMOVED.value,
                "returned": returned,
            }

    def _return_window_nodes(self, conn: Connection, wid: int, why: str, actor: str) -> list[str]:
        """Resume exactly the nodes this window drained (an operator's or a health check's
        drain taken over meanwhile stays)."""
        by = maintenance.drain_by(wid)
        names = [
            str(r.name)
            for r in conn.execute(
                select(s.nodes.c.name).where(s.nodes.c.drain.is_(True), s.nodes.c.drain_by == by)
            )
        ]
        if not names:
            return []
        conn.execute(
            update(s.nodes)
            .where(s.nodes.c.name.in_(names), s.nodes.c.drain_by == by)
            .values(drain=False, drain_reason=None, drain_by=None, drain_time=None)
        )
        self._events_many(
            conn,
            [
                {"kind": "node.resume", "message": f"resumed: {why}", "node": n, "actor": actor}
                for n in names
            ],
        )
        return sorted(names, key=hostname_sort_key)

    def start_window(self, wid: int, fence: Fence | None) -> tuple[list[str], list[str]] | None:
        """The window starts (cluster duty): drain its nodes that are not drained already.
        Returns (drained, already drained by someone else), or None if it was not scheduled."""
        now = _now()
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            row = (
                conn.execute(select(s.maintenance).where(s.maintenance.c.id == wid))
                .mappings()
                .first()
            )
            if row is None or row["state"] != maintenance.WindowState.SCHEDULED.value:
                return None
            conn.execute(
                update(s.maintenance)
                .where(s.maintenance.c.id == wid)
                .values(state=maintenance.WindowState.ACTIVE.value)
            )
            w = maintenance.Window.from_row(dict(row))
            nodes = [
                dict(r)
                for r in conn.execute(
                    select(s.nodes.c.name, s.nodes.c.drain, s.nodes.c.drain_by).where(
                        s.nodes.c.name.in_(list(w.nodes))
                    )
                ).mappings()
            ]
            plan = maintenance.plan_drain(w, nodes)
            reason = maintenance.drain_reason(w, now)
            by = maintenance.drain_by(wid)
            term = fence.term if fence else None
            if plan.drain:
                conn.execute(
                    update(s.nodes)
                    .where(s.nodes.c.name.in_(list(plan.drain)))
                    .values(drain=True, drain_reason=reason, drain_by=by, drain_time=now)
                )
                self._events_many(
                    conn,
                    [
                        {
                            "kind": "node.drain",
                            "message": f"drained: {reason}",
                            "node": n,
                            "actor": by,
                            "term": term,
                        }
                        for n in plan.drain
                    ],
                )
            busy = sorted(
                {
                    int(r.job_id)
                    for r in conn.execute(
                        _active_tasks(s.attempts.c.job_id).where(s.tasks.c.node.in_(list(w.nodes)))
                    )
                }
            )
            msg = f"maintenance {wid} started: drained {compress_hostlist(plan.drain) or 'no node'}"
            if plan.already:
                msg += f"; already drained by others: {compress_hostlist(plan.already)}"
            if busy:
                msg += f"; jobs still on its nodes: {', '.join(map(str, busy))}"
            self._event(
                conn,
                "maint.start",
                msg,
                actor=by,
                term=term,
                data={"window": wid, "drained": list(plan.drain), "already": list(plan.already)},
            )
            return list(plan.drain), list(plan.already)

    def end_window(self, wid: int, fence: Fence | None) -> list[str] | None:
        """The window is over (cluster duty): it is done and the nodes it drained return. A
        window that was never started (no controller held the duty during it) just ends.
        Returns the nodes returned, or None if the window was not live."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            row = (
                conn.execute(select(s.maintenance).where(s.maintenance.c.id == wid))
                .mappings()
                .first()
            )
            if row is None or row["state"] not in maintenance.LIVE:
                return None
            conn.execute(
                update(s.maintenance)
                .where(s.maintenance.c.id == wid)
                .values(state=maintenance.WindowState.DONE.value)
            )
            by = maintenance.drain_by(wid)
            returned = self._return_window_nodes(conn, wid, f"maintenance {wid} is over", by)
            skipped = row["state"] == maintenance.WindowState.SCHEDULED.value
            self._event(
                conn,
                "maint.end",
                f"maintenance {wid} "
                + ("ended before it could start (no controller ran it)" if skipped else "ended")
                + (f"; returned {compress_hostlist(returned)}" if returned else ""),
                actor=by,
                term=fence.term if fence else None,
                data={"window": wid, "returned": returned, "skipped": skipped},
            )
            return returned

    def attempts_on(self, nodes: Sequence[str]) -> list[dict[str, Any]]:
        """Live (starting or running) attempts with a task on any of `nodes`: attempt_id,
        job_id, nodes, end (time limit end, None = unlimited), requeue."""
        if not nodes:
            return []
        with self.db.begin(write=False) as conn:
            ids: set[int] = set()
            for i in range(0, len(nodes), 500):
                names = list(nodes[i : i + 500])
                ids.update(
                    int(r.attempt_id)
                    for r in conn.execute(
                        select(s.tasks.c.attempt_id)
                        .join(s.attempts, s.attempts.c.id == s.tasks.c.attempt_id)
                        .where(
                            s.tasks.c.node.in_(names),
                            s.attempts.c.state.in_(
                                [AttemptState.STARTING.value, AttemptState.RUNNING.value]
                            ),
                        )
                    )
                )
            out = []
            for chunk in _chunks(sorted(ids), 500):
                for r in conn.execute(
                    select(
                        s.attempts.c.id,
                        s.attempts.c.job_id,
                        s.attempts.c.nodes,
                        s.attempts.c.start_time,
                        s.attempts.c.created_at,
                        s.attempts.c.expected_end,
                        s.jobs.c.time_limit_s,
                        s.jobs.c.requeue,
                        s.jobs.c.attempt_id.label("current"),
                    )
                    .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
                    .where(s.attempts.c.id.in_(chunk))
                ).mappings():
                    if r["current"] != r["id"]:
                        continue
                    end = r["expected_end"]
                    if end is None and r["time_limit_s"]:
                        end = (r["start_time"] or r["created_at"]) + r["time_limit_s"]
                    out.append(
                        {
                            "attempt_id": int(r["id"]),
                            "job_id": int(r["job_id"]),
                            "nodes": list(r["nodes"]),
                            "end": end,
                            "requeue": bool(r["requeue"]),
                        }
                    )
            return out

    def checkpoint_graces(self, job_ids: Sequence[int]) -> dict[int, float]:
        """The warning each job asked for before a planned stop (see
        `maintenance.job_checkpoint_grace`); read from the spec, which never changes."""
        out: dict[int, float] = {}
        with self.db.begin(write=False) as conn:
            for chunk in _chunks(sorted(set(job_ids)), 500):
                for r in conn.execute(
                    select(s.jobs.c.id, s.jobs.c.spec).where(s.jobs.c.id.in_(chunk))
                ):
                    out[int(r.id)] = maintenance.job_checkpoint_grace(r.spec)
        return out

    def stop_for_maintenance(
        self, stops: Sequence[tuple[int, int, str]], fence: Fence | None
    ) -> list[int]:
        """Planned stops before a window (cluster duty): each (attempt id, window id, stop
        reason) is asked to checkpoint and stop, and its job will be requeued. Only attempts
        still live and current, of jobs that may be requeued. Returns the jobs stopped."""
        if not stops:
            return []
        stopped: list[int] = []
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            term = fence.term if fence else None
            for aid, wid, why in stops:
                current = self._current_live_attempt(conn, aid)
                if current is None or not current[1]["requeue"]:
                    continue
                att, job = current
                by = maintenance.drain_by(wid)
                if not self._planned_stop(conn, att, job, why, actor=by, term=term):
                    continue
                self._event(
                    conn,
                    "maint.signal",
                    f"checkpoint and requeue before maintenance {wid}: {why}",
                    job_id=int(job["id"]),
                    actor=by,
                    term=term,
                    data={"window": wid, "attempt": aid},
                )
                stopped.append(int(job["id"]))
        return stopped
