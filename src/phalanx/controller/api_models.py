"""The REST API's request and reply bodies (pydantic): what each route accepts, with the
bounds that keep a hostile body from costing the controller more than it is worth."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from phalanx.domain import spec as specs
from phalanx.domain.spec import JobSpec
from phalanx.domain.text import PlainText

MAX_BATCH = 10_000
MAX_ID = 2**63 - 1  # ids and counters go into 64-bit INTEGER columns
MAX_EVENTS = 10_000  # events in one reply of /v1/events (page on with since=)
HEARTBEAT_PATH = "/v1/agents/{node}/heartbeat"


class BatchIn(BaseModel):
    jobs: list[JobSpec] = Field(min_length=1, max_length=MAX_BATCH)


class SubmitOut(BaseModel):
    """The reply to POST /v1/jobs (documents it; the route builds the JSON itself)."""

    job_id: int | None = Field(
        description="the job's id (an array: its first task's); null with test_only"
    )
    job_ids: list[int] = Field(description="every id the submission created (array tasks)")
    array: bool
    test_only: bool = Field(default=False, description="validated only, nothing stored")


class RefsIn(BaseModel):
    jobs: list[Annotated[str, Field(max_length=64)]] = Field(min_length=1, max_length=MAX_BATCH)
    reason: PlainText | None = Field(default=None, max_length=1024)


class SignalIn(BaseModel):
    jobs: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    signal: int = Field(ge=1, le=64, description="signal number")
    target: str = Field(
        default="steps",
        pattern="^(steps|batch|full)$",
        description="steps: the job's steps (scancel --signal); batch: the batch shell only "
        "(--batch); full: the batch shell, its children and all steps (--full)",
    )


class RequeueIn(BaseModel):
    jobs: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    hold: bool = Field(default=False, description="the requeued jobs wait HELD (requeuehold)")


class UpdateIn(BaseModel):
    """Changes to pending jobs (scontrol update JobId=...); fields left out stay as they are."""

    model_config = {"extra": "forbid"}

    jobs: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    time_limit: str | None = Field(default=None, max_length=64, description="Slurm time form")
    nodes: int | None = Field(default=None, ge=1, le=1_000_000)
    partition: PlainText | None = Field(default=None, min_length=1, max_length=64)
    dependency: PlainText | None = Field(
        default=None, max_length=specs.MAX_DEPENDENCY, description="'' clears it"
    )
    priority: int | None = Field(
        default=None,
        ge=-1_000_000,
        le=1_000_000,
        description="--priority, the queue's first sort key: above 0 for operators and admins",
    )
    nice: int | None = Field(
        default=None,
        ge=-10_000_000,
        le=10_000_000,
        description="--nice: below 0 for operators and admins",
    )
    exclude: PlainText | None = Field(
        default=None, max_length=65536, description="ExcNodeList: a host list; '' clears it"
    )
    array_throttle: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="ArrayTaskThrottle: an array's tasks running at most, 0 for no limit",
    )
    # labels, which pending and running jobs take alike (scripts tag running jobs)
    name: PlainText | None = Field(default=None, min_length=1, max_length=256)
    comment: PlainText | None = Field(default=None, max_length=specs.MAX_COMMENT)


class TokenIn(BaseModel):
    user: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")
    role: str = Field(default="user", pattern="^(admin|operator|user)$")
    lifetime_s: float = Field(default=30 * 86400.0, gt=0)


class DrainIn(BaseModel):
    reason: PlainText = Field(min_length=1, max_length=1024)
    now: bool = Field(
        default=False, description="also checkpoint-signal and requeue the node's requeue-able jobs"
    )


class RegisterIn(BaseModel):
    cpus: int = Field(ge=1, le=1_000_000)
    mem_mb: int = Field(ge=1, le=2**40)
    gpus: list[tuple[int, str]] = Field(default_factory=list)
    features: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list, max_length=1024
    )
    addr: str | None = Field(default=None, max_length=256)
    boot_id: str | None = Field(default=None, max_length=256)
    version: str | None = Field(default=None, max_length=256)
    health: dict[str, Any] | None = None  # the preflight's result
    # host:port of the agent's step listener (any controller may ask it for sstat's usage)
    steps_at: str | None = Field(default=None, max_length=300)
    # place in the topology tree, {level: domain} (phalanx agent --topology); absent: none
    topology: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")],
        Annotated[str, Field(min_length=1, max_length=128)],
    ] = Field(default_factory=dict, max_length=16)


class ReportIn(BaseModel):
    attempt_id: int = Field(ge=0, le=MAX_ID)
    token: str = Field(max_length=256)
    state: str = Field(pattern="^(starting|running|exited|lost)$")
    started_at: float | None = None
    exit: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None  # the job's checkpoint marker (docs/checkpoints.md)
    progress: dict[str, Any] | None = None  # the job's progress file
    signals_done: int | None = Field(default=None, ge=0, le=MAX_ID)  # highest seq delivered
    members_gen: int | None = Field(default=None, ge=0, le=MAX_ID)  # membership file written


class StepIn(BaseModel):
    """`srun` inside a job: what to run, how to lay it out, where its srun listens."""

    model_config = ConfigDict(extra="forbid")

    argv: Annotated[list[str], AfterValidator(specs.check_argv)] = Field(
        min_length=1, max_length=4096
    )
    env: Annotated[dict[str, str], AfterValidator(specs.check_env)] = Field(default_factory=dict)
    cwd: str = Field(default="/", max_length=4096)
    name: PlainText | None = Field(default=None, max_length=256)
    nodes: int | None = Field(default=None, ge=1, le=100_000)
    ntasks: int | None = Field(default=None, ge=1, le=1_000_000)
    ntasks_per_node: int | None = Field(default=None, ge=1, le=100_000)
    cpus_per_task: int = Field(default=1, ge=1, le=100_000)
    gpus_per_task: int | None = Field(default=None, ge=0, le=1024)
    gpus_per_node: int | None = Field(default=None, ge=0, le=1024)
    nodelist: list[str] = Field(default_factory=list, max_length=100_000)
    output: str | None = Field(default=None, max_length=4096)
    error: str | None = Field(default=None, max_length=4096)
    label: bool = False
    open_mode: Literal["append", "truncate"] | None = Field(
        default=None, description="how -o/-e files open; the job's --open-mode if absent"
    )
    host: str = Field(max_length=256, description="where srun listens for its tasks' streams")
    port: int = Field(ge=1, le=65535)
    cookie: str = Field(min_length=16, max_length=128)
    pty: bool = Field(
        default=False, description="srun --pty: task 0 on a pseudo-terminal relayed to srun"
    )
    stdin: bool = Field(
        default=False,
        description="srun forwards stdin (its own, and sattach's) on each task's stdout "
        "connection, which the task reads as its stdin; without it a task's stdin is "
        "/dev/null (srun's own stdin is /dev/null, or its output goes to files)",
    )
    direct: bool = Field(
        default=False,
        description="srun hands each node its launch itself (the reply's `launch`: a signed "
        "credential and the agent's address per node) when the cluster allows it "
        "(steps.direct); nodes not in `launch` are woken here",
    )
    pmi_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="srun --mpi=pmi2: the port of srun's PMI-1 server on `host`; each task "
        "gets PMI_PORT, PMI_SIZE, PMI_RANK and PMI_ID (docs/slurm.md)",
    )
    pmi_id_base: int | None = Field(
        default=None,
        ge=1,
        le=2**30,
        description="with pmi_port: a task's PMI_ID is this plus its rank (the server knows "
        "its step's tasks by it)",
    )

    @model_validator(mode="after")
    def _pmi_pair(self) -> StepIn:
        if (self.pmi_port is None) != (self.pmi_id_base is None):
            raise ValueError("pmi_port and pmi_id_base go together (srun --mpi=pmi2)")
        return self


class StepWakeIn(BaseModel):
    nodes: list[str] = Field(min_length=1, max_length=100_000)


class StepSignalIn(BaseModel):
    step_id: int | None = Field(default=None, ge=0, le=2**31, description="all steps if absent")
    signal: int = Field(ge=1, le=64)


class StepCancelIn(BaseModel):
    step_id: int | None = Field(default=None, ge=0, le=2**31, description="all steps if absent")
    reason: PlainText | None = Field(default=None, max_length=1024)


class StepReportIn(BaseModel):
    attempt_id: int = Field(ge=0, le=2**62)
    step_id: int = Field(ge=0, le=2**31)
    token: str = Field(max_length=64)
    state: Literal["starting", "running", "exited", "lost"]
    started_at: float | None = None
    exits: list[dict[str, Any]] = Field(default_factory=list, max_length=4096)


class HeartbeatIn(BaseModel):
    tasks: list[ReportIn] = Field(default_factory=list, max_length=100_000)
    steps: list[StepReportIn] = Field(default_factory=list, max_length=100_000)
    taken_at: float | None = None
    wait: float = Field(default=0.0, ge=0, le=60)
    health: dict[str, Any] | None = None
    steps_at: str | None = Field(
        default=None, max_length=300, description="host:port the agent takes step launches at"
    )
    node_config_version: int | None = Field(
        default=None,
        ge=0,
        description="the cluster configuration version whose node settings the agent runs",
    )
