"""The scheduling loop's pending queue (`PendingMirror`, store/pending.py), on SQLite and
PostgreSQL: read whole once, then only the rows the database stamped as changed since, and
still exactly the pending jobs the store holds after submissions, holds, cancellations,
starts, reasons set by the pass, and a transaction that commits after a later one."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import select, update
from test_store_contract import add_node, exited, item, running, start, store, submit1

from phalanx.domain.states import JobState
from phalanx.store import pending
from phalanx.store import schema as s
from phalanx.store.pending import PendingMirror
from phalanx.store.store import Store

__all__ = ["store"]


def truth(store: Store) -> dict[int, dict[str, Any]]:
    """The pending jobs as a fresh read of the store has them (id -> reason, priority)."""
    with store.db.begin(write=False) as conn:
        rows = conn.execute(
            select(s.jobs.c.id, s.jobs.c.reason, s.jobs.c.priority).where(
                s.jobs.c.state == JobState.PENDING.value
            )
        )
        return {int(r.id): {"reason": r.reason, "priority": r.priority} for r in rows}


def mirrored(store: Store) -> dict[int, dict[str, Any]]:
    snap = store.sched_snapshot(eligible_by=time.time())
    return {int(j["id"]): {"reason": j["reason"], "priority": j["priority"]} for j in snap.pending}


def test_the_mirror_follows_every_change_after_one_whole_read(store: Store) -> None:
    add_node(store, "n1")
    ids = [submit1(store, name=f"j{i}") for i in range(5)]
    mirror = store.pending_mirror
    assert mirrored(store) == truth(store) and set(truth(store)) == set(ids)
    assert mirror.whole_reads == 1

    (array,) = store.submit([item(store, array="0-9")], "bob")  # ten rows in one insert
    store.hold([ids[0]], "alice")  # leaves PENDING
    store.cancel([ids[1]], "alice")
    start(store, ids[2], ["n1"])  # an attempt: STARTING
    store.set_pending_reasons({ids[3]: "Resources"})  # the pass's own write
    store.update_pending([ids[4]], {"time_limit_s": 60}, "root", may_raise=True)
    got = mirrored(store)
    assert got == truth(store)
    assert set(got) == {ids[3], ids[4], *array}
    assert got[ids[3]]["reason"] == "Resources"
    snap = store.sched_snapshot(eligible_by=time.time())
    assert {int(j["id"]): j["time_limit_s"] for j in snap.pending}[ids[4]] == 60
    store.release([ids[0]], "alice")  # back to PENDING
    assert mirrored(store) == truth(store) and ids[0] in truth(store)
    assert mirror.whole_reads == 1, "every read after the first was incremental"


def test_a_read_with_nothing_changed_reads_no_job_row(store: Store) -> None:
    submit1(store)
    mirrored(store)
    mirror = store.pending_mirror
    with store.db.begin(write=False, snapshot=True) as conn:
        before = mirror.rows
        changed = conn.execute(select(s.jobs.c.id).where(s.jobs.c.change_seq >= mirror.mark)).all()
        assert changed == []
        assert [j["id"] for j in mirror.sync(conn).rows] == list(before)
        assert mirror.rows is before and mirror.whole_reads == 1


def test_stamps_are_set_by_the_database_on_insert_and_every_update(store: Store) -> None:
    jid = submit1(store)

    def stamp() -> int:
        with store.db.begin(write=False) as conn:
            got = conn.execute(select(s.jobs.c.change_seq).where(s.jobs.c.id == jid)).scalar()
            assert got is not None
            return int(got)

    first = stamp()
    with store.db.begin() as conn:  # a write no store method makes: raw SQL
        conn.execute(update(s.jobs).where(s.jobs.c.id == jid).values(reason="by hand"))
    assert stamp() > first


def test_a_job_purged_between_two_reads_leaves_the_mirror(store: Store) -> None:
    """A deleted row leaves no stamp: a job the mirror last saw pending that ran, ended and
    was purged before the next read (a standby controller's mirror may be that old) must not
    stay in the queue as a ghost the pass would try to start for ever."""
    add_node(store, "n1")
    gone, kept = submit1(store, name="gone"), submit1(store, name="kept")
    assert set(mirrored(store)) == {gone, kept}
    att = start(store, gone, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.apply_reports("n1", [exited(att, 0)], None)
    assert store.purge_finished(time.time() + 60) == 1
    assert set(mirrored(store)) == {kept} == set(truth(store))


def test_a_row_deleted_elsewhere_leaves_the_mirror_at_the_next_count_check(store: Store) -> None:
    """Another controller's purge raises no flag here: the count (pending.COUNT_CHECK_EVERY)
    catches it at its next check, not at every pass (it cost 7% of PostgreSQL's time)."""
    from sqlalchemy import delete

    gone, kept = submit1(store, name="gone"), submit1(store, name="kept")
    assert set(mirrored(store)) == {gone, kept}
    with store.db.begin() as conn:  # as a purge by another process: no stamp, no flag
        for table in (s.events, s.jobs):
            col = table.c.job_id if table is s.events else table.c.id
            conn.execute(delete(table).where(col == gone))
    mirror = store.pending_mirror
    assert set(mirrored(store)) == {gone, kept}, "counted a moment ago: not checked again yet"
    mirror.counted_at -= pending.COUNT_CHECK_EVERY  # as if that long had passed
    assert set(mirrored(store)) == {kept} == set(truth(store))
    assert mirror.whole_reads == 2


def test_purging_the_newest_stamped_row_does_not_hide_the_next_change(store: Store) -> None:
    """Stamps must never repeat: had a stamp been the largest one plus one, purging the row
    that held the largest would give the next change a stamp below the mirror's mark, and a
    change that keeps the job pending (here its reason) would be missed for good."""
    add_node(store, "n1")
    waiting, done = submit1(store, name="waiting"), submit1(store, name="done")
    att = start(store, done, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.apply_reports("n1", [exited(att, 0)], None)  # `done` now holds the newest stamp
    mirrored(store)
    assert store.purge_finished(time.time() + 60) == 1
    store.set_pending_reasons({waiting: "Resources"})
    assert mirrored(store)[waiting]["reason"] == "Resources"
    assert store.pending_mirror.whole_reads == 1


def test_a_mark_that_goes_backwards_reads_everything_again(store: Store) -> None:
    """A store restored from a backup, or failed over to a replica behind the primary:
    nothing is known about what changed, so the next read is whole."""
    submit1(store)
    mirrored(store)
    mirror = store.pending_mirror
    assert mirror.mark is not None
    mirror.mark += 10**12  # as if the database had been set back
    jid = submit1(store)
    assert jid in mirrored(store)
    assert mirror.whole_reads == 2


def test_a_failed_read_leaves_the_mirror_to_be_read_whole(store: Store) -> None:
    jid = submit1(store)
    mirror = PendingMirror(store.pending_mirror.columns, store.pending_mirror.source)
    with store.db.begin(write=False, snapshot=True) as conn:
        mirror.sync(conn)
    assert set(mirror.rows) == {jid}
    conn = store.db.read.connect()
    conn.close()  # a connection that is gone: every statement on it fails
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises
        mirror.sync(conn)
    assert mirror.mark is None and mirror.rows == {}
    with store.db.begin(write=False, snapshot=True) as live:
        assert [j["id"] for j in mirror.sync(live).rows] == [jid]
    assert mirror.whole_reads == 2


def test_the_whole_queue_is_read_not_a_first_slice(store: Store) -> None:
    """Before the mirror a pass read the first 5,000 pending jobs by (--priority, id), so
    multifactor priority and fair share ordered those alone; the 5,001st was never seen."""
    (array,) = store.submit([item(store, array="0-5000")], "alice")
    late = submit1(store, user="bob")
    snap = store.sched_snapshot(eligible_by=time.time())
    assert len(snap.pending) == len(array) + 1 == 5002
    assert snap.pending[-1]["id"] == late, "(--priority, id) order"


def test_a_whole_read_in_chunks_reads_every_pending_row_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole read takes the pending ids, then their rows a chunk of ids at a time (one
    statement for 100,000 rows ran past db_op_timeout on PostgreSQL): jobs that are not
    pending between two chunks' ids must not slip in, and none may be left out."""
    monkeypatch.setattr(pending, "WHOLE_READ_CHUNK", 3)
    ids = [submit1(store, name=f"j{i}") for i in range(11)]
    store.hold(ids[2:4], "alice")
    store.cancel([ids[7]], "alice")
    mirror = PendingMirror(store.pending_mirror.columns, store.pending_mirror.source)
    with store.db.begin(write=False, snapshot=True) as conn:
        got = mirror.sync(conn).rows
    assert [j["id"] for j in got] == [i for i in ids if i not in (ids[2], ids[3], ids[7])]
    assert {int(j["id"]): {"reason": j["reason"], "priority": j["priority"]} for j in got} == (
        truth(store)
    )


def test_a_change_committed_after_the_read_began_is_read_next_time(store: Store) -> None:
    """A write transaction still open while the pass reads: the read cannot see it, and the
    next read must. On PostgreSQL the older transaction also commits after a younger one the
    read did see (rows are stamped with their transaction's id, and transactions commit out
    of id order: the mark, the oldest transaction still running, allows for it); SQLite has
    one writer at a time, so there the open transaction is the only one."""
    older, younger = submit1(store, name="older"), submit1(store, name="younger")
    mirrored(store)
    postgres = store.dialect == "postgresql"
    a = store.db.write.connect()
    try:
        ta = a.begin()
        a.execute(update(s.jobs).where(s.jobs.c.id == older).values(reason="from A"))
        if postgres:
            with store.db.write.begin() as b:
                b.execute(update(s.jobs).where(s.jobs.c.id == younger).values(reason="from B"))
        got = mirrored(store)  # A is still open
        assert got[older]["reason"] != "from A"
        assert got[younger]["reason"] == ("from B" if postgres else None)
        ta.commit()
    finally:
        a.close()
    got = mirrored(store)
    assert got[older]["reason"] == "from A" and got == truth(store)
    assert store.pending_mirror.whole_reads == 1


def test_begin_times_and_dependencies_are_judged_each_pass(store: Store) -> None:
    """The mirror hands out the rows a pass must look at by themselves (a begin time, a
    dependency) apart from the rest: a job waiting for its begin time becomes eligible as
    the clock passes it, with no change to its row, and a dependency's state is read."""
    first = submit1(store, name="first")
    later = submit1(store, name="later")
    after = submit1(store, name="after", dependency=f"afterok:{first}")
    now = time.time()
    with store.db.begin() as conn:  # a retry's backoff, as the store sets it
        conn.execute(update(s.jobs).where(s.jobs.c.id == later).values(eligible_time=now + 100))
    snap = store.sched_snapshot(eligible_by=now)
    assert [int(j["id"]) for j in snap.pending] == [first, after]
    assert [j["id"] for j in snap.not_yet] == [later]
    assert snap.dep_states == {first: JobState.PENDING}
    snap = store.sched_snapshot(eligible_by=now + 101)  # the clock alone moved
    assert [int(j["id"]) for j in snap.pending] == [first, later, after]
    assert snap.not_yet == []
    assert store.pending_mirror.whole_reads == 1
