"""The job specification a client submits, and its normalisation into what the scheduler needs.

`JobSpec` is the wire format (the same field names the `#SBATCH` parser produces). `normalize`
checks it against the cluster's partitions and turns it into a `ResolvedJob`: per-node resources,
the partition list, the time limit after partition defaults, parsed arrays, dependencies and signal.
Everything here is pure; refusals raise `InvalidSpec` naming the field.
"""

from __future__ import annotations

import math
import signal as _signal
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from phalanx.domain import policy, text, values
from phalanx.domain.licenses import format_licenses, parse_licenses
from phalanx.errors import InvalidSpec

# Field limits of a job (docs/security.md, "Request limits"). Sizes are characters (of the
# JSON text's strings once decoded); the body limit (http.max_body_bytes) bounds bytes. What a
# job runs goes through execve on its node, whose Linux limits are 128 KiB a string
# (MAX_ARG_STRLEN) and about 2 MiB for argv and the environment together (ARG_MAX): the argv
# and environment limits below keep a job within them, so that what is accepted can start.
MAX_SCRIPT_BYTES = 4 * 1024 * 1024  # the batch script
MAX_NAME = 256  # --job-name
MAX_COMMENT = 4096  # --comment
MAX_PATH = 4096  # output, error, workdir, ... (PATH_MAX)
MAX_TEXT = 4096  # --partition lists, --array, --constraint, --mail-*, ...
MAX_DEPENDENCY = 65_536  # --dependency: thousands of job ids
MAX_EXPORT = 65_536  # --export
MAX_ARG = 128 * 1024  # one argv string, one NAME=value of the environment (MAX_ARG_STRLEN)
MAX_ARGV = 10_000  # argv strings
MAX_ARGV_TOTAL = 1024 * 1024  # characters of all argv strings
MAX_ENV_VARS = 10_000  # environment variables
MAX_ENV_TOTAL = 1024 * 1024  # characters of every NAME=value
MAX_WRAP = MAX_ARG  # --wrap: becomes `sh -c` text
MAX_NODE_NAMES = 100_000  # --nodelist / --exclude entries
MAX_NODE_NAME = 256
MAX_IGNORED = 1000  # options the parser accepted without effect
#: A job with every field at its limit, as JSON (with room for escapes): the smallest body
#: limit (http.max_body_bytes) that still lets any one valid job in.
MAX_JOB_BYTES = 8 * 1024 * 1024

# fields shown to other users (squeue, scontrol show, sacct): no control characters
_TEXT_FIELDS = (
    "name",
    "partition",
    "gpu_type",
    "array",
    "dependency",
    "signal",
    "constraint",
    "submit_host",
    "account",
    "qos",
    "comment",
    "mail_user",
    "mail_type",
    "retry_on",
    "retry_backoff",
    "checkpoint_signal",
)


def check_env(env: dict[str, str]) -> dict[str, str]:
    """An environment a node can pass to execve: names without '=', each NAME=value within
    MAX_ARG, all of them within MAX_ENV_VARS and MAX_ENV_TOTAL (ValueError names the limit)."""
    if len(env) > MAX_ENV_VARS:
        raise ValueError(f"{len(env)} variables; at most {MAX_ENV_VARS} per job")
    total = 0
    for k, v in env.items():
        if not k or "=" in k:
            raise ValueError(
                f"invalid variable name {text.escape(k[:64])!r}: a name is not empty and has no '='"
            )
        size = len(k) + 1 + len(v)
        if size > MAX_ARG:
            raise ValueError(
                f"{text.escape(k[:64])} is {size} characters long (NAME=value); at most "
                f"{MAX_ARG} a variable"
            )
        total += size
    if total > MAX_ENV_TOTAL:
        raise ValueError(f"the environment totals {total} characters; at most {MAX_ENV_TOTAL}")
    return env


def check_argv(argv: list[str]) -> list[str]:
    """argv strings within MAX_ARG each and MAX_ARGV_TOTAL together (ValueError)."""
    total = 0
    for i, a in enumerate(argv):
        if len(a) > MAX_ARG:
            raise ValueError(f"argument {i} is {len(a)} characters long; at most {MAX_ARG}")
        total += len(a)
    if total > MAX_ARGV_TOTAL:
        raise ValueError(f"the arguments total {total} characters; at most {MAX_ARGV_TOTAL}")
    return argv


def check_names(names: list[str]) -> list[str]:
    """Lists of names (--nodelist, --exclude): no control characters."""
    for i, n in enumerate(names):
        text.check_text(n, f"entry {i}")
    return names


class JobSpec(BaseModel):
    """A job as submitted. Field names follow the `#SBATCH` option they come from."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=MAX_NAME)
    partition: str | None = Field(
        default=None, max_length=MAX_TEXT, description="partition, or a comma list to try in order"
    )
    nodes: int = Field(default=1, ge=1, le=100_000)
    nodes_max: int | None = Field(default=None, ge=1, le=100_000)
    ntasks: int | None = Field(default=None, ge=1)
    ntasks_per_node: int | None = Field(default=None, ge=1)
    cpus_per_task: int | None = Field(default=None, ge=1, le=100_000, description="absent: 1")
    cpus_per_gpu: int | None = Field(
        default=None, ge=1, le=100_000, description="CPUs per node = this x GPUs per node"
    )
    mem_mb: int | None = Field(
        default=None, ge=0, description="per node; 0 = all of the node's memory"
    )
    mem_per_cpu_mb: int | None = Field(default=None, ge=1)
    mem_per_gpu_mb: int | None = Field(
        default=None, ge=1, description="memory per node = this x GPUs per node"
    )
    gpus_per_node: int | None = Field(default=None, ge=0)
    gpus_total: int | None = Field(default=None, ge=0)
    gpus_per_task: int | None = Field(default=None, ge=0)
    gpu_type: str | None = Field(default=None, max_length=64)
    time_limit_s: int | None = Field(
        default=None, ge=0, description="seconds; 0 = UNLIMITED; absent = the partition's default"
    )
    output: str | None = Field(default=None, max_length=MAX_PATH)
    error: str | None = Field(default=None, max_length=MAX_PATH)
    open_mode: Literal["truncate", "append"] | None = Field(
        default=None, description="unset: truncate on the first run, append after a requeue (Slurm)"
    )
    array: str | None = Field(default=None, max_length=MAX_TEXT)
    dependency: str | None = Field(default=None, max_length=MAX_DEPENDENCY)
    requeue: bool | None = None
    signal: str | None = Field(default=None, max_length=64)
    exclusive: bool = False
    constraint: str | None = Field(default=None, max_length=MAX_TEXT)
    nodelist: list[Annotated[str, Field(max_length=MAX_NODE_NAME)]] = Field(
        default_factory=list, max_length=MAX_NODE_NAMES
    )
    exclude: list[Annotated[str, Field(max_length=MAX_NODE_NAME)]] = Field(
        default_factory=list, max_length=MAX_NODE_NAMES
    )
    workdir: str | None = Field(default=None, max_length=MAX_PATH)
    submit_dir: str | None = Field(default=None, max_length=MAX_PATH)
    submit_host: str | None = Field(default=None, max_length=256, description="SLURM_SUBMIT_HOST")
    export: str | None = Field(default="ALL", max_length=MAX_EXPORT)
    env: dict[str, str] = Field(
        default_factory=dict,
        description=f"at most {MAX_ENV_VARS} variables, {MAX_ARG} characters a NAME=value, "
        f"{MAX_ENV_TOTAL} in all",
    )
    hold: bool = False
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    script: str | None = Field(default=None, max_length=MAX_SCRIPT_BYTES)
    script_path: str | None = Field(
        default=None,
        max_length=MAX_PATH,
        description="where the script was read from (shown as Command)",
    )
    argv: list[str] = Field(
        default_factory=list,
        max_length=MAX_ARGV,
        description=f"at most {MAX_ARGV} strings of {MAX_ARG} characters, {MAX_ARGV_TOTAL} in all",
    )
    wrap: str | None = Field(default=None, max_length=MAX_WRAP)
    account: str | None = Field(default=None, max_length=64)
    qos: str | None = Field(default=None, max_length=64)
    nice: int = Field(
        default=0,
        ge=-10_000_000,
        le=10_000_000,
        description="subtracted from the multifactor priority; negative: admins only",
    )
    comment: str | None = Field(default=None, max_length=MAX_COMMENT)
    begin_time: float | None = Field(
        default=None,
        ge=0,
        description="sbatch --begin: epoch seconds; the job waits pending (BeginTime) until then",
    )
    mail_user: str | None = Field(default=None, max_length=MAX_TEXT)
    mail_type: str | None = Field(default=None, max_length=MAX_TEXT)
    spares: int | None = Field(default=None, ge=0)
    licenses: str | None = Field(
        default=None, max_length=4096, description="cluster licences, e.g. fluent:2,matlab:1"
    )
    reservation: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}$",
        description="run in this reservation (scontrol create reservation), on its nodes only",
    )
    switches: int | None = Field(default=None, ge=1, le=100_000, description="--switches=N")
    switches_wait_s: int | None = Field(
        default=None, ge=-1, description="--switches=N@TIME: seconds; -1 for ever; absent 300"
    )
    spread: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    group: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    anti_affinity: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    all_nodes: bool = Field(
        default=False,
        description="run the batch script on every node (rank in SLURM_NODEID); default: once, "
        "on the first node of the allocation, as Slurm's batch step",
    )
    no_kill: bool = Field(
        default=False,
        description="--no-kill: the loss of a node does not stop the job; it goes on in its "
        "allocation, a hot spare in the lost node's place (docs/elastic.md)",
    )
    progress_timeout_s: int | None = Field(default=None, ge=1)
    retries: int | None = Field(
        default=None, ge=0, le=10_000, description="failure retries; absent = the cluster's"
    )
    retry_on: str | None = Field(
        default=None, max_length=1024, description="failure kinds/exit codes that retry"
    )
    retry_backoff: str | None = Field(
        default=None, max_length=64, description="BASE[:MAX] seconds before a retry"
    )
    checkpoint_dir: str | None = Field(default=None, max_length=MAX_PATH)
    checkpoint_signal: str | None = Field(
        default=None, max_length=16, description="USR1 (default), SIGUSR2, 12, ..."
    )
    checkpoint_grace_s: int | None = Field(
        default=None, ge=0, le=7 * 86400, description="absent: the cluster's checkpoint_grace"
    )
    checkpoint_interval_s: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default=None, description='seconds between periodic checkpoint requests, or "auto"'
    )
    ignored: list[Annotated[str, Field(max_length=MAX_TEXT)]] = Field(
        default_factory=list, max_length=MAX_IGNORED
    )

    @field_validator(*_TEXT_FIELDS)
    @classmethod
    def _no_control(cls, v: str | None) -> str | None:
        """Text other users see may not hold terminal escapes (domain/text.py)."""
        return v if v is None else text.check_text(v)

    @field_validator("nodelist", "exclude", "ignored")
    @classmethod
    def _no_control_names(cls, v: list[str]) -> list[str]:
        return check_names(v)

    @field_validator("env")
    @classmethod
    def _env_limits(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("argv")
    @classmethod
    def _argv_limits(cls, v: list[str]) -> list[str]:
        return check_argv(v)

    @field_validator("licenses")
    @classmethod
    def _canonical_licenses(cls, v: str | None) -> str | None:
        """Stored and shown as fluent:2,matlab:1 however it was written (ValueError: 422)."""
        if v is None or not v.strip():
            return None
        return format_licenses(parse_licenses(v))


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    default: bool
    default_time_s: int | None
    max_time_s: int | None


@dataclass
class ResolvedJob:
    """What the store records for one job (one array task) besides the spec itself."""

    name: str
    partitions: list[str]
    nodes: int
    cpus_per_node: int
    mem_per_node_mb: int
    gpus_per_node: int
    gpu_type: str | None
    time_limit_s: int | None
    exclusive: bool
    constraint: str | None
    nodelist: list[str]
    exclude: list[str]
    requeue: bool
    priority: int
    hold: bool
    dependency: list[dict[str, Any]]
    array_indices: list[int] | None
    array_limit: int | None
    signal: dict[str, Any] | None
    workdir: str
    launch: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None
    """The checkpoint spec when the job gave any --checkpoint-* option: signum, grace_s (None:
    the cluster's checkpoint_grace), interval_s (seconds, "auto" or None), dir, batch_only."""
    nodes_max: int | None = None  # elastic (--nodes=MIN-MAX): `nodes` is MIN
    spares: int = 0  # hot spare nodes held with the allocation (--spares)
    licenses: str | None = None  # canonical --licenses text (domain/licenses.py), None: none
    # topology (domain/topology.py): --switches, --spread, --group, --anti-affinity
    switches: int | None = None
    spread: str | None = None
    group: str | None = None
    anti_affinity: str | None = None


def _field_error(fieldname: str, message: str) -> InvalidSpec:
    return InvalidSpec(f"{fieldname}: {message}", field=fieldname)


def normalize(
    spec: JobSpec,
    partitions: dict[str, PartitionInfo],
    *,
    default_mem_per_cpu_mb: int,
    default_requeue: bool,
) -> ResolvedJob:
    """Validate a spec against the cluster's partitions and resolve per-node resources."""
    if not partitions:
        raise InvalidSpec("the cluster has no partitions configured")
    if spec.partition:
        names = [p.strip() for p in spec.partition.split(",") if p.strip()]
        for n in names:
            if n not in partitions:
                known = ", ".join(sorted(partitions))
                raise _field_error("partition", f"unknown partition '{n}' (partitions: {known})")
    else:
        default = [p.name for p in partitions.values() if p.default] or sorted(partitions)[:1]
        names = default[:1]
    if not names:
        raise _field_error("partition", "empty partition list")

    if spec.script is None and not spec.argv and not spec.wrap:
        raise _field_error("script", "nothing to run: give a script, a command (argv) or --wrap")
    if spec.script is not None and not spec.script.startswith("#!"):
        raise _field_error(
            "script",
            "the batch script must start with an interpreter line such as '#!/bin/bash'",
        )
    nodes_max, spares = _elastic(spec)
    licenses = _licenses(spec)
    if spec.anti_affinity is not None and spec.group is None:
        raise _field_error(
            "anti_affinity",
            f"--anti-affinity={spec.anti_affinity} keeps jobs of one group apart: "
            "give the job's group with --group=NAME",
        )

    nodes = spec.nodes
    if spec.ntasks is not None and spec.ntasks_per_node is not None:
        if spec.ntasks > nodes * spec.ntasks_per_node:
            nodes = math.ceil(spec.ntasks / spec.ntasks_per_node)
        tasks_per_node = spec.ntasks_per_node
    elif spec.ntasks_per_node is not None:
        tasks_per_node = spec.ntasks_per_node
    elif spec.ntasks is not None:
        if spec.ntasks < nodes:
            raise _field_error("ntasks", f"--ntasks={spec.ntasks} is fewer than --nodes={nodes}")
        tasks_per_node = math.ceil(spec.ntasks / nodes)
    else:
        tasks_per_node = 1
    gpus = _gpus_per_node(spec, nodes, tasks_per_node)
    cpus_per_node = _cpus_per_node(spec, tasks_per_node, gpus)
    mem = _mem_per_node(spec, cpus_per_node, gpus, default_mem_per_cpu_mb)
    gpu_type = spec.gpu_type if gpus else None

    limit_parts = [partitions[n] for n in names]
    time_limit = spec.time_limit_s
    if time_limit is None:
        time_limit = limit_parts[0].default_time_s
    elif time_limit == 0:
        time_limit = None  # --time=UNLIMITED
    for p in limit_parts:
        if p.max_time_s is not None and (time_limit is None or time_limit > p.max_time_s):
            shown = values.format_duration(time_limit)
            raise _field_error(
                "time_limit_s",
                f"time limit {shown} exceeds the maximum of partition {p.name} "
                f"({values.format_duration(p.max_time_s)})",
            )

    array_indices: list[int] | None = None
    array_limit: int | None = None
    if spec.array:
        try:
            array_indices, array_limit = values.parse_array(spec.array)
        except ValueError as e:
            raise _field_error("array", str(e)) from None
    dependency: list[dict[str, Any]] = []
    if spec.dependency:
        try:
            dependency = values.parse_dependency(spec.dependency)
        except ValueError as e:
            raise _field_error("dependency", str(e)) from None
    signal = None
    if spec.signal:
        try:
            signal = values.parse_signal(spec.signal)
        except ValueError as e:
            raise _field_error("signal", str(e)) from None
        if time_limit is not None and signal["before_s"] >= time_limit:
            raise _field_error(
                "signal",
                f"--signal asks for the signal {signal['before_s']} s before the limit, "
                f"but the time limit is only {time_limit} s",
            )
    _check_retry(spec)
    if spec.constraint:
        try:
            values.parse_constraint(spec.constraint)
        except ValueError as e:
            raise _field_error("constraint", str(e)) from None
    if spec.export is not None:
        try:
            values.parse_export(spec.export)
        except ValueError as e:
            raise _field_error("export", str(e)) from None
    overlap = set(spec.nodelist) & set(spec.exclude)
    if overlap:
        raise _field_error(
            "nodelist", f"nodes both required and excluded: {', '.join(sorted(overlap))}"
        )
    if spec.nodelist and len(set(spec.nodelist)) > (nodes_max or nodes):
        raise _field_error(
            "nodelist",
            f"--nodelist names {len(set(spec.nodelist))} nodes but the job asks for "
            f"{nodes_max or nodes}",
        )

    checkpoint = _checkpoint_spec(spec, signal, time_limit)
    submit_dir = spec.submit_dir or "/"
    workdir = spec.workdir or submit_dir
    name = spec.name or _default_name(spec)
    return ResolvedJob(
        name=name,
        partitions=names,
        nodes=nodes,
        cpus_per_node=cpus_per_node,
        mem_per_node_mb=mem,
        gpus_per_node=gpus,
        gpu_type=gpu_type,
        time_limit_s=time_limit,
        exclusive=spec.exclusive,
        constraint=spec.constraint,
        nodelist=sorted(set(spec.nodelist)),
        exclude=sorted(set(spec.exclude)),
        requeue=default_requeue if spec.requeue is None else spec.requeue,
        priority=spec.priority,
        hold=spec.hold,
        dependency=dependency,
        array_indices=array_indices,
        array_limit=array_limit,
        signal=signal,
        workdir=workdir,
        checkpoint=checkpoint,
        nodes_max=nodes_max,
        spares=spares,
        licenses=licenses,
        switches=spec.switches,
        spread=spec.spread,
        group=spec.group,
        anti_affinity=spec.anti_affinity,
    )


def _gpus_per_node(spec: JobSpec, nodes: int, tasks_per_node: int) -> int:
    """GPUs each node gives the job, from whichever one of the three GPU options was given."""
    given = [
        n
        for n, v in (
            ("gpus_per_node", spec.gpus_per_node),
            ("gpus_total", spec.gpus_total),
            ("gpus_per_task", spec.gpus_per_task),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise _field_error(
            given[1],
            f"give only one of --gres/--gpus-per-node, --gpus, --gpus-per-task (got {', '.join(given)})",
        )
    if spec.gpus_total is not None:
        if spec.gpus_total % nodes:
            raise _field_error(
                "gpus_total", f"--gpus={spec.gpus_total} does not divide evenly over {nodes} nodes"
            )
        return spec.gpus_total // nodes
    if spec.gpus_per_task is not None:
        return spec.gpus_per_task * tasks_per_node
    return spec.gpus_per_node or 0


_NEEDS_GPUS = "add GPUs with --gres=gpu:N, --gpus-per-node=N, --gpus=N or --gpus-per-task=N"


def _cpus_per_node(spec: JobSpec, tasks_per_node: int, gpus: int) -> int:
    """CPUs per node: tasks x --cpus-per-task, or --cpus-per-gpu x GPUs (as sbatch, the two
    are mutually exclusive)."""
    if spec.cpus_per_gpu is None:
        return tasks_per_node * (spec.cpus_per_task or 1)
    if spec.cpus_per_task is not None:
        raise _field_error(
            "cpus_per_gpu", "--cpus-per-task and --cpus-per-gpu are mutually exclusive"
        )
    if not gpus:
        raise _field_error("cpus_per_gpu", f"--cpus-per-gpu needs GPUs: {_NEEDS_GPUS}")
    return spec.cpus_per_gpu * gpus


def _mem_per_node(spec: JobSpec, cpus_per_node: int, gpus: int, default_mem_per_cpu_mb: int) -> int:
    """Memory per node from --mem, --mem-per-cpu or --mem-per-gpu (mutually exclusive, as in
    sbatch), else the cluster's default per CPU."""
    given = [
        flag
        for flag, v in (
            ("--mem", spec.mem_mb),
            ("--mem-per-cpu", spec.mem_per_cpu_mb),
            ("--mem-per-gpu", spec.mem_per_gpu_mb),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise _field_error("mem_mb", f"{', '.join(given)} are mutually exclusive; give one")
    if spec.mem_mb is not None:
        return spec.mem_mb
    if spec.mem_per_gpu_mb is not None:
        if not gpus:
            raise _field_error("mem_per_gpu_mb", f"--mem-per-gpu needs GPUs: {_NEEDS_GPUS}")
        return spec.mem_per_gpu_mb * gpus
    return cpus_per_node * (spec.mem_per_cpu_mb or default_mem_per_cpu_mb)


def _elastic(spec: JobSpec) -> tuple[int | None, int]:
    """Checked elastic range and spare count: (MAX or None for a fixed size, spares)."""
    nodes_max = spec.nodes_max
    if nodes_max is not None and nodes_max < spec.nodes:
        raise _field_error(
            "nodes",
            f"--nodes={spec.nodes}-{nodes_max}: the maximum is below the minimum; "
            "write MIN-MAX, e.g. --nodes=4-8",
        )
    if nodes_max == spec.nodes:
        nodes_max = None  # 4-4 is simply 4
    if nodes_max is not None:
        if spec.gpus_total is not None:
            raise _field_error(
                "gpus_total",
                "--gpus (a total over all nodes) cannot be split over an elastic node range; "
                "give GPUs per node (--gpus-per-node or --gres=gpu:N)",
            )
        if spec.ntasks is not None and spec.ntasks_per_node is None:
            raise _field_error(
                "ntasks",
                "--ntasks cannot be spread over an elastic node range; "
                "give --ntasks-per-node instead",
            )
    spares = spec.spares or 0
    if spares > 100_000:
        raise _field_error("spares", f"--spares={spares} is more than any cluster has")
    return nodes_max, spares


def _licenses(spec: JobSpec) -> str | None:
    """The --licenses request in canonical form; whether the cluster has them is checked at
    submit against its configured counts (the controller knows them, not the spec)."""
    if spec.licenses is None or not spec.licenses.strip():
        return None
    try:
        return format_licenses(parse_licenses(spec.licenses))
    except ValueError as e:
        raise _field_error("licenses", str(e)) from None


def _check_retry(spec: JobSpec) -> None:
    """Refuse retry options that cannot be parsed, or that contradict an explicit
    --no-requeue (which in Slurm means: never requeue, whatever happens)."""
    if spec.retry_on is not None:
        try:
            policy.parse_retry_on(spec.retry_on)
        except ValueError as e:
            raise _field_error("retry_on", str(e)) from None
    if spec.retry_backoff is not None:
        try:
            policy.parse_backoff(spec.retry_backoff)
        except ValueError as e:
            raise _field_error("retry_backoff", str(e)) from None
    if spec.requeue is False and (spec.retries or spec.retry_on not in (None, "none")):
        given = f"--retries={spec.retries}" if spec.retries else f"--retry-on={spec.retry_on}"
        raise _field_error(
            "retries",
            f"--no-requeue means the job never runs again, but {given} asks for retries; "
            "drop one of them",
        )


def has_checkpoint_spec(spec: JobSpec) -> bool:
    """Whether the job takes part in the checkpoint protocol (any --checkpoint-* option)."""
    return any(
        v is not None
        for v in (
            spec.checkpoint_dir,
            spec.checkpoint_signal,
            spec.checkpoint_grace_s,
            spec.checkpoint_interval_s,
        )
    )


def _checkpoint_spec(
    spec: JobSpec, signal: dict[str, Any] | None, time_limit: int | None
) -> dict[str, Any] | None:
    """Resolve the checkpoint options; None for a job that gave none of them.

    The signal defaults to --signal's (a Slurm script that traps it keeps working), then USR1;
    the grace to --signal's lead time, then the cluster's `checkpoint_grace` (None here).
    """
    if not has_checkpoint_spec(spec):
        return None
    if spec.checkpoint_signal is not None:
        try:
            signum = values.parse_signal_name(spec.checkpoint_signal)
        except ValueError as e:
            raise _field_error("checkpoint_signal", str(e)) from None
    elif signal is not None:
        signum = int(signal["signum"])
    else:
        signum = int(_signal.SIGUSR1)
    grace = spec.checkpoint_grace_s
    if grace is not None and time_limit is not None and grace >= time_limit:
        raise _field_error(
            "checkpoint_grace_s",
            f"--checkpoint-grace of {grace} s leaves no time to run within the time limit of "
            f"{time_limit} s; shorten the grace or raise --time",
        )
    if grace is None and signal is not None:
        grace = int(signal["before_s"])
    if spec.checkpoint_dir is not None and not spec.checkpoint_dir.strip():
        raise _field_error("checkpoint_dir", "empty directory: give a path or leave it out")
    return {
        "signum": signum,
        "grace_s": grace,
        "interval_s": spec.checkpoint_interval_s,
        "dir": spec.checkpoint_dir,
        "batch_only": bool(signal and signal.get("batch_only")),
    }


def _default_name(spec: JobSpec) -> str:
    """Slurm's default name: the batch script's file name (``train.sh``), ``sbatch`` for a
    script that came without one (stdin), ``wrap`` for --wrap; a bare command its program."""
    if spec.wrap:
        return "wrap"
    if spec.script is not None:
        if spec.script_path:
            return spec.script_path.rstrip("/").rsplit("/", 1)[-1] or "sbatch"
        return "sbatch"
    if spec.argv:
        return spec.argv[0].rsplit("/", 1)[-1] or "job"
    return "sbatch"
