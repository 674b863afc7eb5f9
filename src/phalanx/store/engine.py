"""Engines and transactions for SQLite (WAL, embedded) and PostgreSQL (psycopg 3).

SQLite writers take the write lock at BEGIN (`BEGIN IMMEDIATE`), so two controllers sharing one
file serialise their writes instead of failing on a lock upgrade; readers use a separate engine
with deferred transactions and never block writers (WAL). Database errors that mean "cannot
reach or use the database" become `StoreUnavailable`.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from phalanx.errors import StoreUnavailable

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` and use psycopg 3; accept a bare path for SQLite."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    url = _hosts_to_query(url)
    if "://" not in url:
        url = f"sqlite:///{Path(url).absolute()}"
    return url


_MULTI_HOST = re.compile(
    r"^(?P<scheme>postgresql(?:\+\w+)?)://(?P<auth>[^@/?]*@)?(?P<hosts>[^/?@]*,[^/?@]*)"
    r"(?P<path>/[^?]*)?(?:\?(?P<query>.*))?$"
)


def _hosts_to_query(url: str) -> str:
    """Rewrite libpq's multi-host form for SQLAlchemy, which cannot parse it.

    `postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write` (what PostgreSQL's
    documentation shows, and what an operator pointing controllers at a primary and its standby
    writes) becomes `postgresql://u@/db?host=h1:5432&host=h2:5432&target_session_attrs=...`,
    which SQLAlchemy hands to libpq as the same list of hosts, tried in order.
    """
    m = _MULTI_HOST.match(url)
    if m is None:
        return url
    hosts = "&".join(f"host={h.strip()}" for h in m["hosts"].split(",") if h.strip())
    query = f"{hosts}&{m['query']}" if m["query"] else hosts
    return f"{m['scheme']}://{m['auth'] or ''}{m['path'] or '/'}?{query}"


def describe_url(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        # shown to people: `host=db1:5432`, not `host=db1%3A5432`
        return unquote(make_url(_hosts_to_query(url)).render_as_string(hide_password=True))
    except Exception:
        return "<invalid url>"


class Engines:
    """A write engine and a read engine (the same one on PostgreSQL)."""

    def __init__(self, url: str, *, connect_timeout: float = 5.0, pool_size: int = 8) -> None:
        self.url = normalize_url(url)
        u = make_url(self.url)
        self.dialect = u.get_backend_name()
        if self.dialect == "sqlite":
            db = u.database
            if not db or db == ":memory:":
                raise StoreUnavailable(
                    "SQLite needs a file path, e.g. sqlite:////var/lib/phalanx/phalanx.db"
                )
            parent = Path(db).absolute().parent
            if not parent.is_dir():
                raise StoreUnavailable(
                    f"cannot open database {db}: directory {parent} does not exist"
                )
            self.write = self._sqlite_engine(immediate=True, timeout=max(connect_timeout, 10.0))
            self.read = self._sqlite_engine(immediate=False, timeout=max(connect_timeout, 10.0))
        elif self.dialect == "postgresql":
            self.write = create_engine(
                self.url,
                pool_size=pool_size,
                max_overflow=pool_size,
                pool_pre_ping=True,
                pool_timeout=connect_timeout,
                connect_args={"connect_timeout": max(1, int(connect_timeout))},
            )
            self.read = self.write
        else:
            raise StoreUnavailable(
                f"unsupported database URL {describe_url(url)}: use sqlite:///PATH or postgresql://..."
            )

    def _sqlite_engine(self, *, immediate: bool, timeout: float) -> Engine:
        engine = create_engine(
            self.url,
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
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    @contextlib.contextmanager
    def begin(self, *, write: bool = True) -> Iterator[Connection]:
        """One transaction; database-level failures become StoreUnavailable."""
        engine = self.write if write else self.read
        try:
            with engine.begin() as conn:
                yield conn
        except (OperationalError, DBAPIError) as e:
            # integrity errors and the like are bugs or races, not outages
            if (
                not isinstance(e, OperationalError)
                and not e.connection_invalidated
                and "database is locked" not in str(e.orig)
            ):
                raise
            raise StoreUnavailable(
                f"database unavailable ({describe_url(self.url)}): {_first_line(e)}"
            ) from e

    def db_now_sql(self) -> Any:
        if self.dialect == "sqlite":
            return text("(julianday('now') - 2440587.5) * 86400.0")
        return text("extract(epoch from clock_timestamp())")

    def dispose(self) -> None:
        self.write.dispose()
        if self.read is not self.write:
            self.read.dispose()


_HOST_FAILURE = re.compile(r"^- host: '([^']*)', port: '([^']*)'.*failed: (.*)$")


def _first_line(e: BaseException) -> str:
    """The database error in one line; with a multi-host URL, every host's failure.

    psycopg's first line names only the last host it tried ("session is read-only" for a
    standby), which hides the one that matters after a failover (the primary refused)."""
    orig = getattr(e, "orig", None) or e
    lines = [ln.strip() for ln in str(orig).strip().splitlines()]
    hosts = [m for m in map(_HOST_FAILURE.match, lines) if m is not None]
    if len(hosts) > 1:
        each = "; ".join(f"{m[1]}:{m[2]}: {m[3]}" for m in hosts)
        return f"no usable server among {len(hosts)} hosts: {each}"
    return (lines or [type(orig).__name__])[0]
