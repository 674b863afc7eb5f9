"""Lease renewals jump a controller's writer queue (engine.WriterQueue, `urgent`).

The controller's own write load (heartbeat reports, submissions, scheduler writes) must never
make it lose its duty leases: docs/architecture.md, "Leases".
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from phalanx.controller.leases import LeaseKeeper
from phalanx.store.store import Fence, Store
from phalanx.store.writers import WriterQueue

URL = "sqlite:////x.db"


def _wait_until(cond: object, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def test_an_urgent_turn_goes_before_every_ordinary_writer_waiting() -> None:
    q = WriterQueue(timeout=30)
    order: list[str] = []
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with q.turn(URL):
            held.set()
            release.wait(30)
            order.append("holder")

    def writer(name: str, urgent: bool) -> None:
        with q.turn(URL, urgent=urgent):
            order.append(name)

    h = threading.Thread(target=holder)
    h.start()
    assert held.wait(30)
    ordinary = [threading.Thread(target=writer, args=(f"w{i}", False)) for i in range(4)]
    for t in ordinary:
        t.start()
    lease = threading.Thread(target=writer, args=("lease", True))
    lease.start()
    _wait_until(lambda: q._urgent == 1)  # the renewal is queued behind the holder
    release.set()
    for t in [h, lease, *ordinary]:
        t.join(30)
    # the renewal first, then the others (in no promised order)
    assert order[:2] == ["holder", "lease"]
    assert sorted(order[2:]) == ["w0", "w1", "w2", "w3"]
    with q.turn(URL):  # free again, nobody left counted as waiting
        pass
    assert q._urgent == 0


@pytest.mark.serial  # each renewal within 1 s under 16 writers: alone, not beside other tests
def test_a_controller_keeps_its_leases_under_its_own_bulk_writes(db_url: str) -> None:
    """Sixteen threads make fenced writes back to back (each transaction 80 ms, like a large
    report batch or scheduling pass) while the lease loop renews every 0.75 s with a 3 s TTL,
    the controller's defaults. Every renewal must get its turn within the current
    transaction, so the leases are taken once and never lost or retaken. On PostgreSQL each
    fenced write locks the lease row (FOR UPDATE): without the queue the writers' lock waits
    on that row lined up ahead of the renewal."""
    store = Store(db_url)
    store.migrate()
    with store.db.begin() as c:
        c.execute(text("CREATE TABLE bulk (v INTEGER)"))
    changes: list[tuple[str, int | None]] = []
    keeper = LeaseKeeper(
        store,
        "c1",
        ["cluster", "sched:batch"],
        ttl=3.0,
        renew_interval=0.75,
        on_change=lambda name, term: changes.append((name, term)),
    )
    renewals: list[float] = []
    real_renew = store.renew_lease

    def timed_renew(name: str, holder: str, term: int, ttl: float) -> bool:
        t0 = time.monotonic()
        try:
            return real_renew(name, holder, term, ttl)
        finally:
            renewals.append(time.monotonic() - t0)

    store.renew_lease = timed_renew  # type: ignore[method-assign]
    stop = threading.Event()
    errors: list[BaseException] = []

    def bulk_writer() -> None:
        try:
            while not stop.is_set():
                with store.db.begin() as c:
                    store._check_fence(c, Fence("sched:batch", "c1", 1))
                    c.execute(text("INSERT INTO bulk VALUES (1)"))
                    time.sleep(0.08)  # the transaction's work, holding the write turn
        except BaseException as e:
            errors.append(e)

    try:
        assert "took" in keeper.tick()
        writers = [threading.Thread(target=bulk_writer) for _ in range(16)]
        for t in writers:
            t.start()
        end = time.monotonic() + 8.0
        while time.monotonic() < end:
            keeper.tick()
            assert keeper.held("cluster") and keeper.held("sched:batch"), (changes, renewals)
            stop.wait(0.75)
        stop.set()
        for t in writers:
            t.join(30)
        assert errors == []
        # taken once each at the start, never lost nor retaken under the write load
        assert sorted(changes) == [("cluster", 1), ("sched:batch", 1)], changes
        # each renewal waited for one 80 ms transaction at most, not for the queue
        assert max(renewals) < 1.0, sorted(renewals)[-5:]
        assert len(renewals) >= 10
        with store.db.begin(write=False) as c:
            assert c.execute(text("SELECT COUNT(*) FROM bulk")).scalar_one() > 50
    finally:
        stop.set()
        store.close()
