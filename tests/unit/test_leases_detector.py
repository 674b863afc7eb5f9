"""LeaseKeeper (local deadlines over the store's leases) and the failure detector's verdict."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.clock import FakeClock
from phalanx.controller.leases import LeaseKeeper
from phalanx.domain.detector import heard_horizon, silent_nodes
from phalanx.store.store import Store
from schema_copy import fresh_db


@pytest.fixture
def store(tmp_path: Path, schema_db: Path) -> Iterator[Store]:
    st = Store(fresh_db(schema_db, tmp_path / "db.sqlite"))
    yield st
    st.close()  # its WAL checkpoint thread, which tests/store counts


def keeper(store: Store, clock: FakeClock, changes: list[tuple[str, int | None]]) -> LeaseKeeper:
    return LeaseKeeper(
        store,
        "ctl-a",
        ["cluster"],
        ttl=30.0,
        renew_interval=1.0,
        clock=clock,
        on_change=lambda name, term: changes.append((name, term)),
    )


def test_holds_until_its_local_deadline_only(store: Store) -> None:
    clock, changes = FakeClock(), []
    k = keeper(store, clock, changes)
    k.tick()
    assert k.held("cluster") and changes == [("cluster", 1)]
    clock.advance(29.9)
    assert k.held("cluster")
    clock.advance(0.2)  # no renewal succeeded: the duty stops at once
    assert not k.held("cluster")
    assert k.fence("cluster") is None


def test_a_lapsed_lease_retaken_with_the_same_term_counts_as_new(store: Store) -> None:
    clock, changes = FakeClock(), []
    k = keeper(store, clock, changes)
    k.tick()
    k.tick()  # a plain renewal is not a change
    assert changes == [("cluster", 1)]
    clock.advance(31.0)  # stalled past the deadline (nobody else took it: same term)
    k.tick()
    assert k.held("cluster")
    assert changes == [("cluster", 1), ("cluster", 1)]  # duties restart their grace


def test_another_holder_cannot_take_a_valid_lease(store: Store) -> None:
    clock = FakeClock()
    a = keeper(store, clock, [])
    a.tick()
    b = LeaseKeeper(store, "ctl-b", ["cluster"], ttl=30.0, renew_interval=1.0, clock=clock)
    b.tick()
    assert a.held("cluster") and not b.held("cluster")


def node(name: str, last: float | None, *, down: bool = False, registered: bool = True) -> dict:
    return {"name": name, "registered": registered, "down": down, "last_heartbeat": last}


def test_detector_names_only_registered_live_nodes_silent_too_long() -> None:
    nodes = [
        node("quiet", 80.0),
        node("fresh", 95.0),
        node("already-down", 10.0, down=True),
        node("never", None),
        node("unregistered", 10.0, registered=False),
        node("unflushed", 10.0),
    ]
    verdicts = silent_nodes(nodes, 100.0, 10.0, heard_recently=["unflushed"])
    assert [n for n, _ in verdicts] == ["quiet"]
    assert "no heartbeat for 20.0s" in verdicts[0][1]
    assert "node_down_timeout 10s" in verdicts[0][1]


def test_detector_boundary_is_strictly_longer_than_the_timeout() -> None:
    assert silent_nodes([node("n", 90.0)], 100.0, 10.0) == []
    assert silent_nodes([node("n", 89.9)], 100.0, 10.0)


def test_the_heard_horizon_waits_for_a_lagging_controller_within_the_timeout() -> None:
    """Silence counts only up to the earliest flushed-through mark of the live controllers:
    one 4 s behind holds the horizon 4 s back; one behind by more than the window (stopped
    or cut off that long: its agents have fenced) and one of an earlier release (no mark)
    hold nothing back; with no one behind, the horizon is now."""
    assert heard_horizon(100.0, [99.5, 96.0], window=10.0) == 96.0
    assert heard_horizon(100.0, [99.5, 89.0, None], window=10.0) == 99.5
    assert heard_horizon(100.0, [], window=10.0) == 100.0
    assert heard_horizon(100.0, [100.3], window=10.0) == 100.0  # a mark is never past now
    # a verdict that "now" would give is held while a controller lags
    late = [node("n", 88.0)]
    assert silent_nodes(late, 100.0, 10.0)
    assert silent_nodes(late, heard_horizon(100.0, [97.0], window=10.0), 10.0) == []


def test_an_unreachable_store_costs_one_call_per_tick_not_one_per_lease(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call to a hung database can take a full timeout; a tick must not multiply it."""
    from phalanx.errors import StoreUnavailable

    clock = FakeClock()
    names = ["cluster", "sched:a", "sched:b", "sched:c"]
    k = LeaseKeeper(store, "ctl-a", names, ttl=30.0, renew_interval=1.0, clock=clock)
    k.tick()
    assert all(k.held(n) for n in names)
    calls: list[str] = []

    def down(name: str, *a: object, **kw: object) -> bool:
        calls.append(name)
        raise StoreUnavailable("database unreachable")

    monkeypatch.setattr(store, "renew_lease", down)
    monkeypatch.setattr(store, "acquire_lease", down)
    clock.advance(1.0)
    summary = k.tick()
    assert len(calls) == 1
    assert all(k.held(n) for n in names)  # kept until their local deadlines
    assert summary.count("kept until deadline") == len(names)
    clock.advance(30.0)
    k.tick()
    assert not any(k.held(n) for n in names)
