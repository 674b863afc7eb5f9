"""The REST API (`/v1`), served by every controller: the app, its credential check, its error
replies and middleware; the routes live in one router per resource (submit_api, jobs_api,
steps_api, nodes_api, agents_api, cluster_api, maintenance_api, reservations_api,
fairshare_api, dashboard). Errors mirror `phalanx.errors`:

{"error": {"code": "invalid_spec", "message": "nodes: ...", "details": {...}}}
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.requests import HTTPConnection
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from phalanx import __version__
from phalanx.auth.keys import KeySet
from phalanx.controller import (
    access,
    agents_api,
    cluster_api,
    config_api,
    dashboard,
    docs_ui,
    fairshare_api,
    guard,
    jobs_api,
    maintenance_api,
    metrics,
    nodes_api,
    rendezvous_api,
    reservations_api,
    steps_api,
    submit_api,
)
from phalanx.controller.api_context import IDENTITY_FIELDS, ApiContext, error_reply
from phalanx.controller.fastpath import FastPaths
from phalanx.controller.runtime import Controller
from phalanx.errors import Forbidden, InvalidSpec, PhalanxError


class Authorize(HTTPBearer):
    """Every route: verify the caller, apply the route's rule, count the call.

    An HTTPBearer so that the OpenAPI document declares the bearer scheme, but the header is
    parsed by access.bearer, which says what is wrong with a malformed one (HTTPBearer would
    silently drop it). One dependency, not a bearer scheme under an `authorize` function:
    FastAPI's dependency solving costs every call more than the check itself."""

    def __init__(self, api: ApiContext) -> None:
        super().__init__(
            auto_error=False,
            scheme_name="HTTPBearer",  # the OpenAPI name it had as a plain HTTPBearer
            description="a Phalanx credential (JWT)",
        )
        self.api = api

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        assert isinstance(request, Request)  # HTTP routes only: FastAPI passes the Request
        api = self.api
        scope = request.scope
        route = scope.get("route")
        key = (request.method, getattr(route, "path", ""))
        rule = access.RULES.get(key)
        if rule is not None and rule.level == access.PUBLIC:
            return None
        ident = scope.get(guard.IDENTITY)  # verified by the guard, before the body
        if ident is None:
            header = request.headers.get("authorization")
            ident = access.authenticate(api.verifier, header) if header else None
        access.decide(rule, ident, dict(request.path_params))
        assert ident is not None
        access.throttle(api.api_buckets, ident, api.limits.exempt_roles, 1, "API call")
        request.state.identity = ident
        # no store keeps a NUL in text (PostgreSQL refuses it): say so before anything is
        # done (scope["path"] is the decoded path that request.url.path is rebuilt from)
        raw = bytes(scope.get("raw_path") or b"") + scope.get("query_string", b"")
        if (
            b"%00" in raw
            or "\x00" in scope.get("root_path", "") + scope["path"]
            or (request.method in ("POST", "PUT", "PATCH") and b"\\u0000" in await request.body())
        ):
            raise InvalidSpec("text in a request may not contain NUL characters (\\u0000)")
        return None


async def _phalanx_error(_req: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, PhalanxError)
    return error_reply(e)


async def _validation_error(_req: Request, e: Exception) -> JSONResponse:
    """A body that does not validate: one InvalidSpec naming every field that is wrong (a
    field naming another user: 403, a job always runs as its submitter)."""
    assert isinstance(e, RequestValidationError)
    for err in e.errors():
        loc = err.get("loc") or ()
        if err.get("type") == "extra_forbidden" and loc and loc[-1] in IDENTITY_FIELDS:
            return error_reply(
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
    return error_reply(InvalidSpec("; ".join(msgs), field=".".join(loc)))


def create_app(ctl: Controller, keys: KeySet) -> FastAPI:
    """The API of one controller; `keys` (the cluster key set) verifies credentials."""
    api = ApiContext(ctl, keys)

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
        dependencies=[Depends(Authorize(api))],
    )
    app.add_exception_handler(PhalanxError, _phalanx_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    # the hot routes (sbatch's submission, the agents' heartbeat) past FastAPI when they can
    app.add_middleware(FastPaths, routes=[submit_api.fast_route(api), agents_api.fast_route(api)])
    # sizes, credential and depth before any body is read or parsed (guard.py)
    app.add_middleware(
        guard.RequestGuard,
        max_body_bytes=ctl.config.http.max_body_bytes,
        max_json_depth=ctl.config.http.max_json_depth,
        authenticate=lambda header: access.authenticate(api.verifier, header),
    )
    # outermost, so that it times the fast path's submissions too (it names their route)
    app.add_middleware(metrics.RequestMetrics)  # API requests by route template and status

    for router in (
        cluster_api.router(api),
        submit_api.router(api),
        jobs_api.router(api),
        steps_api.router(api),
        rendezvous_api.router(api),
        nodes_api.router(api),
        agents_api.router(api),
        maintenance_api.router(ctl),
        reservations_api.router(ctl),
        dashboard.router(ctl),
        fairshare_api.router(ctl),
        config_api.router(api),
    ):
        app.include_router(router)
    docs_ui.add_routes(app)
    return app
