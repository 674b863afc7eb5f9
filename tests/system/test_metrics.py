"""`/metrics` of a live cluster: two controllers over one PostgreSQL store, two agents (one with
a fake NVML and its own `/metrics`), real jobs. The exposition is parsed with the Prometheus
client's parser and checked against what the API says: jobs by state, a drained node, a GPU
XID counted once per node and GPU, the same cluster figures from either controller, every
metric the deploy/ dashboard and alerts use, and a store outage that answers the last values
with `phalanx_store_up 0` (never a 500, never a hang).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from promql import alert_exprs, dashboard_exprs, exposed_names, metric_names
from system.harness import Cluster, free_port, phalanx_cmd, wait_for

pytestmark = [pytest.mark.system, pytest.mark.postgres]

FAST = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 6.0,
    "fence_timeout": 3.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _process_local_prefixes() -> tuple[str, ...]:
    """The families that differ per controller by design: every metric a controller module
    registers for its own process (read from the registry, so a new one needs no entry
    here), and the figures' own ages, read at slightly different moments."""
    from prometheus_client import REGISTRY

    import phalanx.controller.server  # noqa: F401  (imports every module that registers one)

    own = {m.name for m in REGISTRY.collect()}
    return (*sorted(own), "phalanx_metrics_", "phalanx_agent_heartbeat_lag")


LOCAL_PREFIXES = _process_local_prefixes()


def scrape(url: str) -> tuple[str, Samples]:
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return r.text, out


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(
        v
        for (n, labels), v in samples.items()
        if n == name and all(dict(labels).get(k) == x for k, x in match.items())
    )


def cluster_part(samples: Samples) -> Samples:
    return {k: v for k, v in samples.items() if not k[0].startswith(LOCAL_PREFIXES)}


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@pytest.mark.timeout(240)
def test_live_cluster_metrics(
    make_cluster: Callable[..., Cluster], pg_url: str, pg_server: Any, tmp_path: Path
) -> None:
    cluster = make_cluster(db=pg_url)
    cluster.timing.update(FAST)
    cluster.extra_env.update(
        {"PHALANX_METRICS_CACHE_SECONDS": "0.5", "PHALANX_METRICS_SCRAPE_WAIT": "1"}
    )
    ctl1 = cluster.start_controller()
    ctl2 = cluster.start_controller("ctl-2", port=free_port())
    urls = [cluster.controller_url(ctl1), cluster.controller_url(ctl2)]
    nvml = tmp_path / "nvml.json"
    _write_atomic(nvml, {"gpus": [{"temperature": 40}, {"temperature": 45}]})
    health = tmp_path / "health.toml"
    # a GPU stays failed for 10 minutes after a critical XID: the drain lasts the test
    health.write_text("[health]\ninterval = 1\n[health.gpu]\nxid_hold_s = 600\n")
    agent_port = free_port()
    cluster.start_agent(
        "node01",
        gpus="a100:2",
        env={
            "PHX_FAKE_NVML": str(nvml),
            "PHALANX_METRICS_AGENT_PORT": str(agent_port),
            "PHALANX_METRICS_AGENT_HOST": "127.0.0.1",
        },
        extra_args=["--health-config", str(health)],
        wait=False,
    )
    cluster.start_agent("node02", wait=False)
    cluster.wait_agents(["node01", "node02"])
    c = cluster.client()

    quick = [cluster.submit_script(tmp_path, f"q{i}", "#!/bin/sh\ntrue\n") for i in range(3)]
    long = cluster.submit_script(tmp_path, "long", "#!/bin/sh\nsleep 300\n", nodelist=["node02"])
    held = cluster.submit_script(tmp_path, "held", "#!/bin/sh\ntrue\n", hold=True)
    cluster.wait_terminal(quick)
    cluster.wait_state(long, "RUNNING")
    c.drain("node02", "bad DIMM")  # an operator's drain: the running job stays
    _write_atomic(nvml, {"gpus": [{"temperature": 40}, {"temperature": 45}], "xid": [[1, 79]]})
    wait_for(lambda: c.node("node01")["drain"], what="node01 drained by its GPU check")

    def settled() -> Samples | None:
        _, m = scrape(urls[0])
        api: dict[str, int] = {}
        for j in c.jobs(all=True, limit=100_000):
            api[j["state"]] = api.get(j["state"], 0) + 1
        ours = {
            dict(lab)["state"]: int(v) for (n, lab), v in m.items() if n == "phalanx_jobs" and v
        }
        by_state: dict[str, int] = {}
        for st, v in ours.items():
            by_state[st] = by_state.get(st, 0) + v
        ok = (
            by_state == api
            and total(m, "phalanx_nodes_drained", kind="health") == 1
            and total(m, "phalanx_gpu_xid_errors_total", node="node01", gpu="1", xid="79") == 1
        )
        return m if ok else None

    m = wait_for(settled, what="/metrics to agree with the API and to show the drains")
    assert total(m, "phalanx_store_up") == 1
    assert total(m, "phalanx_jobs", state="COMPLETED") == 3
    assert total(m, "phalanx_jobs", state="HELD") == 1
    assert total(m, "phalanx_jobs", state="RUNNING") == 1
    assert total(m, "phalanx_nodes_drained", kind="operator") == 1
    assert total(m, "phalanx_nodes", state="DRAINING") == 1  # node02: drained, job still runs
    assert total(m, "phalanx_nodes_flagged", flag="drain") == 2
    assert total(m, "phalanx_node_health_checks", check="gpu", status="fail") == 1
    # first starts are counted by the controller that placed them: 4 over both
    started = sum(total(scrape(u)[1], "phalanx_job_submit_to_start_seconds_count") for u in urls)
    assert started == 4
    assert total(m, "phalanx_lease_holder") >= 2  # cluster + sched:* held by someone
    # API requests are timed by route template: one series for every job id
    routes = {dict(lab).get("route") for (n, lab), _ in m.items() if n.startswith("phalanx_http")}
    assert "/v1/jobs/{ref}" in routes or "/v1/jobs" in routes
    assert not any(r and any(str(j) in r for j in (long, held)) for r in routes)

    # the same cluster figures from the other controller (it read the same store)
    def same() -> bool:
        a = cluster_part(scrape(urls[0])[1])
        b = cluster_part(scrape(urls[1])[1])
        if a != b:  # raised, so that a timeout names the figures that differ
            diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
            raise ValueError(f"ctl-1 vs ctl-2: {sorted(diff.items())}")
        return True

    wait_for(same, what="both controllers to answer the same cluster figures")

    # the agent's own /metrics
    agent_text, agent_m = scrape(f"http://127.0.0.1:{agent_port}")
    assert total(agent_m, "phalanx_agent_gpu_temperature_celsius", gpu="1") == 45
    assert total(agent_m, "phalanx_agent_health_check_seconds_count", check="gpu") >= 1
    assert total(agent_m, "phalanx_agent_health_check_status", check="gpu", status="fail") == 1

    # every metric deploy/ uses is in these live scrapes
    exposed = exposed_names(scrape(urls[0])[0]) | exposed_names(agent_text)
    exprs = dashboard_exprs() + alert_exprs()
    missing = {(n, e) for e in exprs for n in metric_names(e) if n not in exposed}
    assert not missing, missing

    # a store outage: the last values, phalanx_store_up 0, promptly and never a 500
    before = cluster_part(scrape(urls[1])[1])
    with pg_server.paused():
        time.sleep(0.6)  # older than the cache (0.5 s): the scrape must go to the store
        t0 = time.monotonic()
        _, during = scrape(urls[1])
        took = time.monotonic() - t0
        assert total(during, "phalanx_store_up") == 0
        assert took < 10, took
        assert total(during, "phalanx_jobs", state="COMPLETED") == 3
        assert {k for k in cluster_part(during) if k[0] == "phalanx_jobs"} == {
            k for k in before if k[0] == "phalanx_jobs"
        }
    wait_for(
        lambda: total(scrape(urls[1])[1], "phalanx_store_up") == 1,
        what="phalanx_store_up 1 once the store is back",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("problem", ["port in use", "not a number"])
def test_an_agent_that_cannot_serve_metrics_says_why(
    make_cluster: Callable[..., Cluster], tmp_path: Path, problem: str
) -> None:
    cluster = make_cluster()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1]) if problem == "port in use" else "ninety"
        proc = subprocess.run(
            phalanx_cmd(
                "agent",
                "--name",
                "node01",
                "--state-dir",
                str(cluster.agent_dir("node01")),
                "--url",
                "http://127.0.0.1:9",
                *cluster.agent_auth_args("node01"),
            ),
            env=cluster.env(
                PHALANX_METRICS_AGENT_PORT=port, PHALANX_METRICS_AGENT_HOST="127.0.0.1"
            ),
            capture_output=True,
            text=True,
            timeout=90,
            stdin=subprocess.DEVNULL,
        )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("phalanx agent:"), last
    assert "metrics.agent_port" in last, last
    if problem == "port in use":
        assert port in last
