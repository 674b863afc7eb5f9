"""The `cluster` duty: the failure detector, the reaper, maintenance, reservations' starts and
ends, retention, fair share usage.

Only the holder of the `cluster` lease acts. `ClusterDuty.judge_nodes` marks silent nodes DOWN
(their tasks failed in the same fenced write), fails tasks left on DOWN nodes and requeues
launches no agent confirmed; a new holder first waits one full `node_down_timeout` (`since`),
and so does a holder whose heartbeats could not be recorded, so that an outage of the control
plane never looks like a dead cluster. The fence is asked for again before every verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from phalanx.clock import Clock, SystemClock
from phalanx.config import Config, Timing
from phalanx.controller.fairshare import FairShare
from phalanx.controller.heartbeats import Heartbeats
from phalanx.controller.leases import LeaseKeeper
from phalanx.controller.maintenance import MaintenanceDuty
from phalanx.controller.reservations import ReservationDuty
from phalanx.domain.detector import silent_nodes
from phalanx.errors import StoreUnavailable
from phalanx.store.store import Fence
from phalanx.store.surface import HistoryStore, NodeStore

CLUSTER_LEASE = "cluster"
PURGE_EVERY = 60.0  # seconds between two accounting-retention purges of the cluster duty


class ClusterStore(NodeStore, HistoryStore, Protocol):
    """What the duty asks of the store: the detector's reads and fenced writes, the database
    clock, and the retention purge."""


class ClusterDuty:
    def __init__(
        self,
        store: ClusterStore,
        config: Config,
        leases: LeaseKeeper,
        timing: Callable[[], Timing],
        *,
        heartbeats: Heartbeats,
        maintenance: MaintenanceDuty,
        reservations: ReservationDuty | None = None,
        fairshare: FairShare,
        rescale: Callable[[], str],
        kick: Callable[[], None],
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.leases = leases
        self.timing = timing  # the timings in force (controller/timings.py)
        self.heartbeats = heartbeats  # heard but not yet written: alive
        self.maintenance = maintenance
        self.reservations = reservations
        self.fairshare = fairshare
        self.rescale = rescale  # the heartbeat rule, from the node count read afresh
        self.kick = kick
        # the detector's clock (its grace, the purge and charge periods): a test moves it
        self.clock = clock or SystemClock()
        self.since: float | None = None  # monotonic time the cluster duty was taken
        self._last_purge: float | None = None  # monotonic time of the last retention purge
        self._last_charge: float | None = None  # monotonic time usage was last charged

    def interval(self) -> float:
        """Seconds between two ticks of the cluster duty."""
        return min(1.0, self.timing().node_down_timeout / 4)

    def lease_changed(self, term: int | None) -> None:
        """The `cluster` lease was taken (`term`) or lost (None)."""
        self.since = self.clock.monotonic() if term is not None else None

    def restart_grace(self) -> None:
        """Heartbeats could not be recorded: judge no node until a full timeout of fresh
        heartbeats has been seen again."""
        if self.since is not None:
            self.since = self.clock.monotonic()

    def tick(self) -> str:
        """Failure detector, reaper, maintenance windows and reservations; only the holder of
        the `cluster` lease acts."""
        try:
            said = [
                self.judge_nodes(),
                self.maintenance.tick(),
                self.reservations.tick() if self.reservations is not None else "idle",
                self.purge_tick(),
                self.charge_tick(),
            ]
            return ", ".join(x for x in said if x not in ("idle", "")) or "idle"
        except StoreUnavailable:
            # Heartbeats could not be recorded while the store was away: judge no node until
            # a full timeout of fresh heartbeats has been seen again.
            self.restart_grace()
            raise

    def purge_tick(self, *, now: float | None = None, force: bool = False) -> str:
        """Accounting retention: delete jobs that ended longer than `accounting.keep_finished`
        ago (with their attempts, tasks and events), in batches, at most once a minute and only
        by the `cluster` lease holder. A tick deletes at most 20 batches, so a first purge of a
        big history spreads over several minutes instead of holding the store."""
        keep = self.config.accounting.keep_seconds()
        if keep is None or self.leases.fence(CLUSTER_LEASE) is None:
            return ""
        mono = self.clock.monotonic()
        if not force and self._last_purge is not None and mono - self._last_purge < PURGE_EVERY:
            return ""
        self._last_purge = mono
        cutoff = (self.clock.time() if now is None else now) - keep
        batch = self.config.accounting.purge_batch
        total = 0
        for _ in range(20):
            n = self.store.purge_finished(cutoff, batch=batch)
            total += n
            if n < batch or self.leases.fence(CLUSTER_LEASE) is None:
                break
        return f"purged {total} finished jobs" if total else ""

    def charge_tick(self, *, force: bool = False) -> str:
        """Fair share usage: charge what running and ended attempts held and decay every
        association's usage, once per `priority.calc_period`, by the `cluster` lease holder
        only (the charge and the attempts' marks commit together under its fence)."""
        fence = self.leases.fence(CLUSTER_LEASE)
        if fence is None:
            return ""
        mono = self.clock.monotonic()
        period = self.config.priority.calc_period
        if not force and self._last_charge is not None and mono - self._last_charge < period:
            return ""
        self._last_charge = mono
        self.fairshare.charge(fence)
        return ""

    def _judging_fence(self) -> Fence | None:
        """The cluster lease's fence if this controller may judge nodes right now.

        A new holder first waits one full timeout (an outage of the control plane must never
        look like a dead cluster). Asked again before every verdict is applied: a tick that
        was stalled (a paused process, a hung store) must not act on what it read before.
        """
        fence = self.leases.fence(CLUSTER_LEASE)
        since = self.since
        if fence is None or since is None:
            return None
        if self.clock.monotonic() - since < self.timing().node_down_timeout:
            return None
        return fence

    def judge_nodes(self) -> str:
        """The failure detector and the reaper: silent nodes DOWN, tasks left on DOWN nodes
        failed, launches no agent confirmed requeued."""
        if self._judging_fence() is None:
            return "idle"
        said = []
        # the count afresh, before the silent nodes: at least what any reply they applied
        # was scaled for (Timings.rescale)
        self.rescale()
        timing = self.timing()
        unflushed = self.heartbeats.unflushed()
        # silence counts up to the time through which every live controller's heartbeats
        # are stored, not up to now (domain/detector.py, heard_horizon)
        _db_now, horizon = self.store.heard_horizon(timing.heard_window())
        verdicts = silent_nodes(
            self.store.silent_node_rows(horizon - timing.node_down_timeout),
            horizon,
            timing.node_down_timeout,
            heard_recently=unflushed,
        )
        for name, reason in verdicts:
            fence = self._judging_fence()
            if fence is None:
                return "lost the right to judge nodes mid-cycle; nothing more applied"
            if self.heartbeats.pending(name):  # heard from since the read: alive
                continue
            # its tasks fail in the same write, which checks the silence again (another
            # controller may have written a heartbeat of the node since the read)
            in_force = self.timing()
            if self.store.mark_down(
                name,
                reason,
                fence,
                silent_for=in_force.node_down_timeout,
                heard_window=in_force.heard_window(),
            ):
                said.append(f"{name} DOWN")
                self.kick()
        for name in self.store.down_nodes_with_tasks():
            fence = self._judging_fence()
            if fence is None:
                return "lost the right to judge nodes mid-cycle; nothing more applied"
            if self.store.fail_node_tasks(name, f"node {name} is DOWN", fence):
                said.append(f"live tasks failed on DOWN node {name}")
                self.kick()
        fence = self._judging_fence()
        if fence is None:
            return ", ".join(said) or "idle"
        launch_timeout = self.timing().launch_timeout
        for att in self.store.stale_starting_attempts(self.clock.time() - launch_timeout):
            if self.store.requeue_lost_launch(
                att["id"],
                f"no agent confirmed the launch within {launch_timeout:g}s",
                fence,
            ):
                said.append(f"attempt {att['id']} launch timed out")
                self.kick()
        return ", ".join(said) or "idle"
