"""The agent's side of the heartbeat protocol's timing: how long a heartbeat may take, when a
reply is too late to act on, which of a controller's timings it takes, and how far a reply
may move the fence file.

Pure functions of the clock readings and timings they are given (no I/O), so the agent
(agent.py) and the simulator's nodes (sim/nodes.py) apply the same rules, and the rules can
be tested alone.
"""

from __future__ import annotations

import math
from typing import Any

HEARTBEAT_GRACE_MIN = 0.5  # seconds; see heartbeat_grace()


def heartbeat_grace(interval: float) -> float:
    """How long a heartbeat may take beyond its long-poll before the agent fails over to the
    next controller. Config checks 2 * interval + this < fence_timeout, so a frozen controller
    is left in time for a healthy one to refresh the fence."""
    return max(HEARTBEAT_GRACE_MIN, interval)


def reply_is_late(elapsed: float, timeout: float) -> bool:
    """Whether a reply was read later than its request's own timeout allows.

    A live agent never reads one (the HTTP timeout fires first), so a late reply means this
    process was stopped or starved while the reply waited in its socket: the controller may
    have declared the node DOWN and requeued the work the reply starts. It is dropped, as a
    timed-out heartbeat would be; the protocol is level-triggered, so the next heartbeat gets
    whatever still holds."""
    return elapsed > timeout


# what an agent takes from a controller's timings, and whether zero is allowed
AGENT_TIMINGS = {"heartbeat_interval": False, "fence_timeout": False, "fence_kill_grace": True}


def learned_timing(current: dict[str, Any], offered: Any) -> tuple[dict[str, Any], list[str]]:
    """The agent's timings after a controller's reply offered `offered` (a register reply's
    whole [timing], or a heartbeat reply's scaled fields: the heartbeat rule lengthens them as
    the cluster grows), and the offered fields refused.

    A field the agent acts on must be a finite number, positive (the kill grace may be 0); a
    reply with any such field wrong changes none of them, since the interval and the fence
    timeout are only safe together (2 * interval + grace < fence_timeout). Other fields are
    kept as given (shown, never acted on)."""
    if not isinstance(offered, dict):
        return current, ([] if offered is None else ["timing"])
    bad = []
    for name, zero_ok in AGENT_TIMINGS.items():
        if name not in offered:
            continue
        v = offered[name]
        number = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if not number or v < 0 or (v == 0 and not zero_ok):
            bad.append(name)
    if bad:
        return current, bad
    return {**current, **offered}, []


def fence_mark(wall_now: float, mono_now: float, sent_at: float, timeout: float) -> float:
    """The time a controller's reply may write into the fence file (wall clock).

    The controller counts a node's silence from when a heartbeat reached it, so a reply
    vouches for the node only from its request's sending (`sent_at`, monotonic) plus the
    longest a live exchange takes (`timeout`): never later, however late the reply is read.
    A job that a stopped agent launches on waking is then fenced by the same deadline as
    every other job of the node, ahead of the node being declared DOWN (config rule
    fence_timeout + fence_kill_grace + heartbeat_interval + grace < node_down_timeout).
    Read the wall clock before the monotonic one: a stop between the two then errs early."""
    sent_wall = wall_now - (mono_now - sent_at)
    return min(wall_now, sent_wall + timeout)
