"""`phalanx maint add|list|remove`: maintenance windows (like `scontrol create reservation
flags=maint`, with the scheduler doing the draining and the requeueing).

Times are parsed here, in the operator's own time zone, and sent as epoch seconds.
"""

from __future__ import annotations

import time
from typing import Any

import typer
from rich.table import Table

from phalanx.cli import output
from phalanx.cli.output import JsonOpt, UrlOpt
from phalanx.domain import maintenance as rules
from phalanx.domain.values import format_duration

app = typer.Typer(
    help="Maintenance windows: keep jobs off nodes, checkpoint and requeue, drain, return.",
    no_args_is_help=True,
)


def _describe(w: dict[str, Any], now: float) -> str:
    start, end = w["start"], w["end"]
    if start > now:
        when = f"starts in {format_duration(start - now)}"
    elif end > now:
        when = f"under way, {format_duration(end - now)} left"
    else:
        when = "over"
    return (
        f"maintenance {w['id']}: {w['nodes']} from {rules.format_when(start, now)} to "
        f"{rules.format_when(end, now)} ({when}, {w['state']})"
        + (f": {w['reason']}" if w.get("reason") else "")
    )


@app.command("add")
def add(
    nodes: str = typer.Option(..., "--nodes", "-w", help="hostlist, e.g. node[01-04]"),
    start: str = typer.Option(
        ..., "--start", help="now, now+10min, 15:00, 2026-12-02T15:00, ISO, or epoch seconds"
    ),
    duration: str | None = typer.Option(
        None, "--duration", help="90s, 10min, 4h, 2d or a Slurm time (30 = 30 minutes, 2:00:00)"
    ),
    end: str | None = typer.Option(None, "--end", help="instead of --duration: like --start"),
    reason: str | None = typer.Option(None, "--reason", help="shown as the nodes' drain reason"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Add a maintenance window (crossing jobs kept off, running ones requeued, nodes drained)."""
    now = time.time()
    try:
        start_t, end_t = rules.resolve_times(start, duration, end, now)
    except ValueError as e:
        output.fail(str(e))
    with output.client(url) as c:
        w = output.run(
            lambda: c.add_maintenance(nodes, start_t, duration=end_t - start_t, reason=reason)
        )
    if as_json:
        output.emit(w)
        return
    for warning in w.get("warnings") or []:
        output.say("warning:", "yellow", warning)
    output.console.print(_describe(w, time.time()), highlight=False)


@app.command("list")
def list_(
    all_: bool = typer.Option(False, "--all", "-a", help="also done and removed windows"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List maintenance windows (scheduled and active; --all for past ones too)."""
    with output.client(url) as c:
        ws = output.run(lambda: c.maintenance(all=all_))
    if as_json:
        output.emit(ws)
        return
    output.console.print(windows_table(ws, time.time()))


@app.command("remove")
def remove(
    wid: int = typer.Argument(..., metavar="ID", help="the window's id (`phalanx maint list`)"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Remove a maintenance window; an active one returns the nodes it drained at once."""
    with output.client(url) as c:
        res = output.run(lambda: c.remove_maintenance(wid))
    if as_json:
        output.emit(res)
        return
    msg = f"maintenance {wid} removed"
    if res.get("returned"):
        from phalanx.domain.hostlist import compress_hostlist

        msg += f"; returned {compress_hostlist(res['returned'])}"
    output.console.print(msg, highlight=False)


def windows_table(ws: list[dict[str, Any]], now: float) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("ID", "NODES", "START", "END", "DURATION", "STATE", "BY", "REASON"):
        t.add_column(col)
    for w in ws:
        t.add_row(
            str(w["id"]),
            w["nodes"],
            rules.format_when(w["start"], now),
            rules.format_when(w["end"], now),
            format_duration(w["duration_s"]),
            w["state"],
            w["created_by"],
            w["reason"] or "",
        )
    return t
