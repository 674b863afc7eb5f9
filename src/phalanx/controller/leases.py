"""Holding duty leases: a local monotonic deadline that only a successful renewal extends.

`LeaseKeeper.held(name)` is what a duty checks before (and during) its work: past the deadline
it is False at once, even if the renewal thread is stuck, so a paused controller stops acting
before anyone else can take over (the store's fencing check catches anything in flight).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.clock import Clock, SystemClock
from phalanx.domain.spread import handoff, preferred
from phalanx.errors import PhalanxError
from phalanx.store.store import Fence
from phalanx.store.surface import LeaseStore

log = logging.getLogger(__name__)


@dataclass
class _Held:
    term: int
    deadline: float  # monotonic


class LeaseKeeper:
    def __init__(
        self,
        store: LeaseStore,  # only its leases: the keeper writes nothing else
        holder: str,
        names: list[str],
        *,
        ttl: float,
        renew_interval: float,
        clock: Clock | None = None,
        on_change: Callable[[str, int | None], None] | None = None,
        peers: Callable[[], list[str]] | None = None,
    ) -> None:
        self.store = store
        self.holder = holder
        self.names = names
        self.ttl = ttl
        self.renew_interval = renew_interval
        self.clock = clock or SystemClock()
        self.on_change = on_change
        self.peers = peers  # live controllers (ids), to spread leases; None = take everything
        self.stable_after = 3 * ttl  # a peer gets handovers once live this long
        self._live_since: dict[str, float] = {}
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def fence(self, name: str) -> Fence | None:
        """The fence for a duty if it is held right now, else None."""
        with self._lock:
            h = self._held.get(name)
            if h is None or self.clock.monotonic() >= h.deadline:
                return None
            return Fence(name, self.holder, h.term)

    def held(self, name: str) -> bool:
        return self.fence(name) is not None

    def terms(self) -> dict[str, int]:
        with self._lock:
            now = self.clock.monotonic()
            return {n: h.term for n, h in self._held.items() if now < h.deadline}

    def tick(self) -> str:
        """Try to take or renew every lease once; return one sentence for the log.

        With `peers`, leases are spread (domain/spread.py): a lease whose preferred holder is
        another live controller is handed over (one per tick), and a free lease is taken at
        once by its preferred holder, by the others only after it stayed free for two
        renewal intervals (so a dead preferred holder is replaced, never waited for).
        """
        parts = []
        live = self._live()
        given = self._hand_over(live)
        if given:
            parts.append(f"{given}: handed over to {preferred(given, live or [])}")
        store_error: PhalanxError | None = None
        for name in self.names:
            if name == given:
                continue
            start = self.clock.monotonic()
            with self._lock:
                h = self._held.get(name)
            try:
                if store_error is not None:
                    # one unreachable store is enough to know: each further try could cost a
                    # full connect timeout and stall this loop past its liveness bound
                    raise store_error
                if h is not None and start < h.deadline:
                    ok = self.store.renew_lease(name, self.holder, h.term, self.ttl)
                    term: int | None = h.term if ok else None
                else:
                    mine = live is None or preferred(name, live) == self.holder
                    term = self.store.acquire_lease(
                        name,
                        self.holder,
                        self.ttl,
                        after_expiry=0.0 if mine else self.renew_interval,
                    )
                    if h is not None and term != h.term:
                        log.warning(
                            "lease %s term %s lapsed while this controller was stalled%s",
                            name,
                            h.term,
                            f"; retaken under term {term}" if term else "; another holds it",
                        )
            except PhalanxError as e:
                if store_error is None:
                    log.warning("lease %s: store error: %s", name, e)
                store_error = e
                term = None if h is None or start >= h.deadline else -1
            if term == -1:
                parts.append(f"{name}: kept until deadline (store error)")
                continue
            with self._lock:
                before = self._held.get(name)
                if term is None:
                    self._held.pop(name, None)
                else:
                    # the deadline counts from before the call: the database may have
                    # stamped expiry at any moment during it
                    self._held[name] = _Held(term, start + self.ttl)
            if term is None:
                if before is not None:
                    log.warning("lost lease %s (term %s)", name, before.term)
                    parts.append(f"{name}: lost")
                    if self.on_change:
                        self.on_change(name, None)
            else:
                # A lease that lapsed locally (its deadline passed while the store or this
                # process was stuck) counts as newly taken even with the same term, so duties
                # restart their grace instead of acting on what they saw before.
                if before is None or before.term != term or before.deadline <= start:
                    log.info("took lease %s term %s", name, term)
                    parts.append(f"{name}: took term {term}")
                    if self.on_change:
                        self.on_change(name, term)
        return "; ".join(parts) or "leases unchanged"

    def _live(self) -> list[str] | None:
        if self.peers is None:
            return None
        try:
            return sorted(set(self.peers()) | {self.holder})
        except PhalanxError as e:
            log.warning("cannot read the live controllers: %s", e)
            return None

    def _hand_over(self, live: list[str] | None) -> str | None:
        """Release one lease another live controller should hold (a controller joined).

        Only to peers that have been live for a while (`stable_after`), so a controller that
        flickers (a pause, a slow restart) does not pull leases back and forth."""
        if live is None:
            return None
        now = self.clock.monotonic()
        for gone in set(self._live_since) - set(live):
            del self._live_since[gone]
        for peer in live:
            self._live_since.setdefault(peer, now)
        stable = [
            p for p in live if p == self.holder or now - self._live_since[p] >= self.stable_after
        ]
        if len(stable) < 2:
            return None
        name = handoff(self.terms(), self.holder, stable)
        if name is None:
            return None
        with self._lock:
            h = self._held.pop(name, None)
        if h is None:
            return None
        try:
            self.store.release_lease(name, self.holder, h.term)
        except PhalanxError as e:
            log.warning("could not release lease %s: %s", name, e)
        log.info("handing lease %s (term %s) over to %s", name, h.term, preferred(name, live))
        if self.on_change:
            self.on_change(name, None)
        return name

    def release(self, names: list[str] | None = None) -> None:
        """Hand back these leases (None: every one held) and say so to `on_change`: a
        partition a new configuration version no longer has, or a controller that stops
        taking duties (controller/confversions.py)."""
        with self._lock:
            picked = list(self._held) if names is None else [n for n in names if n in self._held]
            held = {n: self._held.pop(n) for n in picked}
        for name, h in held.items():
            try:
                self.store.release_lease(name, self.holder, h.term)
            except PhalanxError as e:
                log.warning("could not release lease %s: %s", name, e)
            log.info("handed lease %s (term %s) back", name, h.term)
            if self.on_change:
                self.on_change(name, None)

    def release_all(self) -> None:
        with self._lock:
            held = dict(self._held)
            self._held.clear()
        for name, h in held.items():
            try:
                self.store.release_lease(name, self.holder, h.term)
            except PhalanxError as e:
                log.warning("could not release lease %s: %s", name, e)
