"""``sshare``: the fair share tree as Slurm prints it (``GET /v1/share``).

Default columns ``Account User RawShares NormShares RawUsage EffectvUsage FairShare``; ``-l``
adds ``LevelFS``. Without ``-a`` the users listed are the caller's own (accounts are always
shown, as Slurm does); ``-A`` and ``-u`` filter; ``-n`` drops the header; ``-p``/``-P`` print
``|``-separated values (``-p`` with a trailing ``|``). The arithmetic is docs/fairshare.md's.
"""

from __future__ import annotations

from typing import Any

from phalanx.slurm.common import (
    SlurmParser,
    add_clusters,
    check_clusters,
    client,
    refuse,
    run_command,
    split_list,
)

PROG = "sshare"
COLUMNS = [
    ("Account", 20, "<"),
    ("User", 10, ">"),
    ("RawShares", 10, ">"),
    ("NormShares", 11, ">"),
    ("RawUsage", 11, ">"),
    ("EffectvUsage", 13, ">"),
    ("FairShare", 10, ">"),
]
LEVEL_FS = ("LevelFS", 10, ">")


def parser() -> SlurmParser:
    p = SlurmParser(PROG, description="Fair share of accounts and users.")
    p.add_argument("-a", "--all", action="store_true", help="every user, not only yours")
    p.add_argument("-A", "--accounts", action="append", help="only these accounts")
    p.add_argument("-u", "--users", action="append", help="only these users")
    p.add_argument("-l", "--long", action="store_true", help="add the level fair share")
    p.add_argument("-n", "--noheader", action="store_true")
    p.add_argument("-p", "--parsable", action="store_true", help="'|' separated, trailing '|'")
    p.add_argument("-P", "--parsable2", action="store_true", help="'|' separated")
    add_clusters(p)
    refuse(p, "-o", "--format", why="the columns are fixed here (use --json)", nargs=1)
    p.add_argument("--json", action="store_true", help="the API's answer")
    return p


def _num(x: float | None) -> str:
    return "inf" if x is None else f"{x:.6f}"


def rows_for(
    data: dict[str, Any], me: str, *, all_users: bool, accounts: list[str], users: list[str]
) -> list[list[str]]:
    """The values of each row to print (pure: `data` is `GET /v1/share`'s answer)."""
    out = []
    for r in data["rows"]:
        if accounts and r["account"] not in accounts:
            continue
        if r["user"] is not None:
            if users and r["user"] not in users:
                continue
            if not all_users and not users and r["user"] != me:
                continue
        elif users:
            continue
        out.append(
            [
                " " * r["depth"] + r["account"],
                r["user"] or "",
                str(r["raw_shares"]),
                _num(r["norm_shares"]),
                f"{r['raw_usage']:.0f}",
                _num(r["effective_usage"]),
                _num(r["fairshare"]) if r["fairshare"] is not None else "",
                _num(r["level_fs"]),
            ]
        )
    return out


def render(rows: list[list[str]], *, long: bool, header: bool, sep: str | None) -> list[str]:
    cols = COLUMNS + ([LEVEL_FS] if long else [])
    width = len(cols)
    lines = []
    if sep is not None:
        if header:
            lines.append(sep.join(c[0] for c in cols))
        return lines + [sep.join(r[:width]) for r in rows]
    if header:
        lines.append(" ".join(f"{c[0]:{c[2]}{c[1]}}" for c in cols))
        lines.append(" ".join("-" * c[1] for c in cols))
    for r in rows:
        lines.append(" ".join(f"{v[: c[1]]:{c[2]}{c[1]}}" for v, c in zip(r, cols, strict=False)))
    return lines


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    import json

    args = parser().parse_args(argv)
    with client() as c:
        check_clusters(c, args.clusters)
        data = c.get("/v1/share")
        me = c.get("/v1/whoami")["user"]
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = rows_for(
        data,
        me,
        all_users=args.all,
        accounts=split_list(args.accounts),
        users=split_list(args.users),
    )
    sep = "|" if args.parsable or args.parsable2 else None
    for line in render(rows, long=args.long, header=not args.noheader, sep=sep):
        print(line + ("|" if args.parsable else ""))
    return 0
