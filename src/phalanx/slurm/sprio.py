"""``sprio``: pending jobs' priority factor by factor (``GET /v1/jobs/{ref}/priority``).

Columns ``JOBID PARTITION PRIORITY SITE AGE FAIRSHARE JOBSIZE PARTITION QOS`` (each factor's
weighted value, as Slurm prints them; SITE is always 0 here); ``-l`` adds USER and NICE and
shows ACCOUNT; ``-n`` normalized factors (0..1) instead of weighted; ``-w`` prints the weights;
``-j`` and ``-u`` choose jobs (default: every pending job the caller may read: their own, or
all for operators and admins); ``-h`` drops the header.
"""

from __future__ import annotations

from typing import Any

from phalanx.domain.priority import FACTORS
from phalanx.slurm.common import (
    SlurmParser,
    add_clusters,
    check_clusters,
    client,
    refuse,
    run_command,
    split_list,
)

PROG = "sprio"


def parser() -> SlurmParser:
    p = SlurmParser(PROG, description="Pending jobs' priority factors.", add_help=False)
    p.add_argument("--help", action="help")
    p.add_argument("-j", "--jobs", action="append", help="only these jobs")
    p.add_argument("-u", "--user", action="append", help="only these users' jobs")
    p.add_argument("-l", "--long", action="store_true")
    p.add_argument("-n", "--norm", action="store_true", help="factors, not weighted")
    p.add_argument("-w", "--weights", action="store_true", help="print the weights")
    p.add_argument("-h", "--noheader", action="store_true")
    add_clusters(p)
    refuse(p, "-o", "--format", why="the columns are fixed here", nargs=1)
    refuse(p, "-S", "--sort", why="the order is the queue's", nargs=1)
    return p


def line(job: dict[str, Any], *, long: bool, norm: bool) -> str:
    vals = job["factors"] if norm else job["products"]
    fmt = (lambda v: f"{v:>10.7f}") if norm else (lambda v: f"{v:>10.0f}")
    head = f"{job['job_id']:>8} {job['partition'] or '':<9} "
    if long:
        head += f"{job['user']:<8} {job['account']:<10} "
    prio = f"{job['priority']:>10} {0:>10} " if not norm else f"{'':>10} {0:>10.7f} "
    tail = f" {job['nice']:>6}" if long else ""
    return head + prio + " ".join(fmt(vals[k]) for k in FACTORS) + tail


def header(*, long: bool) -> str:
    head = f"{'JOBID':>8} {'PARTITION':<9} "
    if long:
        head += f"{'USER':<8} {'ACCOUNT':<10} "
    cols = f"{'PRIORITY':>10} {'SITE':>10} " + " ".join(
        f"{n:>10}" for n in ("AGE", "FAIRSHARE", "JOBSIZE", "PARTITION", "QOS")
    )
    return head + cols + (f" {'NICE':>6}" if long else "")


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    with client() as c:
        check_clusters(c, args.clusters)
        if args.weights:
            weights = c.get("/v1/share")["weights"]
            if not args.noheader:
                print(header(long=False))
            print(
                f"{'Weights':<19}{'':>10} {0:>10} "
                + " ".join(f"{weights.get(k, 0):>10}" for k in FACTORS)
            )
            return 0
        pending = c.jobs(state="PENDING", limit=100_000)
        partition = {str(j["id"]): j.get("partition") for j in pending}
        refs = split_list(args.jobs)
        if not refs:
            users = split_list(args.user)
            me = c.get("/v1/whoami")
            if not users and me["role"] == "user":
                users = [me["user"]]  # a user may read only their own jobs' factors
            refs = [str(j["id"]) for j in pending if not users or j["user"] in users]
        from phalanx.api_calls import seg

        jobs = [
            j
            for ref in refs
            for j in c.get(f"/v1/jobs/{seg(ref, 'job id')}/priority")["jobs"]
            if j["state"] == "PENDING"
        ]
    if not args.noheader:
        print(header(long=args.long))
    for j in jobs:
        j["partition"] = partition.get(str(j["job_id"]))
        print(line(j, long=args.long, norm=args.norm))
    return 0
