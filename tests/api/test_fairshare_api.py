"""Accounts, QOS and limits at submission, and the share and priority routes, in process."""

from __future__ import annotations

from typing import Any

import pytest
from api_auth import as_user
from fairshare_app import JOB
from fastapi.testclient import TestClient


def _submit(c: TestClient, user: str, **kw: Any) -> Any:
    return c.post("/v1/jobs", json={**JOB, **kw}, headers=as_user(user))


def test_the_default_account_and_qos_are_recorded(fs_client: Any) -> None:
    c, _ = fs_client
    r = _submit(c, "alice")
    assert r.status_code == 201, r.text
    job = c.get(f"/v1/jobs/{r.json()['job_id']}", headers=as_user("alice")).json()["jobs"][0]
    assert (job["account"], job["qos"]) == ("bio", "normal")  # her default, the default QOS
    r = _submit(c, "alice", account="hep", qos="urgent")
    assert r.status_code == 201, r.text
    job = c.get(f"/v1/jobs/{r.json()['job_id']}", headers=as_user("alice")).json()["jobs"][0]
    assert (job["account"], job["qos"]) == ("hep", "urgent")


@pytest.mark.parametrize(
    ("user", "body", "status", "words"),
    [
        ("alice", {"account": "chem"}, 422, "account 'chem' does not exist (accounts: bio, "),
        ("bob", {"account": "hep"}, 403, "user bob may not charge account 'hep' (their "),
        ("carol", {}, 403, "user carol is in no account"),
        ("alice", {"qos": "gold"}, 422, "QOS 'gold' does not exist (QOS: normal, urgent)"),
        ("alice", {"nice": -5}, 403, "a negative --nice raises priority and needs the operator"),
    ],
)
def test_refusals_say_what_is_wrong(
    fs_client: Any, user: str, body: dict[str, Any], status: int, words: str
) -> None:
    c, _ = fs_client
    r = _submit(c, user, **body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_submit_limits_refuse_with_slurms_reason(fs_client: Any) -> None:
    c, _ = fs_client
    assert _submit(c, "bob").status_code == 201
    r = _submit(c, "bob")
    assert r.status_code == 422
    assert "AssocMaxSubmitJobLimit (user bob in account bio: 1 pending or running" in r.text
    # hep's group limit counts an array's tasks: 3 at most
    r = _submit(c, "alice", account="hep", array="0-3")
    assert r.status_code == 422 and "AssocGrpSubmitJobsLimit (account hep" in r.text
    assert _submit(c, "alice", account="hep", array="0-2").status_code == 201


def test_share_and_priority_routes(fs_client: Any) -> None:
    c, _ = fs_client
    jid = _submit(c, "alice", qos="urgent", nice=10).json()["job_id"]
    share = c.get("/v1/share", headers=as_user("bob")).json()
    assert share["users"] == 3
    # nobody has used anything: every LF is infinite (null), so every level ties and lists by
    # name (accounts first), and every user shares the top rank
    assert [(r["account"], r["user"]) for r in share["rows"]] == [
        ("bio", None),
        ("bio", "alice"),
        ("bio", "bob"),
        ("default", None),
        ("phys", None),
        ("hep", None),
        ("hep", "alice"),
    ]
    assert {r["level_fs"] for r in share["rows"]} == {None}
    assert {r["fairshare"] for r in share["rows"] if r["user"]} == {1.0}
    p = c.get(f"/v1/jobs/{jid}/priority", headers=as_user("alice")).json()["jobs"][0]
    assert p["factors"]["qos"] == 1.0
    assert p["nice"] == 10
    assert p["priority"] == round(sum(p["products"].values())) - 10
    assert p["explain"][-1].startswith("priority = round(")
    r = c.get(f"/v1/jobs/{jid}/priority", headers=as_user("bob"))
    assert r.status_code == 403


def test_with_no_tree_declared_any_account_is_made_by_naming_it(client: TestClient) -> None:
    """The default configuration declares no account: scripts that name their site's account
    keep working, and the accounts they name share the cluster as top-level accounts."""
    for user, account in (("alice", "physics"), ("bob", "chemistry"), ("carol", None)):
        body = {**JOB, **({"account": account} if account else {})}
        r = client.post("/v1/jobs", json=body, headers=as_user(user))
        assert r.status_code == 201, r.text
    share = client.get("/v1/share", headers=as_user("bob")).json()
    tops = {r["account"] for r in share["rows"] if r["user"] is None and r["depth"] == 0}
    assert tops == {"physics", "chemistry", "default"}
    assert share["users"] == 3
    r = client.post("/v1/jobs", json={**JOB, "account": "root"}, headers=as_user("bob"))
    assert r.status_code == 422 and "'root' is the root of the account tree" in r.text
