"""Small pieces the store's modules share: the fence proof, the clock, chunking, a task query."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Select, Text, cast, literal_column, select, type_coerce

from phalanx.domain.states import AttemptState
from phalanx.store import schema as s
from phalanx.store.lazyspec import LazySpecColumn

# Every job column but the spec (script and environment can be kilobytes): lists, scheduling
# snapshots and state transitions never need it, only `get_job` does. Nor the change
# sequence: the database's bookkeeping for the scheduler's incremental read, not the job's.
JOB_SUMMARY = [c for c in s.jobs.c if c.name not in ("spec", "change_seq")]

# What a node needs to know about one of its tasks (or step tasks) to start it: the task's
# share of the node, its attempt and its job. Store.node_work and Store.node_step_work select
# these (launch.build_launch and build_step_launch read them), each with its own additions.
NODE_WORK_COLUMNS = (
    s.tasks.c.rank,
    s.tasks.c.cpus,
    s.tasks.c.mem_mb,
    s.tasks.c.gpu_ids,
    s.attempts.c.token,
    s.attempts.c.seq,
    s.attempts.c.state.label("attempt_state"),
    s.attempts.c.stop_reason,
    s.attempts.c.nodes.label("attempt_nodes"),
    s.attempts.c.partition.label("attempt_partition"),
    s.attempts.c.fence_term,
    s.jobs.c.id.label("job_id"),
    s.jobs.c.name,
    s.jobs.c.user,
    s.jobs.c.array_job_id,
    s.jobs.c.array_task_id,
    s.jobs.c.time_limit_s,
    s.jobs.c.cpus_per_node,
    # decoded on first use (store/lazyspec.py); the one field every heartbeat tests, apart.
    # Cast to text in the query: PostgreSQL's driver would decode a json column itself.
    type_coerce(cast(s.jobs.c.spec, Text), LazySpecColumn()).label("spec"),
    s.jobs.c.spec[("checkpoint_parsed", "interval_s")].label("checkpoint_interval_s"),
)


@dataclass(frozen=True)
class Fence:
    """Proof that a write is made by the current holder of a duty lease."""

    lease: str
    holder: str
    term: int


def now() -> float:
    """The controller's clock for stamps (lease expiry uses the database's clock instead)."""
    return time.time()


# The attempt states that hold resources (all but ENDED), named rather than "!= ENDED": the
# database then finds the few live attempts through ix_attempts_state instead of reading every
# attempt ever made (a million of them in a store that has served for months: each scheduling
# pass read them three times, see docs/scheduling.md)
HOLDING = tuple(a.value for a in AttemptState if a.holds_resources)


def literal_in(column: Any, values: Iterable[str]) -> Any:
    """`column IN ('a', 'b')` with the values written into the statement (constants of the
    code, never user input): as a list parameter the statement's text is rebuilt at every
    execution (an expanding IN), about 20 us of each heartbeat's read, and it cannot be a
    `Prebuilt` (store/prebuilt.py)."""
    return column.in_([literal_column(f"'{v}'") for v in sorted(values)])


def attempt_holds() -> Any:
    """WHERE clause: the attempt still holds its resources (not ENDED), by the index."""
    return literal_in(s.attempts.c.state, HOLDING)


def active_tasks(*cols: Any) -> Select[Any]:
    """`cols` of the tasks whose attempt still holds its resources (not ENDED).

    `tasks.held` says the same of each task (cleared where the attempt ends, migration 0011):
    with a node filter the (node, held) index then reads the node's live tasks only, where by
    the node alone it read every task the node ever ran (the capacity re-check of every start,
    `Store._fitting`, grew with the cluster's history)."""
    return (
        select(*cols)
        .join(s.attempts, s.attempts.c.id == s.tasks.c.attempt_id)
        .where(attempt_holds(), s.tasks.c.held.is_(True))
    )


def chunks(items: list[int], n: int) -> Iterable[list[int]]:
    """`items` in lists of at most `n`: keeps IN (...) lists under the backends' limits."""
    for i in range(0, len(items), n):
        yield items[i : i + n]


def unusable_nodes(conn: Connection, names: Iterable[str]) -> set[str]:
    """Those of `names` no task can run on now: DOWN, drained or without a registered agent
    (a restart's candidates, store/attempts.py; an in-place recovery's spares, regroup.py)."""
    names = sorted(set(names))
    if not names:
        return set()
    return {
        r.name
        for r in conn.execute(
            select(s.nodes.c.name).where(
                s.nodes.c.name.in_(names),
                (s.nodes.c.down.is_(True))
                | (s.nodes.c.drain.is_(True))
                | (s.nodes.c.registered.is_(False)),
            )
        )
    }
