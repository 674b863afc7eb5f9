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
