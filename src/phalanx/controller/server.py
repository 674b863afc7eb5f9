"""`phalanx controller`: start checks, then the HTTP server and the controller's loops.

Start-up problems (unwritable state dir, unreachable database, port in use) stop the daemon
with one clear line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import uuid
from pathlib import Path
from types import FrameType

import uvicorn

from phalanx.auth import keys as keyfiles
from phalanx.config import Config
from phalanx.controller import confversions
from phalanx.controller.api import create_app
from phalanx.controller.httpserver import guarded_protocol
from phalanx.controller.runtime import Controller
from phalanx.daemon import StartupError, check_state_dir, open_device, setup_logging
from phalanx.errors import PhalanxError
from phalanx.gctune import tune_collector
from phalanx.sdnotify import Notifier
from phalanx.store.dburl import describe_url
from phalanx.store.store import Store
from phalanx.watchdog import Watchdog

log = logging.getLogger("phalanx.controller")


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


HTTP_BEAT = 1.0  # seconds between two beats of the HTTP event loop (a blocked loop stops them)


class NotifyingServer(uvicorn.Server):
    """uvicorn, telling systemd when it serves (READY=1) and when it stops (STOPPING=1).

    READY=1 goes out once uvicorn's startup is over (the lifespan ran, the socket is served);
    the store answered before (migrations) and the controller's loops run. A task on the
    event loop beats every HTTP_BEAT seconds: an event loop blocked by a stuck call stops it,
    which the watchdog sees as the loop `http` being wedged."""

    def __init__(self, config: uvicorn.Config, ctl: Controller, watchdog: Watchdog) -> None:
        super().__init__(config)
        self.ctl = ctl
        self.watchdog = watchdog
        self._beat_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.started:
            return
        self._beat_task = asyncio.get_running_loop().create_task(self._http_beat())
        self.watchdog.ready(f"serving {self.ctl.url}; {self.ctl.summary()}")

    async def _http_beat(self) -> None:
        deadline = self.ctl.loop_deadline(HTTP_BEAT)
        while True:
            self.ctl.beats.beat("http", deadline)
            await asyncio.sleep(HTTP_BEAT)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.watchdog.notifier.stop(f"stopping on signal {sig}")
        super().handle_exit(sig, frame)
        # uvicorn raises a captured signal again once it has shut down, which kills the process
        # before run_controller's cleanup (leases handed back at once rather than left to
        # expire, heartbeats flushed, the store closed). SIGTERM asks for exactly that clean
        # stop, so the controller exits normally (0) instead.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


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
    # first: no child (a job's `phalanx` call, a helper) may inherit systemd's socket
    notifier = Notifier.from_environment()
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
        except PhalanxError as e:
            sock.close()
            raise StartupError(
                f"cannot use the database {describe_url(url)}: {e.message}"
            ) from None
        try:
            # the cluster-wide sections: the store's current version (version 1 made from
            # this file on an empty store); the process-local ones: this file's
            running, version = confversions.startup(store, config, cid)
            store.policy = running.failure_policy()
            store.restart_reservation = running.timing.restart_reservation
        except PhalanxError as e:
            sock.close()
            store.close()
            raise StartupError(
                f"cannot run the store's cluster configuration: {e.message}"
            ) from None
    except StartupError as e:
        print(f"phalanx controller: {e}", file=sys.stderr)
        return 2
    actual_port = sock.getsockname()[1]
    tls = config.auth.tls_cert is not None
    public = f"{'https' if tls else 'http'}://{host}:{actual_port}"
    ctl = Controller(
        store, running, cid=cid, url=public, local_config=config, config_version=version
    )
    config = running  # what the rest of the start-up reads is process-local: the same
    app = create_app(ctl, keys)
    try:
        device = open_device(config.watchdog.device, config.watchdog.interval)
    except StartupError as e:
        print(f"phalanx controller: {e}", file=sys.stderr)
        sock.close()
        store.close()
        return 2
    watchdog = Watchdog(
        notifier,
        ctl.beats,
        status=ctl.summary,
        interval=config.watchdog.interval,
        device=device,
    )
    server = NotifyingServer(
        uvicorn.Config(
            app,
            # uvicorn[standard] is a dependency: say so rather than rely on "auto" finding them.
            # The HTTP protocol is uvicorn's httptools one with header and body timeouts, a
            # header size limit and the connection cap (httpserver.py; docs/deploy.md)
            loop="uvloop",
            http=guarded_protocol(config.http),
            log_level="warning",
            access_log=False,  # no log line per request
            proxy_headers=False,  # no proxy in front is trusted; nothing reads the client address
            timeout_keep_alive=config.http.idle_timeout,  # type: ignore[arg-type]
            lifespan="on",
            ssl_certfile=config.auth.tls_cert,
            ssl_keyfile=config.auth.tls_key,
        ),
        ctl,
        watchdog,
    )
    watchdog.start()  # STATUS= and the hardware device from now on; WATCHDOG=1 after READY=1
    try:
        ctl.start()
    except PhalanxError as e:
        watchdog.stop(clean=True)
        print(f"phalanx controller: cannot start: {e.message}", file=sys.stderr)
        return 2
    log.info("controller %s serving %s (store %s)", cid, public, describe_url(url))
    tune_collector()  # start-up is over: out of the collector's sight (gctune.py)
    try:
        server.run(sockets=[sock])
    finally:
        notifier.stop("stopping")
        watchdog.stop(clean=True)
        ctl.stop()
        store.close()
        notifier.close()
    log.info("controller %s stopped", cid)
    return 0
