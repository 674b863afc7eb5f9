"""REST endpoints for maintenance windows (`/v1/maintenance`), included by `api.create_app`.

    POST   /v1/maintenance        {nodes, start, duration | end, reason}  -> 201 {window, warnings}
    GET    /v1/maintenance        ?all=true also lists done and removed windows
    GET    /v1/maintenance/{id}
    DELETE /v1/maintenance/{id}   removes it; an active window returns its nodes at once

Times may be epoch seconds or text (`now+10min`, `15:00`, `2026-12-02T15:00`, ISO); text is
read in the controller's local time zone, so the CLI sends epoch seconds it parsed itself.
Bad windows (unknown nodes, an end in the past, a zero or negative duration) are refused with
422 and a message that says what to change.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, Field

from phalanx.domain import maintenance as rules
from phalanx.domain.hostlist import compress_hostlist
from phalanx.domain.text import PlainText
from phalanx.errors import InvalidSpec


class MaintenanceIn(BaseModel):
    nodes: str = Field(min_length=1, max_length=4096, description="hostlist, e.g. node[01-04]")
    start: float | str = Field(
        description="epoch seconds, or now, now+10min, HH:MM, 2026-12-02T15:00 (local time)"
    )
    duration: float | str | None = Field(
        default=None, description="seconds, or 90s, 10min, 4h, 2:00:00 (give this or end)"
    )
    end: float | str | None = Field(default=None, description="like start (give this or duration)")
    reason: PlainText | None = Field(default=None, max_length=1024)


WID = Path(ge=0, le=2**63 - 1, description="the window's id")


def window_view(row: dict[str, Any]) -> dict[str, Any]:
    nodes = list(row["nodes"] or [])
    return {
        "id": int(row["id"]),
        "nodes": compress_hostlist(nodes) if nodes else "",
        "node_names": nodes,
        "nodes_expr": row["nodes_expr"],
        "start": row["start"],
        "end": row["end"],
        "duration_s": row["end"] - row["start"],
        "reason": row["reason"],
        "state": row["state"],
        "created_by": row["created_by"],
        "created_at": row["created_at"],
    }


def node_windows(node: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live windows that include `node` (for node listings), earliest first."""
    return [
        {
            "id": int(r["id"]),
            "start": r["start"],
            "end": r["end"],
            "state": r["state"],
            "reason": r["reason"],
        }
        for r in rows
        if node in (r["nodes"] or ())
    ]


def router(ctl: Any) -> APIRouter:
    """The endpoints, bound to a controller (`runtime.Controller`)."""
    r = APIRouter()

    @r.post("/v1/maintenance", status_code=201)
    def add_maintenance(body: MaintenanceIn, request: Request) -> dict[str, Any]:
        try:
            start, end = rules.resolve_times(body.start, body.duration, body.end, time.time())
        except ValueError as e:
            raise InvalidSpec(str(e), field="start") from None
        row = ctl.store.add_window(
            body.nodes, start, end, body.reason, request.state.identity.actor
        )
        ctl.kick()  # pending jobs may have to avoid the nodes from now on
        warnings = []
        lead = float(ctl.timing.maint_lead)
        if start - time.time() < lead:
            warnings.append(
                f"the window starts in less than the lead time ({lead:g} s): jobs running on "
                "its nodes get only the time left to checkpoint"
            )
        return {"window": window_view(row), "warnings": warnings}

    @r.get("/v1/maintenance")
    def list_maintenance(all: bool = False) -> dict[str, Any]:
        return {"windows": [window_view(w) for w in ctl.store.list_windows(include_past=all)]}

    @r.get("/v1/maintenance/{wid}")
    def show_maintenance(wid: int = WID) -> dict[str, Any]:
        return {"window": window_view(ctl.store.get_window(wid))}

    @r.delete("/v1/maintenance/{wid}")
    def remove_maintenance(request: Request, wid: int = WID) -> dict[str, Any]:
        row = ctl.store.remove_window(wid, request.state.identity.actor)
        ctl.kick()
        return {"window": window_view(row), "returned": row["returned"]}

    return r
