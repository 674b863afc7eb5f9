"""The agents' hot path: heartbeats, the work a node should run, and the reports it sends.

Every agent calls here every heartbeat, so the statements are built once and read only the
columns they compare. A heartbeat stamp never moves back (a paused controller's late flush
cannot make a live node look silent); a report with a wrong attempt token is ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    func,
    or_,
    select,
    text,
    update,
)

from phalanx.domain import efficiency, job_reports
from phalanx.domain.states import (
    AttemptState,
    TaskState,
)
from phalanx.errors import StoreOutcomeUnknown, StoreUnavailable
from phalanx.store import schema as s
from phalanx.store.attempts import AttemptProgress
from phalanx.store.groupcommit import GroupCommit
from phalanx.store.prebuilt import Prebuilt, update_many
from phalanx.store.sqlbits import NODE_WORK_COLUMNS
from phalanx.store.sqlbits import active_tasks as _active_tasks
from phalanx.store.sqlbits import now as _now

# PostgreSQL's heartbeat flush (Exchange._record_heartbeats_postgresql). now() is the
# transaction's start, so the mark and the stamps share one clock reading.
_RETIRE_MARK = text("UPDATE controllers SET flushed_through = NULL WHERE id = :cid")
_ADVANCE_MARK = text(
    "UPDATE controllers SET flushed_through = extract(epoch from now()) - :back "
    "WHERE id = :cid AND (flushed_through IS NULL "
    "OR flushed_through < extract(epoch from now()) - :back)"
)
_STAMP_NODES = text(
    "UPDATE nodes SET last_heartbeat = extract(epoch from now()) - :waited - v.age "
    "FROM unnest(CAST(:names AS varchar[]), CAST(:ages AS float8[])) AS v(name, age) "
    "WHERE nodes.name = v.name AND (nodes.last_heartbeat IS NULL "
    "OR nodes.last_heartbeat <= extract(epoch from now()) - :waited - v.age) "
    "RETURNING nodes.name, nodes.down, nodes.down_reason"
)


@dataclass
class TaskReport:
    """What an agent says about one task (one attempt on its node)."""

    attempt_id: int
    token: str
    state: str  # "starting" | "running" | "exited" | "lost"
    started_at: float | None = None
    exit: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None  # the job's latest checkpoint marker on this node
    progress: dict[str, Any] | None = None  # the job's latest progress report on this node
    # the highest signal seq (scancel --signal) the agent delivered to this attempt; None from
    # agents that do not know signals
    signals_done: int | None = None
    # the membership generation (a --no-kill job's node changes, docs/elastic.md) the agent
    # wrote to the job's control file; None from agents that do not write it
    members_gen: int | None = None


# What `apply_reports` compares a heartbeat's reports with: only the columns it reads. Every
# held task of the node is read on every heartbeat, and whole rows decoded their JSON columns
# (gpu_ids, detail, usage) each time, which cost more than the rest of an "exited" report.
_REPORTED_COLUMNS = (
    s.tasks.c.attempt_id,
    s.tasks.c.rank,
    s.tasks.c.state,
    s.tasks.c.started_at,
    s.attempts.c.token,
    s.attempts.c.state.label("attempt_state"),
)
_REPORTED_TASKS = Prebuilt(
    _active_tasks(*_REPORTED_COLUMNS).where(
        s.tasks.c.node == bindparam("node"), s.tasks.c.spare.is_(False)
    )
)


# Store.node_work's query, built once with the node as a parameter: every heartbeat runs it,
# and building a statement of this size (and its cache key) costs about as much as running it
# on SQLite.
_NODE_WORK_COLUMNS = (
    s.tasks.c.attempt_id,
    s.tasks.c.state.label("task_state"),
    *NODE_WORK_COLUMNS,
    s.jobs.c.checkpoint.label("job_checkpoint"),
    s.attempts.c.progress.label("attempt_progress"),
    s.attempts.c.signals.label("attempt_signals"),
    s.attempts.c.membership.label("attempt_membership"),
)
_NODE_WORK = Prebuilt(
    _active_tasks(*_NODE_WORK_COLUMNS)
    .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
    .where(
        s.tasks.c.node == bindparam("node"),
        s.tasks.c.spare.is_(False),  # a hot spare runs nothing: the agent never sees it
    )
)
# _NODE_WORK for a group of exchanges' nodes at once, with each task's node
_NODE_WORK_OF = (
    _active_tasks(s.tasks.c.node.label("work_node"), *_NODE_WORK_COLUMNS)
    .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
    .where(s.tasks.c.node.in_(bindparam("nodes", expanding=True)), s.tasks.c.spare.is_(False))
)


_CLEAR_LAUNCH_FAILURES = (
    update(s.nodes)
    .where(s.nodes.c.name.in_(bindparam("nodes", expanding=True)), s.nodes.c.launch_failures > 0)
    .values(launch_failures=0)
)

# _REPORTED_TASKS for several nodes at once (a group of exchanges), with each task's node
_REPORTED_TASKS_OF = _active_tasks(s.tasks.c.node, *_REPORTED_COLUMNS).where(
    s.tasks.c.node.in_(bindparam("nodes", expanding=True)), s.tasks.c.spare.is_(False)
)

_Exchange = tuple[str, Sequence[TaskReport], float | None]  # (node, reports, taken_at)


class AgentReports(AttemptProgress):
    """The agents' hot path."""

    def record_config_versions(self, versions: Mapping[str, int]) -> None:
        """The cluster configuration version whose node settings each node's agent says it
        runs (`nodes.config_version`, migration 0021); only rows that differ are written."""
        if not versions:
            return
        n = s.nodes.c
        with self.db.begin() as conn:
            conn.execute(
                update(s.nodes)
                .where(
                    n.name == bindparam("b_name"),
                    or_(n.config_version.is_(None), n.config_version != bindparam("b_v")),
                )
                .values(config_version=bindparam("b_v")),
                [{"b_name": k, "b_v": int(v)} for k, v in sorted(versions.items())],
            )

    def record_heartbeats(
        self,
        ages: dict[str, float],
        *,
        controller: str | None = None,
        flushed_age: float | None = None,
        retire: bool = False,
    ) -> list[str]:
        """One transaction for a batch of heartbeats: node -> seconds since it was seen.

        Stamped with the database's clock (now - age), so controllers on hosts whose clocks
        disagree still agree on when a node was last heard from. A node that was DOWN only
        because it stopped answering is back in service as soon as it is heard from again
        (its jobs were requeued and its agent is told to stop the old attempts); an operator's
        drain is untouched. Returns the nodes that came back.

        A node's stamp never moves back. A controller that was paused (or slow) between
        answering a heartbeat and writing it flushes an older stamp than another controller
        already wrote for the node's later heartbeats: moving the stamp back would make the
        failure detector count the node silent since then, and declare it DOWN while its
        agent's fence (freshened by those later replies) still lets its jobs run. Such a stale
        heartbeat brings no DOWN node back either: it says nothing about the node since.

        `controller`, `flushed_age`: the flushing controller, and how long ago it took this
        batch: everything it heard before then is now stored, and its `flushed_through` mark
        (never moved back) says so in the same transaction (domain/detector.py,
        `heard_horizon`). With no heartbeats, only the mark is written. `retire`: the
        controller is stopping and answers no more heartbeats; with this last batch stored it
        holds no detector back, and its mark is cleared.

        Ages count from the call: the time this method waits for its turn to write (behind the
        process's other writers, or a busy database) is taken off, so neither a stamp nor the
        mark claims a moment later than the one it stands for.
        """
        if not ages and controller is None:
            return []
        called = time.monotonic()
        if self.dialect == "postgresql":
            return self._record_heartbeats_postgresql(ages, controller, flushed_age, retire, called)
        n = s.nodes.c
        # urgent (writers.WriterQueue): a flush that fails restarts the failure detector's
        # grace, so it must not wait behind bulk writes; one small row per node heard from
        with self.db.begin(urgent=True) as conn:
            db_now = float(conn.execute(select(self.db.db_now_sql())).scalar_one())
            waited = time.monotonic() - called
            stamps = {name: db_now - waited - age for name, age in ages.items()}
            c = s.controllers.c
            if controller is not None and retire:
                conn.execute(
                    update(s.controllers).where(c.id == controller).values(flushed_through=None)
                )
            elif controller is not None and flushed_age is not None:
                mark = db_now - waited - flushed_age
                conn.execute(
                    update(s.controllers)
                    .where(
                        c.id == controller,
                        or_(c.flushed_through.is_(None), c.flushed_through < mark),
                    )
                    .values(flushed_through=mark)
                )
            if not ages:
                return []
            rows = conn.execute(
                select(n.name, n.last_heartbeat).where(n.name.in_(sorted(ages)))
            ).all()
            newer = {
                r.name
                for r in rows
                if r.last_heartbeat is None or r.last_heartbeat <= stamps[r.name]
            }
            if newer:
                # the filter again in the update: on PostgreSQL another controller's flush
                # may commit between the read and this write
                conn.execute(
                    update(s.nodes)
                    .where(
                        n.name == bindparam("b_name"),
                        or_(n.last_heartbeat.is_(None), n.last_heartbeat <= bindparam("b_t")),
                    )
                    .values(last_heartbeat=bindparam("b_t")),
                    [{"b_name": name, "b_t": stamps[name]} for name in sorted(newer)],
                )
            # read after the update (which waited for any concurrent writer of these rows):
            # a node declared DOWN meanwhile comes back with this newer heartbeat
            back = conn.execute(
                select(n.name, n.down_reason).where(n.name.in_(sorted(newer)), n.down.is_(True))
            ).all()
            self._back_in_service(conn, [(r.name, r.down_reason) for r in back])
            return [r.name for r in back]

    def _record_heartbeats_postgresql(
        self,
        ages: dict[str, float],
        controller: str | None,
        flushed_age: float | None,
        retire: bool,
        called: float,
    ) -> list[str]:
        """`record_heartbeats` on PostgreSQL in as few statements as the data allows: the
        mark, then every stamp in one UPDATE over the batch's arrays whose RETURNING says which
        nodes were DOWN (read after any concurrent writer of the row, as the separate read
        did), then, only if some were, their return to service. The stamps and the mark are
        computed by the server from now() (the transaction's start: its first statement)
        less the time this method waited for its turn, as the general path does."""
        with self.db.begin(urgent=True) as conn:
            waited = time.monotonic() - called
            if controller is not None and retire:
                conn.execute(_RETIRE_MARK, {"cid": controller})
            elif controller is not None and flushed_age is not None:
                conn.execute(_ADVANCE_MARK, {"cid": controller, "back": waited + flushed_age})
            if not ages:
                return []
            names = sorted(ages)
            rows = conn.execute(
                _STAMP_NODES,
                {"names": names, "ages": [ages[x] for x in names], "waited": waited},
            ).all()
            back = [(r.name, r.down_reason) for r in rows if r.down]
            self._back_in_service(conn, back)
            return [name for name, _ in back]

    def _back_in_service(self, conn: Connection, back: list[tuple[str, str | None]]) -> None:
        """Nodes DOWN only for their silence, heard from again: up, with a `node.up` event."""
        if not back:
            return
        conn.execute(
            update(s.nodes)
            .where(s.nodes.c.name.in_([name for name, _ in back]))
            .values(down=False, down_reason=None)
        )
        self._events_many(
            conn,
            [
                {
                    "kind": "node.up",
                    "node": name,
                    "actor": name,
                    "message": f"node {name} answers again (was DOWN: {reason})",
                }
                for name, reason in back
            ],
        )

    def db_time(self) -> float:
        with self.db.begin(write=False) as conn:
            return float(conn.execute(select(self.db.db_now_sql())).scalar_one())

    def node_gens_total(self) -> int:
        """The sum of every node's work generation: gens only grow, so an unchanged sum means
        no node got work since it was last read, and a poll of 10,000 nodes reads one number
        instead of 10,000 rows (`WorkWakeups.tick`, controller/wakeups.py)."""
        with self.db.begin(write=False) as conn:
            return int(
                conn.execute(select(func.coalesce(func.sum(s.nodes.c.work_gen), 0))).scalar_one()
            )

    def node_gens(self) -> dict[str, int]:
        with self.db.begin(write=False) as conn:
            return {
                r.name: int(r.work_gen)
                for r in conn.execute(select(s.nodes.c.name, s.nodes.c.work_gen))
            }

    def node_work(self, node: str, conn: Connection | None = None) -> list[dict[str, Any]]:
        """Every task of a not-yet-ended attempt on this node, with its job, for the agent."""
        if conn is not None:
            return _NODE_WORK.rows(conn, {"node": node})
        with self.db.begin(write=False) as c:
            return _NODE_WORK.rows(c, {"node": node})

    def node_all_work(
        self, node: str, needs_steps: Callable[[list[dict[str, Any]]], bool]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The node's task work and, when ``needs_steps(task work)`` says the heartbeat can
        use it (exchange.steps_to_decide: not for an idle node), its step work
        (JobSteps.node_step_work), in one read transaction: on SQLite a transaction of its
        own costs about as much as the query."""
        with self.db.begin(write=False) as conn:
            work = self.node_work(node, conn)
            return work, self.node_step_work(node, conn) if needs_steps(work) else []

    def apply_reports(
        self, node: str, reports: Sequence[TaskReport], taken_at: float | None
    ) -> list[dict[str, Any]]:
        """Record what an agent says about its tasks; finish attempts whose every task is done.

        Reports about attempts that are not the job's current one, or with a wrong token, are
        ignored (the agent is told to stop those by the reply). A task that the store believes
        RUNNING on this node and that the agent no longer knows, although it started before the
        report was taken, is LOST.

        Exchanges that arrive together are written together, in one transaction
        (store/groupcommit.py); this returns once this one's change has committed, with the
        node's work as that transaction left it (`node_work`): the reply needs it, and
        reading it inside the group costs one statement for all of the group's nodes where
        a read of its own after the commit cost a round trip per exchange.
        """
        group = self.__dict__.get("_report_group")
        if group is None:
            group = self.__dict__.setdefault("_report_group", GroupCommit(self._apply_report_group))
        return group((node, reports, taken_at))

    def _apply_report_group(
        self, items: list[_Exchange]
    ) -> list[list[dict[str, Any]] | BaseException]:
        """The group commit's body: every exchange in one transaction, or, if that fails for
        a reason of its own (not the database being unavailable), each in its own, so that
        one refused exchange fails alone. Each exchange's result is its node's work."""
        try:
            with self.db.begin() as conn, self._deferring(conn):
                self._apply_exchanges(conn, items)
                work = self._work_of(conn, [node for node, _, _ in items])
            return [work[node] for node, _, _ in items]
        except (StoreUnavailable, StoreOutcomeUnknown):
            raise
        except Exception:
            if len(items) == 1:
                raise
        out: list[list[dict[str, Any]] | BaseException] = []
        for item in items:
            try:
                with self.db.begin() as conn, self._deferring(conn):
                    self._apply_exchanges(conn, [item])
                    out.append(self._work_of(conn, [item[0]])[item[0]])
            except Exception as e:  # that exchange's own error, for its caller
                out.append(e)
        return out

    @staticmethod
    def _work_of(conn: Connection, nodes: list[str]) -> dict[str, list[dict[str, Any]]]:
        """`node_work` of each of `nodes`, in one statement."""
        if len(set(nodes)) == 1:
            return {nodes[0]: _NODE_WORK.rows(conn, {"node": nodes[0]})}
        work: dict[str, list[dict[str, Any]]] = {n: [] for n in nodes}
        for r in conn.execute(_NODE_WORK_OF, {"nodes": sorted(work)}).mappings():
            row = dict(r)
            work[row.pop("work_node")].append(row)
        return work

    def _apply_exchanges(self, conn: Connection, items: list[_Exchange]) -> None:
        """Apply exchanges in one transaction. When no two of them concern the same attempt
        (so none's change can alter what another reads), their tasks are read in one
        statement, their task changes written in one, and their attempts moved forward
        after all of them; otherwise one after the other, as separate exchanges would."""
        now = _now()
        nodes = [node for node, _, _ in items]
        if len(items) == 1:
            mine_of = {nodes[0]: _REPORTED_TASKS.rows(conn, {"node": nodes[0]})}
        else:
            mine_of = {n: [] for n in nodes}
            for r in conn.execute(_REPORTED_TASKS_OF, {"nodes": sorted(set(nodes))}).mappings():
                mine_of[r["node"]].append(dict(r))
        seen: set[int] = set()
        apart = len(set(nodes)) == len(nodes)
        for node, reports, _ in items:
            ids = {r["attempt_id"] for r in mine_of[node]} | {r.attempt_id for r in reports}
            apart = apart and not (ids & seen)
            seen |= ids
        waves = [items] if apart else [[item] for item in items]
        for i, wave in enumerate(waves):
            changes: list[tuple[dict[str, Any], dict[str, Any]]] = []
            touched: set[int] = set()
            clear: list[str] = []
            for node, reports, taken_at in wave:
                mine_rows = (
                    mine_of[node] if apart or i == 0 else _REPORTED_TASKS.rows(conn, {"node": node})
                )
                mine = {r["attempt_id"]: r for r in mine_rows}
                self._report_changes(conn, node, reports, taken_at, mine, now, changes, touched)
                if any(
                    r.state == "running"
                    or (r.state == "exited" and (r.exit or {}).get("started_at"))
                    for r in reports
                ):
                    clear.append(node)  # a job started: its failed launches are not "in a row"
            update_many(conn, s.tasks, changes)
            if clear:
                conn.execute(_CLEAR_LAUNCH_FAILURES, {"nodes": sorted(set(clear))})
            pre = self._prefetch(conn, touched)
            for aid in sorted(touched):
                self._advance_attempt(conn, aid, pre)

    def _report_changes(
        self,
        conn: Connection,
        node: str,
        reports: Sequence[TaskReport],
        taken_at: float | None,
        mine: dict[int, dict[str, Any]],
        now: float,
        changes: list[tuple[dict[str, Any], dict[str, Any]]],
        touched: set[int],
    ) -> None:
        """One exchange's task changes (appended to `changes`, their attempts to `touched`),
        given the node's live tasks `mine`; records its checkpoints and progress."""
        reported = {r.attempt_id for r in reports}
        for rep in reports:
            task = mine.get(rep.attempt_id)
            if task is None or task["token"] != rep.token:
                continue
            self._record_job_reports(conn, node, rep, task)
            if rep.state in ("starting", "running"):
                if task["state"] == TaskState.STARTING.value and rep.state == "running":
                    changes.append(
                        (
                            {"attempt_id": rep.attempt_id, "node": node},
                            {
                                "state": TaskState.RUNNING.value,
                                "started_at": rep.started_at or now,
                            },
                        )
                    )
                    touched.add(rep.attempt_id)
            elif rep.state in ("exited", "lost") and task["state"] not in (
                TaskState.EXITED.value,
                TaskState.LOST.value,
            ):
                ex = rep.exit or {}
                if ex.get("prolog_failed") or ex.get("epilog_failed"):
                    self._drain_for_hook(conn, node, rep.attempt_id, ex)
                changes.append(
                    (
                        {"attempt_id": rep.attempt_id, "node": node},
                        {
                            "state": (
                                TaskState.EXITED if rep.state == "exited" else TaskState.LOST
                            ).value,
                            "started_at": task["started_at"] or ex.get("started_at"),
                            "ended_at": ex.get("ended_at") or now,
                            "exit_code": ex.get("exit_code"),
                            "exit_signal": ex.get("signal"),
                            "detail": ex,
                            **efficiency.task_usage(ex),
                        },
                    )
                )
                touched.add(rep.attempt_id)
        if taken_at is not None:
            for aid, task in mine.items():
                if (
                    aid not in reported
                    and task["state"] == TaskState.STARTING.value
                    and task["attempt_state"] == AttemptState.STOPPING.value
                ):
                    # stopped before the agent ever launched it: nothing to kill
                    changes.append(
                        (
                            {"attempt_id": aid, "node": node},
                            {
                                "state": TaskState.EXITED.value,
                                "ended_at": now,
                                "detail": {"cancelled": True, "never_started": True},
                            },
                        )
                    )
                    touched.add(aid)
                elif (
                    aid not in reported
                    and task["state"] == TaskState.RUNNING.value
                    and (task["started_at"] or now) < taken_at
                ):
                    changes.append(
                        (
                            {"attempt_id": aid, "node": node},
                            {
                                "state": TaskState.LOST.value,
                                "ended_at": now,
                                "detail": {"error": f"node {node} no longer knows this task"},
                            },
                        )
                    )
                    touched.add(aid)

    def _record_job_reports(
        self, conn: Connection, node: str, rep: TaskReport, task: Mapping[Any, Any]
    ) -> None:
        """Record a task's new checkpoint (event + jobs.checkpoint) and progress (throttled)."""
        if rep.checkpoint is None and rep.progress is None:
            return
        row = (
            conn.execute(
                select(
                    s.attempts.c.job_id,
                    s.attempts.c.seq,
                    s.attempts.c.progress,
                    s.jobs.c.checkpoint,
                )
                .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
                .where(s.attempts.c.id == rep.attempt_id)
            )
            .mappings()
            .first()
        )
        if row is None:
            return
        seq = int(row["seq"])
        if rep.checkpoint is not None and job_reports.is_new_checkpoint(
            row["checkpoint"], rep.checkpoint, rank=int(task["rank"])
        ):
            record = job_reports.checkpoint_record(rep.checkpoint, seq=seq, node=node)
            conn.execute(
                update(s.jobs).where(s.jobs.c.id == row["job_id"]).values(checkpoint=record)
            )
            took = record["duration_s"]
            self._event(
                conn,
                "job.checkpoint",
                f"checkpoint {record['path']}"
                + (f" took {took:.1f}s" if took is not None else "")
                + f" (restart {seq}, {node})",
                job_id=int(row["job_id"]),
                node=node,
                data=record,
            )
        if job_reports.progress_due(row["progress"], rep.progress, rank=int(task["rank"])):
            conn.execute(
                update(s.attempts)
                .where(s.attempts.c.id == rep.attempt_id)
                .values(progress={**(rep.progress or {}), "node": node})
            )
