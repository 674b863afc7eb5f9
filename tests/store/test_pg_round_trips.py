"""The round trips PostgreSQL costs each store call, kept few (issue 26).

Reads outside a snapshot run in autocommit (no BEGIN, no COMMIT: under READ COMMITTED each
statement saw its own snapshot anyway), and a pooled connection used within the last
PING_IDLE_AFTER seconds is handed out without the liveness check, which costs a round trip;
one idle longer is still checked, so a server restarted under an idle pool is noticed before a
transaction fails on it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from phalanx.store import pgengine
from phalanx.store.store import Store

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    st = Store(pg_url, actor="test")
    st.migrate()
    try:
        yield st
    finally:
        st.close()


def test_a_read_outside_a_snapshot_opens_no_transaction(store: Store) -> None:
    """In autocommit every statement is a transaction of its own, so now() (the start of the
    transaction) is the statement's own start; inside BEGIN the second statement's now() is
    the first's. Snapshot reads and writes keep their transaction."""

    def own_transaction_each(**begin: Any) -> bool:
        with store.db.begin(**begin) as conn:
            conn.execute(text("SELECT pg_sleep(0.02)"))
            return bool(conn.execute(text("SELECT now() = statement_timestamp()")).scalar_one())

    assert own_transaction_each(write=False) is True
    assert own_transaction_each(write=False, snapshot=True) is False
    assert own_transaction_each(write=True) is False


def test_a_connection_in_use_a_moment_ago_is_not_checked_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    dialect = store.db.write.dialect
    pings: list[float] = []
    real = dialect.do_ping

    def counted(dbapi_conn: Any) -> bool:
        pings.append(time.monotonic())
        return bool(real(dbapi_conn))

    monkeypatch.setattr(dialect, "do_ping", counted)
    store.db_time()  # a connection made (fresh ones are not checked) and returned
    for _ in range(5):
        store.db_time()
    assert pings == []

    with store.db.begin(single=True) as conn:  # a one-statement write in autocommit: checked,
        conn.execute(text("SELECT 1"))  # so that a dead connection is not an unknown outcome
    assert len(pings) == 1
    pings.clear()

    monkeypatch.setattr(pgengine, "PING_IDLE_AFTER", 0.05)
    time.sleep(0.1)  # idle longer than the window: checked at its next checkout
    store.db_time()
    assert len(pings) == 1
