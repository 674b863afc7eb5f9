"""The timings an agent takes from its controllers' replies (agent.learned_timing).

Registration replies carry the cluster's whole [timing]; every heartbeat reply carries the
three the heartbeat rule scales as the cluster grows (docs/sim.md). The agent acts on the
interval, the fence timeout and the fence's kill grace: a bad value there must change nothing,
since the interval and the fence timeout are safe only as a pair. The controllers' side is in
tests/api/test_heartbeat_rule.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.agent.agent_timing import learned_timing

START = {"heartbeat_interval": 1.0, "fence_timeout": 5.0, "fence_kill_grace": 2.0}


def test_a_heartbeat_reply_lengthens_the_interval_and_fence_together() -> None:
    offered = {"heartbeat_interval": 3.3, "fence_timeout": 16.5, "node_down_timeout": 33.0}
    timing, bad = learned_timing(START, offered)
    assert bad == []
    assert timing == {**START, **offered}
    assert START["heartbeat_interval"] == 1.0  # the caller's dict is not changed in place


def test_a_registration_reply_is_taken_whole() -> None:
    offered = {
        "heartbeat_interval": 1.0,
        "fence_timeout": 5.0,
        "fence_kill_grace": 0,
        "lease_ttl": 3.0,
        "checkpoint_grace": 30.0,
    }
    timing, bad = learned_timing(START, offered)
    assert bad == [] and timing["fence_kill_grace"] == 0 and timing["lease_ttl"] == 3.0


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "2", None, [2.0]])
def test_a_bad_interval_changes_nothing(value: Any) -> None:
    offered = {"heartbeat_interval": value, "fence_timeout": 50.0}
    timing, bad = learned_timing(START, offered)
    assert bad == ["heartbeat_interval"]
    assert timing == START


def test_no_timing_changes_nothing_and_a_non_object_is_refused() -> None:
    assert learned_timing(START, None) == (START, [])
    assert learned_timing(START, [1, 2]) == (START, ["timing"])


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-5, max_value=10**6),
    st.booleans(),
    st.text(max_size=3),
)


@given(interval=NUMBERS, fence=NUMBERS, grace=NUMBERS)
def test_the_interval_and_fence_always_come_from_the_same_reply(
    interval: Any, fence: Any, grace: Any
) -> None:
    offered = {"heartbeat_interval": interval, "fence_timeout": fence, "fence_kill_grace": grace}
    timing, bad = learned_timing(START, offered)
    if bad:
        assert timing == START
    else:
        assert timing == offered
        assert timing["heartbeat_interval"] > 0 and timing["fence_timeout"] > 0
        assert timing["fence_kill_grace"] >= 0
