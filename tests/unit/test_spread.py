"""Spreading duty leases over live controllers: rendezvous preference, handover, takeover."""

from __future__ import annotations

from pathlib import Path

from phalanx.clock import FakeClock
from phalanx.controller.leases import LeaseKeeper
from phalanx.domain.spread import handoff, preferred
from phalanx.store.store import Store

LEASES = ["cluster", *(f"sched:p{i}" for i in range(12))]


def test_preference_is_deterministic_and_spreads() -> None:
    live = ["a", "b", "c"]
    owners = [preferred(name, live) for name in LEASES]
    assert owners == [preferred(name, reversed(live)) for name in LEASES]
    assert set(owners) == {"a", "b", "c"}  # 13 leases land on all three
    assert preferred("x", []) is None


def test_a_controller_leaving_moves_only_its_leases() -> None:
    before = {n: preferred(n, ["a", "b", "c"]) for n in LEASES}
    after = {n: preferred(n, ["a", "b"]) for n in LEASES}
    moved = {n for n in LEASES if before[n] != after[n]}
    assert moved == {n for n in LEASES if before[n] == "c"}


def test_handoff_gives_up_one_lease_that_another_should_hold() -> None:
    mine = [n for n in LEASES if preferred(n, ["a", "b"]) == "a"]
    assert handoff(mine, "a", ["a", "b"]) is None
    theirs = next(n for n in LEASES if preferred(n, ["a", "b"]) == "b")
    assert handoff([*mine, theirs], "a", ["a", "b"]) == theirs


def test_two_keepers_share_the_leases_and_a_survivor_takes_all(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    try:
        clock = FakeClock()
        live = {"a", "b"}

        def keeper(cid: str) -> LeaseKeeper:
            return LeaseKeeper(
                store,
                cid,
                LEASES,
                ttl=0.5,
                renew_interval=0.1,
                clock=clock,
                peers=lambda: sorted(live),
            )

        a, b = keeper("a"), keeper("b")
        for _ in range(3):
            a.tick()
            b.tick()
        held_a, held_b = set(a.terms()), set(b.terms())
        assert not held_a & held_b
        assert held_a | held_b == set(LEASES)
        assert held_a == {n for n in LEASES if preferred(n, ["a", "b"]) == "a"}

        live.discard("b")  # b dies: after its leases expire, a takes them over
        import time

        deadline = time.monotonic() + 10
        while set(a.terms()) != set(LEASES):
            assert time.monotonic() < deadline, a.terms()
            clock.advance(0.1)
            a.tick()
            time.sleep(0.05)  # the store's clock (database time) must pass the 0.5 s TTL
        assert all(a.terms()[n] == 2 for n in held_b)  # taken over: the term was bumped
    finally:
        store.close()  # its WAL checkpoint thread, which tests/store counts
