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


def heard_horizon(db_now: float, flushed: Iterable[float | None], window: float) -> float:
    """The time up to which the store holds every heartbeat the live controllers answered.

    A controller answers a node's heartbeat at once and writes it with its next flush; until
    then the store says the node is silent while the node's agent, freshened by the reply,
    keeps its jobs running. Each controller's flush therefore also writes the time through
    which everything it heard is stored (`flushed`, database clock). A silence counts only up
    to the earliest of those times: a controller that is slow, paused or cut off from the
    store holds the failure detector back instead of letting it blame that silence on a node.

    A controller whose mark is older than `window` (Timing.heard_window) no longer holds it
    back: it has stopped or lost the store for that long, and every agent that heard only from
    it has let its fence run out since. That holds because a controller answers heartbeats only
    while its mark is at most Timing.flush_lag_limit old (controller/agents_api.py), and the
    window adds to that limit the longest an answered agent's fence can still run. None: a
    controller of an earlier release, which writes no mark.
    """
    marks = [f for f in flushed if f is not None and f >= db_now - window]
    return min([db_now, *marks])
