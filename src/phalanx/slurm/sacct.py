"""`sacct`: job history from the store, in Slurm's columns, `-P`/`-p` parsable forms and `--json`.

Tools (submitit, Snakemake, Nextflow, exporters) run `sacct -P -n -o JobID,State,ExitCode -j ID`
and split on `|`, so the text of every field is Slurm 22.05's. Rows: the job, then its batch
step (`ID.batch`, synthesised from the job's record: the script ran on the first node of the
allocation) and its job steps (`ID.0`, `ID.1`, ... from the job's `steps` when the API gives
them). Finished jobs stay for `accounting.keep_finished` (30 days by default).

The row building and formatting are pure functions over the API's job dicts.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.domain import efficiency
from phalanx.domain.hostlist import compress_hostlist, expand_hostlist
from phalanx.domain.slurmtime import parse_time
from phalanx.domain.text import escape
from phalanx.errors import NotFound
from phalanx.slurm import records
from phalanx.slurm.common import (
    ACCT_STATE,
    SlurmParser,
    SlurmUsageError,
    acct_cell,
    acct_state,
    add_clusters,
    check_clusters,
    client,
    duration_full,
    job_id_text,
    parse_states,
    phalanx_states,
    run_command,
    slurm_state,
    timestamp,
)

PROG = "sacct"
DEFAULT_FORMAT = "JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode"
BRIEF_FORMAT = "JobID,State,ExitCode"


@dataclass(frozen=True)
class Field:
    name: str
    width: int  # negative: left-justified (as Slurm's field table marks them)
    get: Callable[[dict[str, Any]], Any]


def _t(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: timestamp(r.get(key), "Unknown")


def _elapsed(r: dict[str, Any]) -> float:
    start = r.get("start_time")
    if start is None:
        return 0.0
    return max(0.0, (r.get("end_time") or r["_now"]) - start)


def _cpu_seconds(r: dict[str, Any]) -> float:
    """sacct's CPUTime: elapsed time times the CPUs allocated."""
    return _elapsed(r) * int(r.get("_ncpus") or 0)


def _blank(r: dict[str, Any]) -> str:
    return ""


# sacct(1) fields Phalanx keeps no figure for: printed blank, as sacct prints a field it has
# no data for (per-task I/O, page and VM figures, energy, CPU frequencies, minima, the split
# of CPU time into user and system, reservations, wckeys, containers, admin texts). Widths
# are sacct's.
_NOT_MEASURED = (
    ("AdminComment", 15),
    ("AveCPU", 10),
    ("AveCPUFreq", 10),
    ("AveDiskRead", 14),
    ("AveDiskWrite", 14),
    ("AvePages", 10),
    ("AveRSS", 10),
    ("AveVMSize", 10),
    ("BlockID", 16),
    ("ConsumedEnergy", 14),
    ("ConsumedEnergyRaw", 17),
    ("Container", 19),
    ("Flags", 19),
    ("Layout", 9),
    ("MCSLabel", 12),
    ("MaxDiskRead", 12),
    ("MaxDiskReadNode", 15),
    ("MaxDiskReadTask", 15),
    ("MaxDiskWrite", 12),
    ("MaxDiskWriteNode", 16),
    ("MaxDiskWriteTask", 16),
    ("MaxPages", 8),
    ("MaxPagesNode", 12),
    ("MaxPagesTask", 14),
    ("MaxVMSize", 10),
    ("MaxVMSizeNode", 14),
    ("MaxVMSizeTask", 14),
    ("MinCPU", 10),
    ("MinCPUNode", 10),
    ("MinCPUTask", 10),
    ("ReqCPUFreq", 10),
    ("ReqCPUFreqGov", 13),
    ("ReqCPUFreqMax", 13),
    ("ReqCPUFreqMin", 13),
    ("Reservation", 20),
    ("ReservationId", 8),
    ("ResvCPU", 10),
    ("ResvCPURAW", 10),
    ("SystemCPU", 10),
    ("SystemComment", 15),
    ("TRESUsageInAve", 14),
    ("TRESUsageInMax", 14),
    ("TRESUsageInMaxNode", 18),
    ("TRESUsageInMaxTask", 18),
    ("TRESUsageInMin", 14),
    ("TRESUsageInMinNode", 18),
    ("TRESUsageInMinTask", 18),
    ("TRESUsageInTot", 14),
    ("TRESUsageOutAve", 15),
    ("TRESUsageOutMax", 15),
    ("TRESUsageOutMaxNode", 19),
    ("TRESUsageOutMaxTask", 19),
    ("TRESUsageOutMin", 15),
    ("TRESUsageOutMinNode", 19),
    ("TRESUsageOutMinTask", 19),
    ("TRESUsageOutTot", 15),
    ("UserCPU", 10),
    ("WCKey", 10),
)

FIELDS: dict[str, Field] = {
    f.name.lower(): f
    for f in (
        Field("JobID", -12, lambda r: r["_jobid"]),
        Field("JobIDRaw", -12, lambda r: r["_jobidraw"]),
        Field("JobName", 10, lambda r: r.get("name") or ""),
        Field("Partition", 10, lambda r: r.get("_partition", "")),
        Field("Account", 10, lambda r: r.get("account") or ""),
        Field("User", 9, lambda r: r.get("_user", "")),
        Field("State", 10, lambda r: r["_state"]),
        Field("ExitCode", 8, lambda r: records.exit_code_text(r)),
        Field("DerivedExitCode", 15, lambda r: r.get("_derived", "")),
        Field("Elapsed", 10, lambda r: duration_full(_elapsed(r))),
        Field("ElapsedRaw", 10, lambda r: int(_elapsed(r))),
        Field("Start", 19, _t("start_time")),
        Field("End", 19, _t("end_time")),
        Field("Submit", 19, _t("submit_time")),
        Field("Eligible", 19, _t("eligible_time")),
        Field("NodeList", 15, lambda r: r["_nodelist"]),
        Field("NNodes", 8, lambda r: r["_nnodes"]),
        Field("NCPUS", 10, lambda r: r["_ncpus"]),
        Field("AllocCPUS", 10, lambda r: r["_ncpus"]),
        Field("AllocNodes", 10, lambda r: r["_nnodes"]),
        Field("NTasks", 8, lambda r: r.get("_ntasks", "")),
        Field("AllocTRES", -12, lambda r: r["_tres"]),
        Field("ReqTRES", -12, lambda r: r.get("_reqtres", "")),
        Field("ReqMem", 10, lambda r: r.get("_reqmem", "")),
        Field("ReqCPUS", 8, lambda r: r.get("_reqcpus", "")),
        Field("ReqNodes", 8, lambda r: r.get("_reqnodes", "")),
        # what the job's last attempt used, as its agents measured it (docs/explain.md)
        Field("MaxRSS", 10, lambda r: r.get("_maxrss", "")),
        Field("MaxRSSNode", 10, lambda r: r.get("_maxrssnode", "")),  # step lines
        Field("MaxRSSTask", 10, lambda r: r.get("_maxrsstask", "")),
        Field("TotalCPU", 10, lambda r: r.get("_totalcpu", "")),
        Field("Timelimit", 10, lambda r: r.get("_timelimit", "")),
        Field("Restarts", 8, lambda r: r.get("_restarts", "")),
        Field("Reason", 20, lambda r: r.get("_reason", "")),
        Field("WorkDir", -20, lambda r: r.get("_workdir", "")),
        Field("Priority", 10, lambda r: r.get("_priority", "")),
        Field("QOS", 10, lambda r: r.get("_qos", "")),
        Field("Comment", 15, lambda r: r.get("_comment", "")),
        Field("Constraints", 19, lambda r: r.get("_constraints", "")),
        Field("Group", 9, lambda r: r.get("_group", "")),
        Field("UID", 6, lambda r: r.get("_uid", "")),
        Field("ArrayJobID", 15, lambda r: r.get("_arrayjob", "")),
        Field("ArrayTaskID", 15, lambda r: r.get("_arraytask", "")),
        # the rest of sacct(1)'s fields (Slurm 22.05), with sacct's widths
        Field("CPUTime", 10, lambda r: duration_full(_cpu_seconds(r))),
        Field("CPUTimeRAW", 10, lambda r: int(_cpu_seconds(r))),
        Field("Cluster", 10, lambda r: r.get("_cluster", "")),
        Field("GID", 6, lambda r: r.get("_gid", "")),
        Field("QOSRAW", 6, lambda r: 1 if r.get("_qos") else ""),  # one QOS: normal, id 1
        Field("TimelimitRaw", 10, lambda r: r.get("_timelimitraw", "")),
        Field("Planned", 10, lambda r: r.get("_planned", "")),
        Field("Reserved", 10, lambda r: r.get("_planned", "")),  # Planned's older name
        Field("Suspended", 10, lambda r: "00:00:00"),  # Phalanx never suspends a job
        Field("SubmitLine", 20, lambda r: r.get("_submitline", "")),
        Field("AssocID", 7, lambda r: 0 if r.get("_qos") else ""),
        Field("DBIndex", -21, lambda r: r.get("id", "") if r.get("_qos") else ""),
        Field("WCKeyID", 10, lambda r: 0 if r.get("_qos") else ""),
        *(Field(name, width, _blank) for name, width in _NOT_MEASURED),
    )
}


# ---------------------------------------------------------------------------- format
def parse_format(text: str) -> list[tuple[Field, int]]:
    """`-o JobID,State%20,jobname` to fields and widths (a field's `%N` sets its width; Slurm
    keeps the field's justification). An unknown field is refused by name."""
    out = []
    for raw in text.split(","):
        raw = raw.strip()
        if not raw:
            continue
        name, _, width = raw.partition("%")
        f = FIELDS.get(name.lower())
        if f is None:
            raise SlurmUsageError(
                f'Invalid field requested: "{name}" (sacct --helpformat lists them)'
            )
        if width:
            if not width.isdecimal():
                raise SlurmUsageError(f"Invalid field width: {raw}")
            w = int(width)
            out.append((f, -w if f.width < 0 else w))
        else:
            out.append((f, f.width))
    if not out:
        raise SlurmUsageError("no fields given to --format")
    return out


def render(
    rows: list[dict[str, Any]],
    fields: list[tuple[Field, int]],
    *,
    header: bool = True,
    parsable: str | None = None,
    delimiter: str = "|",
) -> str:
    """The table: fixed columns with the dashes line, or `-P` (`parsable="2"`, fields joined by
    `|`) / `-p` (`parsable="1"`, each field followed by `|`)."""
    lines: list[str] = []
    if parsable:
        end = delimiter if parsable == "1" else ""
        if header:
            lines.append(delimiter.join(f.name for f, _ in fields) + end)
        for r in rows:
            lines.append(delimiter.join(escape(f.get(r)) for f, _ in fields) + end)
        return "".join(x + "\n" for x in lines)
    if header:
        lines.append("".join(acct_cell(f.name, w) for f, w in fields))
        lines.append("".join("-" * abs(w) + " " for _, w in fields))
    for r in rows:
        lines.append("".join(acct_cell(escape(f.get(r)), w) for f, w in fields))
    return "".join(x + "\n" for x in lines)


# ---------------------------------------------------------------------------- rows
_BATCH_STATE = {
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "CANCELLED",  # the batch step of a job that ran out of time was killed
    "NODE_FAIL": "FAILED",
    "OUT_OF_MEMORY": "OUT_OF_MEMORY",
    "RUNNING": "RUNNING",
    "COMPLETING": "COMPLETING",
}


def last_run_steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps of the job's last run (Slurm's sacct without -D): a requeued job's earlier
    runs numbered their steps from 0 too, and two `12.0` rows are one too many for a tool
    that keys rows by JobID."""
    steps = [s for s in job.get("steps") or [] if isinstance(s, dict)]
    last = int(job.get("restart_count") or 0)
    return [s for s in steps if s.get("attempt_seq") is None or int(s["attempt_seq"]) == last]


def _planned(job: dict[str, Any], now: float) -> float:
    """Time eligible but waiting (sacct's Planned, Reserved before 23.02)."""
    eligible = job.get("eligible_time") or job.get("submit_time")
    if eligible is None:
        return 0.0
    started = job.get("start_time") if job.get("state") not in ("PENDING", "HELD") else None
    return max(0.0, (started or now) - float(eligible))


def job_rows(job: dict[str, Any], now: float, *, steps: bool = True) -> list[dict[str, Any]]:
    """The rows of one job: the allocation, then (unless `steps` is off: -X) its batch step
    and job steps."""
    state = job.get("state") or "PENDING"
    jid = job_id_text(job)
    ran = state not in ("PENDING", "HELD")
    nnodes = records.node_count(job)
    mem = int(job.get("mem_per_node_mb") or 0)
    step_list = last_run_steps(job)
    codes = [(int(s.get("exit_code") or 0), int(s.get("exit_signal") or 0)) for s in step_list] or [
        (int(job.get("exit_code") or 0), int(job.get("exit_signal") or 0))
    ]
    derived = max(codes)
    usage = job.get("usage") or {}
    acct = records.user_account(str(job.get("user") or "?"))
    base = {
        **job,
        "_now": now,
        "_jobid": jid,
        "_jobidraw": str(job["id"]),
        "_partition": job.get("partition") or "",
        "_user": job.get("user") or "",
        "_state": records.state_text(job),
        "_nodelist": records.nodelist_text(job) if ran else "None assigned",
        "_nnodes": nnodes,
        "_ncpus": records.cpu_count(job),
        "_tres": records.tres_text(job) if ran else "",
        "_reqtres": records.tres_text(job),
        "_reqmem": records.mem_text(mem) if mem else "0",
        "_reqcpus": records.cpu_count(job),
        "_reqnodes": int(job.get("nodes") or 1),
        "_timelimit": duration_full(job.get("time_limit_s"), unlimited=True),
        "_restarts": int(job.get("restart_count") or 0),
        "_reason": records.reason_word(job),
        "_derived": f"{derived[0]}:{derived[1]}",
        "_workdir": job.get("workdir") or "",
        "_priority": job.get("priority") or 0,
        "_qos": job.get("qos") or "normal",
        "_comment": job.get("comment") or "",
        "_constraints": job.get("constraint") or "",
        "_group": acct.group if acct else str(job.get("user") or "?"),
        "_uid": str(acct.uid) if acct else "?",
        "_arrayjob": job.get("array_job_id") if job.get("array_job_id") is not None else "",
        "_arraytask": job.get("array_task_id") if job.get("array_task_id") is not None else "",
        "_maxrss": efficiency.max_rss(usage.get("max_rss_bytes")),
        "_totalcpu": efficiency.total_cpu(usage.get("cpu_time_s")),
        "_gid": str(acct.gid) if acct else "?",
        "_timelimitraw": (
            int(job["time_limit_s"]) // 60 if job.get("time_limit_s") else "UNLIMITED"
        ),
        "_planned": duration_full(_planned(job, now)),
        "_submitline": job.get("command") or "",
    }
    if not ran and job.get("state") in ("PENDING", "HELD"):
        base["start_time"] = None
        base["end_time"] = None
    rows = [base]
    if not steps or not ran or job.get("start_time") is None:
        return rows
    host = records.batch_host(job) or ""
    cpn = int(job.get("cpus_per_node") or 1)
    batch = {
        **base,
        "name": "batch",
        "_jobid": f"{jid}.batch",
        "_jobidraw": f"{job['id']}.batch",
        "_partition": "",
        "_user": "",
        "_state": _BATCH_STATE.get(state, acct_state(state)),
        "_nodelist": host,
        "_nnodes": 1,
        "_ncpus": cpn,
        "_ntasks": 1,
        "_tres": f"cpu={cpn},mem={records.mem_text(mem)},node=1" if mem else f"cpu={cpn},node=1",
        "_reqtres": "",
        "_timelimit": "",
        "_restarts": "",
        "_reason": "",
        "_derived": "",
        "_qos": "",
        "_priority": "",
        "_reqmem": "",
        "_reqcpus": "",
        "_reqnodes": "",
        "_uid": "",
        "_group": "",
        "_comment": "",
        "_constraints": "",
        "_arrayjob": "",
        "_arraytask": "",
        "_gid": "",
        "_timelimitraw": "",
        "_planned": "",
        "_submitline": "",
    }
    rows.append(batch)
    for s in sorted(step_list, key=lambda s: int(s.get("step_id") or 0)):
        names = [str(n) for n in s.get("nodes") or []]
        rows.append(
            {
                **batch,
                "name": s.get("name") or "",
                "start_time": s.get("start_time"),
                "end_time": s.get("end_time"),
                "exit_code": s.get("exit_code"),
                "exit_signal": s.get("exit_signal"),
                "_jobid": f"{jid}.{s.get('step_id')}",
                "_jobidraw": f"{job['id']}.{s.get('step_id')}",
                "_state": slurm_state(str(s.get("state") or "")),
                "_nodelist": compress_hostlist(names) if names else "",
                "_nnodes": len(names),
                "_ncpus": cpn * len(names),
                "_ntasks": s.get("ntasks") or "",
                "_tres": f"cpu={cpn * len(names)},node={len(names)}",
                # what the step's tasks used, from their exit records (its end)
                **_step_usage(s.get("usage")),
            }
        )
    return rows


def _step_usage(usage: Any) -> dict[str, Any]:
    """A step line's MaxRSS, its node and task, and TotalCPU (blank: no figures kept)."""
    if not isinstance(usage, dict):
        return {"_maxrss": "", "_totalcpu": ""}
    return {
        "_maxrss": efficiency.max_rss(usage.get("max_rss_bytes")),
        "_maxrssnode": usage.get("max_rss_node") or "",
        "_maxrsstask": usage.get("max_rss_task", ""),
        "_totalcpu": efficiency.total_cpu(usage.get("cpu_s")),
    }


def json_job(job: dict[str, Any], now: float) -> dict[str, Any]:
    """A subset of Slurm's `sacct --json` job object (data_parser 0.0.38 names)."""
    rows = job_rows(job, now)
    first = rows[0]
    code, sig = int(job.get("exit_code") or 0), int(job.get("exit_signal") or 0)

    def exit_obj(c: int, s: int) -> dict[str, Any]:
        status = "SIGNALED" if s else ("SUCCESS" if c == 0 else "FAILED")
        out: dict[str, Any] = {"status": status, "return_code": c}
        if s:
            out["signal"] = {"signal_id": s}
        return out

    def time_obj(r: dict[str, Any]) -> dict[str, Any]:
        return {
            "elapsed": int(_elapsed(r)),
            "eligible": int(r.get("eligible_time") or r.get("submit_time") or 0),
            "end": int(r.get("end_time") or 0),
            "start": int(r.get("start_time") or 0),
            "submission": int(r.get("submit_time") or 0),
            "suspended": 0,
            "limit": (int(job["time_limit_s"]) // 60) if job.get("time_limit_s") else None,
        }

    d_code, _, d_sig = str(first["_derived"]).partition(":")
    return {
        "job_id": int(job["id"]),
        "name": job.get("name") or "",
        "user": job.get("user") or "",
        "account": job.get("account") or "",
        "partition": job.get("partition") or "",
        "qos": job.get("qos") or "normal",
        "priority": int(job.get("priority") or 0),
        "array": {
            "job_id": int(job["array_job_id"]) if job.get("array_job_id") is not None else 0,
            "task_id": job.get("array_task_id"),
        },
        "state": {"current": acct_state(job.get("state") or ""), "reason": first["_reason"]},
        "exit_code": exit_obj(code, sig),
        "derived_exit_code": exit_obj(int(d_code or 0), int(d_sig or 0)),
        "time": time_obj(first),
        "nodes": first["_nodelist"],
        "allocation_nodes": first["_nnodes"],
        "required": {"CPUs": first["_reqcpus"], "memory": int(job.get("mem_per_node_mb") or 0)},
        "restart_cnt": int(job.get("restart_count") or 0),
        "working_directory": job.get("workdir") or "",
        "tres": {
            "allocated": _tres_list(first["_tres"]),
            "requested": _tres_list(first["_reqtres"]),
        },
        "steps": [
            {
                "step": {"id": r["_jobid"], "name": r.get("name") or ""},
                "state": r["_state"],
                "exit_code": exit_obj(int(r.get("exit_code") or 0), int(r.get("exit_signal") or 0)),
                "nodes": {"count": r["_nnodes"], "range": r["_nodelist"]},
                "tasks": {"count": r.get("_ntasks") or 0},
                "time": time_obj(r),
            }
            for r in rows[1:]
        ],
    }


def _tres_list(text: str) -> list[dict[str, Any]]:
    out = []
    for part in text.split(","):
        if "=" not in part:
            continue
        kind, _, count = part.partition("=")
        typ, _, name = kind.partition("/")
        mult = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
        if typ == "mem" and count and count[-1] in mult:
            value = int(float(count[:-1]) * mult[count[-1]])
        else:
            value = int(count) if count.isdecimal() else 0
        out.append({"type": typ, "name": name, "count": value})
    return out


# ---------------------------------------------------------------------------- command
def job_refs(text: str) -> list[str]:
    """`-j 12,13_2,14_[1-3],15.batch` to the references the API takes (a step suffix selects
    its job)."""
    refs: list[str] = []
    for piece in re.split(r",(?![^\[]*\])", text):
        piece = piece.strip()
        if not piece:
            continue
        piece = piece.split(".", 1)[0]
        if "[" in piece:
            try:
                refs.extend(expand_hostlist(piece))
            except ValueError:
                raise SlurmUsageError(f"Invalid job id: {piece}") from None
            continue
        if not re.fullmatch(r"\d+(_\d+)?", piece):
            raise SlurmUsageError(f"Invalid job id: {piece}")
        refs.append(piece)
    return refs


def build_parser() -> SlurmParser:
    p = SlurmParser(PROG, add_help=True)
    p.add_argument("-j", "--jobs", action="append")
    p.add_argument("-u", "--user", "--uid", dest="user", action="append")
    p.add_argument("-a", "--allusers", action="store_true")
    p.add_argument("-S", "--starttime")
    p.add_argument("-E", "--endtime")
    p.add_argument("-s", "--state", action="append")
    p.add_argument("-r", "--partition", action="append")
    p.add_argument("--name", action="append")
    p.add_argument("-X", "--allocations", action="store_true")
    p.add_argument("-n", "--noheader", action="store_true")
    p.add_argument("-P", "--parsable2", action="store_true")
    p.add_argument("-p", "--parsable", action="store_true")
    p.add_argument("--delimiter")
    p.add_argument("-o", "--format", action="append")
    p.add_argument("-b", "--brief", action="store_true")
    p.add_argument("-e", "--helpformat", action="store_true")
    p.add_argument("--json", action="store_true")
    add_clusters(p)
    return p


def helpformat() -> str:
    names = [f.name for f in FIELDS.values()]
    lines = [
        " ".join(f"{n:<20}" for n in names[i : i + 4]).rstrip() for i in range(0, len(names), 4)
    ]
    return "\n".join(lines) + "\n"


def body(argv: list[str]) -> int:
    opts = build_parser().parse_args(argv)
    if opts.helpformat:
        sys.stdout.write(helpformat())
        return 0
    now = time.time()
    fmt = ",".join(opts.format) if opts.format else (BRIEF_FORMAT if opts.brief else DEFAULT_FORMAT)
    fields = parse_format(fmt)
    refs = [r for j in opts.jobs or [] for r in job_refs(j)]
    states = {x for s in opts.state or [] for x in parse_states(s)}
    # Slurm's defaults: with -j every time; with -s the window starts now; else at midnight
    if opts.starttime:
        start: float | None = parse_time(opts.starttime, now)
    elif refs:
        start = None
    elif states:
        start = now
    else:
        start = parse_time("midnight", now)
    end = parse_time(opts.endtime, now) if opts.endtime else None
    if start is not None and end is not None and end < start:
        raise SlurmUsageError("Start time (-S) requested is after end time (-E)")
    users = [u for x in opts.user or [] for u in x.split(",") if u]
    with client() as cli:
        check_clusters(cli, opts.clusters)
        cluster = ""
        if any(f.name == "Cluster" for f, _ in fields):  # the one call more it needs
            cluster = str(cli.get("/v1/whoami")["cluster"])
        if not users and not refs and not opts.allusers:
            users = [str(cli.get("/v1/whoami")["user"])]
        params: dict[str, Any] = {"detail": "true"}
        if refs:
            params["job"] = ",".join(refs)
        if states:
            params["state"] = ",".join(phalanx_states(states, ACCT_STATE)) or "NONE"
        if start is not None:
            params["active_after"] = start
        if end is not None:
            params["submitted_before"] = end
        if len(users) == 1:
            params["user"] = users[0]
        try:
            jobs = cli.jobs(**params)
        except NotFound:
            jobs = []
    if users:
        jobs = [j for j in jobs if j.get("user") in users]
    if opts.partition:
        parts = {p for x in opts.partition for p in x.split(",")}
        jobs = [j for j in jobs if j.get("partition") in parts]
    if opts.name:
        names = {n for x in opts.name for n in x.split(",")}
        jobs = [j for j in jobs if j.get("name") in names]
    jobs.sort(key=lambda j: (int(j.get("array_job_id") or j["id"]), j.get("array_task_id") or 0))
    if opts.json:
        out: dict[str, Any] = {"meta": {"plugin": {"type": "phalanx"}}, "errors": []}
        out["warnings"] = []
        out["jobs"] = [json_job(j, now) for j in jobs]
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    rows = [
        {**r, "_cluster": cluster}
        for j in jobs
        for r in job_rows(j, now, steps=not opts.allocations)
    ]
    parsable = "2" if opts.parsable2 else ("1" if opts.parsable else None)
    delimiter = opts.delimiter if opts.delimiter is not None else "|"
    sys.stdout.write(
        render(rows, fields, header=not opts.noheader, parsable=parsable, delimiter=delimiter)
    )
    return 0


def main(argv: list[str]) -> int:
    return run_command(PROG, body, argv)
