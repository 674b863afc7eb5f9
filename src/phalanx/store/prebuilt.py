"""Statements of the job path built once, and run on SQLite straight through its driver.

Two costs of SQLAlchemy Core fall on every statement the controller runs, and on its job path
(a start, a "running" and an "exited" report per job, a heartbeat's read of its node's work;
`bench/job_path.py`) they were most of the store's CPU, more than SQLite's own execution:

- *building* a statement: each `==` and `.values()` coerces its operands into bind
  parameters, and executing a new statement object computes its cache key by walking it;
- *executing* one: the execution context, event dispatch, parameter and result set-up, about
  15 microseconds a statement on this machine against SQLite's 2-5.

`Prebuilt(statement)` is built once (at module level, or per shape by `update_where` and
`select_where`) and run with a parameter dict. On SQLite it renders the statement once per
dialect and runs it on the transaction's own driver connection (part of the same transaction;
`rowinsert.py` does the same for submission's inserts), converting parameters and results
with the processors SQLAlchemy itself would use (JSON, Boolean). On PostgreSQL it runs on the
transaction's psycopg connection (`pgengine.pg_driver_execute`), which arms the round-trip
deadline (`pgwatch.Watchdog`) as SQLAlchemy's cursor events do for every other statement;
there the statement costs about 70 microseconds against 110 through SQLAlchemy, and the job
path's per-job statements are most of a controller's round trips (bench/sim.py). A statement
whose rendering depends on its parameters (an expanding `IN`) runs as usual on both. A driver
error is raised as SQLAlchemy would raise it, so the store's handling of "database
unavailable" is unchanged.

`update_where(conn, table, where, values)` runs `UPDATE table SET ... WHERE a = :a AND ...`;
`select_where(conn, table, where, ...)` the matching SELECT. Both key their statement by the
table and the column names, so a call site whose values vary in *which* columns it sets (a
job's transition with or without `end_time`) gets one statement per combination. Only
equality tests and plain values: anything else (`IN`, `col + 1`, joins) is a `Prebuilt` of its
own, built once at module level beside its caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Delete, Select, Table, Update, bindparam, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

from phalanx.store.pgengine import pg_driver_execute, watchdog_of
from phalanx.store.rowinsert import driver_execute, driver_of

_Proc = Callable[[Any], Any] | None
_Statement = Select[Any] | Update | Delete


@dataclass(frozen=True)
class _Plan:
    """A statement rendered for SQLite's driver: its SQL, where each positional parameter
    comes from (a parameter name, or a constant of the statement) and how it is converted,
    and the result's keys with their converters."""

    sql: str
    names: tuple[str, ...]
    constants: Mapping[str, Any]
    binds: tuple[_Proc, ...]
    keys: tuple[str, ...]
    results: tuple[tuple[str, Callable[[Any], Any]], ...]  # (key, converter) where one applies


class Prebuilt:
    """A statement built once and run with new parameters (see the module docstring)."""

    def __init__(self, statement: _Statement) -> None:
        self.statement = statement
        self._plans: dict[str, _Plan | None] = {}
        # PostgreSQL's result converters, from the first answer's column types (a NUMERIC
        # column's converter depends on the type the server names); None: not yet known
        self._pg_results: tuple[tuple[str, Callable[[Any], Any]], ...] | None = None

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every row of a SELECT, as dicts keyed as `.mappings()` would key them."""
        plan = self._plan(conn.dialect)
        if plan is None:
            return [dict(r) for r in conn.execute(self.statement, params).mappings()]
        cursor = self._execute(conn, plan, params)
        try:
            raw = cursor.fetchall()
            description = cursor.description
        finally:
            cursor.close()
        keys = plan.keys
        out = [dict(zip(keys, r, strict=True)) for r in raw]
        results = plan.results
        if conn.dialect.name == "postgresql":
            if self._pg_results is None:
                self._pg_results = _pg_results(self.statement, conn.dialect, description)
            results = self._pg_results
        if results:
            for row in out:
                for key, convert in results:
                    v = row[key]
                    if v is not None:
                        row[key] = convert(v)
        return out

    def one(self, conn: Connection, params: Mapping[str, Any]) -> dict[str, Any]:
        """The one row of a SELECT; NoResultFound or MultipleResultsFound as SQLAlchemy's
        `.one()` raises them."""
        return only(self.rows(conn, params))

    def run(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Run an UPDATE or DELETE; the number of rows it matched."""
        plan = self._plan(conn.dialect)
        if plan is None:
            return int(conn.execute(self.statement, params).rowcount)
        cursor = self._execute(conn, plan, params)
        try:
            return int(cursor.rowcount)
        finally:
            cursor.close()

    @staticmethod
    def _execute(conn: Connection, plan: _Plan, params: Mapping[str, Any]) -> Any:
        given = {**plan.constants, **params} if plan.constants else params
        values = [
            given[n] if proc is None else proc(given[n])
            for n, proc in zip(plan.names, plan.binds, strict=True)
        ]
        if conn.dialect.name == "postgresql":
            return pg_driver_execute(conn, plan.sql, dict(zip(plan.names, values, strict=True)))
        return driver_execute(driver_of(conn), plan.sql, values)

    def _plan(self, dialect: Dialect) -> _Plan | None:
        try:
            return self._plans[dialect.name]
        except KeyError:
            plan = self._plans[dialect.name] = (
                _render(self.statement, dialect)
                if dialect.name == "sqlite"
                or (dialect.name == "postgresql" and watchdog_of(dialect) is not None)
                else None
            )
            return plan


def _render(statement: _Statement, dialect: Dialect) -> _Plan | None:
    """The driver plan of a statement, or None where it must run through SQLAlchemy."""
    compiled = statement.compile(dialect=dialect)
    # SQLite's driver takes positional parameters; psycopg's, named ones (%(name)s)
    order = compiled.positiontup if dialect.name == "sqlite" else tuple(compiled.binds)
    if order is None or "POSTCOMPILE" in compiled.string:
        return None
    constants: dict[str, Any] = {}
    for name, bind in compiled.binds.items():
        if bind.expanding or bind.callable is not None:
            return None
        if not bind.required:
            constants[name] = bind.value
    binds = tuple(
        compiled.binds[n].type.dialect_impl(dialect).bind_processor(dialect) for n in order
    )
    keys: tuple[str, ...] = ()
    results: list[tuple[str, Callable[[Any], Any]]] = []
    if isinstance(statement, Select):
        columns = statement.selected_columns
        keys = tuple(columns.keys())
        if len(set(keys)) != len(keys):
            return None  # (SQLAlchemy would disambiguate them)
        if dialect.name == "sqlite":  # (PostgreSQL's: `_pg_results`, at the first answer)
            for key, col in zip(keys, columns, strict=True):
                proc = col.type.dialect_impl(dialect).result_processor(dialect, None)
                if proc is not None:
                    results.append((key, proc))
    return _Plan(compiled.string, tuple(order), constants, binds, keys, tuple(results))


def _pg_results(
    statement: _Statement, dialect: Dialect, description: Sequence[Any]
) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """The result converters SQLAlchemy would use for a SELECT's columns on PostgreSQL, given
    the types the server's answer names (`cursor.description`)."""
    assert isinstance(statement, Select)
    out = []
    for (key, col), desc in zip(statement.selected_columns.items(), description, strict=True):
        proc = col.type.dialect_impl(dialect).result_processor(dialect, desc.type_code)
        if proc is not None:
            out.append((key, proc))
    return tuple(out)


def only(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The one row, as SQLAlchemy's `.one()`."""
    if not rows:
        raise sa_exc.NoResultFound("No row was found when one was required")
    if len(rows) > 1:
        raise sa_exc.MultipleResultsFound("Multiple rows were found when exactly one was required")
    return rows[0]


@functools.cache
def _update(table: Table, where: tuple[str, ...], values: tuple[str, ...]) -> Prebuilt:
    # parameter names must differ from the columns' own (SQLAlchemy reserves those for SET)
    return Prebuilt(
        update(table)
        .where(*(table.c[w] == bindparam(f"w_{w}") for w in where))
        .values({table.c[v]: bindparam(f"v_{v}", type_=table.c[v].type) for v in values})
    )


def update_where(
    conn: Connection, table: Table, where: Mapping[str, Any], values: Mapping[str, Any]
) -> int:
    """`UPDATE table SET <values> WHERE <each where column = its value>`; the rows matched."""
    stmt = _update(table, tuple(where), tuple(values))
    params = {f"w_{k}": v for k, v in where.items()}
    params.update({f"v_{k}": v for k, v in values.items()})
    return stmt.run(conn, params)


def update_many(
    conn: Connection,
    table: Table,
    changes: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
) -> None:
    """`update_where` for each (where, values), rows that name the same columns run
    together: as one executemany, which psycopg 3 sends in one pipeline (one round trip for
    an agent's dozen task changes on PostgreSQL instead of one each)."""
    shapes: dict[tuple[tuple[str, ...], tuple[str, ...]], list[dict[str, Any]]] = {}
    for where, values in changes:
        params = {f"w_{k}": v for k, v in where.items()}
        params.update({f"v_{k}": v for k, v in values.items()})
        shapes.setdefault((tuple(where), tuple(values)), []).append(params)
    for (where_cols, value_cols), rows in shapes.items():
        stmt = _update(table, where_cols, value_cols)
        if len(rows) == 1:
            stmt.run(conn, rows[0])
        else:
            conn.execute(stmt.statement, rows)


@functools.cache
def _select(
    table: Table, cols: tuple[str, ...] | None, where: tuple[str, ...], order_by: str | None
) -> Prebuilt:
    q = select(*(table.c[c] for c in cols)) if cols is not None else select(table)
    q = q.where(*(table.c[w] == bindparam(f"w_{w}") for w in where))
    return Prebuilt(q.order_by(table.c[order_by]) if order_by is not None else q)


def select_where(
    conn: Connection,
    table: Table,
    where: Mapping[str, Any],
    *,
    cols: Sequence[str] | None = None,
    order_by: str | None = None,
) -> list[dict[str, Any]]:
    """`SELECT <cols, or every column> FROM table WHERE <each column = its value> [ORDER BY]`."""
    stmt = _select(table, tuple(cols) if cols is not None else None, tuple(where), order_by)
    return stmt.rows(conn, {f"w_{k}": v for k, v in where.items()})
