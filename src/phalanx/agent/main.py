"""Start-up of `phalanx agent`: resolve resources, check the state dir, run the loop."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tomllib
from pathlib import Path
from types import FrameType
from typing import Any

from phalanx.agent import metrics as agent_metrics
from phalanx.agent import native_srun as native
from phalanx.agent.agent import Agent
from phalanx.agent.health import build_monitor
from phalanx.agent.hooks import parse_hooks
from phalanx.agent.nodeconf import health_table
from phalanx.agent.resources import detect, parse_gpu_override
from phalanx.auth import localsock, service
from phalanx.client import Client
from phalanx.config import load_config
from phalanx.daemon import StartupError, check_state_dir, open_device, setup_logging
from phalanx.domain.topology import parse_place
from phalanx.domain.values import parse_memory_mb
from phalanx.errors import PhalanxError
from phalanx.gctune import tune_collector
from phalanx.sdnotify import Notifier
from phalanx.watchdog import DeviceWatchdog, Watchdog

log = logging.getLogger("phalanx.agent")


def load_node_file(path: Path | None) -> dict[str, Any]:
    """The agent's node file (``--health-config``), parsed; none = empty."""
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise StartupError(f"health config {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise StartupError(f"health config {path} is not valid TOML: {e}") from None


def run_agent(
    *,
    name: str | None,
    state_dir: Path,
    url: str | None,
    cpus: int | None,
    mem: str | None,
    gpus: str | None,
    features: str,
    topology: str = "",
    health_config: Path | None = None,
    log_level: str = "info",
    key_file: Path | None = None,
    auth_socket: Path | None = None,
) -> int:
    name = name or socket.gethostname().split(".")[0]
    setup_logging(log_level, f"agent[{name}]")
    # first: the jobs and shepherds this agent starts must not inherit systemd's socket
    notifier = Notifier.from_environment()
    device: DeviceWatchdog | None = None
    try:
        check_state_dir(state_dir)
        res = detect()
        if cpus is not None:
            if cpus < 1:
                raise StartupError("--cpus must be at least 1")
            res.cpus = cpus
        if mem is not None:
            try:
                res.mem_mb = parse_memory_mb(mem)
            except ValueError as e:
                raise StartupError(f"--mem: {e}") from None
        if gpus is not None:
            try:
                res.gpus = parse_gpu_override(gpus)
            except ValueError as e:
                raise StartupError(f"--gpus: {e}") from None
        res.features = [f.strip() for f in features.split(",") if f.strip()]
        try:
            res.topology = parse_place(topology)
        except ValueError as e:
            raise StartupError(f"--topology: {e}") from None
        node_file = load_node_file(health_config)
        try:
            monitor = build_monitor(health_table(node_file))
        except ValueError as e:
            raise StartupError(f"health config {health_config}: {e}") from None
        try:
            hooks = parse_hooks(node_file)
        except ValueError as e:
            raise StartupError(f"node config {health_config}: {e}") from None
        config = load_config()
        keys = service.host_keys(service.key_file(key_file, service.DEFAULT_NODE_KEY), "node", name)
        cluster, ttl = config.cluster.name, config.auth.credential_ttl
        client = Client(url, credentials=service.agent_source(keys, name, cluster, ttl))
        sock = auth_socket or Path(os.environ.get(localsock.ENV_SOCKET) or localsock.DEFAULT_SOCKET)
        try:
            creds = service.serve_local(keys, cluster, ttl, sock)
        except OSError as e:
            raise StartupError(
                f"cannot serve local credentials on {sock}: {e.strerror or e} "
                "(choose another path with --auth-socket)"
            ) from None
        try:
            device = open_device(config.watchdog.device, config.watchdog.interval)
        except StartupError:
            creds.close()
            raise
    except (StartupError, PhalanxError) as e:
        print(f"phalanx agent: {e}", file=sys.stderr)
        return 2
    agent = Agent(
        name=name,
        state_dir=state_dir,
        client=client,
        resources=res,
        health=monitor,
        job_env={
            localsock.ENV_SOCKET: str(sock.absolute()),
            "PHALANX_URL": ",".join(client.urls),
        },
        loop_timeout=config.watchdog.loop_timeout,
        launch_keys=keys if config.steps.direct else None,
        steps_listen=(config.steps.agent_host, config.steps.agent_port),
        step_report_delay=config.steps.exit_report_delay,
        usage_sample_s=config.accounting.gather_interval,
        srun_dir=native.thin_srun_dir(state_dir) if config.steps.compiled_srun else None,
        hooks=hooks,
        node_file=node_file,
    )
    watchdog = Watchdog(
        notifier,
        agent.beats,
        status=agent.summary,
        interval=config.watchdog.interval,
        device=device,
    )

    monitor.observe = agent_metrics.observe_check
    try:
        agent_metrics.serve(
            config.metrics.agent_port,
            config.metrics.agent_host,
            agent_metrics.AgentCollector(
                name,
                lambda: agent.figures,
                lambda: monitor.summary(),
                agent.gpu_readings,
            ),
        )
    except OSError as e:
        creds.close()
        if device is not None:
            device.close(disarm=True)
        print(
            f"phalanx agent: cannot serve /metrics on {config.metrics.agent_host}:"
            f"{config.metrics.agent_port}: {e.strerror or e} (metrics.agent_port; 0 turns it off)",
            file=sys.stderr,
        )
        return 2

    def _ready() -> None:
        watchdog.ready(agent.summary())

    agent.on_ready = _ready

    def _stop(sig: int, _frame: FrameType | None) -> None:
        notifier.stop(f"stopping on signal {sig}; jobs keep running")
        agent.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info(
        "agent %s starting (state dir %s; jobs keep running if the agent stops)", name, state_dir
    )
    if notifier.enabled:
        notifier.status(f"node {name}: registering with {', '.join(client.urls)}")
    tune_collector()  # start-up is over: out of the collector's sight (gctune.py)
    # from the start: the hardware device is armed, and the controllers may be away for long
    watchdog.start()
    try:
        agent.run()
    finally:
        notifier.stop("stopping; jobs keep running")
        watchdog.stop(clean=True)
        notifier.close()
    creds.close()
    client.close()
    log.info("agent %s stopped", name)
    return 0
