"""Nodes: list and show them (with their maintenance windows, topology and recent events),
drain and resume them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from phalanx.auth.tokens import Identity
from phalanx.controller import maintenance_api
from phalanx.controller.api_context import ApiContext, caller
from phalanx.controller.api_models import DrainIn
from phalanx.controller.views import node_view


def router(api: ApiContext) -> APIRouter:
    """The /v1/nodes routes."""
    ctl = api.ctl
    r = APIRouter()

    @r.get("/v1/nodes")
    def nodes(ident: Identity = Depends(caller)) -> dict[str, Any]:
        windows = ctl.store.list_windows()
        rows = ctl.store.list_nodes()
        current = ctl.versions.latest
        views = [api.node_for(ident, node_view(n, current)) for n in rows]
        for v, n in zip(views, rows, strict=True):
            v["maintenance"] = maintenance_api.node_windows(v["name"], windows)
            v["topology"] = dict(ctl.topology.place(n["name"], n.get("topology")))
        return {"nodes": views}

    @r.get("/v1/nodes/{name}")
    def node(name: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        row = ctl.store.get_node(name)
        view = api.node_for(ident, node_view(row, ctl.versions.latest))
        view["maintenance"] = maintenance_api.node_windows(name, ctl.store.list_windows())
        # the place placement uses: the config's [topology] rules, else what the agent reported
        view["topology"] = dict(ctl.topology.place(name, row.get("topology")))
        view["events"] = api.events_for(ident, ctl.store.events(node=name, limit=50, newest=True))
        return view

    @r.post("/v1/nodes/{name}/drain")
    def drain(name: str, body: DrainIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        requeued = ctl.store.drain(name, body.reason, ident.actor, now=body.now)
        if requeued:
            ctl.waiters.notify([name])
        ctl.kick()
        return {**node_view(ctl.store.get_node(name), ctl.versions.latest), "requeued": requeued}

    @r.post("/v1/nodes/{name}/resume")
    def resume(name: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        ctl.store.resume(name, ident.actor)
        ctl.kick()
        return node_view(ctl.store.get_node(name), ctl.versions.latest)

    return r
