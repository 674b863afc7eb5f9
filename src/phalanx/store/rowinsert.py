"""Single-row INSERTs straight through the SQLite driver, for the hottest write: submission.

SQLAlchemy Core spends about 0.1-0.15 ms of CPU on each statement it executes (the execution
context, event dispatch, bind and result set-up) on top of SQLite's own few tens of
microseconds. A one-job submission is two inserts (the job, its `job.submit` event) and a
commit, so that overhead was most of the store's share of a `sbatch`. `RowInsert` renders the
statement once per set of columns, converts the values with the bind processors SQLAlchemy
itself would use (JSON, Boolean), fills in the columns' scalar Python defaults as SQLAlchemy
would, and runs it on the transaction's own DBAPI connection: it is part of the same
transaction and commits or rolls back with it. A driver error is raised as SQLAlchemy would
raise it, so the store's handling of "database unavailable" is unchanged.

Only SQLite takes this path. On PostgreSQL each round trip must pass through SQLAlchemy's
cursor events, which arm the statement deadline (`pgwatch.Watchdog`); there the ordinary
statement runs.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, Table, insert
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

_Plan = tuple[str, list[Any]]  # SQL, and a bind processor (or None) per column


class RowInsert:
    """`INSERT INTO table (...) VALUES (...)` of one row; returns the new primary key."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.statement = insert(table)  # other dialects; built once
        # what SQLAlchemy fills in for a column the row leaves out (Column(default=...))
        self.defaults: dict[str, Any] = {}
        for col in table.columns:
            default = col.default
            if default is None:
                continue
            if not default.is_scalar:  # a callable or SQL default: not supported here
                raise ValueError(f"{table.name}.{col.key}: only scalar defaults are supported")
            self.defaults[col.key] = default.arg  # type: ignore[attr-defined]
        # per dialect and set of columns: the bind processors are the dialect's own (a plan
        # made with PostgreSQL's, whose JSON processor wraps values for psycopg, hands SQLite
        # objects it cannot bind), and one process may hold stores of both kinds
        self._plans: dict[tuple[str, tuple[str, ...]], _Plan] = {}

    def __call__(self, conn: Connection, row: Mapping[str, Any]) -> int:
        values = {**self.defaults, **row}
        if conn.dialect.name != "sqlite":
            self._known(tuple(values))  # (SQLAlchemy would silently drop unknown columns)
            pk = conn.execute(self.statement, values).inserted_primary_key
            assert pk is not None
            return int(pk[0])
        return self._insert(driver_of(conn), self._plan_for(tuple(values), conn.dialect), values)

    def on_driver(
        self, driver: sqlite3.Connection, dialect: Dialect, row: Mapping[str, Any]
    ) -> int:
        """The same insert on a SQLite driver connection in a transaction the caller runs
        (Engines.driver_write): no SQLAlchemy Connection at all."""
        values = {**self.defaults, **row}
        return self._insert(driver, self._plan_for(tuple(values), dialect), values)

    def _plan_for(self, keys: tuple[str, ...], dialect: Dialect) -> _Plan:
        plan = self._plans.get((dialect.name, keys))
        if plan is None:
            plan = self._plans[(dialect.name, keys)] = self._plan(keys, dialect)
        return plan

    @staticmethod
    def _insert(driver: sqlite3.Connection, plan: _Plan, values: dict[str, Any]) -> int:
        sql, processors = plan
        params = [
            v if proc is None else proc(v)
            for v, proc in zip(values.values(), processors, strict=True)
        ]
        cursor = driver_execute(driver, sql, params)
        try:
            rowid = cursor.lastrowid
        finally:
            cursor.close()
        assert rowid is not None
        return int(rowid)

    def _known(self, keys: tuple[str, ...]) -> None:
        unknown = [k for k in keys if k not in self.table.columns]
        if unknown:
            raise sa_exc.CompileError(f"unknown columns for {self.table.name}: {unknown}")

    def _plan(self, keys: tuple[str, ...], dialect: Dialect) -> _Plan:
        self._known(keys)  # (SQLAlchemy would silently drop unknown columns)
        prep = dialect.identifier_preparer
        cols = [self.table.columns[k] for k in keys]
        sql = (
            f"INSERT INTO {prep.format_table(self.table)} "
            f"({', '.join(prep.format_column(c) for c in cols)}) "
            f"VALUES ({', '.join('?' for _ in cols)})"
        )
        processors = [c.type.dialect_impl(dialect).bind_processor(dialect) for c in cols]
        return sql, processors


def driver_of(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under a SQLAlchemy Connection, in its transaction."""
    driver = conn.connection.driver_connection
    assert isinstance(driver, sqlite3.Connection)
    return driver


def driver_execute(driver: sqlite3.Connection, sql: str, params: list[Any]) -> sqlite3.Cursor:
    """Run one statement on the driver; its open cursor (the caller closes it). A driver
    error is raised as SQLAlchemy would raise it, so the store's mapping of database errors
    (engine.Engines.begin) holds for statements that skip SQLAlchemy too."""
    cursor = driver.cursor()
    try:
        cursor.execute(sql, params)
    except sqlite3.Error as e:
        cursor.close()
        raise sa_exc.DBAPIError.instance(sql, params, e, sqlite3.Error) from e
    return cursor
