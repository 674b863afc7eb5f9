"""The heartbeat rule applied by the controllers themselves (docs/sim.md, "The heartbeat rule").

As nodes join, the controllers lengthen the heartbeat interval, the fence timeout and the
failure-detection timeout (Timing.for_cluster of the node count in the store) and tell agents
the new values in every reply. The safety that matters: the failure detector never judges a
node by a shorter timeout than the one the node's agent may have been told, even when the
judging controller has not itself looked at the cluster's size since the node was told.

A budget of 2 heartbeats/s makes the rule bite at 3 nodes here (the default, 300/s, at 301).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from test_api import Agent

from grace import pass_the_grace
from phalanx.clock import FakeClock
from phalanx.config import Config, load_config
from phalanx.controller.runtime import Controller
from phalanx.store import schema
from phalanx.store.store import Store

PARTITIONS = [{"name": "batch", "default": True}]
BUDGET = 2.0  # heartbeats/s: 4 nodes heartbeat every 2 s instead of 1


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    return load_config(
        overrides={"cluster": {"partitions": PARTITIONS}, "timing": {"heartbeat_budget": BUDGET}}
    )


def register(client: TestClient, *names: str) -> dict[str, dict]:
    return {n: Agent(client, n).register() for n in names}


def scaled(reply: dict) -> tuple[float, float, float]:
    t = reply["timing"]
    return t["heartbeat_interval"], t["fence_timeout"], t["node_down_timeout"]


def test_timings_grow_with_the_cluster_and_every_reply_carries_them(
    ctl: Controller, client: TestClient, config: Config
) -> None:
    base = config.timing
    assert (base.heartbeat_interval, base.fence_timeout, base.node_down_timeout) == (1, 5, 10)
    register(client, "n1", "n2")
    ctl.presence_tick()
    assert scaled(Agent(client, "n1").heartbeat()) == (1, 5, 10)  # 2 nodes: within budget

    register(client, "n3", "n4")
    # not yet looked at: the reply is scaled for the count this controller last read
    assert scaled(Agent(client, "n1").heartbeat()) == (1, 5, 10)
    ctl.presence_tick()
    assert scaled(Agent(client, "n1").heartbeat()) == (2, 10, 20)  # 4 nodes / 2 per s
    assert ctl.timing.node_down_timeout == 20  # what the detector judges by
    assert ctl.timing.lease_ttl == base.lease_ttl  # the rule scales those three only

    r5 = register(client, "n5")["n5"]
    assert (r5["timing"]["heartbeat_interval"], r5["timing"]["fence_timeout"]) == (2, 10)
    ctl.presence_tick()
    assert scaled(Agent(client, "n5").heartbeat()) == (2.5, 12.5, 25)
    status = client.get("/v1/cluster").json()["this_controller"]
    assert status["timing_nodes"] == 5
    assert status["timing"]["heartbeat_interval"] == 2.5


def test_the_timings_never_shrink_on_a_stale_count(ctl: Controller) -> None:
    assert ctl.rescale_timing(6) != ""
    assert ctl.timing.heartbeat_interval == 3
    # a count read earlier, applied late (two loops read it concurrently): ignored
    assert ctl.rescale_timing(4) == ""
    assert ctl.timing.heartbeat_interval == 3
    assert ctl.agent_timing == {
        "heartbeat_interval": 3,
        "fence_timeout": 15,
        "node_down_timeout": 30,
    }


def add_node(store: Store, name: str) -> None:
    store.register_node(
        name, cpus=4, mem_mb=8192, gpus=[], features=[], addr=None, boot_id=None, version=None
    )


def test_a_cluster_past_the_timings_limits_keeps_its_timings(
    ctl: Controller, caplog: pytest.LogCaptureFixture
) -> None:
    """At 2 heartbeats/s, a million nodes would need a heartbeat every 500,000 s, past the
    interval's limit (300 s): the controller keeps what it has (more load, never unsafe) and
    says what to change, instead of failing every tick."""
    ctl.rescale_timing(6)
    assert ctl.rescale_timing(1_000_000) == ""
    assert ctl.timing.heartbeat_interval == 3
    assert "raise [timing] heartbeat_budget" in caplog.text


def silence(store: Store, node: str, seconds: float) -> None:
    with store.db.begin() as conn:
        conn.execute(
            update(schema.nodes)
            .where(schema.nodes.c.name == node)
            .values(last_heartbeat=store.db_time() - seconds)
        )


def judging(ctl: Controller, clock: FakeClock) -> Controller:
    """The cluster duty, past the wait a new lease holder makes before judging any node."""
    pass_the_grace(ctl, clock)
    return ctl


def test_the_detector_judges_by_the_count_it_reads_not_by_a_stale_one(
    store: Store, config: Config
) -> None:
    """Controller A told n1 the 4-node timings (fence 10 s); B, the detector, has not looked
    at the size since it started with 2 nodes (down timeout 10 s). n1 silent for 15 s: B
    must not declare it DOWN (its jobs may fence only at 10 s + the kill grace, and be
    requeued beside themselves), but must once it is silent past 20 s."""
    for n in ("n1", "n2"):
        add_node(store, n)
    clock = FakeClock()
    b = Controller(store, config, cid="b", clock=clock)
    b.rescale_timing()
    assert "took term" in b.leases.tick()
    assert b.timing.node_down_timeout == 10
    for n in ("n3", "n4"):  # registered through controller A
        add_node(store, n)
    a = Controller(store, config, cid="a")
    a.rescale_timing()
    assert a.agent_timing["fence_timeout"] == 10  # what n1 was told
    for n in ("n2", "n3", "n4"):
        silence(store, n, 0)

    silence(store, "n1", 15)
    assert b.cluster.judge_nodes() == "idle"  # a new holder's grace: no verdict yet
    said = judging(b, clock).cluster.judge_nodes()
    assert "n1 DOWN" not in said, said
    assert not store.get_node("n1")["down"]
    assert b.timing.node_down_timeout == 20

    silence(store, "n1", 21)
    # (the grace is one timeout as it now stands, 20 s: the clock moves past that too)
    assert "n1 DOWN" in judging(b, clock).cluster.judge_nodes()
    assert store.get_node("n1")["down"]
