"""`sreport`: cluster and user utilisation from the history kept, in Slurm 22.05's reports.

`GET /v1/report/usage` sums the window's CPU-seconds (domain/usage_report.py); this prints
them as sreport does: the banner (report name, window, units), the columns of its default
format or `format=`, fixed-width or `-p`/`-P`. Reports: `cluster Utilization`,
`cluster AccountUtilizationByUser` (`tree`), `cluster UserUtilizationByAccount`,
`user TopUsage` (`topcount=`), with `start=`, `end=`, `users=`, `accounts=`, and `-t` in
every time format Slurm has. Report and condition names take Slurm's abbreviations. The
window is exact to the second (Slurm's rolls up by the hour); without `start=`/`end=` it is
yesterday, as in Slurm. WCKey, job-size and reservation reports are refused by name.
"""

from __future__ import annotations

import pwd
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.domain.slurmtime import parse_time
from phalanx.slurm.common import SlurmParser, SlurmUsageError, client, run_command

PROG = "sreport"
RULE = "-" * 80

# -t: (name, shortest abbreviation, what the banner says, divisor, with percent, only percent)
TIME_FORMATS = (
    ("secper", 6, "Seconds/Percentage of Total", 1, True, False),
    ("minper", 6, "Minutes/Percentage of Total", 60, True, False),
    ("hourper", 6, "Hours/Percentage of Total", 3600, True, False),
    ("seconds", 1, "Seconds", 1, False, False),
    ("minutes", 1, "Minutes", 60, False, False),
    ("hours", 1, "Hours", 3600, False, False),
    ("percent", 1, "Percentage of Total", 1, False, True),
)


@dataclass(frozen=True)
class TimeFormat:
    label: str
    divisor: int
    per: bool  # the value and its percent
    percent_only: bool

    def text(self, seconds: float, total: float) -> str:
        pct = 100.0 * seconds / total if total > 0 else 0.0
        if self.percent_only:
            return f"{pct:.2f}%"
        value = int(seconds) // self.divisor
        return f"{value}({pct:.2f}%)" if self.per else str(value)

    @property
    def banner(self) -> str:
        return self.label if self.percent_only else f"CPU {self.label}"


def time_format(text: str) -> TimeFormat:
    word = text.lower()
    for name, shortest, label, divisor, per, only in TIME_FORMATS:
        if len(word) >= min(shortest, len(name)) and name.startswith(word):
            return TimeFormat(label, divisor, per, only)
    raise SlurmUsageError(f"unknown time format {text} (use -t with one of {_format_names()})")


def _format_names() -> str:
    return ", ".join(n.capitalize() for n, *_ in TIME_FORMATS)


def _wide(tf: TimeFormat, normal: int, per: int) -> int:
    return per if tf.per else normal


# format= column names (Slurm's abbreviations: the shortest prefix each takes), header, width
@dataclass(frozen=True)
class Column:
    name: str
    shortest: int
    header: str
    width: Callable[[TimeFormat], int]


COLUMNS = (
    Column("accounts", 2, "Account", lambda tf: 15),
    Column("allocated", 2, "Allocated", lambda tf: _wide(tf, 12, 20)),
    Column("cluster", 2, "Cluster", lambda tf: 9),
    Column("down", 1, "Down", lambda tf: _wide(tf, 10, 18)),
    Column("idle", 1, "Idle", lambda tf: _wide(tf, 12, 20)),
    Column("login", 1, "Login", lambda tf: 9),
    Column("overcommitted", 1, "Over Comm", lambda tf: _wide(tf, 9, 18)),
    Column("planned", 2, "Planned", lambda tf: _wide(tf, 9, 18)),
    Column("planneddown", 2, "PLND Down", lambda tf: _wide(tf, 10, 18)),
    Column("proper", 2, "Proper Name", lambda tf: 15),
    Column("reported", 3, "Reported", lambda tf: _wide(tf, 12, 20)),
    Column("trescount", 5, "TRES Count", lambda tf: 10),
    Column("tresname", 5, "TRES Name", lambda tf: 14),
    Column("used", 1, "Used", lambda tf: _wide(tf, 10, 18)),
    Column("energy", 1, "Energy", lambda tf: _wide(tf, 10, 18)),
)
ALIASES = {"acct": "accounts", "reserved": "planned", "plnddown": "planneddown", "count": "trescount",
           "cpucount": "trescount"}  # fmt: skip


def column(text: str) -> Column:
    word = text.lower()
    word = ALIASES.get(word, word)
    # exact names first: "planned" is also a prefix of "planneddown"
    for c in COLUMNS:
        if word == c.name:
            return c
    for c in COLUMNS:
        if len(word) >= c.shortest and c.name.startswith(word):
            return c
    raise SlurmUsageError(f"Unknown field '{text}'")


# report -> (type, shortest abbreviation of the report, default format, banner)
REPORTS = {
    ("cluster", "utilization"): (2, "Cluster,Allocated,Down,PlannedDown,Idle,Planned,Reported"),
    ("cluster", "accountutilizationbyuser"): (1, "Cluster,Accounts,Login,Proper,Used,Energy"),
    ("cluster", "userutilizationbyaccount"): (18, "Cluster,Login,Proper,Accounts,Used,Energy"),
    ("user", "topusage"): (1, "Cluster,Login,Proper,Accounts,Used,Energy"),
}
REFUSED = {
    "userutilizationbywckey": "Phalanx keeps no WCKeys",
    "wckeyutilizationbyuser": "Phalanx keeps no WCKeys",
    "sizesbyaccount": "job size reports are not built yet; sacct has every job's size",
    "sizesbyaccountandwckey": "Phalanx keeps no WCKeys",
    "sizesbywckey": "Phalanx keeps no WCKeys",
}


def pick_report(kind: str, name: str) -> tuple[str, str]:
    k = kind.lower()
    if k.startswith("res") and "reservation".startswith(k):
        raise SlurmUsageError("reservation reports: Phalanx has no reservations yet")
    if k == "job" or (len(k) >= 2 and "job".startswith(k)):
        if name.lower() in REFUSED:
            raise SlurmUsageError(f"job {name}: {REFUSED[name.lower()]}")
        raise SlurmUsageError(f"job {name}: {REFUSED['sizesbyaccount']}")
    types = [t for t in ("cluster", "user") if len(k) >= 2 and t.startswith(k)]
    if not types:
        raise SlurmUsageError(f"Not valid report type {kind} (cluster or user)")
    n = name.lower()
    if n in REFUSED:
        raise SlurmUsageError(f"{types[0]} {name}: {REFUSED[n]}")
    for (t, report), (shortest, _) in REPORTS.items():
        if t == types[0] and len(n) >= shortest and report.startswith(n):
            return t, report
    raise SlurmUsageError(f"Not valid report {name} for {types[0]}")


@dataclass
class Conditions:
    start: float | None = None
    end: float | None = None
    users: list[str] | None = None
    accounts: list[str] | None = None
    fmt: list[str] | None = None
    tree: bool = False
    top: int = 10


def conditions(words: list[str], now: float) -> Conditions:
    """`start=... end=... users=a,b accounts=x format=... tree topcount=N` (Slurm's names
    and abbreviations; an unknown one is refused as sreport refuses it)."""
    c = Conditions()
    for w in words:
        key, eq, value = w.partition("=")
        k = key.lower()

        def is_(name: str, shortest: int, k: str = k) -> bool:
            return len(k) >= shortest and name.startswith(k)

        if not eq and is_("tree", 4):
            c.tree = True
        elif not eq and (is_("all_clusters", 1) or is_("group", 1)):
            pass  # one cluster; TopUsage lists each user's accounts apart, as without it
        elif eq and is_("start", 1):
            c.start = parse_time(value, now)
        elif eq and is_("end", 1):
            c.end = parse_time(value, now)
        elif eq and is_("users", 1):
            c.users = [u for u in value.split(",") if u]
        elif eq and (is_("accounts", 2) or k == "acct"):
            c.accounts = [a for a in value.split(",") if a]
        elif eq and is_("format", 1):
            c.fmt = [f for f in value.split(",") if f]
        elif eq and is_("topcount", 1):
            if not value.isdecimal():
                raise SlurmUsageError(f"topcount must be a number, not {value!r}")
            c.top = int(value)
        elif eq and is_("clusters", 1):
            pass  # checked against this cluster by the caller
        else:
            raise SlurmUsageError(f"Unknown condition: {w}")
    return c


def default_window(now: float) -> tuple[float, float]:
    """Yesterday, midnight to midnight (local time), sreport's default."""
    t = time.localtime(now)
    today = time.mktime((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0, 0, 0, -1))
    y = time.localtime(today - 12 * 3600)
    return time.mktime((y.tm_year, y.tm_mon, y.tm_mday, 0, 0, 0, 0, 0, -1)), today


def window(c: Conditions, now: float) -> tuple[float, float]:
    """The report's [start, end): yesterday by default; from `start=` to now; the day up to
    `end=`."""
    if c.start is None and c.end is None:
        return default_window(now)
    end = c.end if c.end is not None else now
    start = c.start if c.start is not None else end - 86400
    if end <= start:
        raise SlurmUsageError("the start time must come before the end time")
    return start, end


def proper_name(user: str) -> str:
    try:
        gecos = pwd.getpwnam(user).pw_gecos
    except KeyError:
        return ""
    return gecos.split(",")[0]


def rows_for(
    report: str, data: dict[str, Any], c: Conditions, tf: TimeFormat
) -> list[dict[str, str]]:
    """Each line's values by column name (pure but for the users' real names)."""
    cl = str(data["cluster"])
    if report == "utilization":
        total = float(data["reported_s"])
        return [
            {
                "cluster": cl,
                "allocated": tf.text(data["allocated_s"], total),
                "down": tf.text(data["down_s"], total),
                "planneddown": tf.text(0, total),
                "idle": tf.text(data["idle_s"], total),
                "planned": tf.text(0, total),
                "overcommitted": tf.text(0, total),
                "reported": tf.text(total, total),
                "trescount": str(data["cpus"]),
                "tresname": "cpu",
            }
        ]
    assocs = [
        a
        for a in data["assocs"]
        if (c.users is None or a["user"] in c.users)
        and (c.accounts is None or a["account"] in c.accounts)
    ]
    total = float(data["allocated_s"])

    def line(account: str, user: str, used: float) -> dict[str, str]:
        return {
            "cluster": cl,
            "accounts": account,
            "login": user,
            "proper": proper_name(user) if user else "",
            "used": tf.text(used, total),
            "energy": "0",
            "tresname": "cpu",
        }

    if report == "accountutilizationbyuser":
        by_account: dict[str, list[dict[str, Any]]] = {}
        for a in assocs:
            by_account.setdefault(a["account"], []).append(a)
        out = [line("root", "", sum(a["cpu_s"] for a in assocs))]
        for account in sorted(by_account):
            users = sorted(by_account[account], key=lambda a: (-a["cpu_s"], a["user"]))
            out.append(line((" " if c.tree else "") + account, "", sum(a["cpu_s"] for a in users)))
            out += [line(("  " if c.tree else "") + account, a["user"], a["cpu_s"]) for a in users]
        return out
    ranked = sorted(assocs, key=lambda a: (-a["cpu_s"], a["user"], a["account"]))
    if report == "topusage":
        ranked = ranked[: c.top]
    return [line(a["account"], a["user"], a["cpu_s"]) for a in ranked]


def render(
    columns: list[tuple[Column, int]], rows: list[dict[str, str]], *, header: bool,
    sep: str | None, trailing: bool,
) -> list[str]:  # fmt: skip
    """Slurm's print_fields: right-justified to each width (cut to it), or `|`-separated."""
    if sep is not None:
        end = sep if trailing else ""
        lines = [sep.join(col.header for col, _ in columns) + end] if header else []
        return lines + [sep.join(r.get(col.name, "") for col, _ in columns) + end for r in rows]
    lines = []
    if header:
        lines.append("".join(f"{col.header[:w]:>{w}} " for col, w in columns))
        lines.append("".join("-" * w + " " for _, w in columns))
    for r in rows:
        lines.append("".join(f"{r.get(col.name, '')[:w]:>{w}} " for col, w in columns))
    return lines


def build_parser() -> SlurmParser:
    p = SlurmParser(PROG, add_help=True)
    p.add_argument("-a", "--all_clusters", action="store_true")
    p.add_argument("-M", "--cluster", dest="clusters")
    p.add_argument("--federation", action="store_true")
    p.add_argument("--local", action="store_true")
    p.add_argument("-n", "--noheader", action="store_true")
    p.add_argument("-p", "--parsable", action="store_true")
    p.add_argument("-P", "--parsable2", action="store_true")
    p.add_argument("-Q", "--quiet", action="store_true")
    p.add_argument("-t", dest="time_format", default="minutes")
    p.add_argument("-T", "--tres", default="cpu")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("words", nargs="*")
    return p


BANNERS = {
    "utilization": "Cluster Utilization {start} - {end}",
    "accountutilizationbyuser": "Cluster/Account/User Utilization {start} - {end} ({secs} secs)",
    "userutilizationbyaccount": "Cluster/User/Account Utilization {start} - {end} ({secs} secs)",
    "topusage": "Top {top} Users {start} - {end} ({secs} secs)",
}


def body(argv: list[str]) -> int:
    opts = build_parser().parse_args(argv)
    if len(opts.words) < 2:
        raise SlurmUsageError(
            "give the report on the command line (e.g. `sreport cluster utilization`): "
            "interactive mode is not supported"
        )
    if opts.tres.lower() not in ("cpu", "billing"):
        raise SlurmUsageError(f"-T {opts.tres}: Phalanx reports CPU time only (-T cpu)")
    tf = time_format(opts.time_format)
    _, report = pick_report(opts.words[0], opts.words[1])
    now = time.time()
    c = conditions(opts.words[2:], now)
    start, end = window(c, now)
    kind = "user" if report == "topusage" else "cluster"
    columns = [column(x) for x in (c.fmt or REPORTS[(kind, report)][1].split(","))]
    with client() as cli:
        if opts.clusters and opts.clusters.lower() != "all":
            name = str(cli.get("/v1/whoami")["cluster"])
            if name not in opts.clusters.split(","):
                raise SlurmUsageError(f"No such cluster {opts.clusters}")
        data = cli.get("/v1/report/usage", start=start, end=end)
    rows = rows_for(report, data, c, tf)
    widths = [
        (col, max([col.width(tf)] + [len(r.get(col.name, "")) for r in rows]))
        if col.name == "used" else (col, col.width(tf))
        for col in columns
    ]  # fmt: skip
    header = not opts.noheader
    sep = "|" if opts.parsable or opts.parsable2 else None
    if header:
        fmt_t = "%Y-%m-%dT%H:%M:%S"
        banner = BANNERS[report].format(
            start=time.strftime(fmt_t, time.localtime(start)),
            end=time.strftime(fmt_t, time.localtime(end - 1)),
            secs=int(end - start),
            top=c.top,
        )
        sys.stdout.write(f"{RULE}\n{banner}\nUsage reported in {tf.banner}\n{RULE}\n")
    for line in render(widths, rows, header=header, sep=sep, trailing=bool(opts.parsable)):
        sys.stdout.write(line + "\n")
    return 0


def main(argv: list[str]) -> int:
    return run_command(PROG, body, argv)
