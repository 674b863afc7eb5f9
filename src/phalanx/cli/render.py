"""Tables and detail views for people (the `--json` output is the machine interface).

Text from the store reaches the terminal of whoever runs the command, others' job names and
reasons included: every value shown goes through `domain.text.escape` (tables, per cell) or
`escape_data` (detail views, the record at once), so that a control character prints as its
visible escape and never acts on the terminal."""

from __future__ import annotations

import signal
import time
from typing import Any

from rich.table import Table

from phalanx.domain.checkpointing import describe, describe_cluster_mtbf
from phalanx.domain.text import escape, escape_data
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
    cols = ("JOBID", "PARTITION", "NAME", "USER", "ST", "RETRIES", "TIME", "NODES")
    for col in (*cols, "NODELIST(REASON)"):
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
        cells = (
            j["job_id"],
            j["partition"] or "",
            j["name"],
            j["user"],
            j["state"],
            str(j.get("retries") or 0),
            _elapsed(j),
            str(j.get("nodes_alloc") or j["nodes"])
            if j["state"] in ("STARTING", "RUNNING", "COMPLETING")
            else str(j["nodes"]),
            where,
        )
        t.add_row(*(escape(c) for c in cells))
    return t


def licenses_table(lics: list[dict[str, Any]]) -> str:
    """NAME TOTAL USED FREE, one licence a line (phalanx show licenses)."""
    if not lics:
        return "no licences configured (cluster.licenses)"
    lics = escape_data(lics)
    width = max(4, *(len(x["name"]) for x in lics))
    rows = [f"{'NAME':<{width}} {'TOTAL':>7} {'USED':>7} {'FREE':>7}"]
    rows += [f"{x['name']:<{width}} {x['total']:>7} {x['used']:>7} {x['free']:>7}" for x in lics]
    return "\n".join(rows)


def job_detail(j: dict[str, Any]) -> str:
    j = escape_data(j)
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
        f"   Exclusive={int(j['exclusive'])} Features={j.get('constraint') or '(null)'}"
        f" Licenses={j.get('licenses') or '(null)'}",
        # another user's job under auth.private_data comes without these (access.redact)
        f"   Command={_private(j, 'command')}",
        f"   WorkDir={_private(j, 'workdir')}",
        f"   StdOut={_private(j, 'stdout', None)}",
        f"   StdErr={_private(j, 'stderr', None)}",
    ]
    lines.extend(_retry_lines(j))
    lines.extend(_checkpoint_lines(j))
    lines.extend(_elastic_lines(j))
    for a in attempts:
        nodes = ",".join(a["nodes"])
        spares = [t["node"] for t in a.get("tasks") or [] if t.get("spare")]
        lines.append(
            # per job, as users count them (0 = first run; the same as its restart count);
            # a['id'] is a cluster-wide counter that means nothing to them
            f"   Attempt={a['seq']} State={a['state']} "
            f"Result={a.get('result') or '-'} "
            f"Nodes={nodes}"
            + (f" Spares={','.join(spares)}" if spares else "")
            + f" Start={_ts(a['start_time'])} End={_ts(a['end_time'])}"
            + (f" Stop={a['stop_reason']}" if a.get("stop_reason") else "")
        )
    for st in j.get("steps") or []:
        # srun steps, as sacct names them (JOBID.N), of the attempt they ran in
        code = st["exit_code"] if st["exit_code"] is not None else "-"
        lines.append(
            f"   Step={j['id']}.{st['step_id']} Name={st['name']} State={st['state']} "
            f"Attempt={st.get('attempt_seq', '-')} Nodes={','.join(st['nodes'])} "
            f"Tasks={st['ntasks']} ExitCode={code}:{st['exit_signal'] or 0} "
            f"Start={_ts(st['start_time'])} End={_ts(st['end_time'])}"
        )
    return "\n".join(lines) + "\n"


def _private(j: dict[str, Any], key: str, missing: str | None = "(null)") -> str:
    if j.get("private"):
        return "(private)"
    return str(j.get(key) or missing)


def _retry_lines(j: dict[str, Any]) -> list[str]:
    """Failure retries used of the job's budget, its rules, and the nodes it now avoids
    (docs/retries.md)."""
    rules = j.get("retry") or {}
    if not rules:
        return []
    avoid = ",".join(j.get("avoid_nodes") or []) or "(null)"
    return [
        f"   Retries={j.get('retries') or 0}/{rules['max_retries']} RetryOn={rules['retry_on']}"
        f" RetryBackoff={rules['backoff_base_s']:g}s..{rules['backoff_max_s']:g}s"
        f" AvoidNodes={avoid}"
    ]


def _elastic_lines(j: dict[str, Any]) -> list[str]:
    """Node range, hot spares, a pending restart reservation, and node time held (docs/elastic.md)."""
    lines = []
    if j.get("nodes_max") or j.get("spares"):
        lines.append(
            f"   NumNodesRange={j['nodes']}-{j.get('nodes_max') or j['nodes']}"
            f" SparesRequested={j.get('spares') or 0}"
            f" Spares={','.join(j.get('spare_nodes') or []) or '(none)'}"
        )
    until = j.get("reserved_until")
    if j.get("reserved_nodes") and j["state"] == "PENDING" and until and until > time.time():
        lines.append(
            f"   ReservedNodes={','.join(j['reserved_nodes'])}"
            f" ReservedUntil={_ts(j.get('reserved_until'))}"
        )
    if "node_seconds" in j:
        lines.append(
            f"   NodeSeconds={j['node_seconds']:g} (spares {j.get('spare_node_seconds') or 0:g})"
        )
    return lines


def _checkpoint_lines(j: dict[str, Any]) -> list[str]:
    """Checkpoint spec, latest checkpoint and latest progress (docs/checkpoints.md)."""
    lines = []
    spec = j.get("checkpoint_spec")
    if spec:
        try:
            sig = signal.Signals(int(spec["signum"])).name.removeprefix("SIG")
        except (KeyError, TypeError, ValueError):
            sig = str(spec.get("signum"))
        grace = spec.get("grace_s")
        interval = j.get("checkpoint_interval")
        lines.append(
            f"   CheckpointSignal={sig} CheckpointGrace="
            + (f"{grace}s" if grace is not None else "(cluster default)")
            + (f" CheckpointInterval={describe(interval)}" if interval else "")
        )
    ck = j.get("checkpoint")
    if ck:
        took = ck.get("duration_s")
        lines.append(
            f"   LastCheckpoint={_ts(ck.get('finished_at'))}"
            + (f" Took={took:.1f}s" if took is not None else " Took=(unknown)")
            + f" Restart={ck.get('seq')} Path={ck.get('path')}"
        )
    elif spec:
        lines.append("   LastCheckpoint=(none)")
    progress = j.get("progress")
    if progress:
        step = progress.get("step")
        lines.append(
            f"   Progress={'step ' + str(step) if step is not None else 'reported'}"
            f" at {_ts(progress.get('ts'))}"
        )
    return lines


def _deps(deps: list[dict[str, Any]]) -> str:
    if not deps:
        return "(null)"
    return ",".join(f"{d['type']}" + "".join(f":{x}" for x in d.get("jobs", [])) for d in deps)


def _exit(j: dict[str, Any]) -> str:
    return f"{j['exit_code'] if j['exit_code'] is not None else 0}:{j['exit_signal'] or 0}"


def nodes_table(nodes: list[dict[str, Any]]) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold")
    cols = ("NODE", "STATE", "CPUS(A/T)", "MEM(A/T)", "GPUS(A/T)", "FEATURES", "CONFIG", "REASON")
    for col in cols:
        t.add_column(col)
    for n in nodes:
        reason = n["drain_reason"] or n["down_reason"] or ""
        if n["drain_by"]:
            reason += f" [{n['drain_by']}]"
        if n.get("spare_for"):
            spare = "spare for job " + ",".join(str(x) for x in n["spare_for"])
            reason = f"{reason}; {spare}" if reason else spare
        for w in n.get("maintenance") or []:
            if w["state"] == "scheduled":  # an active one shows as the drain reason
                maint = f"maintenance {w['id']} at {_ts(w['start'])}"
                reason = f"{reason}; {maint}" if reason else maint
        cells = (
            n["name"],
            n["state"],
            f"{n['cpus_alloc']}/{n['cpus']}",
            f"{n['mem_alloc_mb']}/{n['mem_mb']}",
            f"{n['gpus_alloc']}/{len(n['gpus'])}",
            ",".join(n["features"]) or "-",
            config_text(n),
            reason,
        )
        t.add_row(*(escape(c) for c in cells))
    return t


def config_text(n: dict[str, Any]) -> str:
    """The cluster configuration version a node's agent runs: `3`, `2 (behind 3)`, `-`
    (not said: no version in the store, an agent that does not report it)."""
    applied = n.get("config_version")
    if applied is None:
        return "-"
    if n.get("config_behind"):
        return f"{applied} (behind {n.get('cluster_config_version')})"
    return str(applied)


def node_detail(n: dict[str, Any]) -> str:
    n = escape_data(n)
    gpu_types = sorted({g[1] for g in n["gpus"]})
    lines = [
        f"NodeName={n['name']} State={n['state']} Addr={n['addr']}",
        f"   CPUAlloc={n['cpus_alloc']} CPUTot={n['cpus']} RealMemory={n['mem_mb']} AllocMem={n['mem_alloc_mb']}",
        f"   Gres=gpu:{len(n['gpus'])}"
        + (f" ({','.join(gpu_types)})" if gpu_types else "")
        + f" GresUsed=gpu:{n['gpus_alloc']} Features={','.join(n['features']) or '(null)'}",
        f"   LastHeartbeat={_ts(n['last_heartbeat'])} Registered={_ts(n['registered_at'])}"
        + (f" ConfigVersion={config_text(n)}" if n.get("config_version") is not None else ""),
        *(
            ["   Topology=" + ",".join(f"{k}={v}" for k, v in n["topology"].items())]
            if n.get("topology")
            else []
        ),
        f"   Jobs={','.join(str(x) for x in n['jobs']) or '(none)'}"
        + (f" SpareFor={','.join(str(x) for x in n['spare_for'])}" if n.get("spare_for") else ""),
    ]
    health = n.get("health") or {}
    if health:
        what = f" ({health.get('check')}: {health.get('reason')})" if health.get("check") else ""
        lines.append(f"   Health={health.get('status', 'ok')}{what}")
        isolation = (health.get("checks") or {}).get("isolation")
        if isolation and health.get("check") != "isolation":
            lines.append(f"   Isolation={isolation.get('reason')}")
    if n["drain"]:
        lines.append(f"   Reason={n['drain_reason']} [{n['drain_by']}@{_ts(n['drain_time'])}]")
    if n["down"]:
        lines.append(f"   DownReason={n['down_reason']}")
    for w in n.get("maintenance") or []:
        lines.append(
            f"   Maintenance={w['id']} State={w['state']} Start={_ts(w['start'])} "
            f"End={_ts(w['end'])}" + (f" Reason={w['reason']}" if w.get("reason") else "")
        )
    for e in n.get("events", [])[-10:]:
        lines.append(f"   {_ts(e['ts'])} {e['kind']}: {e['message']}")
    return "\n".join(lines) + "\n"


def events_text(evs: list[dict[str, Any]]) -> str:
    """Events as aligned lines; the message is last and never padded or cut, so one long
    message does not widen every row (as a table would) and `grep` sees whole messages."""
    evs = escape_data(evs)
    header = ("TIME", "KIND", "JOB", "NODE", "BY")
    rows = [
        (_ts(e["ts"]), e["kind"], str(e["job_id"] or ""), e["node"] or "", e["actor"] or "")
        for e in evs
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...], message: str) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + "  " + message

    lines = [line(header, "MESSAGE")]
    lines += [line(r, e["message"] or "").rstrip() for r, e in zip(rows, evs, strict=True)]
    return "\n".join(lines)


def cluster_summary(st: dict[str, Any]) -> str:
    lines = ["Controllers:"]
    for c in st["controllers"]:
        line = f"  {c['id']}  {c['url']}  last seen {_ts(c['last_seen'])}"
        if c.get("config_version") is not None:  # the cluster configuration version it runs
            line += f"  config version {c['config_version']}"
        if c.get("config_problem"):
            line += f"  TAKES NO DUTIES: {c['config_problem']}"
        lines.append(line)
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
    if st.get("node_mtbf"):
        lines.append(describe_cluster_mtbf(st["node_mtbf"]))
    return "\n".join(lines)


class WaitProgress:
    """What `phalanx wait` shows on a terminal: a line per state change, and a live line.

    Pure: it remembers the states it has shown and is given the jobs and the time waited."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def changes(self, jobs: list[dict[str, Any]]) -> list[str]:
        """A line for each job whose state differs from the last one shown (or is new)."""
        out = []
        for j in jobs:
            if self.seen.get(j["job_id"]) == j["state"]:
                continue
            self.seen[j["job_id"]] = j["state"]
            line = f"job {j['job_id']}: {j['state']}"
            if j["state"] in ("STARTING", "RUNNING", "COMPLETING") and j.get("nodelist"):
                line += f" on {j['nodelist']}"
            elif j.get("reason") and j["state"] != "COMPLETED":
                line += f" ({j['reason']})"
            out.append(line)
        return out

    @staticmethod
    def live_line(jobs: list[dict[str, Any]], waited_s: float) -> str:
        """``waiting: 12 RUNNING (00:01:05 elapsed)``; state counts for more than three jobs."""
        if len(jobs) <= 3:
            what = ", ".join(f"{j['job_id']} {j['state']}" for j in jobs)
        else:
            counts: dict[str, int] = {}
            for j in jobs:
                counts[j["state"]] = counts.get(j["state"], 0) + 1
            what = f"{len(jobs)} jobs: " + ", ".join(f"{n} {st}" for st, n in counts.items())
        return f"waiting: {what} ({format_duration(int(waited_s))} elapsed)"
