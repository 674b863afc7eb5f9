"""The heartbeat rule applied by a running cluster (docs/sim.md, "The heartbeat rule").

A budget of 1 heartbeat/s makes 2 nodes too many for the configured 1 s interval: the
controller lengthens the interval to 2 s, the fence timeout to 10 s and the failure-detection
timeout to 20 s once the second node has registered, and the real agents take the new values
from their heartbeat replies. A job launched afterwards fences on the longer timeout, which
the detector's (20 s) still outlasts. The arithmetic and the detector's side are in
tests/api/test_heartbeat_rule.py and tests/unit/test_agent_timing.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from phalanx.agent import shepherd_files
from system.harness import Cluster, read_json, wait_for

pytestmark = pytest.mark.system


def test_agents_take_longer_timings_when_the_cluster_outgrows_its_budget(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster(timing={"heartbeat_budget": 1.0})
    cluster.start(nodes=2, cpus=1)

    def controller_timing() -> dict | None:
        status = cluster.client().get("/v1/cluster")["this_controller"]
        return status["timing"] if status["timing_nodes"] == 2 else None

    timing = wait_for(controller_timing, what="the controller to scale for 2 nodes")
    assert (
        timing["heartbeat_interval"],
        timing["fence_timeout"],
        timing["node_down_timeout"],
    ) == (2.0, 10.0, 20.0)
    assert "heartbeat rule: 2 nodes at 1 heartbeats/s: heartbeat every 2s" in (
        cluster.controller.log.read_text()
    )
    for node in cluster.node_names(2):
        log = cluster.agent(node).log
        wait_for(
            lambda log=log: (
                "heartbeat every 2s, fence_timeout 10s (from the controller)" in log.read_text()
            ),
            what=f"{node}'s agent to take the 2 s interval",
        )

    job = cluster.submit_script(tmp_path, "long", "#!/bin/sh\nsleep 300\n")
    cluster.wait_state(job, "RUNNING")
    (task_dir,) = cluster.task_dirs_of(job)
    spec = read_json(task_dir / shepherd_files.SPEC_FILE)
    assert spec is not None
    assert spec["fence"]["timeout_s"] == 10.0  # the scaled fence, not the configured 5 s
    cluster.client().cancel([job])
    cluster.wait_state(job, "CANCELLED")
    assert not any(cluster.client().node(n)["down"] for n in cluster.node_names(2))
