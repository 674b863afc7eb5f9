"""A controller's `/metrics` (docs/metrics.md): cluster figures from the store, cached, plus
this process's own instruments.

Two kinds of series:

* cluster-level, read from the store (store/metrics.py) by `ClusterMetrics`, a prometheus_client
  custom collector that yields metric families from a cached snapshot: the same numbers from
  whichever controller is scraped, counters that survive failover (they are derived from
  rows every controller shares). The snapshot is read at most once per `metrics.cache_seconds`
  by one thread; a scrape waits at most `metrics.scrape_wait` for it and otherwise answers the
  last values with `phalanx_store_up 0`, so a store outage never turns a scrape into a 500 or
  a hang;
* process-local instruments (scheduling passes this controller ran, API requests it served,
  store round trips it made): ordinary prometheus_client histograms and counters in the
  default registry, to be summed over instances.

Per-reason series are capped (`metrics.max_reasons`): the largest N keep their own series,
the rest add up under "other". `/metrics` needs no credential, so it names no user: the public
families count users (`phalanx_users_active`), and the per-user series (`phalanx_user_jobs`,
capped at `metrics.max_users` the same way) are added only to a scrape that brings an
operator's or admin's credential (`user_families`, `exposition(..., users=...)`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phalanx.config import MetricsConfig
from phalanx.domain.states import node_display_state
from phalanx.errors import PhalanxError
from phalanx.store.metrics import Histo, StoreFigures

log = logging.getLogger("phalanx.metrics")
# `*_created` series double every counter and histogram and no dashboard here reads them
disable_created_metrics()

OTHER = "other"
# queue wait and submit-to-start: seconds to days
WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0, 86400.0)
INTERVAL_BUCKETS = (60.0, 300.0, 600.0, 1800.0, 3600.0, 2 * 3600.0, 6 * 3600.0, 86400.0)
LAG_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
PLACEMENT_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
MAX_CHECKPOINTING = 10_000  # running jobs whose interval in force one refresh computes

# ---------------------------------------------------------------- process-local instruments
SINCE = time.time()  # when this process's instruments started counting (sdiag's "Data since")


class PassTimes:
    """The last and the longest scheduling pass of this process (sdiag's "Last cycle" and
    "Max cycle"; the histogram below keeps their count and sum)."""

    def __init__(self) -> None:
        self.last_s = 0.0
        self.max_s = 0.0

    def record(self, seconds: float) -> None:
        self.last_s = seconds
        self.max_s = max(self.max_s, seconds)


PASS_TIMES = PassTimes()
SCHED_PASS_SECONDS = Histogram(
    "phalanx_scheduling_pass_seconds",
    "Duration of one scheduling pass of this controller (passes over partitions it schedules)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
SCHED_PASS_PLACEMENTS = Histogram(
    "phalanx_scheduling_pass_placements",
    "Jobs placed (attempts started) by one scheduling pass of this controller",
    buckets=PLACEMENT_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "phalanx_job_queue_wait_seconds",
    "Attempts this controller's scheduler placed, by time since the job entered the queue "
    "(its submission, or the end of its previous attempt)",
    buckets=WAIT_BUCKETS,
)
SUBMIT_TO_START = Histogram(
    "phalanx_job_submit_to_start_seconds",
    "Jobs this controller's scheduler started for the first time, by time since submission",
    buckets=WAIT_BUCKETS,
)
FENCED_REFUSED = Counter(
    "phalanx_fenced_writes_refused_total",
    "Writes of this controller the store refused because its lease term was no longer current",
    ["loop"],
)
HTTP_SECONDS = Histogram(
    "phalanx_http_request_duration_seconds",
    "API requests served by this controller, by route template, method and status",
    ["route", "method", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
GPU_EVENTS_RECORDED = Counter(
    "phalanx_gpu_events_recorded_total",
    "GPU events (XIDs, ECC error increases) agents reported to this controller and it stored",
)


def observe_placements(
    started: Iterable[dict[str, Any]], now: float, requeued_at: Mapping[int, float]
) -> None:
    """Queue wait and submit-to-start of the jobs a scheduling pass started (`started`: their
    pending rows; `requeued_at`: when the restarted ones entered the queue again)."""
    for job in started:
        jid, submitted = int(job["id"]), float(job["submit_time"])
        if int(job.get("restart_count") or 0) == 0:
            SUBMIT_TO_START.observe(max(0.0, now - submitted))
            QUEUE_WAIT.observe(max(0.0, now - submitted))
        else:
            QUEUE_WAIT.observe(max(0.0, now - requeued_at.get(jid, submitted)))


# ---------------------------------------------------------------- pure helpers
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def reason_code(reason: str | None) -> str:
    """A pending reason as a bounded label: its first word ("Resources", "Priority",
    "Dependency", "requeued", ...); "None" when the job has no reason yet."""
    if not reason:
        return "None"
    m = _WORD.search(reason)
    return m.group(0)[:64] if m else OTHER


def drain_kind(drain_by: str | None) -> str:
    """Who drained a node, as a bounded label: health (a check failed or warned),
    maintenance (a window), phalanx (repeated launch failures), hook (its prolog or epilog
    failed) or operator."""
    by = drain_by or ""
    if by.startswith("health:"):
        return "health"
    if by in ("prolog", "epilog"):
        return "hook"
    if by.startswith("maint:"):
        return "maintenance"
    if by == "phalanx":
        return "phalanx"
    return "operator"


def top_n(counts: Mapping[str, int], n: int) -> dict[str, int]:
    """The `n` largest entries; the rest summed under "other" (present only if non-empty)."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out = dict(ranked[:n])
    rest = sum(v for _, v in ranked[n:])
    if rest:
        out[OTHER] = out.get(OTHER, 0) + rest
    return out


def _buckets(h: Histo) -> list[tuple[str, float]]:
    return [*((_le(b), float(c)) for b, c in zip(h.bounds, h.counts, strict=True)),
            ("+Inf", float(h.total))]  # fmt: skip


def _le(b: float) -> str:
    return repr(float(b))


def observe_buckets(values: Iterable[float], bounds: Sequence[float]) -> Histo:
    """A histogram of `values` (for gauge histograms computed from a snapshot)."""
    vals = list(values)
    return Histo(
        bounds=tuple(bounds),
        counts=[sum(1 for v in vals if v <= b) for b in bounds],
        total=len(vals),
        sum=float(sum(vals)),
    )


@dataclass
class Snapshot:
    """The families of one refresh, ready to yield; `at` is its monotonic time."""

    at: float
    families: list[Metric] = field(default_factory=list)
    took: float = 0.0
    private: list[Metric] = field(default_factory=list)  # user_families: operators only


def build_families(
    fig: StoreFigures,
    *,
    max_users: int,
    max_reasons: int,
    intervals: Sequence[float] = (),
) -> list[Metric]:
    """Every cluster-level family from one read of the store (pure: tests feed it figures)."""
    fams: list[Metric] = []

    jobs = GaugeMetricFamily(
        "phalanx_jobs", "Jobs in the store by state and partition", labels=["state", "partition"]
    )
    by_part: dict[tuple[str, str], int] = {}
    for state, part, n in fig.jobs:
        by_part[(state, part)] = by_part.get((state, part), 0) + n
    for (state, part), n in sorted(by_part.items()):
        jobs.add_metric([state, part], n)
    fams.append(jobs)

    reasons: dict[str, int] = {}
    for reason, n in fig.pending_reasons:
        code = reason_code(reason)
        reasons[code] = reasons.get(code, 0) + n
    pending = GaugeMetricFamily(
        "phalanx_jobs_pending",
        f"Pending jobs by reason (its first word; the {max_reasons} largest, the rest 'other')",
        labels=["reason"],
    )
    for code, n in sorted(top_n(reasons, max_reasons).items()):
        pending.add_metric([code], n)
    fams.append(pending)

    # how many users have active jobs, by state: no names (anyone may scrape /metrics)
    active: dict[str, set[str]] = {}
    for user, state, n in fig.users:
        if n:
            active.setdefault(state, set()).add(user)
    users = GaugeMetricFamily(
        "phalanx_users_active",
        "Users with active jobs, by job state (per-user series: phalanx_user_jobs, for "
        "scrapes with an operator's credential)",
        labels=["state"],
    )
    for state, names in sorted(active.items()):
        users.add_metric([state], len(names))
    fams.append(users)

    if fig.checkpoint_durations is not None:
        h = fig.checkpoint_durations
        fams.append(
            HistogramMetricFamily(
                "phalanx_checkpoint_duration_seconds",
                "Checkpoints by measured duration (job.checkpoint events)",
                buckets=_buckets(h),
                sum_value=h.sum,
            )
        )

    fams.append(
        GaugeHistogramMetricFamily(
            "phalanx_checkpoint_interval_seconds",
            "Running jobs with periodic checkpoints by the interval in force",
            buckets=_buckets(observe_buckets(intervals, INTERVAL_BUCKETS)),
            gsum_value=float(sum(intervals)),
        )
    )

    fams.extend(_node_families(fig))
    fams.extend(_lease_families(fig))
    fams.extend(_event_families(fig))
    return fams


def user_families(fig: StoreFigures, *, max_users: int) -> list[Metric]:
    """Active jobs per user and state: user names, so only for a scrape that brings an
    operator's or admin's credential (docs/metrics.md)."""
    totals: dict[str, int] = {}
    for user, _state, n in fig.users:
        totals[user] = totals.get(user, 0) + n
    kept = set(top_n(totals, max_users)) - {OTHER}
    per_user: dict[tuple[str, str], int] = {}
    for user, state, n in fig.users:
        key = (user if user in kept else OTHER, state)
        per_user[key] = per_user.get(key, 0) + n
    users = GaugeMetricFamily(
        "phalanx_user_jobs",
        f"Active jobs per user and state (the {max_users} users with most, the rest 'other'); "
        "only in scrapes with an operator's or admin's credential",
        labels=["user", "state"],
    )
    for (user, state), n in sorted(per_user.items()):
        users.add_metric([user, state], n)
    return [users]


def _node_families(fig: StoreFigures) -> list[Metric]:
    states: dict[str, int] = {}
    flags = {"down": 0, "drain": 0, "unregistered": 0, "health_warn": 0, "health_fail": 0}
    drains: dict[str, int] = {}
    checks: dict[tuple[str, str], int] = {}
    lags: list[float] = []
    for n in fig.nodes:
        used = fig.busy_nodes.get(n["name"])
        state = node_display_state(
            registered=bool(n["registered"]),
            down=bool(n["down"]),
            drain=bool(n["drain"]),
            used_cpus=used or 0,
            total_cpus=int(n["cpus"] or 0),
            busy=used is not None,
        )
        states[state] = states.get(state, 0) + 1
        flags["down"] += bool(n["down"])
        flags["drain"] += bool(n["drain"])
        flags["unregistered"] += not n["registered"]
        health = n.get("health") or {}
        status = health.get("status") or "ok"
        if status in ("warn", "fail"):
            flags[f"health_{status}"] += 1
        if n["drain"]:
            kind = drain_kind(n.get("drain_by"))
            drains[kind] = drains.get(kind, 0) + 1
        for check, st in (health.get("checks") or {}).items():
            key = (str(check)[:64], str((st or {}).get("status") or "ok"))
            checks[key] = checks.get(key, 0) + 1
        if n["registered"] and not n["down"] and n.get("last_heartbeat") is not None:
            lags.append(max(0.0, fig.db_now - float(n["last_heartbeat"])))
    out: list[Metric] = []
    g = GaugeMetricFamily(
        "phalanx_nodes", "Nodes by state (as `phalanx nodes` shows it)", labels=["state"]
    )
    for state, c in sorted(states.items()):
        g.add_metric([state], c)
    out.append(g)
    g = GaugeMetricFamily("phalanx_nodes_flagged", "Nodes with a flag set", labels=["flag"])
    for flag, c in sorted(flags.items()):
        g.add_metric([flag], c)
    out.append(g)
    g = GaugeMetricFamily(
        "phalanx_nodes_drained",
        "Drained nodes by who drained them (operator, health, maintenance, phalanx)",
        labels=["kind"],
    )
    for kind in ("health", "maintenance", "operator", "phalanx"):
        g.add_metric([kind], drains.get(kind, 0))
    out.append(g)
    g = GaugeMetricFamily(
        "phalanx_node_health_checks",
        "Nodes by health check and its reported status (ok, warn, fail)",
        labels=["check", "status"],
    )
    for (check, st), c in sorted(checks.items()):
        g.add_metric([check, st], c)
    out.append(g)
    h = observe_buckets(lags, LAG_BUCKETS)
    out.append(
        GaugeHistogramMetricFamily(
            "phalanx_agent_heartbeat_lag_seconds",
            "Registered nodes not DOWN by time since their last heartbeat reached the store",
            buckets=_buckets(h),
            gsum_value=h.sum,
        )
    )
    return out


def _lease_families(fig: StoreFigures) -> list[Metric]:
    term = GaugeMetricFamily(
        "phalanx_lease_term", "Current fencing term of each lease", labels=["lease"]
    )
    takeovers = CounterMetricFamily(
        "phalanx_lease_takeovers",
        "Times a lease changed holder (its term minus one: terms only grow on a change)",
        labels=["lease"],
    )
    holder = GaugeMetricFamily(
        "phalanx_lease_holder",
        "1 for the controller holding each valid lease",
        labels=["lease", "holder"],
    )
    for r in fig.leases:
        t = int(r["term"] or 0)
        term.add_metric([r["name"]], t)
        takeovers.add_metric([r["name"]], max(0, t - 1))
        if r.get("valid") and r.get("holder"):
            holder.add_metric([r["name"], r["holder"]], 1)
    return [term, takeovers, holder]


def _event_families(fig: StoreFigures) -> list[Metric]:
    requeues: dict[str, int] = {}
    retries: dict[str, int] = {}
    for _kind, why, retry, n in fig.requeues:
        requeues[why] = requeues.get(why, 0) + n
        if retry:
            retries[why] = retries.get(why, 0) + n
    rq = CounterMetricFamily(
        "phalanx_job_requeues",
        "Jobs put back in the queue, by reason (a failure kind, planned, user)",
        labels=["reason"],
    )
    for why, n in sorted(requeues.items()):
        rq.add_metric([why], n)
    rt = CounterMetricFamily(
        "phalanx_job_retries",
        "Failure retries spent (a subset of requeues), by reason",
        labels=["reason"],
    )
    for why, n in sorted(retries.items()):
        rt.add_metric([why], n)
    xid = CounterMetricFamily(
        "phalanx_gpu_xid_errors",
        "Critical GPU XID errors reported by agents, per node, GPU and XID",
        labels=["node", "gpu", "xid"],
    )
    for node, gpu, code, n in sorted(fig.gpu_xid):
        xid.add_metric([node, str(gpu), str(code)], n)
    ecc = CounterMetricFamily(
        "phalanx_gpu_ecc_uncorrectable_errors",
        "Uncorrectable GPU ECC errors reported by agents, per node and GPU",
        labels=["node", "gpu"],
    )
    for node, gpu, n in sorted(fig.gpu_ecc):
        ecc.add_metric([node, str(gpu)], n)
    return [rq, rt, xid, ecc]


# ---------------------------------------------------------------- the cached collector
class ClusterMetrics(Collector):
    """Yields the cluster families from a snapshot at most `cache_seconds` old, refreshed by
    one thread at a time; see the module docstring for outages."""

    def __init__(
        self,
        read: Callable[[], StoreFigures],
        config: MetricsConfig,
        *,
        intervals: Callable[[list[dict[str, Any]]], list[float]] | None = None,
    ) -> None:
        self._read = read
        self.config = config
        self._intervals = intervals
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._up = False
        self._refreshing: threading.Event | None = None  # set when the running refresh ends

    def _refresh(self, done: threading.Event) -> None:
        start = time.monotonic()
        try:
            fig = self._read()
            intervals: list[float] = []
            if self._intervals is not None and fig.checkpointing:
                intervals = self._intervals(fig.checkpointing[:MAX_CHECKPOINTING])
            fams = build_families(
                fig,
                max_users=self.config.max_users,
                max_reasons=self.config.max_reasons,
                intervals=intervals,
            )
            private = user_families(fig, max_users=self.config.max_users)
            snap = Snapshot(
                at=time.monotonic(),
                families=fams,
                took=time.monotonic() - start,
                private=private,
            )
            with self._lock:
                self._snap, self._up = snap, True
        except PhalanxError as e:
            log.warning("metrics: cannot read the store: %s", e.message)
            with self._lock:
                self._up = False
        except Exception:
            log.exception("metrics: refresh failed")
            with self._lock:
                self._up = False
        finally:
            with self._lock:
                self._refreshing = None
            done.set()

    def current(self) -> tuple[Snapshot | None, bool]:
        """The snapshot to answer with and whether the store answered for it."""
        with self._lock:
            snap = self._snap
            if snap is not None and time.monotonic() - snap.at < self.config.cache_seconds:
                return snap, self._up
            done = self._refreshing
            if done is None:
                done = self._refreshing = threading.Event()
                threading.Thread(
                    target=self._refresh, args=(done,), name="phx-metrics", daemon=True
                ).start()
        fresh = done.wait(self.config.scrape_wait)
        with self._lock:
            return self._snap, self._up and fresh

    def collect(self) -> Iterator[Metric]:
        snap, up = self.current()
        yield GaugeMetricFamily(
            "phalanx_store_up",
            "1 if the last read of the store's figures succeeded in time",
            value=int(up),
        )
        age = GaugeMetricFamily(
            "phalanx_metrics_age_seconds", "Age of the cluster figures this scrape answers with"
        )
        took = GaugeMetricFamily(
            "phalanx_metrics_refresh_seconds", "Time the last refresh of the cluster figures took"
        )
        if snap is not None:
            age.add_metric([], time.monotonic() - snap.at)
            took.add_metric([], snap.took)
        yield age
        yield took
        if snap is not None:
            yield from snap.families


class UserMetrics(Collector):
    """The per-user families of `cluster`'s snapshot (a scrape with an operator's credential)."""

    def __init__(self, cluster: ClusterMetrics) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        snap, _up = self.cluster.current()
        if snap is not None:
            yield from snap.private


def exposition(cluster: CollectorRegistry, users: CollectorRegistry | None = None) -> bytes:
    """The whole `/metrics` body: this process's instruments, then the cluster figures, then
    (`users`, for an operator's scrape) the per-user series."""
    body = generate_latest(REGISTRY) + generate_latest(cluster)
    return body + generate_latest(users) if users is not None else body


# ---------------------------------------------------------------- API request timing
class RequestMetrics:
    """ASGI middleware: time every HTTP request by route template (never the raw path, so
    job ids and node names do not multiply series), method and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            if method not in METHODS:  # any token is a method to HTTP: keep the label bounded
                method = OTHER
            HTTP_SECONDS.labels(template, method, str(status)).observe(time.perf_counter() - start)
