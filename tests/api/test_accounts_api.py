"""Accounts, users and QOS at run time, in process: a change through the API takes effect on
the next submission and the next pass (no restart), only admins change, every change is an
event with its actor, and the first import of [fairshare] happened once."""

from __future__ import annotations

from typing import Any

from api_auth import ADMIN, as_user
from fairshare_app import JOB
from fastapi.testclient import TestClient

from phalanx.controller.runtime import Controller
from phalanx.store.store import Store


def submit(c: TestClient, user: str, **kw: Any) -> Any:
    return c.post("/v1/jobs", json={**JOB, **kw}, headers=as_user(user))


def test_a_user_added_at_run_time_submits_at_once(fs_client: Any) -> None:
    c, ctl = fs_client
    r = submit(c, "carol")
    assert r.status_code == 403 and "sacctmgr add user carol account=ACCOUNT" in r.text
    body = {"kind": "user", "names": ["carol"], "accounts": ["bio"]}
    r = c.post("/v1/accounts/add", json=body, headers=as_user("alice"))
    assert r.status_code == 403 and "needs the admin role" in r.text
    r = c.post("/v1/accounts/add", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["changes"][0]["text"] == "user carol in account bio added"
    r = submit(c, "carol")
    assert r.status_code == 201, r.text
    job = c.get(f"/v1/jobs/{r.json()['job_id']}", headers=ADMIN).json()["jobs"][0]
    assert job["account"] == "bio"
    # a submit limit set now applies to her next job
    r = c.post(
        "/v1/accounts/modify",
        json={"kind": "user", "where": {"names": ["carol"]}, "settings": {"max_submit_jobs": 1}},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    r = submit(c, "carol")
    assert r.status_code == 422 and "AssocMaxSubmitJobLimit (user carol in account bio" in r.text
    # she cannot be deleted while her job is pending
    r = c.post("/v1/accounts/delete", json={"kind": "user", "where": {"names": ["carol"]}},
               headers=ADMIN)  # fmt: skip
    assert r.status_code == 409 and "Job(s) active" in r.text
    kinds = [(e["kind"], e["actor"]) for e in ctl.store.events() if e["kind"].startswith("acct.")]
    assert kinds == [("acct.import", "t"), ("acct.add", "admin"), ("acct.modify", "admin")]


def test_accounts_added_at_run_time_are_ranked(fs_client: Any) -> None:
    c, _ = fs_client
    r = c.post("/v1/accounts/add", json={"kind": "account", "names": ["chem"],
               "settings": {"parent": "phys", "shares": 5}}, headers=ADMIN)  # fmt: skip
    assert r.status_code == 200, r.text
    c.post("/v1/accounts/add", json={"kind": "user", "names": ["dan"], "accounts": ["chem"]},
           headers=ADMIN)  # fmt: skip
    rows = c.get("/v1/share", headers=as_user("dan")).json()["rows"]
    chem = next(r for r in rows if r["account"] == "chem" and r["user"] is None)
    assert chem["raw_shares"] == 5 and chem["depth"] == 1
    assert any(r["user"] == "dan" and r["account"] == "chem" for r in rows)
    listed = c.get("/v1/accounts", headers=as_user("dan")).json()
    assert [a["name"] for a in listed["accounts"]][-1] == "chem"
    assert listed["default_account"] == "default" and listed["open"] is False


def test_a_qos_added_at_run_time_is_usable_and_refusals_say_what_to_do(fs_client: Any) -> None:
    c, _ = fs_client
    assert submit(c, "alice", qos="gold").status_code == 422
    r = c.post("/v1/accounts/add", json={"kind": "qos", "names": ["gold"],
               "settings": {"priority": 50}}, headers=ADMIN)  # fmt: skip
    assert r.status_code == 200, r.text
    assert submit(c, "alice", qos="gold").status_code == 201
    bad = [
        ({"kind": "account", "names": ["x"], "settings": {"parent": "nope"}}, 422,
         "Parent account 'nope' doesn't exist"),
        ({"kind": "account", "names": ["x"], "settings": {"shares": -1}}, 422,
         "shares=-1: must be from 1"),
        ({"kind": "account", "names": ["x"], "settings": {"max_gpus": "many"}}, 422,
         "not a number"),
    ]  # fmt: skip
    for body, status, words in bad:
        r = c.post("/v1/accounts/add", json=body, headers=ADMIN)
        assert r.status_code == status and words in r.text, r.text
    r = c.post("/v1/accounts/delete", json={"kind": "account", "where": {"names": ["bio"]}},
               headers=ADMIN)  # fmt: skip
    assert r.status_code == 409 and "still has users alice, bob" in r.text


def test_another_controller_sees_a_change_at_its_next_pass(fs_client: Any) -> None:
    c, ctl = fs_client
    other = Controller(Store(ctl.store.db.url, actor="t2"), ctl.config, cid="t2")
    try:
        snap = other.store.sched_snapshot(eligible_by=0)
        assert other.fairshare.policy(snap).qos_priority["urgent"] == 100
        r = c.post(
            "/v1/accounts/modify",
            json={"kind": "qos", "where": {"names": ["urgent"]}, "settings": {"priority": 7}},
            headers=ADMIN,
        )
        assert r.status_code == 200, r.text
        # the other controller's next pass reads the moved counter, then the new tree
        assert other.fairshare.policy(snap).qos_priority["urgent"] == 7
        # and its submit path re-checks before refusing someone it does not know yet
        c.post("/v1/accounts/add", json={"kind": "user", "names": ["erin"], "accounts": ["bio"]},
               headers=ADMIN)  # fmt: skip
        assert other.fairshare.resolve("erin", None, None) == ("bio", "normal")
    finally:
        other.store.close()
