"""Configuration: defaults < TOML file < environment < command-line flags.

Every timing parameter has a default, a documented meaning (docs/configuration.md) and a check
here. Rules that tie parameters together are checked when the configuration loads; a config
that breaks one is refused with a ConfigError naming the rule.

A package with one module per topic: timing (`[timing]`), cluster (`[cluster]`, `[retry]`,
`[topology]`), access (`[auth]`, `[limits]`, `[http]`), policy (`[priority]`, `[fairshare]`,
`[preemption]`), daemons (`[isolation]`, `[steps]`, `[metrics]`, `[watchdog]`,
`[accounting]`), and loading (`Config`, `load_config`). The names are re-exported here because
the whole code base imports its configuration from `phalanx.config`.
"""

from phalanx.config.access import AuthConfig, HttpConfig, LimitsConfig, MiB
from phalanx.config.cluster import (
    ClusterConfig,
    PartitionConfig,
    RetryConfig,
    TopologyConfig,
    TopologyRule,
)
from phalanx.config.daemons import (
    AccountingConfig,
    IsolationConfig,
    MetricsConfig,
    StepsConfig,
    WatchdogConfig,
)
from phalanx.config.loading import Config, load_config
from phalanx.config.policy import (
    AccountConfig,
    FairShareConfig,
    LimitFields,
    PreemptionConfig,
    PriorityConfig,
    QosConfig,
    UserAssocConfig,
)
from phalanx.config.timing import Timing
from phalanx.errors import ConfigError

__all__ = [
    "AccountConfig",
    "AccountingConfig",
    "AuthConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "FairShareConfig",
    "HttpConfig",
    "IsolationConfig",
    "LimitFields",
    "LimitsConfig",
    "MetricsConfig",
    "MiB",
    "PartitionConfig",
    "PreemptionConfig",
    "PriorityConfig",
    "QosConfig",
    "RetryConfig",
    "StepsConfig",
    "Timing",
    "TopologyConfig",
    "TopologyRule",
    "UserAssocConfig",
    "WatchdogConfig",
    "load_config",
]
