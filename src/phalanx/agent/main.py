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

from phalanx.agent.agent import Agent
from phalanx.agent.health import build_monitor
from phalanx.agent.resources import detect, parse_gpu_override
from phalanx.auth import localsock, service
from phalanx.client import Client
from phalanx.config import load_config
from phalanx.controller.server import StartupError, check_state_dir, setup_logging
from phalanx.domain.topology import parse_place
from phalanx.domain.values import parse_memory_mb
from phalanx.errors import PhalanxError

log = logging.getLogger("phalanx.agent")


def load_health_config(path: Path | None) -> dict[str, Any]:
    """The [health] table of a TOML file (or the whole file); none = the default checks."""
    if path is None:
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise StartupError(f"health config {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise StartupError(f"health config {path} is not valid TOML: {e}") from None
    return dict(data.get("health", data))


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
        try:
            monitor = build_monitor(load_health_config(health_config))
        except ValueError as e:
            raise StartupError(f"health config {health_config}: {e}") from None
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
    )

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info(
        "agent %s starting (state dir %s; jobs keep running if the agent stops)", name, state_dir
    )
    agent.run()
    creds.close()
    client.close()
    log.info("agent %s stopped", name)
    return 0
