"""The whole configuration (`Config`, one field per section, and the rules that span
sections) and how it is read: defaults < TOML file < environment < command-line overrides.

`load_config` is the one way in: it reads the file ($PHALANX_CONFIG unless given), applies the
PHALANX_TIMING_*, PHALANX_METRICS_* and PHALANX_AUTH_ALLOW_ROOT_JOBS environment overrides and
the caller's, and turns any validation error into one ConfigError line per broken field.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from phalanx.config.access import AuthConfig, HttpConfig, LimitsConfig
from phalanx.config.cluster import ClusterConfig, RetryConfig, TopologyConfig
from phalanx.config.daemons import (
    AccountingConfig,
    IsolationConfig,
    MetricsConfig,
    StepsConfig,
    WatchdogConfig,
)
from phalanx.config.nodes import NodesConfig
from phalanx.config.policy import FairShareConfig, PreemptionConfig, PriorityConfig
from phalanx.config.timing import Timing
from phalanx.domain.policy import FailurePolicy
from phalanx.errors import ConfigError

__all__ = ["Config", "explain_validation", "load_config"]

# timings that also take a word (reservation_overrun = "UNLIMITED")
WORD_TIMINGS = frozenset({"reservation_overrun"})


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
    # what every agent runs (config/nodes.py): part of the versioned document
    nodes: NodesConfig = Field(default_factory=lambda: NodesConfig())

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
                if key in WORD_TIMINGS:  # e.g. UNLIMITED: the model says what it takes
                    timing[key] = env
                    continue
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


def explain_validation(e: ValidationError) -> str:
    """A validation error as one line: `section.key: message; ...`."""
    return _explain(e)


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
