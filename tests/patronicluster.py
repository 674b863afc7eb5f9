"""The production store for tests: PostgreSQL managed by Patroni, with etcd as its DCS.

docs/patroni.md documents the deployment Phalanx recommends for its store: PostgreSQL members
managed by Patroni, which keeps its leader key in etcd, promotes a synchronous standby when the
primary's host dies, and rewrites ``synchronous_standby_names`` as members come and go. Whether
controllers survive that (and lose nothing acknowledged) can only be told against the real
programs, so this module starts, in one temporary directory under /tmp:

* one **etcd** server (Debian's ``etcd-server``; ``scripts/ensure-etcd.sh``) on free loopback
  client and peer ports, run as the calling user;
* two or more **Patroni** members (Patroni from PyPI, the ``test`` extra), each managing a
  PostgreSQL server (the binaries :func:`pgserver.find_bindir` finds) on a free loopback port,
  with its REST API on another. ``initdb`` and ``postgres`` refuse to run as root, so as root
  Patroni runs as the ``postgres`` OS user (``runuser -u postgres``), with this interpreter:
  the caller must make the interpreter's directories searchable by that user while the
  cluster runs (tests/system/test_patroni.py does, and restores their modes after).

The first member bootstraps the cluster (``initdb``) and is the leader; the others are cloned
from it (``pg_basebackup``) and stream from it. :meth:`PatroniCluster.start` returns once the
leader streams to a synchronous standby (Patroni's ``sync_standby`` role): only then does a
commit wait for a second copy, and only then may Patroni promote that standby.

Faults: :meth:`PatroniCluster.kill_host` kills a member as its host's death would: its
postmaster and its Patroni (SIGKILL both; Patroni first frozen for the instant between the two,
so that it cannot restart PostgreSQL in that window, see the method).

:meth:`PatroniCluster.stop` is idempotent and registered with :mod:`atexit`: it asks every
Patroni to stop (which stops its PostgreSQL), stops etcd, SIGKILLs whatever still runs in the
directory (by working directory: every one of these processes has its own there) and deletes
it, so a failing test leaks nothing.

Run ``python tests/patronicluster.py`` (as a user who can run the binaries) for a scratch
cluster to experiment with.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx
import psutil
import psycopg
from psycopg import sql

from pgcluster import _postgres_user_processes_in, sweep
from pgserver import (
    DEFAULT_DBNAME,
    PG_ROLE,
    PgServer,
    PgServerError,
    PostgresNotAvailable,
    _clean_env,
    _free_port,
    find_bindir,
)

__all__ = [
    "ETCD_ENV",
    "EtcdServer",
    "PatroniCluster",
    "PatroniMember",
    "PatroniNotAvailable",
    "PgServerError",
    "PostgresNotAvailable",
    "find_etcd",
]

#: Environment variable naming the etcd binary (same as scripts/ensure-etcd.sh).
ETCD_ENV = "PHALANX_ETCD"
#: The Patroni cluster's name (its ``scope``) and key prefix in etcd.
SCOPE = "phalanx"
NAMESPACE = "/phalanx-test/"
REPLICATION_ROLE = "replicator"
# generous: a busy 2-core CI runner can take long to initdb, clone and start a server
_UP_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 60.0

T = TypeVar("T")


class PatroniNotAvailable(PostgresNotAvailable):
    """etcd or Patroni is not installed (skipped on a laptop, a failure under CI)."""


class ClusterError(PgServerError):
    """An installed etcd, Patroni or PostgreSQL did not come up or behave as expected."""


def find_etcd() -> Path:
    """The etcd server binary: ``$PHALANX_ETCD``, else ``etcd`` on ``$PATH``."""
    override = os.environ.get(ETCD_ENV)
    if override:
        if os.access(override, os.X_OK):
            return Path(override)
        raise PatroniNotAvailable(f"${ETCD_ENV}={override} is not an executable etcd binary")
    found = shutil.which("etcd") or (
        "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None
    )
    if found is None:
        raise PatroniNotAvailable(
            "etcd not found; run scripts/ensure-etcd.sh (Debian: apt-get install etcd-server) "
            f"or set ${ETCD_ENV}"
        )
    return Path(found)


def _require_patroni() -> None:
    """Patroni and python-etcd (its etcd3 extra) are installed for this interpreter."""
    missing = [m for m in ("patroni", "etcd") if importlib.util.find_spec(m) is None]
    if missing:
        raise PatroniNotAvailable(
            f"{' and '.join(missing)} not installed; pip install -e '.[test]' installs "
            "patroni[etcd3]"
        )


def _until(
    check: Callable[[], T | None], timeout: float, what: str, explain: Callable[[], str]
) -> T:
    """Poll `check` until it returns something truthy; ClusterError with `explain()` if not."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, psycopg.OperationalError, OSError):
            got = check()
            if got:
                return got
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: not within {timeout:g}s\n{explain()}")
        time.sleep(0.1)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _kill_wait(proc: psutil.Process, sig: int, timeout: float) -> bool:
    """Send `sig` and wait for the process to end (a zombie counts); True if it did."""
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _silent_listener(port: int) -> socket.socket:
    """A socket listening on loopback `port` that never accepts: connections to the port are
    made by the kernel and then never answered (see `PatroniCluster.kill_host`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead server's TIME_WAITs
    deadline = time.monotonic() + 30
    while True:
        try:
            sock.bind(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > deadline:
                sock.close()
                raise
            time.sleep(0.05)  # a backend of the killed server may still hold it for a moment
    sock.listen(1024)
    return sock


# ---------------------------------------------------------------------- etcd
@dataclass
class EtcdServer:
    """A one-member etcd cluster on loopback (client and peer ports free)."""

    base_dir: Path
    binary: Path
    client_port: int = 0
    peer_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.base_dir / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        self.client_port, self.peer_port = _free_port(), _free_port()
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        argv = [
            str(self.binary),
            "--name", "etcd0",
            "--data-dir", str(self.base_dir / "etcd-data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"etcd0={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"phx-{os.getpid()}-{self.client_port}",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.base_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_clean_env(),
                start_new_session=True,
            )

        def healthy() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ClusterError(f"etcd exited ({self.proc.returncode}):\n{_tail(self.log_path)}")
            r = httpx.get(f"{client}/health", timeout=2)
            return r.status_code == 200 and r.json().get("health") in ("true", True)

        _until(healthy, _UP_TIMEOUT_S, "etcd to be healthy", lambda: _tail(self.log_path))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


# ---------------------------------------------------------------------- Patroni
@dataclass
class PatroniMember:
    """One Patroni process and the PostgreSQL server it manages."""

    name: str
    base_dir: Path  # its own directory: config, log, data dir, socket
    pg_port: int
    api_port: int
    run_as: str | None
    proc: subprocess.Popen[bytes] | None = None  # runuser (as root) or Patroni itself
    killed: bool = False

    @property
    def config_path(self) -> Path:
        return self.base_dir / "patroni.yml"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "patroni.log"

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def dsn(self, dbname: str = "postgres", connect_timeout: int = 5) -> str:
        return (
            f"host=127.0.0.1 port={self.pg_port} user={PG_ROLE} dbname={dbname} "
            f"connect_timeout={connect_timeout}"
        )

    def spawn(self) -> None:
        argv = [sys.executable, "-m", "patroni", str(self.config_path)]
        if self.run_as is not None:
            argv = ["runuser", "-u", self.run_as, "--", *argv]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.base_dir,  # the postgres user may not enter the caller's cwd
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_clean_env(),
                start_new_session=True,
            )

    def patroni_process(self) -> psutil.Process | None:
        """The Patroni process (as root: the child of ``runuser``, which forks and waits)."""
        if self.proc is None:
            return None
        try:
            top = psutil.Process(self.proc.pid)
            if self.run_as is None:
                return top
            kids = [k for k in top.children() if "patroni" in " ".join(k.cmdline())]
            return kids[0] if kids else None
        except psutil.NoSuchProcess:
            return None

    def postmaster_pid(self) -> int | None:
        """The running postmaster's PID (first line of ``postmaster.pid``), if any."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, IndexError, ValueError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def get(self, path: str, timeout: float = 3.0) -> httpx.Response:
        """A request to this member's REST API."""
        return httpx.get(self.api + path, timeout=timeout)

    def is_primary(self) -> bool:
        """Patroni says this member is the leader and its PostgreSQL runs read-write."""
        try:
            return self.get("/primary").status_code == 200
        except httpx.HTTPError:
            return False

    def config(self, etcd: EtcdServer, bindir: Path, dcs: dict[str, Any]) -> dict[str, Any]:
        """This member's Patroni configuration (see docs/patroni.md for the settings)."""
        return {
            "scope": SCOPE,
            "namespace": NAMESPACE,
            "name": self.name,
            "log": {"level": "INFO", "format": "%(asctime)s %(levelname)s: %(message)s"},
            "restapi": {
                "listen": f"127.0.0.1:{self.api_port}",
                "connect_address": f"127.0.0.1:{self.api_port}",
            },
            "etcd3": {"hosts": [etcd.endpoint]},
            "bootstrap": {
                "dcs": dcs,
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(self.data_dir),
                "bin_dir": str(bindir),
                "pgpass": str(self.base_dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": PG_ROLE},
                    "replication": {"username": REPLICATION_ROLE},
                },
                "parameters": {"unix_socket_directories": str(self.base_dir)},
                # loopback only, trusted: the test's throwaway cluster (production: scram)
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    f"host replication {REPLICATION_ROLE} 127.0.0.1/32 trust",
                ],
                "basebackup": [{"checkpoint": "fast"}],
            },
            "watchdog": {"mode": "off"},  # no /dev/watchdog here; see kill_host and the docs
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }


@dataclass
class PatroniCluster:
    """etcd and Patroni-managed PostgreSQL members in one temp dir; see the module docstring."""

    base_dir: Path
    etcd: EtcdServer
    members: list[PatroniMember]
    bindir: Path
    dcs: dict[str, Any]
    dbname: str = DEFAULT_DBNAME
    startup_s: float = 0.0  # how long start() took (for the tests' reports)
    _stopped: bool = field(default=False, repr=False)
    _silencers: list[socket.socket] = field(default_factory=list, repr=False)

    @classmethod
    def start(
        cls,
        *,
        members: int = 2,
        ttl: int = 20,
        loop_wait: int = 1,
        retry_timeout: int = 3,
        base_dir: Path | None = None,
    ) -> PatroniCluster:
        """Start etcd and `members` Patroni members; return once the leader has a synchronous
        standby and the ``phalanx`` database exists.

        `ttl`, `loop_wait` and `retry_timeout` are Patroni's (its minimums: 20, 1, 3). Raises
        :class:`PatroniNotAvailable` (or :class:`PostgresNotAvailable`) when something is not
        installed, :class:`ClusterError` when it is but does not come up.
        """
        t0 = time.monotonic()
        bindir = find_bindir()
        if not (bindir / "pg_basebackup").is_file():
            raise PostgresNotAvailable(f"pg_basebackup is missing from {bindir}")
        etcd_bin = find_etcd()
        _require_patroni()
        run_as = PgServer._os_user_for_server()
        parent = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        root = Path(tempfile.mkdtemp(prefix="phalanx-patroni-", dir=parent))
        root.chmod(0o755)  # the postgres user must reach its members' directories
        dcs = {
            "ttl": ttl,
            "loop_wait": loop_wait,
            "retry_timeout": retry_timeout,
            # every commit waits for a standby that Patroni has named synchronous, and only
            # that standby may be promoted: nothing acknowledged is lost in a failover
            "synchronous_mode": True,
            # not strict: a lone primary (its standby gone) goes on taking writes
            "synchronous_mode_strict": False,
            "postgresql": {
                "use_pg_rewind": False,
                "use_slots": True,
                "parameters": {
                    "wal_level": "replica",
                    "hot_standby": "on",
                    "max_connections": 200,
                    "max_wal_senders": 10,
                    "max_replication_slots": 10,
                    "wal_keep_size": "256MB",
                    "synchronous_commit": "on",
                    # tests kill processes, never the machine: what a server wrote to the
                    # kernel survives; what "no loss" needs is synchronous_commit, above
                    "fsync": "off",
                    "full_page_writes": "off",
                    "wal_sender_timeout": "5s",
                    "wal_receiver_timeout": "5s",
                },
            },
        }
        cluster = cls(root, EtcdServer(root, etcd_bin), [], bindir, dcs)
        atexit.register(cluster.stop)
        try:
            cluster.etcd.start()
            for i in range(members):
                cluster.members.append(cluster._add_member(f"pg{i + 1}", run_as))
            first, *rest = cluster.members
            first.spawn()
            _until(first.is_primary, _UP_TIMEOUT_S, f"{first.name} to bootstrap", cluster.log_tails)
            cluster._create_database(first)
            for m in rest:
                m.spawn()
            cluster.wait_sync(first)
        except BaseException:
            cluster.stop()
            raise
        cluster.startup_s = time.monotonic() - t0
        return cluster

    def _add_member(self, name: str, run_as: str | None) -> PatroniMember:
        d = self.base_dir / name
        d.mkdir()
        member = PatroniMember(name, d, _free_port(), _free_port(), run_as)
        member.config_path.write_text(json.dumps(member.config(self.etcd, self.bindir, self.dcs)))
        if run_as is not None:
            pw = pwd.getpwnam(run_as)
            for p in (d, member.config_path):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        return member

    def _create_database(self, leader: PatroniMember) -> None:
        with psycopg.connect(leader.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))

    # ------------------------------------------------------------------ state
    def url(self, *, scheme: str = "postgresql") -> str:
        """The multi-host URL of the members, in libpq's form (as docs/patroni.md shows it):
        every member, a writable one wanted, so the URL follows the leader."""
        hosts = ",".join(f"127.0.0.1:{m.pg_port}" for m in self.members)
        return f"{scheme}://{PG_ROLE}@{hosts}/{self.dbname}?target_session_attrs=read-write"

    def view(self) -> dict[str, Any]:
        """Patroni's ``GET /cluster`` from the first member whose REST API answers."""
        for m in self.members:
            if m.killed:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = m.get("/cluster")
                if r.status_code == 200:
                    return dict(r.json())
        raise ClusterError("no Patroni REST API answers")

    def roles(self) -> dict[str, tuple[str, str]]:
        """name -> (role, state) as Patroni reports them."""
        return {m["name"]: (m["role"], m.get("state", "")) for m in self.view()["members"]}

    def member(self, name: str) -> PatroniMember:
        return next(m for m in self.members if m.name == name)

    def leader(self) -> PatroniMember | None:
        """The member Patroni lists as leader, if any."""
        for name, (role, _state) in self.roles().items():
            if role == "leader":
                return self.member(name)
        return None

    def wait_sync(self, leader: PatroniMember, timeout: float = _UP_TIMEOUT_S) -> PatroniMember:
        """Wait until `leader` streams to a standby Patroni lists as synchronous; return it."""

        def synced() -> PatroniMember | None:
            roles = self.roles()
            if roles.get(leader.name, ("", ""))[0] != "leader":
                return None
            for name, (role, state) in roles.items():
                if role == "sync_standby" and state == "streaming":
                    with psycopg.connect(leader.dsn()) as conn:
                        rows = conn.execute(
                            "SELECT application_name FROM pg_stat_replication "
                            "WHERE sync_state = 'sync'"
                        ).fetchall()
                    if (name,) in [tuple(r) for r in rows]:
                        return self.member(name)
            return None

        return _until(
            synced,
            timeout,
            f"{leader.name} to stream to a synchronous standby",
            lambda: f"roles: {self._roles_or_error()}\n{self.log_tails()}",
        )

    def _roles_or_error(self) -> Any:
        try:
            return self.roles()
        except Exception as e:
            return f"({e})"

    # ------------------------------------------------------------------ faults
    def kill_host(self, member: PatroniMember, *, silent: bool = True) -> None:
        """Kill `member` as the death of its host would: its PostgreSQL and its Patroni.

        `silent`: its addresses then stay silent, as a dead host's do. A dead host sends no
        "connection refused" (RST): a connection attempt to it waits for its timeout. Here each
        of the member's ports (PostgreSQL's and its REST API's) is taken by a listening socket
        that never accepts or answers, so a client's TCP connect succeeds (the kernel completes
        handshakes for the backlog) but nothing ever answers it: libpq waits for its
        `connect_timeout` before it tries the next host, as it would for a dead host.

        Patroni is frozen (SIGSTOP) first, then the postmaster is SIGKILLed, then Patroni is.
        Without the freeze, Patroni could notice the dead postmaster and start a new one in the
        instant between the two kills; that server, orphaned with nobody to demote it, would
        be a second primary (in production Patroni's watchdog reboots such a host). The
        postmaster's backends exit by themselves when they notice it is gone; this waits for
        them, so that nothing of `member` answers afterwards.
        """
        patroni = member.patroni_process()
        if patroni is None:
            raise ClusterError(f"{member.name}'s Patroni is not running")
        postmaster = member.postmaster_pid()
        if postmaster is None:
            raise ClusterError(f"{member.name}'s PostgreSQL is not running")
        with contextlib.suppress(psutil.NoSuchProcess):
            patroni.send_signal(signal.SIGSTOP)
        member.killed = True
        if not _kill_wait(psutil.Process(postmaster), signal.SIGKILL, 30):
            raise ClusterError(f"postmaster {postmaster} survived SIGKILL")
        if not _kill_wait(patroni, signal.SIGKILL, 30):
            raise ClusterError(f"Patroni {patroni.pid} survived SIGKILL")
        _until(
            lambda: not _postgres_user_processes_in(member.data_dir),
            60,
            f"{member.name}'s PostgreSQL processes to exit",
            lambda: str(_postgres_user_processes_in(member.data_dir)),
        )
        if silent:
            for port in (member.pg_port, member.api_port):
                self._silencers.append(_silent_listener(port))

    # ------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        """Stop every member and etcd, kill stragglers, delete the directory; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        for sock in self._silencers:
            sock.close()
        try:
            procs = [p for m in self.members if (p := m.patroni_process()) is not None]
            for p in procs:  # Patroni stops its PostgreSQL on SIGTERM
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGTERM)
            psutil.wait_procs(procs, timeout=_STOP_TIMEOUT_S)
            for m in self.members:
                if m.proc is not None and m.proc.poll() is None:
                    m.proc.kill()
                if m.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        m.proc.wait(timeout=30)
            with contextlib.suppress(Exception):
                self.etcd.stop()
        finally:
            sweep(self.base_dir)

    def leftover_processes(self) -> list[int]:
        """PIDs of processes still running in the cluster's directory (empty after stop)."""
        return [p.pid for p in _postgres_user_processes_in(self.base_dir)]

    def log_tails(self, chars: int = 3000) -> str:
        """The end of every member's log (Patroni's and its PostgreSQL's) and etcd's."""
        parts = [f"--- {m.log_path} ---\n{_tail(m.log_path, chars)}" for m in self.members]
        parts.append(f"--- {self.etcd.log_path} ---\n{_tail(self.etcd.log_path, chars // 2)}")
        return "\n".join(parts)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


if __name__ == "__main__":
    with PatroniCluster.start() as _cluster:
        print(_cluster.url(), _cluster.roles(), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
