"""SQLite: the database file, its engines' connection settings, and WAL checkpoints.

Writers take the write lock at BEGIN (`BEGIN IMMEDIATE`), so two controllers sharing one file
serialise their writes instead of failing on a lock upgrade; readers use a separate engine
with deferred transactions and never block writers (WAL, `synchronous=NORMAL`: durable
against a process crash, docs/architecture.md). WAL checkpoints run on a thread of their own
(`Checkpointer`), off the commit path. store/engine.py builds both engines from here and runs
the transactions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy import exc as sa_exc

from phalanx.errors import StoreUnavailable
from phalanx.store.jsoncol import json_loads

# the engines' logger, as before store/engine.py was split: log filters may name it
log = logging.getLogger("phalanx.store.engine")


def sqlite_file(db: str | None) -> str:
    """The database file's absolute path, created (mode 0600) if new; StoreUnavailable if
    the URL names no file or its directory does not exist."""
    if not db or db == ":memory:":
        raise StoreUnavailable(
            "SQLite needs a file path, e.g. sqlite:////var/lib/phalanx/phalanx.db"
        )
    parent = Path(db).absolute().parent
    if not parent.is_dir():
        raise StoreUnavailable(f"cannot open database {db}: directory {parent} does not exist")
    # the store holds every job's command, environment and paths: a new database file
    # is the controller's only (SQLite gives its -wal and -shm files the same mode)
    with contextlib.suppress(FileExistsError, PermissionError):
        os.close(os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return str(Path(db).absolute())


#: Pages a SQLite connection lets the WAL grow to before a commit checkpoints it itself: only a
#: backstop, for when the `Checkpointer` thread cannot keep up or is not running (SQLite's own
#: default is 1000, which makes every hundredth or so commit pay for a checkpoint and its fsync).
WAL_BACKSTOP_PAGES = 10_000


class Checkpointer:
    """Runs SQLite's WAL checkpoints on a thread of their own, off the commit path.

    With SQLite's default (`wal_autocheckpoint` = 1000 pages) the commit that fills the WAL
    copies it into the database file and fsyncs both, inside the request that made it: a
    submission that usually commits in ~50 us then takes milliseconds, and on average that
    was more than half of all commit time. Here the engines' connections checkpoint only past
    `WAL_BACKSTOP_PAGES`, and this thread runs a PASSIVE checkpoint (it waits for no reader or
    writer) every `interval` seconds after a write. Durability is unchanged: a commit is
    durable (against a process crash; with `synchronous=NORMAL` not against power loss) once
    it is in the WAL, whether or not it was checkpointed yet.
    """

    def __init__(self, path: str, *, interval: float = 0.5, timeout: float = 10.0) -> None:
        self.path = path
        self.interval = interval
        self.timeout = timeout
        self.dirty = False  # set by each write transaction; a clean WAL needs no checkpoint
        self.checkpoints = 0  # completed checkpoint calls (for tests)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def wrote(self) -> None:
        """A write transaction committed: checkpoint on the next round (starts the thread)."""
        self.dirty = True
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(
                        target=self._run, name="phx-wal-checkpoint", daemon=True
                    )
                    self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout + 2.0)

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            log.warning("WAL checkpoints fall back to commits: cannot open %s: %s", self.path, e)
            return
        try:
            while not self._stop.wait(self.interval):
                if not self.dirty:
                    continue
                self.dirty = False
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.checkpoints += 1
                except sqlite3.Error as e:  # busy, or the file went away: try again later
                    self.dirty = True
                    log.debug("WAL checkpoint of %s failed: %s", self.path, e)
        finally:
            conn.close()


def sqlite_engine(url: str, *, immediate: bool, timeout: float) -> Engine:
    """An engine on the file: WAL, NORMAL sync, our own BEGIN (`BEGIN IMMEDIATE` for the
    write engine), checkpoints left to `Checkpointer` up to `WAL_BACKSTOP_PAGES`."""
    engine = create_engine(
        url,
        json_deserializer=json_loads,
        connect_args={"timeout": timeout, "check_same_thread": False},
        pool_size=8,
        max_overflow=8,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")  # see Checkpointer
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
        cur.close()

    begin_sql = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # straight to the driver: a SQLAlchemy statement here (exec_driver_sql) costs every
        # transaction more than the BEGIN itself
        try:
            conn.connection.driver_connection.execute(begin_sql)  # type: ignore[union-attr]
        except sqlite3.Error as e:  # e.g. "database is locked": as SQLAlchemy would raise it
            raise sa_exc.DBAPIError.instance(begin_sql, None, e, sqlite3.Error) from e

    return engine
