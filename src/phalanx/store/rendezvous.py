"""The torchrun rendezvous the controllers host: torch's rendezvous state and key-value store.

`torchrun --rdzv-backend=phalanx` (phalanx/rendezvous.py, the job's side) keeps the state of
torch's DynamicRendezvousHandler here instead of in a TCPStore on one of the job's nodes, so
the rendezvous survives the loss of any node: the controllers are highly available, and so is
this table. Rows belong to one attempt of a running job (a requeued job starts a fresh
rendezvous; `purge_finished` deletes them with the job) and one rendezvous id:

* ``state``: the handler's opaque state (torch pickles it; it is never unpickled here) with
  its fencing token, `version`: `rdzv_cas` sets it only if the caller's token is the current
  one (or, with none, only if there is no state yet), in one transaction; a retry of a set
  whose answer was lost therefore changes nothing (the token moved on): the call is safe to
  repeat on another controller;
* ``member/<node desc>``: the Phalanx node of each torchrun agent that wrote the state, so the
  controllers can say which participants are on nodes that left the job (`departed`);
* ``kv/<key>``: the key-value store torch's agents share within a round (the master address,
  the worker ranks, the exit barrier): `rdzv_set`, `rdzv_get`, `rdzv_add`, `rdzv_delete`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from phalanx.domain.states import AttemptState, JobState, TaskState
from phalanx.errors import InvalidTransition, NotFound
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.sqlbits import now as _now

STATE_KEY = "state"
MEMBER_PREFIX = "member/"
KV_PREFIX = "kv/"
_LIVE_JOB = (JobState.STARTING.value, JobState.RUNNING.value)
_LIVE_ATTEMPT = (AttemptState.STARTING.value, AttemptState.RUNNING.value)


@dataclass
class RdzvRead:
    """What a rendezvous read returns: the values asked for (key -> (value, version)), and
    the members whose node has left the job's attempt (their node descs, sorted)."""

    values: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    departed: list[str] = field(default_factory=list)


class RendezvousRecords(StoreBase):
    """The rendezvous rows of running jobs (torchrun --rdzv-backend=phalanx)."""

    def rdzv_get(
        self, job_id: int, run_id: str, keys: Sequence[str], *, departed: bool = False
    ) -> RdzvRead:
        """The values of these keys that exist; with `departed`, the members on nodes that
        left the job (a --no-kill job's regroup)."""
        with self.db.begin(write=False) as conn:
            aid = self._rdzv_attempt(conn, job_id)
            out = RdzvRead()
            r = s.rendezvous.c
            base = (r.job_id == job_id, r.attempt_id == aid, r.run_id == run_id)
            if keys:
                for row in conn.execute(
                    select(r.key, r.value, r.version).where(*base, r.key.in_(list(keys)))
                ):
                    out.values[str(row.key)] = (bytes(row.value), int(row.version))
            if departed:
                out.departed = self._departed(conn, aid, base)
            return out

    def rdzv_cas(
        self,
        job_id: int,
        run_id: str,
        key: str,
        value: bytes,
        expect: int | None,
        *,
        member: tuple[str, str] | None = None,
    ) -> tuple[bytes, int, bool, list[str]]:
        """Set `key` to `value` if its version is `expect` (None: if it does not exist yet),
        in one transaction; returns (the value now, its version, whether this set it, the
        departed members). `member`: (node desc, node) recorded with it (a state write)."""
        now = _now()
        with self.db.begin() as conn:
            aid = self._rdzv_attempt(conn, job_id)
            r = s.rendezvous.c
            base = (r.job_id == job_id, r.attempt_id == aid, r.run_id == run_id)
            ids = {"job_id": job_id, "attempt_id": aid, "run_id": run_id}
            if expect is None:
                done = self._insert_new(conn, {**ids, "key": key, "value": value, "version": 1})
            else:
                done = (
                    conn.execute(
                        update(s.rendezvous)
                        .where(*base, r.key == key, r.version == expect)
                        .values(value=value, version=expect + 1, updated_at=now)
                    ).rowcount
                    == 1
                )
            if done and member is not None:
                desc, node = member
                self._insert_new(
                    conn,
                    {**ids, "key": MEMBER_PREFIX + desc, "value": node.encode(), "version": 1},
                )
            row = conn.execute(select(r.value, r.version).where(*base, r.key == key)).one_or_none()
            gone = self._departed(conn, aid, base)
        if row is None:  # deleted meanwhile: nothing to compare with
            return b"", 0, False, gone
        return bytes(row.value), int(row.version), done, gone

    def rdzv_set(self, job_id: int, run_id: str, items: Mapping[str, bytes]) -> None:
        """Set these keys (whatever they held), in one transaction."""
        now = _now()
        with self.db.begin() as conn:
            aid = self._rdzv_attempt(conn, job_id)
            r = s.rendezvous.c
            base = (r.job_id == job_id, r.attempt_id == aid, r.run_id == run_id)
            ids = {"job_id": job_id, "attempt_id": aid, "run_id": run_id}
            for key, value in items.items():
                if not self._insert_new(conn, {**ids, "key": key, "value": value, "version": 1}):
                    conn.execute(
                        update(s.rendezvous)
                        .where(*base, r.key == key)
                        .values(value=value, version=r.version + 1, updated_at=now)
                    )

    def rdzv_add(self, job_id: int, run_id: str, key: str, delta: int) -> int:
        """Add `delta` to the integer at `key` (0 when absent), atomically; the new value."""
        now = _now()
        with self.db.begin() as conn:
            aid = self._rdzv_attempt(conn, job_id)
            r = s.rendezvous.c
            base = (r.job_id == job_id, r.attempt_id == aid, r.run_id == run_id)
            ids = {"job_id": job_id, "attempt_id": aid, "run_id": run_id}
            self._insert_new(conn, {**ids, "key": key, "value": b"0", "version": 0})
            q = select(r.value).where(*base, r.key == key)
            if self.dialect == "postgresql":
                q = q.with_for_update()
            raw = bytes(conn.execute(q).scalar_one())
            try:
                value = int(raw.decode() or "0") + delta
            except ValueError:
                raise InvalidTransition(
                    f"rendezvous key {key!r} does not hold an integer", job_id=job_id
                ) from None
            conn.execute(
                update(s.rendezvous)
                .where(*base, r.key == key)
                .values(value=str(value).encode(), version=r.version + 1, updated_at=now)
            )
            return value

    def rdzv_delete(self, job_id: int, run_id: str, key: str) -> bool:
        """Delete `key`; whether it existed."""
        with self.db.begin() as conn:
            aid = self._rdzv_attempt(conn, job_id)
            r = s.rendezvous.c
            res = conn.execute(
                delete(s.rendezvous).where(
                    r.job_id == job_id, r.attempt_id == aid, r.run_id == run_id, r.key == key
                )
            )
            return bool(res.rowcount)

    def rdzv_count(self, job_id: int, run_id: str, prefix: str) -> int:
        """How many keys start with `prefix` (torch's Store.num_keys, over the kv keys)."""
        with self.db.begin(write=False) as conn:
            aid = self._rdzv_attempt(conn, job_id)
            r = s.rendezvous.c
            return len(
                conn.execute(
                    select(r.key).where(
                        r.job_id == job_id,
                        r.attempt_id == aid,
                        r.run_id == run_id,
                        r.key.startswith(prefix, autoescape=True),
                    )
                ).all()
            )

    # ------------------------------------------------------------------ helpers
    def _rdzv_attempt(self, conn: Connection, job_id: int) -> int:
        """The job's current attempt, which must be live: a rendezvous is a running job's."""
        row = conn.execute(
            select(s.jobs.c.state, s.jobs.c.attempt_id, s.attempts.c.state.label("att_state"))
            .outerjoin(s.attempts, s.attempts.c.id == s.jobs.c.attempt_id)
            .where(s.jobs.c.id == job_id)
        ).one_or_none()
        if row is None:
            raise NotFound(f"job {job_id} not found", job_id=job_id)
        if (
            row.state not in _LIVE_JOB
            or row.attempt_id is None
            or row.att_state not in _LIVE_ATTEMPT
        ):
            raise InvalidTransition(
                f"job {job_id} is {row.state}: a rendezvous is a running job's", job_id=job_id
            )
        return int(row.attempt_id)

    def _insert_new(self, conn: Connection, values: dict[str, Any]) -> bool:
        """Insert the row unless its key exists (either database); whether it was inserted."""
        values = {**values, "updated_at": _now()}
        ins = pg_insert if self.dialect == "postgresql" else sqlite_insert
        # RETURNING tells whether the row went in (psycopg's rowcount for an INSERT that
        # may do nothing is not one to trust through SQLAlchemy)
        res = conn.execute(
            ins(s.rendezvous)
            .values(**values)
            .on_conflict_do_nothing()
            .returning(s.rendezvous.c.version)
        )
        return res.first() is not None

    def _departed(self, conn: Connection, aid: int, base: tuple[Any, ...]) -> list[str]:
        """The members (node descs) whose node left the attempt: its task there is marked
        left (store/regroup.py: lost with the node, or stopped there by self-fencing)."""
        r = s.rendezvous.c
        members = {
            str(row.key)[len(MEMBER_PREFIX) :]: bytes(row.value).decode(errors="replace")
            for row in conn.execute(
                select(r.key, r.value).where(*base, r.key.startswith(MEMBER_PREFIX))
            )
        }
        if not members:
            return []
        left = {
            str(t.node)
            for t in conn.execute(
                select(s.tasks.c.node, s.tasks.c.detail).where(
                    s.tasks.c.attempt_id == aid,
                    s.tasks.c.state.in_([TaskState.LOST.value, TaskState.EXITED.value]),
                    s.tasks.c.held.is_(False),
                )
            )
            if (t.detail or {}).get("left")
        }
        return sorted(desc for desc, node in members.items() if node in left)
