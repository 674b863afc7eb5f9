"""`scontrol`: show jobs, nodes and partitions in Slurm's `Key=Value` form, expand and compress
host lists, requeue/hold/release jobs, update pending jobs and nodes, mint a token, ping.

Scripts grep its output (`Command=`, `WorkDir=`, `StdOut=`, `JobState=`, `NodeList=`) and call
`scontrol show hostnames "$SLURM_JOB_NODELIST"` and `scontrol requeue $SLURM_JOB_ID`, so those
forms are Slurm 22.05's. The formatting functions are pure (dict in, lines out).
"""

from __future__ import annotations

import fnmatch
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from phalanx.api_calls import ApiCalls
from phalanx.domain.hostlist import compress_hostlist, expand_hostlist
from phalanx.domain.text import escape
from phalanx.errors import Forbidden, NotFound, PhalanxError
from phalanx.failover import urls_from
from phalanx.slurm import records, scontrol_resv
from phalanx.slurm.common import (
    TERMINAL_STATES,
    SlurmParser,
    SlurmUsageError,
    add_clusters,
    check_clusters,
    client,
    duration_full,
    refuse,
    run_command,
    slurm_state,
    timestamp,
)
from phalanx.slurm.scontrol_refused import COMMANDS as REFUSED_COMMANDS
from phalanx.slurm.scontrol_refused import OPTIONS as REFUSED_OPTIONS
from phalanx.slurm.scontrol_refused import SHORT as REFUSED_SHORT
from phalanx.slurm.scontrol_refused import SHOW as REFUSED_SHOW

PROG = "scontrol"

# the commands that ask the controllers; `ping` and `version` are answered on their own, and
# everything else scontrol(1) has is refused with why (slurm/scontrol_refused.py)
CLIENT_COMMANDS = (
    *("show", "requeue", "requeuehold", "hold", "uhold", "release", "update", "token"),
    *("wait_job", "create", "delete"),
)
RECENT_S = 300.0  # `show job` without an id also lists jobs ended this recently (MinJobAge)


class CommandError(Exception):
    """A failed scontrol command: the message is printed as is (Slurm's own wording)."""


# ---------------------------------------------------------------------------- show job
def job_lines(job: dict[str, Any], now: float) -> list[str]:
    """One job as `scontrol show job` prints it: the first line, then lines indented by 3."""
    state = job.get("state") or "PENDING"
    user, group = records.user_ids(str(job.get("user") or "?"))
    start = job.get("start_time")
    end = job.get("end_time")
    limit = job.get("time_limit_s")
    waiting = start is None or state in ("PENDING", "HELD")
    run = 0.0 if waiting or start is None else (end or now) - start
    if end is None and start is not None and limit and state not in ("PENDING", "HELD"):
        end = start + limit  # Slurm shows a running job's projected end
    if state in ("PENDING", "HELD"):
        start_text, end_text = "Unknown", "Unknown"
    else:
        start_text, end_text = timestamp(start, "Unknown"), timestamp(end, "Unknown")
    first = f"JobId={job['id']}"
    if job.get("array_job_id") is not None:
        first += f" ArrayJobId={job['array_job_id']} ArrayTaskId={job['array_task_id']}"
        if job.get("array_limit"):
            first += f" ArrayTaskThrottle={job['array_limit']}"
    first += f" JobName={job.get('name') or ''}"
    deps = job.get("dependency") or []
    dep_text = ",".join(
        f"{d.get('type')}:{':'.join(str(j) for j in d.get('jobs') or [])}"
        for d in deps
        if isinstance(d, dict)
    )
    nodes = records.node_count(job)
    cpus = records.cpu_count(job)
    host = records.batch_host(job) if state not in ("PENDING", "HELD") else None
    lines = [
        first,
        f"UserId={user} GroupId={group} MCS_label=N/A",
        f"Priority={job.get('priority') or 0} Nice={job.get('nice') or 0} Account={records.null_text(job.get('account'))} "
        f"QOS={job.get('qos') or 'normal'}",
        f"JobState={slurm_state(state)} Reason={records.reason_word(job)} "
        f"Dependency={records.null_text(dep_text)}",
        f"Requeue={int(bool(job.get('requeue', True)))} Restarts={job.get('restart_count') or 0} "
        f"BatchFlag=1 Reboot=0 ExitCode={records.exit_code_text(job)}",
        f"RunTime={duration_full(run)} TimeLimit={duration_full(limit, unlimited=True)} "
        "TimeMin=N/A",
        f"SubmitTime={timestamp(job.get('submit_time'), 'Unknown')} "
        f"EligibleTime={timestamp(job.get('eligible_time') or job.get('submit_time'), 'Unknown')}",
        f"StartTime={start_text} EndTime={end_text} Deadline=N/A",
        f"PreemptTime={_preempt_time(job)} SuspendTime=None SecsPreSuspend=0",
        f"Partition={job.get('partition') or ''}",
        f"NodeList={records.null_text(job.get('nodelist'))}",
    ]
    if job.get("reservation"):  # as Slurm: only for a job that asked for one
        lines.append(f"Reservation={job['reservation']}")
    if job.get("exclude"):  # Slurm's ExcNodeList= (its ReqNodeList is Phalanx's --nodelist)
        lines.append(f"ExcNodeList={compress_hostlist(list(job['exclude']))}")
    if host:
        lines.append(f"BatchHost={host}")
    lines += [
        f"NumNodes={nodes} NumCPUs={cpus} NumTasks={job.get('ntasks') or nodes} "
        f"CPUs/Task={job.get('cpus_per_task') or 1}",
        f"TRES={records.tres_text(job)}",
        f"Features={records.null_text(job.get('constraint'))}",
        # Slurm prints Licenses= on every job; here only on jobs that asked for some
        *([f"Licenses={job['licenses']}"] if job.get("licenses") else []),
        f"Command={records.null_text(job.get('command'))}",
        f"WorkDir={records.null_text(job.get('workdir'))}",
    ]
    if job.get("comment"):
        lines.append(f"Comment={job['comment']}")
    lines += [
        f"StdErr={records.null_text(job.get('stderr'))}",
        "StdIn=/dev/null",
        f"StdOut={records.null_text(job.get('stdout'))}",
    ]
    return lines


def render_blocks(blocks: list[list[str]], *, oneliner: bool) -> str:
    """Records as scontrol prints them: indented lines and a blank line after each record, or
    one line per record with `-o`. Each line is escaped (domain/text.py): a control character
    in a stored name or reason prints as its visible escape and cannot start a line of its own."""
    blocks = [[escape(x) for x in b] for b in blocks]
    if oneliner:
        return "".join(" ".join(b) + "\n" for b in blocks)
    return "".join(b[0] + "\n" + "".join(f"   {x}\n" for x in b[1:]) + "\n" for b in blocks)


# ---------------------------------------------------------------------------- show node
def node_lines(node: dict[str, Any], partitions: list[str]) -> list[str]:
    gpus = node.get("gpus") or []
    gres = "(null)"
    if gpus:
        types = sorted({str(g[1]) for g in gpus if len(g) > 1 and g[1]})
        gres = f"gpu:{types[0]}:{len(gpus)}" if len(types) == 1 else f"gpu:{len(gpus)}"
    features = ",".join(node.get("features") or []) or "(null)"
    cpus, mem = int(node.get("cpus") or 0), int(node.get("mem_mb") or 0)
    name = node["name"]
    alloc = [f"cpu={node.get('cpus_alloc') or 0}"]
    if node.get("mem_alloc_mb"):
        alloc.append(f"mem={records.mem_text(node['mem_alloc_mb'])}")
    if node.get("gpus_alloc"):
        alloc.append(f"gres/gpu={node['gpus_alloc']}")
    cfg = [f"cpu={cpus}", f"mem={records.mem_text(mem)}", f"billing={cpus}"]
    if gpus:
        cfg.append(f"gres/gpu={len(gpus)}")
    lines = [
        f"NodeName={name} CoresPerSocket=1",
        f"CPUAlloc={node.get('cpus_alloc') or 0} CPUEfctv={cpus} CPUTot={cpus} CPULoad=N/A",
        f"AvailableFeatures={features}",
        f"ActiveFeatures={features}",
        f"Gres={gres}",
        f"NodeAddr={node.get('addr') or name} NodeHostName={name}",
        f"RealMemory={mem} AllocMem={node.get('mem_alloc_mb') or 0} FreeMem=N/A",
        f"State={node.get('state') or 'UNKNOWN'} ThreadsPerCore=1 TmpDisk=0 Weight=1",
        f"Partitions={','.join(partitions) or '(null)'}",
        f"LastBusyTime={timestamp(node.get('last_heartbeat'), 'None')}",
        f"CfgTRES={','.join(cfg)}",
        f"AllocTRES={','.join(alloc) if node.get('cpus_alloc') else ''}",
    ]
    if node.get("cluster_config_version") is not None:
        # Phalanx's: the cluster configuration version whose node settings the agent runs,
        # and the cluster's (a node behind shows a lower ConfigVersion than the cluster's)
        lines.append(
            f"ConfigVersion={records.null_text(node.get('config_version'))} "
            f"ClusterConfigVersion={node['cluster_config_version']}"
        )
    reason = node.get("drain_reason") if node.get("drain") else node.get("down_reason")
    if reason:
        who = node.get("drain_by") or "root"
        at = timestamp(node.get("drain_time"), "Unknown")
        lines.append(f"Reason={reason} [{who}@{at}]")
    return lines


def _preempt_time(job: dict[str, Any]) -> str:
    """Slurm's PreemptTime: when the job was last preempted (here: the end of its latest
    attempt a preemption stopped, docs/preemption.md), else None."""
    for a in reversed(job.get("attempts") or []):
        if str(a.get("stop_reason") or "").split(": ", 1)[-1].startswith("preempted by job "):
            return timestamp(a.get("end_time"), "None")
    return "None"


def partition_nodes(part: dict[str, Any], names: Sequence[str]) -> list[str]:
    """The nodes a partition's globs (`node*`, `gpu[0-9]*,big1`) select."""
    globs = [g.strip() for g in str(part.get("nodes") or "*").split(",") if g.strip()]
    return [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)]


def _limit_text(seconds: Any, none: str) -> str:
    return none if seconds is None else duration_full(float(seconds))


def partition_lines(part: dict[str, Any], nodes: list[dict[str, Any]]) -> list[str]:
    names = [n["name"] for n in nodes]
    cpus = sum(int(n.get("cpus") or 0) for n in nodes)
    return [
        f"PartitionName={part['name']}",
        "AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL",
        f"AllocNodes=ALL Default={'YES' if part.get('is_default') else 'NO'} QoS=N/A",
        f"DefaultTime={_limit_text(part.get('default_time_s'), 'NONE')} DisableRootJobs=NO "
        "ExclusiveUser=NO GraceTime=0 Hidden=NO",
        f"MaxNodes=UNLIMITED MaxTime={_limit_text(part.get('max_time_s'), 'UNLIMITED')} "
        "MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED",
        f"Nodes={compress_hostlist(names) if names else '(null)'}",
        f"PriorityJobFactor={part.get('priority') or 0} "
        f"PriorityTier={part.get('priority_tier', part.get('priority')) or 0} "
        "RootOnly=NO ReqResv=NO OverSubscribe=NO",
        f"OverTimeLimit=NONE PreemptMode={str(part.get('preempt_mode') or 'off').upper()}",
        f"State=UP TotalCPUs={cpus} TotalNodes={len(names)} SelectTypeParameters=NONE",
        "JobDefaults=(null)",
        "DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED",
    ]


# ---------------------------------------------------------------------------- update
JOB_KEYS = {"timelimit": "time_limit", "numnodes": "nodes", "partition": "partition",
            "dependency": "dependency", "comment": "comment", "jobname": "name",
            "name": "name"}  # fmt: skip


def parse_assignments(words: Sequence[str]) -> list[tuple[str, str]]:
    """`Key=Value` words (keys any case) as scontrol takes them; a word without `=` is refused."""
    out = []
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or not key:
            raise SlurmUsageError(f"Invalid input: {w}  (use Key=Value, e.g. TimeLimit=1:00:00)")
        out.append((key, value))
    return out


def parse_job_update(words: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """`JobId=12,13 TimeLimit=2:00:00 NumNodes=2 Partition=p Dependency=afterok:5` to the job
    references and the changes the API takes. Other keys are named and refused."""
    refs: list[str] = []
    changes: dict[str, Any] = {}
    for key, value in parse_assignments(words):
        k = key.lower()
        if k in ("jobid", "job"):
            refs.extend(x for x in value.split(",") if x)
        elif k == "numnodes":
            lo, _, hi = value.partition("-")
            if not lo.isdecimal() or (hi and hi != lo) or int(lo) < 1:
                raise SlurmUsageError(
                    f"NumNodes={value}: give a node count (N, or N-N); node ranges are not "
                    "supported here"
                )
            changes["nodes"] = int(lo)
        elif k in ("priority", "nice"):
            try:
                changes[k] = int(value)
            except ValueError:
                raise SlurmUsageError(f"{key}={value}: give a whole number") from None
        elif k == "arraytaskthrottle":
            if not value.isdecimal():
                raise SlurmUsageError(
                    f"ArrayTaskThrottle={value}: give the number of tasks (0: no limit)"
                )
            changes["array_throttle"] = int(value)
        elif k == "excnodelist":
            changes["exclude"] = value
        elif k in JOB_KEYS:
            changes[JOB_KEYS[k]] = value
        else:
            raise SlurmUsageError(
                f"Update of {key} is not supported here (supported: TimeLimit, NumNodes, "
                "Partition, Dependency, Priority, Nice, ExcNodeList, ArrayTaskThrottle, "
                "JobName, Comment)"
            )
    if not refs:
        raise SlurmUsageError("No job id given: use JobId=<id>")
    if not changes:
        raise SlurmUsageError(
            "Nothing to update: give TimeLimit=, NumNodes=, Partition=, Dependency=, Priority=, "
            "Nice=, ExcNodeList=, ArrayTaskThrottle=, JobName= or Comment="
        )
    return refs, changes


def parse_node_update(words: Sequence[str]) -> tuple[list[str], str, str | None]:
    """`NodeName=n[1-2] State=DRAIN Reason="..."` to (nodes, DRAIN|RESUME, reason)."""
    nodes: list[str] = []
    state: str | None = None
    reason: str | None = None
    for key, value in parse_assignments(words):
        k = key.lower()
        if k == "nodename":
            nodes.extend(expand_hostlist(value))
        elif k == "state":
            state = value.upper()
        elif k == "reason":
            reason = value
        else:
            raise SlurmUsageError(
                f"Update of node {key} is not supported here (supported: State=DRAIN with "
                "Reason=, State=RESUME)"
            )
    if state is None:
        raise SlurmUsageError("No State= given: use State=DRAIN Reason=... or State=RESUME")
    if state in ("DRAIN", "DOWN") and not reason:
        raise SlurmUsageError(
            "You must specify a reason when DOWNING or DRAINING a node. Request denied"
        )
    if state == "DOWN":
        raise SlurmUsageError("State=DOWN is not supported here: use State=DRAIN Reason=...")
    if state not in ("DRAIN", "RESUME", "UNDRAIN", "IDLE"):
        raise SlurmUsageError(
            f"State={state} is not supported here (supported: DRAIN, RESUME, UNDRAIN)"
        )
    return nodes, ("DRAIN" if state == "DRAIN" else "RESUME"), reason


# ---------------------------------------------------------------------------- commands
def _job_refs(words: Sequence[str], cmd: str) -> list[str]:
    refs = [x for w in words for x in w.split(",") if x]
    if not refs:
        raise SlurmUsageError(f"{cmd}: no job id given (scontrol {cmd} <job_id>[,<job_id>...])")
    for r in refs:
        if not r.replace("_", "").isdecimal():
            raise CommandError(f"Invalid job id specified for job {r}")
    return refs


def requeues_itself(refs: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether `scontrol requeue` names the job it runs in ($SLURM_JOB_ID, its array task
    `A_T`, or its whole array `A`). Such a job is stopped at once, this process with it:
    submitit's `subprocess.check_call(["scontrol", "requeue", id])` in its signal handler
    then saw the requeue fail (killed by SIGTERM) though it had been done."""
    own = {environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_ARRAY_JOB_ID", "")}
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        own.add(f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}")
    own.discard("")
    return any(r in own for r in refs)


def _results(results: dict[str, str], ok: tuple[str, ...]) -> int:
    """Print the per-job failures as scontrol does (`<why> for job <id>`); exit 1 if any."""
    rc = 0
    for jid, res in results.items():
        if not res.startswith(ok):
            sys.stderr.write(f"{res} for job {jid}\n")
            rc = 1
    return rc


def show(cli: ApiCalls | None, words: list[str], *, oneliner: bool, now: float) -> int:
    if not words:
        raise SlurmUsageError("show: say what to show (job, node, partition, hostnames, hostlist)")
    what, rest = words[0].lower(), words[1:]
    if what in ("hostnames", "hostname"):
        text = ",".join(rest) or os.environ.get("SLURM_JOB_NODELIST", "")
        if not text:
            raise CommandError(
                "scontrol: error: no host list given and SLURM_JOB_NODELIST is not set"
            )
        try:
            names = expand_hostlist(text)
        except ValueError as e:
            raise CommandError(f"scontrol: error: invalid host list {text!r}: {e}") from None
        sys.stdout.write("".join(n + "\n" for n in names))
        return 0
    if what in ("hostlist", "hostlistsorted"):
        if not rest:
            raise SlurmUsageError("show hostlist: give the host names (a,b,c)")
        names = [n for w in rest for n in w.split(",") if n]
        sys.stdout.write(compress_hostlist(names) + "\n")
        return 0
    assert cli is not None
    if what in ("job", "jobs", "jobid"):
        try:
            if rest:
                jobs = [j for r in _job_refs(rest, "show job") for j in cli.job(r)]
            else:
                jobs = cli.jobs(detail="true", active_after=now - RECENT_S)
        except (NotFound, CommandError):
            raise CommandError("slurm_load_jobs error: Invalid job id specified") from None
        if not jobs and not rest:
            sys.stdout.write("No jobs in the system\n")
            return 0
        sys.stdout.write(render_blocks([job_lines(j, now) for j in jobs], oneliner=oneliner))
        return 0
    if what in ("node", "nodes"):
        nodes = cli.nodes()
        parts = cli.cluster().get("partitions") or []
        names = [n["name"] for n in nodes]
        if rest:
            wanted = set(expand_hostlist(",".join(rest)))
            nodes = [n for n in nodes if n["name"] in wanted]
            if not nodes:
                raise CommandError(
                    f"Node {','.join(rest)} not found"
                    if len(wanted) == 1
                    else "slurm_load_node error: Invalid node name specified"
                )
        member = {n: [p["name"] for p in parts if n in partition_nodes(p, names)] for n in names}
        blocks = [node_lines(n, member.get(n["name"], [])) for n in nodes]
        sys.stdout.write(render_blocks(blocks, oneliner=oneliner))
        return 0
    if what in ("partition", "partitions"):
        parts = cli.cluster().get("partitions") or []
        nodes = cli.nodes()
        if rest:
            parts = [p for p in parts if p["name"] == rest[0]]
            if not parts:
                raise CommandError(f"Partition {rest[0]} not found")
        names = [n["name"] for n in nodes]
        blocks = []
        for p in parts:
            members = set(partition_nodes(p, names))
            blocks.append(partition_lines(p, [n for n in nodes if n["name"] in members]))
        sys.stdout.write(render_blocks(blocks, oneliner=oneliner))
        return 0
    if what in ("reservation", "reservations", "res"):
        blocks = scontrol_resv.show_blocks(cli, rest, now)
        if not blocks:
            sys.stdout.write("No reservations in the system\n")
            return 0
        sys.stdout.write(render_blocks(blocks, oneliner=oneliner))
        return 0
    if what in ("lic", "license", "licenses"):
        lics = cli.licenses()
        if rest:
            lics = [x for x in lics if x["name"] == rest[0]]
            if not lics:
                raise CommandError(f"License {rest[0]} not found")
        sys.stdout.write(render_blocks([license_lines(x) for x in lics], oneliner=oneliner))
        return 0
    raise SlurmUsageError(
        f"show {words[0]} is not supported here (supported: job, node, partition, reservation, "
        "licenses, hostnames, hostlist)"
    )


WAIT_POLL_S = 1.0  # how often `scontrol wait_job` looks at the job


def wait_job(cli: ApiCalls, words: list[str]) -> int:
    """`scontrol wait_job JOB`: return once the job runs on all its nodes (0), or has ended
    (1, in Slurm's words), as Slurm's does for a prolog or a script waiting on nodes."""
    if len(words) != 1:
        raise SlurmUsageError("wait_job: give one job id")
    (ref,) = _job_refs(words, "wait_job")
    while True:
        try:
            (job,) = cli.job(ref)[:1]
        except (NotFound, ValueError):
            raise CommandError(f"Invalid job id specified for job {ref}") from None
        if job["state"] == "RUNNING":
            return 0
        if job["state"] in TERMINAL_STATES:
            raise CommandError(f"scontrol: error: Job allocation {ref} has been revoked")
        time.sleep(WAIT_POLL_S)


def license_lines(lic: dict[str, Any]) -> list[str]:
    """Slurm 22.05's record: LicenseName=, then Total/Used/Free (no reservations, no remote
    licences here)."""
    return [
        f"LicenseName={lic['name']}",
        f"Total={lic['total']} Used={lic['used']} Free={lic['free']} Reserved=0 Remote=no",
    ]


def update(cli: ApiCalls, words: list[str]) -> int:
    if not words:
        raise SlurmUsageError(
            "update: give JobId=..., NodeName=... or ReservationName=... and what to change"
        )
    first = words[0].split("=", 1)[0].lower()
    if first in scontrol_resv.NAME_KEYS:
        return scontrol_resv.update(cli, words, time.time())
    if first in ("jobid", "job"):
        refs, changes = parse_job_update(words)
        try:
            results = cli.update_jobs(refs, **changes)
        except NotFound:
            raise CommandError(f"Invalid job id specified for job {','.join(refs)}") from None
        return _results(results, ("updated",))
    if first == "nodename":
        nodes, state, reason = parse_node_update(words)
        for name in nodes:
            try:
                if state == "DRAIN":
                    cli.drain(name, reason or "")
                else:
                    cli.resume(name)
            except NotFound:
                raise CommandError("slurm_update error: Invalid node name specified") from None
        return 0
    raise SlurmUsageError(
        f"update {words[0]}: only JobId=..., NodeName=... and ReservationName=... updates are "
        "supported here"
    )


def token(cli: ApiCalls, words: list[str]) -> int:
    lifespan = 1800.0  # Slurm's default lifespan
    for key, value in parse_assignments(words):
        if key.lower() == "lifespan":
            if not value.isdecimal() or int(value) < 1:
                raise SlurmUsageError(f"Invalid lifespan: {value} (seconds)")
            lifespan = float(value)
        else:
            raise SlurmUsageError(f"token: {key}= is not supported here (lifespan= is)")
    me = cli.get("/v1/whoami")
    try:
        res = cli.post("/v1/tokens", {"user": me["user"], "role": "user", "lifetime_s": lifespan})
    except Forbidden:
        raise CommandError(
            f"scontrol: error: {me['user']} may not mint a token: on this cluster tokens are "
            "created by an administrator (phalanx token create), who can give you one"
        ) from None
    sys.stdout.write(f"SLURM_JWT={res['token']}\n")
    return 0


def ping(urls: list[str]) -> int:
    """`Slurmctld(primary) at HOST is UP` for each controller, as scontrol ping prints."""
    up = 0
    for i, url in enumerate(urls):
        role = "primary" if i == 0 else ("backup" if i == 1 else f"backup{i - 1}")
        host = httpx.URL(url).host + (f":{httpx.URL(url).port}" if httpx.URL(url).port else "")
        try:
            ok = httpx.get(url + "/healthz/ready", timeout=5.0, verify=False).status_code == 200
        except httpx.HTTPError:
            ok = False
        up += ok
        sys.stdout.write(f"Slurmctld({role}) at {host} is {'UP' if ok else 'DOWN'}\n")
    return 0 if up else 1


def body(argv: list[str]) -> int:
    parser = SlurmParser(PROG, add_help=True)
    parser.add_argument("-o", "--oneliner", action="store_true")
    parser.add_argument("-d", "--details", action="store_true")
    parser.add_argument("-a", "--all", action="store_true")
    parser.add_argument("-Q", "--quiet", action="store_true")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    add_clusters(parser)
    for option, why in REFUSED_OPTIONS.items():
        short = REFUSED_SHORT.get(option)
        refuse(parser, *((short, option) if short else (option,)), why=why,
               nargs=1 if option == "--uid" else 0)  # fmt: skip
    parser.add_argument("words", nargs="*")
    opts, unknown = parser.parse_known_args(argv)
    extra = [u for u in unknown if u.startswith("-")]
    if extra:
        raise SlurmUsageError(f"unrecognized option '{extra[0]}' (not supported here)")
    words = [*opts.words, *[u for u in unknown if not u.startswith("-")]]
    if not words:
        raise SlurmUsageError("no command given (show, requeue, hold, release, update, ...)")
    cmd, rest = words[0].lower(), words[1:]
    now = time.time()
    if cmd == "show" and rest and rest[0].lower() in ("hostnames", "hostname", "hostlist",
                                                      "hostlistsorted"):  # fmt: skip
        return show(None, rest, oneliner=opts.oneliner, now=now)
    if cmd == "ping":
        return ping(urls_from(None))
    if cmd == "version":  # as `scontrol --version`
        from phalanx.slurm.main import SLURM_RELEASE

        sys.stdout.write(f"slurm {SLURM_RELEASE}\n")
        return 0
    if cmd in REFUSED_COMMANDS:
        raise CommandError(f"scontrol: error: {cmd} is not supported: {REFUSED_COMMANDS[cmd]}")
    if cmd in ("suspend", "resume"):
        raise CommandError(
            f"scontrol: error: {cmd} is not supported: Phalanx does not suspend jobs (use "
            "scontrol requeue, or hold a pending job)"
        )
    if cmd == "show" and rest and rest[0].lower() in REFUSED_SHOW:
        what = rest[0].lower()
        raise CommandError(f"scontrol: error: show {what} is not supported: {REFUSED_SHOW[what]}")
    if cmd not in CLIENT_COMMANDS:
        raise SlurmUsageError(f"invalid command '{words[0]}' (not supported here)")
    with client() as cli:
        check_clusters(cli, opts.clusters)
        if cmd == "wait_job":
            return wait_job(cli, rest)
        if cmd == "show":
            return show(cli, rest, oneliner=opts.oneliner, now=now)
        if cmd == "update":
            return update(cli, rest)
        if cmd == "token":
            return token(cli, rest)
        if cmd == "create":
            return scontrol_resv.create(cli, rest, now)
        if cmd == "delete":
            return scontrol_resv.delete(cli, rest)
        # `JobId=12` / `Job=12` as scontrol also takes them; other keys are refused
        words = [w.split("=", 1)[1] if w.lower().startswith(("jobid=", "job=")) else w
                 for w in rest]  # fmt: skip
        if any("=" in w for w in words):
            raise SlurmUsageError(
                f"{cmd}: only job ids are supported here, not {next(w for w in words if '=' in w)}"
            )
        refs = _job_refs(words, cmd)
        try:
            if cmd in ("requeue", "requeuehold"):
                if requeues_itself(refs, os.environ):
                    # the job stops (SIGTERM) as soon as the requeue is taken, and we are one
                    # of its processes: say how the request went rather than die of its effect
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                results = cli.requeue(refs, hold=cmd == "requeuehold")
                return _results(results, ("requeued", "held"))
            if cmd in ("hold", "uhold"):
                return _results(cli.hold(refs), ("held",))
            return _results(cli.release(refs), ("released",))
        except NotFound:
            raise CommandError(f"Invalid job id specified for job {','.join(refs)}") from None


def main(argv: list[str]) -> int:
    def guarded(args: list[str]) -> int:
        try:
            return body(args)
        except (CommandError, scontrol_resv.ResvError) as e:
            sys.stderr.write(f"{e}\n")
            return 1
        except PhalanxError as e:
            sys.stderr.write(f"scontrol: error: {e.message}\n")
            return 1

    return run_command(PROG, guarded, argv)
