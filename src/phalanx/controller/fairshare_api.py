"""REST endpoints for fair share and priority, included by `api.create_app`.

GET /v1/share              the account tree as `sshare` shows it (every association)
GET /v1/jobs/{ref}/priority  a pending job's priority factor by factor (`sprio`), with the
                             arithmetic written out; the job's owner, operators and admins
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Request

from phalanx.controller import access
from phalanx.errors import NotFound


def router(ctl: Any) -> APIRouter:
    """The endpoints, bound to a controller (`runtime.Controller`)."""
    r = APIRouter()

    @r.get("/v1/share")
    def share() -> dict[str, Any]:
        rows: dict[str, Any] = ctl.fairshare.share_rows()
        return rows

    @r.get("/v1/jobs/{ref}/priority")
    def job_priority(ref: str, request: Request) -> dict[str, Any]:
        ids = ctl.store.resolve_refs([ref])
        if not ids:
            raise NotFound(f"job {ref} does not exist", job=ref)
        rows = [ctl.store.get_job(jid) for jid in ids]
        access.check_owner(request.state.identity, rows, "reading a job's priority")
        snap = SimpleNamespace(
            nodes=ctl.store.list_nodes(), partitions=ctl.store.partitions(), pending=rows
        )
        out = []
        for row in rows:
            b = ctl.fairshare.job_breakdown(row, snap).as_dict()
            b.update(
                job_id=row["id"],
                user=row["user"],
                account=row.get("account") or ctl.fairshare.cfg.default_account,
                qos=row.get("qos") or ctl.fairshare.cfg.default_qos,
                state=row["state"],
            )
            out.append(b)
        return {"jobs": out}

    return r
