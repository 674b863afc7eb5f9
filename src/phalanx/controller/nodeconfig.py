"""What a controller tells an agent of its node's configuration (config/nodes.py), and when.

Level-triggered, like the timings every heartbeat reply carries, but cheaper: the resolved
settings go with every registration reply, and with a heartbeat reply only when the version
the agent says it runs is not the one this controller runs. An agent that does not say
(an older release) gets them with every reply, which it ignores. A controller that runs no
version (a store without one: tests, the simulator) sends them at registration only.
"""

from __future__ import annotations

from typing import Any

from phalanx.config import Config
from phalanx.config.nodes import resolve


def node_config(config: Config, version: int | None, node: str) -> dict[str, Any]:
    """The reply's ``node_config``: the version and the node's resolved settings."""
    section = config.nodes.model_dump(mode="json", exclude_none=True)
    return {"version": version, "settings": resolve(section, node)}


def for_heartbeat(
    config: Config, version: int | None, node: str, reported: int | None
) -> dict[str, Any] | None:
    """``node_config`` for a heartbeat reply, or None when the agent already runs `version`."""
    if version is None or reported == version:
        return None
    return node_config(config, version, node)
