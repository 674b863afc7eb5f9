"""`phalanx controller`: start checks, then the HTTP server and the controller's loops.

Start-up problems (unwritable state dir, unreachable database, port in use) stop the daemon
with one clear line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from pathlib import Path

import uvicorn

from phalanx.auth import keys as keyfiles
from phalanx.config import Config
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.errors import PhalanxError
from phalanx.store.engine import describe_url
from phalanx.store.store import Store

log = logging.getLogger("phalanx.controller")


class StartupError(Exception):
    """A problem that stops the daemon at start, with a one-line explanation."""


def check_state_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise StartupError(f"state dir {path} is not writable: {e.strerror or e}") from None


def cluster_key_path(config: Config, state_dir: Path) -> Path:
    return (
        Path(config.auth.key_file) if config.auth.key_file else state_dir / "keys" / "cluster.jwks"
    )


def load_cluster_keys(config: Config, state_dir: Path) -> keyfiles.KeySet:
    """The cluster key: the configured file (which must exist: controllers on several hosts
    share it), or one in the state dir, created on first start (a single-host cluster)."""
    path = cluster_key_path(config, state_dir)
    try:
        ks = keyfiles.load(path) if config.auth.key_file else keyfiles.load_or_create(path)
    except PhalanxError as e:
        raise StartupError(e.message) from None
    except OSError as e:
        raise StartupError(f"cannot create the cluster key {path}: {e.strerror or e}") from None
    if not ks.is_cluster:
        raise StartupError(
            f"{path} holds a node's or host's key, not the cluster key: controllers verify "
            "credentials with the cluster key"
        )
    for p in (config.auth.tls_cert, config.auth.tls_key):
        if p is not None and not Path(p).is_file():
            raise StartupError(f"TLS file {p} does not exist (auth.tls_cert / auth.tls_key)")
    return ks


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno in (98, 48):  # EADDRINUSE
            raise StartupError(
                f"port {port} on {host} is already in use: choose another with --port"
            ) from None
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpcore", "alembic", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_controller(
    *,
    config: Config,
    state_dir: Path,
    db_url: str | None,
    host: str,
    port: int,
    cid: str | None,
    log_level: str = "info",
) -> int:
    cid = cid or f"{socket.gethostname()}-{port}-{uuid.uuid4().hex[:4]}"
    setup_logging(log_level, f"controller[{cid}]")
    try:
        check_state_dir(state_dir)
        keys = load_cluster_keys(config, state_dir)
        url = db_url or f"sqlite:///{state_dir.absolute() / 'phalanx.db'}"
        sock = bind_socket(host, port)
        try:
            store = Store(
                url,
                actor=cid,
                policy=config.failure_policy(),
                op_timeout=config.timing.db_op_timeout,
            )
            store.restart_reservation = config.timing.restart_reservation
            store.migrate()
            store.sync_partitions(partition_rows(config))
        except PhalanxError as e:
            sock.close()
            raise StartupError(
                f"cannot use the database {describe_url(url)}: {e.message}"
            ) from None
    except StartupError as e:
        print(f"phalanx controller: {e}", file=sys.stderr)
        return 2
    actual_port = sock.getsockname()[1]
    tls = config.auth.tls_cert is not None
    public = f"{'https' if tls else 'http'}://{host}:{actual_port}"
    ctl = Controller(store, config, cid=cid, url=public)
    app = create_app(ctl, keys)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            # uvicorn[standard] is a dependency: say so rather than rely on "auto" finding them
            loop="uvloop",
            http="httptools",
            log_level="warning",
            access_log=False,  # no log line per request
            proxy_headers=False,  # no proxy in front is trusted; nothing reads the client address
            timeout_keep_alive=30,
            lifespan="on",
            ssl_certfile=config.auth.tls_cert,
            ssl_keyfile=config.auth.tls_key,
        )
    )
    try:
        ctl.start()
    except PhalanxError as e:
        print(f"phalanx controller: cannot start: {e.message}", file=sys.stderr)
        return 2
    log.info("controller %s serving %s (store %s)", cid, public, describe_url(url))
    try:
        server.run(sockets=[sock])
    finally:
        ctl.stop()
        store.close()
    log.info("controller %s stopped", cid)
    return 0
