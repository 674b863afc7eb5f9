"""What the agents' exchange carries of a node's configuration (controller/nodeconfig.py):
every registration reply has the node's settings resolved from the version in force, with
its number; a heartbeat reply has them only when the agent says it runs another version (or
says nothing); `phalanx config apply` of a new `[nodes]` reaches the next heartbeat; a bad
value is refused with the field named and nothing changes."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

import phalanx.agent.nodecheck  # noqa: F401  (the [nodes] rules: config/nodes.py RULES)
from phalanx.config import Config
from phalanx.config.versioned import cluster_document, to_toml
from phalanx.controller import confversions
from phalanx.controller.runtime import Controller
from phalanx.store.store import Store

NODES = """
[nodes]
prolog = { path = "/etc/phalanx/prolog.sh", timeout = 20 }
features = ["ib"]

[[nodes.match]]
names = "n[2-3]"
prolog = false
"""


@pytest.fixture
def versioned(store: Store, ctl: Controller, config: Config) -> Controller:
    _running, version = confversions.startup(store, config, ctl.cid)
    ctl.versions.version = version
    store.register_controller(ctl.cid, None)
    return ctl


def register(client: TestClient, node: str) -> dict[str, Any]:
    body = {"cpus": 2, "mem_mb": 2048, "gpus": [], "features": [], "addr": "127.0.0.1"}
    r = client.post(f"/v1/agents/{node}/register", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def heartbeat(client: TestClient, node: str, version: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"tasks": [], "wait": 0}
    if version is not None:
        body["node_config_version"] = version
    r = client.post(f"/v1/agents/{node}/heartbeat", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_registration_and_heartbeats_carry_the_nodes_settings(
    client: TestClient, versioned: Controller, config: Config
) -> None:
    assert register(client, "n1")["node_config"] == {"version": 1, "settings": {}}
    register(client, "n2")
    assert "node_config" not in heartbeat(client, "n1", 1)  # it runs version 1 already
    assert heartbeat(client, "n1", None)["node_config"]["version"] == 1  # an agent that says none

    text = to_toml(cluster_document(config)) + NODES
    r = client.post("/v1/config/apply", json={"text": text, "base_version": 1})
    assert r.status_code == 200, r.text
    assert versioned.versions.version == 2

    one = heartbeat(client, "n1", 1)["node_config"]
    assert one == {
        "version": 2,
        "settings": {
            "prolog": {"path": "/etc/phalanx/prolog.sh", "timeout": 20.0},
            "features": ["ib"],
        },
    }
    two = heartbeat(client, "n2", 1)["node_config"]
    assert two["settings"]["prolog"] is False
    assert "node_config" not in heartbeat(client, "n2", 2)
    assert register(client, "n3")["node_config"]["settings"]["prolog"] is False

    bad = text.replace("timeout = 20", "timeout = 7200")
    r = client.post("/v1/config/apply", json={"text": bad, "base_version": 2})
    assert r.status_code == 422, r.text
    assert "nodes.prolog: prolog.timeout: must be a number of seconds" in r.text
    assert versioned.versions.version == 2


def test_the_version_each_agent_runs_is_shown_and_a_node_behind_is_marked(
    client: TestClient, versioned: Controller, config: Config
) -> None:
    """The version an agent says it runs is stored by the heartbeat flush (once per change)
    and shown by GET /v1/nodes, `phalanx nodes` and `scontrol show node`, with the cluster's
    current version: a node that has not taken a new version yet is behind."""
    from phalanx.cli import render
    from phalanx.slurm import scontrol

    register(client, "n1")
    register(client, "n2")
    heartbeat(client, "n1", 1)
    heartbeat(client, "n2", 1)
    versioned.heartbeats.flush()

    def nodes() -> dict[str, dict[str, Any]]:
        r = client.get("/v1/nodes")
        assert r.status_code == 200, r.text
        return {n["name"]: n for n in r.json()["nodes"]}

    seen = nodes()
    assert {n: (v["config_version"], v["config_behind"]) for n, v in seen.items()} == {
        "n1": (1, False),
        "n2": (1, False),
    }
    r = client.post(
        "/v1/config/apply",
        json={"text": to_toml(cluster_document(config)) + NODES, "base_version": 1},
    )
    assert r.status_code == 200, r.text
    heartbeat(client, "n2", 2)  # n2 took version 2 from its reply; n1 has not heard yet
    versioned.heartbeats.flush()
    seen = nodes()
    assert seen["n1"]["cluster_config_version"] == 2
    assert (seen["n1"]["config_version"], seen["n1"]["config_behind"]) == (1, True)
    assert (seen["n2"]["config_version"], seen["n2"]["config_behind"]) == (2, False)
    assert render.config_text(seen["n1"]) == "1 (behind 2)"
    assert render.config_text(seen["n2"]) == "2"
    assert "ConfigVersion=1 ClusterConfigVersion=2" in scontrol.node_lines(seen["n1"], ["batch"])
    one = client.get("/v1/nodes/n1").json()
    assert (one["config_version"], one["config_behind"]) == (1, True)
    assert "ConfigVersion=1 (behind 2)" in render.node_detail(one)
