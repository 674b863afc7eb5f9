"""Agents' retry delays (phalanx/backoff.py): exponential, capped, jittered."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from phalanx.backoff import Backoff


@given(
    seed=st.integers(0, 2**32 - 1),
    cap=st.floats(0.2, 60.0),
    failures=st.integers(1, 30),
)
def test_each_delay_is_half_to_all_of_a_doubling_base_under_the_cap(
    seed: int, cap: float, failures: int
) -> None:
    retry = Backoff(first=0.2, rng=random.Random(seed))
    for n in range(failures):
        base = min(0.2 * 2**n, cap)
        delay = retry.next_delay(cap)
        assert base / 2 <= delay <= base
    retry.reset()
    assert 0.1 <= retry.next_delay(cap) <= 0.2


def test_nodes_that_failed_together_do_not_retry_together() -> None:
    """The point of the jitter: a thousand nodes' third retries spread over half the base."""
    delays = []
    for seed in range(1000):
        retry = Backoff(first=0.2, rng=random.Random(seed))
        delays.append([retry.next_delay(10.0) for _ in range(3)][-1])
    assert min(delays) < 0.45 and max(delays) > 0.75  # base 0.8: spread over [0.4, 0.8]
    assert len({round(d, 3) for d in delays}) > 200
