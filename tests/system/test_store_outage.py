"""A database outage longer than node_down_timeout must not make the cluster look dead.

While PostgreSQL is frozen no heartbeat reaches the store; when it comes back every node's
last heartbeat there is older than the timeout. The cluster duty must first see a full timeout
of fresh heartbeats again (its lease lapsed locally; a stalled tick re-checks before acting),
so no node is declared DOWN and no job is requeued.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, wait_for

pytestmark = [pytest.mark.system, pytest.mark.postgres]

TIMING = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
}
OUTAGE_S = 10.0  # longer than node_down_timeout and than lease_ttl


@pytest.mark.timeout(180)
def test_store_outage_longer_than_the_timeout_declares_no_node_dead(
    make_cluster: Callable[..., Cluster], pg_url: str, pg_server: Any, tmp_path: Path
) -> None:
    cluster = make_cluster(db=pg_url)
    cluster.timing.update(TIMING)
    cluster.start(nodes=2, cpus=2)
    c = cluster.client()
    # the cluster duty is active (its first grace is over) before the outage
    wait_for(
        lambda: any(e["kind"] == "lease.take" for e in c.events(limit=10_000)),
        what="the controller to take its leases",
    )
    time.sleep(TIMING["node_down_timeout"] + 1)  # the fault is timed: let the first grace pass

    with pg_server.paused():
        time.sleep(OUTAGE_S)  # the outage itself (a duration, not a condition)

    # after the store is back, watch for two timeouts: nobody may be declared DOWN
    watch_until = time.monotonic() + 2 * TIMING["node_down_timeout"]
    while time.monotonic() < watch_until:
        nodes = wait_for(c.nodes, what="the controller to answer again")
        assert not any("DOWN" in n["state"] for n in nodes), nodes
        time.sleep(0.2)
    kinds = [e["kind"] for e in c.events(limit=10_000)]
    assert "node.down" not in kinds
    assert all("DOWN" not in n["state"] for n in c.nodes())
