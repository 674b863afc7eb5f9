"""The cluster-wide part of the configuration (config/versioned.py): which sections it holds,
its TOML form read back unchanged, a process's own settings kept when a version is put in
force, every loading rule applied to a version, its diff and changed keys, and the checks of a
new version against the live cluster, each naming its rule."""

from __future__ import annotations

import tomllib

import pytest

from phalanx.config import Config, ConfigError
from phalanx.config.versioned import (
    CLUSTER_SECTIONS,
    OPTIONAL_SECTIONS,
    changed_keys,
    cluster_document,
    cross_check,
    document_from_toml,
    documents_equal,
    local_part,
    to_toml,
    unified_diff,
    with_document,
    with_local_part,
)

RICH = """
[cluster]
licenses = {fluent = 30, matlab = 5}
queue_depth = 500

[[cluster.partitions]]
name = "batch"
default = true
nodes = "node*"
max_time = "2-00:00:00"

[[cluster.partitions]]
name = "gpu"
nodes = "gpu[0-9]*, big*"
priority = 10
priority_tier = 2
preempt_mode = "cancel"

[topology]
levels = ["switch", "rack"]

[[topology.nodes]]
nodes = "node0*"
switch = "sw1"
rack = "r1"

[priority]
weight_fairshare = 50000
usage_half_life = "0"

[timing]
heartbeat_interval = 0.5
db_op_timeout = 1.5

[auth]
admins = ["alice"]

[http]
max_connections = 100

[fairshare]
default_account = "physics"
"""


def test_the_document_holds_the_cluster_wide_sections_only() -> None:
    doc = cluster_document(Config())
    # `[nodes]` only when it sets something (config/nodes.py)
    assert tuple(doc) == tuple(s for s in CLUSTER_SECTIONS if s not in OPTIONAL_SECTIONS)
    assert "db_op_timeout" not in doc["timing"]  # how long this process waits for its database
    for local in ("auth", "http", "limits", "metrics", "watchdog", "steps", "fairshare"):
        assert local not in doc


def test_a_file_gives_its_cluster_wide_sections_and_names_what_it_leaves() -> None:
    doc, ignored = document_from_toml(RICH)
    assert ignored == ["auth", "fairshare", "http", "timing.db_op_timeout"]
    assert [p["name"] for p in doc["cluster"]["partitions"]] == ["batch", "gpu"]
    assert doc["priority"]["weight_fairshare"] == 50000
    assert doc["timing"]["heartbeat_interval"] == 0.5
    # complete: the defaults are written out, so a version means the same in later releases
    assert doc["retry"]["max_retries"] == 5
    assert doc["timing"]["lease_ttl"] == 3.0


@pytest.mark.parametrize("text", ["", RICH])
def test_the_toml_form_reads_back_as_the_same_document(text: str) -> None:
    doc, _ = document_from_toml(text)
    shown = to_toml(doc)
    tomllib.loads(shown)  # valid TOML
    again, ignored = document_from_toml(shown)
    assert ignored == []
    assert again == doc
    assert documents_equal(again, doc)


def test_a_broken_timing_rule_is_refused_naming_the_rule() -> None:
    with pytest.raises(ConfigError) as e:
        document_from_toml("[timing]\nlease_ttl = 1.0\nrenew_interval = 0.5\n", "new.toml")
    assert "invalid configuration in new.toml" in e.value.message
    assert "renew_interval * 3 <= lease_ttl" in e.value.message


def test_a_bad_partition_is_refused_as_loading_refuses_it() -> None:
    text = '[[cluster.partitions]]\nname = "a"\n[[cluster.partitions]]\nname = "a"\n'
    with pytest.raises(ConfigError, match="partition names must be unique"):
        document_from_toml(text)


def test_a_version_in_force_keeps_the_process_own_settings() -> None:
    local = Config.model_validate(
        {"timing": {"db_op_timeout": 0.5}, "http": {"max_connections": 99}}
    )
    doc, _ = document_from_toml(RICH)
    merged = with_document(local, doc)
    assert merged.http.max_connections == 99
    assert merged.timing.db_op_timeout == 0.5
    assert merged.timing.heartbeat_interval == 0.5
    assert [p.name for p in merged.cluster.partitions] == ["batch", "gpu"]
    assert cluster_document(merged) == doc


def test_a_version_that_breaks_a_rule_with_this_process_settings_is_refused() -> None:
    """renew_interval + db_op_timeout < lease_ttl spans both parts: a version that suits
    one controller's database deadline may not suit another's."""
    mine = Config.model_validate({"timing": {"db_op_timeout": 1.0}})
    text = "[timing]\nlease_ttl = 2.4\nrenew_interval = 0.5\n"
    with pytest.raises(ConfigError):  # the default db_op_timeout, 2 s, breaks it
        document_from_toml(text)
    doc, _ = document_from_toml(text, local=mine)
    with_document(mine, doc)
    local = Config.model_validate(
        {"timing": {"db_op_timeout": 2.0, "lease_ttl": 6.0, "renew_interval": 1.0}}
    )
    with pytest.raises(ConfigError, match="renew_interval \\+ db_op_timeout < lease_ttl"):
        with_document(local, doc, "cluster configuration version 2")


def test_another_process_is_checked_by_the_values_its_rules_read() -> None:
    """What a controller publishes of its own file (the values rules across sections read),
    and a version held to them: accepted as with_document would, refused naming the rule."""
    mine = Config.model_validate(
        {"timing": {"db_op_timeout": 1.5}, "watchdog": {"store_timeout": 2.5}, "http": {}}
    )
    part = local_part(mine)
    assert part["timing"] == {"db_op_timeout": 1.5}
    assert part["watchdog"]["store_timeout"] == 2.5 and "loop_timeout" in part["watchdog"]
    doc = cluster_document(Config())
    assert with_local_part(part, doc).timing.db_op_timeout == 1.5
    slower = {**doc, "timing": {**doc["timing"], "renew_interval": 1.0}}  # 1 + 1.5 = 2.5
    with pytest.raises(ConfigError, match=r"watchdog.store_timeout > timing.renew_interval"):
        with_local_part(part, slower, "version 2")
    # the same version with this process's settings: with_document agrees
    with pytest.raises(ConfigError, match=r"watchdog.store_timeout > timing.renew_interval"):
        with_document(mine, slower)


def test_the_diff_and_the_changed_keys() -> None:
    old, _ = document_from_toml("")
    new, _ = document_from_toml("[priority]\nweight_age = 7\n[retry]\nmax_retries = 1\n")
    diff = unified_diff(old, new, "version 1", "new.toml")
    assert diff.startswith("--- version 1\n+++ new.toml\n")
    assert "-weight_age = 1000\n" in diff and "+weight_age = 7\n" in diff
    assert changed_keys(old, new) == ["retry.max_retries", "priority.weight_age"]
    assert unified_diff(old, old, "a", "b") == ""
    assert changed_keys(old, old) == []


def _cfg(text: str) -> Config:
    doc, _ = document_from_toml(text)
    return with_document(Config(), doc)


TWO = """
[[cluster.partitions]]
name = "batch"
default = true
nodes = "node*"
[[cluster.partitions]]
name = "gpu"
nodes = "gpu*"
"""


def test_live_checks_accept_a_layout_the_cluster_can_run() -> None:
    assert (
        cross_check(
            _cfg(TWO),
            _cfg(""),
            nodes=["node01", "gpu01"],
            node_count=2,
            licenses_in_use={},
            active_by_partition={"batch": 3},
        )
        == []
    )


def test_live_checks_refuse_a_partition_with_no_node() -> None:
    problems = cross_check(
        _cfg(TWO),
        None,
        nodes=["node01", "node02"],
        node_count=2,
        licenses_in_use={},
        active_by_partition={},
    )
    assert len(problems) == 1
    assert problems[0].startswith("partition gpu: no node of the cluster matches nodes = 'gpu*'")
    assert "rule: every partition has at least one node" in problems[0]


def test_live_checks_refuse_removing_a_partition_with_jobs_and_licences_below_use() -> None:
    new = _cfg('[cluster]\nlicenses = "fluent:2"\n')
    problems = cross_check(
        new,
        _cfg(TWO),
        nodes=["node01"],
        node_count=1,
        licenses_in_use={"fluent": 3, "matlab": 1},
        active_by_partition={"gpu": 2, "batch": 1},
    )
    assert any(p.startswith("partition gpu: 2 job(s) not yet ended") for p in problems)
    assert any("fluent = 2 is below the 3 in use" in p for p in problems)
    assert any("matlab = 0 is below the 1 in use" in p for p in problems)
    assert all("rule:" in p for p in problems)


def test_live_checks_hold_the_timings_to_their_rules_at_the_cluster_size() -> None:
    """The heartbeat rule scales heartbeat_interval, fence_timeout and node_down_timeout with
    the node count: a version whose scaled timings pass a limit is refused for this cluster."""
    new = _cfg("[timing]\nheartbeat_budget = 1\nnode_down_timeout = 1000\nfence_timeout = 500\n")
    problems = cross_check(
        new, None, nodes=[], node_count=10_000, licenses_in_use={}, active_by_partition={}
    )
    assert len(problems) == 1
    assert problems[0].startswith("timing: scaled for the cluster's 10000 nodes")
    assert (
        cross_check(new, None, nodes=[], node_count=1, licenses_in_use={}, active_by_partition={})
        == []
    )


def test_live_checks_refuse_renaming_the_cluster() -> None:
    problems = cross_check(
        _cfg('[cluster]\nname = "other"\n'),
        _cfg(""),
        nodes=[],
        node_count=0,
        licenses_in_use={},
        active_by_partition={},
    )
    assert problems and problems[0].startswith("cluster.name: 'phalanx' cannot change")
