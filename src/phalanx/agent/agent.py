"""`phalanx agent`: one per node. Registers, heartbeats, and reconciles tasks.

The agent keeps no state in memory that matters: each task lives in its own directory under
`<state-dir>/tasks/<attempt-id>/` and is run by a detached shepherd (shepherd.py). A restarted
agent re-reads those directories, re-adopts running shepherds and reports exits that happened
while it was away. The protocol is level-triggered (DESIGN.md §4): every heartbeat carries the
full list of tasks this node has; the reply says what to start, stop and forget.

Two threads talk to the controllers: the poller (a long-poll heartbeat loop that also receives
new work at once) and the watcher (which notices a task's exit file within ~50 ms and reports
it immediately). Both apply replies under one lock, and launching is idempotent per attempt.

This module holds the agent's loops and the protocol (registering, heartbeats, applying a
reply, reporting exits, the fence file); the rest of :class:`Agent` comes from its parts:
containment (agent_isolation.py), launching tasks (agent_launch.py), stops, signals and
periodic checkpoints (agent_stops.py) and its reports on the node (agent_status.py); the
protocol's timing rules are agent_timing.py.
"""

from __future__ import annotations

import json
import logging
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
    cgroups,
    gpu_usage,
    membership,
    shepherd_control,
    shepherd_files,
    shepherd_launch,
    taskstat,
)
from phalanx.agent.agent_isolation import DEFAULT_ISOLATION
from phalanx.agent.agent_launch import AgentLaunch
from phalanx.agent.agent_nodeconf import AgentNodeConfig
from phalanx.agent.agent_status import AgentStatus, read_job_reports
from phalanx.agent.agent_stops import AgentStops, signals_done
from phalanx.agent.agent_timing import fence_mark, heartbeat_grace, learned_timing, reply_is_late
from phalanx.agent.files import read_json as _read_json
from phalanx.agent.health import HealthMonitor, Status
from phalanx.agent.hooks import NodeHooks, launch_timeout_warning
from phalanx.agent.metrics import AgentFigures
from phalanx.agent.resources import NodeResources
from phalanx.agent.step_listener import StepListener, render
from phalanx.agent.steps import StepRunner
from phalanx.auth import launchcred
from phalanx.auth.keys import KeySet
from phalanx.backoff import REGISTER_TIMEOUT_S, Backoff
from phalanx.client import Client
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
CGROUP_SWEEP_INTERVAL = 5.0  # how often leftover cgroups of ended attempts are looked for (s)


class Agent(AgentLaunch, AgentStops, AgentStatus, AgentNodeConfig):
    """The node agent: its state, its two loops, and the heartbeat protocol."""

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
        usage_sample_s: float = 30.0,
        hooks: NodeHooks | None = None,
        node_file: dict[str, Any] | None = None,
    ) -> None:
        # set in every job: this node's credential socket (it wins over a submitter's) and the
        # controllers (a submitter's own PHALANX_URL wins), so `phalanx` works inside jobs
        self.job_env = dict(job_env or {})
        # the compiled thin srun's directory, first on jobs' PATH (agent/native_srun.py)
        self.srun_dir = srun_dir
        self.usage_sample_s = usage_sample_s  # accounting.gather_interval (taskstat.py)
        self.hooks = hooks  # the node's prolog, epilog and task prolog (agent/hooks.py)
        self.name = name
        self.health = health
        self.state_dir = state_dir
        self.tasks_dir = state_dir / "tasks"
        self.fence_file = state_dir / "heartbeat"
        self.client = client
        self.resources = resources
        # the node file's settings (`node_file`: --health-config, parsed), with those the
        # controllers deliver from the versioned configuration (agent_nodeconf.py)
        self._init_node_config(node_file)
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
        threading.Thread(target=self._sample_usage, name="phx-usage", daemon=True).start()
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
        if "stat" in item:  # a controller asks for its steps' live usage (sstat)
            ask = item["stat"]
            steps = ask.get("steps")
            tasks = taskstat.step_usage(
                self.tasks_dir,
                self.steps.steps_dir,
                int(ask["attempt_id"]),
                None if steps is None else [int(s) for s in steps],
                bool(ask.get("batch")),
            )
            return "stat " + json.dumps(tasks, separators=(",", ":"))
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
                **({"steps_at": self.steps_at} if self.steps_at else {}),
            },
            idempotent=True,
            timeout=REGISTER_TIMEOUT_S,
        )
        self._learn_timing(reply.get("timing"))
        self._learn_isolation(reply.get("isolation"))
        self.launch_timeout = (reply.get("timing") or {}).get("launch_timeout")
        if self.hooks is not None:
            said = launch_timeout_warning(self.hooks, self.launch_timeout)
            if said:
                log.warning("%s", said)
        self._learn_node_config(reply.get("node_config"))
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
                **(
                    {"node_config_version": self.node_config_version}
                    if self.node_config_version is not None
                    else {}
                ),
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
        if "node_config" in reply:  # only when this node runs another version (or none)
            with self._lock:  # between launches: the next one takes the new hooks
                self._learn_node_config(reply["node_config"])
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
            rep["members_gen"] = membership.members_done(d)
            out.append(rep)
        return out

    def apply(self, reply: dict[str, Any]) -> None:
        """Act on a heartbeat reply. Sets `repeats_only` when the reply asked for nothing
        but stops already requested (a planned stop's grace: the controller repeats them
        in every reply, level-triggered), so the poller need not ask again at once."""
        news = bool(
            reply.get("start") or reply.get("signal") or reply.get("forget") or reply.get("members")
        )
        if "checkpoint" in reply:  # level-triggered: the whole list of intervals in force
            self._intervals = {
                int(item["attempt_id"]): item for item in reply.get("checkpoint") or []
            }
        for launch in reply.get("start", []):
            self._launch(launch)
        self._deliver_signals(reply.get("signal") or [])
        membership.write_membership(self.tasks_dir, reply.get("members") or [])
        news = self._request_stops(reply.get("stop", [])) or news
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
