"""An agent's own `/metrics` (docs/metrics.md): what only the node knows.

Served on `metrics.agent_port` (0: not served) by prometheus_client's small threaded HTTP
server, from a registry of the agent's own (never the controller's instruments, which the
agent's process also imports): health-check run durations and verdicts, shepherds by state,
tasks its shepherds stopped by self-fencing, and the GPU readings of its last health run.
The cluster-level figures (and the GPU XID/ECC counters that must survive the node) are the
controllers' business: see controller/metrics.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

log = logging.getLogger("phalanx.agent")

REGISTRY = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=REGISTRY)

HEALTH_CHECK_SECONDS = Histogram(
    "phalanx_agent_health_check_seconds",
    "Duration of this node's health-check runs, by check",
    ["check"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)


def observe_check(check: str, seconds: float) -> None:
    """The health monitor's hook: one run of `check` took `seconds`."""
    HEALTH_CHECK_SECONDS.labels(check).observe(seconds)


@dataclass
class AgentFigures:
    """What the agent's loops last saw, read by the collector (replaced whole, never mutated
    in place, so a scrape on the server's thread needs no lock)."""

    tasks: dict[str, int] = field(default_factory=dict)  # shepherd state -> tasks
    steps: int = 0  # job steps with tasks starting or running on the node
    fenced_total: int = 0  # tasks whose shepherd stopped them by self-fencing, since start


class AgentCollector(Collector):
    """Yields the agent's families from `figures()` and the health monitor's state."""

    def __init__(
        self,
        node: str,
        figures: Callable[[], AgentFigures],
        health: Callable[[], dict[str, Any] | None],
        gpus: Callable[[], dict[int, dict[str, float]]],
    ) -> None:
        self.node = node
        self._figures = figures
        self._health = health
        self._gpus = gpus

    def collect(self) -> Iterator[Metric]:
        fig = self._figures()
        sh = GaugeMetricFamily(
            "phalanx_agent_shepherds",
            "Job tasks on this node by their shepherd's state (starting, running, exited, lost)",
            labels=["state"],
        )
        for state in ("starting", "running", "exited", "lost"):
            sh.add_metric([state], fig.tasks.get(state, 0))
        yield sh
        yield GaugeMetricFamily(
            "phalanx_agent_steps", "Job steps with tasks starting or running here", value=fig.steps
        )
        yield CounterMetricFamily(
            "phalanx_agent_fenced_tasks",
            "Tasks this node's shepherds stopped because the agent's heartbeat went stale "
            "(self-fencing), seen since the agent started",
            value=fig.fenced_total,
        )
        summary = self._health() or {}
        status = GaugeMetricFamily(
            "phalanx_agent_health_check_status",
            "1 for each health check's reported status (ok, warn, fail)",
            labels=["check", "status"],
        )
        for check, st in sorted((summary.get("checks") or {}).items()):
            for s in ("ok", "warn", "fail"):
                status.add_metric([check, s], 1 if (st or {}).get("status") == s else 0)
        yield status
        temp = GaugeMetricFamily(
            "phalanx_agent_gpu_temperature_celsius", "GPU core temperature", labels=["gpu"]
        )
        ecc = GaugeMetricFamily(
            "phalanx_agent_gpu_ecc_volatile_uncorrectable_errors",
            "Uncorrectable ECC errors since the driver loaded (NVML's volatile counter)",
            labels=["gpu"],
        )
        for gpu, reading in sorted(self._gpus().items()):
            if "temperature" in reading:
                temp.add_metric([str(gpu)], reading["temperature"])
            if "ecc_uncorrectable" in reading:
                ecc.add_metric([str(gpu)], reading["ecc_uncorrectable"])
        yield temp
        yield ecc


def serve(port: int, host: str, collector: Collector) -> threading.Thread | None:
    """Serve REGISTRY (with `collector`) on host:port; None when port is 0 (not served).

    Raises OSError when the port cannot be bound: the caller says so in one line."""
    if not port:
        return None
    REGISTRY.register(collector)
    _server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    log.info("serving /metrics on %s:%d", host, port)
    return thread
