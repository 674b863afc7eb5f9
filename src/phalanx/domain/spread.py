"""Which controller should hold which duty lease (pure).

Rendezvous hashing over the live controllers: every controller computes the same preferred
holder for each lease from the same list, a lease moves only when its preferred holder joins or
leaves, and adding a controller moves about 1/N of the leases. The lease itself (a CAS in the
store with a fencing term) stays the only source of truth; preference only decides who tries
first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _score(lease: str, controller: str) -> bytes:
    return hashlib.sha256(f"{lease}\0{controller}".encode()).digest()


def preferred(lease: str, live: Iterable[str]) -> str | None:
    """The live controller that should hold `lease`, or None when none is live."""
    return max(live, key=lambda c: _score(lease, c), default=None)


def handoff(held: Iterable[str], me: str, live: Iterable[str]) -> str | None:
    """One lease this controller holds but another live controller should: give it up.

    At most one per call, so a rebalance after a controller joins is gradual and every duty
    has a holder again within a renewal interval."""
    peers = sorted(set(live) | {me})
    for lease in sorted(held):
        want = preferred(lease, peers)
        if want is not None and want != me:
            return lease
    return None
