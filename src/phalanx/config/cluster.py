"""The cluster itself: its partitions and licences (`[cluster]`), how failed work is retried
(`[retry]`), and where nodes sit in the network/power tree (`[topology]`).

These describe what the scheduler places jobs on and what happens to a job that fails,
as opposed to who may use the cluster (config/access.py) or how it is shared
(config/policy.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from phalanx.domain.policy import parse_retry_on

__all__ = ["ClusterConfig", "PartitionConfig", "RetryConfig", "TopologyConfig", "TopologyRule"]


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
