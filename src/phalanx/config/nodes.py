"""`[nodes]`: what every agent runs, kept in the cluster's versioned configuration.

Slurm's configless mode sends each node its configuration from the controller, so a node's
own file holds only how to reach the controllers and its key. Phalanx does the same for the
settings that are cluster policy rather than facts of one host: the health checks, the
prolog, epilog and task prolog with their timeouts, and the node's features. They are one
section of the versioned document (config/versioned.py), changed with `phalanx config apply`
and delivered to each agent with its registration and heartbeat replies
(controller/nodeconfig.py, agent/nodeconf.py)::

    [nodes]                                # every node
    health = { interval = 30, mounts = ["/scratch"] }
    prolog = { path = "/etc/phalanx/prolog.sh", timeout = 30 }
    epilog = "/etc/phalanx/epilog.sh"      # a bare string is the path
    features = ["ib"]

    [[nodes.match]]                        # the nodes whose names match, in order
    names = "gpu[0-9]*"                    # the patterns of partitions' `nodes`
    health = { gpu = { expected_count = 8 } }
    features = ["ib", "a100"]
    prolog = false                         # off on these nodes

Each value is checked by the rules the agent's node file is held to (agent/hooks.py
`parse_hook`, agent/health/config.py `build_checks`), reused here so that `phalanx config
apply` refuses what an agent would refuse, with the field named. Whether a hook's file exists
and is executable can only be known on the node: the agent logs it when it takes a version,
and a launch whose prolog cannot be run drains the node, as a failing prolog does.

This module is pure: the section's model and `resolve`, a node's settings from it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["NODE_KEYS", "RULES", "NodeMatch", "NodesConfig", "resolve"]

# the settings a node's configuration may hold, in the order they are shown
NODE_KEYS = ("health", "prolog", "epilog", "task_prolog", "features")
HOOK_KEYS = ("prolog", "epilog", "task_prolog")
_FEATURE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,256}$")


# The rules are the agent's own (agent/hooks.py `parse_hook`, agent/health/config.py
# `build_checks`), but the configuration sits below the agent in the package's layers
# (tests/unit/test_import_graph.py), so the agent package installs them here
# (agent/nodecheck.py, imported by the `phalanx` command and whatever checks a version). A
# process without them refuses any `[nodes]` value rather than let it through unchecked.
RULES: dict[str, Callable[..., Any]] = {}


def _rule(name: str) -> Callable[..., Any]:
    rule = RULES.get(name)
    if rule is None:
        raise ValueError(
            "cannot check node settings in this process: the agent's rules are not loaded "
            "(import phalanx.agent.nodecheck)"
        )
    return rule


def _check_health(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a table of health checks, got {value!r}")
    _rule("health")(value)
    return dict(value)


def _check_hook(name: str, value: Any) -> dict[str, Any] | bool | None:
    """A hook's table, normalised to {path, timeout} (false: off; None: not set)."""
    if value is None:
        return None
    if value is False:
        return False
    spec: dict[str, Any] | None = _rule("hook")(name, value)
    return spec if spec is not None else False


class NodeSettings(BaseModel):
    """Settings for a set of nodes; None: not set here (a later or earlier layer decides)."""

    model_config = ConfigDict(extra="forbid")

    health: dict[str, Any] | None = None
    prolog: dict[str, Any] | bool | str | None = None
    epilog: dict[str, Any] | bool | str | None = None
    task_prolog: dict[str, Any] | bool | str | None = None
    features: list[str] | None = None

    @field_validator("health", mode="before")
    @classmethod
    def _health(cls, v: Any) -> Any:
        return _check_health(v)

    @field_validator("prolog", mode="before")
    @classmethod
    def _prolog(cls, v: Any) -> Any:
        return _check_hook("prolog", v)

    @field_validator("epilog", mode="before")
    @classmethod
    def _epilog(cls, v: Any) -> Any:
        return _check_hook("epilog", v)

    @field_validator("task_prolog", mode="before")
    @classmethod
    def _task_prolog(cls, v: Any) -> Any:
        return _check_hook("task_prolog", v)

    @field_validator("features")
    @classmethod
    def _features(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        for f in v:
            if not _FEATURE_RE.match(f):
                raise ValueError(
                    f"feature {f!r}: letters, digits, '_', '.' and '-' only (as --constraint)"
                )
        return list(dict.fromkeys(v))


class NodeMatch(NodeSettings):
    """Settings for the nodes whose names match `names`."""

    names: str = Field(min_length=1, max_length=4096)

    @field_validator("names")
    @classmethod
    def _names(cls, v: str) -> str:
        if not [x for x in v.split(",") if x.strip()]:
            raise ValueError(f"no pattern in {v!r}")
        return v


class NodesConfig(NodeSettings):
    """`[nodes]`: the defaults of every node, then `[[nodes.match]]` in order."""

    match: list[NodeMatch] = Field(default_factory=list, max_length=1000)

    def is_empty(self) -> bool:
        return self == NodesConfig()


def _matches(node: str, names: str) -> bool:
    from phalanx.domain.scheduling import node_partitions  # the partitions' own matching

    return bool(node_partitions(node, [{"name": "m", "nodes": names}]))


def resolve(section: Mapping[str, Any] | None, node: str) -> dict[str, Any]:
    """The settings of one node from a document's `nodes` section: the defaults, then each
    matching `[[nodes.match]]` in order, a later one winning. A `health` table is merged check
    by check (a match can change the GPU check alone; `gpu = false` turns one off); the other
    keys are replaced whole. Keys no layer sets are absent (the node's own file, or the
    built-in defaults, decide them)."""
    if not section:
        return {}
    out: dict[str, Any] = {k: section[k] for k in NODE_KEYS if section.get(k) is not None}
    for m in section.get("match") or ():
        if not _matches(node, str(m.get("names") or "")):
            continue
        for k in NODE_KEYS:
            v = m.get(k)
            if v is None:
                continue
            if k == "health" and isinstance(out.get(k), dict):
                out[k] = {**out[k], **v}
            else:
                out[k] = v
    return out
