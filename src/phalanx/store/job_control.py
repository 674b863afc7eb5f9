"""Job control: cancel, signal, hold, release, requeue, update a pending job, end one.

What users and operators ask of jobs (`scancel`, `scontrol hold/release/requeue/update`).
Each command is one transaction over the jobs named; a running attempt is asked to stop
(its nodes' generation bumped so their agents hear at once), never stopped here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    select,
    update,
)

from phalanx.domain.policy import (
    is_user_requeue,
    user_requeue_reason,
)
from phalanx.domain.states import (
    AttemptState,
    JobState,
)
from phalanx.errors import InvalidSpec
from phalanx.store import schema as s
from phalanx.store.prebuilt import update_where
from phalanx.store.sqlbits import JOB_SUMMARY as _JOB_SUMMARY
from phalanx.store.sqlbits import Fence
from phalanx.store.submission import HOLD_ADMIN, Submission, _hold_columns

# the changes `update_pending` also makes to running jobs: labels, not the allocation
_LABELS = frozenset({"name", "comment"})
# what a running job may change besides its labels: its array's throttle (Slurm lets
# ArrayTaskThrottle change while tasks run; it limits the tasks still to start)
_RUNNING_OK = _LABELS | {"array_limit"}


def _shown_labels(changes: dict[str, Any]) -> dict[str, Any]:
    """The label changes as the update's event shows them (a comment, not the whole spec)."""
    return {k: changes[k] for k in ("comment",) if k in changes}


class JobCommands(Submission):
    """Job control."""

    def cancel(
        self, job_ids: Sequence[int], actor: str, reason: str = "cancelled"
    ) -> dict[int, str]:
        """Cancel jobs: pending ones end at once; running ones are asked to stop."""
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                state = JobState(job["state"])
                text_reason = f"{reason} by {actor}"
                if state.terminal:
                    out[jid] = f"already {state.value}"
                elif state in (JobState.PENDING, JobState.HELD):
                    self._set_job_state(conn, job, JobState.CANCELLED, text_reason, actor=actor)
                    out[jid] = "cancelled"
                else:
                    self._stop_attempt(conn, job, f"cancel: {text_reason}", actor=actor)
                    out[jid] = "stopping"
        return out

    def requeue(
        self, job_ids: Sequence[int], actor: str, *, hold: bool = False, admin: bool = False
    ) -> dict[int, str]:
        """Requeue jobs as `scontrol requeue` does (`hold`: `requeuehold`, they wait HELD; an
        admin hold when `admin`, placed by an operator or admin, see `hold`).

        A running job is stopped with a user-requeue stop reason (no checkpoint signal, no
        retry spent) and its next attempt has restart count + 1; a finished job goes back to
        the queue at once, restart count + 1; a pending job is left as it is (or held). A job
        that said --no-requeue is refused, as Slurm refuses it. Results per job: text that
        starts with "requeued"/"held" on success, anything else says why not.
        """
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                state = JobState(job["state"])
                if not job["requeue"]:
                    out[jid] = "not requeue-able: the job was submitted with --no-requeue"
                elif state is JobState.PENDING:
                    if hold:
                        self._set_job_state(
                            conn,
                            job,
                            JobState.HELD,
                            f"held by {actor}",
                            actor=actor,
                            extra=_hold_columns(actor, admin),
                        )
                        out[jid] = "held"
                    else:
                        out[jid] = "pending: the job has not started, there is nothing to requeue"
                elif state is JobState.HELD:
                    out[jid] = "held" if hold else "held: release it instead (scontrol release)"
                elif state.terminal:
                    new = JobState.HELD if hold else JobState.PENDING
                    why = f"requeued{' and held' if hold else ''} by {actor} after {state.value}"
                    res = conn.execute(
                        update(s.jobs)
                        .where(s.jobs.c.id == jid, s.jobs.c.state == state.value)
                        .values(
                            state=new.value,
                            reason=why,
                            end_time=None,
                            eligible_time=None,
                            restart_count=s.jobs.c.restart_count + 1,
                            **_hold_columns(actor, admin, held=hold),
                        )
                    )
                    if res.rowcount == 1:
                        self._event(
                            conn,
                            "job.requeue",
                            f"{state.value} -> {new.value}: {why}",
                            job_id=jid,
                            actor=actor,
                            data={"from": state.value, "to": new.value, "why": "user"},
                        )
                    out[jid] = "requeued and held" if hold else "requeued"
                else:
                    stop = self._attempt_stop_reason(conn, job)
                    if stop is not None and not is_user_requeue(stop):
                        out[jid] = f"completing: the job is already stopping ({stop})"
                        continue
                    self._stop_attempt(
                        conn, job, user_requeue_reason(actor, hold=hold), actor=actor
                    )
                    if hold:  # the attempt's end puts it HELD: with these, set now
                        update_where(conn, s.jobs, {"id": jid}, _hold_columns(actor, admin))
                    out[jid] = "requeued and held" if hold else "requeued"
        return out

    def _attempt_stop_reason(self, conn: Connection, job: dict[str, Any]) -> str | None:
        """Why the job's current attempt is stopping (None: it is not being stopped)."""
        if job["attempt_id"] is None:
            return None
        row = conn.execute(
            select(s.attempts.c.state, s.attempts.c.stop_reason).where(
                s.attempts.c.id == job["attempt_id"]
            )
        ).first()
        if row is None or row.state != AttemptState.STOPPING.value:
            return None
        return str(row.stop_reason or "stopping")

    def update_pending(
        self, job_ids: Sequence[int], changes: dict[str, Any], actor: str, *, may_raise: bool
    ) -> dict[int, str]:
        """Change pending jobs (scontrol update JobId=...): `time_limit_s`, `nodes`,
        `partition`, `dependency` (text as --dependency), `priority`, `nice`, `exclude` (node
        names); the labels `name` and `comment` of pending and running jobs alike (scripts tag
        running jobs, as Slurm lets them), and `array_limit` of an array's pending and running
        tasks (ArrayTaskThrottle: 0 or None lifts it; a finished task has nothing to
        throttle). Other changes to a running job are refused (its allocation is made),
        and every change to a finished one; `may_raise` (operators) may also raise a time
        limit, as in Slurm where users may only lower theirs. Results per job: "updated" or
        why not."""
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            parts = {r["name"]: dict(r) for r in conn.execute(select(s.partitions)).mappings()}
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                state = JobState(job["state"])
                if "array_limit" in changes and job["array_job_id"] is None:
                    out[jid] = "not a job array: ArrayTaskThrottle applies to arrays"
                    continue
                if state.terminal:
                    if set(changes) == {"array_limit"}:  # a finished task of the array
                        out[jid] = "updated (finished: nothing to throttle)"
                        continue
                    out[jid] = f"{state.value.lower()}: a finished job cannot be changed"
                    continue
                pending = state in (JobState.PENDING, JobState.HELD)
                if not pending and not set(changes) <= _RUNNING_OK:
                    out[jid] = (
                        f"{state.value.lower()}: only a pending job can be changed here "
                        "(its allocation is already made)"
                    )
                    continue
                values: dict[str, Any] = {}
                if "name" in changes:
                    values["name"] = str(changes["name"])
                if "comment" in changes:  # kept in the spec, as submitted (--comment)
                    spec = dict(self._job_spec(conn, jid))
                    spec["comment"] = str(changes["comment"]) or None
                    values["spec"] = spec
                part_names = job["partitions"].split(",")
                if "partition" in changes:
                    name = str(changes["partition"])
                    if name not in parts:
                        raise InvalidSpec(f"partition {name} does not exist", field="partition")
                    part_names = [name]
                    values.update(partitions=name, partition=name)
                if "time_limit_s" in changes:
                    tl = changes["time_limit_s"]
                    old = job["time_limit_s"]
                    raising = tl is None or (old is not None and tl > old)
                    if raising and not may_raise:
                        out[jid] = "time limit: a user may only lower a job's time limit"
                        continue
                    maxes = [parts[p]["max_time_s"] for p in part_names if p in parts]
                    if tl is not None and any(m is not None and tl > m for m in maxes):
                        out[jid] = "time limit: longer than the partition's maximum time"
                        continue
                    values["time_limit_s"] = tl
                if "nodes" in changes:
                    values["nodes"] = int(changes["nodes"])
                if "dependency" in changes:
                    values["dependency"] = self._resolve_dependencies(conn, changes["dependency"])
                if "exclude" in changes:
                    values["exclude"] = list(changes["exclude"])
                if "array_limit" in changes:  # 0 or None: no limit
                    values["array_limit"] = int(changes["array_limit"] or 0) or None
                for key in ("priority", "nice"):  # the API checked who may set them
                    if key in changes:
                        values[key] = int(changes[key])
                if not values:
                    out[jid] = "nothing to change"
                    continue
                res = conn.execute(
                    update(s.jobs)
                    .where(s.jobs.c.id == jid, s.jobs.c.state == job["state"])
                    .values(**values)
                )
                if res.rowcount != 1:
                    out[jid] = "changed state meanwhile: try again"
                    continue
                shown = ", ".join(
                    f"{k}={v}"
                    for k, v in sorted({**values, **_shown_labels(changes)}.items())
                    if k != "spec"
                )
                self._event(
                    conn, "job.update", f"updated by {actor}: {shown}", job_id=jid, actor=actor
                )
                out[jid] = "updated"
        return out

    def signal(
        self, job_ids: Sequence[int], signum: int, target: str, actor: str
    ) -> dict[int, str]:
        """Record a signal for each job's running attempt (``scancel --signal``).

        The request is kept on the attempt (``attempts.signals``, in seq order) so that agents
        deliver it level-triggered, each seq once, even across controller or agent restarts.
        Outcomes: ``signalled``; ``pending`` (not running yet: Slurm refuses "Job is pending
        execution"); ``done`` (completing or ended: "already completing or completed");
        ``not found``.
        """
        out: dict[int, str] = {}
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                    continue
                state = JobState(job["state"])
                if state in (JobState.PENDING, JobState.HELD):
                    out[jid] = "pending"
                    continue
                att = (
                    conn.execute(
                        select(
                            s.attempts.c.id,
                            s.attempts.c.state,
                            s.attempts.c.signals,
                            s.attempts.c.nodes,
                        ).where(s.attempts.c.id == job["attempt_id"])
                    )
                    .mappings()
                    .first()
                )
                live = (AttemptState.STARTING.value, AttemptState.RUNNING.value)
                if state.terminal or att is None or att["state"] not in live:
                    out[jid] = "done"
                    continue
                signals = list(att["signals"] or [])
                seq = (signals[-1]["seq"] if signals else 0) + 1
                signals.append({"seq": seq, "signum": int(signum), "target": target})
                conn.execute(
                    update(s.attempts).where(s.attempts.c.id == att["id"]).values(signals=signals)
                )
                self._event(
                    conn,
                    "job.signal",
                    f"signal {signum} to the {target} of job {jid} by {actor}",
                    job_id=jid,
                    actor=actor,
                    data={"seq": seq, "signum": int(signum), "target": target},
                )
                self._bump_gen(conn, att["nodes"])  # wakes the nodes' long-polling heartbeats
                out[jid] = "signalled"
        return out

    def _job_spec(self, conn: Connection, job_id: int) -> dict[str, Any]:
        got = conn.execute(select(s.jobs.c.spec).where(s.jobs.c.id == job_id)).scalar_one()
        return dict(got or {})

    def _jobs_by_id(self, conn: Connection, job_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        q = select(*_JOB_SUMMARY).where(s.jobs.c.id.in_(list(job_ids)))
        return {r["id"]: dict(r) for r in conn.execute(q).mappings()}

    def _stop_attempt(
        self, conn: Connection, job: dict[str, Any], stop_reason: str, *, actor: str
    ) -> None:
        att = (
            conn.execute(select(s.attempts).where(s.attempts.c.id == job["attempt_id"]))
            .mappings()
            .first()
        )
        if att is None or att["state"] == AttemptState.ENDED.value:
            return
        if att["state"] != AttemptState.STOPPING.value or not att["stop_reason"]:
            conn.execute(
                update(s.attempts)
                .where(s.attempts.c.id == att["id"])
                .values(state=AttemptState.STOPPING.value, stop_reason=stop_reason)
            )
        if job["state"] != JobState.COMPLETING.value:
            self._set_job_state(conn, job, JobState.COMPLETING, stop_reason, actor=actor)
        self._bump_gen(conn, att["nodes"])

    def hold(self, job_ids: Sequence[int], actor: str, *, admin: bool = False) -> dict[int, str]:
        """Hold pending jobs. `admin` (the caller is an operator or admin): an admin hold,
        which only an operator or admin may release (Slurm's `scontrol hold`); otherwise a
        user hold. An admin holding a job its owner held makes it an admin hold."""
        return self._hold_release(job_ids, actor, hold=True, admin=admin)

    def release(self, job_ids: Sequence[int], actor: str, *, admin: bool = False) -> dict[int, str]:
        """Release held jobs; an admin hold only when `admin` (else the result says why)."""
        return self._hold_release(job_ids, actor, hold=False, admin=admin)

    def _hold_release(
        self, job_ids: Sequence[int], actor: str, *, hold: bool, admin: bool
    ) -> dict[int, str]:
        out: dict[int, str] = {}
        src, dst = (JobState.PENDING, JobState.HELD) if hold else (JobState.HELD, JobState.PENDING)
        with self.db.begin() as conn:
            found = self._jobs_by_id(conn, job_ids)
            for jid in job_ids:
                job = found.get(jid)
                if job is None:
                    out[jid] = "not found"
                elif hold and admin and job["state"] == JobState.HELD.value:
                    if job.get("hold_kind") == HOLD_ADMIN:
                        out[jid] = "held"  # already an admin hold
                        continue
                    # the owner's hold becomes an operator's: they no longer release it alone
                    n = update_where(
                        conn,
                        s.jobs,
                        {"id": jid, "state": JobState.HELD.value},
                        {"reason": f"held by {actor}", **_hold_columns(actor, True)},
                    )
                    if n == 1:
                        self._event(
                            conn,
                            "job.held",
                            f"user hold made an admin hold by {actor}",
                            job_id=jid,
                            actor=actor,
                            data={"hold_kind": HOLD_ADMIN},
                        )
                    out[jid] = "held"
                elif job["state"] != src.value:
                    out[jid] = f"not {src.value.lower()} (state {job['state']})"
                elif not hold and job.get("hold_kind") == HOLD_ADMIN and not admin:
                    out[jid] = (
                        f"held by {job.get('held_by') or 'an operator'} (an admin hold): only "
                        "an operator or admin may release it"
                    )
                else:
                    reason = f"held by {actor}" if hold else None
                    self._set_job_state(
                        conn, job, dst, reason, actor=actor, extra=_hold_columns(actor, admin, hold)
                    )
                    out[jid] = dst.value.lower() if hold else "released"
        return out

    def end_pending(self, job_id: int, state: JobState, reason: str, fence: Fence | None) -> bool:
        """End a pending job the scheduler found can never run (e.g. a dependency that failed)."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            job = (
                conn.execute(select(*_JOB_SUMMARY).where(s.jobs.c.id == job_id)).mappings().first()
            )
            if job is None or job["state"] != JobState.PENDING.value:
                return False
            return self._set_job_state(
                conn, dict(job), state, reason, term=fence.term if fence else None
            )
