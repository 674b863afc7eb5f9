"""What the REST API's routers share: the controller, the credential checks and rate limits,
and the rules several routes apply (who may submit what, who reads which job's private part,
the owner check of bulk job commands). One object, built once by `api.create_app` and handed
to each router factory (`jobs_api.router(api)`, ...), in place of the closure every route
used to live in."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from phalanx.auth.keys import KeySet
from phalanx.auth.tokens import Identity, Verifier
from phalanx.controller import access
from phalanx.controller.api_models import MAX_ID
from phalanx.controller.runtime import Controller
from phalanx.controller.views import job_view
from phalanx.domain.spec import JobSpec
from phalanx.domain.values import parse_array
from phalanx.errors import Forbidden, InvalidSpec, NotFound, PhalanxError

_M = TypeVar("_M", bound=BaseModel)  # a fast path's body model

# fields of a job body that would name someone else: a job always runs as its submitter
IDENTITY_FIELDS = ("user", "uid", "gid", "group")


def fast_json(body: dict[str, Any], status_code: int = 200) -> Response:
    """The body as a ready JSON response, skipping FastAPI's jsonable_encoder (a walk of every
    value in Python: the largest cost of a heartbeat reply that carries launch specs), and
    encoded by orjson (the standard encoder Starlette's JSONResponse uses took 2.4% of a busy
    controller's held GIL, nearly all on heartbeat replies). A value orjson cannot take (an
    integer past 64 bits, a type it does not know) goes through FastAPI's encoder, as a route's
    returned value would."""
    try:
        content = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return JSONResponse(jsonable_encoder(body), status_code=status_code)
    return Response(content, status_code=status_code, media_type="application/json")


def error_reply(e: PhalanxError) -> JSONResponse:
    """An error as the API answers it: {"error": {...}} with its status and headers."""
    headers = {}
    if e.details.get("retry_after") is not None:
        headers["Retry-After"] = str(e.details["retry_after"])
    if e.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": e.to_body()}, status_code=e.http_status, headers=headers)


def job_count(spec: JobSpec) -> int:
    """Jobs a submission puts in the queue: 1, or an array's tasks (an invalid --array is
    refused here, before any rate-limit token is taken)."""
    if not spec.array:
        return 1
    try:
        indices, _limit = parse_array(spec.array)
    except ValueError as e:
        raise InvalidSpec(f"array: {e}", field="array") from None
    return len(indices)


def verifier_for(ctl: Controller, keys: KeySet) -> Verifier:
    auth = ctl.config.auth
    return Verifier(
        keys,
        cluster=ctl.config.cluster.name,
        clock_skew=auth.clock_skew,
        admins=auth.admins,
        operators=auth.operators,
        idp_jwks=Path(auth.jwks_file) if auth.jwks_file else None,
        idp_audience=auth.idp_audience,
        idp_issuer=auth.idp_issuer,
        user_claim=auth.user_claim,
        role_claim=auth.role_claim,
    )


async def caller(request: Request) -> Identity:
    """The route's caller, verified by `api.Authorize` (the app's one dependency).

    async: a plain `def` dependency costs every route a hop to the thread pool and back."""
    ident: Identity = request.state.identity
    return ident


def user_may_release(views: list[dict[str, Any]]) -> None:
    """A user releases only user holds (`scontrol release` of an admin hold: 403)."""
    for v in views:
        if v["hold_kind"] == "admin":
            raise Forbidden(
                f"job {v['job_id']} was held by {v['held_by'] or 'an operator'}, an "
                "operator or admin (an admin hold, as Slurm's scontrol hold): only an "
                "operator or admin may release it; ask them to",
                job=str(v["job_id"]),
                held_by=v["held_by"],
            )


class ApiContext:
    """The controller, its credential verifier and rate limits, and the rules routes share."""

    def __init__(self, ctl: Controller, keys: KeySet) -> None:
        self.ctl = ctl
        self.keys = keys
        self.verifier = verifier_for(ctl, keys)
        self.limits = ctl.config.limits
        self.api_buckets = access.TokenBuckets(self.limits.api_rate, self.limits.api_burst)
        self.submit_buckets = access.TokenBuckets(self.limits.submit_rate, self.limits.submit_burst)

    # ------------------------------------------------------------------ submitting
    def submitter(self, ident: Identity, specs: list[JobSpec]) -> str:
        """The user the jobs run as, once the submission rate limit has taken what they cost:
        a job each, an array each of its tasks (they are as many jobs in the queue)."""
        if ident.user == "root" and not self.ctl.config.auth.allow_root_jobs:
            raise Forbidden(
                "jobs would run as root, which this cluster does not allow "
                "(auth.allow_root_jobs = false): submit as a normal user"
            )
        n = 0
        for i, sp in enumerate(specs):
            try:
                n += job_count(sp)
            except InvalidSpec as e:
                if len(specs) > 1:  # as the batch's own validation names the item
                    e.message = f"job {i}: {e.message}"
                    e.details["index"] = i
                raise
        access.throttle(
            self.submit_buckets,
            ident,
            self.limits.exempt_roles,
            n,
            "job submission",
            setting="submit",
        )
        return ident.user

    def standing_allowed(self, ident: Identity, priority: int | None, nice: int | None) -> None:
        """The one rule for a job's place in the queue, on submission and on update: a user
        may lower their own jobs' standing (--nice >= 0, --priority <= 0) but only operators
        and admins may raise a job above others (--priority > 0, the queue's first sort key;
        a negative --nice), as Slurm keeps both for its operators (docs/security.md)."""
        if access.may_see_all(ident):
            return
        if priority is not None and priority > 0:
            raise Forbidden(
                f"--priority={priority} puts a job ahead of every other and needs the operator "
                f"or admin role; {ident.user} is a {ident.role}: leave it out (or give a "
                "value of 0 or less to go behind others)",
                field="priority",
            )
        if nice is not None and nice < 0:
            raise Forbidden(
                f"--nice={nice}: a negative --nice raises priority and needs the operator or "
                f"admin role; {ident.user} is a {ident.role}: use --nice=0 or more",
                field="nice",
            )

    def nice_allowed(self, ident: Identity, specs: list[JobSpec]) -> None:
        for sp in specs:
            self.standing_allowed(ident, sp.priority, sp.nice)

    def admitted(
        self,
        body: bytes,
        authorization: str | None,
        rule: access.Rule,
        params: dict[str, str],
        model: type[_M],
    ) -> tuple[Identity, _M] | None:
        """The fast paths' common checks: a JSON object, a credential the route's rule
        admits, a body that validates as `model`; None (nothing changed) otherwise."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # the guard refused deep bodies; still: the route's
            return None
        if not isinstance(data, dict) or not authorization:
            return None
        try:
            ident = access.authenticate(self.verifier, authorization)
            access.decide(rule, ident, params)
            valid = model.model_validate(data)
        except (PhalanxError, ValidationError):
            return None
        assert ident is not None
        return ident, valid

    # ------------------------------------------------------------------ reading jobs
    def one(self, ref: str) -> list[int]:
        """The jobs `ref` names (an array: its tasks); NotFound if none."""
        ids = self.ctl.store.resolve_refs([ref])
        if not ids:
            raise NotFound(f"job {ref} does not exist", job=ref)
        return ids

    def private(self, ident: Identity, row: dict[str, Any]) -> bool:
        """Whether `ident` sees only the public part of this job (auth.private_data)."""
        return (
            self.ctl.config.auth.private_data
            and row["user"] != ident.user
            and not access.may_see_all(ident)
        )

    def sees_all(self, ident: Identity) -> bool:
        """Whether `ident` reads every job's private fields (auth.private_data)."""
        return not self.ctl.config.auth.private_data or access.may_see_all(ident)

    def node_for(self, ident: Identity, view: dict[str, Any]) -> dict[str, Any]:
        """A node's view as `ident` may read it: a user under private_data does not get the
        last launch error of a Phalanx drain (another user's job's)."""
        if not self.sees_all(ident):
            view["drain_reason"] = access.redact_drain_reason(
                view["drain_reason"], view["drain_by"]
            )
        return view

    def events_for(self, ident: Identity, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Node events as `ident` may read them: under private_data a user reads the events
        of others' jobs without their message and data (access.redact_event)."""
        if self.sees_all(ident):
            return events
        ids = sorted({int(e["job_id"]) for e in events if e.get("job_id") is not None})
        store = self.ctl.store
        owners = {int(r["id"]): str(r["user"]) for r in store.list_jobs(ids=ids)} if ids else {}
        return [
            access.redact_event(
                e, owners.get(int(e["job_id"])) if e.get("job_id") else None, ident.user
            )
            for e in events
        ]

    # ------------------------------------------------------------------ acting on jobs
    def bulk(
        self,
        refs: list[str],
        ident: Identity,
        what: str,
        fn: Any,
        *args: Any,
        check: Any = None,
        **kw: Any,
    ) -> dict[str, Any]:
        """A job command on every job `refs` name (scancel, scontrol hold...): the caller
        must own them all (or be an operator), `check` may refuse first; results keyed by the
        ids users type."""
        ctl = self.ctl
        ids = ctl.store.resolve_refs(refs)
        if not ids:
            raise NotFound(f"no such job: {', '.join(refs)}", jobs=refs)
        views = [job_view(r) for r in ctl.store.list_jobs(ids=ids)]
        access.check_owner(ident, views, what)
        if check is not None:
            check(views)  # the route's own refusal (403), before anything is changed
        result = fn(ids, *args, **kw)
        ctl.kick()
        # keyed by the ids users type (123, or 123_4 for an array task), never internal ids
        shown = {v["id"]: v["job_id"] for v in views}
        return {"results": {shown.get(k, str(k)): v for k, v in result.items()}}

    def own_job(self, ref: str, ident: Identity, what: str) -> dict[str, Any]:
        """The one job a step belongs to. A plain number is that job itself even when it is
        also an array's id: srun sends $SLURM_JOB_ID, and the first task of an array has the
        array's id as its own (as in Slurm), so `123` must not mean the whole array here."""
        store = self.ctl.store
        row: dict[str, Any] | None = None
        if ref.strip().isdecimal() and int(ref) <= MAX_ID:
            # srun's own case (every step of a loop): the job itself, one read less
            with contextlib.suppress(NotFound):
                row = store.get_job(int(ref))
        if row is None:
            ids = self.one(ref)
            if len(ids) != 1:
                raise InvalidSpec(f"{ref} names {len(ids)} jobs: steps belong to one job")
            row = store.get_job(ids[0])
        access.check_owner(ident, [job_view(row)], what)
        return row
