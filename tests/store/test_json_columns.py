"""JSON columns decode as the standard library would (store/engine.py `json_loads`), on both
backends and both of the store's read paths, including what only `json.dumps` writes."""

from __future__ import annotations

import json
import math

from sqlalchemy import select
from test_store_contract import add_node, store

from phalanx.store import prebuilt
from phalanx.store import schema as s
from phalanx.store.jsoncol import json_loads
from phalanx.store.store import Store

__all__ = ["store"]


def test_json_loads_decodes_what_json_dumps_writes() -> None:
    doc = {"command": ["python", "-c", "print('é')"], "env": {"A": "1"}, "n": 3, "f": 0.1}
    assert json_loads(json.dumps(doc)) == doc
    # not strict JSON, but json.dumps writes them: the fallback decodes them
    assert math.isnan(json_loads(json.dumps({"x": float("nan")}))["x"])
    assert json_loads(json.dumps([float("inf"), 2**70])) == [float("inf"), 2**70]


def test_a_json_column_round_trips_through_the_store(store: Store) -> None:
    add_node(store, "n1")
    odd = {"rack": "r1", "big": 2**70, "nested": {"k": [1, None, True], "f": 1.5}}
    if store.dialect == "sqlite":  # (PostgreSQL's json types refuse what is not strict JSON)
        odd["gauge"] = float("inf")
    with store.db.begin() as conn:
        assert prebuilt.update_where(conn, s.nodes, {"name": "n1"}, {"topology": odd}) == 1
    with store.db.begin(write=False) as conn:
        driver = prebuilt.select_where(conn, s.nodes, {"name": "n1"}, cols=["topology"])
        plain = conn.execute(select(s.nodes.c.topology)).scalar_one()
    assert driver == [{"topology": plain}]
    assert plain == odd
