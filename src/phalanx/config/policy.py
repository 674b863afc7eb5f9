"""How the cluster is shared: multifactor priority (`[priority]`), the account tree, user
associations, QOS and their limits (`[fairshare]`), and preemption between tiers
(`[preemption]`).

The scheduling policy an administrator tunes (docs/fairshare.md, docs/preemption.md), kept
together because accounts, QOS and tiers refer to one another and to the partitions of
config/cluster.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from phalanx.config.cluster import ClusterConfig

__all__ = [
    "AccountConfig",
    "FairShareConfig",
    "LimitFields",
    "PreemptionConfig",
    "PriorityConfig",
    "QosConfig",
    "UserAssocConfig",
]


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
