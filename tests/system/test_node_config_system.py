"""Node configuration delivered from the versioned cluster configuration (Slurm's configless
mode), end to end: an agent started without a node file takes its prolog from `[nodes]` of
the version in force; that prolog exits 1, so the node is drained and the job requeued
without a retry spent (as with a node file's prolog); `phalanx config apply` of a version
without the prolog reaches the same agent process with a heartbeat reply, and once the node
is resumed the job runs there, with no prolog. `phalanx nodes` and `phalanx show node` show
the version the agent runs, and the node as behind while its (stopped) agent has not taken
the new one."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from system.harness import Cluster, run_cli, wait_for

pytestmark = pytest.mark.system

FAST = {"heartbeat_interval": 0.5}


def config(cluster: Cluster, *args: str) -> str:
    p = run_cli(["config", *args], url=cluster.url, root=cluster.root)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def nodes(cluster: Cluster) -> str:
    p = run_cli(["nodes"], url=cluster.url, root=cluster.root)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.timeout(240)
def test_an_agent_without_a_node_file_runs_the_versioned_prolog_and_a_new_version_without_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    bad = tmp_path / "bad-prolog.sh"
    bad.write_text("#!/bin/sh\necho 'ERROR: /scratch is not mounted'\nexit 1\n")
    bad.chmod(0o755)
    base = config(cluster, "show")
    with_prolog = tmp_path / "with-prolog.toml"
    with_prolog.write_text(f'{base}\n[nodes]\nprolog = {{ path = "{bad}", timeout = 20 }}\n')
    said = config(cluster, "apply", str(with_prolog), "--yes", "-m", "site prolog")
    assert "cluster configuration version 2 applied" in said, said

    agent = cluster.start_agent("node01")  # no --health-config: nothing but how to reach us
    log = cluster.logs / "agent-node01.log"
    wait_for(
        lambda: "runs the node configuration of cluster version 2" in log.read_text(),
        what="the agent to take version 2's node configuration",
    )
    ran = tmp_path / "ran"
    jid = cluster.submit_script(
        tmp_path, "work", f'#!/bin/bash\necho "$SLURMD_NODENAME" >> {ran}\n'
    )
    node = wait_for(
        lambda: (n := cluster.client().node("node01"))["drain"] and n,
        what="node01 to be drained by the versioned prolog",
    )
    assert node["drain_by"] == "prolog", node
    assert "ERROR: /scratch is not mounted" in node["drain_reason"], node
    job = cluster.wait_state(jid, "PENDING")
    assert job["retries"] == 0 and not ran.exists(), job

    # the version it runs is shown with the node (its heartbeats say it)
    wait_for(
        lambda: cluster.client().node("node01")["config_version"] == 2,
        what="node01 to show that it runs version 2",
    )
    shown = next(x for x in nodes(cluster).splitlines() if x.startswith("node01 "))
    assert re.search(r"\s2\s", shown), shown
    assert "behind" not in shown, shown

    # a version without the prolog: the same agent process takes it from a heartbeat reply;
    # while it is stopped (well within node_down_timeout) the node shows as behind
    pid = agent.pid
    without = tmp_path / "without-prolog.toml"
    without.write_text(base)
    os.kill(pid, signal.SIGSTOP)
    try:
        said = config(cluster, "apply", str(without), "--yes", "-m", "no prolog")
        assert "cluster configuration version 3 applied" in said, said
        view = cluster.client().node("node01")
        assert (view["config_version"], view["config_behind"]) == (2, True), view
        assert "2 (behind 3)" in nodes(cluster)
        p = run_cli(["show", "node", "node01"], url=cluster.url, root=cluster.root)
        assert "ConfigVersion=2 (behind 3)" in p.stdout, p.stdout + p.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(
        lambda: "runs the node configuration of cluster version 3" in log.read_text(),
        what="the agent to take version 3's node configuration without a restart",
    )
    wait_for(
        lambda: (
            (v := cluster.client().node("node01"))["config_version"] == 3 and not v["config_behind"]
        ),
        what="node01 to show version 3",
    )
    assert agent.pid == pid and agent.running()
    assert "prolog: " in log.read_text().split("cluster version 3: ", 1)[1].splitlines()[0]

    resumed = run_cli(["resume", "node01"], url=cluster.url, root=cluster.root)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    done = cluster.wait_terminal([jid])[jid]
    assert done["state"] == "COMPLETED", cluster.client().job(jid)
    assert ran.read_text().split() == ["node01"]
    assert not cluster.client().node("node01")["drain"]
