"""`sstat`: the live usage of a running job's steps, in Slurm 22.05's fields and forms.

`GET /v1/jobs/{ref}/usage` has the job's nodes' agents sample each running task's processes
(agent/taskstat.py); this command folds the tasks of each step into Slurm's figures: the
maximum over the tasks with the node and task it was seen on (MaxRSS, MaxVMSize, MaxPages,
MaxDiskRead, MaxDiskWrite), the minimum CPU time (MinCPU), and the averages over the tasks
(AveRSS, AveVMSize, AvePages, AveCPU, AveDiskRead, AveDiskWrite). Memory and I/O figures are
bytes shown as Slurm's `convert_num_unit` shows them (`1.37M`; `--noconvert`: bytes as they
are); CPU times as sacct's TotalCPU. Figures Phalanx does not measure (energy, CPU frequency)
print as Slurm prints them without a gatherer for them: 0, or Unknown.

Without a step, `-j N` shows the job's lowest-numbered running step (`-a`: every running
step, the batch step first); `N.batch` is the batch script's processes. The errors and exit
codes are Slurm's, checked against the lab (../shared/slurm-lab).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.domain import efficiency
from phalanx.domain.hostlist import compress_hostlist
from phalanx.errors import NotFound
from phalanx.slurm.common import (
    SlurmFatal,
    SlurmParser,
    SlurmUsageError,
    acct_cell,
    client,
    run_command,
)

PROG = "sstat"
DEFAULT_FORMAT = (
    "JobID,MaxVMSize,MaxVMSizeNode,MaxVMSizeTask,AveVMSize,MaxRSS,MaxRSSNode,MaxRSSTask,AveRSS,"
    "MaxPages,MaxPagesNode,MaxPagesTask,AvePages,MinCPU,MinCPUNode,MinCPUTask,AveCPU,NTasks,"
    "AveCPUFreq,ReqCPUFreqMin,ReqCPUFreqMax,ReqCPUFreqGov,ConsumedEnergy,MaxDiskRead,"
    "MaxDiskReadNode,MaxDiskReadTask,AveDiskRead,MaxDiskWrite,MaxDiskWriteNode,"
    "MaxDiskWriteTask,AveDiskWrite,TRESUsageInAve,TRESUsageInMax,TRESUsageInMaxNode,"
    "TRESUsageInMaxTask,TRESUsageInMin,TRESUsageInMinNode,TRESUsageInMinTask,TRESUsageInTot,"
    "TRESUsageOutAve,TRESUsageOutMax,TRESUsageOutMaxNode,TRESUsageOutMaxTask,TRESUsageOutMin,"
    "TRESUsageOutMinNode,TRESUsageOutMinTask,TRESUsageOutTot"
)
PID_FORMAT = "JobID,Nodelist,Pids"


@dataclass(frozen=True)
class Step:
    """One step's tasks as the agents sampled them, and how to show sizes."""

    job_id: int
    step: str  # "0", "1", ..., "batch"
    tasks: list[dict[str, Any]]  # each: node, task, cpu_s, rss, max_rss, vms, ... pids
    convert: bool = True

    def size(self, n: float) -> str:
        return convert_num(n) if self.convert else str(int(n))

    def extreme(self, key: str, pick: Callable[..., Any] = max) -> dict[str, Any]:
        """The task with the largest (smallest) `key`."""
        return pick(self.tasks, key=lambda t: (float(t.get(key) or 0), -int(t["task"])))

    def mean(self, key: str) -> float:
        return sum(float(t.get(key) or 0) for t in self.tasks) / len(self.tasks)

    def total(self, key: str) -> float:
        return sum(float(t.get(key) or 0) for t in self.tasks)


def convert_num(n: float) -> str:
    """Bytes as Slurm's `convert_num_unit` prints them: divided by 1024 while above it, with
    the unit's letter; two decimals unless the value is whole (`0`, `4K`, `1.37M`)."""
    units = ["", "K", "M", "G", "T", "P"]
    i = 0
    while n > 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{int(n)}{units[i]}" if float(n) == int(n) else f"{n:.2f}{units[i]}"


def cpu_time(seconds: float) -> str:
    """A CPU time as sstat prints it (sacct's TotalCPU form)."""
    return efficiency.total_cpu(seconds)


# The TRES figures sstat lists in its TRESUsage* fields (name, the task entry's key), in
# Slurm's order: what a task read ("in") and what it wrote ("out").
_TRES_IN = (
    ("cpu", "cpu_s"),
    ("fs/disk", "read_bytes"),
    ("mem", "max_rss"),
    ("pages", "pages"),
    ("vmem", "max_vms"),
)
_TRES_OUT = (("fs/disk", "write_bytes"),)


def _tres_values(step: Step, how: str, out: bool) -> str:
    """TRESUsageIn/Out Ave, Max, Min, Tot: name=value for each TRES."""
    parts = []
    for name, key in _TRES_OUT if out else _TRES_IN:
        if how == "ave":
            v = step.mean(key)
        elif how == "tot":
            v = step.total(key)
        else:
            v = float(step.extreme(key, max if how == "max" else min).get(key) or 0)
        text = cpu_time(v) if key == "cpu_s" else (str(int(v)) if key == "pages" else step.size(v))
        parts.append(f"{name}={text}")
    return ",".join(parts)


def _tres_where(step: Step, how: str, what: str, out: bool) -> str:
    """TRESUsageIn/Out MaxNode, MaxTask, MinNode, MinTask: where each extreme was seen."""
    parts = []
    for name, key in _TRES_OUT if out else _TRES_IN:
        t = step.extreme(key, max if how == "max" else min)
        parts.append(f"{name}={t['node'] if what == 'node' else t['task']}")
    return ",".join(parts)


@dataclass(frozen=True)
class Field:
    name: str
    width: int  # negative: left-justified
    get: Callable[[Step], Any]


def _max(key: str, show: str = "size") -> Callable[[Step], Any]:
    def get(s: Step) -> Any:
        v = float(s.extreme(key).get(key) or 0)
        return s.size(v) if show == "size" else int(v)

    return get


def _ave(key: str, show: str = "size") -> Callable[[Step], Any]:
    def get(s: Step) -> Any:
        v = s.mean(key)
        return s.size(v) if show == "size" else (cpu_time(v) if show == "cpu" else int(v))

    return get


def _where(key: str, what: str, pick: Callable[..., Any] = max) -> Callable[[Step], Any]:
    return lambda s: s.extreme(key, pick)["node" if what == "node" else "task"]


def _fields() -> dict[str, Field]:
    tres = [
        (f"TRESUsage{io}{how}", width, how.lower(), io == "Out")
        for io, width in (("In", 14), ("Out", 15))
        for how in ("Ave", "Max", "Min", "Tot")
    ]
    where = [
        (f"TRESUsage{io}{how}{what}", width, how.lower(), what.lower(), io == "Out")
        for io, width in (("In", 18), ("Out", 19))
        for how in ("Max", "Min")
        for what in ("Node", "Task")
    ]
    table = [
        Field("JobID", -12, lambda s: f"{s.job_id}.{s.step}"),
        Field("AveCPU", 10, _ave("cpu_s", "cpu")),
        Field("AveCPUFreq", 10, lambda s: 0),  # no CPU frequency gatherer
        Field("AveDiskRead", 12, _ave("read_bytes")),
        Field("AveDiskWrite", 12, _ave("write_bytes")),
        Field("AvePages", 10, _ave("pages", "count")),
        Field("AveRSS", 10, _ave("rss")),
        Field("AveVMSize", 10, _ave("vms")),
        Field("ConsumedEnergy", 14, lambda s: 0),  # no energy gatherer
        Field("ConsumedEnergyRaw", 17, lambda s: 0),
        Field("MaxDiskRead", 12, _max("read_bytes")),
        Field("MaxDiskReadNode", 15, _where("read_bytes", "node")),
        Field("MaxDiskReadTask", 15, _where("read_bytes", "task")),
        Field("MaxDiskWrite", 12, _max("write_bytes")),
        Field("MaxDiskWriteNode", 16, _where("write_bytes", "node")),
        Field("MaxDiskWriteTask", 16, _where("write_bytes", "task")),
        Field("MaxPages", 8, _max("max_pages", "count")),
        Field("MaxPagesNode", 12, _where("max_pages", "node")),
        Field("MaxPagesTask", 14, _where("max_pages", "task")),
        Field("MaxRSS", 10, _max("max_rss")),
        Field("MaxRSSNode", 10, _where("max_rss", "node")),
        Field("MaxRSSTask", 10, _where("max_rss", "task")),
        Field("MaxVMSize", 10, _max("max_vms")),
        Field("MaxVMSizeNode", 14, _where("max_vms", "node")),
        Field("MaxVMSizeTask", 14, _where("max_vms", "task")),
        Field("MinCPU", 10, lambda s: cpu_time(float(s.extreme("cpu_s", min)["cpu_s"] or 0))),
        Field("MinCPUNode", 10, _where("cpu_s", "node", min)),
        Field("MinCPUTask", 10, _where("cpu_s", "task", min)),
        Field("Nodelist", 20, lambda s: compress_hostlist(sorted({t["node"] for t in s.tasks}))),
        Field("NTasks", 8, lambda s: len(s.tasks)),
        Field("Pids", 20, lambda s: ",".join(str(p) for t in s.tasks for p in t.get("pids", []))),
        Field("ReqCPUFreq", 10, lambda s: "Unknown"),  # no --cpu-freq
        Field("ReqCPUFreqMin", 13, lambda s: "Unknown"),
        Field("ReqCPUFreqMax", 13, lambda s: "Unknown"),
        Field("ReqCPUFreqGov", 13, lambda s: "Unknown"),
        *(
            Field(n, w, lambda s, h=h, o=o: _tres_values(s, h, o))  # type: ignore[misc]
            for n, w, h, o in tres
        ),
        *(
            Field(n, w, lambda s, h=h, x=x, o=o: _tres_where(s, h, x, o))  # type: ignore[misc]
            for n, w, h, x, o in where
        ),
    ]
    return {f.name.lower(): f for f in table}


FIELDS = _fields()


def parse_format(text: str) -> list[tuple[Field, int]]:
    """`-o JobID,MaxRSS%12`: fields and widths (`%N` right-justified, `%-N` left, as Slurm)."""
    out = []
    for raw in text.split(","):
        raw = raw.strip()
        if not raw:
            continue
        name, _, width = raw.partition("%")
        f = FIELDS.get(name.lower())
        if f is None:
            raise SlurmUsageError(f'Invalid field requested: "{name}"')
        if width:
            try:
                w = int(width)
            except ValueError:
                raise SlurmUsageError(f'Invalid field requested: "{raw}"') from None
            out.append((f, w))
        else:
            out.append((f, f.width))
    return out


def render(steps: list[Step], fields: list[tuple[Field, int]], *, header: bool, sep: str | None,
           trailing: bool) -> list[str]:  # fmt: skip
    """The lines to print: fixed columns with the dashes line, or `-p`/`-P`."""
    lines = []
    if sep is not None:
        end = sep if trailing else ""
        if header:
            lines.append(sep.join(f.name for f, _ in fields) + end)
        lines += [sep.join(str(f.get(s)) for f, _ in fields) + end for s in steps]
        return lines
    if header:
        lines.append("".join(acct_cell(f.name, w) for f, w in fields))
        lines.append("".join("-" * abs(w) + " " for _, w in fields))
    lines += ["".join(acct_cell(f.get(s), w) for f, w in fields) for s in steps]
    return lines


def parse_refs(text: str) -> list[tuple[str, str | None]]:
    """`-j 12,13.0,14.batch`: (job, step or None) pairs; Slurm's fatal error for a bad one."""
    out: list[tuple[str, str | None]] = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        job, dot, step = piece.partition(".")
        job_ok = job.isdecimal() or ("_" in job and all(x.isdecimal() for x in job.split("_", 1)))
        step_ok = not dot or step.isdecimal() or step == "batch"
        if not job_ok or not step_ok:
            raise SlurmFatal(f"Bad job/step specified: {piece}")
        out.append((job, step if dot else None))
    return out


def steps_of(
    usage: dict[str, Any], step: str | None, all_steps: bool, convert: bool
) -> tuple[list[Step], str | None]:
    """The steps to print for one job reference from its `GET .../usage` answer, and the
    error line Slurm prints instead when there is none (pure)."""
    jid = int(usage["job_id"])
    if usage["state"] != "RUNNING":
        return [], f"No steps running for job {jid}"
    by_step: dict[str, list[dict[str, Any]]] = {}
    for t in usage["tasks"]:
        by_step.setdefault(str(t["step"]), []).append(t)
    live = [str(st["step_id"]) for st in usage["steps"]]
    if step is not None:
        names = [step]
    elif all_steps:
        names = (["batch"] if usage.get("batch_host") else []) + live
    else:
        names = live[:1]
    out = []
    for name in names:
        tasks = sorted(by_step.get(name, []), key=lambda t: int(t["task"]))
        if tasks:
            out.append(Step(jid, name, tasks, convert))
        elif step is not None:
            return [], f"StepId={jid}.{name} not found running."
    return out, None


def build_parser() -> SlurmParser:
    p = SlurmParser(PROG, add_help=True)
    p.add_argument("-a", "--allsteps", action="store_true")
    p.add_argument("-o", "--format", "--fields", dest="format", action="append")
    p.add_argument("-e", "--helpformat", action="store_true")
    p.add_argument("-j", "--jobs", action="append")
    p.add_argument("--noconvert", action="store_true")
    p.add_argument("-n", "--noheader", action="store_true")
    p.add_argument("-p", "--parsable", action="store_true")
    p.add_argument("-P", "--parsable2", action="store_true")
    p.add_argument("-i", "--pidformat", action="store_true")
    p.add_argument("--usage", action="store_true")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def helpformat() -> str:
    names = sorted((f.name for f in FIELDS.values()), key=str.lower)
    rows = [names[i : i + 4] for i in range(0, len(names), 4)]
    return "".join("".join(f"{n:<20}" for n in row).rstrip() + "\n" for row in rows)


def body(argv: list[str]) -> int:
    opts = build_parser().parse_args(argv)
    if opts.helpformat:
        sys.stdout.write(helpformat())
        return 0
    if opts.usage:
        sys.stdout.write(f"Usage: {PROG} [options] -j <job(.stepid)>\n\tUse --help for help\n")
        return 0
    default = PID_FORMAT if opts.pidformat else DEFAULT_FORMAT
    fields = parse_format(",".join(opts.format) if opts.format else default)
    refs = [r for j in opts.jobs or [] for r in parse_refs(j)]
    if not refs:
        raise SlurmUsageError("You didn't give me any jobs to stat.")
    sep = "|" if opts.parsable or opts.parsable2 else None
    steps: list[Step] = []
    errors: list[str] = []
    with client() as cli:
        for job, step in refs:
            params: dict[str, Any] = {
                "batch": "true" if step == "batch" or opts.allsteps else "false"
            }
            if step not in (None, "batch"):
                params["steps"] = step
            try:
                usage = cli.get(f"/v1/jobs/{job}/usage", **params)
            except NotFound:
                errors.append(f"couldn't get steps for job {job}")
                continue
            for node, why in sorted((usage.get("unreachable") or {}).items()):
                errors.append(f"could not reach node {node} for job {job}: {why}")
            got, err = steps_of(usage, step, opts.allsteps, not opts.noconvert)
            steps += got
            if err:
                errors.append(err)
    for line in render(
        steps, fields, header=not opts.noheader, sep=sep, trailing=bool(opts.parsable)
    ):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
    for e in errors:
        sys.stderr.write(f"{PROG}: error: {e}\n")
    return 0


def main(argv: list[str]) -> int:
    return run_command(PROG, body, argv)
