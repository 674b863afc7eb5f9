"""Submitting jobs: POST /v1/jobs (sbatch's hot path, with its fast path past FastAPI) and
POST /v1/jobs/batch."""

from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from phalanx.auth.tokens import Identity
from phalanx.controller import access
from phalanx.controller.api_context import ApiContext, caller, error_reply, fast_json
from phalanx.controller.api_models import BatchIn, SubmitOut
from phalanx.controller.fastpath import FastRoute
from phalanx.domain.spec import JobSpec
from phalanx.errors import InvalidSpec, PhalanxError


def router(api: ApiContext) -> APIRouter:
    """POST /v1/jobs and /v1/jobs/batch."""
    ctl = api.ctl
    r = APIRouter()

    @r.post("/v1/jobs", status_code=201, response_model=SubmitOut)
    async def submit(
        spec: JobSpec,
        request: Request,
        test_only: bool = Query(
            default=False, description="validate fully (sbatch --test-only) but store nothing"
        ),
    ) -> JSONResponse:
        """Submit one job (or one array); the reply has its id (and every array task's)."""
        # The hot path of `sbatch`: the job is stored by the group-commit writer thread
        # (controller/submitq.py) with the other requests in flight, and the reply is built
        # here, not re-validated against `SubmitOut` (a pydantic pass). The caller is read
        # from the request (set by `authorize`), which spares FastAPI a dependency.
        user = api.submitter(request.state.identity, [spec])
        api.nice_allowed(request.state.identity, [spec])
        if test_only:
            await run_in_threadpool(lambda: ctl.submit([spec], user, validate_only=True))
            body: dict[str, Any] = {
                "job_id": None,
                "job_ids": [],
                "array": bool(spec.array),
                "test_only": True,
            }
            return JSONResponse(body, status_code=201)
        ids = await ctl.submitq.submit(spec, user)  # with the other requests in flight
        body = {"job_id": ids[0], "job_ids": ids, "array": bool(spec.array)}
        return JSONResponse(body, status_code=201)

    @r.post("/v1/jobs/batch", status_code=201)
    def submit_batch(body: BatchIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        user = api.submitter(ident, body.jobs)
        api.nice_allowed(ident, body.jobs)
        ids = ctl.submit(body.jobs, user)
        # the annotation is the OpenAPI document's; the reply is made ready (_fast_json)
        return cast(
            dict[str, Any],
            fast_json({"jobs": [{"job_id": i[0], "job_ids": i} for i in ids]}, 201),
        )

    return r


def fast_route(api: ApiContext) -> FastRoute:
    """POST /v1/jobs for controller/fastpath.py."""
    ctl = api.ctl
    submit_rule = access.RULES[("POST", "/v1/jobs")]

    async def fast_submit(
        body: bytes, authorization: str | None, _params: dict[str, str]
    ) -> Response | None:
        """POST /v1/jobs without FastAPI (controller/fastpath.py): the route's steps, in its
        order, for the common case; None, before anything has changed, for any other case
        (the route then handles the request from the start and answers as it always has)."""
        ok = api.admitted(body, authorization, submit_rule, {}, JobSpec)
        if ok is None:
            return None
        ident, spec = ok
        try:  # from here on the route's own steps, side effects included
            access.throttle(api.api_buckets, ident, api.limits.exempt_roles, 1, "API call")
            if b"\\u0000" in body:
                raise InvalidSpec("text in a request may not contain NUL characters (\\u0000)")
            user = api.submitter(ident, [spec])
            api.nice_allowed(ident, [spec])
            ids = await ctl.submitq.submit(spec, user)
        except PhalanxError as e:
            return error_reply(e)
        reply = {"job_id": ids[0], "job_ids": ids, "array": bool(spec.array)}
        return fast_json(reply, 201)

    return FastRoute("/v1/jobs", fast_submit)
