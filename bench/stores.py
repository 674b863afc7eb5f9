"""The stores a benchmark runs on, side by side in one invocation (issue 26).

A figure measured on SQLite, or on a PostgreSQL server that never waits for a disk flush, says
little about a production cluster, whose PostgreSQL runs with `fsync` and `synchronous_commit`
on.  So sim.py, submit.py and failover.py take `--stores`, a comma list of

  pg         a throwaway PostgreSQL server with durability on (fsync, synchronous_commit,
             full_page_writes): the headline, what production runs
  pg-nosync  the same server with durability off, as the test suite's: how much of the
             difference is the flush and how much is PostgreSQL itself
  sqlite     the bench's own SQLite file in the run's state dir (the single-host default)

(default: all three, in that order), and print each store's figures beside the others, with
ratios to SQLite, from one run of the bench on one machine under one load: figures from
separate invocations differ by more than the stores do on a busy host.  Runs are interleaved
(run 1 on every store, then run 2, ...) so that a change of load on the host during the
invocation hits every store alike.

Each PostgreSQL kind gets one server (tests/pgserver.py) for the whole invocation, started up
front and stopped in a `finally`, and a fresh database on it for every run, dropped afterwards,
so runs do not see each other's rows.  The server's CPU over a measured window is the user and
system time of the postmaster and all its descendants (backends, WAL writer, checkpointer,
...), their reaped children included (a backend that ended during the window counts), sampled
before and after with psutil: the cost of the database that the controllers' CPU leaves out.
SQLite has no such figure: it runs inside the controllers and is part of their CPU.

A database URL given the old way (`--db URL`, sim.py's `--store URL`) is one store named
`url`, reused across runs as before; its CPU is reported when the URL names a PostgreSQL
server on this host whose postmaster this process can see, and left out otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
from common import log

KINDS = ("pg", "pg-nosync", "sqlite")
LABELS = {
    "pg": "PostgreSQL, durable (fsync, synchronous_commit on)",
    "pg-nosync": "PostgreSQL, no sync (fsync, synchronous_commit off)",
    "sqlite": "SQLite (a file in the run's state dir)",
}
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def add_argument(ap: argparse.ArgumentParser) -> None:
    """Add `--stores` to a bench's parser."""
    ap.add_argument(
        "--stores",
        default=None,
        help=f"comma list of {', '.join(KINDS)} (default: all; pg = PostgreSQL with fsync and "
        "synchronous_commit on, the headline)",
    )


def chosen(stores: str | None, url: str | None, ap: argparse.ArgumentParser) -> list[str]:
    """The store names asked for: `--stores`, or ["url"] for a given URL, or all kinds."""
    if url and stores:
        ap.error("a database URL and --stores exclude each other")
    if url:
        return ["url"]
    if stores is None:
        return list(KINDS)
    names = [s.strip() for s in stores.split(",") if s.strip()]
    unknown = [n for n in names if n not in KINDS]
    if unknown or not names:
        ap.error(f"--stores: unknown {', '.join(unknown) or 'empty list'} (of {', '.join(KINDS)})")
    if len(set(names)) != len(names):
        ap.error("--stores: a store named twice")
    return names


def tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` and all its descendants, reaped ones
    included (a process's children_* times hold the children it has waited for), or None
    when the process is gone or not ours to read."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    total = 0.0
    for i, proc in enumerate(procs):
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            if i == 0:
                return None
            continue  # a backend that ended meanwhile: its time moves to the postmaster's
        total += t.user + t.system + t.children_user + t.children_system
    return total


class CpuWindow:
    """The database server's CPU between construction and :meth:`stop`."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.t0 = time.monotonic()
        self.cpu0 = None if pid is None else tree_cpu_s(pid)

    def stop(self) -> dict[str, float]:
        """{"db_cpu_s": seconds, "db_cpu_pct": % of one CPU over the window}, or {} when the
        server's CPU cannot be read (SQLite, a remote URL)."""
        wall = time.monotonic() - self.t0
        if self.pid is None or self.cpu0 is None:
            return {}
        cpu1 = tree_cpu_s(self.pid)
        if cpu1 is None:
            return {}
        cpu = cpu1 - self.cpu0
        return {"db_cpu_s": cpu, "db_cpu_pct": 100.0 * cpu / wall if wall > 0 else 0.0}


def _local_postmaster(url: str) -> int | None:
    """The pid of the postmaster listening on this host for a PostgreSQL `url`, if any."""
    from sqlalchemy.engine import make_url

    try:
        u = make_url(url)
    except Exception:
        return None
    if not u.drivername.startswith("postgresql") or (u.host or "localhost") not in LOCAL_HOSTS:
        return None
    port = u.port or 5432
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(c.pid).name() in ("postgres", "postmaster"):
                    return c.pid
    return None


def _fstype(path: Path) -> str:
    """The type of the file system holding `path` (a durable server on tmpfs syncs nothing)."""
    best, kind = "", "?"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") + "/"
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, part.fstype
    return kind


class Store:
    """One store a bench runs on: its name, what it is, and a database per run."""

    def __init__(self, name: str, server: Any = None, url: str | None = None) -> None:
        self.name = name
        self.server = server  # a tests/pgserver.py PgServer for pg and pg-nosync
        self.url = url
        self.pid: int | None = server.pid if server is not None else None
        if name == "url" and url:
            self.pid = _local_postmaster(url)

    @property
    def label(self) -> str:
        if self.name == "url":
            where = (self.url or "").split("://")[0] + "://..."
            return f"{where} (given; reused across runs)"
        return LABELS[self.name]

    @contextlib.contextmanager
    def database(self, prefix: str) -> Iterator[str | None]:
        """The database URL for one run: a fresh database on this store's server (dropped
        afterwards), the given URL, or None for SQLite (the bench's own file)."""
        if self.server is None:
            yield self.url
            return
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        url = str(self.server.create_database(name))
        try:
            yield url
        finally:
            with contextlib.suppress(Exception):
                self.server.drop_database(name)

    def cpu(self) -> CpuWindow:
        """Start measuring the database server's CPU (see :meth:`CpuWindow.stop`)."""
        return CpuWindow(self.pid)


@contextlib.contextmanager
def open_stores(names: Sequence[str], url: str | None = None) -> Iterator[list[Store]]:
    """Start one throwaway PostgreSQL server per PostgreSQL kind in `names`, yield the stores
    in that order, and stop the servers however the bench ends."""
    with contextlib.ExitStack() as stack:
        stores = []
        for name in names:
            if name in ("pg", "pg-nosync"):
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
                from pgserver import PgServer

                server = PgServer.start(durable=name == "pg")
                stack.callback(server.stop)
                fs = _fstype(server.base_dir)
                log(
                    f"{name}: PostgreSQL up at 127.0.0.1:{server.port} (pid {server.pid}, "
                    f"{server.datadir} on {fs})"
                )
                if name == "pg" and fs in ("tmpfs", "ramfs"):
                    log(f"warning: {name} lives on {fs}: fsync costs nothing there")
                stores.append(Store(name, server=server))
            else:
                stores.append(Store(name, url=url))
                if name == "url":
                    pid = stores[-1].pid
                    log(
                        "url: database server's CPU "
                        + (f"from postmaster pid {pid}" if pid else "unknown (not found here)")
                    )
        yield stores


# --- reporting -------------------------------------------------------------------------------


def number(v: float | None) -> str:
    """A figure in a table: whole numbers from 100, else three significant digits."""
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def side_by_side(
    title: str,
    rows: Sequence[tuple[str, str]],
    per_store: dict[str, dict[str, float]],
) -> str:
    """A table with one column per store and, when SQLite is among them, a `X/sqlite` column
    for each other store: X's median divided by SQLite's (a plain ratio of the figures, so
    above 1 is better for a rate and worse for a time or a CPU cost).

    `rows` are (key, label) pairs; `per_store` maps store name to {key: median}."""
    names = list(per_store)
    ratios = [n for n in names if n != "sqlite"] if "sqlite" in names else []
    width = max([len(label) for _, label in rows] + [10])
    cols = [*names, *(f"{n}/sqlite" for n in ratios)]
    widths = [max(len(c), 8) for c in cols]
    head = f"{'':{width}} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))
    lines = [title, head, "-" * len(head)]
    for key, label in rows:
        if not any(key in per_store[n] for n in names):
            continue
        cells = [number(per_store[n].get(key)) for n in names]
        base = per_store.get("sqlite", {}).get(key)
        for n in ratios:
            v = per_store[n].get(key)
            cells.append("-" if v is None or not base else f"{v / base:.2f}x")
        lines.append(
            f"{label:{width}} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        )
    lines += [f"  {n}: {LABELS.get(n, 'the given database URL')}" for n in names]
    return "\n".join(lines)
