"""The `[timing]` section: every timeout and interval that controllers and agents must agree
on (both load the same values), and the rules that tie them together.

A timing that breaks a rule (a lease renewed too rarely for its TTL, a node fenced after it is
declared DOWN) is refused when the configuration loads, naming the rule and the values. Kept
apart because these rules are the fault-tolerance argument of the whole system
(docs/configuration.md), and `Timing.for_cluster` scales them with the cluster's size.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["UNLIMITED", "Timing"]

UNLIMITED = "UNLIMITED"  # reservation_overrun: jobs in a reservation run on past its end
MAX_OVERRUN_S = 366 * 86400.0


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
    reservation_overrun: float | Literal["UNLIMITED"] = Field(
        0.0,
        description="Slurm's ResvOverRun, in seconds: a job running in a reservation is "
        "stopped this long after the reservation ends (checkpoint signal first, then TIMEOUT); "
        "0 stops it at the end, UNLIMITED lets it run on to its own time limit",
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

    @field_validator("reservation_overrun", mode="before")
    @classmethod
    def _overrun_form(cls, v: Any) -> Any:
        """Seconds (a number, or text that reads as one: environment overrides) or
        UNLIMITED/INFINITE in any case; anything else is refused saying what to write."""
        if isinstance(v, str):
            word = v.strip()
            if word.upper() in (UNLIMITED, "INFINITE"):
                return UNLIMITED
            try:
                v = float(word)
            except ValueError:
                raise ValueError(
                    f"reservation_overrun = {v!r}: give seconds (0 stops a job at its "
                    'reservation\'s end, 600 ten minutes after) or "UNLIMITED"'
                ) from None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f'reservation_overrun = {v!r}: give seconds or "UNLIMITED"')
        if not 0 <= float(v) <= MAX_OVERRUN_S:
            raise ValueError(
                f"reservation_overrun = {v!r}: seconds from 0 to {MAX_OVERRUN_S:.0f} "
                '(366 days), or "UNLIMITED" for no stop at all'
            )
        return float(v)

    def overrun_s(self) -> float | None:
        """reservation_overrun in seconds; None for UNLIMITED."""
        v = self.reservation_overrun
        return None if v == UNLIMITED else float(v)

    def cluster_interval(self, nodes: int) -> float:
        """The heartbeat interval for a cluster of `nodes` nodes: the configured one, or longer
        where that many nodes would send more than `heartbeat_budget` heartbeats a second
        (Nomad's habit: the servers' heartbeat rate is capped, the interval grows instead)."""
        return max(self.heartbeat_interval, max(0, nodes) / self.heartbeat_budget)

    def flush_lag_limit(self) -> float:
        """Seconds a controller goes on answering heartbeats after the moment through which its
        last committed heartbeat flush stored everything it had heard: one flush interval
        plus one db_op_timeout for a flush that waits (for its turn, a row lock, a slow
        database). Past it the controller answers 503 instead (controller/agents_api.py), so
        that no agent's fence is freshened by a controller that cannot store the heartbeat."""
        return self.heartbeat_flush_interval + self.db_op_timeout

    def heard_window(self) -> float:
        """Seconds a controller's `flushed_through` mark holds the failure detector back
        (domain/detector.py, `heard_horizon`): at least node_down_timeout, and long enough
        that an agent answered just before the flush-lag limit has fenced its jobs: the limit,
        one long-poll and its grace (the reply may freshen the fence that much after the
        heartbeat was heard), fence_timeout, fence_kill_grace and fence_margin."""
        fenced = (
            self.flush_lag_limit()
            + self.heartbeat_interval
            + max(0.5, self.heartbeat_interval)
            + self.fence_timeout
            + self.fence_kill_grace
            + self.fence_margin
        )
        return max(self.node_down_timeout, fenced)

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
