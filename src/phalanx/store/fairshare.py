"""Fair share usage in the store: charging what attempts hold, decaying it, reading it back,
and the job counts limits are checked against.

A mixin of `Store`. Usage is kept per user association (`assoc_usage`: account, user, decayed
usage, the time it was decayed to). The cluster duty calls `charge_usage` every
`priority.calc_period`: in one fenced transaction it decays every association's usage to now
and adds the charge of each attempt still open for charging (running, or ended but not fully
charged) since it was last charged, so nothing is recomputed from history and nothing is
charged twice (a charge and its attempt's mark commit together). The arithmetic is in
domain/fairshare.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, update

from phalanx.domain import fairshare
from phalanx.domain.states import AttemptState, JobState
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.sqlbits import Fence
from phalanx.store.sqlbits import chunks as _chunks

HOLDING = (JobState.STARTING.value, JobState.RUNNING.value, JobState.COMPLETING.value)
SUBMITTED = (JobState.PENDING.value, JobState.HELD.value, *HOLDING)
# Attempts charged in one transaction at most: a backlog (attempts recorded while no controller
# charged them, or written by a tool) is charged over a few periods, each a short transaction,
# instead of one that holds the store's write lock for seconds. None is lost: an attempt not
# reached stays uncharged, and is charged from its own mark when it is.
CHARGE_BATCH = 5_000


class FairShareUsage(StoreBase):
    """Usage and counts for fair share and limits (see the module docstring)."""

    def charge_usage(
        self,
        now: float,
        *,
        half_life: float,
        cpu_weight: float,
        gpu_weight: float,
        default_account: str,
        fence: Fence | None,
    ) -> int:
        """Decay all usage to `now` and charge open attempts up to `now` (or their end);
        return how many attempts were charged."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            rows = list(
                conn.execute(
                    select(
                        s.attempts.c.id,
                        s.attempts.c.state,
                        s.attempts.c.start_time,
                        s.attempts.c.end_time,
                        s.attempts.c.charged_until,
                        s.jobs.c.user,
                        s.jobs.c.account,
                    )
                    .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)
                    .where(s.attempts.c.uncharged.is_(True))
                    # the least recently charged first (never charged before all): running
                    # attempts stay uncharged-marked, and every one of them must come round
                    .order_by(
                        s.attempts.c.charged_until.is_not(None),
                        s.attempts.c.charged_until,
                        s.attempts.c.id,
                    )
                    .limit(CHARGE_BATCH)
                ).mappings()
            )
            held = self._held_resources(conn, [int(r["id"]) for r in rows if r["start_time"]])
            charges: dict[tuple[str, str], float] = {}
            marks: list[tuple[int, float | None, bool]] = []  # id, charged_until, still open
            for r in rows:
                ended = r["state"] == AttemptState.ENDED.value
                if r["start_time"] is None:
                    if ended:
                        marks.append((int(r["id"]), None, False))
                    continue
                until = min(now, r["end_time"]) if ended and r["end_time"] else now
                since = max(float(r["start_time"]), float(r["charged_until"] or 0.0))
                cpus, gpus = held.get(int(r["id"]), (0, 0))
                amount = fairshare.charge(cpus, gpus, until - since, cpu_weight, gpu_weight)
                key = (str(r["account"] or default_account), str(r["user"]))
                charges[key] = charges.get(key, 0.0) + amount
                marks.append((int(r["id"]), max(until, since), not ended))
            current = {
                (r.account, r.user): (float(r.usage), float(r.decayed_at))
                for r in conn.execute(select(s.assoc_usage))
            }
            for key, (usage, at) in current.items():
                value = fairshare.decay(usage, at, now, half_life) + charges.pop(key, 0.0)
                conn.execute(
                    update(s.assoc_usage)
                    .where(s.assoc_usage.c.account == key[0], s.assoc_usage.c.user == key[1])
                    .values(usage=value, decayed_at=now)
                )
            if charges:
                conn.execute(
                    insert(s.assoc_usage),
                    [
                        {"account": a, "user": u, "usage": v, "decayed_at": now}
                        for (a, u), v in charges.items()
                    ],
                )
            if marks:  # one statement, many parameter sets: a long backlog costs one round
                conn.execute(
                    update(s.attempts)
                    .where(s.attempts.c.id == bindparam("b_id"))
                    .values(charged_until=bindparam("b_until"), uncharged=bindparam("b_open")),
                    [{"b_id": a, "b_until": u, "b_open": o} for a, u, o in marks],
                )
            return sum(1 for m in marks if m[1] is not None)

    def _held_resources(
        self, conn: Connection, attempt_ids: list[int]
    ) -> dict[int, tuple[int, int]]:
        """CPUs and GPUs each attempt holds (all its tasks, spares included)."""
        out: dict[int, tuple[int, int]] = {}
        for chunk in _chunks(attempt_ids, 500):
            for r in conn.execute(
                select(s.tasks.c.attempt_id, s.tasks.c.cpus, s.tasks.c.gpu_ids).where(
                    s.tasks.c.attempt_id.in_(chunk)
                )
            ):
                cpus, gpus = out.get(int(r.attempt_id), (0, 0))
                out[int(r.attempt_id)] = (cpus + int(r.cpus), gpus + len(r.gpu_ids or ()))
        return out

    def usage_table(self, now: float, half_life: float) -> dict[tuple[str, str], float]:
        """Every association's usage decayed to `now`."""
        with self.db.begin(write=False) as conn:
            return {
                (r.account, r.user): fairshare.decay(
                    float(r.usage), float(r.decayed_at), now, half_life
                )
                for r in conn.execute(select(s.assoc_usage))
            }

    def job_users(self) -> set[tuple[str | None, str]]:
        """(account, user) of every pending or running job: associations fair share must rank
        even if they have no usage yet."""
        with self.db.begin(write=False) as conn:
            return {
                (r.account, r.user)
                for r in conn.execute(
                    select(s.jobs.c.account, s.jobs.c.user)
                    .where(s.jobs.c.state.in_(SUBMITTED))
                    .distinct()
                )
            }

    def submitted_counts(self, users: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Jobs pending, held or running, per (user, account, qos), for submit limits."""
        q = select(
            s.jobs.c.user,
            s.jobs.c.account,
            s.jobs.c.qos,
            func.count().label("n"),
        ).where(s.jobs.c.state.in_(SUBMITTED))
        if users is not None:
            q = q.where(s.jobs.c.user.in_(list(users)))
        q = q.group_by(s.jobs.c.user, s.jobs.c.account, s.jobs.c.qos)
        with self.db.begin(write=False) as conn:
            return [dict(r) for r in conn.execute(q).mappings()]
