"""The torchrun rendezvous the controllers host (controller/rendezvous_api.py), in process:
compare-and-set of the state on its token (a repeat changes nothing), the round's key-value
store, the members on nodes that left a --no-kill job (`departed`), and who may use it: the
job's owner while the job runs."""

from __future__ import annotations

import base64
from typing import Any

from api_auth import as_user
from fastapi.testclient import TestClient
from test_api import USER, Agent, error_of, submit

from phalanx.controller.runtime import Controller

ALICE = USER
BOB = as_user("bob")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def start_job(client: TestClient, ctl: Controller, n: int = 1, **spec: Any) -> int:
    agents = [Agent(client, f"n{i}") for i in range(1, n + 1)]
    for a in agents:
        a.register()
    (jid,) = submit(client, **spec)
    ctl.leases.tick()
    assert ctl.schedule_tick().startswith("started 1 jobs")
    for a in agents:
        for start in a.heartbeat()["start"]:
            a.heartbeat([Agent.report(start, "running")])
    return jid


def state_url(jid: int, run: str = "run1") -> str:
    return f"/v1/jobs/{jid}/rendezvous/{run}/state"


def test_the_state_is_set_only_on_the_current_token(client: TestClient, ctl: Controller) -> None:
    jid = start_job(client, ctl)
    got = client.get(state_url(jid), headers=ALICE).json()
    assert got == {"state": None, "token": None, "departed": []}
    first = client.put(state_url(jid), json={"state": b64(b"s1")}, headers=ALICE).json()
    assert first["set"] is True and first["state"] == b64(b"s1")
    token = first["token"]
    # a second "create" loses: the state now comes back
    again = client.put(state_url(jid), json={"state": b64(b"other")}, headers=ALICE).json()
    assert again == {"state": b64(b"s1"), "token": token, "set": False, "departed": []}
    body = {"state": b64(b"s2"), "token": token}
    second = client.put(state_url(jid), json=body, headers=ALICE).json()
    assert second["set"] is True and second["token"] != token
    # the same request repeated (its answer lost, sent to another controller): no change
    repeat = client.put(state_url(jid), json=body, headers=ALICE).json()
    assert repeat["set"] is False and repeat["state"] == b64(b"s2")
    assert repeat["token"] == second["token"]
    # another rendezvous id of the job is another state
    assert client.get(state_url(jid, "run2"), headers=ALICE).json()["state"] is None


def test_the_key_value_store_of_a_round(client: TestClient, ctl: Controller) -> None:
    jid = start_job(client, ctl)
    kv = f"/v1/jobs/{jid}/rendezvous/run1/kv"

    def call(**body: Any) -> dict[str, Any]:
        r = client.post(kv, json=body, headers=ALICE)
        assert r.status_code == 200, r.text
        return dict(r.json())

    call(op="set", keys=["a", "b"], values=[b64(b"1"), b64(b"\x00\xff")])
    assert call(op="get", keys=["a", "b", "c"])["values"] == {"a": b64(b"1"), "b": b64(b"\x00\xff")}
    assert call(op="add", keys=["n"], delta=1)["value"] == 1
    assert call(op="add", keys=["n"], delta=2)["value"] == 3
    assert call(op="count")["count"] == 3
    assert call(op="delete", keys=["a"])["deleted"] is True
    assert call(op="delete", keys=["a"])["deleted"] is False
    # the state is no key of the store, nor the reverse
    assert client.get(state_url(jid), headers=ALICE).json()["state"] is None
    error_of(client.post(kv, json={"op": "set", "keys": ["x"], "values": []}, headers=ALICE))
    error_of(client.post(kv, json={"op": "add", "keys": ["b"], "delta": 1}, headers=ALICE), 409)


def test_only_the_owner_of_a_running_job_may_use_it(client: TestClient, ctl: Controller) -> None:
    jid = start_job(client, ctl)
    r = client.get(state_url(jid), headers=BOB)
    assert r.status_code == 403, r.text
    error_of(client.get(f"/v1/jobs/{jid}/rendezvous/bad%20id/state", headers=ALICE))
    client.post("/v1/jobs/cancel", json={"jobs": [str(jid)]}, headers=ALICE)
    r = client.get(state_url(jid), headers=ALICE)
    assert r.status_code == 409, r.text


def test_members_on_a_node_that_left_are_departed(client: TestClient, ctl: Controller) -> None:
    jid = start_job(client, ctl, 3, nodes=2, spares=1, no_kill=True, requeue=True)
    first = client.put(
        state_url(jid), json={"state": b64(b"s"), "desc": "h_10_0", "node": "n1"}, headers=ALICE
    ).json()
    client.put(
        state_url(jid),
        json={"state": b64(b"s2"), "token": first["token"], "desc": "h_20_0", "node": "n2"},
        headers=ALICE,
    )
    assert client.get(state_url(jid), headers=ALICE).json()["departed"] == []
    assert ctl.store.mark_down("n2", "no heartbeat", None)
    got = client.get(state_url(jid), headers=ALICE).json()
    assert got["departed"] == ["h_20_0"] and got["state"] == b64(b"s2")
