"""Statements of the job path built once per shape and run with new parameters.

Building a SQLAlchemy statement is Python work on every call: each `==` and `.values()`
coerces its operands into bind parameters, and executing a new statement object computes its
cache key by walking it. On the controller's job path (a start, a "running" and an "exited"
report per job, `bench/job_path.py`) that was about 40% of the store's CPU, more than SQLite's
own execution. A statement built once and executed with a parameter dict skips both: its cache
key is memoized on the object, and the compiled form comes from the engine's cache.

`update_where(conn, table, where, values)` runs `UPDATE table SET ... WHERE a = :a AND ...`;
`select_where(conn, table, where, ...)` runs the matching SELECT. Both key their statement by
the table and the column names, so a call site whose values vary in *which* columns it sets
(e.g. a job's transition with or without `end_time`) gets one statement per combination. Only
equality tests and plain values: anything else (`IN`, `col + 1`, joins) is written out and,
where hot, built once at module level beside its caller.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, CursorResult, Select, Table, Update, bindparam, select, update


@functools.cache
def _update(table: Table, where: tuple[str, ...], values: tuple[str, ...]) -> Update:
    # parameter names must differ from the columns' own (SQLAlchemy reserves those for SET)
    return (
        update(table)
        .where(*(table.c[w] == bindparam(f"w_{w}") for w in where))
        .values({table.c[v]: bindparam(f"v_{v}", type_=table.c[v].type) for v in values})
    )


def update_where(
    conn: Connection, table: Table, where: Mapping[str, Any], values: Mapping[str, Any]
) -> CursorResult[Any]:
    """`UPDATE table SET <values> WHERE <each where column = its value>`."""
    stmt = _update(table, tuple(where), tuple(values))
    params = {f"w_{k}": v for k, v in where.items()}
    params.update({f"v_{k}": v for k, v in values.items()})
    return conn.execute(stmt, params)


@functools.cache
def _select(
    table: Table, cols: tuple[str, ...] | None, where: tuple[str, ...], order_by: str | None
) -> Select[Any]:
    q = select(*(table.c[c] for c in cols)) if cols is not None else select(table)
    q = q.where(*(table.c[w] == bindparam(f"w_{w}") for w in where))
    return q.order_by(table.c[order_by]) if order_by is not None else q


def select_where(
    conn: Connection,
    table: Table,
    where: Mapping[str, Any],
    *,
    cols: Sequence[str] | None = None,
    order_by: str | None = None,
) -> CursorResult[Any]:
    """`SELECT <cols, or every column> FROM table WHERE <each column = its value> [ORDER BY]`."""
    stmt = _select(table, tuple(cols) if cols is not None else None, tuple(where), order_by)
    return conn.execute(stmt, {f"w_{k}": v for k, v in where.items()})
