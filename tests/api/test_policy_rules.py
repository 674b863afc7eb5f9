"""Fair rules between users: what a submission costs of the rate limit (an array each of its
tasks), who may release a hold (an operator's hold is an admin hold, as in Slurm), and who
may raise a job above others (--priority > 0, a negative --nice: operators and admins, on
submission and on update)."""

from __future__ import annotations

from typing import Any

import pytest
from api_auth import ADMIN, as_user
from test_access_table import JOB, cluster  # an app per call, with config overrides

ALICE = as_user("alice")
OPS = as_user("ops", "operator")
TINY = {"api_rate": 0.001, "api_burst": 100, "submit_rate": 0.001, "submit_burst": 4}


__all__ = ["cluster"]


# ------------------------------------------------------------------ rate limits count work


@pytest.mark.parametrize("query", ["", "?test_only=true"], ids=["fast path", "route"])
def test_an_array_costs_one_token_per_task(cluster: Any, query: str) -> None:
    c, ctl = cluster(limits=TINY)
    r = c.post("/v1/jobs" + query, json={**JOB, "array": "0-2"}, headers=ALICE)
    assert r.status_code == 201, r.text
    r = c.post("/v1/jobs" + query, json={**JOB, "array": "0-1"}, headers=ALICE)  # 1 left
    assert r.status_code == 429, r.text
    assert "job submission rate limit" in r.json()["error"]["message"]
    assert c.post("/v1/jobs" + query, json=JOB, headers=ALICE).status_code == 201
    assert c.post("/v1/jobs" + query, json=JOB, headers=ALICE).status_code == 429
    if not query:
        assert len(ctl.store.list_jobs()) == 4


def test_a_batch_counts_its_arrays_tasks(cluster: Any) -> None:
    c, ctl = cluster(limits=TINY)
    body = {"jobs": [JOB, {**JOB, "array": "0-2"}]}  # 4 jobs in the queue: the whole burst
    assert c.post("/v1/jobs/batch", json=body, headers=ALICE).status_code == 201
    assert c.post("/v1/jobs", json=JOB, headers=ALICE).status_code == 429
    assert len(ctl.store.list_jobs()) == 4


def test_an_array_larger_than_the_burst_says_so_and_what_to_raise(cluster: Any) -> None:
    c, ctl = cluster(limits=TINY)
    assert c.post("/v1/jobs", json=JOB, headers=ALICE).status_code == 201  # the bucket not full
    r = c.post("/v1/jobs", json={**JOB, "array": "0-9"}, headers=ALICE)
    assert r.status_code == 429, r.text
    msg = r.json()["error"]["message"]
    assert "counts 10" in msg and "more than a whole burst" in msg
    assert "limits.submit_burst" in msg
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["details"]["cost"] == 10
    assert len(ctl.store.list_jobs()) == 1


def test_an_array_larger_than_the_burst_goes_from_a_full_bucket_and_leaves_a_debt(
    cluster: Any,
) -> None:
    """As Slurm takes an array up to MaxArraySize as one submission: it is not refused for
    good, but it is no way around the limit either."""
    c, ctl = cluster(limits=TINY)
    assert c.post("/v1/jobs", json={**JOB, "array": "0-9"}, headers=ALICE).status_code == 201
    assert len(ctl.store.list_jobs()) == 10
    r = c.post("/v1/jobs", json=JOB, headers=ALICE)
    assert r.status_code == 429 and "Retry-After" in r.headers


def test_an_invalid_array_costs_nothing(cluster: Any) -> None:
    c, _ = cluster(limits=TINY)
    for _ in range(6):
        r = c.post("/v1/jobs", json={**JOB, "array": "5-1"}, headers=ALICE)
        assert r.status_code == 422 and r.json()["error"]["details"]["field"] == "array"
    assert c.post("/v1/jobs", json={**JOB, "array": "0-3"}, headers=ALICE).status_code == 201


# ------------------------------------------------------------------ holds


def _held(c: Any, jid: int) -> dict[str, Any]:
    job: dict[str, Any] = c.get(f"/v1/jobs/{jid}", headers=ADMIN).json()["jobs"][0]
    return job


@pytest.mark.parametrize("holder", [OPS, ADMIN], ids=["operator", "admin"])
def test_a_user_cannot_release_an_operators_hold(cluster: Any, holder: dict[str, str]) -> None:
    c, ctl = cluster()
    jid = c.post("/v1/jobs", json=JOB, headers=ALICE).json()["job_id"]
    r = c.post("/v1/jobs/hold", json={"jobs": [str(jid)]}, headers=holder)
    assert r.json()["results"][str(jid)] == "held"
    job = _held(c, jid)
    assert job["state"] == "HELD" and job["hold_kind"] == "admin"
    assert job["held_by"] in ("ops", "admin")
    r = c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=ALICE)
    assert r.status_code == 403, r.text
    msg = r.json()["error"]["message"]
    assert f"job {jid} was held by {job['held_by']}" in msg
    assert "only an operator or admin may release it" in msg
    assert job_state(ctl, jid) == "HELD"
    # the store refuses it too (a race between the check and the release)
    assert "admin hold" in ctl.store.release([jid], "alice")[jid]
    r = c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=OPS)
    assert r.json()["results"][str(jid)] == "released"
    job = _held(c, jid)
    assert job["state"] == "PENDING" and job["hold_kind"] is None and job["held_by"] is None


def job_state(ctl: Any, jid: int) -> str:
    return str(ctl.store.get_job(jid)["state"])


def test_a_users_own_hold_is_theirs_to_release(cluster: Any) -> None:
    c, _ = cluster()
    jid = c.post("/v1/jobs", json=JOB, headers=ALICE).json()["job_id"]
    assert c.post("/v1/jobs/hold", json={"jobs": [str(jid)]}, headers=ALICE).status_code == 200
    job = _held(c, jid)
    assert (job["hold_kind"], job["held_by"]) == ("user", "alice")
    r = c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=ALICE)
    assert r.json()["results"][str(jid)] == "released"
    # submitted held (sbatch -H): a user hold too
    jid = c.post("/v1/jobs", json={**JOB, "hold": True}, headers=ALICE).json()["job_id"]
    assert _held(c, jid)["hold_kind"] == "user"
    r = c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=ALICE)
    assert r.json()["results"][str(jid)] == "released"


def test_an_operator_holding_a_user_held_job_makes_it_an_admin_hold(cluster: Any) -> None:
    c, _ = cluster()
    jid = c.post("/v1/jobs", json={**JOB, "hold": True}, headers=ALICE).json()["job_id"]
    r = c.post("/v1/jobs/hold", json={"jobs": [str(jid)]}, headers=OPS)
    assert r.json()["results"][str(jid)] == "held"
    assert _held(c, jid)["hold_kind"] == "admin"
    assert c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=ALICE).status_code == 403


def test_an_operators_requeuehold_is_an_admin_hold(cluster: Any) -> None:
    c, _ = cluster()
    jid = c.post("/v1/jobs", json=JOB, headers=ALICE).json()["job_id"]
    r = c.post("/v1/jobs/requeue", json={"jobs": [str(jid)], "hold": True}, headers=OPS)
    assert r.json()["results"][str(jid)] == "held"
    assert _held(c, jid)["hold_kind"] == "admin"
    assert c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=ALICE).status_code == 403
    # her own requeuehold of her own job: hers to release
    jid = c.post("/v1/jobs", json=JOB, headers=ALICE).json()["job_id"]
    c.post("/v1/jobs/requeue", json={"jobs": [str(jid)], "hold": True}, headers=ALICE)
    assert _held(c, jid)["hold_kind"] == "user"
    r = c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=ALICE)
    assert r.json()["results"][str(jid)] == "released"


# ------------------------------------------------------------------ priority and nice


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"priority": 5}, "priority"), ({"nice": -1}, "nice")],
)
def test_only_operators_raise_a_job_above_others_on_submit(
    cluster: Any,
    extra: dict[str, int],
    field: str,
) -> None:
    c, ctl = cluster()
    for path, body in (
        ("/v1/jobs", {**JOB, **extra}),
        ("/v1/jobs/batch", {"jobs": [{**JOB, **extra}]}),
    ):
        r = c.post(path, json=body, headers=ALICE)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert "operator or admin role" in err["message"] and err["details"]["field"] == field
    assert ctl.store.list_jobs() == []
    for who in (OPS, ADMIN):
        assert c.post("/v1/jobs", json={**JOB, **extra}, headers=who).status_code == 201
    # lowering one's own standing is anyone's right
    for lower in ({"priority": -5}, {"nice": 100}, {"priority": 0, "nice": 0}):
        assert c.post("/v1/jobs", json={**JOB, **lower}, headers=ALICE).status_code == 201


def test_the_same_rule_on_update(cluster: Any) -> None:
    c, ctl = cluster()
    jid = c.post("/v1/jobs", json=JOB, headers=ALICE).json()["job_id"]
    for change in ({"priority": 100}, {"nice": -50}):
        r = c.post("/v1/jobs/update", json={"jobs": [str(jid)], **change}, headers=ALICE)
        assert r.status_code == 403, r.text
    row = ctl.store.get_job(jid)
    assert (row["priority"], row["nice"]) == (0, 0)
    r = c.post("/v1/jobs/update", json={"jobs": [str(jid)], "nice": 20}, headers=ALICE)
    assert r.json()["results"][str(jid)] == "updated"
    r = c.post("/v1/jobs/update", json={"jobs": [str(jid)], "priority": 100}, headers=OPS)
    assert r.json()["results"][str(jid)] == "updated"
    row = ctl.store.get_job(jid)
    assert (row["priority"], row["nice"]) == (100, 20)
