"""`/v1/config` in process (controller/config_api.py, controller/confversions.py): admins
only; a check writes nothing; an apply is checked whole and refused with the rule named and
nothing changed, or written with its partitions and taken by the serving controller at once;
a stale base is refused; a rollback is a new version; and a controller whose own settings
cannot run the current version stops taking duties, says why, and runs the next version it
can."""

from __future__ import annotations

import pytest
from api_auth import as_user
from fastapi.testclient import TestClient

from phalanx.config import Config
from phalanx.config.versioned import cluster_document, document_from_toml
from phalanx.controller import confversions
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.store.store import Store

LAYOUT = """
[[cluster.partitions]]
name = "batch"
default = true
nodes = "n[12]"
[[cluster.partitions]]
name = "big"
nodes = "n3"
[priority]
weight_fairshare = 4242
"""


def add_nodes(store: Store, *names: str) -> None:
    for n in names:
        store.register_node(
            n, cpus=2, mem_mb=2048, gpus=[], features=[], addr="127.0.0.1", boot_id="b", version="t"
        )


@pytest.fixture
def versioned(store: Store, ctl: Controller, config: Config) -> Controller:
    """The controller, as `phalanx controller` starts it: version 1 from its file."""
    _running, version = confversions.startup(store, config, ctl.cid)
    ctl.versions.version = version
    store.register_controller(ctl.cid, None)
    add_nodes(store, "n1", "n2", "n3")
    ctl.presence_tick()  # reports the version it runs
    return ctl


def versions(client: TestClient) -> list[int]:
    r = client.get("/v1/config/history")
    assert r.status_code == 200, r.text
    return [v["version"] for v in r.json()["versions"]]


def test_only_admins(client: TestClient, versioned: Controller) -> None:
    for who in (as_user("alice"), as_user("op", "operator")):
        assert client.get("/v1/config", headers=who).status_code == 403
        r = client.post("/v1/config/apply", json={"text": LAYOUT}, headers=who)
        assert r.status_code == 403
    assert versions(client) == [1]


def test_check_apply_and_rollback(client: TestClient, versioned: Controller) -> None:
    ctl = versioned
    shown = client.get("/v1/config").json()
    assert shown["version"] == 1 and shown["action"] == "create"
    assert shown["controllers"][0]["config_version"] == 1
    checked = client.post("/v1/config/check", json={"text": LAYOUT}).json()
    assert checked["problems"] == [] and checked["current_version"] == 1
    assert '+name = "big"' in checked["diff"]
    assert checked["changed"] == ["cluster.partitions", "priority.weight_fairshare"]
    assert versions(client) == [1]  # a check writes nothing

    r = client.post("/v1/config/apply", json={"text": LAYOUT, "base_version": 1, "comment": "big"})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2
    # the serving controller runs it at once: partitions, leases, weights
    assert ctl.versions.version == 2 and ctl.status()["config_version"] == 2
    assert ctl.partition_names == ["batch", "big"]
    assert "sched:big" in ctl.leases.names
    assert ctl.fairshare.weights.fairshare == 4242
    assert sorted(ctl.store.partitions()) == ["batch", "big"]
    (ev,) = [e for e in ctl.store.events(limit=100) if e["kind"] == "config.apply"]
    assert ev["actor"] == "admin"  # the admin who applied (tests/api/api_auth.py)
    assert "cluster.partitions, priority.weight_fairshare (big)" in ev["message"]

    # applying against a version that is no longer current is refused
    stale = client.post("/v1/config/apply", json={"text": "", "base_version": 1})
    assert stale.status_code == 409, stale.text
    assert versions(client) == [2, 1]

    back = client.post("/v1/config/rollback", json={})
    assert back.status_code == 200, back.text
    assert (back.json()["version"], back.json()["restored"]) == (3, 1)
    assert ctl.versions.version == 3 and ctl.partition_names == ["batch", "long"]
    assert sorted(ctl.store.partitions()) == ["batch", "long"]
    one = client.get("/v1/config/3").json()
    assert (one["action"], one["source"]) == ("rollback", 1)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("[timing]\nlease_ttl = 1.0\nrenew_interval = 0.5\n", "renew_interval * 3 <= lease_ttl"),
        (
            '[[cluster.partitions]]\nname = "batch"\n[[cluster.partitions]]\nname = "x"\n'
            'nodes = "zz*"\n',
            "rule: every partition has at least one node",
        ),
        ('[cluster]\nlicenses = "fluent:x"\n', "cluster"),
        ("[nonsense", "not valid TOML"),
    ],
)
def test_a_bad_version_is_refused_and_nothing_changes(
    client: TestClient, versioned: Controller, text: str, rule: str
) -> None:
    r = client.post("/v1/config/apply", json={"text": text})
    assert r.status_code == 422, r.text
    assert rule in r.json()["error"]["message"]
    assert versions(client) == [1]
    assert versioned.versions.version == 1
    assert sorted(versioned.store.partitions()) == ["batch", "long"]


def test_a_controller_that_cannot_run_a_version_takes_no_duties(
    store: Store, config: Config
) -> None:
    """Controller B's own db_op_timeout breaks a lease rule with the version A applied: B
    hands its leases back, takes none, skips scheduling passes and says why; the next version
    it can run puts it back to work."""
    confversions.startup(store, config, "a")
    local = config.model_copy(
        update={"timing": config.timing.model_copy(update={"db_op_timeout": 2.0})}
    )
    b = Controller(store, config, cid="b", local_config=local, config_version=1)
    store.register_controller("b", None)
    assert "took term" in b.leases.tick()
    tight, _ = document_from_toml(
        "[timing]\nlease_ttl = 2.4\nrenew_interval = 0.5\n",
        local=Config.model_validate({"timing": {"db_op_timeout": 1.0}}),
    )
    cur = store.config_current()
    assert cur is not None
    store.config_put(
        {**cur["document"], "timing": tight["timing"]},
        actor="alice",
        action="apply",
        base_version=1,
        partitions=partition_rows(config),
        message="tight leases",
    )
    said = b.versions.presence()
    assert "cannot run cluster configuration version 2" in said
    assert "renew_interval + db_op_timeout < lease_ttl" in said
    assert b.leases.terms() == {} and b.leases.names == []
    assert b.leases.tick() == "leases unchanged"  # takes none
    assert not b.versions.runs(2)
    row = next(r for r in store.list_controllers() if r["id"] == "b")
    assert row["config_version"] == 1 and "cannot run" in row["config_problem"]
    assert any(e["kind"] == "config.refused" for e in store.events(limit=100))
    assert b.status()["config_problem"]
    # a version it can run: back to work
    store.config_put(
        cluster_document(config),
        actor="alice",
        action="rollback",
        base_version=2,
        partitions=partition_rows(config),
        message="back",
        source=1,
    )
    assert "runs cluster configuration version 3" in b.versions.presence()
    assert b.versions.problem is None and b.versions.runs(3)
    assert "took term" in b.leases.tick()
    row = next(r for r in store.list_controllers() if r["id"] == "b")
    assert (row["config_version"], row["config_problem"]) == (3, None)


def test_at_start_the_store_version_wins_over_a_different_file(
    store: Store, config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """Version 1 comes from the first controller's file; a controller whose file differs
    later starts with the store's version (and its own process-local settings) and warns."""
    _, v1 = confversions.startup(store, config, "a")
    assert v1 == 1
    other = config.model_copy(
        update={
            "priority": config.priority.model_copy(update={"weight_age": 1}),
            "http": config.http.model_copy(update={"max_connections": 77}),
        }
    )
    with caplog.at_level("WARNING", logger="phalanx.controller"):
        running, version = confversions.startup(store, other, "b")
    assert version == 1
    assert running.priority.weight_age == config.priority.weight_age  # the store's
    assert running.http.max_connections == 77  # its own
    assert "differs from the store's cluster configuration version 1 in priority.weight_age" in (
        caplog.text
    )
    assert "phalanx config apply FILE" in caplog.text
    assert [v["version"] for v in store.config_history()] == [1]


def test_a_key_added_by_a_later_release_is_no_difference_at_start(
    store: Store, config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """A version stored before a key existed (here timing.reservation_overrun) means its
    default: a file that leaves it at the default does not differ, one that sets it does."""
    doc = cluster_document(config)
    del doc["timing"]["reservation_overrun"]  # as a release before it stored version 1
    store.config_first(doc, actor="old", partitions=partition_rows(config))
    with caplog.at_level("WARNING", logger="phalanx.controller"):
        running, version = confversions.startup(store, config, "a")
    assert version == 1 and running.timing.reservation_overrun == 0.0
    assert "differs from the store's" not in caplog.text
    later = config.model_copy(
        update={"timing": config.timing.model_copy(update={"reservation_overrun": "UNLIMITED"})}
    )
    with caplog.at_level("WARNING", logger="phalanx.controller"):
        confversions.startup(store, later, "b")
    assert "version 1 in timing.reservation_overrun" in caplog.text


def test_a_version_another_live_controller_cannot_run_is_refused(
    client: TestClient, versioned: Controller, config: Config
) -> None:
    """Controller b publishes its own watchdog settings when it registers; a version whose
    renew_interval its store_timeout does not allow is refused, naming b and the rule, though
    the serving controller could run it; a controller of an older release (no settings) is
    named as not checked."""
    from phalanx.config.versioned import local_part, to_toml

    b = config.model_copy(
        update={"watchdog": config.watchdog.model_copy(update={"store_timeout": 2.9})}
    )
    versioned.store.register_controller("b", None, local_part(b))
    text = to_toml(cluster_document(config)).replace(
        "renew_interval = 0.75", "renew_interval = 0.95"
    )  # 0.95 + 2.0 < lease_ttl 3 for everyone; store_timeout 2.9 > 0.95 + 2.0 is not
    r = client.post("/v1/config/check", json={"text": text})
    assert r.status_code == 200, r.text
    (problem,) = r.json()["problems"]
    assert "controller b could not run it with its own settings" in problem, problem
    assert "watchdog.store_timeout > timing.renew_interval + timing.db_op_timeout" in problem
    assert r.json()["unchecked_controllers"] == []
    r = client.post("/v1/config/apply", json={"text": text, "base_version": 1})
    assert r.status_code == 422 and "controller b could not run it" in r.text, r.text
    assert versions(client) == [1]

    # b's settings allow 0.85; a controller that did not say its own is not checked
    versioned.store.register_controller("old", None)
    text = text.replace("renew_interval = 0.95", "renew_interval = 0.85")
    r = client.post("/v1/config/check", json={"text": text})
    assert r.json()["problems"] == [] and r.json()["unchecked_controllers"] == ["old"], r.text
    r = client.post("/v1/config/apply", json={"text": text, "base_version": 1})
    assert r.status_code == 200, r.text
    assert versions(client) == [2, 1]
