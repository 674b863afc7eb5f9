"""`phalanx share` (like `sshare -l`) and `phalanx priority JOB` (like `sprio -l`): the numbers
behind the queue's order, printed so a user can redo the arithmetic (docs/fairshare.md)."""

from __future__ import annotations

from typing import Any

import typer

from phalanx.cli import output
from phalanx.cli.output import JsonOpt, UrlOpt


def _num(x: float | None, digits: int = 6) -> str:
    if x is None:
        return "inf"
    return f"{x:.{digits}f}"


def share_lines(data: dict[str, Any]) -> list[str]:
    """The tree as sshare prints it: accounts indented by depth, users under them."""
    head = (
        f"{'Account':<20} {'User':<12} {'RawShares':>9} {'NormShares':>10} {'RawUsage':>14} "
        f"{'EffectvUsage':>12} {'LevelFS':>10} {'FairShare':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in data["rows"]:
        name = " " * r["depth"] + r["account"]
        lines.append(
            f"{name:<20} {r['user'] or '':<12} {r['raw_shares']:>9} "
            f"{_num(r['norm_shares']):>10} {r['raw_usage']:>14.0f} "
            f"{_num(r['effective_usage']):>12} {_num(r['level_fs'], 4):>10} "
            f"{_num(r['fairshare']) if r['fairshare'] is not None else '':>9}"
        )
    hl = data["half_life_s"]
    lines.append("")
    lines.append(
        f"{data['users']} user associations ranked: FairShare = rank / {data['users']}; "
        "LevelFS = NormShares / EffectvUsage among siblings (inf: no usage); usage is "
        f"CPU-s x {data['charge']['cpu']:g} + GPU-s x {data['charge']['gpu']:g}, halved every "
        + (f"{hl / 86400:g} days" if hl else "never (no decay)")
    )
    return lines


def priority_lines(jobs: list[dict[str, Any]]) -> list[str]:
    """sprio's table, then each job's factors as arithmetic."""
    head = (
        f"{'JOBID':>8} {'USER':<10} {'ACCOUNT':<12} {'PRIORITY':>9} {'AGE':>7} "
        f"{'FAIRSHARE':>9} {'JOBSIZE':>7} {'PARTITION':>9} {'QOS':>7} {'NICE':>6}"
    )
    lines = [head]
    for j in jobs:
        p = j["products"]
        lines.append(
            f"{j['job_id']:>8} {j['user']:<10} {j['account']:<12} {j['priority']:>9} "
            f"{p['age']:>7.0f} {p['fairshare']:>9.0f} {p['jobsize']:>7.0f} "
            f"{p['partition']:>9.0f} {p['qos']:>7.0f} {j['nice']:>6}"
        )
    for j in jobs:
        lines.append("")
        lines.append(f"job {j['job_id']} ({j['state']}, account {j['account']}, QOS {j['qos']}):")
        lines.append(f"  {'factor':<10} {'weight':>6}   {'value':<8}   {'product':>12}")
        lines.extend("  " + x for x in j["explain"])
    return lines


def share(url: str | None = UrlOpt, as_json: bool = JsonOpt) -> None:
    """Fair share of every account and user (like `sshare -l -a`)."""
    with output.client(url) as c:
        data = output.run(lambda: c.get("/v1/share"))
    if as_json:
        output.emit(data)
        return
    for line in share_lines(data):
        output.console.print(line, highlight=False, soft_wrap=True)


def priority(
    job: str = typer.Argument(..., help="job id (123 or 123_4)"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """A job's priority factor by factor (like `sprio -l -j JOB`), with the arithmetic."""
    from phalanx.api_calls import seg

    with output.client(url) as c:
        data = output.run(lambda: c.get(f"/v1/jobs/{seg(job, 'job id')}/priority"))
    if as_json:
        output.emit(data)
        return
    for line in priority_lines(data["jobs"]):
        output.console.print(line, highlight=False, soft_wrap=True)
