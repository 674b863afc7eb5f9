"""The failure detector's verdict, pure: which nodes have been silent too long."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def silent_nodes(
    nodes: Iterable[Mapping[str, Any]],
    db_now: float,
    timeout: float,
    *,
    heard_recently: Iterable[str] = (),
) -> list[tuple[str, str]]:
    """(node, reason) for registered, not-yet-DOWN nodes whose last heartbeat in the store is
    older than `timeout` (database clock). `heard_recently`: nodes this controller has heard
    from but not yet written to the store; they are alive whatever the store says."""
    fresh = set(heard_recently)
    out = []
    for n in nodes:
        if not n["registered"] or n["down"] or n["last_heartbeat"] is None or n["name"] in fresh:
            continue
        silent = db_now - float(n["last_heartbeat"])
        if silent > timeout:
            out.append(
                (n["name"], f"no heartbeat for {silent:.1f}s (node_down_timeout {timeout:g}s)")
            )
    return out
