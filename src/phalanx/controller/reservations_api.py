"""REST endpoints for reservations (`/v1/reservations`), included by `api.create_app`.

    POST   /v1/reservations         {name, nodes | node_count, start, duration | end, users,
                                     accounts, flags, partition}         -> 201 {reservation}
    GET    /v1/reservations         the reservations that have not ended
    GET    /v1/reservations/{name}
    POST   /v1/reservations/{name}/update  any of the fields above       -> {reservation}
    DELETE /v1/reservations/{name}  refused (409) while a job asks for it

Times may be epoch seconds or text (`now`, `now+1hour`, `15:00`, `2026-12-02T15:00`); text is
read in the controller's local time zone, so `scontrol` sends epoch seconds it parsed itself.
A duration in seconds, or text (`90s`, `4h`, or a Slurm time, where a lone number is
minutes). Changing the start alone keeps the duration, as in Slurm. Refusals say what to
change: 422 for a value, 409 for a clash (a duplicate name, an overlap, busy nodes, a
reservation in use).
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, Field

from phalanx.domain import maintenance
from phalanx.domain import reservations as rules
from phalanx.domain.hostlist import compress_hostlist
from phalanx.errors import InvalidSpec

Names = list[Annotated[str, Field(max_length=64)]]


class ReservationChange(BaseModel):
    nodes: str | None = Field(default=None, max_length=4096, description="hostlist")
    node_count: int | None = Field(default=None, ge=1, le=1_000_000)
    start: float | str | None = Field(
        default=None, description="epoch seconds, or now, now+1hour, HH:MM, 2026-12-02T15:00"
    )
    duration: float | str | None = Field(
        default=None, description="seconds, or 90s, 4h, 60 (minutes), 2:00:00 (give this or end)"
    )
    end: float | str | None = Field(default=None, description="like start")
    users: Names | None = Field(default=None, max_length=10_000)
    accounts: Names | None = Field(default=None, max_length=10_000)
    flags: list[Annotated[str, Field(max_length=32)]] | None = Field(default=None, max_length=32)
    partition: str | None = Field(default=None, max_length=128)


class ReservationIn(ReservationChange):
    name: str = Field(min_length=1, max_length=128)


NAME = Path(min_length=1, max_length=128, description="the reservation's name")


def reservation_view(row: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    r = rules.Reservation.from_row(row)
    nodes = list(row["nodes"] or [])
    return {
        "name": r.name,
        "nodes": compress_hostlist(nodes) if nodes else "",
        "node_names": nodes,
        "nodes_expr": row["nodes_expr"],
        "node_count": len(nodes),
        "start": r.start,
        "end": r.end,
        "duration_s": r.end - r.start,
        "users": list(r.users),
        "accounts": list(r.accounts),
        "flags": rules.format_flags(r.flags).split(",") if r.flags else [],
        "partition": r.partition,
        "state": r.state(now),
        "created_by": row["created_by"],
        "created_at": row["created_at"],
        "updated_by": row.get("updated_by"),
        "updated_at": row.get("updated_at"),
    }


def _time(value: float | str, now: float, what: str) -> float:
    if isinstance(value, int | float):
        if not math.isfinite(value) or not 0 <= value <= maintenance.MAX_EPOCH:
            raise InvalidSpec(f"{what}: {value!r} is not a time", field=what.lower())
        return float(value)
    try:
        return maintenance.parse_start(value, now)
    except ValueError as e:
        raise InvalidSpec(f"{what}={value}: {e}", field=what.lower()) from None


def _duration(value: float | str) -> float:
    if isinstance(value, int | float):
        if not math.isfinite(value) or value <= 0:
            raise InvalidSpec(
                f"Duration: {value!r}: give a positive duration ({maintenance.DURATION_FORMS})",
                field="duration",
            )
        return float(value)
    try:
        return float(maintenance.parse_window_duration(value))
    except ValueError as e:
        raise InvalidSpec(str(e).replace("window", "reservation"), field="duration") from None


def _lists(body: ReservationChange) -> dict[str, Any]:
    """The parsed fields other than the times, for the store (only those given)."""
    out: dict[str, Any] = {}
    try:
        if body.users is not None:
            out["users"] = rules.parse_names(",".join(body.users), "Users")
        if body.accounts is not None:
            out["accounts"] = rules.parse_names(",".join(body.accounts), "Accounts")
        if body.flags is not None:
            out["flags"] = sorted(rules.parse_flags(",".join(body.flags)) - {"SPEC_NODES"})
    except ValueError as e:
        raise InvalidSpec(str(e), field="flags") from None
    if body.partition is not None:
        out["partition"] = body.partition.strip() or None
    if body.nodes is not None and body.node_count is not None:
        raise InvalidSpec("give Nodes= or NodeCnt=, not both", field="nodes")
    if body.nodes is not None:
        out["nodes_expr"] = body.nodes
    if body.node_count is not None:
        out["node_count"] = body.node_count
    return out


def router(ctl: Any) -> APIRouter:
    """The endpoints, bound to a controller (`runtime.Controller`)."""
    r = APIRouter()

    @r.post("/v1/reservations", status_code=201)
    def create_reservation(body: ReservationIn, request: Request) -> dict[str, Any]:
        now = time.time()
        try:
            name = rules.check_name(body.name)
        except ValueError as e:
            raise InvalidSpec(str(e), field="name") from None
        fields = _lists(body)
        if body.start is None:
            raise InvalidSpec("StartTime= is required (e.g. StartTime=now)", field="start")
        start = _time(body.start, now, "StartTime")
        if (body.duration is None) == (body.end is None):
            raise InvalidSpec(
                "give the reservation either Duration= (minutes, or HH:MM:SS) or EndTime=",
                field="duration",
            )
        if body.duration is not None:
            end = start + _duration(body.duration)
        else:
            assert body.end is not None
            end = _time(body.end, now, "EndTime")
        row = ctl.store.create_reservation(
            name,
            start=start,
            end=end,
            nodes_expr=fields.get("nodes_expr"),
            node_count=fields.get("node_count"),
            users=fields.get("users", ()),
            accounts=fields.get("accounts", ()),
            flags=fields.get("flags", ()),
            partition=fields.get("partition"),
            actor=request.state.identity.actor,
        )
        ctl.kick()  # pending jobs may have to avoid its nodes from now on
        return {"reservation": reservation_view(row)}

    @r.get("/v1/reservations")
    def list_reservations() -> dict[str, Any]:
        now = time.time()
        return {"reservations": [reservation_view(x, now) for x in ctl.store.list_reservations()]}

    @r.get("/v1/reservations/{name}")
    def show_reservation(name: str = NAME) -> dict[str, Any]:
        return {"reservation": reservation_view(ctl.store.get_reservation(name))}

    @r.post("/v1/reservations/{name}/update")
    def update_reservation(
        body: ReservationChange, request: Request, name: str = NAME
    ) -> dict[str, Any]:
        now = time.time()
        changes = _lists(body)
        if body.start is not None:
            changes["start"] = _time(body.start, now, "StartTime")
        if body.duration is not None and body.end is not None:
            raise InvalidSpec("give Duration= or EndTime=, not both", field="duration")
        if body.duration is not None:
            changes["duration"] = _duration(body.duration)
        if body.end is not None:
            changes["end"] = _time(body.end, now, "EndTime")
        if not changes:
            raise InvalidSpec(
                "nothing to change: give StartTime=, Duration=, EndTime=, Nodes=, NodeCnt=, "
                "Users=, Accounts=, Flags= or PartitionName=",
                field="name",
            )
        row = ctl.store.update_reservation(name, changes, request.state.identity.actor)
        ctl.kick()
        return {"reservation": reservation_view(row)}

    @r.delete("/v1/reservations/{name}")
    def delete_reservation(request: Request, name: str = NAME) -> dict[str, Any]:
        row = ctl.store.delete_reservation(name, request.state.identity.actor)
        ctl.kick()  # its nodes are free for every job again
        return {"reservation": reservation_view(row)}

    return r
