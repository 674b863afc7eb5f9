"""Private job fields stay private in every view another user can read (auth.private_data):
a node's page and events (GET /v1/nodes/NAME, `phalanx show node`), the node list and its
drain reasons (GET /v1/nodes, `sinfo -R`), and the node history `phalanx explain` quotes.

The leaks were: a checkpoint's path in the `job.checkpoint` event of a node, and a launch
error naming another user's files in the reason of a node Phalanx drained."""

from __future__ import annotations

from typing import Any

from api_auth import as_user
from sqlalchemy import update
from test_access_table import cluster  # an app per call, with config overrides
from test_api import Agent, run_to_start

from phalanx.store import schema as s

ALICE, BOB, OPS = as_user("alice"), as_user("bob"), as_user("ops", "operator")
SECRET = "/home/alice/project-x"
ERROR = f"cannot open output file {SECRET}/out.log: No such file or directory"


__all__ = ["cluster"]


def poison(c: Any, ctl: Any) -> int:
    """Alice's job checkpointed on n1, and n1 drained by Phalanx after her launch failed."""
    r = c.post("/v1/jobs", json={"argv": ["/bin/true"], "time_limit_s": 60}, headers=ALICE)
    jid = int(r.json()["job_id"])
    ckpt = f"{SECRET}/ckpt-0003"
    ctl.store.add_event(
        "job.checkpoint",
        f"checkpoint {ckpt} took 2.0s (restart 0, n1)",
        job_id=jid,
        node="n1",
        data={"path": ckpt},
    )
    reason = f"3 launch failures in a row, last: {ERROR}"
    with ctl.store.db.begin() as conn:
        conn.execute(
            update(s.nodes)
            .where(s.nodes.c.name == "n1")
            .values(drain=True, drain_by="phalanx", drain_reason=reason)
        )
    ctl.store.add_event("node.drain", f"drained by phalanx: {reason}", node="n1")
    return jid


def test_another_users_node_page_shows_no_private_field(cluster: Any) -> None:
    c, ctl = cluster()
    jid = poison(c, ctl)
    for path in ("/v1/nodes/n1", "/v1/nodes"):
        r = c.get(path, headers=BOB)
        assert r.status_code == 200
        assert SECRET not in r.text, (path, r.text)
    page = c.get("/v1/nodes/n1", headers=BOB).json()
    assert page["drain_reason"].startswith("3 launch failures in a row (the last error is shown")
    (ev,) = [e for e in page["events"] if e["job_id"] == jid]
    assert ev["kind"] == "job.checkpoint" and ev["private"] and ev["data"] is None
    assert f"job {jid} is alice's" in ev["message"]
    drain = next(e for e in page["events"] if e["kind"] == "node.drain")
    assert drain["message"].startswith("drained by phalanx: 3 launch failures in a row")


def test_owners_and_operators_see_what_is_theirs_to_see(cluster: Any) -> None:
    c, ctl = cluster()
    jid = poison(c, ctl)
    mine = c.get("/v1/nodes/n1", headers=ALICE).json()
    (ev,) = [e for e in mine["events"] if e["job_id"] == jid]
    assert SECRET in ev["message"] and ev["data"]["path"].startswith(SECRET)
    for who in (OPS, as_user("root", "admin")):
        page = c.get("/v1/nodes/n1", headers=who).json()
        assert ERROR in page["drain_reason"]
        assert sum(SECRET in str(e) for e in page["events"]) == 2


def test_without_private_data_everyone_sees_everything(cluster: Any) -> None:
    c, ctl = cluster(auth={"private_data": False})
    poison(c, ctl)
    page = c.get("/v1/nodes/n1", headers=BOB).json()
    assert ERROR in page["drain_reason"]
    assert sum(SECRET in str(e) for e in page["events"]) == 2


def test_explain_quotes_a_nodes_drain_without_another_users_launch_error(cluster: Any) -> None:
    c, ctl = cluster()
    agent = Agent(c, "n1")
    r = c.post("/v1/jobs", json={"argv": ["/bin/true"], "time_limit_s": 60}, headers=BOB)
    jid = int(r.json()["job_id"])
    for other in ("n2",):  # only n1 can take it
        c.post(f"/v1/nodes/{other}/drain", json={"reason": "test"})
    start = run_to_start(ctl, agent)
    poison(c, ctl)
    agent.heartbeat([Agent.report(start, "exited", exit_code=1)])
    out = c.get(f"/v1/jobs/{jid}/explain", headers=BOB)
    assert out.status_code == 200, out.text
    assert SECRET not in out.text, out.text
    assert "drained by phalanx: 3 launch failures" in out.text, out.text
    ops = c.get(f"/v1/jobs/{jid}/explain", headers=OPS).text
    assert SECRET in ops
