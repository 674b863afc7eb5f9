"""The controller's side of the agent protocol: registrations, and each heartbeat's exchange.

`AgentDuty` applies what an agent reports (its tasks, its steps, its health and GPU events)
and computes the reply from the store's view of the node's work, with the pure decisions of
controller/exchange.py; it also builds the launch items (and the signed direct step launches)
agents receive. It keeps the per-node soft state the hot path needs (the last health applied,
the step reports already recorded, the agents' step addresses and keys), so that a heartbeat
that changed nothing writes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from phalanx.auth import launchcred
from phalanx.auth.keys import Key, derive
from phalanx.config import Config, Timing
from phalanx.controller.exchange import (
    Reply,
    StepReply,
    StepReportMemo,
    checkpoint_items,
    decide,
    decide_steps,
    membership_items,
    needs_write,
    signal_items,
    state_changes,
    steps_to_decide,
)
from phalanx.controller.heartbeats import Heartbeats
from phalanx.controller.intervals import CheckpointIntervals
from phalanx.controller.launch import build_launch, build_step_launch
from phalanx.controller.maintenance import MaintenanceDuty
from phalanx.controller.metrics import GPU_EVENTS_RECORDED
from phalanx.controller.reservations import ReservationDuty
from phalanx.store.steps import StepReport
from phalanx.store.store import TaskReport
from phalanx.store.surface import AgentExchange

log = logging.getLogger("phalanx.controller")

MAX_GPU_EVENTS = 256  # GPU events one heartbeat may report (the rest wait for the next)
USAGE_REQUEST_TTL = 30.0  # seconds a signed usage request (sstat) stays valid


def health_key(summary: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a health summary worth a store write: the verdict, and each check's status
    (so `/metrics` counts per check stay true; a reason's wording alone is not a change)."""
    checks = summary.get("checks") or {}
    per_check = tuple(
        sorted((str(c), str((v or {}).get("status"))) for c, v in checks.items())
        if isinstance(checks, dict)
        else ()
    )
    return (summary.get("status"), summary.get("check"), summary.get("reason"), per_check)


def stored_health(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """The summary as the node row keeps it: without the GPU events that rode along."""
    if not summary:
        return summary
    return {k: v for k, v in summary.items() if k != "gpu_events"}


class AgentDuty:
    def __init__(
        self,
        store: AgentExchange,
        config: Config,
        timing: Callable[[], Timing],
        *,
        heartbeats: Heartbeats,
        intervals: CheckpointIntervals,
        maintenance: MaintenanceDuty,
        reservations: ReservationDuty | None = None,
        kick: Callable[[], None],
        registered: Callable[[], None],
    ) -> None:
        self.store = store
        self.config = config
        self.timing = timing  # the timings in force (controller/timings.py)
        self.heartbeats = heartbeats
        self.intervals = intervals
        self.maintenance = maintenance  # stops for a maintenance window keep their own grace
        self.reservations = reservations  # and stops at a reservation's end theirs
        self.kick = kick
        self.registered = registered  # a node (re)registered: submit-time views are stale
        # node -> "host:port" its agent takes direct step launches at (config [steps]): soft
        # state from the agents' heartbeats, so a fresh controller knows it within one
        self.step_addrs: dict[str, str] = {}
        self._node_keys: dict[str, Key] = {}  # node -> its derived key (signs step launches)
        self._health: dict[str, tuple[Any, ...]] = {}  # node -> last health summary applied
        self._step_memo = StepReportMemo()  # step reports recorded already (exchange.py)

    def register(self, node: str, info: dict[str, Any]) -> dict[str, Any]:
        row = self.store.register_node(
            node,
            cpus=info["cpus"],
            mem_mb=info["mem_mb"],
            gpus=info["gpus"],
            features=info["features"],
            addr=info.get("addr"),
            boot_id=info.get("boot_id"),
            version=info.get("version"),
            health=stored_health(info.get("health")),
            topology=info.get("topology") or None,
            steps_at=info.get("steps_at"),
        )
        self.heartbeats.seen(node)
        self.registered()
        health = info.get("health")
        if health:  # applied with the registration; remember it so heartbeats compare to it
            self._health[node] = health_key(health)
        else:
            self._health.pop(node, None)
        self.kick()
        return row

    def record_gpu_events(self, node: str, items: list[dict[str, Any]]) -> None:
        """Store the GPU events (XIDs, ECC error increases) an agent reports with its health:
        events of the node, so every controller counts the same ones (docs/metrics.md).
        Agents repeat an event until a reply confirms it; the store skips repeats by key."""
        valid = [i for i in items if isinstance(i, dict) and i.get("key")][:MAX_GPU_EVENTS]
        GPU_EVENTS_RECORDED.inc(self.store.record_gpu_events(node, valid))

    def update_health(self, node: str, summary: dict[str, Any] | None) -> None:
        """Apply an agent's health summary when it changed (the store acts on transitions)."""
        if not summary:
            return
        key = health_key(summary)
        if self._health.get(node) == key:
            return
        said = self.store.apply_health(node, stored_health(summary) or {})
        self._health[node] = key
        if said:
            log.info("health: %s", said)
            self.kick()

    def exchange(
        self,
        node: str,
        reports: list[TaskReport],
        taken_at: float | None,
        health: dict[str, Any] | None = None,
        step_reports: list[StepReport] | None = None,
    ) -> tuple[Reply, StepReply]:
        """Apply an agent's report and compute its reply (runs in a worker thread)."""
        self.update_health(node, health)
        if health and health.get("gpu_events"):
            self.record_gpu_events(node, health["gpu_events"])
        # Step reports first: when a task's end ends its attempt, the steps it ends with are
        # those the node has not already seen end (a step that completed stays COMPLETED).
        fresh_steps = self._step_memo.fresh(node, step_reports or [])
        if fresh_steps:
            self.store.apply_step_reports(node, fresh_steps)
            self._step_memo.applied(node, fresh_steps)
        reported = step_reports or []

        def needs_steps(w: list[dict[str, Any]]) -> bool:
            return steps_to_decide(w, reported)

        work, step_work = self.store.node_all_work(node, needs_steps)
        if needs_write(work, reports, taken_at):
            changed = state_changes(work, reports, taken_at)  # not only checkpoints/progress
            # the work as the write left it (read in its transaction); the write may end steps
            work = self.store.apply_reports(node, reports, taken_at)
            step_work = self.store.node_step_work(node) if needs_steps(work) else []
            if changed:
                self.kick()
        grace = self.timing().checkpoint_grace
        reply = decide(work, reports, checkpoint_grace=grace)
        reply.signals = signal_items(work, reports)
        reply.members = membership_items(work, reports)
        self.maintenance.adjust_stops(reply.stop)  # stopped at the window's start
        if self.reservations is not None and reply.stop:
            self.reservations.adjust_stops(reply.stop)  # at the reservation's end (+ overrun)
        reply.checkpoint = checkpoint_items(work, lambda w: self.intervals.in_force(w).seconds)
        if not needs_steps(work):
            return reply, StepReply()
        return reply, self._step_exchange(node, reported, step_work)

    def _step_exchange(
        self, node: str, reports: list[StepReport], work: list[dict[str, Any]]
    ) -> StepReply:
        """The step half of a heartbeat (its reports were recorded first, `work` read after
        them), the step reply."""
        if not work and not reports:
            return StepReply()
        over = [r for r in reports if r.state in ("exited", "lost")]
        known = self._step_memo.ended(node, [(r.attempt_id, r.step_id, r.token) for r in over])
        ended = known | self.store.finished_steps(
            [
                (r.attempt_id, r.step_id, node)
                for r in over
                if (r.attempt_id, r.step_id) not in known
            ]
        )
        grace = self.timing().checkpoint_grace
        return decide_steps(work, reports, ended, checkpoint_grace=grace)

    def launch_specs(self, reply: Reply, node: str) -> list[dict[str, Any]]:
        timing = self.timing()
        return [
            build_launch(
                w,
                node=node,
                kill_wait=timing.kill_wait,
                checkpoint_grace=timing.checkpoint_grace,
            )
            for w in reply.start
        ]

    def step_launch_specs(self, reply: StepReply, node: str) -> list[dict[str, Any]]:
        now = time.time()
        return [
            build_step_launch(w, node=node, kill_wait=self.timing().kill_wait, now=now)
            for w in reply.start
        ]

    def direct_launches(
        self, rows: list[dict[str, Any]], cluster_key: Key
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """A direct step launch per node of a new step: (credentials with the address of
        each node's agent, the nodes without a known address, which the long-poll serves)."""
        now = time.time()
        ttl = self.config.steps.launch_ttl
        out, unknown = [], []
        for w in rows:
            node = str(w["node"])
            at = self.step_addrs.get(node)
            if at is None:
                unknown.append(node)
                continue
            key = self._node_key(node, cluster_key)
            item = build_step_launch(w, node=node, kill_wait=self.timing().kill_wait, now=now)
            out.append({"node": node, "at": at, **launchcred.sign(key, item, now=now, ttl=ttl)})
        return out, unknown

    def _node_key(self, node: str, cluster_key: Key) -> Key:
        """The node's derived key (only the controllers and that node hold it)."""
        key = self._node_keys.get(node)
        if key is None or not key.kid.startswith(f"{cluster_key.kid}:"):
            key = self._node_keys[node] = derive(cluster_key, "node", node)
        return key

    def usage_requests(
        self, asks: dict[str, dict[str, Any]], cluster_key: Key
    ) -> tuple[dict[str, tuple[str, dict[str, Any]]], list[str]]:
        """Signed usage requests (`sstat`, controller/taskusage.py) for each node of `asks`
        (node -> what to ask it: attempt, steps, batch), with the address its agent listens
        at: the one it heartbeats this controller with, else the one it registered; and the
        nodes with neither."""
        stored = self.store.step_addresses([n for n in asks if n not in self.step_addrs])
        now = time.time()
        out: dict[str, tuple[str, dict[str, Any]]] = {}
        for node, ask in asks.items():
            at = self.step_addrs.get(node) or stored.get(node)
            if at:
                item = {"node": node, "stat": ask}
                key = self._node_key(node, cluster_key)
                out[node] = (at, launchcred.sign(key, item, now=now, ttl=USAGE_REQUEST_TTL))
        return out, sorted(set(asks) - set(out))
