"""A controller's moving parts: duty leases, the scheduling loop, the cluster duty, heartbeats.

Every loop is a thread running `tick()` functions that read, decide (pure), apply, and return one
sentence for the log; an unexpected exception is logged at the tick boundary and the loop goes
on. The HTTP side (api.py) runs on the asyncio loop and talks to this object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter
from pydantic import ValidationError

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
    needs_write,
    signal_items,
    state_changes,
    steps_to_decide,
)
from phalanx.controller.fairshare import FairShare
from phalanx.controller.launch import build_launch, build_step_launch
from phalanx.controller.leases import LeaseKeeper
from phalanx.controller.maintenance import MaintenanceDuty
from phalanx.controller.metrics import (
    FENCED_REFUSED,
    GPU_EVENTS_RECORDED,
    SCHED_PASS_PLACEMENTS,
    SCHED_PASS_SECONDS,
    observe_placements,
)
from phalanx.controller.preempting import preempt_pass
from phalanx.controller.submitq import SubmitQueue
from phalanx.domain import checkpointing, licenses, scheduling, values
from phalanx.domain.checkpointing import IntervalDecision
from phalanx.domain.detector import silent_nodes
from phalanx.domain.spec import JobSpec, ResolvedJob, normalize
from phalanx.domain.states import JobState
from phalanx.errors import (
    Fenced,
    PhalanxError,
    StoreOutcomeUnknown,
    StoreUnavailable,
    Unsatisfiable,
)
from phalanx.faulthooks import maybe_wedge
from phalanx.store.notify import WorkListener
from phalanx.store.steps import StepReport
from phalanx.store.store import Fence, Store, TaskReport
from phalanx.watchdog import Beats

log = logging.getLogger("phalanx.controller")

SUBMITTED = Counter("phalanx_jobs_submitted_total", "Jobs (array tasks count one each) accepted")
STARTED = Counter("phalanx_jobs_started_total", "Attempts started by this controller's scheduler")
HEARTBEATS = Counter("phalanx_heartbeats_total", "Agent heartbeats received by this controller")
LOOP_ERRORS = Counter("phalanx_loop_errors_total", "Ticks that ended in an error", ["loop"])

CACHE_TTL = 2.0  # seconds submit-time checks may use a cached view of partitions and nodes
MAX_VERDICTS = 1024  # request shapes whose satisfiability is remembered per cached node view
CHECKPOINT_INPUT_TTL = 10.0  # seconds a job's measured checkpoint cost is reused
FAILURE_HISTORY_TTL = 60.0  # seconds the cluster's failure history (node MTBF) is reused
CLUSTER_LEASE = "cluster"
MAX_GPU_EVENTS = 256  # GPU events one heartbeat may report (the rest wait for the next)
PURGE_EVERY = 60.0  # seconds between two accounting-retention purges of the cluster duty
# Seconds between polls of nodes.work_gen for long-polling agents whose work another controller
# changed: fast while no LISTEN/NOTIFY wakes us (SQLite, database outage), a slow safety net
# while the PostgreSQL listener is healthy (store/notify.py).
GEN_POLL = 0.2
GEN_POLL_LISTENING = 2.0


def sched_lease(partition: str) -> str:
    """The lease whose holder schedules one partition's jobs."""
    return f"sched:{partition}"


class Waiters:
    """Long-poll wake-ups for agents, per node, safe to trigger from any thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, set[asyncio.Event]] = {}
        self._woken: dict[str, float] = {}  # node -> monotonic time of its last notify

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def waiting_nodes(self) -> list[str]:
        return [n for n, evs in list(self._events.items()) if evs]

    async def wait(self, node: str, timeout: float, since: float | None = None) -> bool:
        """Wait for a wakeup of `node`; True if woken. With `since` (the monotonic time the
        caller read the node's work), a wakeup that came in between counts too: the caller was
        not waiting yet, and would otherwise sleep through new work for a whole long-poll."""
        if since is not None and self._woken.get(node, -1.0) >= since:
            return True
        ev = asyncio.Event()
        self._events.setdefault(node, set()).add(ev)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._events.get(node, set()).discard(ev)

    def _wake(self, nodes: list[str]) -> None:
        for n in nodes:
            for ev in list(self._events.get(n, ())):
                ev.set()

    def notify(self, nodes: list[str]) -> None:
        now = time.monotonic()
        for n in nodes:
            self._woken[n] = now
        if self.loop is not None and nodes:
            self.loop.call_soon_threadsafe(self._wake, list(nodes))


class Controller:
    def __init__(self, store: Store, config: Config, *, cid: str, url: str | None = None) -> None:
        self.store = store
        self.config = config
        # the timings in force: config's, scaled by the heartbeat rule to the cluster's size
        # (rescale_timing); `agent_timing`, the scaled ones, goes with every heartbeat reply
        self.base_timing = config.timing
        self.timing = config.timing
        self.agent_timing = scaled_fields(self.timing)
        self.timing_nodes = 0  # the node count `timing` was scaled for
        self._timing_lock = threading.Lock()
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
        )
        self.waiters = Waiters()
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._beats: dict[str, float] = {}  # node -> monotonic time last seen
        self._beats_lock = threading.Lock()
        self._gens: dict[str, int] = {}
        self._gens_total: int | None = None  # node_gens_total() when _gens was last read
        # node -> "host:port" its agent takes direct step launches at (config [steps]): soft
        # state from the agents' heartbeats, so a fresh controller knows it within one
        self.step_addrs: dict[str, str] = {}
        self._node_keys: dict[str, Key] = {}  # node -> its derived key (signs step launches)
        self._listener: WorkListener | None = None  # PostgreSQL only: cross-controller wakeups
        self._health: dict[str, tuple[Any, ...]] = {}  # node -> last health summary applied
        self._step_memo = StepReportMemo()  # step reports recorded already (exchange.py)
        self._cluster_since: float | None = None  # monotonic time the cluster duty was taken
        self.last_tick: dict[str, float] = {}
        self._partitions_cache: tuple[float, Any] | None = None
        self._views_cache: tuple[float, list[Any]] | None = None
        # submit-time verdicts for the cached node views they were reached on (see
        # _check_satisfiable): the same views give the same verdict, so nothing here is stale
        self._verdicts: tuple[list[Any], dict[Any, str | None]] = ([], {})
        self.maintenance = MaintenanceDuty(
            store,
            lead=lambda: self.timing.maint_lead,
            tick=lambda: self.cluster_interval(),
            fence=lambda: self.leases.fence(CLUSTER_LEASE),
            kick=self.kick,
            notify=self.waiters.notify,
        )
        # --checkpoint-interval=auto inputs: job id -> (monotonic time, measured cost), and
        # (monotonic time, (node-seconds, failures)) of the cluster's failure history
        self._ckpt_cost_cache: dict[int, tuple[float, float | None]] = {}
        self._failure_history: tuple[float, tuple[float, int]] | None = None
        self._last_purge: float | None = None  # monotonic time of the last retention purge
        self._placed = 0  # attempts the current scheduling pass started (for /metrics)
        self.fairshare = FairShare(store, config)  # priority, fair share, limits
        self._last_charge: float | None = None  # monotonic time usage was last charged
        # progress of every loop (and of the store, when watchdog.store_timeout asks), for the
        # systemd watchdog (watchdog.py); the time of the store's last answer, for STATUS=
        self.beats = Beats()
        self.store_ok_at: float | None = None
        # POST /v1/jobs: concurrent one-job requests committed together (submitq.py)
        self.submitq = SubmitQueue(self.submit_group)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.store.register_controller(self.cid, self.url)
        self.rescale_timing()  # before the first agent is answered: a restart knows the size
        self.start_listener()
        loops: list[tuple[str, Callable[[], str], Callable[[], float]]] = [
            ("leases", self.leases.tick, lambda: self.timing.renew_interval),
            ("scheduler", self.schedule_tick, lambda: self.timing.scheduler_interval),
            ("cluster", self.cluster_tick, self.cluster_interval),
            ("heartbeats", self.flush_heartbeats, lambda: self.timing.heartbeat_flush_interval),
            ("gens", self.gen_tick, self.gen_poll_interval),
            ("presence", self.presence_tick, lambda: self.timing.renew_interval),
        ]
        self.store_ok_at = time.monotonic()  # register_controller just answered
        self._store_answered()
        for name, fn, interval in loops:
            self.beats.beat(name, self.loop_deadline(interval()))
            t = threading.Thread(
                target=self._loop, args=(name, fn, interval), name=f"phx-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._listener is not None:
            self._listener.stop()
        for t in self._threads:
            t.join(timeout=5)
        with contextlib.suppress(PhalanxError):
            self.flush_heartbeats()
        self.leases.release_all()

    def cluster_interval(self) -> float:
        """Seconds between two ticks of the cluster duty."""
        return min(1.0, self.timing.node_down_timeout / 4)

    def presence_tick(self) -> str:
        """Keep this controller's `last_seen` fresh: peers spread leases over the live ones,
        and `phalanx cluster` shows who is alive. Also the store probe of the watchdog, and
        the heartbeat rule's look at the cluster's size."""
        self.store.touch_controller(self.cid)
        self._store_answered()
        self.rescale_timing()
        return "idle"

    def rescale_timing(self, nodes: int | None = None) -> str:
        """Apply the heartbeat rule (docs/sim.md) to the cluster's size: `nodes` node rows
        (read from the store when None). Logs and returns what changed, or "".

        The timings follow the node count up and never down, and the count never falls
        (node rows are never deleted), so an agent is never told a longer fence than the
        failure detector allows for: every controller scales from the same count, a reply
        carries timings from a count read before it was sent, and the detector reads the
        count afresh (in its tick, before the silent nodes) long after the reply a silent
        node last applied (a reply read later than its own timeout is dropped by the agent).
        Shorter timings (a config change) reach agents the same way; jobs already running
        keep the fence they were launched with, so lower them only on a quiet cluster
        (docs/configuration.md)."""
        if nodes is None:
            nodes = self.store.node_count()
        with self._timing_lock:
            if nodes <= self.timing_nodes:
                return ""
            self.timing_nodes = nodes
            old = self.timing
            try:
                new = self.base_timing.for_cluster(nodes)
            except ValidationError as e:  # past a timing's upper limit: more load, still safe
                log.warning(
                    "heartbeat rule: %d nodes at %g heartbeats/s would take a timing past its "
                    "limit (%s); heartbeats stay every %.3gs: raise [timing] heartbeat_budget",
                    nodes,
                    self.base_timing.heartbeat_budget,
                    "; ".join(str(x["msg"]) for x in e.errors()),
                    old.heartbeat_interval,
                )
                return ""
            if scaled_fields(new) == scaled_fields(old):
                return ""
            self.timing = new
            self.agent_timing = scaled_fields(new)
        said = (
            f"heartbeat rule: {nodes} nodes at {self.base_timing.heartbeat_budget:g} "
            f"heartbeats/s: heartbeat every {new.heartbeat_interval:.3g}s (was "
            f"{old.heartbeat_interval:.3g}s), fence_timeout {new.fence_timeout:.3g}s, "
            f"node_down_timeout {new.node_down_timeout:.3g}s"
        )
        log.info("%s", said)
        return said

    def _store_answered(self) -> None:
        self.store_ok_at = time.monotonic()
        timeout = self.config.watchdog.store_timeout
        if timeout > 0:
            self.beats.beat("store", timeout)

    def loop_deadline(self, interval: float) -> float:
        """How long a loop may go without progress before the watchdog calls it wedged: its
        own interval twice (a tick, then the wait) plus `watchdog.loop_timeout`."""
        return self.config.watchdog.loop_timeout + 2 * interval

    def live_controllers(self) -> list[str]:
        """Controllers seen within one lease TTL (database clock), this one included: a dead
        controller stops being preferred as soon as its leases could expire."""
        return self.store.live_controllers(self.timing.lease_ttl)

    def _loop(self, name: str, fn: Callable[[], str], interval: Callable[[], float]) -> None:
        quiet = {"leases unchanged", "", "idle"}
        while not self._stop.is_set():
            maybe_wedge(name, self._stop)  # a test-only fault hook; nothing unless asked
            start = time.monotonic()
            try:
                sentence = fn()
                if sentence not in quiet:
                    log.info("%s: %s", name, sentence)
            except StoreUnavailable as e:
                LOOP_ERRORS.labels(name).inc()
                log.warning("%s: store unavailable: %s", name, e.message)
            except Fenced as e:
                LOOP_ERRORS.labels(name).inc()
                FENCED_REFUSED.labels(name).inc()
                log.warning("%s: fenced, stepping down: %s", name, e.message)
            except Exception:
                LOOP_ERRORS.labels(name).inc()
                log.exception("%s: unexpected error; the loop goes on", name)
            self.last_tick[name] = time.monotonic()
            self.beats.beat(name, self.loop_deadline(interval()))
            took = time.monotonic() - start
            wait = interval() - took
            if name == "scheduler":
                # at least scheduler_min_gap between passes, so a burst of submissions or
                # exits is handled by one pass instead of hundreds
                self._stop.wait(max(0.0, self.timing.scheduler_min_gap - took))
                self._kick.wait(max(0.0, wait))
                self._kick.clear()
            elif wait > 0:
                self._stop.wait(wait)

    def _lease_changed(self, name: str, term: int | None) -> None:
        if name == CLUSTER_LEASE:
            self._cluster_since = time.monotonic() if term is not None else None
        if term is not None:
            with contextlib.suppress(PhalanxError):
                self.store.add_event(
                    "lease.take", f"{self.cid} took lease {name} term {term}", term=term
                )
            self.kick()

    def kick(self) -> None:
        self._kick.set()

    # ------------------------------------------------------------------ submit
    def partitions(self) -> Any:
        cached = self._partitions_cache
        if cached and time.monotonic() - cached[0] < CACHE_TTL:
            return cached[1]
        parts = self.store.partition_infos()
        self._partitions_cache = (time.monotonic(), parts)
        return parts

    def node_views(self) -> list[Any]:
        """Registered nodes as placement sees them, cached briefly for submit-time checks.

        A registration invalidates the cache, so a node that just joined is never missed;
        drained or down nodes count (they may come back), so their changes need no refresh.
        """
        cached = self._views_cache
        if cached and time.monotonic() - cached[0] < CACHE_TTL:
            return cached[1]
        nodes = [n for n in self.store.list_nodes() if n["registered"]]
        views = scheduling.node_views(nodes, self.store.partitions())
        self._views_cache = (time.monotonic(), views)
        return views

    def submit(
        self, specs: list[JobSpec], user: str, *, validate_only: bool = False
    ) -> list[list[int]]:
        """Validate and store jobs; `validate_only` (sbatch --test-only) stops before storing
        and returns no ids."""
        parts = self.partitions()
        views = self.node_views()
        items = []
        for i, spec in enumerate(specs):
            try:
                items.append(self._prepare(spec, parts, views, user))
            except PhalanxError as e:
                if len(specs) > 1:
                    e.message = f"job {i}: {e.message}"
                    e.details["index"] = i
                raise
        self.fairshare.check_submit([self._limit_key(user, item) for item in items])
        if validate_only:
            return [[] for _ in items]
        ids = self.store.submit(items, user)
        self._submitted(ids, items)
        return ids

    def submit_group(self, requests: list[tuple[JobSpec, str]]) -> list[list[int] | Exception]:
        """Several one-job submissions (each its own request and submitter) committed in one
        transaction: the group commit of controller/submitq.py. Returns, per request, its ids or
        the error that request alone gets.

        A request refused by validation fails alone. If storing the group fails for a reason
        that may be one request's (an unknown dependency), each request is stored again in a
        transaction of its own, so that it fails only its author; a store failure (unavailable,
        or a commit whose outcome is unknown) is everyone's: retrying then could store a job
        twice.
        """
        parts = self.partitions()
        views = self.node_views()
        out: list[list[int] | Exception] = [[] for _ in requests]
        ready: list[tuple[int, tuple[ResolvedJob, dict[str, Any]], str]] = []
        counted: list[tuple[str, str, str, int]] = []  # submit limits count the group too
        for i, (spec, user) in enumerate(requests):
            try:
                item = self._prepare(spec, parts, views, user)
                key = self._limit_key(user, item)
                self.fairshare.check_submit([*counted, key])
            except PhalanxError as e:
                out[i] = e
                continue
            counted.append(key)
            ready.append((i, item, user))
        if not ready:
            return out
        try:
            ids = self.store.submit_each([(*item, user) for _, item, user in ready])
        except (StoreUnavailable, StoreOutcomeUnknown) as e:
            for i, _, _ in ready:
                out[i] = e
            return out
        except Exception as e:
            if len(ready) == 1:
                out[ready[0][0]] = e
                return out
            for i, item, user in ready:  # nothing was stored: each on its own
                try:
                    one = self.store.submit([item], user)
                    out[i] = one[0]
                    self._submitted(one, [item])
                except Exception as e1:
                    out[i] = e1
            return out
        for (i, _, _), jids in zip(ready, ids, strict=True):
            out[i] = jids
        self._submitted(ids, [item for _, item, _ in ready])
        return out

    def _prepare(
        self, spec: JobSpec, parts: Any, views: list[Any], user: str
    ) -> tuple[ResolvedJob, dict[str, Any]]:
        """A job as the store takes it: normalized, charged to the account and QOS the fair
        share tree allows `user` (controller/fairshare.py), and refused if it can never run
        here."""
        resolved = normalize(
            spec,
            parts,
            default_mem_per_cpu_mb=self.config.cluster.default_mem_per_cpu_mb,
            default_requeue=self.config.cluster.default_requeue,
        )
        self._check_licenses(resolved)
        self._check_topology(resolved)
        self._check_satisfiable(resolved, views)
        dump = spec.model_dump(exclude={"ignored"})
        dump["account"], dump["qos"] = self.fairshare.resolve(user, spec.account, spec.qos)
        return resolved, dump

    @staticmethod
    def _limit_key(
        user: str, item: tuple[ResolvedJob, dict[str, Any]]
    ) -> tuple[str, str, str, int]:
        """(user, account, qos, jobs it adds: array tasks counted) for the submit limits."""
        resolved, dump = item
        return user, dump["account"], dump["qos"], len(resolved.array_indices or [0])

    def _submitted(
        self, ids: list[list[int]], items: list[tuple[ResolvedJob, dict[str, Any]]]
    ) -> None:
        SUBMITTED.inc(sum(len(i) for i in ids))
        if any(not resolved.hold for resolved, _ in items):
            self.kick()

    def plan_options(self, snap: Any) -> dict[str, Any]:
        """What a scheduling pass over `snap` takes besides the snapshot (scheduling.plan's
        keywords): the queue policy (priority, limits), the licence totals, the topology. The
        scheduler and `phalanx explain` use the same, so an explanation agrees with the pass."""
        return {
            "policy": self.fairshare.policy(snap),
            "license_totals": self.config.cluster.license_totals(),
            "topo": self.topology,
            "queue_depth": self.config.cluster.queue_depth,
        }

    def _check_licenses(self, resolved: Any) -> None:
        """Refuse a job asking for a licence the cluster does not have, or more than its
        total (it would wait forever); whether they are free now is the scheduler's matter."""
        if not resolved.licenses:
            return
        why = licenses.refusal(
            licenses.parse_licenses(resolved.licenses), self.config.cluster.license_totals()
        )
        if why:
            raise Unsatisfiable(
                f"this job can never run here: --licenses={resolved.licenses}: {why}"
            )

    def _check_topology(self, resolved: Any) -> None:
        """Refuse --spread/--anti-affinity with a level the cluster does not have (a typo
        would silently spread over nodes instead of racks)."""
        levels = self.config.topology.levels
        for option, level in (
            ("--spread", resolved.spread),
            ("--anti-affinity", resolved.anti_affinity),
        ):
            if level is not None and level not in levels:
                known = ", ".join(levels) or "none"
                raise Unsatisfiable(
                    f"{option}={level}: unknown topology level (levels of this cluster: {known})"
                )
        if resolved.switches is not None and not levels:
            raise Unsatisfiable("--switches: this cluster has no topology levels configured")

    def _check_satisfiable(self, resolved: Any, views: list[Any]) -> None:
        from phalanx.domain.placement_reasons import unsatisfiable_reason

        if not views:
            return  # no node has registered yet: nothing to judge against
        # The verdict is a function of the request and the views only, and placement sorts and
        # walks every node: remember it per request shape for as long as these views are used
        # (jobs submitted together, or one after the other, mostly share their shape).
        fields = scheduling.resolved_fields(resolved)
        key = tuple(tuple(v) if isinstance(v, list) else v for v in fields.values())
        known_views, verdicts = self._verdicts
        if known_views is not views:
            verdicts = {}
            self._verdicts = (views, verdicts)
        if key in verdicts:
            reason = verdicts[key]
        else:
            reason = unsatisfiable_reason(scheduling.job_request(fields), views)
            if len(verdicts) < MAX_VERDICTS:
                verdicts[key] = reason
        if reason:
            raise Unsatisfiable(f"this job can never run here: {reason}")

    # ------------------------------------------------------------------ scheduling
    def schedule_tick(self) -> str:
        """One scheduling pass over the partitions whose `sched:<partition>` lease we hold.

        A job belongs to the lease of the first partition it lists (it may still be placed in
        another of its partitions); the write re-checks node capacity, so holders of different
        partitions that share nodes never double-book them.
        """
        fences = self._sched_fences()
        if not fences:
            return "idle"
        start = time.perf_counter()
        self._placed = 0
        try:
            return self._schedule(fences)
        finally:
            SCHED_PASS_SECONDS.observe(time.perf_counter() - start)
            SCHED_PASS_PLACEMENTS.observe(self._placed)

    def _sched_fences(self) -> dict[str, Fence]:
        out = {}
        for name in self.partition_names:
            fence = self.leases.fence(sched_lease(name))
            if fence is not None:
                out[name] = fence
        return out

    def _schedule(self, fences: dict[str, Fence]) -> str:
        now = time.time()
        snap = self.store.sched_snapshot(eligible_by=now)
        if snap.quiet:
            return "idle"
        owner = {int(j["id"]): j["partitions"].split(",")[0] for j in snap.pending}
        snap.pending = [j for j in snap.pending if owner[int(j["id"])] in fences]
        snap.not_yet = [j for j in snap.not_yet if j["partitions"].split(",")[0] in fences]
        options = self.plan_options(snap)
        totals = options["license_totals"]
        plan = scheduling.plan(snap, now, **options)
        for jid, why in plan.never:
            self.store.end_pending(jid, JobState.CANCELLED, why, fences[owner[jid]])
        started: list[int] = []
        if plan.starts:
            exclusive = {int(j["id"]): bool(j["exclusive"]) for j in snap.pending}
            licensed = {int(j["id"]): j.get("licenses") for j in snap.pending}
            by_lease: dict[str, list[dict[str, Any]]] = {}
            for p in plan.starts:
                by_lease.setdefault(owner[p.job_id], []).append(
                    {
                        "job_id": p.job_id,
                        "partition": p.partition,
                        "nodes": p.nodes,
                        "cpus_per_node": p.cpus_per_node,
                        "mem_per_node_mb": p.mem_per_node_mb,
                        "gpu_ids": p.gpu_ids,
                        "exclusive": exclusive[p.job_id],
                        "spares": p.spares,
                        "licenses": licensed.get(p.job_id),
                    }
                )
            for part, starts in sorted(by_lease.items()):
                # the lease deadline may pass mid-cycle: re-check before each write
                fence = self.leases.fence(sched_lease(part))
                if fence is None:
                    continue
                started += self.store.start_attempts(starts, fence, license_totals=totals)
            STARTED.inc(len(started))
            self._placed = len(started)
            self._observe_starts(snap.pending, started)
            self.waiters.notify(sorted({n for p in plan.starts for n in p.nodes}))
        plan.reasons.update(
            preempt_pass(self.store, self.config, snap, plan, fences, owner, self.topology)
        )
        current = {int(j["id"]): j["reason"] for j in snap.pending}
        changed = {jid: r for jid, r in plan.reasons.items() if current.get(jid) != r}
        self.store.set_pending_reasons(changed)
        if not (plan.starts or plan.never):
            return "idle"
        return plan.sentence() + (
            f" (applied {len(started)})" if len(started) != len(plan.starts) else ""
        )

    def _observe_starts(self, pending: list[dict[str, Any]], started: list[int]) -> None:
        """Queue-wait and submit-to-start histograms of /metrics (controller/metrics.py)."""
        now = time.time()
        ids = set(started)
        rows = [j for j in pending if int(j["id"]) in ids]
        again = [int(j["id"]) for j in rows if int(j.get("restart_count") or 0) > 0]
        requeued_at: dict[int, float] = {}
        if again:
            with contextlib.suppress(PhalanxError):
                requeued_at = self.store.queue_entries(again)
        observe_placements(rows, now, requeued_at)

    # ------------------------------------------------------------------ cluster duty
    def cluster_tick(self) -> str:
        """Failure detector, reaper and maintenance windows; only the holder of the `cluster`
        lease acts."""
        try:
            said = [
                self._cluster_duty(),
                self.maintenance.tick(),
                self.purge_tick(),
                self.charge_tick(),
            ]
            return ", ".join(x for x in said if x not in ("idle", "")) or "idle"
        except StoreUnavailable:
            # Heartbeats could not be recorded while the store was away: judge no node until
            # a full timeout of fresh heartbeats has been seen again.
            if self._cluster_since is not None:
                self._cluster_since = time.monotonic()
            raise

    def purge_tick(self, *, now: float | None = None, force: bool = False) -> str:
        """Accounting retention: delete jobs that ended longer than `accounting.keep_finished`
        ago (with their attempts, tasks and events), in batches, at most once a minute and only
        by the `cluster` lease holder. A tick deletes at most 20 batches, so a first purge of a
        big history spreads over several minutes instead of holding the store."""
        keep = self.config.accounting.keep_seconds()
        if keep is None or self.leases.fence(CLUSTER_LEASE) is None:
            return ""
        mono = time.monotonic()
        if not force and self._last_purge is not None and mono - self._last_purge < PURGE_EVERY:
            return ""
        self._last_purge = mono
        cutoff = (time.time() if now is None else now) - keep
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
        mono = time.monotonic()
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
        since = self._cluster_since
        if fence is None or since is None:
            return None
        if time.monotonic() - since < self.timing.node_down_timeout:
            return None
        return fence

    def _cluster_duty(self) -> str:
        if self._judging_fence() is None:
            return "idle"
        said = []
        # the count afresh, before the silent nodes: at least what any reply they applied
        # was scaled for (rescale_timing)
        self.rescale_timing()
        db_now = self.store.db_time()
        with self._beats_lock:
            unflushed = list(self._beats)
        verdicts = silent_nodes(
            self.store.silent_node_rows(db_now - self.timing.node_down_timeout),
            db_now,
            self.timing.node_down_timeout,
            heard_recently=unflushed,
        )
        for name, reason in verdicts:
            fence = self._judging_fence()
            if fence is None:
                return "lost the right to judge nodes mid-cycle; nothing more applied"
            with self._beats_lock:
                if name in self._beats:  # heard from since the read: alive
                    continue
            # its tasks fail in the same write, which checks the silence again (another
            # controller may have written a heartbeat of the node since the read)
            silent = self.timing.node_down_timeout
            if self.store.mark_down(name, reason, fence, silent_for=silent):
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
        for att in self.store.stale_starting_attempts(time.time() - self.timing.launch_timeout):
            if self.store.requeue_lost_launch(
                att["id"],
                f"no agent confirmed the launch within {self.timing.launch_timeout:g}s",
                fence,
            ):
                said.append(f"attempt {att['id']} launch timed out")
                self.kick()
        return ", ".join(said) or "idle"

    # ------------------------------------------------------------------ agents
    def seen(self, node: str) -> None:
        HEARTBEATS.inc()
        with self._beats_lock:
            self._beats[node] = time.monotonic()

    def flush_heartbeats(self) -> str:
        """Write the heartbeats heard since the last flush. They stay in `_beats` until the
        write commits: the failure detector counts them as heard (`heard_recently`), so a
        node is never judged silent while its heartbeat is on its way to the store."""
        with self._beats_lock:
            beats = dict(self._beats)
        if not beats:
            return "idle"
        now = time.monotonic()
        try:
            back = self.store.record_heartbeats({n: now - t for n, t in beats.items()})
            with self._beats_lock:
                for n, t in beats.items():
                    if self._beats.get(n) == t:  # not heard again meanwhile
                        del self._beats[n]
        except StoreUnavailable:
            if self._cluster_since is not None:
                self._cluster_since = time.monotonic()  # see cluster_tick
            raise
        if back:
            self.kick()
            return f"back in service: {', '.join(back)}"
        return "idle"

    def start_listener(self) -> None:
        """On PostgreSQL, listen for other controllers' work notifications (store/notify.py)."""
        if self.store.dialect != "postgresql" or self._listener is not None:
            return
        self._listener = WorkListener(
            self.store.db.connect_args(), self._work_notice, op_timeout=self.timing.db_op_timeout
        )
        self._listener.start()

    def _work_notice(self, nodes: list[str] | None) -> None:
        """A notification: wake these nodes' long-polls (None: every waiting one re-checks)."""
        self.waiters.notify(self.waiters.waiting_nodes() if nodes is None else nodes)

    def gen_poll_interval(self) -> float:
        """Fast while no notifications arrive; while they do, a safety net that never polls
        faster than agents re-heartbeat anyway (a missed wakeup costs at most one long-poll)."""
        listener = self._listener
        if listener is not None and listener.healthy:
            return max(GEN_POLL_LISTENING, self.timing.heartbeat_interval)
        return GEN_POLL

    def woke(self, gens: dict[str, int]) -> None:
        """Wake these nodes' long-polls for work this controller has just committed, whose
        work generations are `gens`: gen_tick then takes them as seen.  Without this, its next
        poll finds the generations changed and wakes the same agents again, each of which
        answers with a whole exchange (a few per job step, the largest cost of a short step)."""
        self._gens.update(gens)
        self.waiters.notify(sorted(gens))

    def seen_gens(self, gens: dict[str, int]) -> None:
        """Take these nodes' new work generations as seen without waking them: a step srun
        hands to the agents itself (direct launch) needs no long-poll.  A node srun cannot
        reach is woken afterwards (`POST .../steps/N/wake`)."""
        self._gens.update(gens)

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
            key = self._node_keys.get(node)
            if key is None or not key.kid.startswith(f"{cluster_key.kid}:"):
                key = self._node_keys[node] = derive(cluster_key, "node", node)
            item = build_step_launch(w, node=node, kill_wait=self.timing.kill_wait, now=now)
            out.append({"node": node, "at": at, **launchcred.sign(key, item, now=now, ttl=ttl)})
        return out, unknown

    def gen_tick(self) -> str:
        """Wake this controller's long-polls when another controller gave their nodes work
        (the fallback for LISTEN/NOTIFY: see gen_poll_interval)."""
        total = self.store.node_gens_total()  # first: a change after it is read next tick
        if total == self._gens_total:
            return "idle"
        waiting = self.waiters.waiting_nodes()  # after: 10,000 long-polls are a long list
        if not waiting:
            return "idle"
        gens = self.store.node_gens()
        self._gens_total = total
        changed = [n for n in waiting if gens.get(n) is not None and gens[n] != self._gens.get(n)]
        self._gens.update(gens)
        if changed:
            self.waiters.notify(changed)
        return "idle"

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
        )
        self.seen(node)
        self._views_cache = None
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
            self.store.apply_reports(node, reports, taken_at)
            work, step_work = self.store.node_all_work(node, needs_steps)  # may end its steps
            if changed:
                self.kick()
        ended = self.store.finished_attempts(
            [r.attempt_id for r in reports if r.state in ("exited", "lost")]
        )
        reply = decide(work, reports, ended, checkpoint_grace=self.timing.checkpoint_grace)
        reply.signals = signal_items(work, reports)
        self.maintenance.adjust_stops(reply.stop)  # stopped at the window's start
        reply.checkpoint = checkpoint_items(work, lambda w: self.checkpoint_interval(w).seconds)
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
        return decide_steps(work, reports, ended, checkpoint_grace=self.timing.checkpoint_grace)

    def step_launch_specs(self, reply: StepReply, node: str) -> list[dict[str, Any]]:
        now = time.time()
        return [
            build_step_launch(w, node=node, kill_wait=self.timing.kill_wait, now=now)
            for w in reply.start
        ]

    def checkpoint_interval(self, job_row: dict[str, Any]) -> IntervalDecision:
        """The periodic checkpoint interval in force for a job, with its inputs.

        `job_row`: a jobs row (get_job) or a node_work row. Fixed intervals need no store
        access; "auto" is Young/Daly from the job's measured checkpoint cost and the cluster's
        node MTBF (failure history blended with the configured prior), both cached briefly
        since agents ask on every heartbeat.
        """
        spec = job_row.get("spec") or {}
        setting = (spec.get("checkpoint_parsed") or {}).get("interval_s")
        nodes = (
            len(job_row["attempt_nodes"]) if job_row.get("attempt_nodes") else job_row.get("nodes")
        )
        t = self.timing
        if setting != checkpointing.AUTO:
            return checkpointing.interval_in_force(
                setting,
                nodes=int(nodes or 1),
                measured_cost_s=None,
                default_cost_s=t.default_checkpoint_cost_s,
                node_mtbf_s=t.node_mtbf_prior_s,
                mtbf_source="prior",
            )
        job_id = int(job_row.get("job_id") or job_row["id"])
        now = time.monotonic()
        cached = self._ckpt_cost_cache.get(job_id)
        if cached is None or now - cached[0] > CHECKPOINT_INPUT_TTL:
            cached = (now, self.store.checkpoint_cost(job_id))
            self._ckpt_cost_cache[job_id] = cached
            if len(self._ckpt_cost_cache) > 10_000:
                self._ckpt_cost_cache.clear()
        history = self._failure_history
        if history is None or now - history[0] > FAILURE_HISTORY_TTL:
            history = (now, self.store.failure_history(time.time()))
            self._failure_history = history
        node_seconds, failures = history[1]
        mtbf, source = checkpointing.estimate_node_mtbf(
            node_seconds,
            failures,
            prior_s=t.node_mtbf_prior_s,
            prior_weight_s=t.node_mtbf_prior_weight_s,
        )
        return checkpointing.interval_in_force(
            checkpointing.AUTO,
            nodes=int(nodes or 1),
            measured_cost_s=cached[1],
            default_cost_s=t.default_checkpoint_cost_s,
            node_mtbf_s=mtbf,
            mtbf_source=source,
            minimum_s=t.checkpoint_interval_min_s,
        )

    def metrics_intervals(self, rows: list[dict[str, Any]]) -> list[float]:
        """Periodic checkpoint intervals in force for these running jobs (for /metrics)."""
        out = []
        for row in rows:
            with contextlib.suppress(PhalanxError, KeyError, TypeError, ValueError):
                seconds = self.checkpoint_interval(row).seconds
                if seconds:
                    out.append(float(seconds))
        return out

    def launch_specs(self, reply: Reply, node: str) -> list[dict[str, Any]]:
        return [
            build_launch(
                w,
                node=node,
                kill_wait=self.timing.kill_wait,
                checkpoint_grace=self.timing.checkpoint_grace,
            )
            for w in reply.start
        ]

    def stuck_loops(self) -> list[str]:
        """Loops that have not completed a tick for longer than lease_ttl (a stuck controller
        must be restarted; its leases have lapsed already)."""
        now = time.monotonic()
        limit = 3 * self.timing.lease_ttl + self.timing.scheduler_interval
        return sorted(
            name for name, t in self.last_tick.items() if now - t > limit and name != "presence"
        )

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
            "wakeups": "listen"
            if self._listener is not None and self._listener.healthy
            else "poll",
        }


def scaled_fields(timing: Timing) -> dict[str, float]:
    """The timings the heartbeat rule scales (Timing.for_cluster), as agents are told them
    in every heartbeat reply."""
    return {
        "heartbeat_interval": timing.heartbeat_interval,
        "fence_timeout": timing.fence_timeout,
        "node_down_timeout": timing.node_down_timeout,
    }


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


def partition_rows(config: Config) -> list[dict[str, Any]]:
    """The partitions table rows from the configuration."""
    rows = []
    parts = config.cluster.partitions
    has_default = any(p.default for p in parts)
    for i, p in enumerate(parts):
        rows.append(
            {
                "name": p.name,
                "is_default": p.default or (not has_default and i == 0),
                "nodes": p.nodes,
                "default_time_s": values.parse_duration(p.default_time),
                "max_time_s": values.parse_duration(p.max_time),
                "priority": p.priority,
            }
        )
    return rows
