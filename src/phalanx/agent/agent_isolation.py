"""The node's containment (docs/isolation.md), as the agent keeps it: the cgroup backend this
host offers, this node's parent cgroups, the CPUs each running attempt has, the cgroup plan
of a new attempt, and the sweep of cgroups that ended attempts left behind.

A part of :class:`agent.Agent` (a mixin: the agent's state is the agent's, declared below
for the type checker); the cgroups themselves are made and removed by ``cgroups.py`` and
``cgroup_roots.py``, an attempt's own by its shepherd.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from phalanx.agent import cgroup_roots, cgroups, shepherd_files
from phalanx.agent.cgroup_roots import cgroup_name
from phalanx.agent.files import read_json as _read_json
from phalanx.agent.files import write_json as _write_json
from phalanx.agent.health import HealthMonitor, IsolationCheck
from phalanx.agent.resources import NodeResources

log = logging.getLogger("phalanx.agent")

# the cluster's [isolation] settings until the first register reply (config.IsolationConfig)
DEFAULT_ISOLATION: dict[str, Any] = {"pids_max": 4096, "require_cgroups": True}


class AgentIsolation:
    """The agent's containment: set up at start (:meth:`_prepare_isolation`), a plan per
    attempt, and sweeps."""

    name: str
    state_dir: Path
    tasks_dir: Path
    resources: NodeResources
    health: HealthMonitor | None
    isolation: dict[str, Any]
    layout: cgroups.Layout
    _lock: threading.Lock
    _cpu_pool: list[int]
    _task_cpus: dict[str, list[int]]
    _gpu_devices: list[tuple[int, int, int]]
    _swept_at: float

    @property
    def cgroup_name(self) -> str:
        """This agent's directory under ``phalanx/``: the node name and a hash of the state dir.

        Several agents share a host in a local cluster, and several local clusters (test runs)
        may share one too, with the same node names: each must sweep only its own cgroups."""
        return cgroup_name(self.name, self.state_dir)

    @property
    def isolation_file(self) -> Path:
        return self.state_dir / "isolation.json"

    def _prepare_isolation(self) -> None:
        """Detect the cgroup backend, make this node's parent cgroups, learn the CPUs of the
        running attempts (a restarted agent), sweep cgroups of attempts that ended, and add
        the `isolation` health check."""
        saved = _read_json(self.isolation_file)  # the last register reply's, across restarts
        if saved:
            self.isolation.update({k: saved[k] for k in DEFAULT_ISOLATION if k in saved})
        try:
            detected = cgroups.detect()
        except OSError as e:
            detected = cgroups.Layout(
                "none", missing=cgroups.REQUIRED, problem=f"cannot detect: {e}"
            )
        if detected.usable:
            # before making them: a half-made set (ensure_parents failing midway) is removed too
            try:
                cgroup_roots.record(self.state_dir, detected, self.cgroup_name)
            except OSError as e:
                log.warning("cannot remember this node's cgroups: %s", e)
        try:
            layout = cgroups.ensure_parents(detected, self.cgroup_name)
        except OSError as e:
            layout = cgroups.Layout("none", missing=cgroups.REQUIRED, problem=f"cannot detect: {e}")
        self.layout = layout
        try:
            host = sorted(os.sched_getaffinity(0))
        except OSError:
            host = list(range(os.cpu_count() or 1))
        self._cpu_pool = host[: max(1, self.resources.cpus)]
        self._gpu_devices = gpu_device_files()
        self._task_cpus = {}
        if self.tasks_dir.is_dir():
            for d in self.tasks_dir.iterdir():
                spec = _read_json(d / shepherd_files.SPEC_FILE)
                if spec and not (d / shepherd_files.EXIT_FILE).exists():
                    self._task_cpus[d.name] = [int(c) for c in spec.get("cpus") or []]
        self.sweep_cgroups()
        if layout.usable:
            log.info("isolation: %s; CPUs for jobs: %s", layout.describe(), self._cpu_pool)
        else:
            log.warning(
                "isolation: %s: jobs cannot be contained (require_cgroups=%s)",
                layout.describe(),
                self.isolation["require_cgroups"],
            )
        if self.health is not None and not any(c.name == "isolation" for c in self.health.checks):
            self.health.add_check(
                IsolationCheck(
                    lambda: (self.layout.usable, self.layout.describe()),
                    lambda: bool(self.isolation["require_cgroups"]),
                )
            )

    def _learn_isolation(self, settings: dict[str, Any] | None) -> None:
        """The cluster's [isolation] settings from a register reply; kept for restarts."""
        if not settings:
            return
        new = {k: settings[k] for k in DEFAULT_ISOLATION if k in settings}
        if new and {**self.isolation, **new} != self.isolation:
            self.isolation.update(new)
            log.info("isolation settings: %s", self.isolation)
            try:
                _write_json(self.isolation_file, self.isolation)
            except OSError as e:
                log.warning("cannot save %s: %s", self.isolation_file, e)

    def _pick_cpus(self, attempt: str, count: int) -> list[int]:
        """Host CPUs for a new attempt, away from those of running ones (cgroups.pick_cpus)."""
        for aid in list(self._task_cpus):
            if (self.tasks_dir / aid / shepherd_files.EXIT_FILE).exists() or not (
                self.tasks_dir / aid
            ).is_dir():
                del self._task_cpus[aid]
        cpus = cgroups.pick_cpus(self._cpu_pool, list(self._task_cpus.values()), count)
        self._task_cpus[attempt] = cpus
        return cpus

    def _cgroup_plan(self, launch: dict[str, Any], cpus: list[int]) -> dict[str, Any] | None:
        mem_mb = int(launch.get("mem_mb") or 0)
        return cgroups.plan(
            self.layout,
            self.cgroup_name,
            launch["attempt_id"],
            mem_bytes=mem_mb << 20 if mem_mb > 0 else None,
            pids_max=int(self.isolation["pids_max"]),
            cpus=cpus,
            cpu_count=float(launch.get("cpus") or len(cpus) or 1),
            gpu_deny=cgroups.gpu_denials(self._gpu_devices, list(launch.get("gpu_ids") or [])),
            required=bool(self.isolation["require_cgroups"]),
        )

    def sweep_cgroups(self) -> list[str]:
        """Remove the cgroups of attempts that are over (exited, lost, forgotten): normally
        the shepherd removes its own, but it may have died, or the agent was down.  Returns
        the attempt ids swept."""
        self._swept_at = time.monotonic()
        node_dirs = cgroups.node_dirs(self.layout, self.cgroup_name).values()
        swept = []
        for aid, dirs in cgroup_roots.ended_attempts(node_dirs, self.tasks_dir).items():
            left = cgroups.remove({"dirs": dirs}, timeout=0.5)
            swept.append(aid)
            if left:
                log.warning("cannot remove cgroups of attempt %s yet: %s", aid, left)
            else:
                log.info("removed the cgroups of ended attempt %s", aid)
        return swept

    def release_cgroups(self) -> list[str]:
        """At a clean stop: sweep the cgroups of ended attempts, then remove this node's own
        roots (``<base>/phalanx/<node>-<hash>``) where they are empty, so a stopped agent
        leaves nothing behind.  Roots with running jobs beneath stay (the kernel refuses, and
        nothing is killed): the restarted agent uses them again.  Returns the roots kept."""
        try:
            with self._lock:
                self.sweep_cgroups()
            kept = cgroup_roots.release(self.state_dir, self.cgroup_name)
        except Exception:
            log.exception("cannot remove this node's cgroups at stop; going on")
            return []
        if kept:
            log.info("keeping this node's cgroups (jobs still run in them): %s", ", ".join(kept))
        return kept


def gpu_device_files(dev: str = "/dev") -> list[tuple[int, int, int]]:
    """(index, major, minor) of each /dev/nvidiaN character device here."""
    out: list[tuple[int, int, int]] = []
    try:
        names = os.listdir(dev)
    except OSError:
        return out
    for n in names:
        if n.startswith("nvidia") and n[6:].isdigit():
            try:
                st = os.stat(os.path.join(dev, n))
            except OSError:
                continue
            out.append((int(n[6:]), os.major(st.st_rdev), os.minor(st.st_rdev)))
    return sorted(out)
