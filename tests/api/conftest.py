"""In-process API fixtures: the real FastAPI app over a real (SQLite) store and Controller.

No background threads run: tests drive the controller's ticks themselves (`ctl.leases.tick()`,
`ctl.schedule_tick()`), so every step is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from api_auth import KEYS, AuthedClient
from fairshare_app import FAIRSHARE
from fastapi.testclient import TestClient

from phalanx.config import Config, load_config
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.store.store import Store
from schema_copy import fresh_db

PARTITIONS = [
    {"name": "batch", "default": True, "max_time": "2:00:00", "default_time": "1:00:00"},
    {"name": "long", "max_time": "UNLIMITED"},
]


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    return load_config(overrides={"cluster": {"partitions": PARTITIONS}})


@pytest.fixture
def store(tmp_path: Path, config: Config, schema_db: Path) -> Iterator[Store]:
    st = Store(fresh_db(schema_db, tmp_path / "api.db"), actor="t")
    st.sync_partitions(partition_rows(config))
    try:
        yield st
    finally:
        st.close()


@pytest.fixture
def ctl(store: Store, config: Config) -> Controller:
    """The controller, its leases taken. No loops run here, so its `schedule_tick` renews
    them first, as the lease loop would have (every 0.75 s): on a loaded machine a test's
    requests can outlast the 3 s TTL, and a pass without its lease says 'idle' and does
    nothing (seen in make test, three tests in as many runs)."""
    c = Controller(store, config, cid="t")
    assert "took term" in c.leases.tick()
    schedule_tick = c.schedule_tick

    def renewed_schedule_tick() -> str:
        c.leases.tick()
        return schedule_tick()

    c.schedule_tick = renewed_schedule_tick  # type: ignore[method-assign]
    return c


@pytest.fixture
def client(ctl: Controller) -> Iterator[TestClient]:
    with AuthedClient(create_app(ctl, KEYS)) as c:
        yield c


@pytest.fixture
def fs_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schema_db: Path
) -> Iterator[tuple[TestClient, Controller]]:
    """The app and its controller over tests/api/fairshare_app.py's `[fairshare]` (accounts,
    users and QOS imported into the store at the first pass), default partitions."""
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    config: Config = load_config(overrides={"fairshare": FAIRSHARE})
    store = Store(fresh_db(schema_db, tmp_path / "fs.db"), actor="t")
    store.sync_partitions(partition_rows(config))
    ctl = Controller(store, config, cid="t")
    ctl.leases.tick()
    try:
        with AuthedClient(create_app(ctl, KEYS)) as c:
            yield c, ctl
    finally:
        store.close()
