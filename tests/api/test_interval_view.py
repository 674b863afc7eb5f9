"""The checkpoint interval in force, and its inputs, as `phalanx show` and `phalanx cluster`
see them: through the real API over a real store, rendered by the CLI's own functions.

The controller caches the measured inputs (agents ask on every heartbeat); the tests turn the
cache lifetimes to zero so each request sees the store's current history.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from api_auth import as_user
from fastapi.testclient import TestClient

from phalanx.cli.render import cluster_summary, job_detail
from phalanx.controller import intervals
from phalanx.store.store import Store

DAY = 86400.0
USER = as_user("alice", "operator")  # operators may drain nodes and add windows


@pytest.fixture(autouse=True)
def no_input_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intervals, "CHECKPOINT_INPUT_TTL", -1.0)
    monkeypatch.setattr(intervals, "FAILURE_HISTORY_TTL", -1.0)


def submit(client: TestClient, **spec: Any) -> int:
    spec.setdefault("argv", ["/bin/true"])
    r = client.post("/v1/jobs", json=spec, headers=USER)
    assert r.status_code == 201, r.text
    return int(r.json()["job_id"])


def show(client: TestClient, job_id: int) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    (j,) = r.json()["jobs"]
    return dict(j)


def history(store: Store, nodes: int, days: float, failures_per_node: int) -> None:
    """`nodes` nodes watched for `days`, each failing (DOWN, back at once) `failures_per_node`
    times; stamped in the past like the events the store writes."""
    now = time.time()
    for i in range(nodes):
        store.add_event("node.register", "test", node=f"h{i}", ts=now - days * DAY)
        for k in range(failures_per_node):
            t = now - days * DAY * (k + 1) / (failures_per_node + 1)
            store.add_event("node.down", "test", node=f"h{i}", ts=t)
            store.add_event("node.up", "test", node=f"h{i}", ts=t)


def test_auto_interval_and_its_inputs_in_show(client: TestClient, store: Store) -> None:
    jid = submit(client, nodes=1, checkpoint_interval_s="auto")
    # no history, no measurement: the prior (30 days) and the default cost (30 s)
    ci = show(client, jid)["checkpoint_interval"]
    assert ci["mode"] == "auto"
    assert ci["cost_s"] == 30.0 and ci["cost_source"] == "default"
    assert ci["node_mtbf_s"] == 30 * DAY and ci["mtbf_source"] == "prior"
    assert ci["job_mtbf_s"] == 30 * DAY and ci["nodes"] == 1
    assert ci["seconds"] == pytest.approx(math.sqrt(2 * 30 * 30 * DAY))

    # the job reports checkpoints; the cluster has a month of history at one failure per
    # node-day on 64 nodes
    for seq, d in enumerate([4.0, 4.2, 3.9]):
        store.add_event(
            "job.checkpoint",
            f"checkpoint {seq}",
            job_id=jid,
            data={"path": f"/c/{seq}", "finished_at": time.time(), "duration_s": d, "seq": seq},
        )
    history(store, 64, 29.0, 29)
    j = show(client, jid)
    ci = j["checkpoint_interval"]
    assert ci["cost_s"] == pytest.approx(4.0) and ci["cost_source"] == "measured"
    assert ci["mtbf_source"] == "history"
    # (30 days prior + 64 * 29 node-days) / (1 + 64 * 29 failures): about a day
    want_mtbf = (30 + 64 * 29) / (1 + 64 * 29) * DAY
    assert ci["node_mtbf_s"] == pytest.approx(want_mtbf, rel=1e-3)
    assert ci["seconds"] == pytest.approx(math.sqrt(2 * 4.0 * want_mtbf), rel=1e-3)

    line = next(x for x in job_detail(j).splitlines() if "CheckpointInterval=" in x)
    assert f"CheckpointInterval=auto {ci['seconds']:.0f}s (C=4.0s measured, M=" in line
    assert "from history / 1 node)" in line


def test_fixed_and_no_interval_in_show(client: TestClient) -> None:
    fixed = submit(client, checkpoint_interval_s=600)
    j = show(client, fixed)
    assert j["checkpoint_interval"] == {"mode": "fixed", "seconds": 600.0}
    assert "CheckpointInterval=600s (fixed)" in job_detail(j)
    # checkpoint options without an interval: checkpoints only before planned stops
    signal_only = submit(client, checkpoint_signal="USR2")
    j = show(client, signal_only)
    assert j["checkpoint_interval"] == {"mode": "off"}
    # no checkpoint options at all: nothing to show
    plain = show(client, submit(client))
    assert "checkpoint_interval" not in plain
    assert "CheckpointInterval" not in job_detail(plain)


def test_cluster_shows_the_node_mtbf(client: TestClient, store: Store) -> None:
    c = client.get("/v1/cluster").json()["node_mtbf"]
    assert c["source"] == "prior" and c["node_mtbf_s"] == 30 * DAY
    assert c["failures"] == 0 and c["node_seconds"] == 0 and c["window_s"] == 30 * DAY
    history(store, 8, 10.0, 2)
    st = client.get("/v1/cluster").json()
    c = st["node_mtbf"]
    assert c["failures"] == 16 and c["node_seconds"] == pytest.approx(80 * DAY, rel=1e-4)
    assert c["source"] == "history"
    assert c["node_mtbf_s"] == pytest.approx((30 + 80) / (1 + 16) * DAY, rel=1e-4)
    line = cluster_summary(st).splitlines()[-1]
    assert line.startswith("Node MTBF: 6.5d from history (80.0 node-days up, 16 failures")
    assert "in the last 30.0d; prior 30.0d worth 30.0d of node time)" in line
