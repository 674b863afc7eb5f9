"""`phalanx agent`: one per node. Registers, heartbeats, and reconciles tasks.

The agent keeps no state in memory that matters: each task lives in its own directory under
`<state-dir>/tasks/<attempt-id>/` and is run by a detached shepherd (shepherd.py). A restarted
agent re-reads those directories, re-adopts running shepherds and reports exits that happened
while it was away. The protocol is level-triggered (DESIGN.md §4): every heartbeat carries the
full list of tasks this node has; the reply says what to start, stop and forget.

Two threads talk to the controllers: the poller (a long-poll heartbeat loop that also receives
new work at once) and the watcher (which notices a task's exit file within ~50 ms and reports
it immediately). Both apply replies under one lock, and launching is idempotent per attempt.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx import __version__
from phalanx.agent import (
    cgroup_roots,
    cgroups,
    checkpoint_requests,
    gpu_usage,
    jobfiles,
    shepherd_control,
    shepherd_files,
    shepherd_launch,
)
from phalanx.agent.cgroup_roots import cgroup_name
from phalanx.agent.files import read_json as _read_json
from phalanx.agent.files import write_json as _write_json
from phalanx.agent.files import write_private_json
from phalanx.agent.health import GpuCheck, HealthMonitor, IsolationCheck, Status
from phalanx.agent.jobenv import node_environment
from phalanx.agent.metrics import AgentFigures
from phalanx.agent.resources import NodeResources
from phalanx.agent.step_listener import StepListener, render
from phalanx.agent.steps import StepRunner
from phalanx.auth import launchcred
from phalanx.auth.keys import KeySet
from phalanx.backoff import REGISTER_TIMEOUT_S, Backoff
from phalanx.client import Client
from phalanx.domain import job_reports
from phalanx.errors import ControllerUnavailable, PhalanxError
from phalanx.faulthooks import maybe_hold_reply, maybe_wedge
from phalanx.watchdog import Beats

log = logging.getLogger("phalanx.agent")

WATCH_INTERVAL = 0.05  # how often the watcher looks for new exit files (seconds)
# After a reply that started step tasks here, how long the poller waits for them to end before
# its next heartbeat, so that a short step's exits ride on that heartbeat (which is also the
# next long-poll) instead of a separate exchange from the watcher; and how often it looks.
STEP_EXIT_WAIT_S = 0.1
STEP_EXIT_POLL_S = 0.002
FORGOTTEN_MAX = 100_000  # forgotten attempt ids remembered (never launched again)
HEARTBEAT_GRACE_MIN = 0.5  # seconds; see heartbeat_grace()
MAX_GPU_EVENTS = 256  # GPU events one heartbeat carries (controller/runtime.py takes as many)
CGROUP_SWEEP_INTERVAL = 5.0  # how often leftover cgroups of ended attempts are looked for (s)
# the cluster's [isolation] settings until the first register reply (config.IsolationConfig)
DEFAULT_ISOLATION: dict[str, Any] = {"pids_max": 4096, "require_cgroups": True}


def heartbeat_grace(interval: float) -> float:
    """How long a heartbeat may take beyond its long-poll before the agent fails over to the
    next controller. Config checks 2 * interval + this < fence_timeout, so a frozen controller
    is left in time for a healthy one to refresh the fence."""
    return max(HEARTBEAT_GRACE_MIN, interval)


def reply_is_late(elapsed: float, timeout: float) -> bool:
    """Whether a reply was read later than its request's own timeout allows.

    A live agent never reads one (the HTTP timeout fires first), so a late reply means this
    process was stopped or starved while the reply waited in its socket: the controller may
    have declared the node DOWN and requeued the work the reply starts. It is dropped, as a
    timed-out heartbeat would be; the protocol is level-triggered, so the next heartbeat gets
    whatever still holds."""
    return elapsed > timeout


# what an agent takes from a controller's timings, and whether zero is allowed
AGENT_TIMINGS = {"heartbeat_interval": False, "fence_timeout": False, "fence_kill_grace": True}


def learned_timing(current: dict[str, Any], offered: Any) -> tuple[dict[str, Any], list[str]]:
    """The agent's timings after a controller's reply offered `offered` (a register reply's
    whole [timing], or a heartbeat reply's scaled fields: the heartbeat rule lengthens them as
    the cluster grows), and the offered fields refused.

    A field the agent acts on must be a finite number, positive (the kill grace may be 0); a
    reply with any such field wrong changes none of them, since the interval and the fence
    timeout are only safe together (2 * interval + grace < fence_timeout). Other fields are
    kept as given (shown, never acted on)."""
    if not isinstance(offered, dict):
        return current, ([] if offered is None else ["timing"])
    bad = []
    for name, zero_ok in AGENT_TIMINGS.items():
        if name not in offered:
            continue
        v = offered[name]
        number = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if not number or v < 0 or (v == 0 and not zero_ok):
            bad.append(name)
    if bad:
        return current, bad
    return {**current, **offered}, []


def fence_mark(wall_now: float, mono_now: float, sent_at: float, timeout: float) -> float:
    """The time a controller's reply may write into the fence file (wall clock).

    The controller counts a node's silence from when a heartbeat reached it, so a reply
    vouches for the node only from its request's sending (`sent_at`, monotonic) plus the
    longest a live exchange takes (`timeout`): never later, however late the reply is read.
    A job that a stopped agent launches on waking is then fenced by the same deadline as
    every other job of the node, ahead of the node being declared DOWN (config rule
    fence_timeout + fence_kill_grace + heartbeat_interval + grace < node_down_timeout).
    Read the wall clock before the monotonic one: a stop between the two then errs early."""
    sent_wall = wall_now - (mono_now - sent_at)
    return min(wall_now, sent_wall + timeout)


class Agent:
    def __init__(
        self,
        *,
        name: str,
        state_dir: Path,
        client: Client,
        resources: NodeResources,
        addr: str | None = None,
        health: HealthMonitor | None = None,
        job_env: dict[str, str] | None = None,
        loop_timeout: float = 60.0,
        on_ready: Callable[[], None] | None = None,
        gpu_sampler: gpu_usage.GpuSampler | None = None,
        launch_keys: KeySet | None = None,
        steps_listen: tuple[str, int] | None = None,
        step_report_delay: float = 0.5,
        srun_dir: Path | None = None,
    ) -> None:
        # set in every job: this node's credential socket (it wins over a submitter's) and the
        # controllers (a submitter's own PHALANX_URL wins), so `phalanx` works inside jobs
        self.job_env = dict(job_env or {})
        # the compiled thin srun's directory, first on jobs' PATH (agent/native_srun.py)
        self.srun_dir = srun_dir
        self.name = name
        self.health = health
        self.state_dir = state_dir
        self.tasks_dir = state_dir / "tasks"
        self.fence_file = state_dir / "heartbeat"
        self.client = client
        self.resources = resources
        self.addr = addr or socket.gethostname()
        self.boot_id = uuid.uuid4().hex
        self.timing: dict[str, Any] = {
            "heartbeat_interval": 1.0,
            "fence_timeout": 5.0,
            "fence_kill_grace": 2.0,
        }
        self._lock = threading.Lock()
        self._fence_lock = threading.Lock()
        self._stop = threading.Event()
        # direct step launches (agent/step_listener.py): this node's keys verify the
        # controller's signature; None: the agent takes steps from its heartbeats only
        self.launch_keys = launch_keys
        self.steps_listen = steps_listen if launch_keys is not None else None
        self.steps_at: str | None = None  # host:port told to the controllers
        self._step_listener: StepListener | None = None
        # a step task's end may wait this long for a heartbeat (config steps.exit_report_delay)
        self.step_report_delay = step_report_delay
        self._snapshot_at = 0.0  # monotonic time the last heartbeat's snapshot was taken
        self._known_exited: set[str] = set()
        # step task dirs whose exits the poller is about to report itself (the watcher leaves
        # them alone meanwhile); both threads change _known_exited under _exits_lock
        self._held_steps: set[str] = set()
        self._exits_lock = threading.Lock()
        # Attempts the controller told us to forget. The main loop and the exit watcher both
        # heartbeat, so a reply computed before the forget (still saying "start") can arrive
        # after it, when the task dir is gone: it must not run the job a second time.
        self._forgotten: dict[str, None] = {}
        self.repeats_only = False  # the last reply only repeated stops already requested
        # periodic checkpoints in force, attempt id -> {"interval_s", "signal", "batch_only"}
        self._intervals: dict[int, dict[str, Any]] = {}
        self._registered = False
        # systemd (watchdog.py, agent/main.py): the loops' progress, the first registration
        # (READY=1), and what STATUS= says about the controllers
        self.beats = Beats()
        self.loop_timeout = loop_timeout
        self.on_ready = on_ready
        self.ready = False
        self.last_reply_at: float | None = None  # monotonic time a controller last answered
        self.last_error: str | None = None  # why the last call to the controllers failed
        # containment (docs/isolation.md): the cluster's settings, what this host offers,
        # the CPUs jobs are placed on and those each running attempt has
        self.isolation: dict[str, Any] = dict(DEFAULT_ISOLATION)
        self.layout = cgroups.Layout("none", problem="not detected yet")
        self._cpu_pool: list[int] = []
        self._task_cpus: dict[str, list[int]] = {}
        self._gpu_devices: list[tuple[int, int, int]] = []
        self._swept_at = 0.0
        # what /metrics shows (agent/metrics.py): replaced whole by each heartbeat's snapshot
        self.figures = AgentFigures()
        self._fenced: set[int] = set()  # attempts whose shepherd stopped them by self-fencing
        self._fenced_before = 0
        # GPU usage of running tasks (`phalanx eff`): made in run() when the node has GPUs
        self.gpu_sampler = gpu_sampler
        self.gpu_sample_s = gpu_usage.interval_from_env()
        # job steps (srun) on this node: agent/steps.py
        self.steps = StepRunner(
            state_dir / "steps",
            self.tasks_dir,
            job_env=self.job_env,
            srun_dir=srun_dir,
            fence=self._fence_settings,
            launch=self._launch_shepherd,
        )

    # ------------------------------------------------------------------ lifecycle
    def prepare(self) -> None:
        self.tasks_dir.mkdir(parents=True, exist_ok=True)
        self._prepare_isolation()

    # ------------------------------------------------------------------ isolation
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

    def run(self) -> None:
        """Register (retrying forever), then heartbeat until stopped.

        Shepherds are started through one pre-forked launcher helper for the agent's lifetime
        (an interpreter start per task is the largest per-job cost on the node); it is closed
        when the loop ends and falls back to plain launches by itself if it breaks.
        """
        self.prepare()
        self._launcher: shepherd_launch.Launcher | None = shepherd_launch.Launcher()
        try:
            self._launcher.start()
        except OSError as e:
            log.warning("cannot start the shepherd launcher (launching directly): %s", e)
        if self.health is not None:
            # preflight: a node whose checks fail joins drained, with the reason
            first = self.health.preflight()
            if first.status is not Status.OK:
                log.warning("preflight %s: %s: %s", first.status, first.check, first.reason)
            self.health.start_thread(self._stop, period=1.0)
        self._start_step_listener()
        self._beat("poller")
        self._beat("watcher")
        watcher = threading.Thread(target=self._watch, name="phx-watcher", daemon=True)
        watcher.start()
        if self.gpu_sampler is None and self.resources.gpus:
            from phalanx.agent.health.gpu import FakeNvml, RealNvml

            self.gpu_sampler = gpu_usage.GpuSampler(
                FakeNvml.from_env() or RealNvml(xid_events=False)
            )
        if self.gpu_sampler is not None:
            threading.Thread(target=self._sample_gpus, name="phx-gpu", daemon=True).start()
        retry = Backoff()
        try:
            while not self._stop.is_set():
                maybe_wedge("poller", self._stop)  # a test-only fault hook; nothing unless asked
                self._beat("poller")
                began = time.time()
                try:
                    if not self._registered:
                        self.register()
                    self._hold_step_exits()
                    interval = float(self.timing["heartbeat_interval"])
                    asked = time.monotonic()
                    self.heartbeat(wait=interval)
                    retry.reset()
                    if self.repeats_only:
                        # the controller answers at once while it has stops for this node;
                        # asking again at once would spin for a whole checkpoint grace (the
                        # watcher still reports exits the moment they happen)
                        self._stop.wait(max(0.0, interval - (time.monotonic() - asked)))
                except PhalanxError as e:
                    self.last_error = e.message
                    log.warning("controllers unreachable: %s", e.message)
                    if e.details.get("all_refused") or e.details.get("control_plane_down"):
                        self._control_plane_down(began)
                    # never past the interval: a retry must not make a live node look silent
                    self._stop.wait(retry.next_delay(float(self.timing["heartbeat_interval"])))
                except Exception:
                    log.exception("unexpected error in the heartbeat loop; going on")
                    self._stop.wait(1.0)
        finally:
            # The watcher may still be launching; close() waits for that launch, and later ones
            # fall back to plain launches.  Running shepherds are unaffected.
            if self._step_listener is not None:
                self._step_listener.close()
                self._step_listener = None
            self._launcher.close()
            self.release_cgroups()

    def _start_step_listener(self) -> None:
        if self.steps_listen is None:
            return
        host, port = self.steps_listen
        try:
            listener = StepListener(host, port, self.take_direct_launch)
        except OSError as e:
            log.warning(
                "cannot listen for direct step launches on %s: %s (steps reach this node "
                "through its heartbeats only; steps.agent_host / steps.agent_port)",
                render(host, port),
                e.strerror or e,
            )
            return
        listener.start()
        self._step_listener = listener
        self.steps_at = listener.advertised(self.client.urls)
        log.info("taking direct step launches at %s", self.steps_at)

    def take_direct_launch(self, cred: Any) -> str:
        """A step launch srun hands over (step_listener.py): start it if a controller signed
        it for this node."""
        keys = self.launch_keys
        if keys is None:
            return "refused this agent takes no direct launches"
        try:
            item = launchcred.verify(keys, self.name, cred, now=time.time())
        except launchcred.LaunchRefused as e:
            log.warning("refused a direct step launch: %s", e)
            return f"refused {e}"
        with self._lock:
            started = self.steps.launch(item, hold_exits=False)
        return "ok" if started else "wait"

    def loop_deadline(self, loop: str) -> float:
        """How long `loop` may go without progress before the watchdog calls it wedged: twice
        its longest legitimate iteration (a long-poll heartbeat and its grace; the watcher's
        own heartbeat) plus `watchdog.loop_timeout`."""
        interval = float(self.timing["heartbeat_interval"])
        return self.loop_timeout + 2 * (interval + heartbeat_grace(interval) + 10.0)

    def _beat(self, loop: str) -> None:
        self.beats.beat(loop, self.loop_deadline(loop))

    def jobs_running(self) -> int:
        """Task directories of this node whose job has not exited (batch steps and holders)."""
        if not self.tasks_dir.is_dir():
            return 0
        return sum(
            1
            for d in self.tasks_dir.iterdir()
            if d.is_dir()
            and not d.name.startswith(".")
            and not (d / shepherd_files.EXIT_FILE).exists()
        )

    def summary(self) -> str:
        """One line for systemd's STATUS=: node state, jobs running, controller reachable."""
        state = "registered" if self._registered else "registering"
        if self.health is not None:
            h = self.health.summary()
            if h.get("status") not in (None, "ok"):
                state += f", health {h['status']}: {h.get('check')}: {h.get('reason')}"
            else:
                state += ", health ok"
        interval = float(self.timing["heartbeat_interval"])
        seen = self.last_reply_at
        if seen is not None and time.monotonic() - seen <= 2 * interval + heartbeat_grace(interval):
            reach = "controller reachable"
        else:
            ago = f" for {time.monotonic() - seen:.0f}s" if seen is not None else ""
            reach = f"controller UNREACHABLE{ago}" + (
                f": {self.last_error}" if self.last_error else ""
            )
        return f"node {self.name} {state}; jobs running: {self.jobs_running()}; {reach}"

    def stop(self) -> None:
        # Only sets the event: stop() runs from a signal handler on the thread that may be
        # inside a launch (holding the launcher's lock); run() closes the launcher on its way out.
        self._stop.set()

    def register(self) -> None:
        r = self.resources
        reply, sent_at = self.client.post_timed(
            f"/v1/agents/{self.name}/register",
            {
                "cpus": r.cpus,
                "mem_mb": r.mem_mb,
                "gpus": [list(g) for g in r.gpus],
                "features": r.features,
                **({"topology": r.topology} if r.topology else {}),
                "addr": self.addr,
                "boot_id": self.boot_id,
                "version": __version__,
                "health": self.health.summary() if self.health else None,
            },
            idempotent=True,
            timeout=REGISTER_TIMEOUT_S,
        )
        self._learn_timing(reply.get("timing"))
        self._learn_isolation(reply.get("isolation"))
        self._registered = True
        self.last_reply_at = time.monotonic()
        # not a long-poll: the request's sending is the whole of what the reply vouches for
        self._freshen_fence_file(fence_mark(time.time(), time.monotonic(), sent_at, 0.0))
        if not self.ready:  # the first registration: the agent serves its node from now on
            self.ready = True
            if self.on_ready is not None:
                self.on_ready()
        log.info(
            "registered %s with controller %s: %d cpus, %d MB, %d gpus",
            self.name,
            reply.get("controller"),
            r.cpus,
            r.mem_mb,
            len(r.gpus),
        )

    def _fence_settings(self) -> dict[str, Any]:
        return {
            "heartbeat_file": str(self.fence_file),
            "timeout_s": float(self.timing["fence_timeout"]),
            "kill_grace_s": float(self.timing["fence_kill_grace"]),
        }

    def _launch_shepherd(self, d: Path) -> None:
        launcher: shepherd_launch.Launcher | None = getattr(self, "_launcher", None)
        if launcher is not None:
            launcher.launch(d)
        else:  # apply() used without run()
            shepherd_launch.launch(d)

    def _hold_step_exits(self) -> None:
        """Before the poller's next heartbeat: if the last reply started step tasks here, wait
        up to STEP_EXIT_WAIT_S for them to end, so that their exits go with that heartbeat.

        A trivial step (``srun true``) ends within a few milliseconds of its launch; reporting
        its exit from the watcher costs the controllers a whole exchange per node and step,
        on top of this heartbeat (which must follow anyway: it is the next long-poll).  Work
        that arrives meanwhile waits for the end of the wait at most: the heartbeat's reply
        carries it at once (the protocol is level-triggered).  The watcher skips the held dirs; those
        that ended are marked reported before the heartbeat (should it fail, the poller's
        retry reports them: every heartbeat carries every step), the others are the watcher's
        again."""
        with self._lock:
            names = self.steps.take_launched()
        if not names:
            return
        steps_dir = self.steps.steps_dir
        with self._exits_lock:
            self._held_steps = {f"step:{n}" for n in names}
        try:
            deadline = time.monotonic() + STEP_EXIT_WAIT_S
            left = list(names)
            while True:
                left = [n for n in left if not (steps_dir / n / shepherd_files.EXIT_FILE).exists()]
                if not left or time.monotonic() >= deadline or self._stop.is_set():
                    break
                time.sleep(STEP_EXIT_POLL_S)
        finally:
            with self._exits_lock:
                done = {f"step:{n}" for n in names if n not in left}
                self._known_exited |= done
                self._held_steps = set()

    # ------------------------------------------------------------------ protocol
    def heartbeat(self, wait: float = 0.0) -> dict[str, Any]:
        taken_at = time.time()
        with self._lock:
            self._snapshot_at = time.monotonic()
            tasks = self.snapshot()
            steps = self.steps.snapshot()
        self._note_figures(tasks, steps)
        health = self.health.summary() if self.health else None
        gpu_events = self.gpu_events()
        if health is not None and gpu_events:  # stored by the controller (docs/metrics.md)
            health["gpu_events"] = gpu_events
        # Heartbeats are level-triggered, so retrying one on another controller is safe; the
        # timeout is short so a hung controller does not hold the agent past its fence timeout.
        timeout = wait + heartbeat_grace(float(self.timing["heartbeat_interval"]))
        reply, sent_at = self.client.post_timed(
            f"/v1/agents/{self.name}/heartbeat",
            {
                "tasks": tasks,
                "steps": steps,
                "taken_at": taken_at,
                "wait": wait,
                "health": health,
                **({"steps_at": self.steps_at} if self.steps_at else {}),
            },
            idempotent=True,
            timeout=timeout,
        )
        maybe_hold_reply(reply, self._stop)  # a test-only fault hook
        if gpu_events:
            self._confirm_gpu_events({str(e["key"]) for e in gpu_events})
        elapsed = time.monotonic() - sent_at
        if reply_is_late(elapsed, timeout):
            started = [int(item["attempt_id"]) for item in reply.get("start") or ()]
            log.warning(
                "dropped a heartbeat reply read %.1fs after its request, past its %.1fs "
                "timeout (was this agent stopped?); it would have started attempts %s",
                elapsed,
                timeout,
                started,
            )
            raise ControllerUnavailable(
                f"the heartbeat reply came {elapsed:.1f}s after its request (timeout "
                f"{timeout:.1f}s): dropped",
                late_reply=True,
            )
        self.last_reply_at = time.monotonic()
        self._freshen_fence_file(fence_mark(time.time(), time.monotonic(), sent_at, timeout))
        # after the lateness check: a controller scales only from counts read before it
        # replied, and the detector's count is read after the silence (rescale_timing)
        self._learn_timing(reply.get("timing"))
        with self._lock:
            self.apply(reply)
        return reply

    def _learn_timing(self, offered: Any) -> None:
        """Take the timings a controller's reply gives (learned_timing)."""
        was = self.timing.get("heartbeat_interval")
        self.timing, bad = learned_timing(self.timing, offered)
        if bad:
            log.warning("ignored a controller's timing: invalid %s", ", ".join(bad))
        elif self.timing.get("heartbeat_interval") != was:
            log.info(
                "heartbeat every %.3gs, fence_timeout %.3gs (from the controller)",
                float(self.timing["heartbeat_interval"]),
                float(self.timing["fence_timeout"]),
            )

    # ------------------------------------------------------------------ metrics
    def _gpu_checks(self) -> list[GpuCheck]:
        return [c for c in (self.health.checks if self.health else []) if isinstance(c, GpuCheck)]

    def gpu_events(self) -> list[dict[str, Any]]:
        """GPU events (XIDs, ECC increases) no controller has confirmed yet."""
        return [e for c in self._gpu_checks() for e in c.pending_events()][:MAX_GPU_EVENTS]

    def _confirm_gpu_events(self, keys: set[str]) -> None:
        for c in self._gpu_checks():
            c.confirm(keys)

    def gpu_readings(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for c in self._gpu_checks():
            out.update(c.readings)
        return out

    def _note_figures(self, tasks: list[dict[str, Any]], steps: list[dict[str, Any]]) -> None:
        states: dict[str, int] = {}
        for rep in tasks:
            states[rep["state"]] = states.get(rep["state"], 0) + 1
            if (rep.get("exit") or {}).get("fenced"):
                self._fenced.add(int(rep["attempt_id"]))
        if len(self._fenced) > FORGOTTEN_MAX:  # long forgotten by the controller: keep a count
            self._fenced_before += len(self._fenced)
            self._fenced.clear()
        self.figures = AgentFigures(
            tasks=states,
            steps=sum(1 for s in steps if s.get("state") in ("starting", "running")),
            fenced_total=self._fenced_before + len(self._fenced),
        )

    def _control_plane_down(self, began: float) -> None:
        """Every controller's host refused the connection (no controller process is running),
        or answered that it cannot reach the database (503 store_unavailable), or a mix.

        Self-fencing exists so that a node cut off from live controllers stops its jobs before
        they are requeued elsewhere. When every controller in our list is either not running
        or running without a database, nobody can declare this node dead (that is a database
        write, and a controller whose store comes back first waits a full node_down_timeout
        of fresh heartbeats before judging any node), so the jobs keep running: a control-plane
        or database outage must never look like a dead cluster. A controller that does not
        answer at all (a timeout) may be partitioned from us while it reaches the database, so
        that case still fences. This assumes --url lists every controller.

        `began` (wall clock) is when the failed call started: the refusals say nothing about
        later, should this process have been stopped since.
        """
        self._freshen_fence_file(min(began, time.time()))

    def _freshen_fence_file(self, at: float) -> None:
        """Shepherds stop their jobs when this file goes stale (self-fencing, DESIGN.md §4).

        `at` (wall clock) is the moment the controllers vouched for. The poller and the watcher
        both heartbeat, so the file's time does not go back, unless it lies in the future (the
        wall clock was stepped back): jobs would then outlive their fence by the step."""
        with self._fence_lock:
            try:
                try:
                    was = self.fence_file.stat().st_mtime
                    if was <= time.time():
                        at = max(at, was)
                except FileNotFoundError:
                    self.fence_file.touch()
                os.utime(self.fence_file, (at, at))
            except OSError as e:
                log.warning("cannot freshen %s: %s", self.fence_file, e)

    def snapshot(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.tasks_dir.is_dir():
            return out
        for d in sorted(self.tasks_dir.iterdir()):
            meta = _read_json(d / "meta.json")
            if meta is None:
                continue
            status = shepherd_control.read_status(d)
            st = status.get("state")
            rep: dict[str, Any] = {"attempt_id": meta["attempt_id"], "token": meta["token"]}
            if st == "exited":
                rep["state"] = "exited"
                rep["exit"] = {k: v for k, v in status.items() if k != "state"}
                gpu = gpu_usage.summary(gpu_usage.read(d))
                if gpu is not None:
                    rep["exit"]["gpu"] = gpu
                rep["started_at"] = status.get("started_at")
            elif st == "running":
                rep["state"] = "running"
                rep["started_at"] = status.get("started_at") or meta.get("launched_at")
                self._periodic_checkpoint(d, meta["attempt_id"], rep["started_at"])
            elif st == "starting":
                rep["state"] = "starting"
            elif st == "lost":
                rep["state"] = "lost"
                rep["exit"] = {
                    "error": status.get("reason") or "shepherd vanished",
                    "ended_at": time.time(),
                }
            else:  # absent: the launch never happened (agent died in between)
                rep["state"] = "lost"
                rep["exit"] = {"error": "the shepherd was never started", "ended_at": time.time()}
            rep.update(read_job_reports(d))
            rep["signals_done"] = signals_done(d)
            out.append(rep)
        return out

    def apply(self, reply: dict[str, Any]) -> None:
        """Act on a heartbeat reply. Sets `repeats_only` when the reply asked for nothing
        but stops already requested (a planned stop's grace: the controller repeats them
        in every reply, level-triggered), so the poller need not ask again at once."""
        news = bool(reply.get("start") or reply.get("signal") or reply.get("forget"))
        if "checkpoint" in reply:  # level-triggered: the whole list of intervals in force
            self._intervals = {
                int(item["attempt_id"]): item for item in reply.get("checkpoint") or []
            }
        for launch in reply.get("start", []):
            self._launch(launch)
        self._deliver_signals(reply.get("signal") or [])
        for stop in reply.get("stop", []):
            d = self.tasks_dir / str(stop["attempt_id"])
            if d.is_dir() and not (d / shepherd_files.STOP_FILE).exists():
                news = True
                log.info("stopping attempt %s: %s", stop["attempt_id"], stop.get("reason"))
            if d.is_dir():
                holder = bool((_read_json(d / "spec.json") or {}).get("holder"))
                planned = stop.get("checkpoint_signal") is not None
                shepherd_control.request_stop(
                    d,
                    # a holder gets no signal, but keeps the job's cgroup here until the
                    # steps in it have checkpointed and ended, or the grace is over
                    checkpoint_signal=None if holder else stop.get("checkpoint_signal"),
                    checkpoint_grace=float(stop.get("checkpoint_grace") or 0.0),
                    reason=stop.get("reason"),
                    wait=holder and planned,
                )
            # the job's steps here stop with it (a planned stop checkpoints them first)
            news = self.steps.stop(int(stop["attempt_id"]), None, stop) > 0 or news
        if reply.get("steps"):
            news = self.steps.apply(reply["steps"]) or news
        self.repeats_only = not news
        for aid in reply.get("forget", []):
            d = self.tasks_dir / str(aid)
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            self._known_exited.discard(str(aid))
            self._forgotten[str(aid)] = None
        while len(self._forgotten) > FORGOTTEN_MAX:
            del self._forgotten[next(iter(self._forgotten))]  # the oldest

    def _periodic_checkpoint(self, d: Path, attempt_id: int, started_at: float | None) -> None:
        """Ask a running job for a checkpoint when its interval in force has passed."""
        item = self._intervals.get(int(attempt_id))
        if item is None:
            return
        marker = read_job_reports(d).get("checkpoint") or {}
        request = checkpoint_requests.read_checkpoint_request(d) or {}
        if not checkpoint_due(
            time.time(),
            item.get("interval_s"),
            started_at=started_at,
            last_checkpoint_at=marker.get("finished_at"),
            last_request_at=request.get("requested_at"),
        ):
            return
        try:
            seq = shepherd_control.request_checkpoint(
                d, "interval", int(item["signal"]), batch_only=bool(item.get("batch_only"))
            )
        except (OSError, ValueError) as e:
            log.warning("cannot request a checkpoint of attempt %s: %s", attempt_id, e)
            return
        if seq is not None:
            log.info("periodic checkpoint request %d to attempt %s", seq, attempt_id)
            if not item.get("batch_only"):
                # the job's srun steps get it too: they are where training runs
                self.steps.signal_attempt(int(attempt_id), int(item["signal"]))

    def _deliver_signals(self, items: list[dict[str, Any]]) -> None:
        """Deliver the signals the controller lists (scancel --signal), each seq once.

        The highest seq handled is kept in the task dir (``signals-done``) and reported in
        heartbeats, so a repeated reply or a restarted agent never sends one twice. Targets, as
        Slurm's: ``batch`` the batch shell only, ``full`` the batch shell's whole process group
        and every step, ``steps`` every step only. A signal that cannot be delivered yet (the
        shepherd is still starting) is tried again with the next reply; one for a job that has
        already exited is done.
        """
        for item in sorted(items, key=lambda i: (int(i["attempt_id"]), int(i["seq"]))):
            aid, seq = int(item["attempt_id"]), int(item["seq"])
            d = self.tasks_dir / str(aid)
            if not d.is_dir() or seq <= signals_done(d):
                continue
            signum, target = int(item["signum"]), str(item["target"])
            if target in ("batch", "full") and not self._signal_batch(d, signum, target):
                continue  # not running yet (or its shepherd is gone): next reply
            if target in ("steps", "full"):
                self._signal_steps(aid, signum)
            log.info("signal %d (%s, seq %d) delivered to attempt %s", signum, target, seq, aid)
            _write_json(d / SIGNALS_DONE_FILE, {"seq": seq})

    @staticmethod
    def _signal_batch(d: Path, signum: int, target: str) -> bool:
        """Signal the batch shell (``batch``) or its process group (``full``) through its
        shepherd; True when done with it (delivered, or the job has already exited)."""
        if (d / shepherd_files.EXIT_FILE).exists():
            return True
        sent = shepherd_control.forward_signal(d, signum, batch_only=target == "batch")
        return sent or (d / shepherd_files.EXIT_FILE).exists()

    def _signal_steps(self, attempt_id: int, signum: int) -> None:
        """Signal every job step (srun) of this attempt running on this node: each step task's
        process group, through its shepherd (agent/steps.py). A job without steps gets nothing,
        exactly as Slurm's ``scancel --signal`` without ``--batch``/``--full``."""
        sent = self.steps.signal_attempt(attempt_id, signum)
        if sent:
            log.info("signal %d to %d step task(s) of attempt %s", signum, sent, attempt_id)

    def _launch(self, launch: dict[str, Any]) -> None:
        d = self.tasks_dir / str(launch["attempt_id"])
        if d.exists() or str(launch["attempt_id"]) in self._forgotten:
            return  # already launched (replies may repeat), or already over and forgotten
        tmp = self.tasks_dir / f".{launch['attempt_id']}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tmp.chmod(0o711)  # the job's user reaches its script and control/, lists nothing
        owner = job_owner(launch.get("user"))
        cmd = launch["command"]
        if "script" in cmd:
            script = tmp / "script"
            script.write_text(cmd["script"])
            script.chmod(0o700)
            if owner:
                os.chown(script, *owner)
            argv = [str(d / "script"), *cmd.get("args", [])]
        else:
            argv = list(cmd["argv"])
        env = node_environment(launch["env"], self.job_env, self.srun_dir)
        env["PHX_TASK_DIR"] = str(d)
        # the checkpoint protocol's control files (docs/checkpoints.md)
        (tmp / shepherd_files.CONTROL_DIR).mkdir(mode=0o700)
        if owner:  # the job writes checkpoint.json and progress.json there
            os.chown(tmp / shepherd_files.CONTROL_DIR, *owner)
        # a TMPDIR of the job's own on this node, for its batch step and its steps; it goes
        # with the task directory when the attempt is over
        (tmp / "tmp").mkdir(mode=0o700)
        if owner:
            os.chown(tmp / "tmp", *owner)
        env["TMPDIR"] = str(d / "tmp")
        env.update(checkpoint_requests.control_environment(d))
        cpus = self._pick_cpus(str(launch["attempt_id"]), int(launch.get("cpus") or 1))
        stdout = launch["stdout"]
        stderr = launch["stderr"]
        open_mode = launch["open_mode"]
        if launch.get("all_nodes") and int(env.get("PHX_NNODES", "1")) > 1:
            open_mode = "append"  # every node writes the same file: never truncate a peer's lines
        spec = {
            "attempt_id": launch["attempt_id"],
            "job_id": launch["job_id"],
            "token": launch["token"],
            "node": self.name,
            "rank": launch["rank"],
            "holder": bool(launch.get("holder")),
            "argv": argv,
            "env": env,
            "cwd": launch["cwd"],
            "stdout": stdout,
            "stderr": stderr,
            "open_mode": open_mode,
            "time_limit_s": launch["time_limit_s"],
            "kill_grace_s": launch["kill_grace_s"],
            "progress_timeout_s": launch.get("progress_timeout_s"),
            "signal": launch.get("signal"),
            # --signal without B: goes to the job's running steps when it has any (shepherd)
            "steps_dir": str(self.steps.steps_dir),
            "checkpoint": launch.get("checkpoint"),
            "fence": self._fence_settings(),
            "user": launch.get("user"),
            "cpus": cpus,
            "cgroup": self._cgroup_plan(launch, cpus),
        }
        # the job's environment and the attempt's token are nobody else's business
        write_private_json(tmp / "spec.json", spec)
        write_private_json(
            tmp / "meta.json",
            {
                "attempt_id": launch["attempt_id"],
                "token": launch["token"],
                "job_id": launch["job_id"],
                "launched_at": time.time(),
                "gpu_ids": list(launch.get("gpu_ids") or []),  # sampled for `eff`
            },
        )
        os.replace(tmp, d)
        launcher: shepherd_launch.Launcher | None = getattr(self, "_launcher", None)
        try:
            if launcher is not None:
                launcher.launch(d)
            else:  # apply() used without run()
                shepherd_launch.launch(d)
            log.info(
                "started job %s attempt %s rank %s",
                launch["job_id"],
                launch["attempt_id"],
                launch["rank"],
            )
        except Exception as e:
            log.error("could not start a shepherd for attempt %s: %s", launch["attempt_id"], e)
            _write_json(
                d / "exit.json",
                {
                    "exit_code": None,
                    "signal": None,
                    "timed_out": False,
                    "cancelled": False,
                    "fenced": False,
                    "launch_failed": True,
                    "error": f"cannot start the shepherd: {e}",
                    "started_at": None,
                    "ended_at": time.time(),
                },
            )

    def _sample_gpus(self) -> None:
        """Sample the GPUs of running tasks every `gpu_sample_s` (agent/gpu_usage.py)."""
        assert self.gpu_sampler is not None
        while not self._stop.wait(self.gpu_sample_s):
            try:
                if not self.tasks_dir.is_dir():
                    continue
                tasks = []
                for d in self.tasks_dir.iterdir():
                    if d.name.startswith(".") or (d / "exit.json").exists():
                        continue
                    meta = _read_json(d / "meta.json")
                    if meta and meta.get("gpu_ids") and (d / "job.json").exists():
                        tasks.append((d, [int(i) for i in meta["gpu_ids"]]))
                self.gpu_sampler.sample(tasks)
            except Exception:
                log.exception("GPU usage sampler error; going on")

    def _step_ends_can_wait(self) -> bool:
        """Whether the ends of step tasks may wait for a later heartbeat: until
        `step_report_delay` after the last heartbeat's snapshot.  srun learns of a task's end
        from the task itself, and a burst of short steps (a loop of ``srun``) then costs the
        controllers one exchange per node per delay instead of one per step; a job task's end
        is never held (it ends the attempt), and takes the held step ends along."""
        return time.monotonic() - self._snapshot_at < self.step_report_delay

    def _watch(self) -> None:
        """Report a task's exit as soon as its exit file appears."""
        while not self._stop.wait(WATCH_INTERVAL):
            maybe_wedge("watcher", self._stop)  # a test-only fault hook; nothing unless asked
            self._beat("watcher")
            try:
                if not self._registered or not self.tasks_dir.is_dir():
                    continue
                if time.monotonic() - self._swept_at >= CGROUP_SWEEP_INTERVAL:
                    with self._lock:
                        self.sweep_cgroups()
                fresh = [
                    d.name
                    for d in self.tasks_dir.iterdir()
                    if d.name not in self._known_exited and (d / "exit.json").exists()
                ]
                steps_exited = {f"step:{name}" for name in self.steps.exited_dirs()}
                with self._exits_lock:
                    # forgotten steps' dirs are gone: so are their names here
                    self._known_exited -= {
                        n
                        for n in self._known_exited
                        if n.startswith("step:") and n not in steps_exited
                    }
                    # the poller reports the exits of step tasks it has just started itself
                    step_ends = sorted(steps_exited - self._known_exited - self._held_steps)
                    if step_ends and not fresh and self._step_ends_can_wait():
                        step_ends = []  # a later heartbeat takes them, with the next ones
                    fresh += step_ends
                    if fresh:
                        self._known_exited.update(fresh)
                if fresh:
                    self.heartbeat(wait=0.0)
            except PhalanxError as e:
                log.debug("exit report failed (the poller will retry): %s", e.message)
            except Exception:
                log.exception("watcher error; going on")


def job_owner(user: str | None) -> tuple[int, int] | None:
    """(uid, gid) to give the job's own files to, when the agent is root and the user is known
    (an unknown user is the shepherd's to report); None: leave them as they are."""
    if not user or os.geteuid() != 0:
        return None
    import pwd

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None
    return (pw.pw_uid, pw.pw_gid) if pw.pw_uid != 0 else None


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


def checkpoint_due(
    now: float,
    interval_s: float | None,
    *,
    started_at: float | None,
    last_checkpoint_at: float | None,
    last_request_at: float | None,
) -> bool:
    """Whether a periodic checkpoint is due: the interval has passed since the attempt
    started, its last checkpoint, or the last request (so a job that is slow to answer, or
    ignores requests, is asked once per interval rather than on every heartbeat)."""
    if not interval_s or interval_s <= 0 or started_at is None:
        return False
    times = [t for t in (started_at, last_checkpoint_at, last_request_at) if t is not None]
    return now - max(times) >= interval_s


SIGNALS_DONE_FILE = "signals-done.json"


def signals_done(task_dir: Path) -> int:
    """The highest signal seq delivered to this task (0: none)."""
    data = _read_json(task_dir / SIGNALS_DONE_FILE) or {}
    try:
        return max(0, int(data.get("seq") or 0))
    except (TypeError, ValueError):
        return 0


def read_job_reports(task_dir: Path) -> dict[str, Any]:
    """The job's checkpoint marker and progress, as reported in heartbeats (absent: omitted).

    The job's user owns ``control/`` and may put anything there: each file is read only when
    it is a regular file of that user (the directory's owner), at most 64 KiB, without
    following a link or blocking on a FIFO (agent/jobfiles.py); anything else is absent, and
    the reason (never the content) is logged once."""
    out: dict[str, Any] = {}
    control = task_dir / shepherd_files.CONTROL_DIR
    try:
        owner = jobfiles.dir_owner(control)
    except jobfiles.Refused as e:  # the task dir is root's: never expected, said if so
        jobfiles.warn_once(e.path, e.reason)
        return out
    except OSError:
        return out
    for key, name, parse in (
        ("checkpoint", shepherd_files.CHECKPOINT_MARKER_FILE, job_reports.parse_checkpoint_marker),
        ("progress", shepherd_files.PROGRESS_FILE, job_reports.parse_progress),
    ):
        got = jobfiles.read_or_none(control / name, (owner,), jobfiles.MAX_JOB_FILE)
        if got is None:
            continue
        data, st = got
        value = parse(data.decode("utf-8", errors="replace"), st.st_mtime)
        if value is not None:
            out[key] = value
    return out
