"""The store's Protocols (store/surface.py) and `Store`'s public methods are the same set: a
method added to the store without a place in a part, or a part naming a method the store lost,
fails here (mypy checks the signatures: `surface._store_satisfies_every_part`)."""

from __future__ import annotations

import inspect
from collections import Counter

from phalanx.store import surface
from phalanx.store.store import Store


def members(proto: type) -> set[str]:
    return {
        name
        for name, value in vars(proto).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }


def public_methods(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def test_the_parts_and_the_store_have_the_same_methods() -> None:
    declared = set().union(*(members(p) for p in surface.PARTS))
    store = public_methods(Store)
    assert sorted(store - declared) == [], "a public Store method in no part of store/surface.py"
    assert sorted(declared - store) == [], "a part of store/surface.py names no Store method"


def test_each_method_is_in_one_part() -> None:
    counts = Counter(n for p in surface.PARTS for n in members(p))
    assert [n for n, c in counts.items() if c > 1] == []


def test_every_part_is_listed() -> None:
    protocols = {
        v
        for v in vars(surface).values()
        if isinstance(v, type)
        and getattr(v, "_is_protocol", False)
        and v.__module__ == surface.__name__
    }
    assert protocols == set(surface.PARTS)
