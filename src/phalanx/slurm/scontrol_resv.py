"""`scontrol create|update|delete|show reservation` and `sinfo -T`, as Slurm 22.05 prints them.

Keys are Slurm's, in any case (`ReservationName=`, `StartTime=`, `EndTime=`, `Duration=`,
`Nodes=`, `NodeCnt=`, `Users=`, `Accounts=`, `Flags=`, `PartitionName=`); times are parsed
here, in the caller's zone, and sent as epoch seconds. What Phalanx's reservations cannot
hold (`Groups=`, `Licenses=`, `CoreCnt=`, ...) is refused by name with why. The formatting
functions are pure.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from phalanx.api_calls import ApiCalls
from phalanx.domain import maintenance, reservations
from phalanx.errors import Conflict, InvalidSpec, NotFound
from phalanx.slurm.common import SlurmUsageError, duration_full, timestamp

_CORES = "reservations here hold whole nodes"
REFUSED_KEYS = {
    "groups": "reservations are for users and accounts here: give Users= or Accounts=",
    "licenses": "reservations hold nodes, not licences",
    "corecnt": _CORES,
    "core": _CORES,
    "features": "give the nodes with Nodes= (or NodeCnt= with PartitionName=)",
    "burstbuffer": "no burst buffers",
    "tres": "give Nodes= or NodeCnt=: reservations hold whole nodes",
    "watts": "no power management",
    "maxstartdelay": "reservations here have no floating start",
    "skip": "recurring reservations are not supported",
    "nodecnt_per": _CORES,
}
NAME_KEYS = ("reservationname", "reservation")
_KEYS = {
    "starttime": "start",
    "endtime": "end",
    "duration": "duration",
    "nodes": "nodes",
    "nodelist": "nodes",
    "nodecnt": "node_count",
    "nodecount": "node_count",
    "users": "users",
    "user": "users",
    "accounts": "accounts",
    "account": "accounts",
    "flags": "flags",
    "partitionname": "partition",
    "partition": "partition",
}


class ResvError(Exception):
    """A failed reservation command: printed as is, exit 1 (as Slurm's scontrol)."""


def parse(words: Sequence[str], now: float, *, what: str) -> tuple[str | None, dict[str, Any]]:
    """`ReservationName=N StartTime=now Duration=60 Nodes=n[1-2] Users=a` (keys in any case)
    to (name, the API's body). `what`: "created" or "updated", for Slurm's error tail."""
    name: str | None = None
    body: dict[str, Any] = {}
    tail = f"No reservation {what}." if what == "created" else "Request aborted."
    for word in words:
        key, eq, value = word.partition("=")
        k = key.lower()
        if k.endswith(("+", "-")) and eq:
            raise SlurmUsageError(
                f"{word}: adding to or taking from a list with {key[-1]}= is not supported "
                f"here; give the whole list ({key[:-1]}=a,b)"
            )
        if not eq:
            raise SlurmUsageError(f"Unknown parameter {word}.  {tail} (use Key=Value)")
        if k in NAME_KEYS:
            name = value.strip()
            continue
        if k in REFUSED_KEYS:
            raise SlurmUsageError(f"{key}= is not supported here: {REFUSED_KEYS[k]}.  {tail}")
        field = _KEYS.get(k)
        if field is None:
            raise SlurmUsageError(f"Unknown parameter {word}.  {tail}")
        body[field] = _value(field, key, value, now)
    return name, body


def _value(field: str, key: str, value: str, now: float) -> Any:
    try:
        if field in ("start", "end"):
            return maintenance.parse_start(value, now)
        if field == "duration":
            if value.strip().upper() in ("UNLIMITED", "INFINITE"):
                raise ValueError(
                    "a reservation needs an end here: give minutes, HH:MM:SS or D-HH:MM:SS"
                )
            return float(maintenance.parse_window_duration(value))
        if field == "node_count":
            if not value.strip().isdecimal() or int(value) < 1:
                raise ValueError("give a node count, e.g. NodeCnt=2")
            return int(value)
        if field in ("users", "accounts"):
            return list(reservations.parse_names(value, key.capitalize()))
        if field == "flags":
            return sorted(reservations.parse_flags(value))
    except ValueError as e:
        raise SlurmUsageError(f"{key}={value}: {e}") from None
    return value.strip()


# ---------------------------------------------------------------------------- commands
def create(cli: ApiCalls, words: list[str], now: float) -> int:
    if words and words[0].lower() in ("reservation", "res", "reservations") and "=" not in words[0]:
        words = words[1:]
    name, body = parse(words, now, what="created")
    if not name:
        raise SlurmUsageError(
            "ReservationName= is required here (e.g. ReservationName=maint_rack3).  "
            "No reservation created."
        )
    try:
        res = cli.create_reservation({"name": name, **body})
    except (InvalidSpec, Conflict) as e:
        raise ResvError(f"Error creating the reservation: {e.message}") from None
    sys.stdout.write(f"Reservation created: {res['name']}\n")
    return 0


def update(cli: ApiCalls, words: list[str], now: float) -> int:
    name, body = parse(words, now, what="updated")
    assert name is not None  # the caller saw ReservationName= first
    try:
        cli.update_reservation(name, body)
    except NotFound:
        raise ResvError(
            "Error updating the reservation: Requested reservation is invalid\n"
            f"slurm_update error: Requested reservation is invalid ({name} does not exist: "
            "`scontrol show reservation` lists them)"
        ) from None
    except (InvalidSpec, Conflict) as e:
        raise ResvError(
            f"Error updating the reservation: {e.message}\nslurm_update error: {e.message}"
        ) from None
    sys.stdout.write("Reservation updated.\n")
    return 0


def delete(cli: ApiCalls, words: list[str]) -> int:
    """`delete ReservationName=N`, `delete reservation=N`, `delete reservation N`."""
    text = " ".join(words)
    if not words:
        raise SlurmUsageError("delete: give ReservationName=<name>")
    key, eq, value = words[0].partition("=")
    if key.lower() not in (*NAME_KEYS, "res") or (not eq and len(words) != 2) or len(words) > 2:
        raise SlurmUsageError(
            f"delete {text}: only reservations can be deleted here (ReservationName=<name>)"
        )
    name = value if eq else words[1]
    try:
        cli.delete_reservation(name)
    except NotFound:
        raise ResvError(
            f"delete_reservation {text}: Requested reservation is invalid ({name} does not "
            "exist: `scontrol show reservation` lists them)"
        ) from None
    except Conflict as e:
        raise ResvError(f"delete_reservation {text}: {e.message}") from None
    return 0


def show_blocks(cli: ApiCalls, rest: list[str], now: float) -> list[list[str]]:
    """The records of `scontrol show reservation [NAME]` ([] when there is none)."""
    if rest:
        try:
            found = [cli.reservation(rest[0])]
        except NotFound:
            raise ResvError(f"Reservation {rest[0]} not found") from None
    else:
        found = cli.reservations()
    if not found:
        return []
    cpus = {n["name"]: int(n.get("cpus") or 0) for n in cli.nodes()}
    return [lines(r, cpus, now) for r in found]


def lines(resv: dict[str, Any], cpus: dict[str, int], now: float) -> list[str]:
    """One reservation as Slurm 22.05's `scontrol show reservation` prints it."""
    names = list(resv.get("node_names") or [])
    cores = sum(cpus.get(n, 0) for n in names)
    flags = reservations.format_flags(resv.get("flags") or [])
    state = "ACTIVE" if resv["start"] <= now < resv["end"] else "INACTIVE"
    return [
        f"ReservationName={resv['name']} StartTime={timestamp(resv['start'])} "
        f"EndTime={timestamp(resv['end'])} Duration={duration_full(resv['end'] - resv['start'])}",
        f"Nodes={resv.get('nodes') or '(null)'} NodeCnt={len(names)} CoreCnt={cores} "
        f"Features=(null) PartitionName={resv.get('partition') or '(null)'} Flags={flags}",
        f"TRES=cpu={cores}",
        f"Users={','.join(resv.get('users') or []) or '(null)'} Groups=(null) "
        f"Accounts={','.join(resv.get('accounts') or []) or '(null)'} Licenses=(null) "
        f"State={state} BurstBuffer=(null) Watts=n/a",
        "MaxStartDelay=(null)",
    ]


def sinfo_lines(found: list[dict[str, Any]], now: float, *, header: bool = True) -> str:
    """`sinfo -T`: Slurm's columns (the name as wide as the longest, the rest right-aligned)."""
    width = max([9, *(len(r["name"]) for r in found)])
    out = []
    if header:
        out.append(
            f"{'RESV_NAME':<{width}}{'STATE':>10}{'START_TIME':>21}{'END_TIME':>21}"
            f"{'DURATION':>13}  NODELIST"
        )
    for r in found:
        state = "ACTIVE" if r["start"] <= now < r["end"] else "INACTIVE"
        out.append(
            f"{r['name']:<{width}}{state:>10}{timestamp(r['start']):>21}"
            f"{timestamp(r['end']):>21}{duration_full(r['end'] - r['start']):>13}  "
            f"{r.get('nodes') or '(null)'}"
        )
    return "".join(x + "\n" for x in out)
