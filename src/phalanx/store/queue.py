"""The queue as the dashboard pages it: array tasks folded into one row per (array, state,
partition), filtered and paged in SQL, so a page of 100 rows out of 10,000 jobs costs the
store a grouped count and a 100-row read, never 10,000 rows through Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, func, select

from phalanx.store import schema as s
from phalanx.store.sqlbits import JOB_SUMMARY

MAX_TASK_IDS = 100_000  # task ids read to write one folded row's range


@dataclass(frozen=True)
class Group:
    first: dict[str, Any]  # the group's first job (lowest id), all summary columns
    count: int
    tasks: list[int] | None  # array task ids (sorted) for a folded array row; None: a plain job


@dataclass(frozen=True)
class QueuePage:
    groups: list[Group]
    total_rows: int
    by_state: dict[str, int]


def queue_page(
    store: Any,
    *,
    states: Sequence[str],
    user: str | None,
    partition: str | None,
    offset: int,
    limit: int,
) -> QueuePage:
    """One page of the folded queue; `states` empty means every state. `store` is a Store."""
    j = s.jobs.c
    conds: list[ColumnElement[bool]] = []
    if states:
        conds.append(j.state.in_(list(states)))
    if user:
        conds.append(j.user == user)
    if partition:
        conds.append(j.partition == partition)
    where = and_(True, *conds)
    key = func.coalesce(j.array_job_id, j.id)  # a plain job is its own group
    grouped = (
        select(
            func.min(j.id).label("first"),
            func.count().label("n"),
            j.array_job_id,
            j.state,
            j.partition,
        )
        .where(where)
        .group_by(key, j.array_job_id, j.state, j.partition)
    )
    with store.db.begin(write=False) as conn:
        by_state = {
            str(r.state): int(r.n)
            for r in conn.execute(
                select(j.state, func.count().label("n")).where(where).group_by(j.state)
            )
        }
        # the number of groups comes with the page (one grouping pass, not two); a page past
        # the end has no row to carry it, and counts them apart
        page = conn.execute(
            grouped.add_columns(func.count().over().label("groups"))
            .order_by("first")
            .offset(offset)
            .limit(limit)
        ).all()
        total = (
            int(page[0].groups)
            if page
            else conn.execute(select(func.count()).select_from(grouped.subquery())).scalar_one()
        )
        firsts = [int(r.first) for r in page]
        rows = {
            int(r["id"]): dict(r)
            for r in conn.execute(select(*JOB_SUMMARY).where(j.id.in_(firsts))).mappings()
        }
        groups = []
        for r in page:
            tasks = None
            if r.array_job_id is not None:
                tasks = [
                    int(t)
                    for (t,) in conn.execute(
                        select(j.array_task_id)
                        .where(
                            where,
                            j.array_job_id == r.array_job_id,
                            j.state == r.state,
                            j.partition == r.partition,
                        )
                        .order_by(j.array_task_id)
                        .limit(MAX_TASK_IDS)
                    )
                ]
            groups.append(Group(rows[int(r.first)], int(r.n), tasks))
    return QueuePage(groups, int(total), by_state)
