"""How the daemons run on their hosts: what contains a job on its node (`[isolation]`), how
job steps are launched (`[steps]`), Prometheus metrics (`[metrics]`), the systemd watchdog
(`[watchdog]`), and how long finished jobs stay in the store (`[accounting]`).

Operational settings of the controller and agent processes, which change how they run but
not what the scheduler decides.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "AccountingConfig",
    "IsolationConfig",
    "MetricsConfig",
    "StepsConfig",
    "WatchdogConfig",
]


class AccountingConfig(BaseModel):
    """How long finished jobs stay in the store for `sacct` and `phalanx show`, and how often
    agents sample running tasks for `sstat` (docs/slurm.md)."""

    model_config = ConfigDict(extra="forbid")

    keep_finished: str = Field(
        "30-00:00:00",
        description="finished jobs are kept this long after their end, then purged with their "
        "attempts, tasks and events (Slurm time forms; UNLIMITED keeps them for ever)",
    )
    purge_batch: int = Field(
        1000, ge=1, le=100_000, description="jobs deleted per transaction when purging"
    )
    gather_interval: float = Field(
        30.0,
        ge=1.0,
        le=3600.0,
        description="agent: seconds between samples of each running task's processes, whose "
        "largest memory and page-fault figures `sstat` prints (Slurm's JobAcctGatherFrequency; "
        "an `sstat` call also samples at once, so the current figures are always exact)",
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
