"""``squeue``: the job queue as Slurm prints it, for people and for the tools that parse it.

What tools rely on is kept byte for byte: the default columns and header, ``-h``, ``-o``
(``%[.][width]x``: cut to the width, ``.`` right-justifies), ``-O`` (``Field[:[.]width]``),
compact and long state names, folded pending array tasks (``12_[3-9]``), and the errors of
``-j`` (a finished job prints only the header and exits 0; an unknown one fails with
``slurm_load_jobs error: Invalid job id specified``). Formatting is pure (``job_values``,
``format_rows``) over the job records of ``GET /v1/jobs``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from phalanx.domain.hostlist import expand_hostlist
from phalanx.domain.text import CONTROL, escape
from phalanx.errors import NotFound
from phalanx.slurm import squeue_fields
from phalanx.slurm.common import (
    Field,
    SlurmParser,
    SlurmUsageError,
    add_clusters,
    check_clusters,
    client,
    duration,
    job_id_text,
    line_template,
    parse_format,
    parse_long_format,
    parse_states,
    phalanx_states,
    refuse,
    render_line,
    run_command,
    slurm_state,
    split_list,
    state_code,
    timestamp,
)

PROG = "squeue"
DEFAULT_FORMAT = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R"
LONG_FORMAT = "%.18i %.9P %.8j %.8u %.8T %.10M %.9l %.6D %R"
# What squeue lists when no -t is given: jobs that are not finished.
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"}

# %x letter -> header, as Slurm names the columns.
HEADERS = {
    "i": "JOBID",
    "j": "NAME",
    "u": "USER",
    "T": "STATE",
    "t": "ST",
    "M": "TIME",
    "l": "TIME_LIMIT",
    "D": "NODES",
    "R": "NODELIST(REASON)",
    "P": "PARTITION",
    "N": "NODELIST",
    "A": "JOBID",  # Slurm 22.05: an array's tasks show the array's id
    "k": "COMMENT",
    "C": "CPUS",
    "b": "TRES_PER_NODE",
    "L": "TIME_LEFT",
    "S": "START_TIME",
    "V": "SUBMIT_TIME",
    "r": "REASON",
    "F": "ARRAY_JOB_ID",
    "K": "ARRAY_TASK_ID",
    "Q": "PRIORITY",
    "p": "PRIORITY",
    "e": "END_TIME",
    "E": "DEPENDENCY",
}
HEADERS = {**squeue_fields.LETTER_HEADERS, **HEADERS}  # every letter Slurm documents
# -O field names (lower case) -> the key their value is printed from, and Slurm's -O headers
LONG_FIELDS = {name: key for name, (key, _) in squeue_fields.NAMES.items()}
LONG_HEADERS = {key: header for key, header in squeue_fields.NAMES.values()}
SORT_KEYS = "iAaCDjlLMNPpQrSTtuVe"


def slurm_reason(job: dict[str, Any]) -> str:
    """A job's reason as Slurm's one-word codes where they map (``Priority``, ``Resources``,
    ``Dependency``, ``JobHeldUser``, ``BeginTime``); else our text, short, without spaces."""
    if job["state"] == "HELD":
        return "JobHeldUser"
    text = (job.get("reason") or "").strip()
    if job["state"] not in ("PENDING", "HELD") or not text:
        return "None"
    word = text.split(" (", 1)[0].strip()
    if word.startswith(_SLURM_PHRASES):  # Slurm's own words, printed as Slurm prints them
        return word
    return word.replace(" ", "_")[:40] or "None"


# reasons given in Slurm's own phrasing (reservations: domain/reservations.py)
_SLURM_PHRASES = ("ReqNodeNotAvail, ",)


def _elapsed(job: dict[str, Any], now: float) -> float | None:
    start = job.get("start_time")
    if start is None or job["state"] in ("PENDING", "HELD"):
        return None
    return max(0.0, (job.get("end_time") or now) - start)


def _tres(job: dict[str, Any]) -> str:
    n = int(job.get("gpus_per_node") or 0)
    if not n:
        return "N/A"
    kind = f"{job['gpu_type']}:" if job.get("gpu_type") else ""
    return f"gres:gpu:{kind}{n}"


def _cpus(job: dict[str, Any]) -> int:
    nodes = job.get("nodes_alloc") or job.get("nodes") or 1
    return int(nodes) * int(job.get("cpus_per_node") or 1)


def _limit(job: dict[str, Any]) -> float | None:
    limit = job.get("time_limit_s")
    return limit if limit else None  # 0 and None: no limit


def _nodelist(job: dict[str, Any]) -> str:
    return "" if job["state"] in ("PENDING", "HELD") else (job.get("nodelist") or "")


def _own_id(job: dict[str, Any]) -> str:
    arr = job.get("array_job_id")
    return str(arr if arr is not None else job.get("id", job["job_id"]))


def _index(job: dict[str, Any]) -> str:
    folded, arr = job.get("fold"), job.get("array_job_id")
    if folded:
        return f"[{folded}]"
    return str(job.get("array_task_id") if arr is not None else "N/A")


def _reason_list(job: dict[str, Any]) -> str:
    if job["state"] in ("PENDING", "HELD"):
        return f"({slurm_reason(job)})"
    return _nodelist(job) or f"({slurm_reason(job)})"


def _left(job: dict[str, Any], now: float) -> str:
    limit = _limit(job)
    if limit is None:
        return duration(None, unlimited=True)
    left = limit - (_elapsed(job, now) or 0)
    return duration(left, unlimited=True) if left >= 0 else "0:00"


def _job_id(job: dict[str, Any]) -> str:
    folded = job.get("fold")
    return f"{job.get('array_job_id')}_[{folded}]" if folded else job_id_text(job)


# the common letters' values, each computed only when a format asks for it (a listing of
# thousands of jobs pays for its eight default columns, not for all of them)
VALUES: dict[str, Callable[[dict[str, Any], float], str]] = {
    "i": lambda j, now: _job_id(j),
    "j": lambda j, now: str(j.get("name") or ""),
    "u": lambda j, now: str(j.get("user") or ""),
    "T": lambda j, now: slurm_state(j["state"]),
    "t": lambda j, now: state_code(j["state"]),
    "M": lambda j, now: duration(_elapsed(j, now)),
    "l": lambda j, now: duration(_limit(j), unlimited=True),
    "D": lambda j, now: str(j.get("nodes_alloc") or j.get("nodes") or 1),
    "R": lambda j, now: _reason_list(j),
    "P": lambda j, now: str(j.get("partition") or j.get("partitions") or ""),
    "N": lambda j, now: _nodelist(j),
    "A": lambda j, now: _own_id(j),
    "F": lambda j, now: _own_id(j),
    "K": lambda j, now: _index(j),
    "k": lambda j, now: str(j.get("comment") or "(null)"),
    "C": lambda j, now: str(_cpus(j)),
    "b": lambda j, now: _tres(j),
    "L": _left,
    "S": lambda j, now: timestamp(j.get("start_time")),
    "V": lambda j, now: timestamp(j.get("submit_time")),
    "e": lambda j, now: timestamp(j.get("end_time")),
    "r": lambda j, now: slurm_reason(j),
    "Q": lambda j, now: str(j.get("priority") or 0),
    "p": lambda j, now: str(j.get("priority") or 0),
    "E": lambda j, now: str(_dependency(j)),
}


def job_values(job: dict[str, Any], now: float) -> dict[str, str]:
    """Every common field of one job record, by format letter, as Slurm prints it."""
    return {k: f(job, now) for k, f in VALUES.items()}


def _dependency(job: dict[str, Any]) -> str:
    dep = job.get("dependency")
    if not dep:
        return "(null)"
    if isinstance(dep, str):
        return dep
    return json.dumps(dep)


def compress_ids(ids: Sequence[int]) -> str:
    """``[3, 4, 5, 7]`` -> ``3-5,7`` (how Slurm writes a folded array's pending tasks)."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(ids)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def fold_arrays(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pending tasks of one array (same state and reason) as one record, as squeue shows them
    without ``-r``: ``12_[3-9]``; a single pending task stays ``12_3``. Running tasks and
    plain jobs are unchanged; the folded record takes the place of its first task."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for j in jobs:
        if j.get("array_job_id") is not None and j["state"] == "PENDING":
            groups.setdefault((j["array_job_id"], j["state"], j.get("reason")), []).append(j)
    out: list[dict[str, Any]] = []
    done: set[tuple[Any, ...]] = set()
    for j in jobs:
        key = (j.get("array_job_id"), j["state"], j.get("reason"))
        group = groups.get(key) if j.get("array_job_id") is not None else None
        if group is None:
            out.append(j)
            continue
        if key in done:
            continue
        done.add(key)
        if len(group) == 1:
            out.append(j)
            continue
        tasks = [int(g["array_task_id"]) for g in group]
        out.append(
            {**min(group, key=lambda g: int(g["array_task_id"])), "fold": compress_ids(tasks)}
        )
    return out


_STATE_ORDER = {"PENDING": 0, "RUNNING": 1, "SUSPENDED": 2, "COMPLETING": 3, "CONFIGURING": 1}


def sort_jobs(jobs: list[dict[str, Any]], spec: str | None, now: float) -> list[dict[str, Any]]:
    """Order as ``--sort`` says (Slurm's letters, ``-`` for descending, comma list); without
    it as squeue's default (partition, state, priority descending, job id)."""

    def numeric_id(j: dict[str, Any]) -> tuple[int, int]:
        arr = j.get("array_job_id")
        if arr is not None:
            return int(arr), int(j.get("array_task_id") or 0)
        return int(j.get("id") or str(j["job_id"]).split("_")[0]), -1

    def key_of(letter: str, j: dict[str, Any]) -> Any:
        if letter in ("i", "A"):
            return numeric_id(j)
        if letter in ("p", "Q"):
            return int(j.get("priority") or 0)
        if letter in ("t", "T"):
            return _STATE_ORDER.get(slurm_state(j["state"]), 9)
        if letter == "D":
            return int(j.get("nodes_alloc") or j.get("nodes") or 0)
        if letter == "C":
            return _cpus(j)
        if letter in ("M",):
            return _elapsed(j, now) or 0.0
        if letter in ("l",):
            return j.get("time_limit_s") or 0
        if letter in ("S", "V", "e"):
            field = {"S": "start_time", "V": "submit_time", "e": "end_time"}[letter]
            return j.get(field) or 0.0
        if letter == "P":
            return str(j.get("partition") or j.get("partitions") or "")
        return field_values(j, now, [letter])[letter]

    out = sorted(jobs, key=numeric_id)
    keys = [k.strip() for k in (spec or "P,t,-p").split(",") if k.strip()]
    for k in reversed(keys):
        desc = k.startswith("-")
        letter = k.lstrip("+-")
        if len(letter) != 1 or letter not in SORT_KEYS:
            raise SlurmUsageError(f"Invalid sort specification: {k} (use letters such as i,P,t,-p)")
        out.sort(key=functools.partial(key_of, letter), reverse=desc)
    return out


def _unknown(job: dict[str, Any], now: float) -> str:
    raise KeyError("a field no table has")  # parse_format/parse_long_format refuse them first


def field_values(job: dict[str, Any], now: float, keys: Iterable[str]) -> dict[str, str]:
    """The printed values of `keys` for one job record: the common letters (``job_values``)
    and any other field of squeue_fields.py, computed only when asked for."""
    return {k: VALUES.get(k, squeue_fields.EXTRA.get(k, _unknown))(job, now) for k in keys}


def format_rows(
    jobs: list[dict[str, Any]],
    prefix: str,
    fields: Sequence[Field],
    *,
    headers: dict[str, str],
    header: bool,
    now: float,
) -> list[str]:
    """The output lines: a header (unless ``-h``) and one line per job record."""
    lines = []
    if header:
        lines.append(render_line(prefix, fields, {f.key: headers[f.key] for f in fields}))
    template = line_template(prefix, fields).format
    makers = [VALUES.get(f.key, squeue_fields.EXTRA.get(f.key, _unknown)) for f in fields]
    for j in jobs:
        values = [make(j, now) for make in makers]
        line = template(*values)
        if CONTROL.search(line) is not None:
            # others' names, comments and reasons: never a control character on the
            # terminal (each value escaped, then cut to its width)
            line = render_line(
                prefix, fields, {f.key: escape(v) for f, v in zip(fields, values, strict=True)}
            )
        lines.append(line)
    return lines


def json_jobs(jobs: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """``--json``: a subset of Slurm's data_parser job records (docs/slurm.md lists it)."""
    out = []
    for j in jobs:
        v = job_values(j, now)
        arr = j.get("array_job_id")
        out.append(
            {
                "job_id": int(j.get("id") or 0),
                "array_job_id": int(arr) if arr is not None else 0,
                # a folded record (pending tasks 3-9) names its tasks as Slurm's does
                "array_task_id": None if j.get("fold") else j.get("array_task_id"),
                "array_task_string": j.get("fold") or "",
                "name": j.get("name"),
                "user_name": j.get("user"),
                "partition": v["P"],
                "job_state": [v["T"]],
                "state_reason": v["r"],
                "nodes": v["N"],
                "node_count": int(v["D"]),
                "cpus": int(v["C"]),
                "priority": int(j.get("priority") or 0),
                "time_limit": (j["time_limit_s"] // 60) if j.get("time_limit_s") else None,
                "submit_time": int(j["submit_time"]) if j.get("submit_time") else 0,
                "start_time": int(j["start_time"]) if j.get("start_time") else 0,
                "end_time": int(j["end_time"]) if j.get("end_time") else 0,
                "exit_code": j.get("exit_code"),
                "restart_cnt": int(j.get("restart_count") or 0),
                "tres_per_node": None if v["b"] == "N/A" else v["b"],
            }
        )
    return {"jobs": out, "warnings": [], "errors": []}


def parser() -> SlurmParser:
    p = SlurmParser(PROG, add_help=False)
    p.add_argument("--help", action="help")
    p.add_argument("-h", "--noheader", action="store_true")
    p.add_argument("-j", "--jobs", action="append")
    p.add_argument("-u", "--user", action="append")
    p.add_argument("-t", "--states", "--state", dest="states", action="append")
    p.add_argument("-p", "--partition", action="append")
    p.add_argument("-n", "--name", action="append")
    p.add_argument("-w", "--nodelist", action="append")
    p.add_argument("--me", action="store_true")
    p.add_argument("-o", "--format")
    p.add_argument("-O", "--Format", dest="long_format")
    p.add_argument("-r", "--array", action="store_true")
    p.add_argument("-S", "--sort")
    p.add_argument("--json", action="store_true")
    p.add_argument("-l", "--long", action="store_true")
    # harmless: accepted
    p.add_argument("-a", "--all", action="store_true")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--hide", action="store_true")
    p.add_argument("--local", action="store_true")
    p.add_argument("--federation", action="store_true")
    p.add_argument("--sibling", action="store_true")
    refuse(p, "-i", "--iterate", why="run squeue in a loop (e.g. watch squeue)")
    refuse(p, "-s", "--steps", why="job steps are not listed by squeue here", nargs="?")
    refuse(p, "-A", "--account", why="jobs are not filtered by account here")
    refuse(p, "-q", "--qos", why="jobs are not filtered by QOS here")
    refuse(p, "-R", "--reservation", why="reservations do not exist here")
    refuse(p, "-L", "--licenses", why="licenses do not exist here")
    add_clusters(p)
    refuse(p, "--start", why="expected start times are not computed", nargs=0)
    refuse(p, "--yaml", why="use --json", nargs=0)
    p.add_argument("job_ids", nargs="*")
    return p


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    now = time.time()
    refs = split_list(args.jobs) + split_list(args.job_ids)
    states = parse_states(",".join(split_list(args.states))) if args.states else None
    if args.format and args.long_format:
        raise SlurmUsageError("-o/--format and -O/--Format cannot be used together")
    if args.long_format:
        prefix, fields, headers = "", parse_long_format(args.long_format, LONG_FIELDS), LONG_HEADERS
    else:
        fmt = args.format or (LONG_FORMAT if args.long else DEFAULT_FORMAT)
        (prefix, fields), headers = parse_format(fmt, HEADERS), HEADERS
    users = split_list(args.user)
    with client() as c:
        cluster = check_clusters(c, args.clusters)
        if args.me:
            users.append(str(c.get("/v1/whoami")["user"]))
        want = phalanx_states(states) if states is not None else phalanx_states(ACTIVE)
        keys = {f.key for f in fields}
        # the command, directory, output files and comment are in the jobs' detail: the same
        # one call asks for it when a field needs it
        detail = bool(keys & squeue_fields.DETAIL) and not args.json
        jobs = _load(c, refs, want if not refs else None, detail=detail)
        if "cluster" in keys:
            name = str(c.get("/v1/whoami")["cluster"])
            jobs = [{**j, "_cluster": name} for j in jobs]
    # -j: Slurm shows the listed jobs in their active states only (a finished one: no line)
    jobs = [j for j in jobs if j["state"] in want]
    jobs = _filter(jobs, users, split_list(args.partition), split_list(args.name), args.nodelist)
    if not args.array:
        jobs = fold_arrays(jobs)
    jobs = sort_jobs(jobs, args.sort, now)
    if args.json:
        sys.stdout.write(json.dumps(json_jobs(jobs, now), indent=2) + "\n")
        return 0
    lines = format_rows(jobs, prefix, fields, headers=headers, header=not args.noheader, now=now)
    if args.long and not args.noheader:  # squeue -l starts with the date, as Slurm's
        lines.insert(0, time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now)))
    if cluster is not None:  # with -M, Slurm heads each cluster's part with its name
        lines.insert(0, f"CLUSTER: {cluster}")
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


def _load(
    c: Any, refs: list[str], states: list[str] | None, *, detail: bool = False
) -> list[dict[str, Any]]:
    """Jobs from the API (with their detail when asked); with ``-j``, every state (finished
    ones are then left out), and an unknown single id fails as Slurm's does."""
    more = {"detail": "true"} if detail else {}
    if not refs:
        return list(c.jobs(state=states, limit=100_000, **more))
    jobs = list(c.jobs(job=refs, limit=100_000, **more))
    if not jobs and len(refs) == 1:
        try:
            c.job(refs[0])
        except NotFound:
            sys.stderr.write("slurm_load_jobs error: Invalid job id specified\n")
            raise SystemExit(1) from None
    return jobs


def _filter(
    jobs: list[dict[str, Any]],
    users: list[str],
    partitions: list[str],
    names: list[str],
    nodelists: list[str] | None,
) -> list[dict[str, Any]]:
    nodes = {n for text in split_list(nodelists) for n in expand_hostlist(text)}
    out = []
    for j in jobs:
        if users and j.get("user") not in users:
            continue
        if partitions and not set(str(j.get("partition") or "").split(",")) & set(partitions):
            continue
        if names and j.get("name") not in names:
            continue
        if nodes and not nodes & set(expand_hostlist(j.get("nodelist") or "")):
            continue
        out.append(j)
    return out
