"""The cluster as a whole: health checks, Prometheus metrics, licences, the cluster's state
and events, the caller's identity and tokens."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from phalanx import __version__
from phalanx.auth.tokens import Identity, mint_token
from phalanx.controller import access, metrics
from phalanx.controller.api_context import ApiContext, caller
from phalanx.controller.api_models import MAX_EVENTS, MAX_ID, TokenIn
from phalanx.domain import checkpointing
from phalanx.domain.values import format_duration
from phalanx.errors import InvalidSpec, PhalanxError
from phalanx.store.metrics import CHECKPOINT_BUCKETS


def router(api: ApiContext) -> APIRouter:
    """/healthz, /metrics, /v1/licenses, /v1/cluster, /v1/events, /v1/whoami, /v1/tokens."""
    ctl = api.ctl
    r = APIRouter()

    @r.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "version": __version__, **ctl.status()}

    @r.get("/healthz/live")
    async def live() -> JSONResponse:
        """For a supervisor or load balancer: 503 when this controller's loops are stuck."""
        stuck = ctl.stuck_loops()
        body = {"live": not stuck, "controller": ctl.cid, "stuck": stuck}
        return JSONResponse(body, status_code=503 if stuck else 200)

    @r.get("/healthz/ready")
    def ready() -> JSONResponse:
        """For a load balancer: 503 when this controller cannot serve (store or loops down)."""
        problems = [f"loop {name} has not run recently" for name in ctl.stuck_loops()]
        if ctl.versions.problem:  # it takes no duties (controller/confversions.py)
            problems.append(ctl.versions.problem)
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

    @r.get("/metrics", response_class=PlainTextResponse)
    def prometheus_metrics(request: Request) -> Response:
        """Prometheus exposition (docs/metrics.md). Public, so it names no user; a scrape
        with an operator's or admin's credential also gets the per-user series (a missing or
        unacceptable credential: the public part). A plain `def`: a scrape may wait (at most
        metrics.scrape_wait) for the store, in a worker thread, never on the event loop."""
        header = request.headers.get("authorization")
        ident = None
        if header:
            with contextlib.suppress(PhalanxError):
                ident = access.authenticate(api.verifier, header)
        operator = ident is not None and access.may_see_all(ident)
        body = metrics.exposition(cluster_metrics, user_metrics if operator else None)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @r.get("/v1/licenses")
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

    @r.get("/v1/diag")
    def diag() -> dict[str, Any]:
        """This controller's scheduler and API statistics since it started (sdiag)."""
        from phalanx.controller.diag import diag_view

        return diag_view(ctl.store)

    @r.get("/v1/report/usage")
    def usage_report(start: float, end: float, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """CPU-seconds of [start, end): the cluster's (reported, allocated, down, idle) and
        each account and user's (sreport; domain/usage_report.py). With `auth.private_data`,
        a user who may not see everyone's jobs gets the others' usage only as totals."""
        if not 0 <= start < end <= 2**40:
            raise InvalidSpec(f"a report needs 0 <= start < end (got start={start} end={end})")
        from phalanx.domain import usage_report

        rows = ctl.store.usage_rows(start, end)
        out = usage_report.build(start, end, time.time(), *rows).as_dict()
        if not api.sees_all(ident):
            out["assocs"] = [a for a in out["assocs"] if a["user"] == ident.user]
        out["cluster"] = ctl.config.cluster.name
        return out

    @r.get("/v1/cluster")
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

    @r.get("/v1/events")
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
    @r.get("/v1/whoami")
    def whoami(ident: Identity = Depends(caller)) -> dict[str, Any]:
        return {
            "user": ident.user,
            "role": ident.role,
            "kind": ident.kind,
            "uid": ident.uid,
            "cluster": ctl.config.cluster.name,  # what `squeue -M NAME` must name
        }

    @r.post("/v1/tokens", status_code=201)
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
            api.keys,
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

    return r
