"""A node's settings in force: the node file's, with those the controllers deliver.

Slurm's configless mode: the controllers send each agent its node's settings from the
cluster's versioned configuration (`[nodes]`, config/nodes.py; controller/nodeconfig.py),
with the registration reply and whenever the version changes. **The delivered settings win**
for every key they set (`health`, `prolog`, `epilog`, `task_prolog`); the node file
(``--health-config``) still decides the keys they leave unset, so a cluster without `[nodes]`
runs exactly as before, and a node file that a version overrides draws a warning naming the
keys. Features add up: the agent's ``--features`` and the delivered `features`.

Pure: what is in force (`effective`) and what changed (`changes`); the agent applies them
(agent/agent_nodeconf.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from phalanx.agent.hooks import HOOK_TABLES

# the keys a node file and a delivered configuration may both set
FILE_KEYS = ("health", *HOOK_TABLES)


def health_table(data: Mapping[str, Any]) -> dict[str, Any]:
    """The [health] table of the node file, or the whole file less the hooks' tables (a
    file of health keys alone); none = the default checks."""
    if "health" in data:
        return dict(data["health"])
    return {k: v for k, v in data.items() if k not in HOOK_TABLES}


def file_settings(data: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a node file sets, in the delivered form (an absent key: not set)."""
    out: dict[str, Any] = {}
    health = health_table(data)
    if health:
        out["health"] = health
    for name in HOOK_TABLES:
        if data.get(name) is not None:
            out[name] = data[name]
    return out


def effective(
    file_data: Mapping[str, Any],
    delivered: Mapping[str, Any],
    own_features: Iterable[str],
) -> tuple[dict[str, Any], list[str]]:
    """The settings in force and the node file's keys that the delivered ones override.
    `health` is always present ({}: the built-in checks); a hook is None when off;
    `features` is the agent's own, then the delivered ones not among them."""
    mine = file_settings(file_data)
    out: dict[str, Any] = {"health": mine.get("health") or {}}
    for name in HOOK_TABLES:
        out[name] = mine.get(name)
    overridden = []
    for key in FILE_KEYS:
        if key in delivered and delivered[key] is not None:
            if key in mine and not same(mine[key], delivered[key]):
                overridden.append(key)
            out[key] = delivered[key]
    out["features"] = list(dict.fromkeys([*own_features, *(delivered.get("features") or ())]))
    return out, overridden


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """One phrase per setting that differs, for the agent's log."""
    out = []
    for key in (*FILE_KEYS, "features"):
        if not same(old.get(key), new.get(key)):
            out.append(f"{key}: {_show(old.get(key))} -> {_show(new.get(key))}")
    return out


def same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _show(v: Any) -> str:
    if v is None or v is False:
        return "off"
    if v == {}:
        return "built-in checks"
    return json.dumps(v, sort_keys=True, default=str)
