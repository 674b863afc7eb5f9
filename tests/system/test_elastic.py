"""Elastic jobs and hot spares, end to end with real processes.

An elastic job (`--nodes=4-8`) starts on every free node up to its maximum. When one of its
nodes dies (the agent, its shepherds and the job's processes SIGKILLed, as a power loss would),
the node is marked DOWN and the job restarts at once on the survivors: PHX_NNODES tells it its
new size, and a competing job that waits in the queue (with a higher priority) does not get the
survivors. A job with a hot spare (`--spares=1`) holds one more node that runs nothing; when a
rank's node dies the spare takes that rank, the other ranks stay where they were, and again no
queue wait. Both restarts use no retry and show as `job.restart` events, not `job.requeue`.

Timing is tightened (a valid set) so the failure is detected within seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, read_json, run_cli, wait_for

pytestmark = pytest.mark.system

FAST = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
    "kill_wait": 2.0,
    "restart_reservation": 30.0,
}

# Every rank of every attempt appends one line, then waits to be stopped.
RECORDER = """#!/bin/bash
echo "$PHX_RESTART_COUNT $PHX_NODE_RANK $PHX_NNODES $SLURM_NNODES $SLURM_JOB_NUM_NODES \
$PHX_NODENAME $PHX_NODELIST" >> {record}
sleep 600
"""


def _job(cluster: Cluster, jid: int) -> dict[str, Any]:
    return cluster.client().job(jid)[0]


def _records(path: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """restart count -> rank -> what that rank saw."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) != 7:
            continue  # a line being written
        restart, rank, nn, snn, snum, node, nodelist = parts
        out.setdefault(int(restart), {})[int(rank)] = {
            "nnodes": int(nn),
            "slurm_nnodes": int(snn),
            "slurm_num_nodes": int(snum),
            "node": node,
            "nodelist": nodelist,
        }
    return out


def _all_ranks(path: Path, restart: int, n: int) -> dict[int, dict[str, Any]] | None:
    got = _records(path).get(restart, {})
    return got if sorted(got) == list(range(n)) else None


def _kill_node(cluster: Cluster, node: str) -> float:
    """SIGKILL the node's agent, its shepherds and its jobs' process groups; return when."""
    agent = cluster.agent(node)
    killed_at = time.time()
    agent.kill(signal.SIGKILL)
    for d in cluster.task_dirs(node):
        shep = cluster.shepherd_of(d)
        if shep is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shep[0], signal.SIGKILL)
        info = read_json(d / "job.json")
        if info and isinstance(info.get("pgid"), int):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(info["pgid"], signal.SIGKILL)
    return killed_at


def _kinds(cluster: Cluster, jid: int) -> list[str]:
    return [e["kind"] for e in cluster.client().job_events(jid)]


def _restarted(cluster: Cluster, jid: int) -> dict[str, Any] | None:
    j = _job(cluster, jid)
    return j if j["state"] == "RUNNING" and j["restart_count"] == 1 else None


def _no_queue_wait(cluster: Cluster, jid: int) -> None:
    """The restart was placed by the first scheduling pass after the job became PENDING."""
    evs = cluster.client().job_events(jid)
    restart = next(e for e in evs if e["kind"] == "job.restart")
    starting = [e for e in evs if e["kind"] == "job.starting" and e["id"] > restart["id"]]
    assert starting, evs
    waited = starting[0]["ts"] - restart["ts"]
    assert waited < 3.0, f"the restart waited {waited:.1f}s for a placement"
    assert "job.requeue" not in [e["kind"] for e in evs], evs


@pytest.mark.timeout(240)
def test_elastic_job_continues_on_the_survivors(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start(nodes=8, cpus=1, mem="1G")
    record = tmp_path / "record"
    jid = cluster.submit_script(
        tmp_path,
        "elastic",
        RECORDER.format(record=record),
        nodes=4,
        nodes_max=8,
        requeue=True,
        mem_mb=100,
        all_nodes=True,  # every rank runs the script (torchrun without srun)
    )
    job = cluster.wait_state(jid, "RUNNING")
    first = wait_for(lambda: _all_ranks(record, 0, 8), what="8 ranks of attempt 0")
    assert {r["nnodes"] for r in first.values()} == {8}, first
    assert {r["slurm_nnodes"] for r in first.values()} == {8}
    assert {r["slurm_num_nodes"] for r in first.values()} == {8}
    assert [first[i]["node"] for i in range(8)] == cluster.node_names(8)
    assert job["nodes_alloc"] == 8, job

    # a competitor with a higher priority waits for a node; every node is busy
    rival = cluster.submit_script(
        tmp_path, "rival", "#!/bin/bash\nsleep 600\n", priority=1000, mem_mb=100
    )
    wait_for(
        lambda: (j := _job(cluster, rival))["state"] == "PENDING" and j["reason"] == "Resources",
        what="the rival to wait for resources",
    )

    killed_at = _kill_node(cluster, "node03")
    wait_for(lambda: cluster.client().node("node03")["down"], what="node03 DOWN", timeout=60)
    job = wait_for(lambda: _restarted(cluster, jid), what="the restart", timeout=90)
    survivors = [n for n in cluster.node_names(8) if n != "node03"]
    second = wait_for(lambda: _all_ranks(record, 1, 7), what="7 ranks of attempt 1")
    # the survivors kept their order: ranks 0..6 on node01, node02, node04, ..., node08
    assert [second[i]["node"] for i in range(7)] == survivors, second
    assert {r["nnodes"] for r in second.values()} == {7}, second
    assert {r["slurm_nnodes"] for r in second.values()} == {7}
    assert {r["slurm_num_nodes"] for r in second.values()} == {7}
    assert job["attempts"][-1]["nodes"] == survivors
    assert job["restart_count"] == 1 and job["nodes_alloc"] == 7
    print(f"elastic: running again on 7 nodes {job['start_time'] - killed_at:.1f}s after the kill")

    # the rival (higher priority, waiting the whole time) did not get a survivor
    r = _job(cluster, rival)
    assert r["state"] == "PENDING", r
    _no_queue_wait(cluster, jid)
    assert "job.restart" in _kinds(cluster, jid)

    cluster.client().cancel([jid])
    # the nodes go to the rival now
    assert cluster.wait_terminal([jid])[jid]["state"] == "CANCELLED"
    cluster.wait_state(rival, "RUNNING")
    cluster.client().cancel([rival])
    cluster.wait_terminal([rival])


@pytest.mark.timeout(240)
def test_spare_takes_the_failed_rank(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start(nodes=4, cpus=1, mem="1G")
    record = tmp_path / "record"
    jid = cluster.submit_script(
        tmp_path,
        "spare",
        RECORDER.format(record=record),
        nodes=3,
        spares=1,
        requeue=True,
        mem_mb=100,
        all_nodes=True,  # every rank runs the script (torchrun without srun)
    )
    cluster.wait_state(jid, "RUNNING")
    first = wait_for(lambda: _all_ranks(record, 0, 3), what="3 ranks of attempt 0")
    assert [first[i]["node"] for i in range(3)] == ["node01", "node02", "node03"], first
    assert {r["nnodes"] for r in first.values()} == {3}
    job = _job(cluster, jid)
    assert job["spare_nodes"] == ["node04"] and job["spares"] == 1, job
    # the spare's node holds the job's resources but runs nothing
    spare = cluster.client().node("node04")
    assert spare["spare_for"] == [jid] and spare["cpus_alloc"] == 1, spare
    assert cluster.task_dirs("node04") == []
    nodes_out = run_cli(["nodes"], url=cluster.url, root=cluster.root)
    assert f"spare for job {jid}" in nodes_out.stdout, nodes_out.stdout
    show = run_cli(["show", str(jid)], url=cluster.url, root=cluster.root)
    assert "Spares=node04" in show.stdout, show.stdout
    assert "NodeSeconds=" in show.stdout, show.stdout

    rival = cluster.submit_script(
        tmp_path, "rival", "#!/bin/bash\nsleep 600\n", priority=1000, mem_mb=100
    )
    wait_for(
        lambda: (j := _job(cluster, rival))["state"] == "PENDING" and j["reason"] == "Resources",
        what="the rival to wait for resources",
    )

    killed_at = _kill_node(cluster, "node02")
    job = wait_for(lambda: _restarted(cluster, jid), what="the restart", timeout=90)
    second = wait_for(lambda: _all_ranks(record, 1, 3), what="3 ranks of attempt 1")
    # rank layout kept: ranks 0 and 2 stay, the spare took rank 1
    assert [second[i]["node"] for i in range(3)] == ["node01", "node04", "node03"], second
    assert {r["nnodes"] for r in second.values()} == {3}
    assert job["attempts"][-1]["nodes"] == ["node01", "node04", "node03"]
    assert job["spare_nodes"] == []  # no free node left to be the new spare
    print(f"spare: running again {job['start_time'] - killed_at:.1f}s after the kill")
    assert _job(cluster, rival)["state"] == "PENDING"
    _no_queue_wait(cluster, jid)

    # accounting: the spare's node time is charged to the job
    job = _job(cluster, jid)
    assert job["spare_node_seconds"] > 0 and job["node_seconds"] > job["spare_node_seconds"]

    cluster.client().cancel([jid, rival])
    cluster.wait_terminal([jid, rival])
