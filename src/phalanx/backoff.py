"""Retry delays for agents (and the simulator's virtual nodes, which behave as agents do).

Exponential backoff with jitter: after the n-th failure in a row a node waits between half
and all of ``first * 2**(n-1)`` (capped), drawn at random.  Without the jitter, nodes that
failed together (a boot storm, a controller that stalled) retry together and make the same
storm again; with it their retries spread over the interval.  The agent caps the delay at its
heartbeat interval, so a retry never waits long enough to make a live node look silent.
"""

from __future__ import annotations

import random

FIRST_S = 0.2  # the first retry's delay (before jitter)
REGISTER_TIMEOUT_S = 10.0  # how long an agent waits for a registration's answer


class Backoff:
    """The delay before the next retry; :meth:`reset` after a success."""

    def __init__(self, first: float = FIRST_S, rng: random.Random | None = None) -> None:
        self.first = first
        self.current = first
        self.rng = rng or random.Random()

    def next_delay(self, cap: float) -> float:
        """A delay in [current/2, current] (current capped at `cap`), then double current."""
        base = min(self.current, cap)
        self.current = min(self.current * 2, cap)
        return base * self.rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.current = self.first
