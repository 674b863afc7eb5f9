"""Fair share usage in the store: attempts are charged incrementally, once, up to their end,
and usage decays with the half-life, on SQLite and PostgreSQL."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select
from test_store_contract import add_node, exited, running, start, store, submit1

from phalanx.store import schema as s
from phalanx.store.store import Store

__all__ = ["store"]  # the fixture, imported for pytest


def _charge(store: Store, now: float, half_life: float = 0.0) -> int:
    return store.charge_usage(
        now,
        half_life=half_life,
        cpu_weight=1.0,
        gpu_weight=10.0,
        default_account="default",
        fence=None,
    )


def _set_start(store: Store, attempt_id: int, at: float) -> None:
    with store.db.begin() as conn:
        conn.execute(s.attempts.update().where(s.attempts.c.id == attempt_id).values(start_time=at))


def test_running_attempts_are_charged_incrementally_and_once(store: Store) -> None:
    add_node(store, "n1", cpus=4, gpus=2)
    jid = submit1(store, cpus_per_task=2, gpus_per_node=1, account="phys")
    job = store.get_job(jid)
    (started,) = store.start_attempts(
        [
            {
                "job_id": jid,
                "partition": job["partition"],
                "nodes": ["n1"],
                "cpus_per_node": 2,
                "mem_per_node_mb": [job["mem_per_node_mb"]],
                "gpu_ids": [[1]],
                "exclusive": False,
            }
        ],
        None,
    )
    assert started == jid
    att = store.attempts_of(jid)[-1]
    store.apply_reports("n1", [running(att)], time.time())
    t0 = time.time() - 1000.0
    _set_start(store, att["id"], t0)
    # 2 CPUs x 1.0 + 1 GPU x 10.0 = 12 units a second
    assert _charge(store, t0 + 100) == 1
    assert store.usage_table(t0 + 100, 0.0) == {("phys", "alice"): pytest.approx(1200.0)}
    _charge(store, t0 + 100)  # the same moment again: nothing more is owed
    assert store.usage_table(t0 + 100, 0.0)[("phys", "alice")] == pytest.approx(1200.0)
    _charge(store, t0 + 150)
    assert store.usage_table(t0 + 150, 0.0)[("phys", "alice")] == pytest.approx(1800.0)
    # it ends: charged up to its end, however late the next charge comes, then closed
    store.apply_reports("n1", [exited(att, 0)], time.time())
    with store.db.begin(write=False) as conn:
        end = conn.execute(
            select(s.attempts.c.end_time).where(s.attempts.c.id == att["id"])
        ).scalar_one()
    later = time.time() + 500
    _charge(store, later)
    assert store.usage_table(later, 0.0)[("phys", "alice")] == pytest.approx(12.0 * (end - t0))
    with store.db.begin(write=False) as conn:
        assert (
            conn.execute(
                select(s.attempts.c.uncharged).where(s.attempts.c.id == att["id"])
            ).scalar_one()
            is False
        )
    assert _charge(store, later + 100) == 0
    assert store.usage_table(later + 100, 0.0)[("phys", "alice")] == pytest.approx(
        12.0 * (end - t0)
    )


def test_usage_decays_with_the_half_life(store: Store) -> None:
    add_node(store, "n1", cpus=4)
    jid = submit1(store, cpus_per_task=4)  # no account: charged to the default one
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], time.time())
    t0 = time.time() - 1000.0
    _set_start(store, att["id"], t0)
    _charge(store, t0 + 50, half_life=100.0)  # 4 CPUs x 50 s = 200
    store.apply_reports("n1", [exited(att, 0)], time.time())
    with store.db.begin() as conn:  # it ended right at the charge: nothing more is owed
        conn.execute(
            s.attempts.update().where(s.attempts.c.id == att["id"]).values(end_time=t0 + 50)
        )
    _charge(store, t0 + 150, half_life=100.0)
    # stored: 200 decayed over one half-life
    assert store.usage_table(t0 + 150, 0.0)[("default", "alice")] == pytest.approx(100.0)
    # read later: decayed on the way out too (another half-life: 50)
    assert store.usage_table(t0 + 250, 100.0)[("default", "alice")] == pytest.approx(50.0)


def test_an_attempt_that_never_started_costs_nothing(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    start(store, jid, ["n1"])
    assert _charge(store, time.time()) == 0
    assert store.usage_table(time.time(), 0.0) == {}


def test_a_backlog_is_charged_in_batches_and_nothing_is_lost(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More uncharged attempts than one transaction takes (store/fairshare.py CHARGE_BATCH, 2 here): each
    charge takes the oldest batch, the next ones the rest, and the total is what one charge of
    everything would have given."""
    from phalanx.store import fairshare as usage

    monkeypatch.setattr(usage, "CHARGE_BATCH", 2)
    add_node(store, "n1", cpus=8, gpus=0)
    t0 = time.time() - 1000.0
    atts: list[dict[str, object]] = []
    for _ in range(5):
        jid = submit1(store, cpus_per_task=1, account="phys")
        job = store.get_job(jid)
        store.start_attempts(
            [
                {
                    "job_id": jid,
                    "partition": job["partition"],
                    "nodes": ["n1"],
                    "cpus_per_node": 1,
                    "mem_per_node_mb": [job["mem_per_node_mb"]],
                    "gpu_ids": [[]],
                    "exclusive": False,
                }
            ],
            None,
        )
        atts.append(store.attempts_of(jid)[-1])
        # a report names every task the node runs (one left out has ended)
        store.apply_reports("n1", [running(a) for a in atts], time.time())
        _set_start(store, atts[-1]["id"], t0)
    # each a running CPU: 1 unit a second. Two charges reach 4 of the 5 attempts...
    assert [_charge(store, t0 + 100) for _ in range(2)] == [2, 2]
    assert store.usage_table(t0 + 100, 0.0) == {("phys", "alice"): pytest.approx(400.0)}
    # ... the third the last one (never charged goes first) and then the least recently
    # charged: running attempts stay open, and all of them come round in turn
    _charge(store, t0 + 100)
    assert store.usage_table(t0 + 100, 0.0)[("phys", "alice")] == pytest.approx(500.0)
    for _ in range(3):  # a later moment: every one is charged its 50 s, none twice
        _charge(store, t0 + 150)
    assert store.usage_table(t0 + 150, 0.0)[("phys", "alice")] == pytest.approx(750.0)
