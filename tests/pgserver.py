"""Throwaway PostgreSQL clusters for tests and benchmarks.

Phalanx's store must behave identically on SQLite and PostgreSQL, and the HA features (controller
fail-over, database outages) can only be exercised against a real server.  Mocking PostgreSQL
would hide exactly the bugs we care about (locking, isolation, connection loss), so this module
starts a real, private cluster in a temporary directory:

* ``initdb`` with ``--no-sync`` and ``fsync=off``/``synchronous_commit=off``/
  ``full_page_writes=off`` so a cluster is up in a couple of seconds; durability is irrelevant for
  data that is thrown away.  Benchmarks pass ``durable=True`` to get the settings a production
  server runs with (``fsync``, ``synchronous_commit`` and ``full_page_writes`` on): every commit
  then waits for its WAL flush, which is what a throughput figure must include to mean anything.
  ``initdb --no-sync`` stays either way: it only skips syncing initdb's own files once, which
  no commit measured afterwards waits for.
* It listens on 127.0.0.1 only, on a free port, with its Unix socket inside the temp dir, so it
  never collides with a system PostgreSQL or with a parallel test run.
* As root (CI containers) the server binaries refuse to run, so every command is run as the
  ``postgres`` OS user through ``runuser``; as an ordinary user they run directly.
* ``stop()`` is idempotent and also registered with :mod:`atexit`, and it falls back to SIGKILL,
  so a failing or interrupted test run does not leak postmasters or data directories.

The module only depends on the standard library, :mod:`psutil` and :mod:`psycopg` so that a
benchmark script can import it (``sys.path.insert(0, "tests")``) without pytest.

Run ``python tests/pgserver.py`` to get a scratch server for manual experiments.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import psutil
import psycopg
from psycopg import sql

__all__ = [
    "PgServer",
    "PgServerError",
    "PostgresNotAvailable",
    "find_bindir",
    "start_postgres",
]

#: OS user that owns the cluster when we run as root (initdb refuses to run as root).
PG_OS_USER = "postgres"
#: Database role used by every connection; the cluster uses ``trust`` authentication.
PG_ROLE = "postgres"
#: Database created at start-up; ``PgServer.url`` points at it.
DEFAULT_DBNAME = "phalanx"
#: Environment variable that overrides binary discovery (e.g. ``/usr/lib/postgresql/16/bin``).
BINDIR_ENV = "PHALANX_PG_BINDIR"

_REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")
# Generous limits: a busy 2-core CI runner can take a long time to fork a cluster.
_INITDB_TIMEOUT_S = 180.0
_START_TIMEOUT_S = 90
_STOP_TIMEOUT_S = 60
_PORT_ATTEMPTS = 5
_BIND_ERRORS = ("could not bind", "could not create any TCP/IP sockets", "Address already in use")


class PgServerError(RuntimeError):
    """Starting or controlling a throwaway cluster failed (a real error, never skipped)."""


class PostgresNotAvailable(PgServerError):
    """No PostgreSQL server binaries (or no usable OS user) on this machine.

    Distinct from :class:`PgServerError` so that the test suite can *skip* on a developer laptop
    without PostgreSQL while still failing loudly when an installed server does not start.
    """


def _has_binaries(bindir: Path) -> bool:
    return all((bindir / name).is_file() for name in _REQUIRED_BINARIES)


def _version_key(path: str) -> tuple[int, ...]:
    """Sort key for ``/usr/lib/postgresql/<version>/bin`` so that 16 beats 9.6."""
    match = re.search(r"/(\d+(?:\.\d+)*)/bin$", path)
    return tuple(int(p) for p in match.group(1).split(".")) if match else (0,)


def find_bindir() -> Path:
    """Return the directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Debian keeps the server binaries off ``$PATH`` (in ``/usr/lib/postgresql/N/bin``), so
    ``$PATH`` alone is not enough.  Order: ``$PHALANX_PG_BINDIR``, ``pg_config --bindir``, the
    highest Debian/RHEL versioned directory, then ``$PATH`` (Homebrew, Nix, ...).
    """
    override = os.environ.get(BINDIR_ENV)
    if override:
        if _has_binaries(Path(override)):
            return Path(override)
        raise PostgresNotAvailable(
            f"${BINDIR_ENV}={override} lacks {', '.join(_REQUIRED_BINARIES)}"
        )

    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=30, check=True
            ).stdout.strip()
            if out and _has_binaries(Path(out)):
                return Path(out)

    candidates = glob.glob("/usr/lib/postgresql/*/bin") + glob.glob("/usr/pgsql-*/bin")
    for candidate in sorted(candidates, key=_version_key, reverse=True):
        if _has_binaries(Path(candidate)):
            return Path(candidate)

    initdb = shutil.which("initdb")
    if initdb and _has_binaries(Path(initdb).parent):
        return Path(initdb).parent

    raise PostgresNotAvailable(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; run "
        "scripts/ensure-postgres.sh (Debian: apt-get install postgresql-15) "
        f"or set ${BINDIR_ENV}"
    )


def _free_port() -> int:
    """Ask the kernel for an unused loopback port.

    There is an unavoidable race between closing this socket and the postmaster binding it;
    :meth:`PgServer.start` retries with a new port when the postmaster reports a bind failure.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_env() -> dict[str, str]:
    """Environment for server commands: no PG* variables that could redirect them elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"  # avoid initdb failures on machines with unset/odd locales
    return env


def _alive(proc: psutil.Process) -> bool:
    """True if ``proc`` still runs; zombies count as dead (PID 1 in a container may not reap)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class PgServer:
    """A private PostgreSQL cluster in a temporary directory; see the module docstring.

    Use :meth:`start` (or :func:`start_postgres`) and always :meth:`stop` it, preferably via
    ``with PgServer.start() as server: ...``.
    """

    def __init__(
        self, base_dir: Path, bindir: Path, run_as: str | None, *, durable: bool = False
    ) -> None:
        """Prepare but do not start; :meth:`start` is the public constructor."""
        self.base_dir: Path = base_dir
        self.bindir: Path = bindir
        self.datadir: Path = base_dir / "data"
        self.socket_dir: Path = base_dir / "sock"
        self.log_path: Path = base_dir / "postgres.log"
        self.port: int = 0
        self.pid: int | None = None
        self.dbname: str = DEFAULT_DBNAME
        #: Whether commits wait for a WAL flush to disk (:meth:`start`'s ``durable``).
        self.durable: bool = durable
        self._run_as = run_as
        self._paused = False
        self._stopped = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def start(cls, base_dir: Path | None = None, *, durable: bool = False) -> PgServer:
        """Create, start and return a cluster with an empty ``phalanx`` database.

        ``base_dir`` is the parent for the cluster's temp dir (default: the system temp dir).
        As root it must be traversable by the ``postgres`` user, which pytest's ``tmp_path``
        (mode 0700) is not.  ``durable`` turns ``fsync``, ``synchronous_commit`` and
        ``full_page_writes`` on, as in production (benchmarks); the default leaves them off so
        tests run fast.  A durable server only means something on a disk that really syncs
        (not tmpfs).  Raises :class:`PostgresNotAvailable` when there is nothing to run,
        :class:`PgServerError` when the server fails to come up.
        """
        bindir = find_bindir()
        run_as = cls._os_user_for_server()
        parent = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="phalanx-pg-", dir=parent))
        server = cls(tmp, bindir, run_as, durable=durable)
        atexit.register(server.stop)
        try:
            server._prepare_dir()
            server._initdb()
            server._start_postmaster()
            server.create_database(DEFAULT_DBNAME)
        except BaseException:
            server.stop()
            raise
        return server

    @staticmethod
    def _os_user_for_server() -> str | None:
        """Return the OS user to ``runuser`` to, or ``None`` to run binaries directly."""
        if os.geteuid() != 0:
            return None
        try:
            pwd.getpwnam(PG_OS_USER)
        except KeyError:
            raise PostgresNotAvailable(
                f"running as root but there is no '{PG_OS_USER}' OS user to run the server as "
                "(the postgresql package creates it)"
            ) from None
        if shutil.which("runuser") is None:
            raise PostgresNotAvailable("running as root but 'runuser' (util-linux) is missing")
        return PG_OS_USER

    def _cmd(self, argv: Sequence[str]) -> list[str]:
        """Wrap a server command so that it runs as the cluster owner."""
        if self._run_as is None:
            return list(argv)
        return ["runuser", "-u", self._run_as, "--", *argv]

    def _run(self, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        # cwd=base_dir: the postgres user may not be allowed into the caller's cwd (/root).
        return subprocess.run(
            self._cmd(argv),
            cwd=self.base_dir,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _prepare_dir(self) -> None:
        self.socket_dir.mkdir()
        if self._run_as is None:
            return
        owner = pwd.getpwnam(self._run_as)
        for path in (self.base_dir, self.socket_dir):
            os.chown(path, owner.pw_uid, owner.pw_gid)
        probe = self._run(["test", "-w", str(self.base_dir)], timeout=30)
        if probe.returncode != 0:
            raise PgServerError(
                f"{self.base_dir} is not reachable by the '{self._run_as}' user; pass a base_dir "
                "whose parents are world-traversable (e.g. /tmp)"
            )

    def _initdb(self) -> None:
        result = self._run(
            [
                str(self.bindir / "initdb"),
                "-D", str(self.datadir),
                "-A", "trust",
                "-U", PG_ROLE,
                "-E", "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            timeout=_INITDB_TIMEOUT_S,
        )  # fmt: skip
        if result.returncode != 0:
            raise PgServerError(
                f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        durability = "on" if self.durable else "off"
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "max_connections": "200",
            "fsync": durability,
            "synchronous_commit": durability,
            "full_page_writes": durability,
            # Keep the log useful when a test fails: it is included in error messages.
            "log_min_messages": "warning",
        }
        with (self.datadir / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write("\n# phalanx test settings\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def _start_postmaster(self, port: int | None = None) -> None:
        """Run ``pg_ctl start`` on a free port, retrying when another process grabbed it;
        on `port` when given (a rebuilt standby keeps the port clients list)."""
        for _ in range(1 if port else _PORT_ATTEMPTS):
            port = port or _free_port()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            result = self._run(
                [
                    str(self.bindir / "pg_ctl"),
                    "-D", str(self.datadir),
                    "-l", str(self.log_path),
                    "-o", f"-p {port}",
                    "-w", "-t", str(_START_TIMEOUT_S),
                    "start",
                ],
                timeout=_START_TIMEOUT_S + 30,
            )  # fmt: skip
            if result.returncode == 0:
                self.port = port
                self.pid = self._read_pid()
                self._wait_accepting()
                return
            new_log = self._read_log(log_offset)
            if any(marker in new_log for marker in _BIND_ERRORS):
                continue
            raise PgServerError(
                f"pg_ctl start failed ({result.returncode}):\n{result.stdout}{result.stderr}\n"
                f"--- {self.log_path} ---\n{new_log}"
            )
        raise PgServerError(f"no free port after {_PORT_ATTEMPTS} attempts:\n{self._read_log()}")

    def _read_pid(self) -> int:
        pid_file = self.datadir / "postmaster.pid"
        try:
            return int(pid_file.read_text(encoding="utf-8").splitlines()[0])
        except (OSError, IndexError, ValueError) as exc:
            raise PgServerError(f"cannot read postmaster pid from {pid_file}: {exc}") from exc

    def _wait_accepting(self, timeout: float = 60.0) -> None:
        """``pg_ctl -w`` already waited; this covers slow first connections on busy machines."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn("postgres", connect_timeout=10)):
                    return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise PgServerError(f"server does not accept connections: {exc}") from exc
                time.sleep(0.2)

    def _read_log(self, offset: int = 0) -> str:
        try:
            with self.log_path.open(encoding="utf-8", errors="replace") as log:
                log.seek(offset)
                return log.read()
        except OSError:
            return ""

    # ------------------------------------------------------------------ connection info

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``phalanx`` database."""
        return self.url_for(self.dbname)

    def url_for(self, dbname: str) -> str:
        """SQLAlchemy URL (psycopg 3 driver) for another database on this server."""
        return f"postgresql+psycopg://{PG_ROLE}@127.0.0.1:{self.port}/{dbname}"

    def dsn(self, dbname: str | None = None, connect_timeout: int = 10) -> str:
        """libpq conninfo string for plain :func:`psycopg.connect` (admin work, probes)."""
        return (
            f"host=127.0.0.1 port={self.port} user={PG_ROLE} dbname={dbname or self.dbname} "
            f"connect_timeout={connect_timeout}"
        )

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create a database, empty or a copy of `template` (which no session may be
        connected to), and return its SQLAlchemy URL."""
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(query)
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, terminating its connections (tests often leak pooled ones)."""
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    # ------------------------------------------------------------------ outage simulation

    @property
    def is_paused(self) -> bool:
        """Whether :meth:`pause` is in effect."""
        return self._paused

    def _processes(self) -> list[psutil.Process]:
        """The postmaster followed by all its descendants (backends, checkpointer, ...)."""
        if self.pid is None:
            return []
        try:
            postmaster = psutil.Process(self.pid)
            return [postmaster, *postmaster.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _signal_all(self, procs: Sequence[psutil.Process], sig: int) -> None:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                proc.send_signal(sig)

    def pause(self) -> None:
        """Freeze the whole server (SIGSTOP) to simulate a hung database host.

        Unlike stopping it, this keeps TCP connections open and new connects hang in the
        listen backlog, which is what clients see when the database host stalls.
        """
        if self._stopped:
            raise PgServerError("server is stopped")
        procs = self._processes()
        if not procs:
            raise PgServerError("postmaster is not running")
        # Postmaster first, so it cannot fork new children while we freeze the existing ones.
        self._signal_all(procs[:1], signal.SIGSTOP)
        self._signal_all(self._processes()[1:], signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause` (SIGCONT children first, then the postmaster)."""
        procs = self._processes()
        self._signal_all(procs[1:], signal.SIGCONT)
        self._signal_all(procs[:1], signal.SIGCONT)
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """``with server.paused(): ...`` — pause, and always resume afterwards."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        """Shut the server down and delete its directory; safe to call any number of times.

        Fast shutdown first (it aborts open transactions, which is fine for test data); if that
        does not finish in time, SIGKILL the postmaster and every child so nothing is leaked.
        """
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        try:
            if self.pid is None and (self.datadir / "postmaster.pid").exists():
                with contextlib.suppress(PgServerError):
                    self.pid = self._read_pid()
            if self.pid is not None:
                self._shutdown()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def _shutdown(self) -> None:
        procs = self._processes()
        if self._paused:
            self.resume()  # a stopped postmaster would ignore the shutdown request
        if procs and _alive(procs[0]):
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self._run(
                    [
                        str(self.bindir / "pg_ctl"), "-D", str(self.datadir),
                        "-m", "fast", "-w", "-t", str(_STOP_TIMEOUT_S), "stop",
                    ],
                    timeout=_STOP_TIMEOUT_S + 30,
                )  # fmt: skip
        leftovers = [p for p in procs if _alive(p)]
        if leftovers:
            self._signal_all(leftovers, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while any(_alive(p) for p in leftovers) and time.monotonic() < deadline:
                time.sleep(0.05)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("paused" if self._paused else "running")
        return f"<PgServer {state} port={self.port} pid={self.pid} datadir={self.datadir}>"


def start_postgres(base_dir: Path | None = None, *, durable: bool = False) -> PgServer:
    """Function form of :meth:`PgServer.start` for scripts."""
    return PgServer.start(base_dir, durable=durable)


if __name__ == "__main__":
    with PgServer.start() as _server:
        print(_server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


def in_ci() -> bool:
    """CI sets ``CI=true``; there a missing PostgreSQL must fail, not silently skip."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}
