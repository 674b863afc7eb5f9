"""Insert an array's tasks as one server-side expansion of a template row.

An array's tasks are one row each, identical but for `array_task_id`. Sent as a multi-row
INSERT they cost one bound parameter per column per task: 5,000 tasks were 150,000
parameters, and psycopg parses a statement that long in Python on every execution (it
caches only short ones), so a 5,001-task `sbatch --array` took 2.5 s on an idle machine and
a single statement of it ran past `db_op_timeout` on a busy one, which failed the
submission. Here the template's values are bound once and the database expands the task ids
from one list parameter (PostgreSQL `unnest`, SQLite `json_each`): a few dozen parameters
per statement whatever the array's size, in chunks so no one statement grows with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, Connection, Integer, func, insert, literal, select
from sqlalchemy.dialects.postgresql import ARRAY

from phalanx.store import schema as s
from phalanx.store.sqlbits import chunks

# Tasks per statement: bounds one statement's time (and the list parameter's size) for the
# largest array accepted (values.MAX_ARRAY_TASKS).
TASKS_PER_STATEMENT = 5_000


def insert_array_tasks(
    conn: Connection, template: Mapping[str, Any], tasks: Sequence[int]
) -> list[int]:
    """Insert one row per task id in `tasks` (each `template` with its `array_task_id`);
    return the new job ids in the order of `tasks`. Ids are assigned in task order within
    a statement; the mapping back is by `RETURNING array_task_id`, so it does not rely on
    that."""
    names = [n for n in template if n != "array_task_id"]
    by_task: dict[int, int] = {}
    for part in chunks(list(tasks), TASKS_PER_STATEMENT):
        if conn.dialect.name == "postgresql":
            src = (
                func.unnest(literal(part, ARRAY(BigInteger))).table_valued("task").render_derived()
            )
            task = src.c.task
        else:
            src = func.json_each(literal(json.dumps(part))).table_valued("value")
            task = src.c.value
        fixed = [literal(template[n], s.jobs.c[n].type).label(n) for n in names]
        rows = select(*fixed, task.cast(Integer).label("array_task_id")).order_by(task)
        stmt = (
            insert(s.jobs)
            .from_select([*names, "array_task_id"], rows)
            .returning(s.jobs.c.id, s.jobs.c.array_task_id)
        )
        by_task.update((int(r.array_task_id), int(r.id)) for r in conn.execute(stmt))
    return [by_task[t] for t in tasks]
