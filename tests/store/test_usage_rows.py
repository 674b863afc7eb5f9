"""The rows a utilisation report is computed from (`Store.usage_rows`, sreport), on both
backends: attempts that held CPUs in the window with their job's account and user, the
nodes with their first registration, and their DOWN and back events."""

from __future__ import annotations

import time

from test_store_contract import add_node, exited, running, start, store, submit1

from phalanx.domain import usage_report
from phalanx.store.store import Store

__all__ = ["store"]


def test_a_finished_jobs_cpu_time_and_a_down_nodes_time(store: Store) -> None:
    t0 = time.time() - 1.0
    add_node(store, "n1", cpus=4)
    add_node(store, "n2", cpus=2)
    jid = submit1(store, user="alice", cpus_per_task=3, account="physics")
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], time.time())
    store.apply_reports("n1", [exited(att)], None)
    store.mark_down("n2", "test", None)
    t1 = time.time() + 1.0
    done = store.attempts_of(jid)[0]
    attempts, nodes, events = store.usage_rows(t0, t1)
    assert [(a["cpus"], a["account"], a["user"]) for a in attempts] == [(3, "physics", "alice")]
    assert sorted((n["name"], n["cpus"]) for n in nodes) == [("n1", 4), ("n2", 2)]
    assert [down for _, down in events["n2"]] == [True] and "n1" not in events
    rep = usage_report.build(t0, t1, t1, attempts, nodes, events)
    ran = done["end_time"] - done["start_time"]
    assert abs(rep.allocated - 3 * ran) < 1e-6
    assert rep.by_assoc == {("physics", "alice"): rep.allocated}
    down_since = events["n2"][0][0]
    assert abs(rep.down - 2 * (t1 - down_since)) < 1e-6
    # a window before anything happened reports nothing allocated
    attempts, nodes, events = store.usage_rows(t0 - 100, t0 - 50)
    assert attempts == []
