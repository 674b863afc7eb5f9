"""`[nodes]` in the versioned configuration (config/nodes.py): checked by the node file's own
rules with the field named, resolved per node name (defaults, then each matching
`[[nodes.match]]` in order), shown as TOML that reads back the same; and the agent's side
(agent/nodeconf.py, agent/agent_nodeconf.py): the delivered settings win over the node
file's, features add up, a new version swaps checks and hooks without a restart, and an
older version from a controller not yet moved is ignored."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import phalanx.agent.nodecheck  # noqa: F401  (the [nodes] rules: config/nodes.py RULES)
from phalanx.agent import nodeconf
from phalanx.agent.agent import Agent
from phalanx.agent.health import HealthMonitor
from phalanx.agent.health.base import CheckResult, Status
from phalanx.agent.hooks import Hook
from phalanx.agent.resources import NodeResources
from phalanx.client import Client
from phalanx.config import Config
from phalanx.config.nodes import resolve
from phalanx.config.versioned import cluster_document, document_from_toml, to_toml
from phalanx.errors import ConfigError

NODES = """
[[cluster.partitions]]
name = "batch"
default = true
nodes = "node*,gpu*"

[nodes]
features = ["ib"]
prolog = "/etc/phalanx/prolog.sh"
health = { interval = 20, mounts = ["/scratch"], kernel_log = {} }

[[nodes.match]]
names = "gpu[0-3]"
features = ["ib", "a100"]
health = { gpu = { expected_count = 8 } }
epilog = { path = "/etc/phalanx/epilog.sh", timeout = 90 }

[[nodes.match]]
names = "gpu3"
prolog = false
"""


def doc() -> dict[str, Any]:
    d, _ = document_from_toml(NODES)
    return d


def test_an_empty_section_is_left_out_of_the_document() -> None:
    assert "nodes" not in cluster_document(Config())


def test_the_section_is_normalised_and_reads_back_the_same() -> None:
    d = doc()
    nodes = d["nodes"]
    assert nodes["prolog"] == {"path": "/etc/phalanx/prolog.sh", "timeout": 30.0}
    assert nodes["match"][1] == {"names": "gpu3", "prolog": False}
    again, _ = document_from_toml(to_toml(d))
    assert again == d


def test_resolving_takes_the_defaults_then_each_match_in_order() -> None:
    nodes = doc()["nodes"]
    plain = resolve(nodes, "node07")
    assert plain == {
        "features": ["ib"],
        "prolog": {"path": "/etc/phalanx/prolog.sh", "timeout": 30.0},
        "health": {"interval": 20, "mounts": ["/scratch"], "kernel_log": {}},
    }
    gpu = resolve(nodes, "gpu1")
    assert gpu["features"] == ["ib", "a100"]
    # health merged check by check; the other keys replaced whole
    assert gpu["health"] == {
        "interval": 20,
        "mounts": ["/scratch"],
        "kernel_log": {},
        "gpu": {"expected_count": 8},
    }
    assert gpu["epilog"] == {"path": "/etc/phalanx/epilog.sh", "timeout": 90.0}
    assert gpu["prolog"]["path"] == "/etc/phalanx/prolog.sh"
    assert resolve(nodes, "gpu3")["prolog"] is False  # the later match wins
    assert resolve(nodes, "gpu4")["features"] == ["ib"]
    assert resolve(None, "x") == {} and resolve({}, "x") == {}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[nodes]\nprolog = { path = "/p", timeout = 0 }', "nodes.prolog: prolog.timeout"),
        ('[nodes]\nprolog = "relative.sh"', "nodes.prolog: prolog.path: must be an absolute"),
        ('[nodes]\nepilog = { path = "/e", when = 1 }', "nodes.epilog: epilog: unknown key"),
        ("[nodes]\nhealth = { mount = ['/x'] }", "nodes.health: health config: unknown key"),
        (
            "[[nodes.match]]\nnames = 'g*'\nhealth = { gpu = { temp_warn_c = 99 } }",
            "nodes.match.0.health: health config: gpu: temp_warn_c (99) is above",
        ),
        ("[[nodes.match]]\nnames = ' , '", "nodes.match.0.names"),
        ("[nodes]\nfeatures = ['a b']", "nodes.features"),
        ("[nodes]\nslurmd_port = 1", "nodes.slurmd_port"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        document_from_toml(text)
    assert field in e.value.message, e.value.message


# ---------------------------------------------------------------- the agent's side
def test_the_delivered_settings_win_and_features_add_up() -> None:
    file = {"health": {"interval": 5}, "prolog": {"path": "/mine"}, "epilog": "/e"}
    delivered = {"prolog": {"path": "/theirs", "timeout": 30.0}, "features": ["ib", "a100"]}
    now, overridden = nodeconf.effective(file, delivered, ["a100", "local"])
    assert now["prolog"] == {"path": "/theirs", "timeout": 30.0}
    assert now["epilog"] == "/e" and now["health"] == {"interval": 5}  # the file's, not set there
    assert now["features"] == ["a100", "local", "ib"]
    assert overridden == ["prolog"]
    alone, none = nodeconf.effective({}, {}, [])
    assert alone == {
        "health": {},
        "prolog": None,
        "epilog": None,
        "task_prolog": None,
        "features": [],
    }
    assert none == []
    assert nodeconf.changes(alone, now)[0] == 'health: built-in checks -> {"interval": 5}'


class Named:
    def __init__(self, name: str, status: Status = Status.OK) -> None:
        self.name, self.interval, self.status = name, 1.0, status

    def run(self) -> CheckResult:
        return CheckResult(self.name, self.status, self.name)


def test_replacing_checks_keeps_the_verdict_of_a_kept_check() -> None:
    mon = HealthMonitor([Named("a", Status.FAIL), Named("b")], passes_to_recover=2)  # type: ignore[list-item]
    mon.preflight()
    assert mon.summary()["status"] == "fail"
    mon.replace_checks([Named("a"), Named("c")], passes_to_recover=2)  # type: ignore[list-item]
    assert mon.summary()["status"] == "fail"  # a still needs its passes
    assert "b" not in mon.summary()["checks"]
    mon.run_due(now=1e9)
    mon.run_due(now=2e9)
    assert mon.summary()["status"] == "ok", mon.summary()
    assert set(mon.summary()["checks"]) == {"a", "c"}


def agent(tmp_path: Path, node_file: dict[str, Any] | None = None) -> Agent:
    return Agent(
        name="gpu1",
        state_dir=tmp_path / "state",
        client=Client("http://127.0.0.1:9"),  # never called
        resources=NodeResources(cpus=1, mem_mb=1024, features=["local"]),
        health=HealthMonitor([]),
        node_file=node_file,
    )


def test_an_agent_takes_a_newer_version_and_ignores_an_older_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prolog = tmp_path / "prolog.sh"
    prolog.write_text("#!/bin/sh\n")
    prolog.chmod(0o755)
    a = agent(tmp_path, {"epilog": {"path": "/bin/true"}})
    a._registered = True
    caplog.set_level(logging.INFO, logger="phalanx.agent")
    settings = {
        "prolog": {"path": str(prolog), "timeout": 20.0},
        "features": ["ib"],
        "health": {"memory": {"min_available_mb": 1}},
    }
    a._learn_node_config({"version": 3, "settings": settings})
    assert a.node_config_version == 3
    assert a.hooks is not None and a.hooks.prolog == Hook(str(prolog), 20.0)
    assert a.hooks.epilog == Hook("/bin/true", 60.0)  # the node file's, not set by the version
    assert [c.name for c in a.health.checks] == ["memory"]  # type: ignore[union-attr]
    assert a.resources.features == ["local", "ib"] and not a._registered  # registers again
    assert "runs the node configuration of cluster version 3: health:" in caplog.text

    a._learn_node_config({"version": 2, "settings": {}})  # a controller not yet on 3
    assert a.node_config_version == 3 and a.hooks.prolog is not None

    a._learn_node_config({"version": 4, "settings": {"prolog": False}})
    assert a.node_config_version == 4 and a.hooks is not None and a.hooks.prolog is None
    assert a.resources.features == ["local"]
    assert [c.name for c in a.health.checks] == ["gpu", "memory", "kernel_log"]  # type: ignore[union-attr]


def test_a_process_without_the_agents_rules_refuses_node_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from phalanx.config import nodes

    monkeypatch.setattr(nodes, "RULES", {})
    with pytest.raises(ConfigError) as e:
        document_from_toml('[nodes]\nprolog = "/p"')
    assert "nodes.prolog: cannot check node settings in this process" in e.value.message
