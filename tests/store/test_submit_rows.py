"""The submission fast path: rows written by `RowInsert` are the rows SQLAlchemy would write,
on SQLite (the driver path) and PostgreSQL (the ordinary statement); driver errors keep their
meaning; SQLite's WAL is checkpointed by the store's own thread, off the commits.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import func, insert, select, text

from phalanx.config import load_config
from phalanx.controller.runtime import partition_rows
from phalanx.domain.spec import JobSpec, normalize
from phalanx.errors import StoreUnavailable
from phalanx.store import schema as s
from phalanx.store import submission
from phalanx.store.engine import DEFAULT_OP_TIMEOUT
from phalanx.store.rowinsert import RowInsert
from phalanx.store.sqliteengine import WAL_BACKSTOP_PAGES
from phalanx.store.store import Store
from phalanx.store.submission import _JOB_ROW


def wait_for(cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.05)
    return got


@pytest.fixture
def store(migrated_db_url: str) -> Iterator[Store]:
    st = Store(migrated_db_url, actor="ctl-t")
    cfg = load_config(overrides={"cluster": {"partitions": [{"name": "batch", "default": True}]}})
    st.sync_partitions(partition_rows(cfg))
    try:
        yield st
    finally:
        st.close()


def item(store: Store, **kw: Any) -> tuple[Any, dict[str, Any]]:
    spec = JobSpec(argv=["/bin/true"], **kw)
    resolved = normalize(
        spec, store.partition_infos(), default_mem_per_cpu_mb=512, default_requeue=True
    )
    return resolved, spec.model_dump(exclude={"ignored"})


def job_row(store: Store, **kw: Any) -> dict[str, Any]:
    resolved, spec = item(store, **kw)
    with store.db.begin(write=False) as conn:
        return store._job_row(conn, resolved, spec, "alice", 1234.5)


def stored(store: Store, table: Any, key: int) -> dict[str, Any]:
    """The row as SQLAlchemy reads it back, without its id and the stamp the database gives
    each change (jobs.change_seq: one per insert, so never equal for two rows)."""
    with store.db.begin(write=False) as conn:
        row = conn.execute(select(table).where(table.c.id == key)).mappings().one()
    return {k: v for k, v in row.items() if k not in ("id", "change_seq")}


def test_job_row_matches_sqlalchemy_insert(store: Store) -> None:
    row = job_row(store, hold=True, name="x", comment="a 'quoted' \"text\" é")
    with store.db.begin() as conn:
        fast = RowInsert(s.jobs)(conn, row)
        slow = conn.execute(insert(s.jobs), row).inserted_primary_key[0]
    assert fast != slow
    a, b = stored(store, s.jobs, fast), stored(store, s.jobs, slow)
    assert a == b
    # the scalar defaults the row leaves out were filled in, as SQLAlchemy does
    assert a["launch_failures"] == 0 and a["retries"] == 0 and a["restart_count"] == 0
    assert a["spec"]["comment"] == "a 'quoted' \"text\" é"


@pytest.mark.parametrize("data", [None, {"k": [1, 2]}])
def test_event_row_matches_sqlalchemy_insert(store: Store, data: Any) -> None:
    row = {"ts": 1.5, "kind": "job.submit", "job_id": 7, "node": None, "actor": "alice"}
    row |= {"controller": "c", "term": None, "message": "m", "data": data}
    with store.db.begin() as conn:
        fast = RowInsert(s.events)(conn, row)
        slow = conn.execute(insert(s.events), row).inserted_primary_key[0]
    assert stored(store, s.events, fast) == stored(store, s.events, slow)


def test_sqlite_stores_the_same_bytes(tmp_path: Path) -> None:
    """On SQLite the raw column values are identical too (JSON text, booleans as integers)."""
    st = Store(f"sqlite:///{tmp_path}/x.db", actor="t")
    st.migrate()
    cfg = load_config(overrides={"cluster": {"partitions": [{"name": "batch", "default": True}]}})
    st.sync_partitions(partition_rows(cfg))
    try:
        row = job_row(st, exclusive=True)
        with st.db.begin() as conn:
            fast = RowInsert(s.jobs)(conn, row)
            slow = conn.execute(insert(s.jobs), row).inserted_primary_key[0]
    finally:
        st.close()
    db = sqlite3.connect(tmp_path / "x.db")
    try:
        columns = ", ".join(f'"{c.name}"' for c in s.jobs.c if c.name not in ("id", "change_seq"))
        sql = f"SELECT {columns} FROM jobs WHERE id = ?"
        raw = {i: db.execute(sql, (i,)).fetchone() for i in (fast, slow)}
    finally:
        db.close()
    assert raw[fast] == raw[slow]


def test_rolled_back_with_its_transaction(store: Store) -> None:
    row = job_row(store)
    with pytest.raises(RuntimeError), store.db.begin() as conn:
        jid = RowInsert(s.jobs)(conn, row)
        raise RuntimeError("later in the same transaction")
    with store.db.begin(write=False) as conn:
        assert conn.execute(select(s.jobs.c.id).where(s.jobs.c.id == jid)).first() is None


def test_driver_errors_are_sqlalchemy_errors(store: Store) -> None:
    row = job_row(store)
    del row["name"]  # NOT NULL
    with pytest.raises(sa_exc.IntegrityError), store.db.begin() as conn:
        RowInsert(s.jobs)(conn, row)
    with pytest.raises(sa_exc.CompileError), store.db.begin() as conn:
        RowInsert(s.jobs)(conn, {**job_row(store), "no_such_column": 1})


def test_locked_database_is_unavailable(tmp_path: Path) -> None:
    """Another process holds SQLite's write lock past the busy timeout: StoreUnavailable (a
    503), not a driver error (BEGIN IMMEDIATE goes straight to the driver)."""
    st = Store(f"sqlite:///{tmp_path}/x.db", actor="t")
    st.migrate()
    st.db.write.pool.dispose()
    with st.db.write.connect() as c:  # the pool's only connection from now on: quick to give up
        c.connection.driver_connection.execute("PRAGMA busy_timeout=200")  # type: ignore[union-attr]
    other = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable, match="locked"), st.db.begin() as conn:
            conn.execute(text("SELECT 1"))
    finally:
        other.execute("ROLLBACK")
        other.close()
    st.add_event("test.after", "the lock is gone: writes work again")
    st.close()


def test_wal_checkpointed_off_the_commit_path(tmp_path: Path) -> None:
    st = Store(f"sqlite:///{tmp_path}/x.db", actor="t")
    st.migrate()
    cfg = load_config(overrides={"cluster": {"partitions": [{"name": "batch", "default": True}]}})
    st.sync_partitions(partition_rows(cfg))
    ckpt = st.db.checkpointer
    assert ckpt is not None
    try:
        with st.db.begin() as conn:
            pages = conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar()
        assert pages == WAL_BACKSTOP_PAGES
        before = ckpt.checkpoints
        for _ in range(20):
            st.submit([item(st)], "alice")
        wait_for(lambda: ckpt.checkpoints > before)

        def wal_clean() -> bool:
            """Nothing left in the WAL that is not in the database file. The probe is a
            checkpoint too: it answers busy while the thread's own one runs, so it is retried."""
            probe = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
            try:
                busy, log, done = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            finally:
                probe.close()
            return bool(busy == 0 and log == done)

        wait_for(wal_clean)
    finally:
        st.close()
    # this store's thread is gone (not any thread of that name: another test's store may
    # still be open in this process)
    thread = ckpt._thread
    assert thread is not None and not thread.is_alive()


def ready_store(url: str, actor: str = "t", op_timeout: float = DEFAULT_OP_TIMEOUT) -> Store:
    """A migrated store at `url` with the one partition these tests submit to."""
    st = Store(url, actor=actor, op_timeout=op_timeout)
    st.migrate()
    cfg = load_config(overrides={"cluster": {"partitions": [{"name": "batch", "default": True}]}})
    st.sync_partitions(partition_rows(cfg))
    return st


def sqlite_store(tmp_path: Path) -> Store:
    return ready_store(f"sqlite:///{tmp_path}/x.db")


def assert_same_rows(st: Store, fast: list[int], slow: list[int]) -> None:
    """Each pair of jobs (one from a fast path, one from the general path) has the same job
    row and the same one job.submit event, by the job's own user."""
    for f, g in zip(fast, slow, strict=True):
        a, b = stored(st, s.jobs, f), stored(st, s.jobs, g)
        assert a == b
        with st.db.begin(write=False) as conn:
            ev = [
                {k: v for k, v in r.items() if k not in ("id", "job_id")}
                for jid in (f, g)
                for r in conn.execute(select(s.events).where(s.events.c.job_id == jid))
                .mappings()
                .all()
            ]
        assert len(ev) == 2 and ev[0] == ev[1] and ev[0]["actor"] == a["user"]


def test_driver_path_writes_what_the_general_path_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's plain submissions (Store._submit_plain_sqlite, on the driver) store the same
    job and event rows as the SQLAlchemy path, several submitters in one transaction."""
    st = sqlite_store(tmp_path)
    monkeypatch.setattr(submission, "_now", lambda: 1234.5)  # one submit time for both
    try:
        items = [(*item(st, hold=True, name=f"j{i}"), u) for i, u in enumerate(["al", "bo"])]
        fast = [ids[0] for ids in st.submit_each(items)]
        monkeypatch.setattr(st, "dialect", "general")  # the path arrays and dependencies take
        slow = [ids[0] for ids in st.submit_each(items)]
        monkeypatch.setattr(st, "dialect", "sqlite")
        assert len(set(fast + slow)) == 4
        assert_same_rows(st, fast, slow)
        assert {stored(st, s.jobs, f)["user"] for f in fast} == {"al", "bo"}
    finally:
        st.close()


def test_driver_path_errors_keep_their_meaning(tmp_path: Path) -> None:
    """On the driver path a locked database is StoreUnavailable (a 503) and stores nothing;
    an integrity error is SQLAlchemy's, and the transaction is rolled back."""
    st = sqlite_store(tmp_path)
    try:
        resolved, spec = item(st, hold=True)
        with st.db.begin(write=False) as conn:
            before = conn.execute(select(s.jobs.c.id)).all()
        st.db.write.pool.dispose()
        with st.db.write.connect() as c:  # the pool's only connection: quick to give up
            c.connection.driver_connection.execute("PRAGMA busy_timeout=200")  # type: ignore[union-attr]
        other = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreUnavailable, match="locked"):
                st.submit_each([(resolved, spec, "al")])
        finally:
            other.execute("ROLLBACK")
            other.close()
        row = job_row(st)
        del row["name"]  # NOT NULL
        with pytest.raises(sa_exc.IntegrityError), st.db.driver_write() as driver:
            _JOB_ROW.on_driver(driver, st.db.write.dialect, job_row(st))
            _JOB_ROW.on_driver(driver, st.db.write.dialect, row)
        with st.db.begin(write=False) as conn:
            assert conn.execute(select(s.jobs.c.id)).all() == before
        assert st.submit_each([(resolved, spec, "al")])  # and it works again
    finally:
        st.close()


@pytest.mark.postgres
def test_a_postgres_store_first_leaves_sqlite_submissions_working(
    tmp_path: Path, pg_url: str
) -> None:
    """One process holding stores of both kinds (a backup copied between them, a test run
    whose workers mix backends): the plans of the SQLite driver path are made with SQLite's
    own bind processors, whichever store submitted first. Before, the first PostgreSQL
    submission cached PostgreSQL's JSON processor for every later SQLite one, which failed
    with "type 'Json' is not supported"."""
    sqlite_url = f"sqlite:///{tmp_path}/phalanx.db"
    stores = [Store(url, actor="ctl-t") for url in (pg_url, sqlite_url)]
    cfg = load_config(overrides={"cluster": {"partitions": [{"name": "batch", "default": True}]}})
    try:
        for st in stores:
            st.migrate()
            st.sync_partitions(partition_rows(cfg))
            # a fresh set of columns, so that no earlier test made its plan already
            shape = {"comment": "both kinds", "name": f"mixed-{st.dialect}"}
            (job,) = st.submit_each([(*item(st, **shape), "alice")])
            assert st.get_job(job[0])["name"] == f"mixed-{st.dialect}"
    finally:
        for st in stores:
            st.close()


@pytest.mark.postgres
def test_postgresql_plain_path_writes_what_the_general_path_writes(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's plain submissions (Store._submit_plain_postgresql: ids from the sequence,
    then jobs and events in one statement) store the same job and event rows as the general
    path, a held job and a plain one from two submitters in one group, ids in request order;
    and the ids and rows of one group stay together when groups of other sizes follow."""
    st = ready_store(pg_url, actor="ctl-t")
    monkeypatch.setattr(submission, "_now", lambda: 1234.5)  # one submit time for both
    try:
        items = [
            (*item(st, hold=True, name="held"), "al"),
            (*item(st, name="plain", comment="c"), "bo"),
        ]
        fast = [ids[0] for ids in st.submit_each(items)]
        assert fast == sorted(fast)
        monkeypatch.setattr(st, "dialect", "general")  # the path arrays and dependencies take
        slow = [ids[0] for ids in st.submit_each(items)]
        monkeypatch.setattr(st, "dialect", "postgresql")
        assert_same_rows(st, fast, slow)
        assert stored(st, s.jobs, fast[0])["state"] == "HELD"
        assert stored(st, s.jobs, fast[1])["state"] == "PENDING"
        one = st.submit_each([(*item(st, name="one"), "cy")])
        three = st.submit_each([(*item(st, name=f"t{i}"), "cy") for i in range(3)])
        names = {jid: stored(st, s.jobs, jid)["name"] for (jid,) in [*one, *three]}
        assert list(names.values()) == ["one", "t0", "t1", "t2"]
    finally:
        st.close()


@pytest.mark.postgres
def test_a_postgresql_batch_larger_than_one_statement_is_stored_whole(pg_url: str) -> None:
    """More jobs than one statement carries (PostgreSQL takes 65,535 parameters): the batch
    is several statements in one transaction, every job and event stored, ids in order.

    What is checked is the batch's atomic storing, not its speed: ten statements of 200 jobs
    each on a server as loaded as CI's (three test workers and their clusters on 2 cores)
    have run past the default 2 s round-trip deadline, whose watchdog then closed the
    connection. A controller would answer that batch with "store unavailable" and nothing
    stored; here the deadline is one a loaded host meets."""
    st = ready_store(pg_url, actor="ctl-t", op_timeout=30.0)
    try:
        n = 10 * submission._GROUP_ROWS + 7  # about 100,000 parameters in one
        ids = [
            jid for (jid,) in st.submit_each([(*item(st, name=f"b{i}"), "al") for i in range(n)])
        ]
        assert ids == sorted(ids) and len(set(ids)) == n
        with st.db.begin(write=False) as conn:
            names = dict(conn.execute(select(s.jobs.c.id, s.jobs.c.name)).all())
            events = conn.execute(
                select(func.count()).select_from(s.events).where(s.events.c.kind == "job.submit")
            ).scalar_one()
        assert [names[j] for j in ids] == [f"b{i}" for i in range(n)]
        assert events == n
    finally:
        st.close()
