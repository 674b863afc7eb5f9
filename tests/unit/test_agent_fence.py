"""What a controller's reply lets the agent write into its fence file (agent.fence_mark).

The controller counts a node's silence from a heartbeat's arrival; the agent's shepherds count
theirs from the fence file's time. A reply read long after its request (the agent was stopped
with it in its socket) must not date the fence by its reading, or jobs outlive the moment their
node is declared DOWN. The end-to-end case is in tests/system/test_node_failure.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from phalanx.agent.agent import Agent
from phalanx.agent.agent_timing import fence_mark, reply_is_late
from phalanx.agent.resources import NodeResources
from phalanx.client import Client

WALL = 1_700_000_000.0  # a wall-clock instant, in the past
MONO = 5_000.0  # the monotonic clock at that instant


def test_a_reply_read_in_time_dates_the_fence_at_its_reading() -> None:
    # sent 0.7 s ago with a 1.5 s timeout (a long-poll of 1 s plus its grace)
    assert fence_mark(WALL, MONO, MONO - 0.7, 1.5) == WALL
    assert not reply_is_late(0.7, 1.5)


def test_a_reply_read_late_dates_the_fence_at_most_a_timeout_after_its_sending() -> None:
    # sent 30 s ago (the agent was stopped for about 29 s with the reply in its socket)
    assert fence_mark(WALL, MONO, MONO - 30.0, 1.5) == WALL - 30.0 + 1.5
    assert reply_is_late(30.0, 1.5)


def test_a_registration_dates_the_fence_at_its_sending() -> None:
    assert fence_mark(WALL, MONO, MONO - 0.2, 0.0) == WALL - 0.2


@given(
    ago=st.floats(min_value=0.0, max_value=1e6),
    timeout=st.floats(min_value=0.0, max_value=1e4),
)
def test_the_mark_is_never_past_the_reading_nor_past_sending_plus_timeout(
    ago: float, timeout: float
) -> None:
    mark = fence_mark(WALL, MONO, MONO - ago, timeout)
    assert mark <= WALL
    assert mark <= WALL - ago + timeout + 1e-6  # float rounding of the two sums
    if not reply_is_late(ago, timeout):
        assert mark == WALL


def test_the_fence_file_never_goes_back(tmp_path: Path) -> None:
    """The poller and the watcher both heartbeat: the older vouching must not undo a newer."""
    client = Client("http://127.0.0.1:9")  # never called
    agent = Agent(
        name="n1",
        state_dir=tmp_path / "state",
        client=client,
        resources=NodeResources(cpus=1, mem_mb=1024),
    )
    agent.fence_file.parent.mkdir(parents=True)
    try:
        agent._freshen_fence_file(WALL)
        assert os.stat(agent.fence_file).st_mtime == WALL
        agent._freshen_fence_file(WALL - 10.0)
        assert os.stat(agent.fence_file).st_mtime == WALL
        agent._freshen_fence_file(WALL + 2.5)
        assert os.stat(agent.fence_file).st_mtime == WALL + 2.5
        # a time ahead of the clock (the clock was stepped back) does not hold the file there
        ahead = time.time() + 3600
        agent._freshen_fence_file(ahead)
        agent._freshen_fence_file(WALL)
        assert os.stat(agent.fence_file).st_mtime == WALL
    finally:
        client.close()
