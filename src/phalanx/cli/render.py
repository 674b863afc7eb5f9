"""Tables and detail views for people (the `--json` output is the machine interface)."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from phalanx.domain.values import format_duration


def _ts(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) if t else "-"


def _elapsed(j: dict[str, Any]) -> str:
    if not j.get("start_time"):
        return "0:00"
    end = j.get("end_time") or time.time()
    return format_duration(max(0, int(end - j["start_time"])))


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("JOBID", "PARTITION", "NAME", "USER", "ST", "TIME", "NODES", "NODELIST(REASON)"):
        t.add_column(col)
    for j in jobs:
        where = (
            j["nodelist"]
            if j["state"] in ("STARTING", "RUNNING", "COMPLETING")
            else f"({j['reason'] or 'None'})"
        )
        if j["state"] in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        ):
            code = f" exit {j['exit_code']}" if j["exit_code"] is not None else ""
            where = f"{j['nodelist'] or ''}{code}"
        t.add_row(
            j["job_id"],
            j["partition"] or "",
            j["name"],
            j["user"],
            j["state"],
            _elapsed(j),
            str(j["nodes"]),
            where,
        )
    return t


def job_detail(j: dict[str, Any]) -> str:
    attempts = j.get("attempts") or []
    lines = [
        f"JobId={j['id']} JobName={j['name']}"
        + (
            f" ArrayJobId={j['array_job_id']} ArrayTaskId={j['array_task_id']}"
            if j["array_job_id"]
            else ""
        ),
        f"   UserId={j['user']} Priority={j['priority']} Partition={j['partition']}",
        f"   JobState={j['state']} Reason={j['reason'] or 'None'} Dependency={_deps(j['dependency'])}",
        f"   Requeue={int(j['requeue'])} Restarts={j['restart_count']} ExitCode={_exit(j)}",
        f"   RunTime={_elapsed(j)} TimeLimit={j['time_limit']}",
        f"   SubmitTime={_ts(j['submit_time'])} StartTime={_ts(j['start_time'])} EndTime={_ts(j['end_time'])}",
        f"   NodeList={j['nodelist'] or '(null)'} NumNodes={j['nodes']} CPUs/Node={j['cpus_per_node']}"
        f" Mem/Node={j['mem_per_node_mb']}M"
        + (
            f" GPUs/Node={j['gpus_per_node']}{':' + j['gpu_type'] if j['gpu_type'] else ''}"
            if j["gpus_per_node"]
            else ""
        ),
        f"   Exclusive={int(j['exclusive'])} Features={j.get('constraint') or '(null)'}",
        f"   Command={j.get('command') or '(null)'}",
        f"   WorkDir={j.get('workdir') or '(null)'}",
        f"   StdOut={j.get('stdout')}",
        f"   StdErr={j.get('stderr')}",
    ]
    for a in attempts:
        nodes = ",".join(a["nodes"])
        lines.append(
            f"   Attempt={a['id']} Restart={a['seq']} State={a['state']} Result={a['result'] or '-'} "
            f"Nodes={nodes} Start={_ts(a['start_time'])} End={_ts(a['end_time'])}"
            + (f" Stop={a['stop_reason']}" if a["stop_reason"] else "")
        )
    return "\n".join(lines) + "\n"


def _deps(deps: list[dict[str, Any]]) -> str:
    if not deps:
        return "(null)"
    return ",".join(f"{d['type']}" + "".join(f":{x}" for x in d.get("jobs", [])) for d in deps)


def _exit(j: dict[str, Any]) -> str:
    return f"{j['exit_code'] if j['exit_code'] is not None else 0}:{j['exit_signal'] or 0}"


def nodes_table(nodes: list[dict[str, Any]]) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NODE", "STATE", "CPUS(A/T)", "MEM(A/T)", "GPUS(A/T)", "FEATURES", "REASON"):
        t.add_column(col)
    for n in nodes:
        reason = n["drain_reason"] or n["down_reason"] or ""
        if n["drain_by"]:
            reason += f" [{n['drain_by']}]"
        t.add_row(
            n["name"],
            n["state"],
            f"{n['cpus_alloc']}/{n['cpus']}",
            f"{n['mem_alloc_mb']}/{n['mem_mb']}",
            f"{n['gpus_alloc']}/{len(n['gpus'])}",
            ",".join(n["features"]) or "-",
            reason,
        )
    return t


def node_detail(n: dict[str, Any]) -> str:
    gpu_types = sorted({g[1] for g in n["gpus"]})
    lines = [
        f"NodeName={n['name']} State={n['state']} Addr={n['addr']}",
        f"   CPUAlloc={n['cpus_alloc']} CPUTot={n['cpus']} RealMemory={n['mem_mb']} AllocMem={n['mem_alloc_mb']}",
        f"   Gres=gpu:{len(n['gpus'])}"
        + (f" ({','.join(gpu_types)})" if gpu_types else "")
        + f" GresUsed=gpu:{n['gpus_alloc']} Features={','.join(n['features']) or '(null)'}",
        f"   LastHeartbeat={_ts(n['last_heartbeat'])} Registered={_ts(n['registered_at'])}",
        f"   Jobs={','.join(str(x) for x in n['jobs']) or '(none)'}",
    ]
    health = n.get("health") or {}
    if health:
        what = f" ({health.get('check')}: {health.get('reason')})" if health.get("check") else ""
        lines.append(f"   Health={health.get('status', 'ok')}{what}")
    if n["drain"]:
        lines.append(f"   Reason={n['drain_reason']} [{n['drain_by']}@{_ts(n['drain_time'])}]")
    if n["down"]:
        lines.append(f"   DownReason={n['down_reason']}")
    for e in n.get("events", [])[-10:]:
        lines.append(f"   {_ts(e['ts'])} {e['kind']}: {e['message']}")
    return "\n".join(lines) + "\n"


def events_table(evs: list[dict[str, Any]]) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("TIME", "KIND", "JOB", "NODE", "BY", "MESSAGE"):
        t.add_column(col)
    for e in evs:
        t.add_row(
            _ts(e["ts"]),
            e["kind"],
            str(e["job_id"] or ""),
            e["node"] or "",
            e["actor"],
            e["message"],
        )
    return t


def cluster_summary(st: dict[str, Any]) -> str:
    lines = ["Controllers:"]
    for c in st["controllers"]:
        lines.append(f"  {c['id']}  {c['url']}  last seen {_ts(c['last_seen'])}")
    lines.append("Leases:")
    for le in st["leases"]:
        lines.append(
            f"  {le['name']:<10} holder={le['holder']} term={le['term']} valid={le['valid']}"
        )
    lines.append("Partitions:")
    for p in st["partitions"]:
        lines.append(
            f"  {p['name']}{'*' if p['is_default'] else ''} nodes={p['nodes']} "
            f"default_time={format_duration(p['default_time_s'])} max_time={format_duration(p['max_time_s'])}"
        )
    n = st["nodes"]
    lines.append(f"Nodes: {n['total']} total, {n['down']} down, {n['drain']} drained")
    jobs = st["jobs"]
    lines.append("Jobs: " + (", ".join(f"{k}={v}" for k, v in sorted(jobs.items())) or "none"))
    return "\n".join(lines)
