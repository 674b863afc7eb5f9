"""`/metrics` in process: the cluster figures match the store, counters come from stored events,
caps hold, and a store that cannot be read gives the last values with `phalanx_store_up 0`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from api_auth import KEYS, AuthedClient
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_api import USER, Agent, run_to_start, submit

from phalanx.config import Config
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller
from phalanx.errors import StoreUnavailable
from phalanx.store.store import Store


@pytest.fixture
def config(config: Config) -> Config:
    # every scrape reads the store again: the tests change it between scrapes
    config.metrics.cache_seconds = 0.001
    config.metrics.max_users = 2
    return config


@pytest.fixture
def client(ctl: Controller) -> Iterator[TestClient]:
    with AuthedClient(create_app(ctl, KEYS)) as c:
        yield c


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: TestClient) -> Samples:
    r = client.get("/metrics")  # as an admin (AuthedClient's default): per-user series too
    assert r.status_code == 200, r.text
    return parse(r.text)


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_jobs_nodes_and_leases_match_the_store(
    client: TestClient, ctl: Controller, store: Store
) -> None:
    Agent(client, "n1").register(cpus=1)
    Agent(client, "n2").register(cpus=1)
    submit(client, name="a")
    submit(client, name="b", partition="long")
    submit(client, name="c")
    submit(client, name="held", hold=True)
    r = client.post("/v1/nodes/n2/drain", json={"reason": "bad DIMM"}, headers=USER)
    assert r.status_code == 200, r.text
    agent = Agent(client, "n1")
    placed = scrape(client)
    run_to_start(ctl, agent)
    ctl.leases.tick()
    ctl.schedule_tick()

    m = scrape(client)
    assert value(m, "phalanx_store_up") == 1
    by_state: dict[str, float] = {}
    for (name, labels), v in m.items():
        if name == "phalanx_jobs":
            st = dict(labels)["state"]
            by_state[st] = by_state.get(st, 0) + v
    api = {}
    for j in client.get("/v1/jobs", params={"all": True}).json()["jobs"]:
        api[j["state"]] = api.get(j["state"], 0) + 1
    assert by_state == api
    assert value(m, "phalanx_jobs", state="PENDING", partition="long") == 1
    assert value(m, "phalanx_jobs", state="HELD", partition="batch") == 1
    # one pending job waits for resources (n1 busy, n2 drained), the held one is not pending
    assert sum(v for (n, _), v in m.items() if n == "phalanx_jobs_pending") == api["PENDING"]
    assert value(m, "phalanx_nodes_drained", kind="operator") == 1
    assert value(m, "phalanx_nodes_flagged", flag="drain") == 1
    assert value(m, "phalanx_nodes", state="DRAINED") == 1
    for lease in store.list_leases():
        assert value(m, "phalanx_lease_term", lease=lease["name"]) == lease["term"]
        assert value(m, "phalanx_lease_holder", lease=lease["name"], holder="t") == 1
    # the one placement (process-wide histograms: other tests in this process add to them)
    for name in (
        "phalanx_job_queue_wait_seconds_count",
        "phalanx_job_submit_to_start_seconds_count",
    ):
        assert (value(m, name) or 0) - (value(placed, name) or 0) == 1
    # API requests by route template, not raw path
    assert value(
        m,
        "phalanx_http_request_duration_seconds_count",
        route="/v1/nodes/{name}/drain",
        method="POST",
        status="200",
    )


def test_gpu_events_are_counted_once_per_key_and_per_gpu(
    client: TestClient, ctl: Controller
) -> None:
    Agent(client, "g1").register(cpus=4, gpus=[[0, "h100"], [1, "h100"]])
    events = [
        {"key": "b1:1", "gpu": 1, "xid": 79},
        {"key": "b1:ecc:1:3", "gpu": 1, "count": 3, "total": 3, "boot": "b1"},
    ]
    for _ in range(2):  # an agent repeats events until a reply confirms them
        r = client.post(
            "/v1/agents/g1/heartbeat",
            json={"health": {"status": "ok", "checks": {}, "gpu_events": events}, "wait": 0},
        )
        assert r.status_code == 200, r.text
    later = [  # two more on this boot; after a reboot the counter starts again at 0
        {"key": "b1:ecc:1:5", "gpu": 1, "count": 2, "total": 5, "boot": "b1"},
        {"key": "b2:ecc:1:1", "gpu": 1, "count": 1, "total": 1, "boot": "b2"},
    ]
    client.post(
        "/v1/agents/g1/heartbeat",
        json={"health": {"status": "ok", "gpu_events": later}},
    )
    m = scrape(client)
    assert value(m, "phalanx_gpu_xid_errors_total", node="g1", gpu="1", xid="79") == 1
    assert value(m, "phalanx_gpu_ecc_uncorrectable_errors_total", node="g1", gpu="1") == 6
    # the events stay out of the node's stored health summary
    node = client.get("/v1/nodes/g1").json()
    assert "gpu_events" not in str(node)


def test_user_series_are_capped_with_other(client: TestClient) -> None:
    from api_auth import as_user

    for user, n in (("ann", 3), ("bob", 2), ("cat", 1), ("dan", 1)):
        for _ in range(n):
            r = client.post(
                "/v1/jobs", json={"argv": ["/bin/true"], "hold": True}, headers=as_user(user)
            )
            assert r.status_code == 201, r.text
    m = scrape(client)
    users = {dict(lab)["user"]: v for (n, lab), v in m.items() if n == "phalanx_user_jobs"}
    assert users == {"ann": 3, "bob": 2, "other": 2}


def test_a_store_outage_answers_the_last_values_and_store_up_0(
    client: TestClient, ctl: Controller, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit(client)
    before = scrape(client)
    assert value(before, "phalanx_store_up") == 1

    def down(**_kw: Any) -> Any:
        raise StoreUnavailable("database unavailable (test)")

    monkeypatch.setattr(store, "metrics_figures", down)
    time.sleep(0.01)  # older than cache_seconds (1 ms)
    during = scrape(client)
    assert value(during, "phalanx_store_up") == 0
    assert value(during, "phalanx_jobs", state="PENDING", partition="batch") == 1

    def hangs(**_kw: Any) -> Any:
        time.sleep(3)
        raise StoreUnavailable("timed out")

    ctl.config.metrics.scrape_wait = 0.2
    monkeypatch.setattr(store, "metrics_figures", hangs)
    t0 = time.monotonic()
    slow = scrape(client)
    assert time.monotonic() - t0 < 2.5
    assert value(slow, "phalanx_store_up") == 0
    assert value(slow, "phalanx_jobs", state="PENDING", partition="batch") == 1


def test_requeues_and_retries_are_counted_by_reason(client: TestClient, ctl: Controller) -> None:
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    (jid,) = submit(client, retries=2, retry_on="exit:3")
    start = run_to_start(ctl, agent)
    agent.heartbeat([Agent.report(start, "exited", exit_code=3)])  # a retry (exit), backing off
    assert client.get(f"/v1/jobs/{jid}").json()["jobs"][0]["retries"] == 1
    (other,) = submit(client)
    second = run_to_start(ctl, agent)
    assert second["job_id"] == other
    agent.heartbeat([Agent.report(second, "running")])
    r = client.post("/v1/jobs/requeue", json={"jobs": [str(other)]}, headers=USER)
    assert r.status_code == 200, r.text
    agent.heartbeat([Agent.report(second, "exited", exit_code=0)])  # a planned requeue
    m = scrape(client)
    retried = {
        dict(lab)["reason"]: v for (n, lab), v in m.items() if n == "phalanx_job_retries_total"
    }
    requeued = {
        dict(lab)["reason"]: v for (n, lab), v in m.items() if n == "phalanx_job_requeues_total"
    }
    assert retried == {"exit": 1}
    assert requeued == {"exit": 1, "planned": 1}


def test_purging_finished_jobs_keeps_the_counters(
    client: TestClient, ctl: Controller, store: Store
) -> None:
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    (jid,) = submit(client, retries=2, retry_on="exit:3")
    start = run_to_start(ctl, agent)
    store.add_event("job.checkpoint", "checkpoint", job_id=jid, data={"duration_s": 2.0})
    agent.heartbeat([Agent.report(start, "exited", exit_code=3)])
    (kept,) = submit(client, hold=True)
    store.add_event("job.checkpoint", "checkpoint", job_id=kept, data={"duration_s": 20.0})

    def figures() -> tuple[Any, ...]:
        m = scrape(client)
        return (
            value(m, "phalanx_job_retries_total", reason="exit"),
            value(m, "phalanx_job_requeues_total", reason="exit"),
            value(m, "phalanx_checkpoint_duration_seconds_count"),
            value(m, "phalanx_checkpoint_duration_seconds_bucket", le="5.0"),
            value(m, "phalanx_checkpoint_duration_seconds_sum"),
        )

    before = figures()
    assert before == (1, 1, 2, 1, 22.0)
    client.post("/v1/jobs/cancel", json={"jobs": [str(jid)]}, headers=USER)
    assert store.purge_finished(time.time() + 60) == 1
    assert client.get(f"/v1/jobs/{jid}").status_code == 404
    assert figures() == before
    # a second purge adds to the counts kept from the first
    (again,) = submit(client, retries=2, retry_on="exit:3")
    start = run_to_start(ctl, agent)
    agent.heartbeat([Agent.report(start, "exited", exit_code=3)])
    client.post("/v1/jobs/cancel", json={"jobs": [str(again)]}, headers=USER)
    assert store.purge_finished(time.time() + 60) == 1
    assert figures()[:2] == (2, 2)


def test_the_public_scrape_names_no_user_and_operators_get_the_per_user_series(
    client: TestClient,
) -> None:
    """/metrics needs no credential, so it must not list who runs what: user names only in a
    scrape with an operator's or admin's credential (docs/metrics.md)."""
    from api_auth import ANONYMOUS, as_agent, as_user

    for user in ("zelda", "yorick"):
        r = client.post(
            "/v1/jobs", json={"argv": ["/bin/true"], "hold": True}, headers=as_user(user)
        )
        assert r.status_code == 201, r.text
    garbage = {"Authorization": "Bearer not-a-jwt"}
    for who in (ANONYMOUS, as_user("carol"), as_agent("n1"), garbage):
        r = client.get("/metrics", headers=who)
        assert r.status_code == 200
        assert "zelda" not in r.text and "yorick" not in r.text, who
        m = parse(r.text)
        assert not [k for k in m if "user" in dict(k[1])], who
        assert value(m, "phalanx_users_active", state="HELD") == 2
    for who in (as_user("ops", "operator"), as_user("root", "admin")):
        m = parse(client.get("/metrics", headers=who).text)
        assert value(m, "phalanx_user_jobs", user="zelda", state="HELD") == 1
        assert value(m, "phalanx_users_active", state="HELD") == 2
