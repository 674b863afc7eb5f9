"""The dashboard's queue pages in the store, on SQLite and PostgreSQL: array tasks folded per
(array, state, partition), plain jobs one row each, in id order, filtered and paged in SQL."""

from __future__ import annotations

from test_store_contract import item, store, submit1

from phalanx.store.queue import queue_page
from phalanx.store.store import Store

__all__ = ["store"]


def test_arrays_fold_and_pages_follow_the_first_id(store: Store) -> None:
    (arr,) = store.submit([item(store, array="0-9")], "alice")
    store.hold([arr[3], arr[4]], "alice")
    plain = [submit1(store, "bob") for _ in range(3)]
    store.cancel([plain[1]], "bob")

    page = queue_page(store, states=[], user=None, partition=None, offset=0, limit=100)
    assert page.total_rows == 5
    assert page.by_state == {"PENDING": 10, "HELD": 2, "CANCELLED": 1}
    got = [(g.first["id"], g.count, g.first["state"], g.tasks) for g in page.groups]
    assert got == [
        (arr[0], 8, "PENDING", [0, 1, 2, 5, 6, 7, 8, 9]),
        (arr[3], 2, "HELD", [3, 4]),
        (plain[0], 1, "PENDING", None),
        (plain[1], 1, "CANCELLED", None),
        (plain[2], 1, "PENDING", None),
    ]

    second = queue_page(store, states=[], user=None, partition=None, offset=2, limit=2)
    assert [g.first["id"] for g in second.groups] == plain[:2]
    assert second.total_rows == 5
    past = queue_page(store, states=[], user=None, partition=None, offset=10, limit=2)
    assert past.groups == [] and past.total_rows == 5

    pending = queue_page(store, states=["PENDING"], user="bob", partition=None, offset=0, limit=9)
    assert [g.first["id"] for g in pending.groups] == [plain[0], plain[2]]
    assert pending.by_state == {"PENDING": 2} and pending.total_rows == 2
    none = queue_page(store, states=[], user=None, partition="other", offset=0, limit=9)
    assert none.groups == [] and none.total_rows == 0 and none.by_state == {}
