"""The store's foundation: engines and configuration, migrations, and the helpers every
transaction uses (events, fence checks, conditional job transitions, work wakeups).

`Store` (store/store.py) is built on it, topic by topic (store/maintenance.py for maintenance windows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, text, update

from phalanx.domain.policy import FailurePolicy
from phalanx.domain.states import AttemptState, JobState, check_job_transition
from phalanx.errors import Fenced
from phalanx.store import schema as s
from phalanx.store.engine import DEFAULT_OP_TIMEOUT, Engines
from phalanx.store.notify import SCHED_CHANNEL, WORK_CHANNEL, encode_nodes
from phalanx.store.prebuilt import Prebuilt, update_where
from phalanx.store.rowinsert import RowInsert
from phalanx.store.sqlbits import JOB_SUMMARY, Fence
from phalanx.store.sqlbits import now as _now

_INSERT_EVENT = insert(s.events)  # built once: every transition appends an event
_EVENT_ROW = RowInsert(s.events)  # one event (a submission's): straight to SQLite's driver
_BUMP_GEN = (  # built once: most transitions give some nodes new work
    update(s.nodes)
    .where(s.nodes.c.name.in_(bindparam("names", expanding=True)))
    .values(work_gen=s.nodes.c.work_gen + 1)
)
# most transitions concern a node or a few: one rendered statement a node takes SQLite's
# driver path (prebuilt.py), where the expanding IN above is rendered again on every call
_BUMP_GEN_ONE = Prebuilt(
    update(s.nodes)
    .where(s.nodes.c.name == bindparam("node"))
    .values(work_gen=s.nodes.c.work_gen + 1)
)
_BUMP_AND_NOTIFY = select(func.pg_notify(WORK_CHANNEL, bindparam("payload"))).add_cte(
    _BUMP_GEN.cte("bumped")
)
_BUMP_ONE_BY_ONE = 8  # nodes up to which _BUMP_GEN_ONE runs once a node (SQLite)


# the attempt states a planned stop applies to (StoreBase._current_live_attempt)
_STOPPABLE = (AttemptState.STARTING.value, AttemptState.RUNNING.value)


@dataclass
class _Deferred:
    """What a transaction's `StoreBase._deferring` scope holds back until it ends: its events
    (appended in order) and the nodes whose work generation it bumps."""

    events: list[dict[str, Any]] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)


# the open `_deferring` scopes, by the id of their connection (popped when the scope ends)
_DEFERRED: dict[int, _Deferred] = {}


class StoreBase:
    """Engines, settings and shared transaction helpers of `Store`."""

    def __init__(
        self,
        url: str,
        *,
        actor: str = "phalanx",
        connect_timeout: float = 5.0,
        policy: FailurePolicy | None = None,
        op_timeout: float = DEFAULT_OP_TIMEOUT,
    ) -> None:
        # op_timeout: PostgreSQL round-trip deadline (timing.db_op_timeout; store/pgwatch.py)
        self.db = Engines(url, connect_timeout=connect_timeout, op_timeout=op_timeout)
        self.actor = actor  # default actor/controller id stamped on events
        self.dialect = self.db.dialect
        self.policy = policy or FailurePolicy()
        # seconds an elastic or spare job's surviving nodes stay reserved for its fast restart
        # (timing.restart_reservation; the controller sets it from its configuration)
        self.restart_reservation = 60.0

    # ------------------------------------------------------------------ schema
    def migrate(self) -> None:
        """Bring the schema to the latest Alembic revision (safe to run from several controllers)."""
        from alembic import command
        from alembic.config import Config as AlembicConfig

        cfg = AlembicConfig()
        cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
        with self.db.begin(unbounded=True) as conn:  # a migration may rewrite large tables
            if self.dialect == "postgresql":
                # Between its statements Alembic runs Python (it loads and runs each revision
                # script): on a loaded host those gaps can outlast the idle limit set for the
                # controllers' short transactions (engine.idle_in_transaction_ms), and the
                # server would end the migration half way. Its own, longer limit still frees
                # the lock of a controller that froze mid-migration.
                conn.execute(text("SET LOCAL idle_in_transaction_session_timeout = '300s'"))
                conn.execute(text("SELECT pg_advisory_xact_lock(7263501)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def close(self) -> None:
        self.db.dispose()

    def record_event(self, kind: str, message: str, *, actor: str | None = None) -> None:
        """An event that goes with no other change (e.g. a token was created)."""
        with self.db.begin() as conn:
            self._event(conn, kind, message, actor=actor)

    # ------------------------------------------------------------------ helpers
    def _event(
        self,
        conn: Connection,
        kind: str,
        message: str,
        *,
        job_id: int | None = None,
        node: str | None = None,
        actor: str | None = None,
        term: int | None = None,
        data: dict[str, Any] | None = None,
        ts: float | None = None,
    ) -> None:
        row = {
            "ts": ts or _now(),
            "kind": kind,
            "job_id": job_id,
            "node": node,
            "actor": actor or self.actor,
            "controller": self.actor,
            "term": term,
            "message": message,
            "data": data,
        }
        deferred = _DEFERRED.get(id(conn))
        if deferred is not None:
            deferred.events.append(row)
        else:
            _EVENT_ROW(conn, row)

    @contextlib.contextmanager
    def _deferring(self, conn: Connection) -> Iterator[None]:
        """Within this scope, the transaction's events and work-generation bumps are held
        back and written when it ends, in one multi-row insert and one bump of every node
        named: an agent's exchange that moves a dozen jobs forward takes two round trips for
        them instead of two or three a job (on PostgreSQL each is a round trip; bench/sim.py).
        Nothing else reads them before the transaction commits. A scope that raises writes
        nothing (its transaction is rolled back); a scope inside another is part of it."""
        key = id(conn)
        if key in _DEFERRED:
            yield
            return
        held = _DEFERRED[key] = _Deferred()
        try:
            yield
        finally:
            del _DEFERRED[key]
        self._events_many(conn, held.events)
        if held.nodes:
            self._bump_gen(conn, held.nodes)

    def _events_many(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        if len(rows) == 1:
            _EVENT_ROW(conn, self._event_values(rows[0]))
            return
        base = self._event_values({})
        conn.execute(_INSERT_EVENT, [{**base, **r} for r in rows])

    def _event_values(self, row: dict[str, Any]) -> dict[str, Any]:
        """An event row with every column: what `row` leaves out filled in as for any event."""
        return {
            "ts": _now(),
            "job_id": None,
            "node": None,
            "actor": self.actor,
            "controller": self.actor,
            "term": None,
            "data": None,
            **row,
        }

    def _check_fence(self, conn: Connection, fence: Fence | None) -> None:
        if fence is None:
            return
        q = select(s.leases.c.holder, s.leases.c.term).where(s.leases.c.name == fence.lease)
        if self.dialect == "postgresql":
            q = q.with_for_update()
        row = conn.execute(q).first()
        if row is None or row.holder != fence.holder or row.term != fence.term:
            raise Fenced(
                f"lease {fence.lease} term {fence.term} is no longer held by {fence.holder}",
                lease=fence.lease,
                term=fence.term,
            )

    def _set_job_state(
        self,
        conn: Connection,
        job: dict[str, Any],
        new: JobState,
        reason: str | None,
        *,
        extra: dict[str, Any] | None = None,
        actor: str | None = None,
        term: int | None = None,
        event_kind: str | None = None,
        message: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> bool:
        """Conditional transition: only if the job is still in the state we read."""
        old = JobState(job["state"])
        check_job_transition(job["id"], old, new)
        values: dict[str, Any] = {"state": new.value, "reason": reason, **(extra or {})}
        if new.terminal and "end_time" not in values:
            values["end_time"] = _now()
        if update_where(conn, s.jobs, {"id": job["id"], "state": old.value}, values) != 1:
            return False
        self._event(
            conn,
            event_kind or f"job.{new.value.lower()}",
            message or (f"{old.value} -> {new.value}" + (f": {reason}" if reason else "")),
            job_id=job["id"],
            actor=actor,
            term=term,
            data={"from": old.value, "to": new.value, **(data or {})},
        )
        return True

    def _current_live_attempt(
        self, conn: Connection, aid: int
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(attempt, job summary) while attempt `aid` is starting or running and is its job's
        current one: what a planned stop decided on a read before its transaction may stop."""
        att = conn.execute(select(s.attempts).where(s.attempts.c.id == aid)).mappings().first()
        if att is None or att["state"] not in _STOPPABLE:
            return None
        job = dict(
            conn.execute(select(*JOB_SUMMARY).where(s.jobs.c.id == att["job_id"])).mappings().one()
        )
        if job["attempt_id"] != aid:
            return None
        return dict(att), job

    def _planned_stop(
        self,
        conn: Connection,
        att: dict[str, Any],
        job: dict[str, Any],
        why: str,
        *,
        actor: str | None,
        term: int | None = None,
    ) -> bool:
        """The writes every planned stop shares (drain --now, maintenance, a reservation's
        end, preemption): the attempt STOPPING with `why` (its agents signal the checkpoint,
        then stop it; `why` decides what follows, domain/policy.py), if it is still in the
        state read (False: it moved meanwhile, nothing written); its job COMPLETING; its
        nodes told there is new work."""
        changed = update_where(
            conn,
            s.attempts,
            {"id": att["id"], "state": att["state"]},
            {"state": AttemptState.STOPPING.value, "stop_reason": why},
        )
        if changed != 1:
            return False
        if job["state"] in (JobState.STARTING.value, JobState.RUNNING.value):
            self._set_job_state(conn, job, JobState.COMPLETING, why, actor=actor, term=term)
        self._bump_gen(conn, att["nodes"])
        return True

    def notify_schedulers(self) -> bool:
        """Tell the other controllers' schedulers that a pass has new work (PostgreSQL NOTIFY
        on SCHED_CHANNEL, store/notify.py; nothing on SQLite, whose controllers share a host
        and poll). Sent after the change committed, so a pass it starts sees the change.
        Whether one was sent."""
        if self.dialect != "postgresql":
            return False
        with self.db.begin(write=False) as conn:  # no write turn: it changes no row
            conn.execute(select(func.pg_notify(SCHED_CHANNEL, "")))
        return True

    def _bump_gen(self, conn: Connection, nodes: Iterable[str]) -> None:
        """These nodes have new work. On PostgreSQL also NOTIFY the other controllers, in this
        transaction, so the wakeup goes out when the change is committed (store/notify.py)."""
        deferred = _DEFERRED.get(id(conn))
        if deferred is not None:
            deferred.nodes.update(nodes)
            return
        names = sorted(set(nodes))
        if names and self.dialect == "postgresql":
            # one round trip: the bump runs as a data-modifying WITH of the NOTIFY, which
            # PostgreSQL runs to completion whether or not the query reads it
            conn.execute(_BUMP_AND_NOTIFY, {"names": names, "payload": encode_nodes(names)})
            return
        if len(names) > _BUMP_ONE_BY_ONE:
            conn.execute(_BUMP_GEN, {"names": names})
        else:
            for name in names:
                _BUMP_GEN_ONE.run(conn, {"node": name})
