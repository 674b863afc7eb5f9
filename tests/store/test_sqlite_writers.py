"""SQLite: a controller's write transactions take turns on a lock (engine.WriterQueue)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from phalanx.errors import StoreUnavailable
from phalanx.store.engine import Engines
from phalanx.store.writers import WriterQueue


def test_many_threads_writing_at_once_all_commit(tmp_path: Path) -> None:
    db = Engines(f"sqlite:///{tmp_path}/w.db")
    try:
        with db.begin() as c:
            c.execute(text("CREATE TABLE n (v INTEGER)"))
            c.execute(text("INSERT INTO n VALUES (0)"))
        errors: list[BaseException] = []
        inside = [0]
        most = [0]
        guard = threading.Lock()

        def writer() -> None:
            try:
                for _ in range(25):
                    with db.begin() as c:
                        with guard:
                            inside[0] += 1
                            most[0] = max(most[0], inside[0])
                        v = c.execute(text("SELECT v FROM n")).scalar_one()
                        c.execute(text("UPDATE n SET v = :v"), {"v": v + 1})
                        with guard:
                            inside[0] -= 1
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=writer) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        with db.begin(write=False) as c:
            assert c.execute(text("SELECT v FROM n")).scalar_one() == 300  # no update lost
        assert most[0] == 1  # one writer inside a transaction at a time
        # reads do not take a turn: one runs while a write transaction is open
        with db.begin() as c:
            c.execute(text("UPDATE n SET v = v"))
            got: list[int] = []
            reader = threading.Thread(
                target=lambda: got.append(
                    _read(db)  # would block until the write commits if reads took turns
                )
            )
            reader.start()
            reader.join(timeout=30)
            assert got == [300]
    finally:
        db.dispose()


def _read(db: Engines) -> int:
    with db.begin(write=False) as c:
        return int(c.execute(text("SELECT v FROM n")).scalar_one())


def test_a_writer_that_gets_no_turn_is_told_the_store_is_busy() -> None:
    q = WriterQueue(timeout=0.2)
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with q.turn("sqlite:////x.db"):
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        with pytest.raises(StoreUnavailable, match="database is locked"), q.turn("sqlite:////x.db"):
            pass
    finally:
        release.set()
        t.join()
    with q.turn("sqlite:////x.db"):  # free again
        pass
