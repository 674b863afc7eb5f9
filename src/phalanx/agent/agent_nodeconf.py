"""Taking the node settings the controllers deliver (agent/nodeconf.py), without a restart.

A part of :class:`agent.Agent`. A reply's ``node_config`` (``{"version", "settings"}``:
controller/nodeconfig.py) is applied between jobs and checks: new health checks replace the
monitor's (each runs at the monitor's next look), new hooks are what the next launch hands
its shepherd (a task already launched keeps the ones it started with), and new features are
registered again. The version taken goes with every heartbeat, so the controllers send the
settings again only when it is not theirs. Versions only move forward: while controllers
move to a new version one presence loop apart, a reply from one still on the older version
is ignored rather than flapping the node between the two.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from phalanx.agent import nodeconf
from phalanx.agent.health import HealthMonitor
from phalanx.agent.hooks import NodeHooks, launch_timeout_warning, parse_hooks
from phalanx.agent.resources import NodeResources

log = logging.getLogger("phalanx.agent")


class AgentNodeConfig:
    """The agent's node settings in force, and their replacement by a delivered version."""

    name: str
    health: HealthMonitor | None
    hooks: NodeHooks | None
    resources: NodeResources
    _registered: bool
    # set by Agent.__init__
    node_file: dict[str, Any]
    own_features: list[str]
    node_config_version: int | None
    node_settings: dict[str, Any]
    launch_timeout: Any

    def _init_node_config(self, node_file: dict[str, Any] | None) -> None:
        self.node_file = dict(node_file or {})
        self.own_features = list(self.resources.features)
        self.node_config_version = None  # the version whose settings run here (None: none yet)
        self.node_settings, _ = nodeconf.effective(self.node_file, {}, self.own_features)
        self.launch_timeout = None  # the controllers' timing.launch_timeout (registration)

    def _learn_node_config(self, offered: Any) -> None:
        """Take a reply's ``node_config`` if it is newer than the one in force."""
        if not isinstance(offered, dict) or not isinstance(offered.get("settings"), dict):
            return
        version = offered.get("version")
        if version is not None and not isinstance(version, int):
            return
        have = self.node_config_version
        if have is not None and (version is None or version <= have):
            return  # the same, or a controller not yet on the version this node runs
        new, overridden = nodeconf.effective(self.node_file, offered["settings"], self.own_features)
        label = f"node configuration of cluster version {version}"
        if overridden:
            log.warning(
                "the %s sets %s, which this node's file sets too: the controllers' settings "
                "are in force (remove them from the node file)",
                label,
                ", ".join(overridden),
            )
        changed = nodeconf.changes(self.node_settings, new)
        try:
            self._apply_node_settings(new)
        except ValueError as e:  # checked by `config apply`; a release that reads it otherwise
            log.error("cannot run the %s (keeping the settings in force): %s", label, e)
        else:
            if changed:
                log.info("runs the %s: %s", label, "; ".join(changed))
            elif have is None:
                log.info("runs the %s (nothing changes here)", label)
            self.node_settings = new
        self.node_config_version = version

    def _apply_node_settings(self, new: dict[str, Any]) -> None:
        """Swap in `new` (nodeconf.effective's form); ValueError before anything changes."""
        hooks = parse_hooks(new, check_file=False)
        checks = None
        if self.health is not None and not nodeconf.same(
            new["health"], self.node_settings.get("health")
        ):
            from phalanx.agent.health.config import build_checks, default_checks

            health = new["health"]
            checks = build_checks(health) if health else default_checks()
        for name in ("prolog", "epilog", "task_prolog"):
            hook = getattr(hooks, name)
            if hook is not None and not (
                os.path.isfile(hook.path) and os.access(hook.path, os.X_OK)
            ):
                log.warning(
                    "%s.path %s is not an executable file on this node: a launch here will "
                    "fail its %s (and a failing prolog or epilog drains the node)",
                    name,
                    hook.path,
                    name,
                )
        if checks is not None and self.health is not None:
            health = new["health"]
            self.health.replace_checks(
                checks,
                passes_to_recover=int(health.get("passes_to_recover") or 3),
                hung_after=float(health.get("hung_after") or 120.0),
            )
        before, self.hooks = self.hooks, hooks
        said = launch_timeout_warning(hooks, self.launch_timeout)
        if said and hooks != before:
            log.warning("%s", said)
        if sorted(new["features"]) != sorted(self.resources.features):
            self.resources.features = list(new["features"])
            self._registered = False  # registered again, with them, before the next heartbeat
