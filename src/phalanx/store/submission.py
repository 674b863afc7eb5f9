"""Submission: a checked job spec becomes job rows (one per array task) in one transaction.

The hot path of `sbatch`: its statements are built once at import, and SQLite takes a plainer
path for a single job. Dependencies are resolved to job ids here (a reference to a job that
does not exist is refused at submit, as Slurm does). Partitions live here too: a submission is
checked against them, and the controller syncs them from its configuration.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    JSON,
    Connection,
    Dialect,
    String,
    Table,
    insert,
    select,
    text,
    update,
)

from phalanx.domain.spec import PartitionInfo, ResolvedJob
from phalanx.domain.states import (
    JobState,
)
from phalanx.errors import InvalidSpec
from phalanx.store import schema as s
from phalanx.store.arrayinsert import insert_array_tasks
from phalanx.store.base import _EVENT_ROW, StoreBase
from phalanx.store.rowinsert import RowInsert
from phalanx.store.sqlbits import now as _now

# Submission's statements, built once: SQLAlchemy caches a statement's compiled form, but
# building one (and its cache key) costs a submission more than the SQLite insert itself.
_JOB_ROW = RowInsert(s.jobs)


_INSERT_JOBS_IDS = insert(s.jobs).returning(s.jobs.c.id, sort_by_parameter_order=True)
# PostgreSQL: n new job ids, outside any transaction (Submission._submit_plain_postgresql)
_NEXT_JOB_IDS = text(
    "SELECT nextval(pg_get_serial_sequence('jobs', 'id')) FROM generate_series(1, :n)"
)


MAX_ID = 2**63 - 1  # the largest id an INTEGER column holds (SQLite and PostgreSQL)


# PostgreSQL: the most jobs one jobs-and-events statement carries. The statement is the same
# whatever the count (one array parameter per column); the bound keeps one round trip short
# against the per-round-trip deadline (db_op_timeout) on a loaded server.
_GROUP_ROWS = 200


@functools.lru_cache(maxsize=64)
def _jobs_and_events(
    job_keys: tuple[str, ...], event_keys: tuple[str, ...], dialect: Dialect
) -> str:
    """PostgreSQL: `WITH new_jobs AS (INSERT INTO jobs ... SELECT ... FROM unnest(arrays))
    INSERT INTO events ... SELECT ... FROM unnest(arrays)`, one text array parameter per
    column (`j_<column>`, `e_<column>`; `_column_arrays` builds them).

    Why arrays rather than a VALUES list of n rows: the statement's text and its parameter
    count no longer grow with the group, so psycopg converts it once (it re-parsed a query
    of over 50 parameters on every call: 12% of a controller's time under
    `bench/sim.py placements` on PostgreSQL) and prepares it on the server after a few
    uses, where a 200-row VALUES statement of ~7,000 parameters was parsed and planned anew
    each time. Each column is cast from text to its own type, except strings: their
    assignment to a VARCHAR(n) column checks the length as a VALUES insert did (an explicit
    cast would cut it silently). The rows keep their order (ORDER BY the arrays' ordinality):
    the events' ids follow the jobs' order as before. psycopg caches the conversion of a
    query of at most 50 parameters (`psycopg._queries.MAX_CACHED_STATEMENT_PARAMS`): the jobs'
    and events' columns are 43 today."""
    quote = dialect.identifier_preparer.quote

    def insert_select(table: Table, prefix: str, keys: tuple[str, ...]) -> str:
        casts = []
        for i, k in enumerate(keys):
            typ = table.columns[k].type
            casts.append(f"c{i}" if isinstance(typ, String) else f"c{i}::{typ.compile(dialect)}")
        arrays = ", ".join(f"%({prefix}_{k})s::text[]" for k in keys)
        names = ", ".join(f"c{i}" for i in range(len(keys)))
        return (
            f"INSERT INTO {quote(table.name)} ({', '.join(quote(k) for k in keys)}) "
            f"SELECT {', '.join(casts)} FROM unnest({arrays}) WITH ORDINALITY "
            f"AS t({names}, ord) ORDER BY ord"
        )

    return (
        f"WITH new_jobs AS ({insert_select(s.jobs, 'j', job_keys)}) "
        f"{insert_select(s.events, 'e', event_keys)}"
    )


def _as_text(value: Any) -> str | None:
    """A non-JSON column's value as the text PostgreSQL reads back as the same value
    (`_jobs_and_events` casts it); floats by `repr`, which round-trips exactly."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _column_arrays(
    table: Table, prefix: str, rows: list[dict[str, Any]], keys: tuple[str, ...]
) -> dict[str, Any]:
    """The `_jobs_and_events` parameters of `rows`: one list of texts per column. A JSON
    column's value is written by `json.dumps`, as psycopg's JSON adapter writes it through
    SQLAlchemy, None included: JSON `null`, not SQL NULL, as the columns' `none_as_null`
    (false) asks and every other insert stores it."""
    out: dict[str, Any] = {}
    for k in keys:
        if isinstance(table.columns[k].type, JSON):
            out[f"{prefix}_{k}"] = [json.dumps(row[k]) for row in rows]
        else:
            out[f"{prefix}_{k}"] = [_as_text(row[k]) for row in rows]
    return out


def _submit_event(job_id: int, row: dict[str, Any], user: str, now: float) -> dict[str, Any]:
    held = " (held)" if row["state"] == JobState.HELD.value else ""
    return {
        "kind": "job.submit",
        "job_id": job_id,
        "actor": user,
        "message": f"submitted by {user} to {row['partitions']}{held}",
        "ts": now,
    }


HOLD_USER, HOLD_ADMIN = "user", "admin"  # jobs.hold_kind (migration 0013)


def _hold_columns(actor: str, admin: bool, held: bool = True) -> dict[str, Any]:
    """jobs.held_by/hold_kind for a hold `actor` places (`admin`: an operator or admin), or
    cleared (`held` false: a release, a requeue that does not hold)."""
    if not held:
        return {"held_by": None, "hold_kind": None}
    return {"held_by": actor, "hold_kind": HOLD_ADMIN if admin else HOLD_USER}


class Submission(StoreBase):
    """Submission."""

    def sync_partitions(self, parts: Sequence[dict[str, Any]]) -> None:
        """Make the partitions table match the controller's configuration."""
        with self.db.begin() as conn:
            existing = {r.name for r in conn.execute(select(s.partitions.c.name))}
            for p in parts:
                if p["name"] in existing:
                    conn.execute(
                        update(s.partitions).where(s.partitions.c.name == p["name"]).values(**p)
                    )
                else:
                    conn.execute(insert(s.partitions).values(**p))
            gone = existing - {p["name"] for p in parts}
            if gone:
                conn.execute(s.partitions.delete().where(s.partitions.c.name.in_(sorted(gone))))

    def partitions(self) -> dict[str, dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            return {r["name"]: dict(r) for r in conn.execute(select(s.partitions)).mappings()}

    def partition_infos(self) -> dict[str, PartitionInfo]:
        return {
            n: PartitionInfo(
                name=n,
                default=bool(p["is_default"]),
                default_time_s=p["default_time_s"],
                max_time_s=p["max_time_s"],
            )
            for n, p in self.partitions().items()
        }

    def submit(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any]]], user: str
    ) -> list[list[int]]:
        """Insert jobs (arrays expand to one row per task); return the ids per item.

        One transaction for the whole request. Plain jobs are inserted with one multi-row
        statement and their events with another, so a batch of thousands costs a few
        statements, not thousands.
        """
        return self.submit_each([(resolved, spec, user) for resolved, spec in items])

    def submit_each(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any], str]]
    ) -> list[list[int]]:
        """`submit` where each item names its own submitter: several users' requests
        committed in one transaction (the API's group commit, controller/submitq.py)."""
        now = _now()
        simple = all(r.array_indices is None and not r.dependency for r, _, _ in items)
        if simple and self.dialect == "sqlite":
            return self._submit_plain_sqlite(items, now)
        if simple and self.dialect == "postgresql":
            return self._submit_plain_postgresql(items, now)
        out: list[list[int]] = [[] for _ in items]
        with self.db.begin() as conn:
            plain: list[tuple[int, dict[str, Any]]] = []  # consecutive plain jobs, not yet inserted
            events: list[dict[str, Any]] = []

            def flush() -> None:
                if not plain:
                    return
                if len(plain) == 1:  # `sbatch`: one row, straight to the driver (rowinsert.py)
                    idx, row = plain[0]
                    jid = _JOB_ROW(conn, row)
                    out[idx] = [jid]
                    events.append(_submit_event(jid, row, row["user"], now))
                    plain.clear()
                    return
                res = conn.execute(_INSERT_JOBS_IDS, [row for _, row in plain])
                for (idx, row), r in zip(plain, res, strict=True):
                    out[idx] = [int(r[0])]
                    events.append(_submit_event(int(r[0]), row, row["user"], now))
                plain.clear()

            for idx, (resolved, spec, user) in enumerate(items):
                base = self._job_row(conn, resolved, spec, user, now)
                if resolved.array_indices is None:
                    plain.append((idx, base))
                    continue
                flush()  # ids follow the order of the request
                first, *rest = resolved.array_indices
                jid = conn.execute(
                    insert(s.jobs).values({**base, "array_task_id": first}).returning(s.jobs.c.id)
                ).scalar_one()
                conn.execute(update(s.jobs).where(s.jobs.c.id == jid).values(array_job_id=jid))
                ids = [int(jid)]
                if rest:
                    ids.extend(insert_array_tasks(conn, {**base, "array_job_id": jid}, rest))
                out[idx] = ids
                events.extend(_submit_event(i, base, user, now) for i in ids)
            flush()
            self._events_many(conn, events)
        return out

    def _submit_plain_sqlite(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any], str]], now: float
    ) -> list[list[int]]:
        """`submit_each` of plain jobs without dependencies (every `sbatch` of a script) on
        SQLite: each job row and its event straight to the driver, in one transaction of the
        driver's own (Engines.driver_write), the rows exactly as the general path writes them
        (the same RowInsert plans and bind processors)."""
        dialect = self.db.write.dialect
        out: list[list[int]] = []
        with self.db.driver_write() as driver:
            for resolved, spec, user in items:
                row = self._job_values(resolved, spec, user, now, [])
                jid = _JOB_ROW.on_driver(driver, dialect, row)
                event = self._event_values(_submit_event(jid, row, user, now))
                _EVENT_ROW.on_driver(driver, dialect, event)
                out.append([jid])
        return out

    def _submit_plain_postgresql(
        self, items: Sequence[tuple[ResolvedJob, dict[str, Any], str]], now: float
    ) -> list[list[int]]:
        """`submit_each` of plain jobs without dependencies on PostgreSQL in two round trips
        instead of four: the jobs' ids first (a sequence hands them out outside any
        transaction), then their rows and their `job.submit` events in one statement (the jobs'
        insert a data-modifying CTE of the events' insert), which is its own transaction
        (Engines.begin, `single`): both are stored, or neither."""
        rows = [self._job_values(r, spec, user, now, []) for r, spec, user in items]
        with self.db.begin(write=False) as conn:
            ids = sorted(int(i) for i in conn.execute(_NEXT_JOB_IDS, {"n": len(rows)}).scalars())
        # every column SQLAlchemy would fill in with its default, as RowInsert does
        jobs = [{**_JOB_ROW.defaults, **row, "id": jid} for row, jid in zip(rows, ids, strict=True)]
        events = [
            {**_EVENT_ROW.defaults, **self._event_values(_submit_event(jid, row, row["user"], now))}
            for row, jid in zip(rows, ids, strict=True)
        ]
        # one statement in autocommit for a group that fits in one; a bigger batch is
        # several in one transaction (_GROUP_ROWS says why).
        # Every statement is built before the transaction opens: the server ends a session
        # idle inside a transaction for 2 x db_op_timeout (pgengine.idle_in_transaction_ms),
        # and building a group's parameters on a loaded host must not count as idle.
        statements = [
            self._jobs_and_events_statement(
                jobs[at : at + _GROUP_ROWS], events[at : at + _GROUP_ROWS]
            )
            for at in range(0, len(jobs), _GROUP_ROWS)
        ]
        with self.db.begin(single=len(statements) == 1) as conn:
            for sql, params in statements:
                conn.exec_driver_sql(sql, params)
        return [[jid] for jid in ids]

    def _jobs_and_events_statement(
        self, jobs: list[dict[str, Any]], events: list[dict[str, Any]]
    ) -> tuple[str, dict[str, Any]]:
        """The one statement (and its parameters) that inserts `jobs` and their `events`."""
        job_keys, event_keys = tuple(jobs[0]), tuple(events[0])  # every row has them all
        sql = _jobs_and_events(job_keys, event_keys, self.db.write.dialect)
        return sql, (
            _column_arrays(s.jobs, "j", jobs, job_keys)
            | _column_arrays(s.events, "e", events, event_keys)
        )

    def _job_row(
        self, conn: Connection, resolved: ResolvedJob, spec: dict[str, Any], user: str, now: float
    ) -> dict[str, Any]:
        deps = self._resolve_dependencies(conn, resolved.dependency)
        return self._job_values(resolved, spec, user, now, deps)

    def _job_values(
        self,
        resolved: ResolvedJob,
        spec: dict[str, Any],
        user: str,
        now: float,
        dependency: list[dict[str, Any]],
    ) -> dict[str, Any]:
        state = JobState.HELD if resolved.hold else JobState.PENDING
        return {
            # sbatch -H: a user hold. Every row names both columns, so that the rows of one
            # group (executemany, the PostgreSQL VALUES list) have one set of columns
            "held_by": user if resolved.hold else None,
            "hold_kind": HOLD_USER if resolved.hold else None,
            "name": resolved.name,
            "user": user,
            "partitions": ",".join(resolved.partitions),
            "partition": resolved.partitions[0],
            "state": state.value,
            "reason": "held by user" if resolved.hold else None,
            "priority": resolved.priority,
            "submit_time": now,
            # --begin: pending with reason BeginTime until then (scheduling.begin_reason)
            "eligible_time": spec.get("begin_time"),
            "time_limit_s": resolved.time_limit_s,
            "nodes": resolved.nodes,
            "cpus_per_node": resolved.cpus_per_node,
            "mem_per_node_mb": resolved.mem_per_node_mb,
            "gpus_per_node": resolved.gpus_per_node,
            "gpu_type": resolved.gpu_type,
            "exclusive": resolved.exclusive,
            "constraint_expr": resolved.constraint,
            "nodelist": resolved.nodelist,
            "exclude": resolved.exclude,
            "dependency": dependency,
            "requeue": resolved.requeue,
            "spec": {
                **spec,
                "signal_parsed": resolved.signal,
                "checkpoint_parsed": resolved.checkpoint,
                "workdir": resolved.workdir,
            },
            "restart_count": 0,
            "array_limit": resolved.array_limit,
            "array_job_id": None,
            "array_task_id": None,
            "account": spec.get("account"),
            "qos": spec.get("qos"),
            "nice": int(spec.get("nice") or 0),
        }

    def _resolve_dependencies(
        self, conn: Connection, deps: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Turn `123` / `123_4` references into concrete job ids; unknown jobs are refused."""
        out = []
        for dep in deps:
            ids: list[int] = []
            for ref in dep.get("jobs", []):
                found = self._refs(conn, [str(ref)])
                if not found:
                    raise InvalidSpec(
                        f"dependency: job {ref} does not exist", field="dependency", job=str(ref)
                    )
                ids.extend(found)
            out.append({"type": dep["type"], "jobs": ids})
        return out

    def _refs(self, conn: Connection, refs: Sequence[str]) -> list[int]:
        ids: list[int] = []
        for ref in refs:
            ref = str(ref).strip()
            if "_" in ref:
                a, _, t = ref.partition("_")
                if not (a.isdecimal() and t.isdecimal()):
                    raise InvalidSpec(f"invalid job id '{ref}': use 123 or 123_4")
                if int(a) > MAX_ID or int(t) > MAX_ID:
                    continue  # larger than any id a job can have: no such job
                row = conn.execute(
                    select(s.jobs.c.id).where(
                        s.jobs.c.array_job_id == int(a), s.jobs.c.array_task_id == int(t)
                    )
                ).first()
                if row:
                    ids.append(int(row.id))
                continue
            if not ref.isdecimal():
                raise InvalidSpec(f"invalid job id '{ref}': use 123 or 123_4")
            jid = int(ref)
            if jid > MAX_ID:
                continue
            rows = conn.execute(
                select(s.jobs.c.id).where(s.jobs.c.array_job_id == jid).order_by(s.jobs.c.id)
            ).all()
            if rows:
                ids.extend(int(r.id) for r in rows)
            elif conn.execute(select(s.jobs.c.id).where(s.jobs.c.id == jid)).first():
                ids.append(jid)
        return ids

    def resolve_refs(self, refs: Sequence[str]) -> list[int]:
        """Job references as users type them: `123` (a job, or a whole array) or `123_4`."""
        with self.db.begin(write=False) as conn:
            return self._refs(conn, refs)
