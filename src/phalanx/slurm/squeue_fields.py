"""squeue's fields, every one Slurm 22.05 documents: the ``-o`` letters and the ``-O`` names,
each with Slurm's header and how Phalanx fills it, or refused by name.

One table per form (``LETTERS``, ``NAMES``); ``tests/unit/test_squeue_fields.py`` holds them
to the lists in Slurm 22.05's squeue(1) (``tests/data/slurm-22.05/``) so that none is silently
missing.  Headers and the texts of fields Phalanx has no counterpart for (``(null)``, ``N/A``,
``*``, ``0``) are what Slurm 22.05's squeue prints for a job without them, as checked against it
(../shared/slurm-lab).  Fields Slurm only has for job steps (``squeue -s``: StepID, StepName,
StepState, tres-per-step, CPUFreq, ResvPort, Nodes) are refused as Slurm refuses them for jobs.

Values come from the job records of ``GET /v1/jobs``; those marked in ``DETAIL`` need the
job's detail (command, working directory, output files, comment), which squeue then asks
for in the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.slurm.common import timestamp
from phalanx.slurm.records import null_text, user_account

# key -> (header); a key is the -o letter where there is one, else the -O name (lower case)
LETTERS: dict[str, str] = {
    "a": "ACCOUNT",
    "A": "ARRAY_JOB_ID",
    "B": "EXEC_HOST",
    "b": "TRES_PER_NODE",
    "c": "MIN_CPUS",
    "C": "CPUS",
    "d": "MIN_TMP_DISK",
    "D": "NODES",
    "e": "END_TIME",
    "E": "DEPENDENCY",
    "f": "FEATURES",
    "F": "ARRAY_JOB_ID",
    "g": "GROUP",
    "G": "GROUP",
    "h": "OVER_SUBSCRIBE",
    "H": "SOCKETS_PER_NODE",
    "i": "JOBID",
    "I": "CORES_PER_SOCKET",
    "j": "NAME",
    "J": "THREADS_PER_CORE",
    "k": "COMMENT",
    "K": "ARRAY_TASK_ID",
    "l": "TIME_LIMIT",
    "L": "TIME_LEFT",
    "m": "MIN_MEMORY",
    "M": "TIME",
    "n": "REQ_NODES",
    "N": "NODELIST",
    "o": "COMMAND",
    "O": "CONTIGUOUS",
    "p": "PRIORITY",
    "P": "PARTITION",
    "q": "QOS",
    "Q": "PRIORITY",
    "r": "REASON",
    "R": "NODELIST(REASON)",
    "s": "SELECT_JOB_INFO",
    "S": "START_TIME",
    "t": "ST",
    "T": "STATE",
    "u": "USER",
    "U": "UID",
    "v": "RESERVATION",
    "V": "SUBMIT_TIME",
    "w": "WCKEY",
    "W": "LICENSES",
    "x": "EXC_NODES",
    "X": "CORE_SPEC",
    "y": "NICE",
    "Y": "SCHEDNODES",
    "z": "S:C:T",
    "Z": "WORK_DIR",
}
# Slurm's -o header for %a shows ACCOUNT; its %s header is empty
LETTER_HEADERS = {**LETTERS, "s": ""}

# -O name (lower case) -> (key, header)
NAMES: dict[str, tuple[str, str]] = {
    "account": ("a", "ACCOUNT"),
    "accruetime": ("accruetime", "ACCRUE_TIME"),
    "admin_comment": ("admin_comment", "ADMIN_COMMENT"),
    "allocnodes": ("allocnodes", "ALLOC_NODES"),
    "allocsid": ("allocsid", "ALLOC_SID"),
    "arrayjobid": ("A", "ARRAY_JOB_ID"),
    "arraytaskid": ("K", "ARRAY_TASK_ID"),
    "associd": ("associd", "ASSOC_ID"),
    "batchflag": ("batchflag", "BATCH_FLAG"),
    "batchhost": ("B", "EXEC_HOST"),
    "boardspernode": ("boardspernode", "BOARDS_PER_NODE"),
    "burstbuffer": ("burstbuffer", "BURST_BUFFER"),
    "burstbufferstate": ("burstbufferstate", "BURST_BUFFER_STATE"),
    "cluster": ("cluster", "CLUSTER"),
    "clusterfeature": ("clusterfeature", "CLUSTER_FEATURES"),
    "command": ("o", "COMMAND"),
    "comment": ("k", "COMMENT"),
    "contiguous": ("O", "CONTIGUOUS"),
    "container": ("container", "CONTAINER"),
    "cores": ("I", "CORES_PER_SOCKET"),
    "corespec": ("X", "CORE_SPEC"),
    "cpus-per-task": ("cpus-per-task", "CPUS_PER_TASK"),
    "cpus-per-tres": ("cpus-per-tres", "CPUS_PER_TRES"),
    "deadline": ("deadline", "DEADLINE"),
    "delayboot": ("delayboot", "DELAY_BOOT"),
    "dependency": ("E", "DEPENDENCY"),
    "derivedec": ("derivedec", "DERIVED_EC"),
    "eligibletime": ("eligibletime", "ELIGIBLE_TIME"),
    "endtime": ("e", "END_TIME"),
    "exit_code": ("exit_code", "EXIT_CODE"),
    "feature": ("f", "FEATURES"),
    "groupid": ("G", "GROUP"),
    "groupname": ("g", "GROUP"),
    "hetjobid": ("hetjobid", "HET_JOB_ID"),
    "hetjobidset": ("hetjobidset", "HET_JOB_ID_SET"),
    "hetjoboffset": ("hetjoboffset", "HET_JOB_OFFSET"),
    "jobarrayid": ("i", "JOBID"),
    "jobid": ("jobid", "JOBID"),
    "lastschedeval": ("lastschedeval", "LAST_SCHED_EVAL"),
    "licenses": ("W", "LICENSES"),
    "maxcpus": ("maxcpus", "MAX_CPUS"),
    "maxnodes": ("maxnodes", "MAX_NODES"),
    "mcslabel": ("mcslabel", "MCSLABEL"),
    "mem-per-tres": ("mem-per-tres", "MEM_PER_TRES"),
    "mincpus": ("c", "MIN_CPUS"),
    "minmemory": ("m", "MIN_MEMORY"),
    "mintime": ("mintime", "TIME_MIN"),
    "mintmpdisk": ("d", "MIN_TMP_DISK"),
    "name": ("j", "NAME"),
    "network": ("network", "NETWORK"),
    "nice": ("y", "NICE"),
    "nodelist": ("N", "NODELIST"),
    "ntperboard": ("ntperboard", "NTASKS_PER_BOARD"),
    "ntpercore": ("ntpercore", "NTASKS_PER_CORE"),
    "ntpernode": ("ntpernode", "NTASKS_PER_NODE"),
    "ntpersocket": ("ntpersocket", "NTASKS_PER_SOCKET"),
    "numcpus": ("C", "CPUS"),
    "numnodes": ("D", "NODES"),
    "numtasks": ("numtasks", "TASKS"),
    "origin": ("origin", "ORIGIN"),
    "originraw": ("originraw", "ORIGIN_RAW"),
    "oversubscribe": ("h", "OVER_SUBSCRIBE"),
    "partition": ("P", "PARTITION"),
    "pendingtime": ("pendingtime", "PENDING_TIME"),
    "preempttime": ("preempttime", "PREEMPT_TIME"),
    "prefer": ("prefer", "PREFER"),
    "priority": ("p", "PRIORITY"),
    "prioritylong": ("Q", "PRIORITY"),
    "profile": ("profile", "PROFILE"),
    "qos": ("q", "QOS"),
    "reason": ("r", "REASON"),
    "reasonlist": ("R", "NODELIST(REASON)"),
    "reboot": ("reboot", "REBOOT"),
    "reqnodes": ("n", "REQ_NODES"),
    "reqswitch": ("reqswitch", "REQ_SWITCH"),
    "requeue": ("requeue", "REQUEUE"),
    "reservation": ("v", "RESERVATION"),
    "resizetime": ("resizetime", "RESIZE_TIME"),
    "restartcnt": ("restartcnt", "RESTART_COUNT"),
    "schednodes": ("Y", "SCHEDNODES"),
    "sct": ("z", "S:C:T"),
    "selectjobinfo": ("s", ""),
    "siblingsactive": ("siblingsactive", "ACTIVE_SIBLINGS"),
    "siblingsactiveraw": ("siblingsactiveraw", "ACTIVE_SIBLINGS_RAW"),
    "siblingsviable": ("siblingsviable", "VIABLE_SIBLINGS"),
    "siblingsviableraw": ("siblingsviableraw", "VIALBLE_SIBLINGS_RAW"),  # sic: Slurm 22.05's header
    "sockets": ("H", "SOCKETS_PER_NODE"),
    "sperboard": ("sperboard", "SOCKETS_PER_BOARD"),
    "starttime": ("S", "START_TIME"),
    "state": ("T", "STATE"),
    "statecompact": ("t", "ST"),
    "stderr": ("stderr", "STDERR"),
    "stdin": ("stdin", "STDIN"),
    "stdout": ("stdout", "STDOUT"),
    "submittime": ("V", "SUBMIT_TIME"),
    "system_comment": ("system_comment", "SYSTEM_COMMENT"),
    "threads": ("J", "THREADS_PER_CORE"),
    "timeleft": ("L", "TIME_LEFT"),
    "timelimit": ("l", "TIME_LIMIT"),
    "timeused": ("M", "TIME"),
    "tres-alloc": ("tres-alloc", "TRES_ALLOC"),
    "tres-bind": ("tres-bind", "TRES_BIND"),
    "tres-freq": ("tres-freq", "TRES_FREQ"),
    "tres-per-job": ("tres-per-job", "TRES_PER_JOB"),
    "tres-per-node": ("b", "TRES_PER_NODE"),
    "tres-per-socket": ("tres-per-socket", "TRES_PER_SOCKET"),
    "tres-per-task": ("tres-per-task", "TRES_PER_TASK"),
    "userid": ("U", "UID"),
    "username": ("u", "USER"),
    "wckey": ("w", "WCKEY"),
    "workdir": ("Z", "WORK_DIR"),
}
# -O fields Phalanx has no counterpart for: what Slurm 22.05 prints for a job without them
CONSTANT: dict[str, str] = {
    "boardspernode": "0",
    "burstbuffer": "(null)",
    "burstbufferstate": "(null)",
    "clusterfeature": "(null)",
    "container": "(null)",
    "cpus-per-tres": "N/A",
    "deadline": "N/A",
    "derivedec": "0",
    "hetjobid": "N/A",
    "hetjobidset": "N/A",
    "hetjoboffset": "N/A",
    "mcslabel": "(null)",
    "mem-per-tres": "N/A",
    "network": "(null)",
    "ntperboard": "0",
    "ntpercore": "N/A",
    "ntpersocket": "N/A",
    "origin": "NA",
    "originraw": "NA",
    "preempttime": "N/A",
    "prefer": "(null)",
    "reboot": "0",
    "reqswitch": "0",
    "resizetime": "N/A",
    "siblingsactive": "NA",
    "siblingsactiveraw": "NA",
    "siblingsviable": "NA",
    "siblingsviableraw": "NA",
    "sperboard": "0",
    "system_comment": "(null)",
    "tres-bind": "N/A",
    "tres-freq": "N/A",
    "tres-per-job": "N/A",
    "tres-per-socket": "N/A",
    "tres-per-task": "N/A",
}
# -O names Slurm documents that are job steps' only (squeue -s): it refuses them for jobs too
STEP_ONLY = ("cpufreq", "nodes", "resvport", "stepid", "stepname", "stepstate", "tres-per-step")
# keys whose values are in the job's detail (GET /v1/jobs?detail=true)
DETAIL = frozenset(
    {"k", "o", "Z", "W", "v", "stdout", "stderr", "stdin"}
    | {"maxnodes", "numtasks", "ntpernode", "cpus-per-task"}
)

Value = Callable[[dict[str, Any], float], str]


def _iso(t: float | None) -> str:
    return timestamp(t or None)  # Slurm's ISO form, N/A when unset


def _uid(job: dict[str, Any]) -> str:
    acct = user_account(str(job.get("user")))
    return str(acct.uid) if acct else "(null)"


def _group(job: dict[str, Any], numeric: bool) -> str:
    """The job user's primary group (records.user_account)."""
    acct = user_account(str(job.get("user")))
    if acct is None:
        return "(null)"
    return str(acct.gid) if numeric else acct.group


def _hosts(names: Any) -> str:
    from phalanx.domain.hostlist import compress_hostlist

    return compress_hostlist(list(names)) if names else ""


def _memory(job: dict[str, Any]) -> str:
    mb = int(job.get("mem_per_node_mb") or 0)
    return f"{mb}M" if mb else "0"


def _pending(job: dict[str, Any]) -> bool:
    return job["state"] in ("PENDING", "HELD")


def _tasks(job: dict[str, Any]) -> str:
    return str(job.get("ntasks") or job.get("nodes_alloc") or job.get("nodes") or 1)


def _tres_alloc(job: dict[str, Any]) -> str:
    if _pending(job):
        return "(null)"
    nodes = int(job.get("nodes_alloc") or job.get("nodes") or 1)
    cpus = nodes * int(job.get("cpus_per_node") or 1)
    parts = [f"cpu={cpus}"]
    mb = int(job.get("mem_per_node_mb") or 0) * nodes
    if mb:
        parts.append(f"mem={mb}M")
    parts.append(f"node={nodes}")
    gpus = int(job.get("gpus_per_node") or 0) * nodes
    if gpus:
        parts.append(f"gres/gpu={gpus}")
    return ",".join(parts)


def _constant(text: str) -> Value:
    return lambda j, now: text


# values of the keys the squeue module does not compute itself (its own: i j u T t M l D R
# P N A a F K k C b L S V e r Q p E)
EXTRA: dict[str, Value] = {
    "a": lambda j, now: null_text(j.get("account")),
    "B": lambda j, now: "n/a" if _pending(j) else null_text(j.get("batch_host")),
    "c": lambda j, now: str(int(j.get("cpus_per_node") or 1)),
    "d": lambda j, now: "0",
    "f": lambda j, now: null_text(j.get("constraint")),
    "g": lambda j, now: _group(j, numeric=False),
    "G": lambda j, now: _group(j, numeric=True),
    "h": lambda j, now: "NO" if j.get("exclusive") else "OK",
    "H": lambda j, now: "*",
    "I": lambda j, now: "*",
    "J": lambda j, now: "*",
    "m": lambda j, now: _memory(j),
    "n": lambda j, now: _hosts(j.get("req_nodes")),
    "o": lambda j, now: null_text(j.get("command")),
    "O": lambda j, now: "0",
    "q": lambda j, now: null_text(j.get("qos")),
    "s": lambda j, now: "",
    "U": lambda j, now: _uid(j),
    "v": lambda j, now: j.get("reservation") or "(null)",
    "w": lambda j, now: "(null)",
    "W": lambda j, now: null_text(j.get("licenses")),
    "x": lambda j, now: _hosts(j.get("exclude")),
    "X": lambda j, now: "N/A",
    "y": lambda j, now: str(int(j.get("nice") or 0)),
    "Y": lambda j, now: "(null)",
    "z": lambda j, now: "*:*:*",
    "Z": lambda j, now: null_text(j.get("workdir")),
    # -O only
    **{name: _constant(v) for name, v in CONSTANT.items()},
    "maxcpus": lambda j, now: str(
        int(j.get("nodes_alloc") or j.get("nodes") or 1) * int(j.get("cpus_per_node") or 1)
    ),
    "accruetime": lambda j, now: _iso(j.get("eligible_time") or j.get("submit_time")),
    "admin_comment": lambda j, now: "(null)",
    "allocnodes": lambda j, now: "(null)",
    "allocsid": lambda j, now: "0",
    "associd": lambda j, now: "0",
    "batchflag": lambda j, now: "1",
    "cluster": lambda j, now: str(j.get("_cluster") or "phalanx"),  # squeue adds it
    "cpus-per-task": lambda j, now: str(int(j.get("cpus_per_task") or 1)),
    "delayboot": lambda j, now: "0:00",
    "eligibletime": lambda j, now: _iso(j.get("eligible_time") or j.get("submit_time")),
    "exit_code": lambda j, now: str(int(j.get("exit_code") or 0)),
    "jobid": lambda j, now: str(j.get("id", j["job_id"])),
    "lastschedeval": lambda j, now: _iso(j.get("start_time") or j.get("submit_time")),
    "maxnodes": lambda j, now: str(int(j.get("nodes_max") or j.get("nodes") or 1)),
    "mintime": lambda j, now: "0:00",
    "ntpernode": lambda j, now: str(int(j.get("ntasks_per_node") or 0)),
    "numtasks": lambda j, now: _tasks(j),
    "pendingtime": lambda j, now: str(
        int(max(0.0, (j.get("start_time") or now) - float(j.get("submit_time") or now)))
    ),
    "profile": lambda j, now: "NotSet",
    "requeue": lambda j, now: str(int(bool(j.get("requeue", True)))),
    "restartcnt": lambda j, now: str(int(j.get("restart_count") or 0)),
    "stderr": lambda j, now: null_text(j.get("stderr")),
    "stdin": lambda j, now: "/dev/null",
    "stdout": lambda j, now: null_text(j.get("stdout")),
    "tres-alloc": lambda j, now: _tres_alloc(j),
}
