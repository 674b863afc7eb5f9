"""Jobs: list and show them, act on them (cancel, signal, hold, release, requeue, update),
their events and why they wait or ended."""

from __future__ import annotations

import time
from typing import Any, cast

from fastapi import APIRouter, Depends, Query

from phalanx.auth.tokens import Identity
from phalanx.controller import access, explain
from phalanx.controller.api_context import ApiContext, caller, fast_json, user_may_release
from phalanx.controller.api_models import RefsIn, RequeueIn, SignalIn, UpdateIn
from phalanx.controller.views import allocation_view, job_view
from phalanx.domain import efficiency
from phalanx.domain.hostlist import expand_hostlist
from phalanx.domain.states import JobState
from phalanx.domain.values import parse_dependency, parse_duration
from phalanx.errors import Forbidden, InvalidSpec


def router(api: ApiContext) -> APIRouter:
    """The /v1/jobs routes but submission (submit_api.py) and steps (steps_api.py)."""
    ctl = api.ctl
    r = APIRouter()

    @r.get("/v1/jobs")
    def list_jobs(
        state: list[str] | None = Query(default=None),
        user: str | None = None,
        partition: str | None = None,
        name: str | None = None,
        node: str | None = None,
        job: list[str] | None = Query(default=None),
        limit: int = Query(default=10_000, ge=1, le=100_000),
        active_after: float | None = Query(
            default=None, description="only jobs not ended before this time (epoch seconds)"
        ),
        submitted_before: float | None = Query(
            default=None, description="only jobs submitted by this time (epoch seconds)"
        ),
        detail: bool = Query(
            default=False, description="each job's detail (command, workdir, account...)"
        ),
        ident: Identity = Depends(caller),
    ) -> dict[str, Any]:
        states = [x.strip().upper() for s in state or [] for x in s.split(",") if x.strip()]
        for x in states:
            if x not in JobState.__members__:
                raise InvalidSpec(
                    f"state: unknown job state {x!r}; states are {', '.join(JobState)}",
                    field="state",
                )
        ids = (
            ctl.store.resolve_refs([x for j in job or [] for x in j.split(",") if x])
            if job
            else None
        )
        rows = ctl.store.list_jobs(
            states=states,
            user=user,
            partition=partition,
            name=name,
            ids=ids,
            node=node,
            limit=limit,
            active_after=active_after,
            submitted_before=submitted_before,
            with_spec=detail,
        )
        # the annotation is the OpenAPI document's; the reply is made ready (fast_json): a
        # listing of thousands of jobs (squeue, sacct) spent most of its time in FastAPI's
        # encoder walking every value
        if not detail:
            return cast(dict[str, Any], fast_json({"jobs": [job_view(r) for r in rows]}))
        views = []
        steps = ctl.store.steps_of_jobs([int(r["id"]) for r in rows])
        last = ctl.store.attempts_by_id([int(r["attempt_id"]) for r in rows if r["attempt_id"]])
        now = time.time()
        for r in rows:
            view = job_view(r, detail=True)
            view["steps"] = steps.get(int(r["id"]), [])  # sacct's JOBID.N rows
            att = last.get(int(r["attempt_id"] or 0))
            # sacct's TotalCPU/MaxRSS: what the current or last attempt used
            view["usage"] = efficiency.job_usage([att] if att else [], now)
            views.append(access.redact(view) if api.private(ident, r) else view)
        return cast(dict[str, Any], fast_json({"jobs": views}))

    @r.get("/v1/jobs/{ref}")
    def show_job(ref: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        ids = api.one(ref)
        out = []
        for jid in ids:
            row = ctl.store.get_job(jid)
            if api.private(ident, row):
                view = job_view(row, detail=True)
                view["attempts"] = ctl.store.attempts_of(jid)
                out.append(access.redact(view))
                continue
            view = job_view(row, detail=True)
            view["attempts"] = ctl.store.attempts_of(jid)
            view.update(allocation_view(view["attempts"], time.time()))
            view["usage"] = efficiency.job_usage(view["attempts"], time.time())
            view["retry"] = ctl.store.policy.job_rules(row["spec"]).as_dict()
            view["steps"] = ctl.store.steps_of(jid)
            view["progress"] = next(
                (a["progress"] for a in reversed(view["attempts"]) if a.get("progress")), None
            )
            if view["checkpoint_spec"]:
                # a running job's interval counts the nodes it runs on (an elastic job may have
                # shrunk), as the one its agents are sent does
                running = row["state"] == "RUNNING" and row["nodelist_run"]
                sized = {**row, "attempt_nodes": row["nodelist_run"]} if running else row
                view["checkpoint_interval"] = ctl.checkpoint_interval(sized).as_dict()
            out.append(view)
        return {"jobs": out}

    @r.post("/v1/jobs/cancel")
    def cancel(body: RefsIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        return api.bulk(
            body.jobs, ident, "cancel", ctl.store.cancel, ident.actor, body.reason or "cancelled"
        )

    @r.post("/v1/jobs/signal")
    def signal(body: SignalIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        return api.bulk(
            body.jobs, ident, "signal", ctl.store.signal, body.signal, body.target, ident.actor
        )

    @r.post("/v1/jobs/hold")
    def hold(body: RefsIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """Hold pending jobs. An operator's or admin's hold is an admin hold, which only an
        operator or admin may release (Slurm's `scontrol hold`); a user's is a user hold."""
        admin = access.may_see_all(ident)
        return api.bulk(body.jobs, ident, "hold", ctl.store.hold, ident.actor, admin=admin)

    @r.post("/v1/jobs/release")
    def release(body: RefsIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """Release held jobs: their owner a user hold, operators and admins any hold."""
        admin = access.may_see_all(ident)
        return api.bulk(
            body.jobs,
            ident,
            "release",
            ctl.store.release,
            ident.actor,
            admin=admin,
            check=None if admin else user_may_release,
        )

    @r.post("/v1/jobs/requeue")
    def requeue(body: RequeueIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """scontrol requeue/requeuehold: running jobs stop and come back (restart count + 1),
        finished ones go back to the queue; a job may requeue itself with its own identity."""
        return api.bulk(
            body.jobs,
            ident,
            "requeue",
            ctl.store.requeue,
            ident.actor,
            hold=body.hold,
            admin=access.may_see_all(ident),  # an operator's requeuehold is an admin hold
        )

    @r.post("/v1/jobs/update")
    def update_jobs(body: UpdateIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """scontrol update JobId=...: change pending jobs (time limit, nodes, partition,
        dependency, priority, nice) and the labels of pending and running ones (name,
        comment). Users may only lower a time limit; operators may raise it. A priority above
        0 or a negative nice: operators and admins, as on submission."""
        changes: dict[str, Any] = {}
        if body.time_limit is not None:
            try:
                changes["time_limit_s"] = parse_duration(body.time_limit)
            except ValueError as e:
                raise InvalidSpec(f"time_limit: {e}", field="time_limit") from None
        if body.nodes is not None:
            changes["nodes"] = body.nodes
        if body.partition is not None:
            changes["partition"] = body.partition
        if body.dependency is not None:
            try:
                changes["dependency"] = (
                    parse_dependency(body.dependency) if body.dependency.strip() else []
                )
            except ValueError as e:
                raise InvalidSpec(f"dependency: {e}", field="dependency") from None
        api.standing_allowed(ident, body.priority, body.nice)  # the submission's rule, the same
        if body.priority is not None:
            changes["priority"] = body.priority
        if body.nice is not None:
            changes["nice"] = body.nice
        if body.exclude is not None:
            try:
                changes["exclude"] = expand_hostlist(body.exclude) if body.exclude.strip() else []
            except ValueError as e:
                raise InvalidSpec(f"exclude: {e}", field="exclude") from None
        if body.array_throttle is not None:
            changes["array_limit"] = body.array_throttle
        if body.name is not None:
            changes["name"] = body.name
        if body.comment is not None:
            changes["comment"] = body.comment
        if not changes:
            raise InvalidSpec(
                "nothing to change: give time_limit, nodes, partition, dependency, priority, "
                "nice, exclude, array_throttle, name or comment"
            )
        return api.bulk(
            body.jobs,
            ident,
            "update",
            ctl.store.update_pending,
            changes,
            ident.actor,
            may_raise=access.may_see_all(ident),
        )

    @r.get("/v1/jobs/{ref}/events")
    def job_events(ref: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        out = []
        for jid in api.one(ref):
            row = ctl.store.get_job(jid)
            if api.private(ident, row):
                raise Forbidden(
                    f"the events of job {jid} are private to {row['user']} (auth.private_data)",
                    job=str(jid),
                    owner=row["user"],
                )
            out.extend(ctl.store.events(job_id=jid))
        out.sort(key=lambda e: e["id"])
        return {"events": out}

    @r.get("/v1/jobs/{ref}/explain")
    def explain_job(ref: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """Why the job waits (pending, held) or why it ended or was requeued, in sentences:
        {"job", "state", "summary", "lines"} (docs/explain.md). An array names one task."""
        ids = api.one(ref)
        if ref.strip().isdecimal() and int(ref) in ids:
            ids = [int(ref)]
        if len(ids) != 1:
            raise InvalidSpec(f"{ref} names {len(ids)} jobs: explain one array task (e.g. {ref}_0)")
        row = ctl.store.get_job(ids[0])
        if api.private(ident, row):
            raise Forbidden(
                f"why job {explain.display_id(row)} waits or ended is private to "
                f"{row['user']} (auth.private_data)",
                job=str(ids[0]),
                owner=row["user"],
            )
        return explain.explain_job(
            ctl.store,
            row,
            time.time(),
            ctl.plan_options,
            # the nodes' drains around its attempts: others' launch errors left out
            redact=lambda evs: api.events_for(ident, evs),
            overrun=ctl.timing.overrun_s(),
        ).as_dict()

    return r
