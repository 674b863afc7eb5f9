"""`phalanx explain JOB` (why it waits, or why it ended) and `phalanx eff JOB` (like seff).

Both only print what the controller computes: the explanation comes whole from
GET /v1/jobs/{ref}/explain, the efficiency from the job's view (its ``attempts`` with the usage
the agents measured), formatted by `domain/efficiency.py`.
"""

from __future__ import annotations

import time

import typer

from phalanx.cli import output
from phalanx.cli.output import JsonOpt, UrlOpt
from phalanx.domain import efficiency
from phalanx.domain.text import escape


def explain(
    ref: str = typer.Argument(..., help="job id (123, or 123_4 for an array task)"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Why a job waits (per constraint and node, with estimates), or why it failed or was
    requeued (the retry rule, the node, the health reason)."""
    with output.client(url) as c:
        out = output.run(lambda: c.explain(ref))
    if as_json:
        output.emit(out)
        return
    # the lines quote stored text (job names, reasons): escaped, and never read as markup
    summary = escape(f"job {out['job']} {out['state']}: {out['summary']}")
    output.console.print(summary, highlight=False, markup=False)
    for line in out["lines"]:
        output.console.print(f"  {escape(line)}", highlight=False, soft_wrap=True, markup=False)


def eff(
    ref: str = typer.Argument(..., help="job id (123, or 123_4 for an array task)"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """How efficiently a job used what it asked for, like Slurm's seff: CPU and memory
    utilised against the allocation, wall time against the limit, GPU figures."""
    with output.client(url) as c:
        jobs = output.run(lambda: c.job(ref))
    now = time.time()
    if as_json:
        output.emit(
            [
                {
                    "job": j["job_id"],
                    "state": j["state"],
                    "usage": efficiency.job_usage(j.get("attempts") or [], now),
                }
                for j in jobs
            ]
        )
        return
    for i, j in enumerate(jobs):
        if i:
            output.console.print("")
        if "attempts" in j and j.get("usage", "redacted") == "redacted":
            output.fail(f"the usage of job {j['job_id']} is private to {j['user']}")
        for line in efficiency.report(j, j.get("attempts") or [], now):
            output.console.print(escape(line), highlight=False, soft_wrap=True, markup=False)


def register(app: typer.Typer) -> None:
    app.command()(explain)
    app.command()(eff)
