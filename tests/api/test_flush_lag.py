"""A controller whose heartbeat flushes lag answers no heartbeat (issue 26).

The failure detector waits for a lagging controller's `flushed_through` mark only for
Timing.heard_window; after that it may declare DOWN a node whose heartbeats only that
controller heard. That is safe only if the controller stopped vouching for nodes in time: a
reply freshens the agent's fence, so a controller whose flushes cannot commit (a row lock, a
slow database) must answer 503 once everything it has stored is older than
Timing.flush_lag_limit, and every agent it answered before that must have fenced within the
window. The PostgreSQL case blocks the flush on a real row lock held by another session.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from api_auth import KEYS, AuthedClient
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from test_api import Agent

from phalanx.clock import FakeClock
from phalanx.config import Config, Timing, load_config
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.errors import StoreUnavailable
from phalanx.store.store import Store
from schema_copy import fresh_db
from system.harness import wait_for

PARTITIONS = [{"name": "batch", "default": True}]
FAST = {"db_op_timeout": 0.5, "heartbeat_flush_interval": 0.2}  # a 0.7 s flush-lag limit


def heartbeat(client: TestClient, node: str) -> tuple[int, dict]:
    r = client.post(f"/v1/agents/{node}/heartbeat", json={"tasks": [], "wait": 0})
    return r.status_code, r.json()


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    return load_config(overrides={"cluster": {"partitions": PARTITIONS}, "timing": FAST})


def test_a_controller_behind_on_its_flushes_answers_503_until_one_commits(
    tmp_path: Path, config: Config, schema_db: Path
) -> None:
    clock = FakeClock()
    store = Store(fresh_db(schema_db, tmp_path / "lag.db"), actor="t")
    try:
        store.sync_partitions(partition_rows(config))
        ctl = Controller(store, config, cid="c1", clock=clock)
        store.register_controller("c1", "http://c1")  # as Controller.start does
        ctl.heartbeats.marked()
        limit = config.timing.flush_lag_limit()
        with AuthedClient(create_app(ctl, KEYS)) as client:
            Agent(client, "n1").register()
            assert heartbeat(client, "n1")[0] == 200
            ctl.heartbeats.flush()  # it is stored

            clock.advance(limit + 0.1)  # no flush committed for longer than the limit
            code, body = heartbeat(client, "n1")
            assert code == 503, body
            assert body["error"]["code"] == "store_unavailable", body
            assert "cannot store heartbeats" in body["error"]["message"], body
            assert "ask another controller" in body["error"]["message"], body
            assert not ctl.heartbeats.pending("n1")  # the refused heartbeat is not taken

            ctl.heartbeats.flush()  # a flush commits: answering again
            assert heartbeat(client, "n1")[0] == 200
            assert ctl.heartbeats.pending("n1")
    finally:
        store.close()


@pytest.mark.postgres
def test_a_flush_blocked_on_a_row_lock_stops_the_heartbeat_answers(
    pg_url: str, config: Config
) -> None:
    store = Store(pg_url, actor="t", op_timeout=config.timing.db_op_timeout)
    other = create_engine(pg_url)
    locked = threading.Event()
    release = threading.Event()

    def hold_the_controller_row() -> None:
        """Another session updates the controller's row and keeps the transaction open."""
        with other.begin() as conn:
            conn.execute(text("UPDATE controllers SET url = url WHERE id = 'c1'"))
            locked.set()
            release.wait(60)

    try:
        store.migrate()
        store.sync_partitions(partition_rows(config))
        ctl = Controller(store, config, cid="c1")
        store.register_controller("c1", "http://c1")
        ctl.heartbeats.marked()
        limit = config.timing.flush_lag_limit()
        with AuthedClient(create_app(ctl, KEYS)) as client:
            Agent(client, "n1").register()
            ctl.heartbeats.flush()
            assert heartbeat(client, "n1")[0] == 200

            holder = threading.Thread(target=hold_the_controller_row, daemon=True)
            holder.start()
            try:
                assert locked.wait(30), "the other session could not lock the row"
                with pytest.raises(StoreUnavailable):
                    ctl.heartbeats.flush()  # waits on the lock until db_op_timeout
                code, body = wait_for(
                    lambda: (r := heartbeat(client, "n1"))[0] != 200 and r,
                    timeout=30,
                    interval=0.05,
                    what="the heartbeat to be refused",
                )
                assert ctl.heartbeats.lag() > limit
                assert code == 503 and body["error"]["code"] == "store_unavailable", body
            finally:
                release.set()
                holder.join(30)
            ctl.heartbeats.flush()
            assert ctl.heartbeats.lag() < limit
            assert heartbeat(client, "n1")[0] == 200
    finally:
        release.set()
        other.dispose()
        store.close()


# the default timings, those of the HA and chaos tests, and a 3,000-node cluster's (scaled)
TIMINGS = [
    Timing(),
    Timing(
        lease_ttl=3.0,
        renew_interval=0.5,
        heartbeat_interval=0.5,
        node_down_timeout=6.0,
        fence_timeout=4.0,
        fence_kill_grace=0.5,
        fence_margin=1.0,
    ),
    Timing(heartbeat_flush_interval=2.0, db_op_timeout=5.0, lease_ttl=8.0),
    Timing().for_cluster(3000),
]


@pytest.mark.parametrize("t", TIMINGS, ids=["default", "ha", "slow-db", "3000-nodes"])
def test_every_answered_agent_has_fenced_before_the_window_closes(t: Timing) -> None:
    """A controller answers up to flush_lag_limit after its mark; a reply may freshen the
    agent's fence one long-poll plus its grace after the heartbeat was heard, and the jobs are
    dead fence_timeout + fence_kill_grace later. The detector must still be waiting for that
    controller's mark then, with fence_margin to spare, and never judge sooner than the
    node-DOWN timeout."""
    dead_by = (
        t.flush_lag_limit()
        + t.heartbeat_interval
        + max(0.5, t.heartbeat_interval)
        + t.fence_timeout
        + t.fence_kill_grace
    )
    assert dead_by + t.fence_margin <= t.heard_window()
    assert t.heard_window() >= t.node_down_timeout
    # one flush interval is not a lag: a healthy controller keeps answering
    assert t.flush_lag_limit() > 2 * t.heartbeat_flush_interval
