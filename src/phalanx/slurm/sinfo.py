"""``sinfo``: partitions and nodes as Slurm prints them.

The default view groups each partition's nodes by state (``%9P %.5a %.10l %.6D %.6t %N``,
the default partition marked ``*``); ``-N`` lists nodes one per line, ``-l`` is the long form,
``-R`` lists why nodes are down or drained, ``-o`` takes Slurm's ``%[.][width]x`` fields.
States are Slurm's words (``idle mix alloc drain drng down unk``; ``*`` marks a node that does
not respond). Data: ``GET /v1/nodes`` and the partitions of ``GET /v1/cluster``; the pure part
(``node_values``, ``summarize``) works on those records.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from phalanx.domain.hostlist import compress_hostlist, expand_hostlist
from phalanx.domain.scheduling import node_partitions
from phalanx.domain.text import escape
from phalanx.slurm.common import (
    Field,
    SlurmParser,
    SlurmUsageError,
    add_clusters,
    check_clusters,
    client,
    duration,
    parse_format,
    parse_long_format,
    refuse,
    render_line,
    run_command,
    split_list,
    timestamp,
)
from phalanx.slurm.main import SLURM_RELEASE
from phalanx.slurm.scontrol_resv import sinfo_lines as _resv_lines

PROG = "sinfo"
DEFAULT_FORMAT = "%9P %.5a %.10l %.6D %.6t %N"
LONG_FORMAT = "%9P %.5a %.10l %.10s %.4r %.8h %.10g %.6D %.11T %N"
NODE_FORMAT = "%#N %.6D %.9P %.6t"
NODE_LONG_FORMAT = "%#N %.6D %.9P %.11T %.4c %.8z %.6m %.8d %.6w %.8f %20E"
REASON_FORMAT = "%20E %9u %19H %N"
SUMMARIZE_FORMAT = "%9P %.5a %.10l %.16F  %N"

HEADERS = {
    "P": "PARTITION",
    "R": "PARTITION",
    "a": "AVAIL",
    "l": "TIMELIMIT",
    "L": "DEFAULTTIME",
    "D": "NODES",
    "t": "STATE",
    "T": "STATE",
    "N": "NODELIST",
    "n": "HOSTNAMES",
    "c": "CPUS",
    "m": "MEMORY",
    "G": "GRES",
    "f": "AVAIL_FEATURES",
    "b": "ACTIVE_FEATURES",
    "E": "REASON",
    "H": "TIMESTAMP",
    "u": "USER",
    "C": "CPUS(A/I/O/T)",
    "F": "NODES(A/I/O/T)",
    "A": "NODES(A/I)",
    "e": "FREE_MEM",
    "z": "S:C:T",
    "d": "TMP_DISK",
    "w": "WEIGHT",
    "s": "JOB_SIZE",
    "r": "ROOT",
    "h": "OVERSUBSCRIBE",
    "g": "GROUPS",
    # the rest of sinfo(1)'s letters (Slurm 22.05), with its headers
    "B": "MAX_CPUS_PER_NODE",
    "I": "PRIO_JOB_FACTOR",
    "M": "PREEMPT_MODE",
    "O": "CPU_LOAD",
    "S": "ALLOCNODES",
    "U": "USER",
    "V": "CLUSTER",
    "X": "SOCKETS",
    "Y": "CORES",
    "Z": "THREADS",
    "o": "NODE_ADDR",
    "p": "PRIO_TIER",
    "v": "VERSION",
}
# -O/--Format names (lower case) -> (the key printed, Slurm 22.05's header)
FORMAT_NAMES: dict[str, tuple[str, str]] = {
    "allocmem": ("allocmem", "ALLOCMEM"),
    "allocnodes": ("S", "ALLOCNODES"),
    "available": ("a", "AVAIL"),
    "cluster": ("V", "CLUSTER"),
    "comment": ("comment", "COMMENT"),
    "cores": ("Y", "CORES"),
    "cpus": ("c", "CPUS"),
    "cpusload": ("O", "CPU_LOAD"),
    "cpusstate": ("C", "CPUS(A/I/O/T)"),
    "defaulttime": ("L", "DEFAULTTIME"),
    "disk": ("d", "TMP_DISK"),
    "extra": ("extra", "EXTRA"),
    "features": ("f", "AVAIL_FEATURES"),
    "features_act": ("b", "ACTIVE_FEATURES"),
    "freemem": ("e", "FREE_MEM"),
    "gres": ("G", "GRES"),
    "gresused": ("gresused", "GRES_USED"),
    "groups": ("g", "GROUPS"),
    "maxcpuspernode": ("B", "MAX_CPUS_PER_NODE"),
    "memory": ("m", "MEMORY"),
    "nodeaddr": ("o", "NODE_ADDR"),
    "nodeai": ("A", "NODES(A/I)"),
    "nodeaiot": ("F", "NODES(A/I/O/T)"),
    "nodehost": ("n", "HOSTNAMES"),
    "nodelist": ("N", "NODELIST"),
    "nodes": ("D", "NODES"),
    "oversubscribe": ("h", "OVERSUBSCRIBE"),
    "partition": ("P", "PARTITION"),
    "partitionname": ("R", "PARTITION"),
    "port": ("port", "PORT"),
    "preemptmode": ("M", "PREEMPT_MODE"),
    "priorityjobfactor": ("I", "PRIO_JOB_FACTOR"),
    "reason": ("E", "REASON"),
    "root": ("r", "ROOT"),
    "size": ("s", "JOB_SIZE"),
    "socketcorethread": ("z", "S:C:T"),
    "sockets": ("X", "SOCKETS"),
    "statecompact": ("t", "STATE"),
    "statelong": ("T", "STATE"),
    "statecomplete": ("statecomplete", "STATECOMPLETE"),
    "threads": ("Z", "THREADS"),
    "time": ("l", "TIMELIMIT"),
    "timestamp": ("H", "TIMESTAMP"),
    "user": ("u", "USER"),
    "userlong": ("U", "USER"),
    "version": ("v", "VERSION"),
    "weight": ("w", "WEIGHT"),
}
FORMAT_HEADERS = {key: header for key, header in FORMAT_NAMES.values()}
# What each node's state is called: (compact %t, long %T).
STATE_WORDS = {
    "IDLE": ("idle", "idle"),
    "MIXED": ("mix", "mixed"),
    "ALLOCATED": ("alloc", "allocated"),
    "DRAINED": ("drain", "drained"),
    "DRAINING": ("drng", "draining"),
    "DOWN": ("down", "down"),
    "DOWN+DRAIN": ("drain", "drained"),
    "UNKNOWN": ("unk", "unknown"),
}
# -t/--states words -> the long state words they select
STATE_FILTERS = {
    "idle": {"idle"},
    "mix": {"mixed"},
    "mixed": {"mixed"},
    "alloc": {"allocated"},
    "allocated": {"allocated"},
    "drain": {"drained", "draining"},
    "drained": {"drained"},
    "draining": {"draining"},
    "drng": {"draining"},
    "down": {"down"},
    "unk": {"unknown"},
    "unknown": {"unknown"},
    "no_respond": {"*"},
    "responding": {"responding"},
    "all": {"idle", "mixed", "allocated", "drained", "draining", "down", "unknown"},
}
# Fields summed (or listed) over a group of nodes rather than telling groups apart.
AGGREGATE = {"N", "n", "D", "C", "F", "A", "e"}


def node_state(node: dict[str, Any]) -> tuple[str, str, bool]:
    """(compact, long, not responding) Slurm state words of a node record."""
    state = str(node["state"])
    compact, long = STATE_WORDS.get(state, (state.lower()[:5], state.lower()))
    silent = bool(node.get("down")) or state == "UNKNOWN"
    return compact, long, silent


def time_limit(seconds: int | None) -> str:
    """A partition's limit as sinfo prints it: ``infinite`` or ``1-00:00:00`` style."""
    return "infinite" if not seconds else duration(seconds)


def _gres(node: dict[str, Any]) -> str:
    gpus = node.get("gpus") or []
    if not gpus:
        return "(null)"
    types = sorted({str(g[1]) for g in gpus if len(g) > 1 and g[1]})
    kind = f"{types[0]}:" if len(types) == 1 else ""
    return f"gpu:{kind}{len(gpus)}"


def node_reason(node: dict[str, Any]) -> str:
    return str(node.get("drain_reason") or node.get("down_reason") or "none")


def node_values(
    node: dict[str, Any], partition: dict[str, Any] | None, default: str | None
) -> dict[str, str]:
    """Every printable field of one node, by format letter, in one partition."""
    compact, long, silent = node_state(node)
    star = "*" if silent else ""
    name = str(partition["name"]) if partition else "n/a"
    cpus, alloc = int(node.get("cpus") or 0), int(node.get("cpus_alloc") or 0)
    other = cpus - alloc if long in ("down", "drained", "unknown") else 0
    idle = cpus - alloc - other
    busy = long in ("allocated", "mixed", "draining")
    avail_idle = long == "idle"
    features = ",".join(node.get("features") or []) or "(null)"
    reasons = long in ("down", "drained", "draining", "unknown") or node.get("drain")
    values = {
        "P": name + ("*" if name == default else ""),
        "R": name,
        "a": "up",
        "l": time_limit(partition.get("max_time_s") if partition else None),
        "L": time_limit(partition.get("default_time_s") if partition else None),
        "D": "1",
        "t": compact + star,
        "T": long + star,
        "N": str(node["name"]),
        "n": str(node["name"]),
        "c": str(cpus),
        "m": str(int(node.get("mem_mb") or 0)),
        "G": _gres(node),
        "f": features,
        "b": features,
        "E": node_reason(node) if reasons else "none",
        "H": timestamp(node.get("drain_time"), "Unknown"),
        "u": str(node.get("drain_by") or ("slurm" if node.get("down") else "Unknown")),
        "C": f"{alloc}/{idle}/{other}/{cpus}",
        "F": f"{int(busy)}/{int(avail_idle)}/{int(not busy and not avail_idle)}/1",
        "A": f"{int(busy)}/{int(avail_idle)}",
        "e": str(max(0, int(node.get("mem_mb") or 0) - int(node.get("mem_alloc_mb") or 0))),
        "z": f"{cpus}:1:1",
        "d": "0",
        "w": "1",
        "s": "1-infinite",
        "r": "no",
        "h": "NO",
        "g": "all",
        "B": "UNLIMITED",
        "I": "1",
        "M": str((partition or {}).get("preempt_mode") or "off").upper(),
        "O": "N/A",  # not measured here
        "S": "all",
        "V": "N/A",  # Slurm's unless federated
        "X": str(cpus),  # each CPU a socket of one core, as %z's S:C:T
        "Y": "1",
        "Z": "1",
        "o": str(node.get("address") or node["name"]),
        "p": str(int((partition or {}).get("priority_tier") or 1)),
        "v": SLURM_RELEASE,
        "allocmem": str(int(node.get("mem_alloc_mb") or 0)),
        "comment": "(null)",
        "extra": "(null)",
        "gresused": "(null)",
        "port": "0",
        "statecomplete": long + star,
    }
    values["U"] = values["u"]  # -O UserLong: the same user here
    # drain reasons, features: never a control character on the terminal (domain/text.py)
    return {k: escape(v) for k, v in values.items()}


def _sum_slashes(values: list[str]) -> str:
    parts = [list(map(int, v.split("/"))) for v in values]
    return "/".join(str(sum(col)) for col in zip(*parts, strict=True))


def summarize(rows: list[dict[str, str]], fields: Sequence[Field]) -> list[dict[str, str]]:
    """Group node rows that print the same (apart from counts and names), as sinfo does:
    one line per partition and state with the node count and the compressed node list."""
    keys = [f.key for f in fields if f.key not in AGGREGATE]
    groups: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for members in groups.values():
        first = dict(members[0])
        names = [m["N"] for m in members]
        first["N"] = first["n"] = compress_hostlist(names)
        first["D"] = str(len(members))
        for k in ("C", "F", "A"):
            first[k] = _sum_slashes([m[k] for m in members])
        free = sorted(int(m["e"]) for m in members)
        first["e"] = str(free[0]) if free[0] == free[-1] else f"{free[0]}-{free[-1]}"
        out.append(first)
    return out


def rows_for(
    nodes: list[dict[str, Any]],
    partitions: list[dict[str, Any]],
    *,
    node_oriented: bool,
    fields: Sequence[Field],
    want_parts: list[str],
    want_nodes: set[str],
    want_states: set[str] | None,
    responding: bool | None = None,
) -> list[dict[str, str]]:
    """The value rows to print: per (partition, node), filtered, grouped unless ``-N``."""
    default = next((str(p["name"]) for p in partitions if p.get("is_default")), None)
    by_name = {str(p["name"]): p for p in partitions}
    rows: list[dict[str, str]] = []
    order = [str(p["name"]) for p in partitions] or ["n/a"]
    for part in order:
        if want_parts and part not in want_parts:
            continue
        part_rows = []
        for n in sorted(nodes, key=lambda n: _natural(str(n["name"]))):
            if by_name and part not in node_partitions(str(n["name"]), partitions):
                continue
            if want_nodes and n["name"] not in want_nodes:
                continue
            _, long, silent = node_state(n)
            if responding is not None and silent == responding:
                continue
            if want_states is not None and not _state_matches(long, silent, want_states):
                continue
            part_rows.append(node_values(n, by_name.get(part), default))
        rows.extend(part_rows if node_oriented else summarize(part_rows, fields))
    return rows


def _state_matches(long: str, silent: bool, wanted: set[str]) -> bool:
    if "*" in wanted and silent:
        return True
    if "responding" in wanted and not silent:
        return True
    return long in wanted


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdecimal() else p for p in re.split(r"(\d+)", name))


def parse_node_states(text: str) -> set[str]:
    """``-t idle,drain`` -> the long state words to keep; unknown words are refused."""
    out: set[str] = set()
    for raw in text.split(","):
        word = raw.strip().lower()
        if not word:
            continue
        if word not in STATE_FILTERS:
            raise SlurmUsageError(
                f"Invalid node state specified: {raw.strip()} (use e.g. "
                "idle, mix, alloc, drain, drng, down, unk)"
            )
        out |= STATE_FILTERS[word]
    return out


def expand_widths(fmt: str, rows: list[dict[str, str]]) -> str:
    """``%#N``: the node name column as wide as the longest name (sinfo -N's form)."""
    if "%#N" not in fmt:
        return fmt
    width = max([len("NODELIST")] + [len(r["N"]) for r in rows])
    return fmt.replace("%#N", f"%{width}N")


def parser() -> SlurmParser:
    p = SlurmParser(PROG, add_help=False)
    p.add_argument("--help", action="help")
    p.add_argument("-h", "--noheader", action="store_true")
    p.add_argument("-N", "--Node", action="store_true")
    p.add_argument("-l", "--long", action="store_true")
    p.add_argument("-R", "--list-reasons", action="store_true")
    p.add_argument("-s", "--summarize", action="store_true")
    p.add_argument("-o", "--format")
    p.add_argument("-t", "--states", "--state", dest="states", action="append")
    p.add_argument("-p", "--partition", action="append")
    p.add_argument("-n", "--nodes", action="append")
    p.add_argument("-r", "--responding", action="store_true")
    p.add_argument("-d", "--dead", action="store_true")
    p.add_argument("-a", "--all", action="store_true")
    p.add_argument("-e", "--exact", action="store_true")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--local", action="store_true")
    p.add_argument("--federation", action="store_true")
    refuse(p, "-i", "--iterate", why="run sinfo in a loop (e.g. watch sinfo)")
    p.add_argument("-O", "--Format", dest="long_format")
    refuse(p, "-S", "--sort", why="sinfo prints partitions and nodes in their natural order")
    p.add_argument("-T", "--reservation", action="store_true")
    add_clusters(p)
    refuse(p, "--json", why="use `phalanx nodes --json`", nargs=0)
    refuse(p, "--yaml", why="use `phalanx nodes --json`", nargs=0)
    return p


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.format:
        fmt = args.format
    elif args.list_reasons:
        fmt = REASON_FORMAT
    elif args.summarize:
        fmt = SUMMARIZE_FORMAT
    elif args.Node:
        fmt = NODE_LONG_FORMAT if args.long else NODE_FORMAT
    else:
        fmt = LONG_FORMAT if args.long else DEFAULT_FORMAT
    states = parse_node_states(",".join(split_list(args.states))) if args.states else None
    if args.list_reasons and states is None:
        states = {"down", "drained", "draining", "*"}
    want_nodes = {n for t in split_list(args.nodes) for n in expand_hostlist(t)}
    responding = True if args.responding else False if args.dead else None
    with client() as c:
        cluster = check_clusters(c, args.clusters)
        if args.reservation:  # -T: the reservations instead of the nodes
            text = _resv_lines(c.reservations(), time.time(), header=not args.noheader)
            sys.stdout.write(text)
            return 0
        nodes = c.nodes()
        partitions = list(c.cluster().get("partitions") or [])
    if args.long_format and args.format:
        raise SlurmUsageError("-o/--format and -O/--Format cannot be used together")
    if args.long_format and "all" in (
        x.split(":")[0].strip().lower() for x in args.long_format.split(",")
    ):
        raise SlurmUsageError("-O All is not supported here: name the fields you want")
    if args.long_format:
        long_fields = parse_long_format(
            args.long_format, {n: k for n, (k, _) in FORMAT_NAMES.items()}, prog=PROG
        )
        probe = long_fields
    else:
        _, probe = parse_format(fmt.replace("%#N", "%N"), HEADERS, PROG)
    rows = rows_for(
        nodes,
        partitions,
        node_oriented=args.Node,
        fields=probe if not args.list_reasons else [*probe, Field("P")],
        want_parts=split_list(args.partition),
        want_nodes=want_nodes,
        want_states=states,
        responding=responding,
    )
    if args.list_reasons and not args.format:
        rows = _by_reason(rows)
    if args.long_format:
        prefix, fields, headers = "", long_fields, FORMAT_HEADERS
    else:
        prefix, fields = parse_format(expand_widths(fmt, rows), HEADERS, PROG)
        headers = HEADERS
    out = [] if cluster is None else [f"CLUSTER: {cluster}"]  # as Slurm heads it with -M
    if args.long and not args.noheader:  # the date line, as Slurm's long form starts
        out.append(time.strftime("%a %b %d %H:%M:%S %Y"))
    if not args.noheader:
        out.append(render_line(prefix, fields, {f.key: headers[f.key] for f in fields}))
    out.extend(render_line(prefix, fields, r) for r in rows)
    sys.stdout.write("".join(line + "\n" for line in out))
    return 0


def _by_reason(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """``-R``: one line per reason (and who set it, when), nodes across partitions merged."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in rows:
        for name in expand_hostlist(r["N"]):
            names = groups.setdefault((r["E"], r["u"], r["H"]), [])
            if name not in names:
                names.append(name)
    out = []
    for (reason, user, ts), names in groups.items():
        out.append({"E": reason, "u": user, "H": ts, "N": compress_hostlist(names)})
    return out
