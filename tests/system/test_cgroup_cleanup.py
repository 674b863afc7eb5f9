"""An agent that stops cleanly leaves no cgroup of its own behind (agent/cgroup_roots.py).

Each agent makes ``<base>/phalanx/<node>-<hash of its state dir>`` in every cgroup hierarchy
it uses; with a fresh state dir per test run, a root left behind is a leak per node and
hierarchy.  A clean stop (SIGTERM) removes the root where it is empty; one with a running job
beneath stays, and the restarted agent carries on with it.  Needs root and usable cgroups
(memory and pids, v1 or v2); skipped otherwise, with the reason.

The controller's fence and node-down timeouts are long, so a slow restart on a loaded machine
tests the agent, not self-fencing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from phalanx.agent import cgroup_roots, cgroups
from system.harness import Cluster, agent_cgroup_roots, cgroup_layout, wait_for

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)"),
]

NODE = "node01"
TIMING = {"fence_timeout": 30.0, "node_down_timeout": 40.0}


@pytest.fixture
def layout() -> cgroups.Layout:
    """This host's cgroups as an agent started by this test sees them (it inherits ours)."""
    found = cgroup_layout()
    if found is None:
        pytest.skip(f"cgroups not usable here: {cgroups.detect().describe()}")
    return found


def roots(cluster: Cluster, layout: cgroups.Layout) -> list[str]:
    """The node's roots, one per hierarchy (v2: one)."""
    return agent_cgroup_roots(layout, cluster.agent_dir(NODE), NODE)


def present(dirs: list[str]) -> list[str]:
    return [d for d in dirs if os.path.isdir(d)]


def start(cluster: Cluster) -> None:
    cluster.timing.update(TIMING)
    cluster.start_controller()
    cluster.start_agent(NODE)


def submit(cluster: Cluster, tmp_path: Path, body: str) -> int:
    return cluster.submit_script(tmp_path, "cg", "#!/bin/sh\n" + body, time_limit_s=300)


def stop_agent(cluster: Cluster) -> None:
    """SIGTERM: the agent's clean stop (jobs keep running)."""
    d = cluster.agent(NODE)
    d.kill(signal.SIGTERM, timeout=60)
    assert d.proc is not None and d.proc.returncode == 0, d.proc.returncode if d.proc else None


def test_clean_stop_removes_the_nodes_own_cgroups(
    cluster: Cluster, tmp_path: Path, layout: cgroups.Layout
) -> None:
    start(cluster)
    mine = roots(cluster, layout)
    name = cgroup_roots.cgroup_name(NODE, cluster.agent_dir(NODE))
    assert present(mine) == mine, "the agent makes its root in every hierarchy it uses"
    jid = submit(cluster, tmp_path, "grep -c phalanx/ /proc/self/cgroup\n")
    assert cluster.wait_terminal([jid])[jid]["state"] == "COMPLETED"
    assert int((tmp_path / f"cg-{jid}.out").read_text().split()[0]) >= 1, "contained"
    assert present(mine) == mine

    stop_agent(cluster)
    assert present(mine) == [], "a clean stop removes the node's empty roots"
    assert cgroup_roots.recorded(cluster.agent_dir(NODE), name) == mine, "remembered"
    # other agents' roots (and the shared `phalanx` directory) are not the agent's to remove
    assert all(os.path.isdir(os.path.dirname(d)) for d in mine)


def test_a_running_job_keeps_the_root_and_the_restarted_agent_carries_on(
    cluster: Cluster, tmp_path: Path, layout: cgroups.Layout
) -> None:
    start(cluster)
    mine = roots(cluster, layout)
    go = tmp_path / "go"
    jid = submit(cluster, tmp_path, f"while [ ! -e {go} ]; do sleep 0.1; done\necho done\n")
    task = wait_for(
        lambda: next((d for d in cluster.task_dirs_of(jid) if cluster.job_pid_alive(d)), None),
        what=f"job {jid} to run",
    )
    spec = json.loads((task / "spec.json").read_text())
    attempt = list(spec["cgroup"]["dirs"])  # only the hierarchies it is limited in
    assert attempt and all(os.path.dirname(d) in mine for d in attempt), attempt
    assert present(attempt) == attempt

    stop_agent(cluster)
    holding = sorted({os.path.dirname(d) for d in attempt})
    assert sorted(present(holding)) == holding, "a root with a running job beneath stays"
    assert present(attempt) == attempt
    assert cluster.job_pid_alive(task), "the job runs on without its agent"
    # (roots of hierarchies the job is not limited in, cpu or devices, were empty: gone)

    cluster.restart(cluster.agent(NODE))
    assert present(mine) == mine, "the restarted agent has its roots again"
    go.touch()
    assert cluster.wait_terminal([jid])[jid]["state"] == "COMPLETED"
    assert (tmp_path / f"cg-{jid}.out").read_text().strip() == "done"
    wait_for(lambda: present(attempt) == [], what="the ended attempt's cgroups to go")

    # a shepherd lost while the agent is down leaves its attempt's cgroups: the restarted
    # agent sweeps them as before, and its clean stop then removes the roots
    stray = [f"{d}/999999" for d in mine]
    for d in stray:
        os.mkdir(d)
    try:
        stop_agent(cluster)
        assert present(stray) == [], "cgroups of attempts it does not run are swept"
        assert present(mine) == []
    finally:
        for d in stray:
            with contextlib.suppress(OSError):
                os.rmdir(d)
