"""Agent heartbeats, batched: heard in memory on the request path, written in one flush.

`Heartbeats` owns the nodes heard since the last flush (node -> monotonic time last heard)
and the flush that stamps them in the store with the database's clock (`now - age`). A
heartbeat stays in the batch until its flush commits, and the failure detector counts the
batch as heard (`unflushed`, `pending`), so a node is never judged silent while its heartbeat
is on its way to the store. Apart from the exchange so that the detector's view of "heard" and
the flush that empties it share one lock and nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import Counter

from phalanx.clock import Clock, SystemClock
from phalanx.errors import StoreUnavailable
from phalanx.store.surface import AgentExchange

HEARTBEATS = Counter("phalanx_heartbeats_total", "Agent heartbeats received by this controller")


class Heartbeats:
    def __init__(
        self,
        store: AgentExchange,  # only record_heartbeats
        *,
        kick: Callable[[], None],
        unrecorded: Callable[[], None],
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.kick = kick  # a node came back: the scheduler may place on it
        # a flush failed for want of the store: the failure detector restarts its grace
        self.unrecorded = unrecorded
        self.clock = clock or SystemClock()  # when a node was heard (monotonic)
        self._beats: dict[str, float] = {}  # node -> monotonic time last seen
        self._lock = threading.Lock()

    def seen(self, node: str) -> None:
        HEARTBEATS.inc()
        with self._lock:
            self._beats[node] = self.clock.monotonic()

    def unflushed(self) -> list[str]:
        """The nodes heard since the last flush that committed."""
        with self._lock:
            return list(self._beats)

    def pending(self, node: str) -> bool:
        """Whether `node` was heard since the last flush that committed."""
        with self._lock:
            return node in self._beats

    def flush(self) -> str:
        """Write the heartbeats heard since the last flush. They stay in the batch until the
        write commits: the failure detector counts them as heard (`heard_recently`), so a
        node is never judged silent while its heartbeat is on its way to the store."""
        with self._lock:
            beats = dict(self._beats)
        if not beats:
            return "idle"
        now = self.clock.monotonic()
        try:
            back = self.store.record_heartbeats({n: now - t for n, t in beats.items()})
            with self._lock:
                for n, t in beats.items():
                    if self._beats.get(n) == t:  # not heard again meanwhile
                        del self._beats[n]
        except StoreUnavailable:
            self.unrecorded()  # see ClusterDuty.tick
            raise
        if back:
            self.kick()
            return f"back in service: {', '.join(back)}"
        return "idle"
