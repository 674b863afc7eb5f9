"""Agents' exchanges that arrive together are written in one transaction (store/groupcommit.py,
`AgentReports.apply_reports`), on both backends, with the outcome separate exchanges give:
set-based when no two concern the same attempt, one after the other when they do."""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import func, select
from test_store_contract import (
    add_node,
    exited,
    running,
    start,
    state,
    store,
    submit1,
    wait_for,
)

from phalanx.store import schema as s
from phalanx.store.groupcommit import GroupCommit
from phalanx.store.store import Store, TaskReport

__all__ = ["store"]

DEADLINE = 60.0


def report_together(
    store: Store,
    exchanges: list[tuple[str, list[TaskReport]]],
    work: dict[str, list[dict[str, Any]]] | None = None,
) -> GroupCommit[Any, Any]:
    """Apply the exchanges from one thread each while this thread holds the store's write
    turn, so that all but the first (which leads, and waits for the turn) queue up and run as
    one group. Returns the group commit, for its counts; each call's answer (the node's
    work) goes into `work`."""
    errors: list[BaseException] = []

    def call(node: str, reports: list[TaskReport]) -> None:
        try:
            got = store.apply_reports(node, reports, time.time())
            if work is not None:
                work[node] = got
        except BaseException as e:
            errors.append(e)

    store.apply_reports(exchanges[0][0], [], None)  # (creates the group commit)
    group: GroupCommit[Any, Any] = store.__dict__["_report_group"]
    before = group.groups
    assert store.db.writers is not None
    with store.db.writers.turn(store.db.url):
        threads = [threading.Thread(target=call, args=x) for x in exchanges]
        threads[0].start()
        wait_for(lambda: group.groups == before + 1, DEADLINE)  # the first leads
        for t in threads[1:]:
            t.start()
        wait_for(lambda: group.waiting() == len(exchanges) - 1, DEADLINE)  # the others queue
    for t in threads:
        t.join(DEADLINE)
    assert not errors, errors
    assert group.groups == before + 2
    return group


def events_of(store: Store, kind: str) -> int:
    with store.db.begin(write=False) as conn:
        return int(
            conn.execute(
                select(func.count()).select_from(s.events).where(s.events.c.kind == kind)
            ).scalar_one()
        )


def test_exchanges_from_many_nodes_are_written_together(store: Store) -> None:
    nodes = [f"n{i}" for i in range(6)]
    atts = {}
    for n in nodes:
        add_node(store, n)
        atts[n] = start(store, submit1(store), [n])
    work: dict[str, list[dict[str, Any]]] = {}
    group = report_together(store, [(n, [running(atts[n])]) for n in nodes], work)
    assert group.largest == len(nodes) - 1
    assert {state(store, a["job_id"]) for a in atts.values()} == {"RUNNING"}
    # each exchange answers with its own node's work as the group's transaction left it
    # (read for the whole group in one statement), the same rows a read of its own gives
    for n in nodes:
        assert [(w["attempt_id"], w["task_state"]) for w in work[n]] == [(atts[n]["id"], "RUNNING")]
        assert work[n] == store.node_work(n)
    assert events_of(store, "job.running") == len(nodes)  # one each, none lost or doubled
    group = report_together(
        store,
        [(n, [exited(atts[n], code=0 if i % 2 else 3)]) for i, n in enumerate(nodes)],
        work,
    )
    assert all(work[n] == [] for n in nodes)  # ended: the agents may forget them
    assert [state(store, atts[n]["job_id"]) for n in nodes] == ["FAILED", "COMPLETED"] * 3
    with store.db.begin(write=False) as conn:
        held = conn.execute(
            select(func.count()).select_from(s.tasks).where(s.tasks.c.held)
        ).scalar()
    assert held == 0  # every ended attempt released its tasks


def test_exchanges_about_one_attempt_are_applied_one_after_the_other(store: Store) -> None:
    """A two-node job's tasks end in the same group as a one-node job's: the two-node
    attempt moves forward once per exchange, as separate exchanges would move it."""
    for n in ("a", "b", "c"):
        add_node(store, n)
    wide = start(store, submit1(store, nodes=2), ["a", "b"])
    narrow = start(store, submit1(store), ["c"])
    for node in ("a", "b"):
        store.apply_reports(node, [running(wide)], time.time())
    store.apply_reports("c", [running(narrow)], time.time())
    report_together(
        store, [("a", [exited(wide)]), ("b", [exited(wide)]), ("c", [exited(narrow, code=1)])]
    )
    assert state(store, wide["job_id"]) == "COMPLETED"
    assert state(store, narrow["job_id"]) == "FAILED"
    with store.db.begin(write=False) as conn:
        ended = conn.execute(
            select(s.tasks.c.node, s.tasks.c.state).where(s.tasks.c.attempt_id == wide["id"])
        ).all()
    assert sorted(ended) == [("a", "EXITED"), ("b", "EXITED")]
