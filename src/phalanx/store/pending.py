"""The pending queue as the scheduling loop last read it, kept up to date by reading only the
job rows changed since (`jobs.change_seq`, stamped by the database: migration 0010).

Why: a scheduling pass runs every second and must order the whole pending queue by
multifactor priority. Reading 100,000 pending rows (three JSON columns each) into dicts
costs seconds a pass, so the pass used to read only the first 5,000 by ``--priority`` and
id, and fair share ordered those alone. With the mirror a pass reads what changed: new jobs,
jobs that started or were cancelled, reasons it set itself.

The mark. Each read first takes a *mark*, then reads the rows stamped at or after the
previous read's mark, then keeps the new mark for the next read:

* SQLite: the stamp counter plus one. Writers take turns (one write transaction at a time)
  and each change takes the counter's next value, so stamps grow in commit order and never
  repeat: a row changed after the mark was taken is stamped at or above it.
* PostgreSQL: the stamp is the writing transaction's id, and transactions commit out of id
  order; the mark is the oldest transaction id still running when the read starts
  (``pg_snapshot_xmin``). Any change the read does not see belongs to a transaction that was
  running or not yet begun then, whose id is at or above the mark. Rows of a transaction
  that committed during the read may be read twice, which is harmless: a row read again
  replaces itself.

A whole read replaces the mirror at the first read, after a failed read, when the mark goes
backwards (a store restored from a backup, or a database failed over to a replica that had
not received the last transactions): nothing then is known about what changed; and when the
mirror does not hold as many jobs as the store has pending (a row deleted leaves no stamp: a
job that ended and was purged between two reads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, FromClause, func, select, text

from phalanx.domain.states import JobState
from phalanx.store import schema as s
from phalanx.store.sqlbits import chunks

_PENDING = JobState.PENDING.value

# Rows per statement of a whole read. PostgreSQL parses a `json` column's whole text for each
# `->>`, and a pass reads eight keys of the spec: about 40 us a row with a 1 KB spec, 0.1 s a
# chunk on an idle machine, inside db_op_timeout (2 s) on one several times busier.
WHOLE_READ_CHUNK = 2_000

# Seconds between two checks of the pending count against the mirror (its drift check). The
# count costs 6-7 ms a pass at 5,000 pending jobs on PostgreSQL (an index scan with heap
# visits; 7% of the server's time in a placements run, pg_stat_statements), and the drift it
# catches, a job that left the queue and was purged between two reads, needs a mirror older
# than the accounting retention: hours, not a pass. A purge in this process makes the next
# sync check at once (`PendingMirror.purged`).
COUNT_CHECK_EVERY = 10.0


def current_mark(conn: Connection) -> int:
    """The mark a read taken now starts from (module docstring)."""
    if conn.dialect.name == "postgresql":
        return int(
            conn.execute(
                text("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
            ).scalar_one()
        )
    top = conn.execute(
        select(s.job_change_counter.c.seq).where(s.job_change_counter.c.id == 1)
    ).scalar_one()
    return int(top) + 1


def _marked(row: dict[str, Any]) -> bool:
    """Whether a pass must look at this row by itself: a begin time, a restart reservation
    or a dependency (most of a large queue has none of these, and a pass then need not walk
    every row to find the few that do)."""
    return (
        row["eligible_time"] is not None
        or row["reserved_until"] is not None
        or bool(row["dependency"])
    )


@dataclass(frozen=True)
class Pending:
    """What a `sync` hands out: every pending row, and the `_marked` ones among them."""

    rows: list[dict[str, Any]]
    marked: list[dict[str, Any]]


class PendingMirror:
    """Every pending job's row (the columns given), by id, as of the last `sync`."""

    def __init__(self, columns: Sequence[Any], source: FromClause = s.jobs) -> None:
        self.columns = list(columns)
        self.source = source  # what the columns are read from: `jobs`, or joined with more
        self.rows: dict[int, dict[str, Any]] = {}
        self.marked: dict[int, dict[str, Any]] = {}  # the `_marked` rows of `rows`
        self.mark: int | None = None  # None: the next sync reads every pending row
        self.whole_reads = 0  # how many syncs read everything (tests read it)
        self.counted_at = -COUNT_CHECK_EVERY  # monotonic time of the last drift check
        self.purged = False  # this process purged jobs since: check the count at the next sync
        self._lock = threading.Lock()

    def sync(self, conn: Connection) -> Pending:
        """Bring the mirror up to date on `conn` and return its rows. `conn`: a transaction
        whose statements all see one snapshot (`Engines.begin(snapshot=True)`), or the count
        that checks the mirror may differ from the rows read and force a whole read.

        The rows are the mirror's own: callers must not change them (a row read again is
        replaced, never changed in place, so a caller's list stays as it was while another
        thread syncs: the scheduling loop and `explain` both read through it). A failure
        leaves the mirror empty, to be read whole next time (the read may have stopped half
        way)."""
        with self._lock:
            try:
                self._sync(conn)
                return Pending(list(self.rows.values()), list(self.marked.values()))
            except BaseException:
                self.mark = None
                self.rows, self.marked = {}, {}
                raise

    def _sync(self, conn: Connection) -> None:
        mark = current_mark(conn)
        since = self.mark
        if since is None or mark < since:
            self._whole(conn)
        else:
            rows, marked = self.rows, self.marked
            # ids and states first, by the stamp's index alone (with the state in the WHERE,
            # SQLite walks the state index instead: every pending row), then the pending
            # ones' columns by id
            pending = []
            for jid, state in conn.execute(
                select(s.jobs.c.id, s.jobs.c.state).where(s.jobs.c.change_seq >= since)
            ):
                if state == _PENDING:
                    pending.append(int(jid))
                else:
                    rows.pop(int(jid), None)
                    marked.pop(int(jid), None)
            for chunk in chunks(pending, 500):
                for r in conn.execute(
                    select(*self.columns)
                    .select_from(self.source)
                    .where(s.jobs.c.id.in_(chunk), s.jobs.c.state == _PENDING)
                ).mappings():
                    row = dict(r)
                    jid = int(row["id"])
                    rows[jid] = row
                    if _marked(row):
                        marked[jid] = row
                    else:
                        marked.pop(jid, None)
            # A deleted row leaves no stamp behind: a job that left the queue and was purged
            # between two reads (a standby controller's mirror can be a month old) would stay
            # here for ever. The count of pending rows, from the state index, catches that and
            # any other drift.
            now = time.monotonic()
            if self.purged or now - self.counted_at >= COUNT_CHECK_EVERY:
                self.purged = False
                self.counted_at = now
                if self._pending_count(conn) != len(rows):
                    self._whole(conn)
        self.mark = mark

    def _whole(self, conn: Connection) -> None:
        # The ids first (from the state index alone), then the rows WHOLE_READ_CHUNK at a time
        # by id range: one statement for 100,000 rows took 4 s on PostgreSQL, past
        # db_op_timeout, and the scheduler could not start. (Not `id > last ORDER BY id
        # LIMIT n`: with statistics not yet updated after a large submission PostgreSQL sorts
        # every pending row for each chunk, working out the spec's keys for all of them.) The
        # snapshot transaction keeps the statements consistent with each other.
        ids = sorted(
            int(i)
            for i in conn.execute(select(s.jobs.c.id).where(s.jobs.c.state == _PENDING)).scalars()
        )
        rows: dict[int, dict[str, Any]] = {}
        for part in chunks(ids, WHOLE_READ_CHUNK):
            got = conn.execute(
                select(*self.columns)
                .select_from(self.source)
                .where(s.jobs.c.state == _PENDING, s.jobs.c.id.between(part[0], part[-1]))
            ).mappings()
            rows.update((int(r["id"]), dict(r)) for r in got)
        self.rows = rows
        self.marked = {jid: row for jid, row in self.rows.items() if _marked(row)}
        self.whole_reads += 1
        self.counted_at = time.monotonic()  # read whole: nothing to drift from yet
        self.purged = False

    @staticmethod
    def _pending_count(conn: Connection) -> int:
        return int(
            conn.execute(
                select(func.count()).select_from(s.jobs).where(s.jobs.c.state == _PENDING)
            ).scalar_one()
        )
