"""The controller: its duties composed, started and stopped, and the one object the API talks to.

`Controller` owns no duty's logic: each lives in its own module and is a plain `tick()` (or a
method the API calls) that reads, decides (pure), applies, and returns one sentence for the log.
The loops (controller/loops.py) run those ticks on threads; the HTTP side (api.py) runs on the
asyncio loop and calls the methods here, which hand each request to its duty:

- duty leases: controller/leases.py (`LeaseKeeper`);
- submissions: controller/intake.py (`Intake`), group commit in controller/submitq.py;
- the scheduling pass: controller/scheduler.py (`Scheduler`);
- the cluster duty (failure detector, reaper, maintenance, reservations, retention, usage):
  controller/clusterduty.py (`ClusterDuty`), controller/maintenance.py,
  controller/reservations.py;
- agents: controller/agentwork.py (`AgentDuty`: registrations, the heartbeat exchange),
  controller/heartbeats.py (`Heartbeats`: batched heartbeat stamps), controller/wakeups.py
  (`Waiters`, `WorkWakeups`: long-polls woken for new work), controller/intervals.py
  (checkpoint intervals in force);
- the timings in force: controller/timings.py (`Timings`, the heartbeat rule);
- the cluster configuration version it runs: controller/confversions.py (`ConfigVersions`,
  read each presence tick, swapped in by `adopt_config`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from phalanx.auth.keys import Key
from phalanx.clock import Clock
from phalanx.config import Config, Timing
from phalanx.config.versioned import local_part
from phalanx.controller.agentwork import AgentDuty
from phalanx.controller.clusterduty import CLUSTER_LEASE, ClusterDuty
from phalanx.controller.confversions import ConfigVersions, partition_rows
from phalanx.controller.exchange import Reply, StepReply
from phalanx.controller.fairshare import FairShare
from phalanx.controller.heartbeats import Heartbeats
from phalanx.controller.intake import Intake
from phalanx.controller.intervals import CheckpointIntervals
from phalanx.controller.leases import LeaseKeeper
from phalanx.controller.loops import Loop, LoopRunner
from phalanx.controller.maintenance import MaintenanceDuty
from phalanx.controller.reservations import ReservationDuty
from phalanx.controller.scheduler import Scheduler, sched_lease
from phalanx.controller.submitq import SubmitQueue
from phalanx.controller.timings import Timings
from phalanx.controller.wakeups import Waiters, WorkWakeups
from phalanx.domain.checkpointing import IntervalDecision
from phalanx.domain.spec import JobSpec
from phalanx.errors import PhalanxError
from phalanx.store.steps import StepReport
from phalanx.store.store import Store, TaskReport
from phalanx.watchdog import Beats

log = logging.getLogger("phalanx.controller")

# partition_rows moved to confversions.py; importable from here as before
__all__ = ["Controller", "partition_rows"]


class Controller:
    """One controller: its duties wired together (docs/architecture.md, the map). `clock`
    is the clock of its leases and its failure detector (when a node was heard, a new lease
    holder's grace, the purge and charge periods); tests pass a `FakeClock` to move it."""

    def __init__(
        self,
        store: Store,
        config: Config,
        *,
        cid: str,
        url: str | None = None,
        clock: Clock | None = None,
        local_config: Config | None = None,
        config_version: int | None = None,
    ) -> None:
        self.store = store
        self.config = config
        # the timings in force: config's, scaled by the heartbeat rule to the cluster's size
        # (rescale_timing); `agent_timing`, the scaled ones, goes with every heartbeat reply
        self.timings = Timings(store, config.timing)
        self.cid = cid
        self.url = url
        self.partition_names = [p.name for p in config.cluster.partitions]
        self.topology = config.topology.layout()
        self.leases = LeaseKeeper(
            store,
            cid,
            [CLUSTER_LEASE, *(sched_lease(p) for p in self.partition_names)],
            ttl=self.timing.lease_ttl,
            renew_interval=self.timing.renew_interval,
            on_change=self._lease_changed,
            peers=self.live_controllers,
            clock=clock,
        )
        self.waiters = Waiters()
        # progress of every loop (and of the store, when watchdog.store_timeout asks), for the
        # systemd watchdog (watchdog.py); the time of the store's last answer, for STATUS=
        self.beats = Beats()
        self.store_ok_at: float | None = None
        self.loops = LoopRunner(config, self._timing, self.beats)
        self.last_tick = self.loops.last_tick  # loop -> monotonic time of its last tick
        self.heartbeats = Heartbeats(
            store, cid, kick=self.kick, unrecorded=lambda: self.cluster.restart_grace(), clock=clock
        )
        self.wakeups = WorkWakeups(store, self.waiters, self._timing)
        self.maintenance = MaintenanceDuty(
            store,
            lead=lambda: self.timing.maint_lead,
            tick=lambda: self.cluster_interval(),
            fence=lambda: self.leases.fence(CLUSTER_LEASE),
            kick=self.kick,
            notify=self.waiters.notify,
        )
        self.reservations = ReservationDuty(
            store,
            overrun=lambda: self.timing.overrun_s(),
            grace=lambda: self.timing.checkpoint_grace,
            tick=lambda: self.cluster_interval(),
            fence=lambda: self.leases.fence(CLUSTER_LEASE),
            kick=self.kick,
            notify=self.waiters.notify,
        )
        self.fairshare = FairShare(store, config)  # priority, fair share, limits
        self.intake = Intake(store, config, self.fairshare, self.kick)
        self.scheduler = Scheduler(
            store,
            config,
            self.leases,
            self.fairshare,
            topology=self.topology,
            waiters=self.waiters,
        )
        self.cluster = ClusterDuty(
            store,
            config,
            self.leases,
            self._timing,
            heartbeats=self.heartbeats,
            maintenance=self.maintenance,
            reservations=self.reservations,
            fairshare=self.fairshare,
            rescale=self.rescale_timing,
            kick=self.kick,
            clock=clock,
        )
        self.intervals = CheckpointIntervals(store, self._timing)
        self.agents = AgentDuty(
            store,
            config,
            self._timing,
            heartbeats=self.heartbeats,
            intervals=self.intervals,
            maintenance=self.maintenance,
            reservations=self.reservations,
            kick=self.kick,
            registered=self.intake.forget_views,
        )
        # node -> "host:port" its agent takes direct step launches at (AgentDuty)
        self.step_addrs = self.agents.step_addrs
        # POST /v1/jobs: concurrent one-job requests committed together (submitq.py)
        self.submitq = SubmitQueue(self.submit_group)
        # the cluster configuration version it runs (confversions.py); `local_config`: this
        # process's file, whose process-local sections stay in force whatever the version
        self._between_passes = threading.Lock()  # a new version is swapped in between passes
        self.versions = ConfigVersions(
            store,
            local_config or config,
            cid,
            config_version,
            adopt=self.adopt_config,
            stop_duties=self.stop_duties,
        )
        self.scheduler.config_check = self.versions.runs

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        # with what its file sets of the values the configuration's rules read across
        # sections: `config apply` holds a new version to every live controller's rules
        self.store.register_controller(self.cid, self.url, local_part(self.versions.local))
        self.heartbeats.marked()
        self.rescale_timing()  # before the first agent is answered: a restart knows the size
        self.start_listener()
        loops: list[Loop] = [
            ("leases", self.leases.tick, lambda: self.timing.renew_interval),
            ("scheduler", self.schedule_tick, lambda: self.timing.scheduler_interval),
            ("cluster", self.cluster.tick, self.cluster_interval),
            ("heartbeats", self.heartbeats.flush, lambda: self.timing.heartbeat_flush_interval),
            ("gens", self.wakeups.tick, self.wakeups.poll_interval),
            ("presence", self.presence_tick, lambda: self.timing.renew_interval),
        ]
        self.store_ok_at = time.monotonic()  # register_controller just answered
        self._store_answered()
        self.loops.start(loops)

    def stop(self) -> None:
        self.loops.stopping()
        self.wakeups.stop()
        self.loops.join()
        with contextlib.suppress(PhalanxError):
            self.heartbeats.flush(final=True)  # (the HTTP server has stopped: server.py)
        self.leases.release_all()

    def start_listener(self) -> None:
        """On PostgreSQL, listen for other controllers' work notifications (store/notify.py)."""
        if self.store.dialect != "postgresql" or self.wakeups.listener is not None:
            return
        # another controller's news wakes this one's scheduler, without news of its own
        self.wakeups.listen(
            self.store.db.connect_args(),
            op_timeout=self.timing.db_op_timeout,
            on_sched=self.loops.kick,
        )

    @property
    def timing(self) -> Timing:
        """The timings in force (controller/timings.py)."""
        return self.timings.current

    def _timing(self) -> Timing:
        return self.timings.current

    @property
    def agent_timing(self) -> dict[str, float]:
        """The scaled timings every heartbeat reply carries."""
        return self.timings.agent

    @property
    def timing_nodes(self) -> int:
        """The node count `timing` was scaled for."""
        return self.timings.nodes

    def rescale_timing(self, nodes: int | None = None) -> str:
        """The heartbeat rule applied to `nodes` node rows (read when None): Timings.rescale."""
        return self.timings.rescale(nodes)

    def cluster_interval(self) -> float:
        """Seconds between two ticks of the cluster duty."""
        return self.cluster.interval()

    def presence_tick(self) -> str:
        """Keep this controller's `last_seen` fresh: peers spread leases over the live ones,
        and `phalanx cluster` shows who is alive. Also the store probe of the watchdog, and
        the heartbeat rule's look at the cluster's size."""
        said = self.versions.presence()  # also reads the current configuration version
        self._store_answered()
        self.rescale_timing()
        return said or "idle"

    def adopt_config(self, config: Config) -> None:
        """Run a new cluster configuration version (ConfigVersions.move): swapped in whole,
        between two scheduling passes; the leases of partitions it no longer has are handed
        back, those of new ones taken by the next lease tick."""
        with self._between_passes:
            self.config = config
            self.timings.rebase(config.timing)
            self.partition_names = [p.name for p in config.cluster.partitions]
            self.topology = config.topology.layout()
            names = [CLUSTER_LEASE, *(sched_lease(p) for p in self.partition_names)]
            gone = [n for n in self.leases.names if n not in names]
            self.leases.names = names
            self.leases.ttl = config.timing.lease_ttl
            self.leases.renew_interval = config.timing.renew_interval
            self.leases.release(gone)
            self.fairshare = FairShare(self.store, config)
            for duty in (self.intake, self.scheduler, self.cluster, self.agents):
                duty.config = config
            self.intake.fairshare = self.fairshare
            self.scheduler.fairshare = self.fairshare
            self.cluster.fairshare = self.fairshare
            self.scheduler.partition_names = list(self.partition_names)
            self.scheduler.topology = self.topology
            self.intake.forget_views()
            self.store.policy = config.failure_policy()
            self.store.restart_reservation = config.timing.restart_reservation
        self.kick()

    def stop_duties(self) -> None:
        """Take no duty: hand every lease back and take none (a version this controller
        cannot run: ConfigVersions)."""
        self.leases.names = []
        self.leases.release()

    def _store_answered(self) -> None:
        self.store_ok_at = time.monotonic()
        timeout = self.config.watchdog.store_timeout
        if timeout > 0:
            self.beats.beat("store", timeout)

    def loop_deadline(self, interval: float) -> float:
        """How long a loop may go without progress before the watchdog calls it wedged."""
        return self.loops.deadline(interval)

    def stuck_loops(self) -> list[str]:
        """Loops that have not completed a tick for longer than lease_ttl (LoopRunner.stuck)."""
        return self.loops.stuck()

    def live_controllers(self) -> list[str]:
        """Controllers seen within one lease TTL (database clock), this one included: a dead
        controller stops being preferred as soon as its leases could expire."""
        return self.store.live_controllers(self.timing.lease_ttl)

    def _lease_changed(self, name: str, term: int | None) -> None:
        if name == CLUSTER_LEASE:
            self.cluster.lease_changed(term)
        if term is not None:
            with contextlib.suppress(PhalanxError):
                self.store.add_event(
                    "lease.take", f"{self.cid} took lease {name} term {term}", term=term
                )
            self.kick()

    def kick(self) -> None:
        """New work for a scheduling pass here, and for the other lease holders (Scheduler.news)."""
        self.scheduler.news()
        self.loops.kick()

    # ------------------------------------------------------------------ the API's calls
    def submit(
        self, specs: list[JobSpec], user: str, *, validate_only: bool = False
    ) -> list[list[int]]:
        """Validate and store jobs (Intake.submit)."""
        return self.intake.submit(specs, user, validate_only=validate_only)

    def submit_group(self, requests: list[tuple[JobSpec, str]]) -> list[list[int] | Exception]:
        """One-job submissions committed in one transaction (Intake.submit_group): the group
        commit of controller/submitq.py."""
        return self.intake.submit_group(requests)

    def plan_options(self, snap: Any) -> dict[str, Any]:
        """A scheduling pass's keywords besides the snapshot (Scheduler.plan_options)."""
        return self.scheduler.plan_options(snap)

    def schedule_tick(self) -> str:
        """One scheduling pass (Scheduler.tick), never while a new configuration version is
        being swapped in."""
        with self._between_passes:
            return self.scheduler.tick()

    def purge_tick(self, *, now: float | None = None, force: bool = False) -> str:
        """Accounting retention (ClusterDuty.purge_tick)."""
        return self.cluster.purge_tick(now=now, force=force)

    def seen(self, node: str, config_version: int | None = None) -> None:
        """A heartbeat of `node` (written by the next flush: Heartbeats), and the cluster
        configuration version whose node settings its agent says it runs."""
        self.heartbeats.seen(node, config_version)

    def register(self, node: str, info: dict[str, Any]) -> dict[str, Any]:
        return self.agents.register(node, info)

    def exchange(
        self,
        node: str,
        reports: list[TaskReport],
        taken_at: float | None,
        health: dict[str, Any] | None = None,
        step_reports: list[StepReport] | None = None,
    ) -> tuple[Reply, StepReply]:
        """Apply an agent's report and compute its reply (AgentDuty.exchange)."""
        return self.agents.exchange(node, reports, taken_at, health, step_reports)

    def launch_specs(self, reply: Reply, node: str) -> list[dict[str, Any]]:
        return self.agents.launch_specs(reply, node)

    def step_launch_specs(self, reply: StepReply, node: str) -> list[dict[str, Any]]:
        return self.agents.step_launch_specs(reply, node)

    def direct_launches(
        self, rows: list[dict[str, Any]], cluster_key: Key
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Signed direct step launches (AgentDuty.direct_launches)."""
        return self.agents.direct_launches(rows, cluster_key)

    def usage_requests(
        self, asks: dict[str, dict[str, Any]], cluster_key: Key
    ) -> tuple[dict[str, tuple[str, dict[str, Any]]], list[str]]:
        return self.agents.usage_requests(asks, cluster_key)

    def woke(self, gens: dict[str, int]) -> None:
        """Wake long-polls for work just committed (WorkWakeups.woke)."""
        self.wakeups.woke(gens)

    def seen_gens(self, gens: dict[str, int]) -> None:
        """Work generations taken as seen without a wakeup (WorkWakeups.seen_gens)."""
        self.wakeups.seen_gens(gens)

    def checkpoint_interval(self, job_row: dict[str, Any]) -> IntervalDecision:
        """The periodic checkpoint interval in force for a job (CheckpointIntervals)."""
        return self.intervals.in_force(job_row)

    def metrics_intervals(self, rows: list[dict[str, Any]]) -> list[float]:
        """Checkpoint intervals in force for these running jobs (for /metrics)."""
        return self.intervals.for_metrics(rows)

    # ------------------------------------------------------------------ status
    def summary(self) -> str:
        """One line for systemd's STATUS=: leases held, nodes up, jobs, the store."""
        terms = self.leases.terms()
        leases = " ".join(f"{n}(term {t})" for n, t in sorted(terms.items())) or "none"
        parts = [f"leases held: {leases}"]
        try:
            counts = self.store.cluster_counts()
            self._store_answered()
        except PhalanxError as e:
            since = self.store_ok_at
            ago = f" for {time.monotonic() - since:.0f}s" if since is not None else ""
            parts.append(f"store DOWN{ago}: {e.message}")
        else:
            nodes, jobs = counts["nodes"], counts["jobs"]
            up = nodes["total"] - nodes["down"]
            parts.append(f"nodes up: {up}/{nodes['total']} ({nodes['drain']} drained)")
            parts.append(
                f"jobs: {jobs.get('RUNNING', 0)} running, {jobs.get('PENDING', 0)} pending"
            )
            parts.append("store ok")
        return "; ".join(parts)

    def status(self) -> dict[str, Any]:
        return {
            "controller": self.cid,
            "url": self.url,
            "leases": self.leases.terms(),
            "timing": self.timing.model_dump(),
            "timing_nodes": self.timing_nodes,
            "ticks_ago": {k: round(time.monotonic() - v, 3) for k, v in self.last_tick.items()},
            # how work placed by other controllers reaches agents long-polling this one
            "wakeups": self.wakeups.mode(),
            # the cluster configuration version it runs, or why it cannot run the current one
            "config_version": self.versions.version,
            "config_problem": self.versions.problem,
        }
