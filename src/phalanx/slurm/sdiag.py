"""``sdiag``: the scheduler's statistics in Slurm's layout (``GET /v1/diag``: controller/diag.py).

Printed as Slurm 22.05's sdiag prints them, for the lines Phalanx has figures for: the header
with "Data since" (the controller's start), "Server thread count", jobs submitted, started,
completed, canceled and failed since then, jobs pending and running now, the main schedule
statistics (the controller's scheduling passes, in microseconds) and the API calls by route
("Remote Procedure Call statistics by message type": count, ave_time and total_time in
microseconds; by count, or ``-i`` by name, ``-t`` by total time, ``-T`` by average time).
Slurm's agent queue, DBD, backfill and per-user RPC sections have no counterpart and are left
out.  ``-r/--reset`` is refused: the counters are the controller's own since it started.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from phalanx.slurm.common import (
    SlurmParser,
    add_clusters,
    check_clusters,
    client,
    refuse,
    run_command,
)

PROG = "sdiag"
RULE = "*" * 55


def parser() -> SlurmParser:
    p = SlurmParser(PROG, description="The scheduler's statistics.", add_help=False)
    p.add_argument("-h", "--help", "--usage", action="help")
    p.add_argument("-a", "--all", action="store_true", help="all statistics (the default)")
    p.add_argument("-i", "--sort-by-id", action="store_true", help="calls by name")
    p.add_argument("-t", "--sort-by-time", action="store_true", help="calls by total time")
    p.add_argument("-T", "--sort-by-time2", action="store_true", help="calls by average time")
    add_clusters(p)
    refuse(
        p, "-r", "--reset", why="the counters are the controller's own since it started", nargs=0
    )
    return p


def _stamp(t: float) -> str:
    return f"{time.strftime('%a %b %d %H:%M:%S %Y', time.localtime(t))} ({int(t)})"


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def render(d: Mapping[str, Any], *, sort: str = "count") -> str:
    """sdiag's text from the ``/v1/diag`` view. `sort`: count, id, time or time2."""
    lines = [
        RULE,
        f"sdiag output at {_stamp(d['now'])}",
        f"Data since      {_stamp(d['since'])}",
        RULE,
        f"Server thread count:  {d['server_threads']}",
        "",
        f"Jobs submitted: {d['jobs_submitted']}",
        f"Jobs started:   {d['jobs_started']}",
        f"Jobs completed: {d['jobs_completed']}",
        f"Jobs canceled:  {d['jobs_canceled']}",
        f"Jobs failed:    {d['jobs_failed']}",
        "",
        f"Job states ts:  {_stamp(d['now'])}",
        f"Jobs pending:   {d['jobs_pending']}",
        f"Jobs running:   {d['jobs_running']}",
        "",
        "Main schedule statistics (microseconds):",
        f"\tLast cycle:   {_us(d['pass_last_s'])}",
        f"\tMax cycle:    {_us(d['pass_max_s'])}",
        f"\tTotal cycles: {d['passes']}",
        f"\tMean cycle:   {_us(d['pass_mean_s'])}",
        f"\tCycles per minute: {_per_minute(d)}",
        f"\tLast queue length: {d['jobs_pending']}",
        "",
        "Remote Procedure Call statistics by message type",
    ]
    calls = [
        (f"{c['method']} {c['route']}", int(c["count"]), _us(float(c["total_s"])))
        for c in d["rpcs"]
    ]
    order = {
        "count": lambda c: (-c[1], c[0]),
        "id": lambda c: c[0],
        "time": lambda c: (-c[2], c[0]),
        "time2": lambda c: (-(c[2] // max(c[1], 1)), c[0]),
    }[sort]
    for name, count, total in sorted(calls, key=order):
        lines.append(
            f"\t{name:<40} count:{count:<6} ave_time:{total // max(count, 1):<6} total_time:{total}"
        )
    return "\n".join(lines) + "\n"


def _per_minute(d: Mapping[str, Any]) -> int:
    minutes = (float(d["now"]) - float(d["since"])) / 60.0
    return int(d["passes"] / minutes) if minutes >= 1.0 else int(d["passes"])


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    opts = parser().parse_args(argv)
    sort = (
        "id"
        if opts.sort_by_id
        else "time"
        if opts.sort_by_time
        else "time2"
        if opts.sort_by_time2
        else "count"
    )
    with client() as c:
        check_clusters(c, opts.clusters)
        view = c.get("/v1/diag")
    sys.stdout.write(render(view, sort=sort))
    return 0
