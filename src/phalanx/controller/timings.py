"""The timings in force: the configured ones, scaled by the heartbeat rule to the cluster's size.

`Timings` owns the one mutable copy of the controller's timing (the loops, the failure detector
and every heartbeat reply read it) and the rule that grows it with the node count
(docs/sim.md). It lives apart from the duties that read it so that each reads the same value
through one getter, and the rule's one-way ratchet (timings follow the count up, never down)
is kept in one place.
"""

from __future__ import annotations

import logging
import threading

from pydantic import ValidationError

from phalanx.config import Timing
from phalanx.store.surface import NodeStore

log = logging.getLogger("phalanx.controller")


def scaled_fields(timing: Timing) -> dict[str, float]:
    """The timings the heartbeat rule scales (Timing.for_cluster), as agents are told them
    in every heartbeat reply."""
    return {
        "heartbeat_interval": timing.heartbeat_interval,
        "fence_timeout": timing.fence_timeout,
        "node_down_timeout": timing.node_down_timeout,
    }


class Timings:
    """The configured timing (`base`), the one in force (`current`), what agents are told
    (`agent`) and the node count `current` was scaled for (`nodes`)."""

    def __init__(self, store: NodeStore, base: Timing) -> None:
        self.store = store  # only its node count
        self.base = base
        self.current = base
        self.agent = scaled_fields(base)  # goes with every heartbeat reply
        self.nodes = 0  # the node count `current` was scaled for
        self._lock = threading.Lock()

    def rebase(self, base: Timing) -> None:
        """New configured timings (a new cluster configuration version,
        controller/confversions.py), scaled for the node count already seen."""
        with self._lock:
            self.base = base
            try:
                new = base.for_cluster(self.nodes)
            except ValidationError:  # past a limit: unscaled, as rescale would keep them
                new = base
            self.current = new
            self.agent = scaled_fields(new)

    def rescale(self, nodes: int | None = None) -> str:
        """Apply the heartbeat rule (docs/sim.md) to the cluster's size: `nodes` node rows
        (read from the store when None). Logs and returns what changed, or "".

        The timings follow the node count up and never down, and the count never falls
        (node rows are never deleted), so an agent is never told a longer fence than the
        failure detector allows for: every controller scales from the same count, a reply
        carries timings from a count read before it was sent, and the detector reads the
        count afresh (in its tick, before the silent nodes) long after the reply a silent
        node last applied (a reply read later than its own timeout is dropped by the agent).
        Shorter timings (a config change) reach agents the same way; jobs already running
        keep the fence they were launched with, so lower them only on a quiet cluster
        (docs/configuration.md)."""
        if nodes is None:
            nodes = self.store.node_count()
        with self._lock:
            if nodes <= self.nodes:
                return ""
            self.nodes = nodes
            old = self.current
            try:
                new = self.base.for_cluster(nodes)
            except ValidationError as e:  # past a timing's upper limit: more load, still safe
                log.warning(
                    "heartbeat rule: %d nodes at %g heartbeats/s would take a timing past its "
                    "limit (%s); heartbeats stay every %.3gs: raise [timing] heartbeat_budget",
                    nodes,
                    self.base.heartbeat_budget,
                    "; ".join(str(x["msg"]) for x in e.errors()),
                    old.heartbeat_interval,
                )
                return ""
            if scaled_fields(new) == scaled_fields(old):
                return ""
            self.current = new
            self.agent = scaled_fields(new)
        said = (
            f"heartbeat rule: {nodes} nodes at {self.base.heartbeat_budget:g} "
            f"heartbeats/s: heartbeat every {new.heartbeat_interval:.3g}s (was "
            f"{old.heartbeat_interval:.3g}s), fence_timeout {new.fence_timeout:.3g}s, "
            f"node_down_timeout {new.node_down_timeout:.3g}s"
        )
        log.info("%s", said)
        return said
