"""The agent's rules for its node settings, installed where the versioned configuration
checks `[nodes]` (config/nodes.py `RULES`): the configuration sits below the agent in the
package's layers, so it cannot import them itself. Imported for its effect by the `phalanx`
command (cli/main.py), so every controller, and every `phalanx config` run, holds a version's
`[nodes]` to the same rules as an agent's node file."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from phalanx.agent.health.config import build_checks
from phalanx.agent.health.gpu import NvmlLike
from phalanx.agent.hooks import parse_hook
from phalanx.config.nodes import RULES


class _NoNvml:
    """Stands for NVML while a health table is checked: building the checks must not touch
    the checking host's own GPUs (NVML is only called when a check runs)."""


def check_health(value: Mapping[str, Any]) -> None:
    """ValueError naming the field, as for a node file's `[health]`."""
    build_checks(value, nvml=cast(NvmlLike, _NoNvml()))


def check_hook(name: str, value: Any) -> dict[str, Any] | None:
    """A hook's normalised table ({path, timeout}) or None when off; ValueError naming the
    field. The file is not looked for: it exists, or not, on each node."""
    hook = parse_hook(name, value, check_file=False)
    return hook.spec() if hook is not None else None


def install() -> None:
    RULES.update(health=check_health, hook=check_hook)


install()
