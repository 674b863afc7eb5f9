"""Agent heartbeats, batched: heard in memory on the request path, written in one flush.

`Heartbeats` owns the nodes heard since the last flush (node -> monotonic time last heard)
and the flush that stamps them in the store with the database's clock (`now - age`). A
heartbeat stays in the batch until its flush commits, and the failure detector counts the
batch as heard (`unflushed`, `pending`), so a node is never judged silent while its heartbeat
is on its way to the store. Apart from the exchange so that the detector's view of "heard" and
the flush that empties it share one lock and nothing else.

The cluster configuration version whose node settings an agent says it runs comes with its
heartbeat and is written by the flush too, in a write of its own, only when it differs from
what this controller last wrote for the node (once per node and version; `phalanx nodes` and
`scontrol show node` show it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prometheus_client import Counter

from phalanx.clock import Clock, SystemClock
from phalanx.errors import PhalanxError, StoreUnavailable
from phalanx.store.surface import AgentExchange

log = logging.getLogger("phalanx.controller")

HEARTBEATS = Counter("phalanx_heartbeats_total", "Agent heartbeats received by this controller")


class Heartbeats:
    def __init__(
        self,
        store: AgentExchange,  # only record_heartbeats and record_config_versions
        cid: str,
        *,
        kick: Callable[[], None],
        unrecorded: Callable[[], None],
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.cid = cid  # whose flushed_through mark each flush advances
        self.kick = kick  # a node came back: the scheduler may place on it
        # a flush failed for want of the store: the failure detector restarts its grace
        self.unrecorded = unrecorded
        self.clock = clock or SystemClock()  # when a node was heard (monotonic)
        self._beats: dict[str, float] = {}  # node -> monotonic time last seen
        self._versions: dict[str, int] = {}  # node -> config version its agent last said
        self._written: dict[str, int] = {}  # node -> the version this controller stored
        # everything heard before this (monotonic) is stored: the batch time of the last flush
        # that committed, or when the controller registered (its mark set to then). None
        # until then: a controller that has not started (in-process tests drive its ticks
        # by hand) has no mark that detectors wait for, and no lag
        self._stored_through: float | None = None
        self._lock = threading.Lock()

    def marked(self) -> None:
        """The store just set this controller's mark to now (`register_controller`)."""
        with self._lock:
            self._stored_through = max(self._stored_through or 0.0, self.clock.monotonic())

    def lag(self) -> float:
        """Seconds since the moment through which all this controller heard is stored. While
        it exceeds Timing.flush_lag_limit the controller answers no heartbeat: the failure
        detectors stop waiting for its mark after Timing.heard_window, and by then every
        agent it answered must have fenced."""
        with self._lock:
            if self._stored_through is None:
                return 0.0
            return self.clock.monotonic() - self._stored_through

    def seen(self, node: str, config_version: int | None = None) -> None:
        HEARTBEATS.inc()
        with self._lock:
            self._beats[node] = self.clock.monotonic()
            if config_version is not None:
                self._versions[node] = config_version

    def unflushed(self) -> list[str]:
        """The nodes heard since the last flush that committed."""
        with self._lock:
            return list(self._beats)

    def pending(self, node: str) -> bool:
        """Whether `node` was heard since the last flush that committed."""
        with self._lock:
            return node in self._beats

    def flush(self, *, final: bool = False) -> str:
        """Write the heartbeats heard since the last flush. They stay in the batch until the
        write commits: the failure detector counts them as heard (`heard_recently`), so a
        node is never judged silent while its heartbeat is on its way to the store.

        Every flush, even of no heartbeat, also advances this controller's mark: all it heard
        before it took the batch is stored. Every detector counts a node's silence only up to
        the earliest mark of the live controllers (domain/detector.py, `heard_horizon`), so a
        controller that cannot flush holds them back rather than let them declare DOWN a node
        whose heartbeat it holds. `final`: the controller's HTTP server has stopped, so
        nothing more will be heard; the mark is cleared with this last batch."""
        with self._lock:
            beats = dict(self._beats)
            taken = self.clock.monotonic()  # all heard before this is in `beats` or stored
            versions = {n: v for n, v in self._versions.items() if self._written.get(n) != v}
        now = self.clock.monotonic()
        try:
            back = self.store.record_heartbeats(
                {n: now - t for n, t in beats.items()},
                controller=self.cid,
                flushed_age=now - taken,
                retire=final,
            )
            with self._lock:
                for n, t in beats.items():
                    if self._beats.get(n) == t:  # not heard again meanwhile
                        del self._beats[n]
                if self._stored_through is not None:  # started: see __init__
                    self._stored_through = max(self._stored_through, taken)
        except StoreUnavailable:
            self.unrecorded()  # see ClusterDuty.tick
            raise
        if versions:  # rare (a new version, a controller's first flush): a write of its own
            try:
                self.store.record_config_versions(versions)
            except PhalanxError as e:  # shown, not safety: tried again by the next flush
                log.warning("could not record the nodes' configuration versions: %s", e.message)
            else:
                with self._lock:
                    self._written.update(versions)
        if back:
            self.kick()
            return f"back in service: {', '.join(back)}"
        return "idle"
