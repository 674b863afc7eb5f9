"""Agents: registration and the heartbeat (a long-poll: the agent's reports in, its node's
work out), with the heartbeat's fast path past FastAPI."""

from __future__ import annotations

import time
from typing import Any, cast

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from phalanx.controller import access, nodeconfig
from phalanx.controller.api_context import ApiContext, error_reply, fast_json
from phalanx.controller.api_models import HEARTBEAT_PATH, HeartbeatIn, RegisterIn
from phalanx.controller.fastpath import FastRoute
from phalanx.controller.runtime import Controller
from phalanx.errors import PhalanxError, StoreUnavailable
from phalanx.store.steps import StepReport
from phalanx.store.store import TaskReport


async def answer_heartbeat(ctl: Controller, node: str, body: HeartbeatIn) -> Response:
    """The route's work (also the fast path's): record, wait for work, reply.

    Not while this controller's heartbeat flushes lag (Timing.flush_lag_limit): a reply
    freshens the agent's fence, so it must come from a controller that will store the
    heartbeat in time for every failure detector to see it. The 503 sends the agent to another
    controller; when none can answer, it is the store outage agents already ride out."""
    lag, limit = ctl.heartbeats.lag(), ctl.timing.flush_lag_limit()
    if lag > limit:
        raise StoreUnavailable(
            f"controller {ctl.cid} cannot store heartbeats: everything it heard up to "
            f"{lag:.1f}s ago is stored, and it answers only within {limit:g}s "
            "(heartbeat_flush_interval + db_op_timeout); ask another controller"
        )
    ctl.seen(node, body.node_config_version)
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
    # the node's settings (health checks, hooks, features) when its agent runs another version
    conf = nodeconfig.for_heartbeat(
        ctl.config, ctl.versions.version, node, body.node_config_version
    )
    return fast_json(
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
            **({"members": reply.members} if reply.members else {}),
            "controller": ctl.cid,
            "terms": ctl.leases.terms(),
            # the heartbeat rule's timings, as they grow with the cluster (rescale_timing)
            "timing": ctl.agent_timing,
            **({"node_config": conf} if conf is not None else {}),
        }
    )


def router(api: ApiContext) -> APIRouter:
    """/v1/agents/{node}/register and the heartbeat route."""
    ctl = api.ctl
    r = APIRouter()

    @r.post("/v1/agents/{node}/register")
    def register(node: str, body: RegisterIn) -> dict[str, Any]:
        ctl.register(node, body.model_dump())
        return {
            "node": node,
            "timing": ctl.timing.model_dump(),
            "isolation": ctl.config.isolation.model_dump(),
            "controller": ctl.cid,
            # the node's settings from the version in force (controller/nodeconfig.py)
            "node_config": nodeconfig.node_config(ctl.config, ctl.versions.version, node),
        }

    @r.post(HEARTBEAT_PATH)
    async def heartbeat(node: str, body: HeartbeatIn) -> dict[str, Any]:
        # the annotation is the OpenAPI document's (a JSON object); the reply is made ready
        return cast(dict[str, Any], await answer_heartbeat(ctl, node, body))

    return r


def fast_route(api: ApiContext) -> FastRoute:
    """POST /v1/agents/{node}/heartbeat for controller/fastpath.py."""
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
        ok = api.admitted(body, authorization, heartbeat_rule, {"node": node}, HeartbeatIn)
        if ok is None:
            return None
        ident, hb = ok
        try:  # from here on the route's own steps, side effects included
            access.throttle(api.api_buckets, ident, api.limits.exempt_roles, 1, "API call")
            answer = await answer_heartbeat(api.ctl, node, hb)
        except PhalanxError as e:
            return error_reply(e)
        return answer

    return FastRoute(HEARTBEAT_PATH, fast_heartbeat)
