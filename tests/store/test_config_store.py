"""The cluster configuration's versions in the store (store/configs.py), on SQLite and
PostgreSQL: version 1 made once from the first file, the next version written with its
partitions in one transaction and an event naming who changed what, a stale base refused with
nothing changed, the history, each controller's report of the version it runs (read back in
the same transaction as its presence), and the version a scheduling snapshot saw."""

from __future__ import annotations

from typing import Any

import pytest
from test_store_contract import add_node, store, submit1  # the contract suite's `store`

from phalanx.config import Config
from phalanx.config.versioned import cluster_document, document_from_toml, with_document
from phalanx.controller.confversions import partition_rows
from phalanx.errors import Conflict
from phalanx.store.store import Store

__all__ = ["store"]

TWO = """
[[cluster.partitions]]
name = "batch"
default = true
nodes = "n*"
[[cluster.partitions]]
name = "gpu"
nodes = "g*"
[priority]
weight_age = 5
"""


def doc_of(text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    doc, _ = document_from_toml(text)
    return doc, partition_rows(with_document(Config(), doc))


def events(store: Store, kind: str) -> list[dict[str, Any]]:
    return [e for e in store.events(limit=1000) if e["kind"] == kind]


def test_version_1_is_made_once_from_the_first_file(store: Store) -> None:
    assert store.config_current() is None
    first = cluster_document(Config())
    v1 = store.config_first(first, actor="ctl-1", partitions=partition_rows(Config()))
    assert (v1["version"], v1["action"], v1["actor"]) == (1, "create", "ctl-1")
    assert v1["document"] == first
    other, parts = doc_of(TWO)
    again = store.config_first(other, actor="ctl-2", partitions=parts)
    assert again["version"] == 1 and again["document"] == first  # the first one stands
    assert sorted(store.partitions()) == ["batch"]
    assert [e["actor"] for e in events(store, "config.create")] == ["ctl-1"]


def test_a_new_version_brings_its_partitions_and_an_event(store: Store) -> None:
    store.config_first(cluster_document(Config()), actor="c", partitions=partition_rows(Config()))
    doc, parts = doc_of(TWO)
    v = store.config_put(
        doc,
        actor="alice",
        action="apply",
        base_version=1,
        partitions=parts,
        message="applied; changed: cluster.partitions",
        comment="gpu nodes",
    )
    assert v == 2
    cur = store.config_current()
    assert cur is not None
    assert (cur["version"], cur["parent"], cur["actor"], cur["comment"]) == (
        2,
        1,
        "alice",
        "gpu nodes",
    )
    assert cur["document"] == doc
    assert sorted(store.partitions()) == ["batch", "gpu"]
    (ev,) = events(store, "config.apply")
    assert ev["actor"] == "alice"
    assert "version 2" in ev["message"] and "cluster.partitions" in ev["message"]
    assert [h["version"] for h in store.config_history()] == [2, 1]
    assert "document" not in store.config_history()[0]
    one = store.config_get(1)
    assert one is not None and one["document"] == cluster_document(Config())


def test_a_stale_base_version_changes_nothing(store: Store) -> None:
    store.config_first(cluster_document(Config()), actor="c", partitions=partition_rows(Config()))
    doc, parts = doc_of(TWO)
    store.config_put(doc, actor="a", action="apply", base_version=1, partitions=parts, message="m")
    with pytest.raises(Conflict, match="version 2 is current, not 1"):
        store.config_put(
            cluster_document(Config()),
            actor="b",
            action="apply",
            base_version=1,
            partitions=partition_rows(Config()),
            message="m",
        )
    cur = store.config_current()
    assert cur is not None and cur["version"] == 2
    assert sorted(store.partitions()) == ["batch", "gpu"]
    restored = store.config_put(
        cluster_document(Config()),
        actor="b",
        action="rollback",
        base_version=2,
        partitions=partition_rows(Config()),
        message="rolled back",
        source=1,
    )
    row = store.config_get(restored)
    assert row is not None and (row["action"], row["source"]) == ("rollback", 1)
    assert sorted(store.partitions()) == ["batch"]


def test_presence_reports_the_version_run_and_reads_the_current_one(store: Store) -> None:
    store.register_controller("ctl-1", "http://x")
    assert store.controller_presence("ctl-1", config_version=None, problem=None) is None
    store.config_first(cluster_document(Config()), actor="c", partitions=partition_rows(Config()))
    assert store.controller_presence("ctl-1", config_version=1, problem=None) == 1
    (row,) = store.list_controllers()
    assert (row["config_version"], row["config_problem"]) == (1, None)
    seen = row["last_seen"]
    # a controller that cannot run the current version reports why and leaves the spread
    store.controller_presence("ctl-1", config_version=1, problem="cannot", seen=False)
    (row,) = store.list_controllers()
    assert (row["config_problem"], row["last_seen"]) == ("cannot", seen)


def test_the_snapshot_says_which_version_its_partitions_are(store: Store) -> None:
    store.config_first(cluster_document(Config()), actor="c", partitions=partition_rows(Config()))
    add_node(store, "n1")
    submit1(store)
    assert store.sched_snapshot().config_version == 1
    doc, parts = doc_of(TWO)
    store.config_put(doc, actor="a", action="apply", base_version=1, partitions=parts, message="m")
    snap = store.sched_snapshot()
    assert snap.config_version == 2 and sorted(snap.partitions) == ["batch", "gpu"]


def test_live_facts(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    submit1(store)
    submit1(store)
    facts = store.config_live_facts()
    assert sorted(facts["nodes"]) == ["n1", "n2"]
    assert facts["active_by_partition"] == {"batch": 2}


def test_the_version_each_node_runs_is_recorded(store: Store) -> None:
    """What a node's agent says it runs (the heartbeat flush writes it): each node its own,
    a node not named left as it is, the same value again a no-op."""
    for n in ("n1", "n2", "n3"):
        add_node(store, n)
    store.record_config_versions({"n1": 2, "n2": 1})
    store.record_config_versions({"n2": 2})
    store.record_config_versions({"n2": 2, "nope": 5})  # an unknown node is no error
    got = {n["name"]: n["config_version"] for n in store.list_nodes()}
    assert got == {"n1": 2, "n2": 2, "n3": None}


def test_controllers_publish_their_own_settings_when_they_register(store: Store) -> None:
    """What `config apply` checks a version against for each live controller: its own
    settings as it registered them (none for an older release); the listing leaves them out."""
    part = {"timing": {"db_op_timeout": 1.5}, "watchdog": {"store_timeout": 0.0}}
    store.register_controller("ctl-1", "http://a", part)
    store.register_controller("ctl-2", "http://b")
    seen = {c["id"]: c["local_settings"] for c in store.controllers_seen(60.0)}
    assert seen == {"ctl-1": part, "ctl-2": None}
    assert "local_settings" not in store.list_controllers()[0]
    assert store.controllers_seen(-3600.0) == []  # none seen in the future
