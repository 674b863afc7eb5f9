"""A throwaway PostgreSQL primary with a synchronous streaming standby, for failover tests.

Controllers in an HA deployment reach PostgreSQL through a multi-host URL, and "nothing that
was acknowledged is lost when the primary dies" only holds when every commit waits for a
standby (synchronous replication). That can only be tested against real servers, so this
module builds on :mod:`pgserver` (same binaries, same ``runuser`` handling, same free-port and
cleanup rules) and starts, in one temporary directory:

* a **primary** (``initdb``), listening on a free loopback port;
* a **standby** made with ``pg_basebackup -R -X stream`` from it (``standby.signal`` and
  ``primary_conninfo``, with ``application_name`` :data:`STANDBY_NAME`), on another free port;
* then, once the standby streams, ``synchronous_standby_names`` and ``synchronous_commit = on``
  on the primary (``ALTER SYSTEM`` + reload), and :meth:`PgCluster.wait_sync` until the primary
  reports the standby as ``sync``. It is set only after the base backup so that the promoted
  standby does not inherit it: a lone primary that waits for a standby that no longer exists
  would block every commit.

``fsync`` stays off as in :mod:`pgserver`: tests kill processes, never the machine, so what a
server wrote to the kernel survives; what matters for "no loss" is that the primary does not
report a commit before the standby has received and written it, which ``synchronous_commit``
guarantees independently of ``fsync``.

Faults: :meth:`PgCluster.kill_primary` SIGKILLs the primary's postmaster (its backends notice
and exit; an in-flight commit waiting for the standby is never acknowledged) and
:meth:`PgCluster.promote_standby` runs ``pg_ctl promote`` and waits until it accepts writes.

:meth:`PgCluster.stop` is idempotent, registered with :mod:`atexit`, stops both servers, then
SIGKILLs any process still working in the cluster's directory (backends orphaned by a killed
postmaster, walreceivers) and deletes the directory, so a failing test leaks nothing.

Run ``python tests/pgcluster.py`` for a scratch pair to experiment with.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import psutil
import psycopg

from pgserver import (
    DEFAULT_DBNAME,
    PG_ROLE,
    PgServer,
    PgServerError,
    PostgresNotAvailable,
    find_bindir,
)

__all__ = [
    "STANDBY_NAME",
    "PgCluster",
    "PgNode",
    "PgServerError",
    "PostgresNotAvailable",
    "multi_host_url",
    "start_reachable_server",
]

#: ``application_name`` of the standby, named in the primary's ``synchronous_standby_names``.
STANDBY_NAME = "phx_standby"
_BASEBACKUP_TIMEOUT_S = 180.0
_SYNC_TIMEOUT_S = 60.0
_PROMOTE_TIMEOUT_S = 60


def multi_host_url(ports: list[int], dbname: str = DEFAULT_DBNAME) -> str:
    """The libpq-style multi-host URL of servers on loopback, writable one wanted.

    ``target_session_attrs=read-write`` makes libpq skip a server that is in recovery, so the
    URL keeps working when the standby is promoted without anybody editing it.
    """
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"postgresql+psycopg://{PG_ROLE}@{hosts}/{dbname}?target_session_attrs=read-write"


def _postgres_user_processes_in(base_dir: Path) -> list[psutil.Process]:
    """Live processes whose working directory is inside ``base_dir``.

    Every PostgreSQL server process runs with its data directory as cwd, so this finds the
    backends of a postmaster that was SIGKILLed (they are no longer its children).
    """
    out = []
    prefix = str(base_dir)
    for proc in psutil.process_iter(["pid"]):
        try:
            cwd = proc.cwd()
            if (cwd == prefix or cwd.startswith(prefix + "/")) and proc.status() not in (
                psutil.STATUS_ZOMBIE,
                psutil.STATUS_DEAD,
            ):
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return out


def sweep(base_dir: Path) -> None:
    """Kill what still runs in ``base_dir`` (backends orphaned by a SIGKILLed postmaster, a
    server a failed stop left behind) and remove the directory: a test's last cleanup step."""
    for _ in range(5):
        left = _postgres_user_processes_in(base_dir)
        if not left:
            break
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(left, timeout=5)
    shutil.rmtree(base_dir, ignore_errors=True)


class PgNode(PgServer):
    """One server of a :class:`PgCluster`: a :class:`PgServer` with replication helpers."""

    def append_settings(
        self, settings: dict[str, str], note: str, file: str = "postgresql.conf"
    ) -> None:
        """Append to ``postgresql.conf`` (a later line wins over an earlier one).

        ``postgresql.auto.conf`` is read after it, so settings ``pg_basebackup -R`` wrote
        there (``primary_conninfo``) can only be overridden in that file.
        """
        with (self.datadir / file).open("a", encoding="utf-8") as conf:
            conf.write(f"\n# {note}\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def base_backup_from(self, primary: PgNode) -> None:
        """Fill this node's (empty) data dir with a streaming base backup of ``primary``.

        ``-R`` writes ``standby.signal`` and ``primary_conninfo`` (to ``postgresql.auto.conf``);
        the copied configuration still names the primary's socket directory and no
        ``application_name``, so this node's own settings are appended to the auto file.
        """
        result = self._run(
            [
                str(self.bindir / "pg_basebackup"),
                "-h", "127.0.0.1", "-p", str(primary.port), "-U", PG_ROLE,
                "-D", str(self.datadir),
                "-R", "-X", "stream", "-c", "fast", "--no-sync",
            ],
            timeout=_BASEBACKUP_TIMEOUT_S,
        )  # fmt: skip
        if result.returncode != 0:
            raise PgServerError(
                f"pg_basebackup failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        conninfo = (
            f"host=127.0.0.1 port={primary.port} user={PG_ROLE} "
            f"application_name={STANDBY_NAME} connect_timeout=5"
        )
        self.append_settings(
            {
                "unix_socket_directories": f"'{self.socket_dir}'",
                "primary_conninfo": f"'{conninfo}'",
                "hot_standby": "on",
                # notice a dead primary quickly, and keep no standby name for after promotion
                "wal_receiver_timeout": "5s",
                "synchronous_standby_names": "''",
            },
            "phalanx standby settings",
            file="postgresql.auto.conf",
        )

    def start_server(self, port: int | None = None) -> None:
        """Start the postmaster on a free port, or on `port` (the data dir must exist)."""
        self._start_postmaster(port)

    def in_recovery(self) -> bool:
        """True while this server is a standby (``pg_is_in_recovery()``)."""
        with psycopg.connect(self.dsn("postgres", connect_timeout=5)) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def kill_postmaster(self) -> None:
        """SIGKILL the postmaster only, as when its host's OOM killer or a crash hits it.

        Its backends are orphaned and exit when they notice (they watch the postmaster); a
        backend that waits for the synchronous standby to confirm a commit exits without
        acknowledging it. :meth:`PgCluster.stop` sweeps up any that linger.
        """
        if self.pid is None:
            raise PgServerError("postmaster is not running")
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
            psutil.Process(self.pid).send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                p = psutil.Process(self.pid)
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
        else:
            raise PgServerError(f"postmaster {self.pid} survived SIGKILL")

    def promote(self) -> None:
        """``pg_ctl promote -w``, then wait until it accepts a write."""
        result = self._run(
            [
                str(self.bindir / "pg_ctl"), "-D", str(self.datadir),
                "-w", "-t", str(_PROMOTE_TIMEOUT_S), "promote",
            ],
            timeout=_PROMOTE_TIMEOUT_S + 30,
        )  # fmt: skip
        if result.returncode != 0:
            raise PgServerError(
                f"pg_ctl promote failed ({result.returncode}):\n{result.stdout}{result.stderr}\n"
                f"--- {self.log_path} ---\n{self._read_log()[-4000:]}"
            )
        deadline = time.monotonic() + _PROMOTE_TIMEOUT_S
        while self.in_recovery():
            if time.monotonic() > deadline:
                raise PgServerError("the promoted standby is still in recovery")
            time.sleep(0.1)


def start_reachable_server(
    listen_addresses: str, trusted_cidrs: list[str], base_dir: Path | None = None
) -> PgNode:
    """One server (no standby) that also listens on `listen_addresses` (e.g. ``'*'``) and
    trusts connections from `trusted_cidrs`: for tests that reach it over a veth from another
    network namespace. The caller's network namespace is the server's (it is forked from the
    calling thread). Stop it with :meth:`PgNode.stop` (idempotent, also at exit).
    """
    bindir = find_bindir()
    run_as = PgServer._os_user_for_server()
    parent = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    node = PgNode(Path(tempfile.mkdtemp(prefix="phalanx-pg-", dir=parent)), bindir, run_as)
    atexit.register(node.stop)
    try:
        node._prepare_dir()
        node._initdb()
        node.append_settings(
            {"listen_addresses": f"'{listen_addresses}'"}, "phalanx: reachable over a veth"
        )
        with (node.datadir / "pg_hba.conf").open("a", encoding="utf-8") as hba:
            hba.writelines(f"host all all {cidr} trust\n" for cidr in trusted_cidrs)
        node.start_server()
        node.create_database(DEFAULT_DBNAME)
    except BaseException:
        node.stop()
        raise
    return node


class PgCluster:
    """A primary and a synchronous standby in one temp dir; see the module docstring."""

    def __init__(self, base_dir: Path, primary: PgNode, standby: PgNode) -> None:
        """Use :meth:`start`."""
        self.base_dir = base_dir
        self.primary = primary
        self.standby = standby
        self.dbname = DEFAULT_DBNAME
        self._stopped = False

    @classmethod
    def start(cls, base_dir: Path | None = None) -> PgCluster:
        """Start the pair, wait until the standby is synchronous, and return it.

        Raises :class:`PostgresNotAvailable` when PostgreSQL is not installed (tests skip,
        except under CI) and :class:`PgServerError` when it is but does not come up.
        """
        bindir = find_bindir()
        if not (bindir / "pg_basebackup").is_file():
            raise PostgresNotAvailable(f"pg_basebackup is missing from {bindir}")
        run_as = PgServer._os_user_for_server()
        parent = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="phalanx-pgha-", dir=parent))
        root.chmod(0o755)  # the postgres user must reach both nodes' directories
        primary = PgNode(root / "primary", bindir, run_as)
        standby = PgNode(root / "standby", bindir, run_as)
        cluster = cls(root, primary, standby)
        atexit.register(cluster.stop)
        try:
            for node in (primary, standby):
                node.base_dir.mkdir()
                node._prepare_dir()
            primary._initdb()
            primary.append_settings(
                {
                    "wal_level": "replica",
                    "max_wal_senders": "10",
                    "wal_keep_size": "'256MB'",
                    "hot_standby": "on",
                    # the default; pgserver turns it off for speed, zero loss needs it on
                    "synchronous_commit": "on",
                    "wal_sender_timeout": "5s",
                },
                "phalanx primary settings",
            )
            primary.start_server()
            primary.create_database(DEFAULT_DBNAME)
            standby.base_backup_from(primary)
            standby.start_server()
            cluster._require_sync_standby()
            cluster.wait_sync()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    # ------------------------------------------------------------------ connection info
    @property
    def url(self) -> str:
        """Multi-host SQLAlchemy URL: primary first, then standby, read-write server wanted."""
        return multi_host_url([self.primary.port, self.standby.port], self.dbname)

    def nodes(self) -> list[PgNode]:
        return [self.primary, self.standby]

    # ------------------------------------------------------------------ replication
    def _require_sync_standby(self) -> None:
        with psycopg.connect(self.primary.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 ({STANDBY_NAME})'")
            conn.execute("SELECT pg_reload_conf()")

    def replication(self) -> list[tuple[str, str, str]]:
        """(application_name, state, sync_state) of each standby the primary streams to."""
        with psycopg.connect(self.primary.dsn("postgres", connect_timeout=5)) as conn:
            rows = conn.execute(
                "SELECT application_name, state, sync_state FROM pg_stat_replication"
            ).fetchall()
        return [(str(a), str(b), str(c)) for a, b, c in rows]

    def wait_sync(self, timeout: float = _SYNC_TIMEOUT_S) -> None:
        """Wait until the primary streams to the standby synchronously."""
        deadline = time.monotonic() + timeout
        seen: list[tuple[str, str, str]] = []
        while True:
            seen = self.replication()
            if (STANDBY_NAME, "streaming", "sync") in seen:
                return
            if time.monotonic() > deadline:
                raise PgServerError(
                    f"the standby is not synchronous after {timeout:g}s (pg_stat_replication: "
                    f"{seen}):\n--- standby log ---\n{self.standby._read_log()[-4000:]}"
                )
            time.sleep(0.1)

    # ------------------------------------------------------------------ faults
    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster (see :meth:`PgNode.kill_postmaster`)."""
        self.primary.kill_postmaster()

    def promote_standby(self) -> None:
        """Promote the standby and wait until it accepts writes."""
        self.standby.promote()

    def failover(self, gap: float = 0.0) -> None:
        """A whole failover, ready for the next: SIGKILL the primary, wait `gap` seconds,
        promote the standby, then rebuild the dead server as the new synchronous standby of
        the promoted one, on its old port (the controllers' multi-host URL lists both ports,
        so they follow whichever accepts writes). Repeatable: the chaos soak fails over
        again and again."""
        old, new = self.primary, self.standby
        old.kill_postmaster()
        time.sleep(gap)
        new.promote()
        port = old.port
        with contextlib.suppress(Exception):
            old.stop()  # the dead postmaster's leftovers go, and its whole directory
        sweep(old.base_dir)
        atexit.unregister(old.stop)
        old._stopped, old.pid = False, None  # the same node, about to be rebuilt
        old.base_dir.mkdir()
        old._prepare_dir()
        old.base_backup_from(new)
        old.start_server(port)
        self.primary, self.standby = new, old
        self._require_sync_standby()
        self.wait_sync()

    # ------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        """Stop both servers, kill stragglers, delete the directory; safe to call repeatedly."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        try:
            for node in (self.standby, self.primary):
                with contextlib.suppress(Exception):
                    node.stop()  # also removes the node's own directory
        finally:
            sweep(self.base_dir)

    def leftover_processes(self) -> list[int]:
        """PIDs of processes still running in this cluster's directory (empty after stop)."""
        return [p.pid for p in _postgres_user_processes_in(self.base_dir)]

    def log_tails(self, chars: int = 3000) -> str:
        """The end of both servers' logs, for failure messages."""
        return "\n".join(
            f"--- {name} {node.log_path} ---\n{node._read_log()[-chars:]}"
            for name, node in (("primary", self.primary), ("standby", self.standby))
        )

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
        return f"<PgCluster primary={self.primary!r} standby={self.standby!r}>"


if __name__ == "__main__":
    with PgCluster.start() as _cluster:
        print(_cluster.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
