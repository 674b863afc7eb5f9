"""Accounts, user associations and QOS in the store (`sacctmgr`), on SQLite and PostgreSQL:
the first import happens once, every change moves the counter and is an event with its actor,
values come back field by field, refusals say what to do, and nothing a pending job charges
can be deleted."""

from __future__ import annotations

from typing import Any

import pytest
from test_store_contract import store, submit1

from phalanx.config import load_config
from phalanx.domain import accounts as acct
from phalanx.errors import Conflict, InvalidSpec, NotFound
from phalanx.store.store import Store

__all__ = ["store"]

FAIRSHARE = {
    "open": False,
    "accounts": [
        {"name": "phys", "shares": 2, "max_gpus": 8},
        {"name": "hep", "parent": "phys", "shares": 1},
    ],
    "users": [
        {"name": "alice", "account": "hep", "max_running_jobs": 3},
        {"name": "alice", "account": "phys"},
    ],
    "qos": [{"name": "urgent", "priority": 100, "max_wall": "4:00:00", "priority_tier": 2}],
}


def first_tree() -> acct.Tree:
    return acct.from_config(load_config(overrides={"fairshare": FAIRSHARE}).fairshare)


def tree(store: Store) -> acct.Tree:
    got = store.accounts_tree()
    assert got is not None
    return got[0]


def acct_events(store: Store) -> list[tuple[str, str]]:
    return [(e["kind"], e["actor"]) for e in store.events() if e["kind"].startswith("acct.")]


def test_the_first_import_happens_once(store: Store) -> None:
    assert store.accounts_version() is None and store.accounts_tree() is None
    assert store.import_accounts(first_tree(), "ctl-a", source="[fairshare] of x.toml")
    assert not store.import_accounts(first_tree(), "ctl-b")  # another controller: no-op
    assert store.accounts_version() == 1
    t = tree(store)
    assert list(t.accounts) == ["phys", "hep", "default"]  # the file's order, default added
    assert t.accounts["phys"].max_gpus == 8 and t.accounts["hep"].parent == "phys"
    assert t.accounts["hep"].organization == "phys"
    assert t.assocs[("hep", "alice")].default  # her first listed
    assert t.assocs[("hep", "alice")].max_running_jobs == 3
    assert not t.assocs[("phys", "alice")].default
    assert t.qos["urgent"].max_wall_s == 4 * 3600 and t.qos["urgent"].priority_tier == 2
    assert set(t.qos) == {"urgent", "normal"}
    assert t.declared and t.digest() == first_tree().digest()
    assert acct_events(store) == [("acct.import", "ctl-a")]


def test_changes_round_trip_field_by_field(store: Store) -> None:
    store.import_accounts(first_tree(), "ctl")
    out = store.change_accounts(
        "add",
        "account",
        names=["bio"],
        settings={"shares": 3, "description": "Biology", "max_running_jobs": 5},
        actor="admin",
    )
    assert [c["text"] for c in out["changes"]] == [
        "account bio added (parent=root, shares=3, description=Biology, max_running_jobs=5, "
        "organization=bio)"
    ]
    assert out["version"] == 2 and store.accounts_version() == 2
    store.change_accounts("add", "user", names=["bob"], accounts=["bio"], actor="admin")
    store.change_accounts(
        "modify",
        "user",
        where={"names": ["bob"]},
        settings={"max_submit_jobs": 2, "max_wall_s": 600, "shares": 4},
        actor="admin",
    )
    store.change_accounts(
        "modify", "account", where={"names": ["bio"]}, settings={"parent": "phys"}, actor="admin"
    )
    store.change_accounts(
        "add", "qos", names=["low"], settings={"priority": 1, "preempt_mode": "requeue"},
        actor="admin",
    )  # fmt: skip
    t = tree(store)
    bio = t.accounts["bio"]
    assert (bio.parent, bio.shares, bio.description, bio.organization) == (
        "phys", 3, "Biology", "bio",
    )  # fmt: skip
    assert (bio.max_running_jobs, bio.max_submit_jobs, bio.max_gpus, bio.max_wall_s) == (
        5, None, None, None,
    )  # fmt: skip
    bob = t.assocs[("bio", "bob")]
    assert (bob.shares, bob.default, bob.max_submit_jobs, bob.max_wall_s) == (4, True, 2, 600)
    low = t.qos["low"]
    assert (low.priority, low.preempt_mode, low.priority_tier) == (1, "requeue", None)
    assert t.version == 6
    kinds = acct_events(store)
    assert kinds[1:] == [("acct.add", "admin")] * 2 + [("acct.modify", "admin")] * 2 + [
        ("acct.add", "admin")
    ]
    # a limit cleared with -1
    store.change_accounts(
        "modify", "user", where={"names": ["bob"]}, settings={"max_submit_jobs": -1},
        actor="admin",
    )  # fmt: skip
    assert tree(store).assocs[("bio", "bob")].max_submit_jobs is None


def test_refusals_say_what_to_do(store: Store) -> None:
    store.import_accounts(first_tree(), "ctl")

    def refused(exc: type[Exception], *a: Any, **kw: Any) -> str:
        with pytest.raises(exc) as e:
            store.change_accounts(*a, actor="admin", **kw)
        return str(e.value)

    assert "Parent account 'nope' doesn't exist" in refused(
        InvalidSpec, "add", "account", names=["x"], settings={"parent": "nope"}
    )
    assert "cycle" in refused(
        InvalidSpec, "modify", "account", where={"names": ["phys"]}, settings={"parent": "hep"}
    )
    assert "shares=0: must be from 1" in refused(
        InvalidSpec, "modify", "account", where={"names": ["phys"]}, settings={"shares": 0}
    )
    assert "max_gpus='lots': not a number" in refused(
        InvalidSpec, "modify", "account", where={"names": ["phys"]}, settings={"max_gpus": "lots"}
    )
    assert "Account 'chem' doesn't exist" in refused(
        InvalidSpec, "add", "user", names=["carol"], accounts=["chem"]
    )
    msg = refused(Conflict, "delete", "account", where={"names": ["phys"]})
    assert "still has users alice and sub-accounts hep" in msg
    assert "sacctmgr delete user where account=phys" in msg
    assert "Nothing new added" in refused(Conflict, "add", "account", names=["phys"])
    assert "Nothing deleted" in refused(NotFound, "delete", "qos", where={"names": ["gold"]})
    assert "fairshare.default_qos" in refused(
        Conflict, "delete", "qos", where={"names": ["normal"]}, keep={"qos": "normal"}
    )
    assert store.accounts_version() == 1  # nothing refused moved the counter
    assert acct_events(store) == [("acct.import", "ctl")]


def test_what_a_pending_job_charges_cannot_be_deleted(store: Store) -> None:
    store.import_accounts(first_tree(), "ctl")
    jid = submit1(store, user="alice", account="phys", qos="urgent")
    with pytest.raises(Conflict) as e:
        store.change_accounts("delete", "user", where={"names": ["alice"]}, actor="admin")
    assert f"Job(s) active, cancel job(s) before remove: job {jid}" in str(e.value)
    with pytest.raises(Conflict):
        store.change_accounts("delete", "qos", where={"names": ["urgent"]}, actor="admin")
    # her other association has no job: it goes, and phys becomes her default
    store.change_accounts(
        "delete", "user", where={"names": ["alice"], "accounts": ["hep"]}, actor="admin"
    )
    t = tree(store)
    assert list(t.assocs) == [("phys", "alice")] and t.assocs[("phys", "alice")].default


def test_a_dry_run_writes_nothing(store: Store) -> None:
    store.import_accounts(first_tree(), "ctl")
    out = store.change_accounts("add", "qos", names=["q1"], actor="admin", dry_run=True)
    assert out["dry_run"] and out["changes"][0]["text"] == "QOS q1 added (description=q1)"
    assert "q1" not in tree(store).qos and store.accounts_version() == 1


def test_a_re_import_replaces_the_tree(store: Store) -> None:
    store.import_accounts(first_tree(), "ctl")
    store.change_accounts("add", "account", names=["bio"], actor="admin")
    assert store.import_accounts(first_tree(), "admin", replace=True)
    t = tree(store)
    assert "bio" not in t.accounts and t.digest() == first_tree().digest()
    assert acct_events(store)[-1] == ("acct.import", "admin")
