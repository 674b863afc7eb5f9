"""The REST API (`/v1`), served by every controller. Errors mirror `phalanx.errors`:

{"error": {"code": "invalid_spec", "message": "nodes: ...", "details": {...}}}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

import orjson
from fastapi import Depends, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.requests import HTTPConnection
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from phalanx import __version__
from phalanx.auth.keys import KeySet
from phalanx.auth.tokens import Identity, Verifier, mint_token
from phalanx.controller import (
    access,
    dashboard,
    docs_ui,
    explaining,
    guard,
    maint_api,
    metrics,
    share_api,
)
from phalanx.controller.fastpath import FastPaths, FastRoute
from phalanx.controller.launch import job_layout
from phalanx.controller.runtime import Controller
from phalanx.controller.views import allocation_view, job_view, node_view
from phalanx.domain import checkpointing, efficiency
from phalanx.domain import spec as specs
from phalanx.domain.spec import JobSpec
from phalanx.domain.states import JobState
from phalanx.domain.steps import StepRequest
from phalanx.domain.text import PlainText
from phalanx.domain.values import (
    format_duration,
    parse_array,
    parse_dependency,
    parse_duration,
)
from phalanx.errors import Forbidden, InvalidSpec, NotFound, PhalanxError
from phalanx.store.metrics import CHECKPOINT_BUCKETS
from phalanx.store.steps import StepReport
from phalanx.store.store import TaskReport

MAX_BATCH = 10_000
MAX_ID = 2**63 - 1  # ids and counters go into 64-bit INTEGER columns
MAX_EVENTS = 10_000  # events in one reply of /v1/events (page on with since=)
HEARTBEAT_PATH = "/v1/agents/{node}/heartbeat"
_M = TypeVar("_M", bound=BaseModel)  # a fast path's body model


class BatchIn(BaseModel):
    jobs: list[JobSpec] = Field(min_length=1, max_length=MAX_BATCH)


class SubmitOut(BaseModel):
    """The reply to POST /v1/jobs (documents it; the route builds the JSON itself)."""

    job_id: int | None = Field(
        description="the job's id (an array: its first task's); null with test_only"
    )
    job_ids: list[int] = Field(description="every id the submission created (array tasks)")
    array: bool
    test_only: bool = Field(default=False, description="validated only, nothing stored")


class RefsIn(BaseModel):
    jobs: list[Annotated[str, Field(max_length=64)]] = Field(min_length=1, max_length=MAX_BATCH)
    reason: PlainText | None = Field(default=None, max_length=1024)


class SignalIn(BaseModel):
    jobs: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    signal: int = Field(ge=1, le=64, description="signal number")
    target: str = Field(
        default="steps",
        pattern="^(steps|batch|full)$",
        description="steps: the job's steps (scancel --signal); batch: the batch shell only "
        "(--batch); full: the batch shell, its children and all steps (--full)",
    )


class RequeueIn(BaseModel):
    jobs: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    hold: bool = Field(default=False, description="the requeued jobs wait HELD (requeuehold)")


class UpdateIn(BaseModel):
    """Changes to pending jobs (scontrol update JobId=...); fields left out stay as they are."""

    model_config = {"extra": "forbid"}

    jobs: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    time_limit: str | None = Field(default=None, max_length=64, description="Slurm time form")
    nodes: int | None = Field(default=None, ge=1, le=1_000_000)
    partition: PlainText | None = Field(default=None, min_length=1, max_length=64)
    dependency: PlainText | None = Field(
        default=None, max_length=specs.MAX_DEPENDENCY, description="'' clears it"
    )
    priority: int | None = Field(
        default=None,
        ge=-1_000_000,
        le=1_000_000,
        description="--priority, the queue's first sort key: above 0 for operators and admins",
    )
    nice: int | None = Field(
        default=None,
        ge=-10_000_000,
        le=10_000_000,
        description="--nice: below 0 for operators and admins",
    )


class TokenIn(BaseModel):
    user: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")
    role: str = Field(default="user", pattern="^(admin|operator|user)$")
    lifetime_s: float = Field(default=30 * 86400.0, gt=0)


class DrainIn(BaseModel):
    reason: PlainText = Field(min_length=1, max_length=1024)
    now: bool = Field(
        default=False, description="also checkpoint-signal and requeue the node's requeue-able jobs"
    )


class RegisterIn(BaseModel):
    cpus: int = Field(ge=1, le=1_000_000)
    mem_mb: int = Field(ge=1, le=2**40)
    gpus: list[tuple[int, str]] = Field(default_factory=list)
    features: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list, max_length=1024
    )
    addr: str | None = Field(default=None, max_length=256)
    boot_id: str | None = Field(default=None, max_length=256)
    version: str | None = Field(default=None, max_length=256)
    health: dict[str, Any] | None = None  # the preflight's result
    # place in the topology tree, {level: domain} (phalanx agent --topology); absent: none
    topology: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")],
        Annotated[str, Field(min_length=1, max_length=128)],
    ] = Field(default_factory=dict, max_length=16)


class ReportIn(BaseModel):
    attempt_id: int = Field(ge=0, le=MAX_ID)
    token: str = Field(max_length=256)
    state: str = Field(pattern="^(starting|running|exited|lost)$")
    started_at: float | None = None
    exit: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None  # the job's checkpoint marker (docs/checkpoints.md)
    progress: dict[str, Any] | None = None  # the job's progress file
    signals_done: int | None = Field(default=None, ge=0, le=MAX_ID)  # highest seq delivered


class StepIn(BaseModel):
    """`srun` inside a job: what to run, how to lay it out, where its srun listens."""

    model_config = ConfigDict(extra="forbid")

    argv: Annotated[list[str], AfterValidator(specs.check_argv)] = Field(
        min_length=1, max_length=4096
    )
    env: Annotated[dict[str, str], AfterValidator(specs.check_env)] = Field(default_factory=dict)
    cwd: str = Field(default="/", max_length=4096)
    name: PlainText | None = Field(default=None, max_length=256)
    nodes: int | None = Field(default=None, ge=1, le=100_000)
    ntasks: int | None = Field(default=None, ge=1, le=1_000_000)
    ntasks_per_node: int | None = Field(default=None, ge=1, le=100_000)
    cpus_per_task: int = Field(default=1, ge=1, le=100_000)
    gpus_per_task: int | None = Field(default=None, ge=0, le=1024)
    gpus_per_node: int | None = Field(default=None, ge=0, le=1024)
    nodelist: list[str] = Field(default_factory=list, max_length=100_000)
    output: str | None = Field(default=None, max_length=4096)
    error: str | None = Field(default=None, max_length=4096)
    label: bool = False
    open_mode: Literal["append", "truncate"] | None = Field(
        default=None, description="how -o/-e files open; the job's --open-mode if absent"
    )
    host: str = Field(max_length=256, description="where srun listens for its tasks' streams")
    port: int = Field(ge=1, le=65535)
    cookie: str = Field(min_length=16, max_length=128)
    pty: bool = Field(
        default=False, description="srun --pty: task 0 on a pseudo-terminal relayed to srun"
    )
    direct: bool = Field(
        default=False,
        description="srun hands each node its launch itself (the reply's `launch`: a signed "
        "credential and the agent's address per node) when the cluster allows it "
        "(steps.direct); nodes not in `launch` are woken here",
    )


class StepWakeIn(BaseModel):
    nodes: list[str] = Field(min_length=1, max_length=100_000)


class StepSignalIn(BaseModel):
    step_id: int | None = Field(default=None, ge=0, le=2**31, description="all steps if absent")
    signal: int = Field(ge=1, le=64)


class StepCancelIn(BaseModel):
    step_id: int | None = Field(default=None, ge=0, le=2**31, description="all steps if absent")
    reason: PlainText | None = Field(default=None, max_length=1024)


class StepReportIn(BaseModel):
    attempt_id: int = Field(ge=0, le=2**62)
    step_id: int = Field(ge=0, le=2**31)
    token: str = Field(max_length=64)
    state: Literal["starting", "running", "exited", "lost"]
    started_at: float | None = None
    exits: list[dict[str, Any]] = Field(default_factory=list, max_length=4096)


class HeartbeatIn(BaseModel):
    tasks: list[ReportIn] = Field(default_factory=list, max_length=100_000)
    steps: list[StepReportIn] = Field(default_factory=list, max_length=100_000)
    taken_at: float | None = None
    wait: float = Field(default=0.0, ge=0, le=60)
    health: dict[str, Any] | None = None
    steps_at: str | None = Field(
        default=None, max_length=300, description="host:port the agent takes step launches at"
    )


def _fast_json(body: dict[str, Any], status_code: int = 200) -> Response:
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


def _error(e: PhalanxError) -> JSONResponse:
    headers = {}
    if e.details.get("retry_after") is not None:
        headers["Retry-After"] = str(e.details["retry_after"])
    if e.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": e.to_body()}, status_code=e.http_status, headers=headers)


# fields of a job body that would name someone else: a job always runs as its submitter
_IDENTITY_FIELDS = ("user", "uid", "gid", "group")


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


def create_app(ctl: Controller, keys: KeySet) -> FastAPI:
    """The API of one controller; `keys` (the cluster key set) verifies credentials."""
    verifier = verifier_for(ctl, keys)
    limits = ctl.config.limits
    api_buckets = access.TokenBuckets(limits.api_rate, limits.api_burst)
    submit_buckets = access.TokenBuckets(limits.submit_rate, limits.submit_burst)

    class Authorize(HTTPBearer):
        """Every route: verify the caller, apply the route's rule, count the call.

        An HTTPBearer so that the OpenAPI document declares the bearer scheme, but the header is
        parsed by access.bearer, which says what is wrong with a malformed one (HTTPBearer would
        silently drop it). One dependency, not a bearer scheme under an `authorize` function:
        FastAPI's dependency solving costs every call more than the check itself."""

        async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
            assert isinstance(request, Request)  # HTTP routes only: FastAPI passes the Request
            scope = request.scope
            route = scope.get("route")
            key = (request.method, getattr(route, "path", ""))
            rule = access.RULES.get(key)
            if rule is not None and rule.level == access.PUBLIC:
                return None
            ident = scope.get(guard.IDENTITY)  # verified by the guard, before the body
            if ident is None:
                header = request.headers.get("authorization")
                ident = access.authenticate(verifier, header) if header else None
            access.decide(rule, ident, dict(request.path_params))
            assert ident is not None
            access.throttle(api_buckets, ident, limits.exempt_roles, 1, "API call")
            request.state.identity = ident
            # no store keeps a NUL in text (PostgreSQL refuses it): say so before anything is
            # done (scope["path"] is the decoded path that request.url.path is rebuilt from)
            raw = bytes(scope.get("raw_path") or b"") + scope.get("query_string", b"")
            if (
                b"%00" in raw
                or "\x00" in scope.get("root_path", "") + scope["path"]
                or (
                    request.method in ("POST", "PUT", "PATCH")
                    and b"\\u0000" in await request.body()
                )
            ):
                raise InvalidSpec("text in a request may not contain NUL characters (\\u0000)")
            return None

    authorize = Authorize(
        auto_error=False,
        scheme_name="HTTPBearer",  # the OpenAPI name it had as a plain HTTPBearer
        description="a Phalanx credential (JWT)",
    )

    async def caller(request: Request) -> Identity:
        # async: a plain `def` dependency costs every route a hop to the thread pool and back
        ident: Identity = request.state.identity
        return ident

    def submitter(ident: Identity, specs: list[JobSpec]) -> str:
        """The user the jobs run as, once the submission rate limit has taken what they cost:
        a job each, an array each of its tasks (they are as many jobs in the queue)."""
        if ident.user == "root" and not ctl.config.auth.allow_root_jobs:
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
            submit_buckets, ident, limits.exempt_roles, n, "job submission", setting="submit"
        )
        return ident.user

    def standing_allowed(ident: Identity, priority: int | None, nice: int | None) -> None:
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

    def nice_allowed(ident: Identity, specs: list[JobSpec]) -> None:
        for sp in specs:
            standing_allowed(ident, sp.priority, sp.nice)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # long-polls are woken from the controller's threads through this loop
        ctl.waiters.bind(asyncio.get_running_loop())
        yield

    app = FastAPI(
        title="Phalanx",
        version=__version__,
        # the OpenAPI document and the documentation pages are routes of ours (docs_ui.py):
        # in the authorization table, and served without a CDN
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        dependencies=[Depends(authorize)],
    )

    @app.exception_handler(PhalanxError)
    async def _phalanx_error(_req: Request, e: PhalanxError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, e: RequestValidationError) -> JSONResponse:
        for err in e.errors():
            loc = err.get("loc") or ()
            if err.get("type") == "extra_forbidden" and loc and loc[-1] in _IDENTITY_FIELDS:
                return _error(
                    Forbidden(
                        f"a job runs as the user who submits it; the field {loc[-1]!r} cannot "
                        "name another user or id",
                        field=str(loc[-1]),
                    )
                )
        msgs = []
        for err in e.errors():
            loc = [str(x) for x in err["loc"] if x not in ("body",)]
            msg = str(err["msg"]).removeprefix("Value error, ")  # pydantic's, for our checks
            msgs.append(f"{'.'.join(loc) or 'request'}: {msg}")
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return _error(InvalidSpec("; ".join(msgs), field=".".join(loc)))

    # ---------------------------------------------------------------- health
    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "version": __version__, **ctl.status()}

    @app.get("/healthz/live")
    async def live() -> JSONResponse:
        """For a supervisor or load balancer: 503 when this controller's loops are stuck."""
        stuck = ctl.stuck_loops()
        body = {"live": not stuck, "controller": ctl.cid, "stuck": stuck}
        return JSONResponse(body, status_code=503 if stuck else 200)

    @app.get("/healthz/ready")
    def ready() -> JSONResponse:
        """For a load balancer: 503 when this controller cannot serve (store or loops down)."""
        problems = [f"loop {name} has not run recently" for name in ctl.stuck_loops()]
        try:
            ctl.store.db_time()
        except PhalanxError as e:
            problems.append(e.message)
        body = {"ready": not problems, "controller": ctl.cid, "problems": problems}
        return JSONResponse(body, status_code=503 if problems else 200)

    cluster_figures = metrics.ClusterMetrics(
        lambda: ctl.store.metrics_figures(checkpoint_bounds=CHECKPOINT_BUCKETS),
        ctl.config.metrics,
        intervals=ctl.metrics_intervals,
    )
    cluster_metrics = CollectorRegistry(auto_describe=False)
    cluster_metrics.register(cluster_figures)
    user_metrics = CollectorRegistry(auto_describe=False)
    user_metrics.register(metrics.UserMetrics(cluster_figures))

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus_metrics(request: Request) -> Response:
        """Prometheus exposition (docs/metrics.md). Public, so it names no user; a scrape
        with an operator's or admin's credential also gets the per-user series (a missing or
        unacceptable credential: the public part). A plain `def`: a scrape may wait (at most
        metrics.scrape_wait) for the store, in a worker thread, never on the event loop."""
        header = request.headers.get("authorization")
        ident = None
        if header:
            with contextlib.suppress(PhalanxError):
                ident = access.authenticate(verifier, header)
        operator = ident is not None and access.may_see_all(ident)
        body = metrics.exposition(cluster_metrics, user_metrics if operator else None)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # ---------------------------------------------------------------- jobs
    @app.post("/v1/jobs", status_code=201, response_model=SubmitOut)
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
        user = submitter(request.state.identity, [spec])
        nice_allowed(request.state.identity, [spec])
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

    submit_rule = access.RULES[("POST", "/v1/jobs")]

    def admitted(
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
            ident = access.authenticate(verifier, authorization)
            access.decide(rule, ident, params)
            valid = model.model_validate(data)
        except (PhalanxError, ValidationError):
            return None
        assert ident is not None
        return ident, valid

    async def fast_submit(
        body: bytes, authorization: str | None, _params: dict[str, str]
    ) -> Response | None:
        """POST /v1/jobs without FastAPI (controller/fastpath.py): the route's steps, in its
        order, for the common case; None, before anything has changed, for any other case
        (the route then handles the request from the start and answers as it always has)."""
        ok = admitted(body, authorization, submit_rule, {}, JobSpec)
        if ok is None:
            return None
        ident, spec = ok
        try:  # from here on the route's own steps, side effects included
            access.throttle(api_buckets, ident, limits.exempt_roles, 1, "API call")
            if b"\\u0000" in body:
                raise InvalidSpec("text in a request may not contain NUL characters (\\u0000)")
            user = submitter(ident, [spec])
            nice_allowed(ident, [spec])
            ids = await ctl.submitq.submit(spec, user)
        except PhalanxError as e:
            return _error(e)
        reply = {"job_id": ids[0], "job_ids": ids, "array": bool(spec.array)}
        return _fast_json(reply, 201)

    heartbeat_rule = access.RULES[("POST", HEARTBEAT_PATH)]

    async def fast_heartbeat(
        body: bytes, authorization: str | None, params: dict[str, str]
    ) -> Response | None:
        """POST /v1/agents/{node}/heartbeat without FastAPI, as `fast_submit`: the route's
        checks (credential, the node's own agent, a valid body), then its answer; None,
        before anything has changed, for any other case."""
        node = params["node"]
        if b"\\u0000" in body or "\x00" in node:  # the route refuses these
            return None
        ok = admitted(body, authorization, heartbeat_rule, {"node": node}, HeartbeatIn)
        if ok is None:
            return None
        ident, hb = ok
        try:  # from here on the route's own steps, side effects included
            access.throttle(api_buckets, ident, limits.exempt_roles, 1, "API call")
            answer = await answer_heartbeat(node, hb)
        except PhalanxError as e:
            return _error(e)
        return answer

    app.add_middleware(
        FastPaths,
        routes=[FastRoute("/v1/jobs", fast_submit), FastRoute(HEARTBEAT_PATH, fast_heartbeat)],
    )
    # sizes, credential and depth before any body is read or parsed (guard.py)
    app.add_middleware(
        guard.RequestGuard,
        max_body_bytes=ctl.config.http.max_body_bytes,
        max_json_depth=ctl.config.http.max_json_depth,
        authenticate=lambda header: access.authenticate(verifier, header),
    )
    # outermost, so that it times the fast path's submissions too (it names their route)
    app.add_middleware(metrics.RequestMetrics)  # API requests by route template and status

    @app.post("/v1/jobs/batch", status_code=201)
    def submit_batch(body: BatchIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        user = submitter(ident, body.jobs)
        nice_allowed(ident, body.jobs)
        ids = ctl.submit(body.jobs, user)
        # the annotation is the OpenAPI document's; the reply is made ready (_fast_json)
        return cast(
            dict[str, Any],
            _fast_json({"jobs": [{"job_id": i[0], "job_ids": i} for i in ids]}, 201),
        )

    @app.get("/v1/jobs")
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
        if not detail:
            return {"jobs": [job_view(r) for r in rows]}
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
            views.append(access.redact(view) if private(ident, r) else view)
        return {"jobs": views}

    def _one(ref: str) -> list[int]:
        ids = ctl.store.resolve_refs([ref])
        if not ids:
            raise NotFound(f"job {ref} does not exist", job=ref)
        return ids

    def private(ident: Identity, row: dict[str, Any]) -> bool:
        """Whether `ident` sees only the public part of this job (auth.private_data)."""
        return (
            ctl.config.auth.private_data
            and row["user"] != ident.user
            and not access.may_see_all(ident)
        )

    @app.get("/v1/jobs/{ref}")
    def show_job(ref: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        ids = _one(ref)
        out = []
        for jid in ids:
            row = ctl.store.get_job(jid)
            if private(ident, row):
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

    def _bulk(
        refs: list[str],
        ident: Identity,
        what: str,
        fn: Any,
        *args: Any,
        check: Any = None,
        **kw: Any,
    ) -> dict[str, Any]:
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

    @app.post("/v1/jobs/cancel")
    def cancel(body: RefsIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        return _bulk(
            body.jobs, ident, "cancel", ctl.store.cancel, ident.actor, body.reason or "cancelled"
        )

    @app.post("/v1/jobs/signal")
    def signal(body: SignalIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        return _bulk(
            body.jobs, ident, "signal", ctl.store.signal, body.signal, body.target, ident.actor
        )

    @app.post("/v1/jobs/hold")
    def hold(body: RefsIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """Hold pending jobs. An operator's or admin's hold is an admin hold, which only an
        operator or admin may release (Slurm's `scontrol hold`); a user's is a user hold."""
        admin = access.may_see_all(ident)
        return _bulk(body.jobs, ident, "hold", ctl.store.hold, ident.actor, admin=admin)

    @app.post("/v1/jobs/release")
    def release(body: RefsIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """Release held jobs: their owner a user hold, operators and admins any hold."""
        admin = access.may_see_all(ident)
        return _bulk(
            body.jobs,
            ident,
            "release",
            ctl.store.release,
            ident.actor,
            admin=admin,
            check=None if admin else _user_may_release,
        )

    def _user_may_release(views: list[dict[str, Any]]) -> None:
        for v in views:
            if v["hold_kind"] == "admin":
                raise Forbidden(
                    f"job {v['job_id']} was held by {v['held_by'] or 'an operator'}, an "
                    "operator or admin (an admin hold, as Slurm's scontrol hold): only an "
                    "operator or admin may release it; ask them to",
                    job=str(v["job_id"]),
                    held_by=v["held_by"],
                )

    @app.post("/v1/jobs/requeue")
    def requeue(body: RequeueIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """scontrol requeue/requeuehold: running jobs stop and come back (restart count + 1),
        finished ones go back to the queue; a job may requeue itself with its own identity."""
        return _bulk(
            body.jobs,
            ident,
            "requeue",
            ctl.store.requeue,
            ident.actor,
            hold=body.hold,
            admin=access.may_see_all(ident),  # an operator's requeuehold is an admin hold
        )

    @app.post("/v1/jobs/update")
    def update_jobs(body: UpdateIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """scontrol update JobId=...: change pending jobs (time limit, nodes, partition,
        dependency, priority, nice). Users may only lower a time limit; operators may raise
        it. A priority above 0 or a negative nice: operators and admins, as on submission."""
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
        standing_allowed(ident, body.priority, body.nice)  # the submission's rule, the same
        if body.priority is not None:
            changes["priority"] = body.priority
        if body.nice is not None:
            changes["nice"] = body.nice
        if not changes:
            raise InvalidSpec(
                "nothing to change: give time_limit, nodes, partition, dependency, priority or nice"
            )
        return _bulk(
            body.jobs,
            ident,
            "update",
            ctl.store.update_pending,
            changes,
            ident.actor,
            may_raise=access.may_see_all(ident),
        )

    @app.get("/v1/jobs/{ref}/events")
    def job_events(ref: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        out = []
        for jid in _one(ref):
            row = ctl.store.get_job(jid)
            if private(ident, row):
                raise Forbidden(
                    f"the events of job {jid} are private to {row['user']} (auth.private_data)",
                    job=str(jid),
                    owner=row["user"],
                )
            out.extend(ctl.store.events(job_id=jid))
        out.sort(key=lambda e: e["id"])
        return {"events": out}

    @app.get("/v1/jobs/{ref}/explain")
    def explain_job(ref: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """Why the job waits (pending, held) or why it ended or was requeued, in sentences:
        {"job", "state", "summary", "lines"} (docs/explain.md). An array names one task."""
        ids = _one(ref)
        if ref.strip().isdecimal() and int(ref) in ids:
            ids = [int(ref)]
        if len(ids) != 1:
            raise InvalidSpec(f"{ref} names {len(ids)} jobs: explain one array task (e.g. {ref}_0)")
        row = ctl.store.get_job(ids[0])
        if private(ident, row):
            raise Forbidden(
                f"why job {explaining.display_id(row)} waits or ended is private to "
                f"{row['user']} (auth.private_data)",
                job=str(ids[0]),
                owner=row["user"],
            )
        return explaining.explain_job(
            ctl.store,
            row,
            time.time(),
            ctl.plan_options,
            # the nodes' drains around its attempts: others' launch errors left out
            redact=lambda evs: events_for(ident, evs),
        ).as_dict()

    # ---------------------------------------------------------------- steps (srun)
    def _own_job(ref: str, ident: Identity, what: str) -> dict[str, Any]:
        """The one job a step belongs to. A plain number is that job itself even when it is
        also an array's id: srun sends $SLURM_JOB_ID, and the first task of an array has the
        array's id as its own (as in Slurm), so `123` must not mean the whole array here."""
        row: dict[str, Any] | None = None
        if ref.strip().isdecimal() and int(ref) <= MAX_ID:
            # srun's own case (every step of a loop): the job itself, one read less
            with contextlib.suppress(NotFound):
                row = ctl.store.get_job(int(ref))
        if row is None:
            ids = _one(ref)
            if len(ids) != 1:
                raise InvalidSpec(f"{ref} names {len(ids)} jobs: steps belong to one job")
            row = ctl.store.get_job(ids[0])
        access.check_owner(ident, [job_view(row)], what)
        return row

    @app.post("/v1/jobs/{ref}/steps", status_code=201)
    def create_step(ref: str, body: StepIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        row = _own_job(ref, ident, "srun")
        req = StepRequest(
            nodes=body.nodes,
            ntasks=body.ntasks,
            ntasks_per_node=body.ntasks_per_node,
            cpus_per_task=body.cpus_per_task,
            gpus_per_task=body.gpus_per_task,
            gpus_per_node=body.gpus_per_node,
            nodelist=tuple(body.nodelist),
            job_ntasks_per_node=tuple(job_layout(row["spec"], len(row["nodelist_run"] or [None]))),
        )
        spec = {
            "argv": body.argv,
            "env": body.env,
            "cwd": body.cwd,
            "cpus_per_task": body.cpus_per_task,
            "output": body.output,
            "error": body.error,
            "label": body.label,
            "open_mode": body.open_mode,
            "io": {
                "host": body.host,
                "port": body.port,
                "cookie": body.cookie,
                "stdout": body.output is None,
                "stderr": body.error is None,
                **({"pty": True} if body.pty else {}),
            },
        }
        name = body.name or os.path.basename(body.argv[0])
        direct = body.direct and ctl.config.steps.direct
        step = ctl.store.create_step(
            int(row["id"]), req, spec, name, ident.actor, launch_rows=direct
        )
        gens: dict[str, int] = step.pop("work_gens")
        rows = step.pop("launch_rows")
        if direct:
            # srun hands the launches over itself (Slurm's model): no long-poll is woken for
            # them, and the nodes whose agents have told no address yet are woken now
            step["launch"], unknown = ctl.direct_launches(rows, keys.signing)
            step["push_timeout"] = ctl.config.steps.push_timeout
            ctl.seen_gens(gens)
            if unknown:
                ctl.woke({n: gens[n] for n in unknown if n in gens})
        else:
            # this controller's long-polling agents start it at once (SQLite has no NOTIFY,
            # and the work_gen poll would cost up to GEN_POLL per step); the poll is told, so
            # it does not wake them a second time for the same step
            ctl.woke(gens)
        return step

    @app.post("/v1/jobs/{ref}/steps/{step_id}/wake")
    def wake_step_nodes(
        ref: str, step_id: int, body: StepWakeIn, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        """The nodes of a step whose direct launch srun could not hand over: their agents'
        long-polls on this controller answer with it now (the others' controllers have
        woken them already: the step bumped their work generation)."""
        row = _own_job(ref, ident, "srun")
        if not 0 <= step_id < 2**31:
            raise InvalidSpec(f"invalid step id {step_id}")
        step = ctl.store.get_step(int(row["id"]), step_id)
        nodes = sorted(set(body.nodes) & set(step["nodes"]))
        ctl.waiters.notify(nodes)
        return {"step_id": step_id, "woken": nodes}

    @app.get("/v1/jobs/{ref}/steps/{step_id}")
    def show_step(ref: str, step_id: int, ident: Identity = Depends(caller)) -> dict[str, Any]:
        row = _own_job(ref, ident, "show a step")
        if not 0 <= step_id < 2**31:
            raise InvalidSpec(f"invalid step id {step_id}")
        return ctl.store.get_step(int(row["id"]), step_id)

    @app.post("/v1/jobs/{ref}/steps/signal")
    def signal_steps(
        ref: str, body: StepSignalIn, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        row = _own_job(ref, ident, "signal")
        done = ctl.store.signal_steps(int(row["id"]), body.signal, body.step_id, ident.actor)
        ctl.waiters.notify(ctl.waiters.waiting_nodes())
        return {"steps": done}

    @app.post("/v1/jobs/{ref}/steps/cancel")
    def cancel_steps(
        ref: str, body: StepCancelIn, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        row = _own_job(ref, ident, "cancel a step")
        reason = body.reason or f"cancelled by {ident.actor}"
        done = ctl.store.cancel_steps(int(row["id"]), body.step_id, reason, ident.actor)
        ctl.waiters.notify(ctl.waiters.waiting_nodes())
        return {"steps": done}

    # ---------------------------------------------------------------- nodes
    def sees_all(ident: Identity) -> bool:
        """Whether `ident` reads every job's private fields (auth.private_data)."""
        return not ctl.config.auth.private_data or access.may_see_all(ident)

    def node_for(ident: Identity, view: dict[str, Any]) -> dict[str, Any]:
        """A node's view as `ident` may read it: a user under private_data does not get the
        last launch error of a Phalanx drain (another user's job's)."""
        if not sees_all(ident):
            view["drain_reason"] = access.redact_drain_reason(
                view["drain_reason"], view["drain_by"]
            )
        return view

    def events_for(ident: Identity, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Node events as `ident` may read them: under private_data a user reads the events
        of others' jobs without their message and data (access.redact_event)."""
        if sees_all(ident):
            return events
        ids = sorted({int(e["job_id"]) for e in events if e.get("job_id") is not None})
        owners = {int(r["id"]): str(r["user"]) for r in ctl.store.list_jobs(ids=ids)} if ids else {}
        return [
            access.redact_event(
                e, owners.get(int(e["job_id"])) if e.get("job_id") else None, ident.user
            )
            for e in events
        ]

    @app.get("/v1/nodes")
    def nodes(ident: Identity = Depends(caller)) -> dict[str, Any]:
        windows = ctl.store.list_windows()
        rows = ctl.store.list_nodes()
        views = [node_for(ident, node_view(n)) for n in rows]
        for v, n in zip(views, rows, strict=True):
            v["maintenance"] = maint_api.node_windows(v["name"], windows)
            v["topology"] = dict(ctl.topology.place(n["name"], n.get("topology")))
        return {"nodes": views}

    @app.get("/v1/nodes/{name}")
    def node(name: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        row = ctl.store.get_node(name)
        view = node_for(ident, node_view(row))
        view["maintenance"] = maint_api.node_windows(name, ctl.store.list_windows())
        # the place placement uses: the config's [topology] rules, else what the agent reported
        view["topology"] = dict(ctl.topology.place(name, row.get("topology")))
        view["events"] = events_for(ident, ctl.store.events(node=name, limit=50, newest=True))
        return view

    @app.post("/v1/nodes/{name}/drain")
    def drain(name: str, body: DrainIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        requeued = ctl.store.drain(name, body.reason, ident.actor, now=body.now)
        if requeued:
            ctl.waiters.notify([name])
        ctl.kick()
        return {**node_view(ctl.store.get_node(name)), "requeued": requeued}

    @app.post("/v1/nodes/{name}/resume")
    def resume(name: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        ctl.store.resume(name, ident.actor)
        ctl.kick()
        return node_view(ctl.store.get_node(name))

    # ---------------------------------------------------------------- licences
    @app.get("/v1/licenses")
    def licenses_view() -> dict[str, Any]:
        """Every configured licence with its total, what attempts holding nodes use, and
        what is free (scontrol show licenses, phalanx show licenses)."""
        totals = ctl.config.cluster.license_totals()
        used = ctl.store.licenses_in_use()
        return {
            "licenses": [
                {
                    "name": name,
                    "total": total,
                    "used": used.get(name, 0),
                    "free": max(0, total - used.get(name, 0)),
                }
                for name, total in sorted(totals.items())
            ]
        }

    # ---------------------------------------------------------------- cluster
    @app.get("/v1/cluster")
    def cluster() -> dict[str, Any]:
        # each partition's preemption tier and mode, from the config (docs/preemption.md)
        preempt_fields = {
            p.name: {"priority_tier": p.priority_tier, "preempt_mode": p.preempt_mode}
            for p in ctl.config.cluster.partitions
        }
        return {
            **ctl.store.cluster_counts(),
            "partitions": [
                {**p, **preempt_fields.get(name, {})} for name, p in ctl.store.partitions().items()
            ],
            "controllers": ctl.store.list_controllers(),
            "leases": ctl.store.list_leases(),
            "this_controller": ctl.status(),
            # what --checkpoint-interval=auto divides by the node count (checkpoint-interval.md)
            "node_mtbf": checkpointing.cluster_mtbf(
                *ctl.store.failure_history(time.time()),
                prior_s=ctl.timing.node_mtbf_prior_s,
                prior_weight_s=ctl.timing.node_mtbf_prior_weight_s,
            ),
        }

    @app.get("/v1/events")
    def events(
        since: int = Query(default=0, ge=0, le=MAX_ID),
        limit: int = Query(default=1000, ge=1, description=f"at most {MAX_EVENTS}"),
        node: str | None = None,
    ) -> dict[str, Any]:
        if limit > MAX_EVENTS:
            raise InvalidSpec(
                f"limit: at most {MAX_EVENTS} events per request; ask for the next ones with "
                "since=ID (the id of the last event you got)",
                field="limit",
            )
        return {"events": ctl.store.events(since_id=since, limit=limit, node=node)}

    # ---------------------------------------------------------------- identity
    @app.get("/v1/whoami")
    def whoami(ident: Identity = Depends(caller)) -> dict[str, Any]:
        return {"user": ident.user, "role": ident.role, "kind": ident.kind, "uid": ident.uid}

    @app.post("/v1/tokens", status_code=201)
    def create_token(body: TokenIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """A bearer token for `user` (admin only). The token is in the reply and nowhere
        else: not in events, not in logs."""
        most = ctl.config.auth.token_max_lifetime
        if body.lifetime_s > most:
            raise InvalidSpec(
                f"lifetime_s: {body.lifetime_s:g} s is longer than this cluster allows "
                f"({most:g} s, auth.token_max_lifetime)",
                field="lifetime_s",
            )
        token = mint_token(
            keys,
            user=body.user,
            role=body.role,
            cluster=ctl.config.cluster.name,
            lifetime=body.lifetime_s,
        )
        expires = time.time() + body.lifetime_s
        ctl.store.record_event(
            "auth.token",
            f"{ident.actor} created a {body.role} token for {body.user} valid for "
            f"{format_duration(int(body.lifetime_s))}",
            actor=ident.actor,
        )
        return {"token": token, "user": body.user, "role": body.role, "expires_at": expires}

    # ---------------------------------------------------------------- agents
    @app.post("/v1/agents/{node}/register")
    def register(node: str, body: RegisterIn) -> dict[str, Any]:
        ctl.register(node, body.model_dump())
        return {
            "node": node,
            "timing": ctl.timing.model_dump(),
            "isolation": ctl.config.isolation.model_dump(),
            "controller": ctl.cid,
        }

    @app.post(HEARTBEAT_PATH)
    async def heartbeat(node: str, body: HeartbeatIn) -> dict[str, Any]:
        # the annotation is the OpenAPI document's (a JSON object); the reply is made ready
        return cast(dict[str, Any], await answer_heartbeat(node, body))

    async def answer_heartbeat(node: str, body: HeartbeatIn) -> Response:
        """The route's work (also the fast path's): record, wait for work, reply."""
        ctl.seen(node)
        if body.steps_at:
            ctl.step_addrs[node] = body.steps_at
        else:
            ctl.step_addrs.pop(node, None)
        reports = [TaskReport(**r.model_dump()) for r in body.tasks]
        step_reports = [StepReport(**r.model_dump()) for r in body.steps]
        deadline = time.monotonic() + min(body.wait, ctl.timing.heartbeat_interval)
        read_at = time.monotonic()  # a wakeup after this may not be in the reply: wait less
        args = (node, reports, body.taken_at, body.health, step_reports)
        reply, steps = await run_in_threadpool(ctl.exchange, *args)
        while reply.empty and steps.empty and time.monotonic() < deadline:
            woke = await ctl.waiters.wait(node, deadline - time.monotonic(), since=read_at)
            if not woke:
                break
            read_at = time.monotonic()
            reply, steps = await run_in_threadpool(ctl.exchange, *args)
        return _fast_json(
            {
                "start": await run_in_threadpool(ctl.launch_specs, reply, node),
                "stop": reply.stop,
                "forget": reply.forget,
                "steps": {
                    "start": ctl.step_launch_specs(steps, node),
                    "stop": steps.stop,
                    "signal": steps.signal,
                    "forget": steps.forget,
                },
                **({"checkpoint": reply.checkpoint} if reply.checkpoint is not None else {}),
                **({"signal": reply.signals} if reply.signals else {}),
                "controller": ctl.cid,
                "terms": ctl.leases.terms(),
                # the heartbeat rule's timings, as they grow with the cluster (rescale_timing)
                "timing": ctl.agent_timing,
            }
        )

    app.include_router(maint_api.router(ctl))
    app.include_router(dashboard.router(ctl))
    app.include_router(share_api.router(ctl))
    docs_ui.add_routes(app)
    return app
