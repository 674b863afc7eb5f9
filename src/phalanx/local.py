"""`phalanx up` / `phalanx down`: a whole cluster on this host, as real processes.

Controllers and agents are separate processes (as in production), each in its own session so a
Ctrl-C in the terminal reaches only `phalanx up`, which then stops them in order. Every PID is
written to `<state-dir>/run/<name>.pid`; `phalanx down` stops exactly those processes (after
checking that each PID is still a phalanx process), asks the shepherds of the local
agents to stop their jobs, and once those have ended removes the agents' node cgroups
(agent/cgroup_roots.py), so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from phalanx.agent import cgroup_roots, shepherd_control
from phalanx.auth import localsock
from phalanx.auth.credentials import LocalService
from phalanx.client import Client
from phalanx.errors import PhalanxError
from phalanx.slurm.cmdserver import DEFAULT_SOCKET as COMMAND_SOCKET

READY_TIMEOUT = 60.0
# how long `phalanx down` waits for the stopped jobs to end before removing the nodes' cgroups
# (a job gets SIGKILL after its kill grace; one still running keeps its node's cgroup)
JOBS_END_TIMEOUT = 30.0


def _alive(pid: int) -> bool:
    """Alive and not a zombie (PID 1 may take a while to reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _is_phalanx(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"phalanx" in f.read()
    except OSError:
        return False


def _terminate(pids: dict[str, int], timeout: float = 15.0) -> list[str]:
    stopped = []
    for name, pid in pids.items():
        if _alive(pid) and _is_phalanx(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            stopped.append(name)
    deadline = time.monotonic() + timeout
    for _name, pid in pids.items():
        while _alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        if _alive(pid) and _is_phalanx(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return stopped


def _stop_shepherds(state_dir: Path) -> None:
    for tasks in sorted((state_dir / "nodes").glob("*/tasks")):
        for d in tasks.iterdir():
            if d.is_dir():
                shepherd_control.request_stop(d)


def _remove_node_cgroups(state_dir: Path, timeout: float = JOBS_END_TIMEOUT) -> None:
    """Each local agent's node cgroups, once its jobs have ended (cgroup_roots.teardown)."""
    deadline = time.monotonic() + timeout
    nodes = state_dir.absolute() / "nodes"  # as the agents were given it (cgroup_name)
    for node_dir in sorted(d for d in nodes.glob("*") if d.is_dir()):
        name = cgroup_roots.cgroup_name(node_dir.name, node_dir)
        left = max(0.0, deadline - time.monotonic())
        kept = cgroup_roots.teardown(node_dir, name, timeout=left)
        if kept:
            print(
                f"{node_dir.name}: jobs still running; its cgroups stay: {', '.join(kept)}",
                file=sys.stderr,
            )


def publish_socket(auth_socket: Path, well_known: Path | None = None) -> bool:
    """Make the local cluster's credential socket the one commands find without being told
    (`localsock.DEFAULT_SOCKET`, /run/phalanx/auth.sock): a link there to `auth_socket`, so
    that after `phalanx up` the commands need no exported variable. Only when that path is
    free: absent, or a link left dangling by a cluster that is gone. A site's own service
    there, or another running cluster's link, is never replaced. False when not published
    (taken, or not writable for this user: the printed `export` line is then the way)."""
    path = Path(well_known or localsock.DEFAULT_SOCKET)
    try:
        if path.is_symlink() and not path.exists():
            path.unlink()  # dangling: its cluster is gone
        if path.exists() or path.is_symlink():
            return False
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.symlink_to(auth_socket.absolute())
    except OSError:
        return False
    return True


def unpublish_socket(auth_socket: Path, well_known: Path | None = None) -> None:
    """Remove the well-known link if it is this cluster's (`publish_socket`)."""
    path = Path(well_known or localsock.DEFAULT_SOCKET)
    with contextlib.suppress(OSError):
        if path.is_symlink() and Path(os.readlink(path)) == auth_socket.absolute():
            path.unlink()
            path.parent.rmdir()  # only if empty: a site's own files there stay


HOSTS = Path("/etc/hosts")
RESOLVE_TIMEOUT_S = 2.0  # how long `up` waits to learn whether its node names resolve


def _resolves(names: list[str]) -> dict[str, bool | None]:
    """Whether each name resolves on this host (None: the resolver did not say in time)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor, wait

    def one(name: str) -> bool:
        try:
            socket.getaddrinfo(name, None)
            return True
        except OSError:
            return False

    pool = ThreadPoolExecutor(max_workers=min(16, len(names) or 1))
    futures = {name: pool.submit(one, name) for name in names}
    wait(futures.values(), timeout=RESOLVE_TIMEOUT_S)
    pool.shutdown(wait=False, cancel_futures=True)
    return {n: f.result() if f.done() else None for n, f in futures.items()}


def _hosts_marker(state_dir: Path) -> str:
    return f"# phalanx up {state_dir.absolute()}"


def publish_names(names: list[str], state_dir: Path, hosts: Path = HOSTS) -> list[str]:
    """Make this local cluster's node names resolve, to 127.0.0.1, as a real cluster's do:
    the usual rendezvous recipe (`MASTER_ADDR=$(scontrol show hostnames
    $SLURM_JOB_NODELIST | head -n1)`) then works on `phalanx up` too. One line in `hosts`,
    marked with the state dir, for the names that do not resolve already (a name the
    resolver knows, or does not answer for in time, is never shadowed: on a real cluster's
    login node `node01` may be a real host); `unpublish_names` removes it. Returns the names
    added (none when `hosts` cannot be written: not root)."""
    missing = [n for n, ok in _resolves(names).items() if ok is False]
    if not missing:
        return []
    try:
        with open(hosts, "a", encoding="utf-8") as f:
            f.write(f"127.0.0.1 {' '.join(missing)} {_hosts_marker(state_dir)}\n")
    except OSError:
        return []
    return missing


def unpublish_names(state_dir: Path, hosts: Path = HOSTS) -> None:
    """Remove this cluster's line from `hosts` (`publish_names`), in place: /etc/hosts may be
    a bind mount, which a rename would not replace."""
    marker = _hosts_marker(state_dir)
    try:
        lines = hosts.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [x for x in lines if not x.rstrip("\n").endswith(marker)]
        if len(kept) != len(lines):
            with open(hosts, "w", encoding="utf-8") as f:
                f.write("".join(kept))
    except OSError:
        pass


def stop_from_pidfiles(state_dir: Path) -> list[str]:
    run = state_dir / "run"
    pids: dict[str, int] = {}
    for p in sorted(run.glob("*.pid")):
        try:
            pids[p.stem] = int(p.read_text().strip())
        except (OSError, ValueError):
            continue
    # agents first (so nothing reports to a dying controller), then controllers
    ordered = dict(sorted(pids.items(), key=lambda kv: (not kv[0].startswith("agent"), kv[0])))
    stopped = _terminate(ordered)
    _stop_shepherds(state_dir)
    _remove_node_cgroups(state_dir)
    for p in run.glob("*.pid"):
        p.unlink(missing_ok=True)
    unpublish_socket(state_dir / "auth.sock")
    unpublish_socket(state_dir / "commands.sock", COMMAND_SOCKET)
    unpublish_names(state_dir)
    return stopped


class LocalCluster:
    def __init__(
        self,
        state_dir: Path,
        *,
        nodes: int,
        controllers: int,
        port: int,
        db: str | None,
        cpus: int,
        mem: str,
        gpus: str,
        config: Path | None,
        health_config: Path | None = None,
        log_level: str = "info",
        root_jobs: bool = True,
    ) -> None:
        self.root_jobs = root_jobs
        self.health_config = health_config.absolute() if health_config else None
        self.state_dir = state_dir.absolute()
        self.n_nodes = nodes
        self.n_controllers = controllers
        self.port = port
        self.db = db or f"sqlite:///{self.state_dir / 'phalanx.db'}"
        self.cpus, self.mem, self.gpus = cpus, mem, gpus
        self.config = config
        self.log_level = log_level
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.urls = [f"http://127.0.0.1:{port + i}" for i in range(controllers)]
        self.url = ",".join(self.urls)
        # where users of this cluster get local credentials (`phalanx up` prints it)
        self.auth_socket = self.state_dir / "auth.sock"
        # where the compiled Slurm commands find this host's command server (slurm/cmdserver.py)
        self.command_socket = self.state_dir / "commands.sock"

    def node_names(self) -> list[str]:
        width = max(2, len(str(self.n_nodes)))
        return [f"node{i + 1:0{width}d}" for i in range(self.n_nodes)]

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def _spawn(self, name: str, args: list[str], module: str = "phalanx") -> None:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PHALANX_AUTH_ALLOW_ROOT_JOBS"] = "1" if self.root_jobs else "0"
        if self.config:
            env["PHALANX_CONFIG"] = str(self.config.absolute())
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        log.close()
        self.procs[name] = proc
        run = self.state_dir / "run"
        run.mkdir(parents=True, exist_ok=True)
        (run / f"{name}.pid").write_text(f"{proc.pid}\n")

    def _log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = (self.state_dir / "logs" / f"{name}.log").read_text().strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        existing = (
            [p for p in (self.state_dir / "run").glob("*.pid")]
            if (self.state_dir / "run").is_dir()
            else []
        )
        live = [
            p.stem
            for p in existing
            if p.read_text().strip().isdecimal()
            and _alive(int(p.read_text().strip()))
            and _is_phalanx(int(p.read_text().strip()))
        ]
        if live:
            raise PhalanxError(
                f"a cluster is already running from {self.state_dir} ({', '.join(live)}): "
                f"stop it with `phalanx down --state-dir {self.state_dir}`"
            )
        for i in range(self.n_controllers):
            name = f"controller-{i + 1}"
            self._spawn(
                name,
                [
                    "controller",
                    "--state-dir",
                    str(self.state_dir),
                    "--port",
                    str(self.port + i),
                    "--db",
                    self.db,
                    "--id",
                    name,
                    "--log-level",
                    self.log_level,
                ],
            )
        for i, url in enumerate(self.urls):
            self._wait(
                f"controller-{i + 1}",
                lambda url=url: httpx.get(url + "/healthz", timeout=2).status_code == 200,
            )
        health = self.health_config or self._local_health_config()
        # one host: agents and authd derive their keys from the controllers' cluster key
        key = str(self.state_dir / "keys" / "cluster.jwks")
        self._spawn(
            "authd",
            [
                "authd",
                "--key-file",
                key,
                "--socket",
                str(self.auth_socket),
                "--log-level",
                self.log_level,
            ],
        )
        self._spawn(
            "cmdserver",
            ["--socket", str(self.command_socket), "--log-level", self.log_level],
            module="phalanx.slurm.cmdserver",
        )
        for node in self.node_names():
            name = f"agent-{node}"
            self._spawn(
                name,
                [
                    "agent",
                    "--name",
                    node,
                    "--state-dir",
                    str(self.state_dir / "nodes" / node),
                    "--url",
                    self.url,
                    "--cpus",
                    str(self.cpus),
                    "--mem",
                    self.mem,
                    "--gpus",
                    self.gpus,
                    "--log-level",
                    self.log_level,
                    "--health-config",
                    str(health),
                    "--key-file",
                    key,
                    "--auth-socket",
                    str(self.state_dir / "nodes" / node / "auth.sock"),
                ],
            )
        want = set(self.node_names())

        client = Client(self.url, credentials=LocalService(self.auth_socket))

        def registered() -> bool:
            try:
                nodes = client.nodes()
            except PhalanxError:
                return False
            got = {n["name"] for n in nodes if n["state"] not in ("UNKNOWN", "DOWN")}
            return want <= got

        try:
            self._wait("agents", registered)
        finally:
            client.close()

    def _local_health_config(self) -> Path:
        """Local nodes share one host: the host-wide checks (kernel log, disks) would drain all
        of them at once and say nothing about any one, so they run the GPU and memory checks."""
        path = self.state_dir / "local-health.toml"
        path.write_text(
            "# health checks of the local cluster's nodes (see docs/health.md)\n"
            "[health]\ngpu = true\nmemory = { min_available_mb = 256 }\ninterval = 10\n"
        )
        return path

    def _wait(self, what: str, ready: object) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise PhalanxError(
                        f"{name} exited with code {p.returncode}: {self._log_tail(name)}"
                    )
            try:
                if ready():  # type: ignore[operator]
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise PhalanxError(
            f"{what} not ready after {READY_TIMEOUT:g}s; see {self.state_dir / 'logs'}"
        )

    def wait(self) -> None:
        """Block until interrupted, or until a daemon dies (then report it and stop)."""
        stop = {"flag": False}

        def _term(_s: int, _f: object) -> None:
            stop["flag"] = True

        signal.signal(signal.SIGTERM, _term)
        while not stop["flag"]:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    print(
                        f"{name} exited with code {p.returncode}: {self._log_tail(name)}",
                        file=sys.stderr,
                    )
                    return
            time.sleep(0.5)

    def stop(self, quiet: bool = False) -> None:
        stop_from_pidfiles(self.state_dir)
        for p in self.procs.values():
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
