"""`scheduling.node_views` keeps the views of its last call and gives a node whose row reads
the same its view back: the views must still be exactly what a fresh build gives."""

from __future__ import annotations

from typing import Any

from phalanx.domain import scheduling

PARTS = {"cpu": {"name": "cpu", "nodes": "c*"}, "all": {"name": "all", "nodes": "*"}}


def _row(name: str, **kw: Any) -> dict[str, Any]:
    row = {
        "name": name,
        "cpus": 8,
        "mem_mb": 1000,
        "gpus": [[0, "a100"]],
        "features": ["ib"],
        "registered": True,
        "down": False,
        "drain": False,
        "topology": None,
    }
    row.update(kw)
    return row


def _fresh(rows: list[dict[str, Any]], parts: dict[str, Any]) -> list[Any]:
    return scheduling._node_views(rows, scheduling._patterns(parts.values()), None)


def test_unchanged_rows_get_their_views_back_and_changed_ones_new_views() -> None:
    rows = [_row("c1"), _row("c2"), _row("g1")]
    first = scheduling.node_views(rows, PARTS)
    assert first == _fresh(rows, PARTS)
    # the next read: new dicts (as the store gives), one node drained, one with more memory
    again = [dict(r) for r in rows]
    again[1]["drain"] = True
    again[2]["mem_mb"] = 2000
    second = scheduling.node_views(again, PARTS)
    assert second == _fresh(again, PARTS)
    assert second[0] is first[0]  # the same row: the same view
    assert not second[1].schedulable and second[2].mem_mb == 2000
    # other partitions: every view is rebuilt (a node's partitions come from them)
    other = {"cpu": {"name": "cpu", "nodes": "c1"}}
    assert scheduling.node_views(again, other) == _fresh(again, other)
    # rows without every column (hand-made): built as before
    bare = [{k: v for k, v in r.items() if k != "topology"} for r in again]
    assert scheduling.node_views(bare, PARTS) == _fresh(again, PARTS)
