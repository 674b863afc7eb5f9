"""Configuration: defaults < TOML file < environment < command-line flags.

Every timing parameter has a default, a documented meaning (docs/configuration.md) and a check
here. Rules that tie parameters together are checked when the configuration loads; a config
that breaks one is refused with a ConfigError naming the rule.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from phalanx.domain.policy import FailurePolicy, parse_retry_on
from phalanx.domain.spec import MAX_JOB_BYTES
from phalanx.errors import ConfigError


class Timing(BaseModel):
    """Timeouts shared by controllers and agents (both must load the same values)."""

    model_config = ConfigDict(extra="forbid")

    heartbeat_interval: float = Field(
        1.0,
        gt=0,
        le=300,
        description="agent: seconds between heartbeats; also the longest long-poll",
    )
    node_down_timeout: float = Field(
        10.0, gt=0, le=3600, description="controller: a node without heartbeat this long is DOWN"
    )
    fence_timeout: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="shepherd: stop the job after this long without a controller reply",
    )
    fence_kill_grace: float = Field(
        2.0, ge=0, le=600, description="shepherd: SIGTERM→SIGKILL grace when self-fencing"
    )
    fence_margin: float = Field(
        1.0,
        ge=0,
        le=600,
        description="safety margin between self-fencing and the node being declared DOWN",
    )
    kill_wait: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="SIGTERM→SIGKILL grace on cancel and time limit (Slurm KillWait)",
    )
    lease_ttl: float = Field(
        3.0, gt=0, le=3600, description="a duty lease expires this long after its last renewal"
    )
    renew_interval: float = Field(0.75, gt=0, le=600, description="how often a lease holder renews")
    db_op_timeout: float = Field(
        2.0,
        ge=0.1,
        le=600,
        description="PostgreSQL: longest wait for the database to answer one statement, commit "
        "or connection check; then the connection is closed and the call fails (store "
        "unavailable)",
    )
    scheduler_interval: float = Field(
        1.0,
        gt=0,
        le=600,
        description="a scheduling pass runs at least this often, and at once on new work",
    )
    scheduler_min_gap: float = Field(
        0.05,
        ge=0,
        le=10,
        description="shortest time between two scheduling passes (batches bursts)",
    )
    heartbeat_budget: float = Field(
        300.0,
        gt=0,
        le=1_000_000,
        description="heartbeats per second the control plane is sized for: a cluster of N "
        "nodes heartbeats every max(heartbeat_interval, N / heartbeat_budget) seconds, and "
        "fence_timeout and node_down_timeout grow by the same factor (Timing.for_cluster, "
        "docs/sim.md)",
    )
    heartbeat_flush_interval: float = Field(
        0.5,
        gt=0,
        le=60,
        description="controller: heartbeats are written to the store in one batch this often",
    )
    checkpoint_grace: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="planned stops: time between the checkpoint signal and SIGTERM "
        "(a job's --signal=SIG@N asks for N instead)",
    )
    maint_lead: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="maintenance windows: jobs on the window's nodes get their checkpoint "
        "signal this long before it starts (longer if the job asks for a longer grace)",
    )
    launch_backoff_base: float = Field(
        2.0, gt=0, le=3600, description="wait before retrying a failed launch; doubles each time"
    )
    launch_backoff_max: float = Field(
        60.0, gt=0, le=86400, description="longest wait between launch retries"
    )
    launch_timeout: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="a STARTING attempt that no agent confirms in this long is requeued",
    )
    restart_reservation: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="an elastic or spare job that lost a node keeps its surviving nodes "
        "reserved this long for its restart; no other job may take them meanwhile",
    )
    node_mtbf_prior_s: float = Field(
        30 * 86400.0,
        gt=0,
        le=10 * 365 * 86400.0,
        description="--checkpoint-interval=auto: assumed mean time between failures of one "
        "node until the cluster's own failure history says otherwise",
    )
    node_mtbf_prior_weight_s: float = Field(
        30 * 86400.0,
        gt=0,
        le=10 * 365 * 86400.0,
        description="how much observed node time the prior is worth (node-seconds): history "
        "outweighs the prior once the cluster has been watched for longer than this",
    )
    default_checkpoint_cost_s: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="--checkpoint-interval=auto: assumed duration of one checkpoint until the "
        "job has reported one",
    )
    checkpoint_interval_min_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="--checkpoint-interval=auto never asks for checkpoints more often than this",
    )

    def cluster_interval(self, nodes: int) -> float:
        """The heartbeat interval for a cluster of `nodes` nodes: the configured one, or longer
        where that many nodes would send more than `heartbeat_budget` heartbeats a second
        (Nomad's habit: the servers' heartbeat rate is capped, the interval grows instead)."""
        return max(self.heartbeat_interval, max(0, nodes) / self.heartbeat_budget)

    def for_cluster(self, nodes: int) -> Timing:
        """These timings for a cluster of `nodes` nodes (docs/sim.md, "The heartbeat rule").

        The heartbeat interval is `cluster_interval(nodes)`; fence_timeout and
        node_down_timeout (so the failure-detection time) grow by the same factor, which keeps
        every timing rule true: each rule is linear in those three with slack that only grows.
        Unchanged (the same object's values) while the budget is not exceeded."""
        factor = self.cluster_interval(nodes) / self.heartbeat_interval
        if factor <= 1.0:
            return self.model_copy()
        return Timing.model_validate(
            {
                **self.model_dump(),
                "heartbeat_interval": self.heartbeat_interval * factor,
                "fence_timeout": self.fence_timeout * factor,
                "node_down_timeout": self.node_down_timeout * factor,
            }
        )

    @model_validator(mode="after")
    def _rules(self) -> Timing:
        rules = [
            (
                self.renew_interval * 3 <= self.lease_ttl,
                "renew_interval * 3 <= lease_ttl",
            ),
            (
                # a renewal stuck on a dead connection is cut with time left for one more try
                # before the lease lapses. Liveness only: a duty write that hangs past the TTL
                # holds its lease row locked (fence check), so it commits before any takeover
                # or not at all
                self.renew_interval + self.db_op_timeout < self.lease_ttl,
                "renew_interval + db_op_timeout < lease_ttl",
            ),
            (
                self.fence_timeout + self.fence_kill_grace + self.fence_margin
                < self.node_down_timeout,
                "fence_timeout + fence_kill_grace + fence_margin < node_down_timeout",
            ),
            (
                # a reply may freshen the fence up to one long-poll plus its grace after the
                # controller last heard from the node (agent.fence_mark): the node's jobs must
                # still be dead before the node is declared DOWN
                self.fence_timeout
                + self.fence_kill_grace
                + self.heartbeat_interval
                + max(0.5, self.heartbeat_interval)
                < self.node_down_timeout,
                "fence_timeout + fence_kill_grace + heartbeat_interval + "
                "max(0.5, heartbeat_interval) < node_down_timeout",
            ),
            (
                # a heartbeat stuck on a frozen controller times out after one interval plus
                # its grace, and the next one (to another controller) takes one more interval
                self.heartbeat_interval * 2 + max(0.5, self.heartbeat_interval)
                < self.fence_timeout,
                "heartbeat_interval * 2 + max(0.5, heartbeat_interval) < fence_timeout",
            ),
            (
                self.launch_backoff_base <= self.launch_backoff_max,
                "launch_backoff_base <= launch_backoff_max",
            ),
            (
                self.scheduler_min_gap <= self.scheduler_interval,
                "scheduler_min_gap <= scheduler_interval",
            ),
            (
                # the restart gets at least two scheduling passes on its reserved nodes
                self.restart_reservation >= 2 * self.scheduler_interval,
                "restart_reservation >= 2 * scheduler_interval",
            ),
            (
                self.heartbeat_flush_interval < self.node_down_timeout / 2,
                "heartbeat_flush_interval < node_down_timeout / 2",
            ),
            (
                # a checkpoint that outlasts a node's expected life is a unit mistake
                self.default_checkpoint_cost_s < self.node_mtbf_prior_s,
                "default_checkpoint_cost_s < node_mtbf_prior_s",
            ),
            (
                self.checkpoint_interval_min_s < self.node_mtbf_prior_s,
                "checkpoint_interval_min_s < node_mtbf_prior_s",
            ),
        ]
        broken = [text for ok, text in rules if not ok]
        if broken:
            values = self.model_dump()
            raise ValueError(
                "timing rule broken: "
                + "; ".join(broken)
                + " (values: "
                + ", ".join(f"{k}={values[k]}" for k in sorted(values))
                + ")"
            )
        return self


class PartitionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    default: bool = False
    nodes: str = Field("*", description="node names: a glob (fnmatch) or a comma list of globs")
    default_time: str = "1:00:00"
    max_time: str = "UNLIMITED"
    priority: int = 0
    priority_tier: int = Field(
        0,
        ge=0,
        le=65533,
        description="Slurm's PriorityTier: a pending job may preempt running jobs of a lower "
        "tier (docs/preemption.md)",
    )
    preempt_mode: Literal["requeue", "cancel", "off"] = Field(
        "requeue",
        description="Slurm's PreemptMode for jobs of this partition when a higher tier "
        "preempts them: requeue (checkpoint, back to the queue), cancel, or off (never)",
    )


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "phalanx"
    default_requeue: bool = True
    default_mem_per_cpu_mb: int = Field(512, ge=1)
    max_launch_failures: int = Field(
        3, ge=1, le=100, description="failed launches before a job is held"
    )
    node_launch_failures_to_drain: int = Field(
        3, ge=1, le=100, description="failed launches in a row that drain a node"
    )
    partitions: list[PartitionConfig] = Field(
        default_factory=lambda: [PartitionConfig(name="batch", default=True, nodes="*")]
    )
    queue_depth: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="pending jobs, in queue order, one scheduling pass examines for a start "
        "or a backfill reservation (Slurm's default_queue_depth); the ones behind wait with "
        "reason Priority until they come within it (docs/scheduling.md)",
    )
    licenses: str | dict[str, int] = Field(
        default="",
        description='cluster-wide licence counts (Slurm\'s Licenses=): "fluent:30,matlab:5" '
        "or a table {fluent = 30, matlab = 5}; jobs ask with --licenses",
    )

    def license_totals(self) -> dict[str, int]:
        """The configured licence counts (validated when the config was loaded)."""
        from phalanx.domain.licenses import parse_totals

        return parse_totals(self.licenses)

    @model_validator(mode="after")
    def _licenses(self) -> ClusterConfig:
        from phalanx.domain.licenses import parse_totals

        parse_totals(self.licenses)  # ValueError -> a one-line config error
        return self

    @model_validator(mode="after")
    def _partitions(self) -> ClusterConfig:
        from phalanx.domain import values

        names = [p.name for p in self.partitions]
        if len(set(names)) != len(names):
            raise ValueError(f"partition names must be unique: {names}")
        if not self.partitions:
            raise ValueError("at least one partition is required")
        if sum(p.default for p in self.partitions) > 1:
            raise ValueError("only one partition may be the default")
        for p in self.partitions:
            for label, text in (("default_time", p.default_time), ("max_time", p.max_time)):
                try:
                    values.parse_duration(text)
                except ValueError as e:
                    raise ValueError(f"partition {p.name}: {label}: {e}") from None
        return self


class RetryConfig(BaseModel):
    """Cluster-wide retry defaults; a job's --retries, --retry-on and --retry-backoff override
    them (docs/retries.md)."""

    model_config = ConfigDict(extra="forbid")

    max_retries: int = Field(5, ge=0, le=10_000, description="failure retries per job (per task)")
    retry_on: str = Field(
        "node_fail,health,launch,hang",
        description="failure kinds (and exit:N codes) that are retried by default",
    )
    backoff_base: float = Field(
        10.0,
        ge=0,
        le=86400,
        description="seconds before the first retry of a job-caused failure; doubles per retry",
    )
    backoff_max: float = Field(600.0, ge=0, le=7 * 86400, description="longest wait before a retry")

    @field_validator("retry_on")
    @classmethod
    def _retry_on(cls, text: str) -> str:
        parse_retry_on(text)  # its ValueError names the bad word and the valid ones
        return text

    @model_validator(mode="after")
    def _rules(self) -> RetryConfig:
        if self.backoff_base > self.backoff_max:
            raise ValueError(
                f"backoff_base ({self.backoff_base:g}) must not exceed backoff_max "
                f"({self.backoff_max:g})"
            )
        return self


class AuthConfig(BaseModel):
    """Who may call the API and as whom jobs run (docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    key_file: str | None = Field(
        None,
        description="the cluster key (JWKS of HS256 keys; the first signs, all verify): "
        "default <state-dir>/keys/cluster.jwks, created on first start",
    )
    credential_ttl: float = Field(
        300.0,
        ge=10,
        le=86400,
        description="seconds a local credential (minted by an agent or `phalanx authd` for "
        "the Unix user on a local socket) stays valid",
    )
    clock_skew: float = Field(
        30.0,
        ge=0,
        le=600,
        description="seconds of clock difference between hosts tolerated when checking a "
        "credential's expiry and not-before times",
    )
    token_max_lifetime: float = Field(
        365 * 86400.0,
        gt=0,
        le=10 * 365 * 86400.0,
        description="longest lifetime `phalanx token create` may give a bearer token",
    )
    admins: list[str] = Field(
        default_factory=list, description="user names that are admins (root always is)"
    )
    operators: list[str] = Field(default_factory=list, description="user names that are operators")
    allow_root_jobs: bool = Field(False, description="accept jobs that would run as root")
    private_data: bool = Field(
        True,
        description="others' jobs are listed without their command, environment, paths and "
        "events (Slurm PrivateData=jobs); false shows everything to everyone",
    )
    jwks_file: str | None = Field(
        None, description="public keys (JWKS) of the site's identity provider (RS256 tokens)"
    )
    idp_audience: str | None = Field(None, description="the 'aud' an IdP token must carry")
    idp_issuer: str | None = Field(None, description="the 'iss' an IdP token must carry")
    user_claim: str = Field("sub", description="the IdP token claim that names the user")
    role_claim: str | None = Field(
        None, description="an IdP token claim listing roles (admin, operator); none: user"
    )
    tls_cert: str | None = Field(None, description="controller: TLS certificate (PEM)")
    tls_key: str | None = Field(None, description="controller: TLS private key (PEM)")

    @model_validator(mode="after")
    def _rules(self) -> AuthConfig:
        if self.clock_skew >= self.credential_ttl:
            raise ValueError(
                f"clock_skew ({self.clock_skew:g}) must be less than credential_ttl "
                f"({self.credential_ttl:g})"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.jwks_file is not None and not self.idp_audience:
            raise ValueError("jwks_file needs idp_audience (the audience IdP tokens carry)")
        return self


class LimitsConfig(BaseModel):
    """Per-user rate limits of each controller (token buckets; docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    api_rate: float = Field(
        200.0, gt=0, le=1e6, description="API calls per second per user, sustained"
    )
    api_burst: float = Field(2000.0, ge=1, le=1e7, description="API calls per user in a burst")
    submit_rate: float = Field(
        200.0, gt=0, le=1e6, description="jobs submitted per second per user, sustained"
    )
    submit_burst: float = Field(
        20000.0, ge=1, le=1e8, description="jobs per user in a burst (a batch counts each job)"
    )
    exempt_roles: list[str] = Field(
        default_factory=lambda: ["admin"], description="roles never throttled (agents never are)"
    )

    @field_validator("exempt_roles")
    @classmethod
    def _roles(cls, roles: list[str]) -> list[str]:
        bad = [r for r in roles if r not in ("admin", "operator", "user")]
        if bad:
            raise ValueError(f"unknown roles {bad}: use admin, operator or user")
        return roles


class AccountingConfig(BaseModel):
    """How long finished jobs stay in the store for `sacct` and `phalanx show` (docs/slurm.md)."""

    model_config = ConfigDict(extra="forbid")

    keep_finished: str = Field(
        "30-00:00:00",
        description="finished jobs are kept this long after their end, then purged with their "
        "attempts, tasks and events (Slurm time forms; UNLIMITED keeps them for ever)",
    )
    purge_batch: int = Field(
        1000, ge=1, le=100_000, description="jobs deleted per transaction when purging"
    )

    @field_validator("keep_finished")
    @classmethod
    def _keep(cls, text: str) -> str:
        from phalanx.domain import values

        try:
            seconds = values.parse_duration(text)
        except ValueError as e:
            raise ValueError(f"keep_finished: {e}") from None
        if seconds is not None and seconds < 60:
            raise ValueError(
                f"keep_finished: {text!r} is under a minute; finished jobs must stay long "
                "enough for `sacct` and `phalanx wait` to see them (e.g. '30-00:00:00')"
            )
        return text

    def keep_seconds(self) -> int | None:
        """Seconds a finished job is kept (None: for ever)."""
        from phalanx.domain import values

        return values.parse_duration(self.keep_finished)


class IsolationConfig(BaseModel):
    """What contains a job on its node (docs/isolation.md); sent to agents when they register."""

    model_config = ConfigDict(extra="forbid")

    pids_max: int = Field(
        4096, ge=16, le=4_194_304, description="most processes and threads one job attempt may have"
    )
    require_cgroups: bool = Field(
        True,
        description="a node whose agent cannot put jobs in cgroups (memory, pids, cpu) runs "
        "no jobs: it is drained with the reason",
    )


class MetricsConfig(BaseModel):
    """Prometheus exposition (docs/metrics.md): the controllers' `/metrics` cache and bounds,
    the agents' own `/metrics` listener."""

    model_config = ConfigDict(extra="forbid")

    cache_seconds: float = Field(
        5.0,
        gt=0,
        le=300,
        description="seconds a controller reuses the store figures of /metrics before reading "
        "them again (N controllers scraped every 15 s cost the store one read each per period)",
    )
    scrape_wait: float = Field(
        2.0,
        gt=0,
        le=60,
        description="seconds a scrape waits for fresh store figures before it answers the last "
        "ones with phalanx_store_up 0 (keep it under Prometheus' scrape_timeout)",
    )
    max_users: int = Field(
        20, ge=1, le=10_000, description="users with series of their own; the rest are 'other'"
    )
    max_reasons: int = Field(
        20,
        ge=1,
        le=10_000,
        description="pending reasons with series of their own; the rest are 'other'",
    )
    agent_port: int = Field(
        0, ge=0, le=65535, description="port of each agent's /metrics (0: not served)"
    )
    agent_host: str = Field(
        "0.0.0.0", min_length=1, max_length=256, description="address the agent's /metrics binds"
    )


MiB = 1024 * 1024


class HttpConfig(BaseModel):
    """What one client may hold of a controller's HTTP server (docs/deploy.md, "Hostile
    clients"): request sizes, JSON depth, the time to send a request, connections."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        64 * MiB,
        ge=MAX_JOB_BYTES,
        le=1024 * MiB,
        description="longest request body; a longer one is answered 413 before it is read "
        "(from its Content-Length, or as it streams in). The largest legitimate request is a "
        "batch submission (POST /v1/jobs/batch, up to 10,000 jobs); at least one job at every "
        "field limit",
    )
    max_json_depth: int = Field(
        64,
        ge=8,
        le=512,
        description="deepest nesting of JSON arrays and objects in a request body; deeper is "
        "answered 400 (Python's own parser would run out of stack near 1,000)",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=8 * 1024,
        le=MiB,
        description="the request line and headers of one request; longer is answered 431 "
        "and the connection closed",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        le=300,
        description="seconds a client has, from connecting (or from the first byte of its next "
        "request), to send a request's complete headers; a connection that has not is closed "
        "(slowloris)",
    )
    body_timeout: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="seconds a client has, after a request's headers, to send its whole body; "
        "a connection that has not is closed",
    )
    idle_timeout: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="seconds a kept-alive connection may stay idle between two requests",
    )
    max_connections: int = Field(
        16384,
        ge=16,
        le=1_000_000,
        description="open connections (or requests in progress) at which a new request is "
        "answered 503 at once, before the API sees it (clients fail over); every agent holds "
        "one connection to one controller, so keep it above the node count plus the clients, "
        "and below the process's file descriptor limit (LimitNOFILE)",
    )


class StepsConfig(BaseModel):
    """Job steps (`srun` inside a job; docs/slurm.md, "What a step costs")."""

    model_config = ConfigDict(extra="forbid")

    direct: bool = Field(
        True,
        description="srun hands each node's share of a step to that node's agent itself, with "
        "a credential the controller signed (Slurm's model); false: every step reaches the "
        "agents through their long-polls, as does any step a direct hand-over misses",
    )
    compiled_srun: bool = Field(
        True,
        description="agent: build the compiled thin srun (slurm/srun_thin.c) with the host's "
        "C compiler once and put it first on jobs' PATH, so a step does not pay a Python "
        "start-up; false, or no compiler: jobs find the Python srun on their PATH",
    )
    agent_host: str = Field(
        "0.0.0.0",
        min_length=1,
        max_length=256,
        description="address each agent listens on for direct step launches",
    )
    agent_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port each agent listens on for direct step launches (0: any free port; "
        "agents tell the controllers theirs in every heartbeat)",
    )
    launch_ttl: float = Field(
        60.0,
        ge=1,
        le=3600,
        description="seconds a signed step launch stays valid for the node it is addressed "
        "to (clocks of controllers and nodes may differ by less than this)",
    )
    push_timeout: float = Field(
        2.0,
        gt=0,
        le=60,
        description="seconds srun waits for a node's agent to take a step before it has the "
        "controller wake that node's long-poll instead",
    )
    exit_report_delay: float = Field(
        0.5,
        ge=0,
        le=60,
        description="agent: seconds a step task's end may wait before it is reported, so that "
        "the ends of a burst of short steps go to the controller in one heartbeat (srun "
        "learns of them from the tasks at once; the store within this delay)",
    )


def _duration_field(text: str, label: str, *, allow_zero: bool = False) -> str:
    """Check a Slurm-form duration ("7-00:00:00", "30:00"; "UNLIMITED" not allowed here;
    "0" only where `allow_zero` says it means something)."""
    from phalanx.domain import values

    if allow_zero and text.strip() == "0":
        return text
    try:
        seconds = values.parse_duration(text)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    if seconds is None:
        raise ValueError(f"{label}: {text!r} must be a duration such as '7-00:00:00'")
    return text


class PriorityConfig(BaseModel):
    """Multifactor priority (Slurm's priority/multifactor; docs/fairshare.md): each factor is
    0..1 and is multiplied by its weight; the sum, less the job's nice, is its priority."""

    model_config = ConfigDict(extra="forbid")

    weight_age: int = Field(1000, ge=0, le=1_000_000_000, description="PriorityWeightAge")
    weight_fairshare: int = Field(
        10000, ge=0, le=1_000_000_000, description="PriorityWeightFairshare"
    )
    weight_jobsize: int = Field(1000, ge=0, le=1_000_000_000, description="PriorityWeightJobSize")
    weight_partition: int = Field(
        1000, ge=0, le=1_000_000_000, description="PriorityWeightPartition"
    )
    weight_qos: int = Field(1000, ge=0, le=1_000_000_000, description="PriorityWeightQOS")
    max_age: str = Field(
        "7-00:00:00", description="PriorityMaxAge: a job this old has the full age factor"
    )
    favor_small: bool = Field(
        False, description="PriorityFavorSmall: the job size factor favours small jobs"
    )
    usage_half_life: str = Field(
        "7-00:00:00",
        description="PriorityDecayHalfLife: past usage counts half after this long (0: never "
        "decays)",
    )
    calc_period: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="PriorityCalcPeriod (seconds here): usage of running jobs is charged and "
        "decayed, and the fair share table refreshed, this often",
    )
    charge_cpu: float = Field(
        1.0, ge=0, le=1e6, description="charge units per CPU-second (TRESBillingWeights CPU)"
    )
    charge_gpu: float = Field(
        10.0, ge=0, le=1e6, description="charge units per GPU-second (TRESBillingWeights GRES/gpu)"
    )

    @field_validator("max_age")
    @classmethod
    def _max_age(cls, text: str) -> str:
        return _duration_field(text, "max_age")

    @field_validator("usage_half_life")
    @classmethod
    def _half_life(cls, text: str) -> str:
        return _duration_field(text, "usage_half_life", allow_zero=True)

    def max_age_s(self) -> float:
        from phalanx.domain import values

        return float(values.parse_duration(self.max_age) or 0)

    def half_life_s(self) -> float:
        """Seconds; 0: usage never decays."""
        from phalanx.domain import values

        if self.usage_half_life.strip() == "0":
            return 0.0
        return float(values.parse_duration(self.usage_half_life) or 0)


class LimitFields(BaseModel):
    """Limits an account, a user association or a QOS may carry (docs/fairshare.md)."""

    model_config = ConfigDict(extra="forbid")

    max_running_jobs: int | None = Field(None, ge=0, description="GrpJobs / MaxJobs")
    max_submit_jobs: int | None = Field(None, ge=0, description="GrpSubmitJobs / MaxSubmitJobs")
    max_gpus: int | None = Field(None, ge=0, description="GrpTRES=gres/gpu=N")
    max_wall: str | None = Field(None, description="MaxWall: longest time limit of one job")

    @field_validator("max_wall")
    @classmethod
    def _wall(cls, text: str | None) -> str | None:
        return None if text is None else _duration_field(text, "max_wall")

    def max_wall_s(self) -> int | None:
        from phalanx.domain import values

        return None if self.max_wall is None else values.parse_duration(self.max_wall)


_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class AccountConfig(LimitFields):
    name: str = Field(pattern=_NAME)
    parent: str = Field("root", pattern=_NAME, description="parent account; root: top level")
    shares: int = Field(1, ge=1, le=1_000_000_000)


class UserAssocConfig(LimitFields):
    name: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,128}$", description="the Unix user")
    account: str = Field(pattern=_NAME)
    shares: int = Field(1, ge=1, le=1_000_000_000)
    default: bool = Field(False, description="the user's default account (else the first)")


class QosConfig(LimitFields):
    """A QOS: its priority (the QOS factor's numerator) and per-user limits."""

    name: str = Field(pattern=_NAME)
    priority: int = Field(0, ge=0, le=1_000_000_000)
    priority_tier: int | None = Field(
        None,
        ge=0,
        le=65533,
        description="preemption tier of the QOS's jobs (unset: their partition's)",
    )
    preempt_mode: Literal["requeue", "cancel", "off"] | None = Field(
        None, description="PreemptMode of the QOS's jobs (unset: their partition's)"
    )


class FairShareConfig(BaseModel):
    """Accounts in a tree, users in accounts, QOS (docs/fairshare.md)."""

    model_config = ConfigDict(extra="forbid")

    default_account: str = Field(
        "default", pattern=_NAME, description="created under root if not declared"
    )
    default_qos: str = Field("normal", pattern=_NAME, description="created if not declared")
    open: bool = Field(
        True,
        description="users not listed in `users` may submit, to the default account, with 1 "
        "share each; false: they are refused",
    )
    accounts: list[AccountConfig] = Field(default_factory=list)
    users: list[UserAssocConfig] = Field(default_factory=list)
    qos: list[QosConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tree(self) -> FairShareConfig:
        from phalanx.domain import fairshare

        try:
            fairshare.validate_tree(self.tree_accounts(), self.members())
        except ValueError as e:
            raise ValueError(f"fairshare: {e}") from None
        names = [q.name for q in self.qos]
        if len(set(names)) != len(names):
            raise ValueError(f"fairshare: QOS names must be unique: {names}")
        return self

    def all_accounts(self) -> list[AccountConfig]:
        accts = list(self.accounts)
        if self.default_account not in {a.name for a in accts}:
            accts.append(AccountConfig(name=self.default_account))
        return accts

    def all_qos(self) -> list[QosConfig]:
        qos = list(self.qos)
        if self.default_qos not in {q.name for q in qos}:
            qos.append(QosConfig(name=self.default_qos))
        return qos

    def tree_accounts(self) -> list[Any]:
        from phalanx.domain import fairshare

        return [fairshare.Account(a.name, a.parent, a.shares) for a in self.all_accounts()]

    def members(self) -> list[Any]:
        from phalanx.domain import fairshare

        return [fairshare.Member(u.name, u.account, u.shares) for u in self.users]

    def accounts_of(self, user: str) -> list[str]:
        """The user's accounts, default first; [] if the user is not listed."""
        mine = [u for u in self.users if u.name == user]
        mine.sort(key=lambda u: not u.default)
        return [u.account for u in mine]


class PreemptionConfig(BaseModel):
    """Preemption between priority tiers (docs/preemption.md); tiers and modes are set on
    partitions and QOS."""

    model_config = ConfigDict(extra="forbid")

    exempt_time: float = Field(
        0.0,
        ge=0,
        le=30 * 86400,
        description="Slurm's PreemptExemptTime: seconds a job runs before it may be preempted",
    )
    reserve_margin: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="seconds the preemptor keeps its claim on the victims' nodes beyond the "
        "victims' longest checkpoint grace (then the claim lapses and it competes again)",
    )
    max_per_pass: int = Field(
        16, ge=1, le=10_000, description="preempting jobs decided in one scheduling pass"
    )

    def tiers(self, cluster: ClusterConfig, fairshare: FairShareConfig) -> Any:
        """The tiers and modes of partitions and QOS (domain/preemption.Tiers)."""
        from phalanx.domain.preemption import Mode, Tiers

        return Tiers(
            partition_tier={p.name: p.priority_tier for p in cluster.partitions},
            partition_mode={p.name: Mode(p.preempt_mode) for p in cluster.partitions},
            qos_tier={
                q.name: q.priority_tier for q in fairshare.qos if q.priority_tier is not None
            },
            qos_mode={
                q.name: Mode(q.preempt_mode) for q in fairshare.qos if q.preempt_mode is not None
            },
        )


class WatchdogConfig(BaseModel):
    """The daemons' watchdog under systemd (deploy/systemd/, docs/deploy.md): when a loop is
    wedged, pings to systemd (and the optional hardware watchdog) stop."""

    model_config = ConfigDict(extra="forbid")

    loop_timeout: float = Field(
        60.0,
        ge=1,
        le=3600,
        description="a loop that has not progressed for this long beyond twice its own interval "
        "is wedged: watchdog pings stop and systemd restarts the daemon",
    )
    store_timeout: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="controller: pings also stop when the store has not answered for this long "
        "(0: never; a store outage alone does not restart controllers)",
    )
    interval: float = Field(
        5.0,
        gt=0,
        le=600,
        description="seconds between two watchdog rounds (STATUS=, the hardware device) when "
        "systemd sets no WATCHDOG_USEC; with it, half of that is used",
    )
    device: str | None = Field(
        None,
        description="a hardware watchdog device (e.g. /dev/watchdog) petted under the same rule; "
        "none: not used",
    )


class TopologyRule(BaseModel):
    """One `[[topology.nodes]]` entry: node globs and their domain at some levels."""

    model_config = ConfigDict(extra="allow")

    nodes: str = Field(description="node names: a glob (fnmatch) or a comma list of globs")


class TopologyConfig(BaseModel):
    """Where nodes sit in the network/power tree (docs/topology.md)."""

    model_config = ConfigDict(extra="forbid")

    levels: list[str] = Field(
        default_factory=lambda: ["switch", "rack", "pdu"],
        description="tree levels, leaf first; --switches counts the first",
    )
    nodes: list[TopologyRule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> TopologyConfig:
        import re

        if len(set(self.levels)) != len(self.levels):
            raise ValueError(f"topology.levels must be unique: {self.levels}")
        for lv in self.levels:
            if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", lv) or lv == "nodes":
                raise ValueError(f"topology.levels: {lv!r} is not a level name (e.g. rack)")
        for i, rule in enumerate(self.nodes):
            for key, value in (rule.model_extra or {}).items():
                if key not in self.levels:
                    raise ValueError(
                        f"topology.nodes[{i}] ({rule.nodes}): {key!r} is not one of "
                        f"topology.levels ({', '.join(self.levels)})"
                    )
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(
                        f"topology.nodes[{i}] ({rule.nodes}): {key} must be a domain name"
                    )
        return self

    def layout(self) -> Any:
        """The pure form the scheduler uses (domain.topology.Layout)."""
        from phalanx.domain.topology import Layout

        return Layout(
            levels=tuple(self.levels),
            rules=tuple(
                (
                    tuple(g.strip() for g in r.nodes.split(",") if g.strip()),
                    tuple((str(k), str(v)) for k, v in (r.model_extra or {}).items()),
                )
                for r in self.nodes
            ),
        )


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timing: Timing = Field(default_factory=lambda: Timing())
    cluster: ClusterConfig = Field(default_factory=lambda: ClusterConfig())
    retry: RetryConfig = Field(default_factory=lambda: RetryConfig())
    auth: AuthConfig = Field(default_factory=lambda: AuthConfig())
    limits: LimitsConfig = Field(default_factory=lambda: LimitsConfig())
    http: HttpConfig = Field(default_factory=lambda: HttpConfig())
    isolation: IsolationConfig = Field(default_factory=lambda: IsolationConfig())
    accounting: AccountingConfig = Field(default_factory=lambda: AccountingConfig())
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig())
    priority: PriorityConfig = Field(default_factory=lambda: PriorityConfig())
    fairshare: FairShareConfig = Field(default_factory=lambda: FairShareConfig())
    watchdog: WatchdogConfig = Field(default_factory=lambda: WatchdogConfig())
    preemption: PreemptionConfig = Field(default_factory=lambda: PreemptionConfig())
    topology: TopologyConfig = Field(default_factory=lambda: TopologyConfig())
    steps: StepsConfig = Field(default_factory=lambda: StepsConfig())

    @model_validator(mode="after")
    def _watchdog_rules(self) -> Config:
        t, w = self.timing, self.watchdog
        rules = [
            (
                # a tick that waits on a hanging store fails after db_op_timeout, and a few
                # such waits in a row are an outage, not a wedged loop
                w.loop_timeout >= 5 * t.db_op_timeout,
                "watchdog.loop_timeout >= 5 * timing.db_op_timeout",
            ),
            (
                # the store is probed every renew_interval, and an answer may take
                # db_op_timeout: anything shorter stops the pings of a healthy controller
                w.store_timeout == 0 or w.store_timeout > t.renew_interval + t.db_op_timeout,
                "watchdog.store_timeout == 0 or watchdog.store_timeout > "
                "timing.renew_interval + timing.db_op_timeout",
            ),
        ]
        broken = [text for ok, text in rules if not ok]
        if broken:
            raise ValueError(
                f"watchdog rule broken: {'; '.join(broken)} (values: "
                f"loop_timeout={w.loop_timeout}, store_timeout={w.store_timeout}, "
                f"db_op_timeout={t.db_op_timeout}, "
                f"renew_interval={t.renew_interval})"
            )
        return self

    def failure_policy(self) -> FailurePolicy:
        return FailurePolicy(
            max_launch_failures=self.cluster.max_launch_failures,
            launch_backoff_base=self.timing.launch_backoff_base,
            launch_backoff_max=self.timing.launch_backoff_max,
            node_launch_failures_to_drain=self.cluster.node_launch_failures_to_drain,
            max_retries=self.retry.max_retries,
            retry_on=self.retry.retry_on,
            retry_backoff_base=self.retry.backoff_base,
            retry_backoff_max=self.retry.backoff_max,
        )


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None
) -> Config:
    """Read `path` (or $PHALANX_CONFIG), apply PHALANX_TIMING_<NAME> env overrides, validate."""
    data: dict[str, Any] = {}
    path = path or os.environ.get("PHALANX_CONFIG")
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    timing = dict(data.get("timing", {}))
    for key in Timing.model_fields:
        env = os.environ.get(f"PHALANX_TIMING_{key.upper()}")
        if env is not None:
            try:
                timing[key] = float(env)
            except ValueError:
                raise ConfigError(f"PHALANX_TIMING_{key.upper()}={env!r} is not a number") from None
    if timing:
        data["timing"] = timing
    metrics = dict(data.get("metrics", {}))
    for key in MetricsConfig.model_fields:
        env = os.environ.get(f"PHALANX_METRICS_{key.upper()}")
        if env is not None:  # validated (and explained) with the rest below
            metrics[key] = env
    if metrics:
        data["metrics"] = metrics
    root_jobs = os.environ.get("PHALANX_AUTH_ALLOW_ROOT_JOBS")
    if root_jobs is not None:  # `phalanx up` run by root: its owner may run jobs as root
        if root_jobs not in ("0", "1"):
            raise ConfigError(f"PHALANX_AUTH_ALLOW_ROOT_JOBS={root_jobs!r} must be 0 or 1")
        data.setdefault("auth", {})["allow_root_jobs"] = root_jobs == "1"
    for key, value in (overrides or {}).items():
        data.setdefault(key, {}).update(value)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(
            f"invalid configuration{f' in {path}' if path else ''}: {_explain(e)}"
        ) from None


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
