"""Migration 0007 on a store with jobs in it: live jobs keep the account and QOS they named,
ended attempts owe nothing, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import select, text

import phalanx.store.base as base
from phalanx.store import schema as s
from phalanx.store.store import Store


def _upgrade(store: Store, revision: str) -> None:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(base.__file__).parent / "migrations"))
    with store.db.begin(unbounded=True) as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def test_live_jobs_keep_their_account_and_qos(db_url: str) -> None:
    store = Store(db_url, actor="test")
    try:
        _upgrade(store, "0006")
        now = time.time()
        cols = (
            'name, "user", partitions, state, priority, submit_time, nodes, cpus_per_node, '
            "mem_per_node_mb, gpus_per_node, exclusive, nodelist, exclude, dependency, "
            "requeue, spec, restart_count, launch_failures, retries"
        )
        with store.db.begin() as conn:
            for state, spec in (
                ("PENDING", '{"account": "physics", "qos": "urgent"}'),
                ("COMPLETED", '{"account": "physics"}'),
                ("PENDING", "{}"),
            ):
                conn.execute(
                    text(
                        f"INSERT INTO jobs ({cols}) VALUES ('j', 'alice', 'batch', :state, 0, "
                        ":now, 1, 1, 512, 0, false, '[]', '[]', '[]', true, :spec, 0, 0, 0)"
                    ),
                    {"state": state, "now": now, "spec": spec},
                )
        _upgrade(store, "head")
        with store.db.begin(write=False) as conn:
            rows = conn.execute(
                select(s.jobs.c.state, s.jobs.c.account, s.jobs.c.qos, s.jobs.c.nice).order_by(
                    s.jobs.c.id
                )
            ).all()
        assert [tuple(r) for r in rows] == [
            ("PENDING", "physics", "urgent", 0),
            ("COMPLETED", None, None, 0),  # over: nothing to charge or order
            ("PENDING", None, None, 0),
        ]
    finally:
        store.close()
