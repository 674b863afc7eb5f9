"""A node-work row's job spec is decoded only when read (store/lazyspec.py), on both backends
the same values: the heartbeat's exchange reads every live task's row, and starts few."""

from __future__ import annotations

import json
import time

import orjson
import pytest
from test_store_contract import add_node, running, start, store, submit1

from phalanx.controller.exchange import checkpoint_items
from phalanx.store.lazyspec import LazySpec
from phalanx.store.store import Store

__all__ = ["store"]


def test_node_work_gives_the_spec_and_its_checkpoint_interval_apart(store: Store) -> None:
    add_node(store, "n1", cpus=8)
    jobs = {
        600: submit1(store, checkpoint_interval_s=600),
        "auto": submit1(store, checkpoint_interval_s="auto"),
        None: submit1(store),
    }
    atts = [start(store, jid, ["n1"]) for jid in jobs.values()]
    # a heartbeat reports every task of its node: those it leaves out are lost
    store.apply_reports("n1", [running(att) for att in atts], time.time())
    rows = {int(w["job_id"]): w for w in store.node_work("n1")}
    assert {k: rows[jid]["checkpoint_interval_s"] for k, jid in jobs.items()} == {
        600: 600,
        "auto": "auto",
        None: None,
    }
    # on both backends (the column is read as text: PostgreSQL's driver decodes json itself)
    assert all(isinstance(w["spec"], LazySpec) for w in rows.values())
    assert not any(w["spec"].decoded for w in rows.values())

    # the exchange's per-row test reads the interval alone: only the two jobs that have one
    # are asked for their settings (the spec), the third's spec stays text
    items = checkpoint_items(list(rows.values()), lambda w: 600.0)
    assert sorted(i["attempt_id"] for i in items) == sorted(
        rows[jobs[k]]["attempt_id"] for k in (600, "auto")
    )
    assert not rows[jobs[None]]["spec"].decoded

    for jid, w in rows.items():
        assert w["spec"] == store.get_job(jid)["spec"]  # the same values, read in full
        assert dict(w["spec"]) == store.get_job(jid)["spec"]


def test_a_lazy_spec_reads_as_a_mapping_and_refuses_to_be_serialized_half() -> None:
    text = json.dumps({"argv": ["/bin/true"], "env": {"A": "1"}, "n": 1.5})
    spec = LazySpec(text)
    assert spec and not spec.decoded  # truth needs no decoding: a spec is never empty
    assert spec["argv"] == ["/bin/true"] and spec.get("missing", 7) == 7
    assert spec.decoded
    assert "env" in spec and len(spec) == 3 and sorted(spec) == ["argv", "env", "n"]
    assert spec == json.loads(text) and json.loads(text) == spec
    assert not LazySpec("{}")
    # serializing one would silently write `{}` were it a dict subclass: it raises instead
    with pytest.raises(TypeError):
        json.dumps(spec)
    with pytest.raises(TypeError):
        orjson.dumps(spec)
    with pytest.raises(TypeError, match="JSON object"):
        LazySpec("[1, 2]").get("x")
