"""Node failures, end to end: a dead agent, a frozen agent, and a controller restart.

A node that stops heartbeating is DOWN after `node_down_timeout`; its requeue-able jobs run again
elsewhere (avoiding the failed node), the others end NODE_FAIL. Before that happens the job on
the silent node has been stopped by its shepherd (self-fencing), so two attempts never overlap.
A node that answers again is back in service by itself. A controller restart shorter than
`node_down_timeout` must not look like dead nodes.

The first two tests run with tightened (valid) timing so that they are fast; the last one with
the default node-down timeout, which is what the restart has to stay under.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx.faulthooks import FAULT_HOLD_REPLY_FILE
from system.harness import Cluster, alive, read_json, wait_for

pytestmark = pytest.mark.system

FAST = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
}


# ---------------------------------------------------------------------- helpers
def _job(cluster: Cluster, jid: int) -> dict[str, Any]:
    return cluster.client().job(jid)[0]


def _node(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.client().node(name)


def _node_events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return cluster.client().get("/v1/events", node=name, limit=10_000)["events"]


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


def _wait_go(go: Path) -> str:
    return f"while [ ! -e {go} ]; do sleep 0.2; done\n"


def _running_on(cluster: Cluster, jid: int, node: str) -> dict[str, Any]:
    job = cluster.wait_state(jid, "RUNNING")
    assert job["nodelist"] == node, job
    return job


def _task_of_attempt(cluster: Cluster, node: str, attempt_id: int) -> Path:
    return cluster.agent_dir(node) / "tasks" / str(attempt_id)


TICKER = """#!{python}
import os, time
path = {ticks!r}
attempt = os.environ["PHX_ATTEMPT_ID"]
while True:
    with open(path, "a") as f:
        f.write(f"tick {{attempt}} {{time.time():.6f}}\\n")
    time.sleep(0.1)
"""


def _ticks(path: Path) -> dict[int, list[float]]:
    """attempt id -> tick times, from the job's history file."""
    out: dict[int, list[float]] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and parts[0] == "tick":  # a line being written may be partial
            try:
                out.setdefault(int(parts[1]), []).append(float(parts[2]))
            except ValueError:
                continue
    return out


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(180)
def test_agent_sigkill_node_down_requeue_and_rejoin(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    cluster.start_agent("node01", cpus=4)
    go_a, go_filler = tmp_path / "go-a", tmp_path / "go-filler"
    # A: requeue-able; prints where each run happens, then waits for the test
    a = cluster.submit_script(
        tmp_path,
        "a",
        '#!/bin/bash\necho "run $SLURM_RESTART_COUNT on $SLURMD_NODENAME"\n' + _wait_go(go_a),
        requeue=True,
    )
    # B: not requeue-able; must end NODE_FAIL with its node
    b = cluster.submit_script(tmp_path, "b", "#!/bin/bash\nsleep 600\n", requeue=False)
    _running_on(cluster, a, "node01")
    _running_on(cluster, b, "node01")

    # node02 has one CPU, held by a filler until the test lets it go: the requeued job then
    # has to wait, which shows that it does not go back to node01 once node01 is back
    cluster.start_agent("node02", cpus=1)
    filler = cluster.submit_script(
        tmp_path,
        "filler",
        "#!/bin/bash\n" + _wait_go(go_filler),
        nodelist=["node02"],
    )
    _running_on(cluster, filler, "node02")

    agent = cluster.agent("node01")
    killed_at = time.time()
    agent.kill(signal.SIGKILL)

    down = wait_for(
        lambda: (n := _node(cluster, "node01"))["down"] and n,
        what="node01 to be DOWN",
        timeout=60,
    )
    assert down["state"] in ("DOWN", "DOWN+DRAIN"), down
    down_ev = [e for e in _node_events(cluster, "node01") if e["kind"] == "node.down"]
    assert len(down_ev) == 1, down_ev
    took = down_ev[0]["ts"] - killed_at
    timeout = FAST["node_down_timeout"]
    assert timeout - 1.5 <= took <= timeout + 5, f"node01 DOWN {took:.1f}s after the SIGKILL"

    # B ends NODE_FAIL; A is requeued (pending: node01 is down, node02 is full)
    jb = cluster.wait_terminal([b], timeout=60)[b]
    assert jb["state"] == "NODE_FAIL", _job(cluster, b)
    assert jb["restart_count"] == 0
    ja = wait_for(
        lambda: (j := _job(cluster, a))["restart_count"] == 1 and j["state"] == "PENDING" and j,
        what="job A to be requeued",
        timeout=60,
    )
    assert "job.requeue" in _kinds(cluster.client().job_events(a)), ja

    # the agent comes back: the node is in service again by itself (no `resume`)
    cluster.restart(agent)  # waits until node01 has registered again and is not DOWN
    back = _node(cluster, "node01")
    assert not back["down"] and not back["drain"], back
    kinds = _kinds(_node_events(cluster, "node01"))
    assert "node.up" in kinds[kinds.index("node.down") :], kinds
    assert "node.resume" not in kinds, kinds

    # A avoids node01 although node01 is idle: it waits for node02 (several scheduling passes)
    observe_until = time.monotonic() + 4.0
    while time.monotonic() < observe_until:
        j = _job(cluster, a)
        assert j["state"] == "PENDING", (
            f"job A did not wait for node02: {j['state']} on {j['nodelist']}"
        )
        time.sleep(0.25)
    assert _node(cluster, "node01")["state"] == "IDLE"

    go_filler.touch()
    assert cluster.wait_terminal([filler])[filler]["state"] == "COMPLETED"
    ja = _running_on(cluster, a, "node02")
    assert ja["restart_count"] == 1
    atts = ja["attempts"]
    assert [x["nodes"] for x in atts] == [["node01"], ["node02"]], atts
    assert atts[0]["result"] == "NODE_FAIL", atts[0]

    go_a.touch()
    done = cluster.wait_terminal([a])[a]
    assert done["state"] == "COMPLETED", _job(cluster, a)
    out = (tmp_path / f"a-{a}.out").read_text().splitlines()
    assert out == ["run 0 on node01", "run 1 on node02"], out


@pytest.mark.timeout(180)
def test_frozen_agent_job_fenced_before_requeue(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    cluster.start_agent("node01")
    ticks = tmp_path / "ticks"
    jid = cluster.submit_script(
        tmp_path,
        "ticker",
        TICKER.format(python=sys.executable, ticks=str(ticks)),
        requeue=True,
    )
    job = _running_on(cluster, jid, "node01")
    a1 = int(job["attempts"][0]["id"])
    wait_for(lambda: len(_ticks(ticks).get(a1, [])) >= 3, what="attempt 1 to tick")
    task1 = _task_of_attempt(cluster, "node01", a1)
    shepherd1 = cluster.shepherd_of(task1)
    assert shepherd1 is not None and alive(*shepherd1)
    cluster.start_agent("node02")

    agent = cluster.agent("node01")
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _node(cluster, "node01")["down"], what="node01 to be DOWN", timeout=60)
        job = wait_for(
            lambda: (
                (j := _job(cluster, jid))["state"] == "RUNNING" and j["restart_count"] == 1 and j
            ),
            what="the job to run again",
            timeout=60,
        )
        assert job["nodelist"] == "node02", job
        a2 = int(job["attempts"][-1]["id"])
        assert a2 != a1
        wait_for(lambda: len(_ticks(ticks).get(a2, [])) >= 3, what="attempt 2 to tick")
        # the shepherd (a process of its own, not frozen) fenced attempt 1: exit.json says so
        exit1 = read_json(task1 / "exit.json")
        assert exit1 is not None, "attempt 1 was not stopped on the frozen node"
        assert exit1["fenced"] is True, exit1
        assert not cluster.job_pid_alive(task1), "attempt 1 still runs on the frozen node"
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    before_cont = len(_ticks(ticks)[a1])

    history = _ticks(ticks)
    last1, first2 = max(history[a1]), min(history[a2])
    assert last1 < first2, f"attempts overlapped: attempt 1 ticked at {last1}, 2 at {first2}"
    assert exit1["ended_at"] <= first2, (exit1, first2)

    # the agent answers again: node01 is back by itself; attempt 1 stays dead
    back = wait_for(
        lambda: (n := _node(cluster, "node01"))["state"] == "IDLE" and n,
        what="node01 to return to service",
        timeout=60,
    )
    assert not back["down"] and not back["drain"], back
    kinds = _kinds(_node_events(cluster, "node01"))
    assert "node.up" in kinds[kinds.index("node.down") :], kinds
    assert "node.resume" not in kinds, kinds
    seen2 = len(_ticks(ticks)[a2])
    wait_for(
        lambda: len(_ticks(ticks)[a2]) >= seen2 + 20,
        what="attempt 2 to tick 20 more times",
    )
    assert len(_ticks(ticks)[a1]) == before_cont, "attempt 1 ticked again after SIGCONT"
    assert max(_ticks(ticks)[a1]) < first2
    job = _job(cluster, jid)
    assert job["state"] == "RUNNING" and job["restart_count"] == 1, job
    assert [x["nodes"] for x in job["attempts"]] == [["node01"], ["node02"]]
    cluster.client().cancel([jid])
    assert cluster.wait_terminal([jid])[jid]["state"] == "CANCELLED"


@pytest.mark.timeout(180)
def test_a_start_read_late_by_a_stopped_agent_never_runs(cluster: Cluster, tmp_path: Path) -> None:
    """Found by the chaos test: an agent stopped while the reply that started a job sat in
    its socket read that reply on waking, after its node had been declared DOWN and the job
    requeued elsewhere, and ran the job a second time beside its new attempt. A reply read
    past its request's timeout is now dropped, and the fence is never dated by a late reading.

    SIGSTOP cannot be timed to land between a reply's sending and its reading, so the agent's
    test-only fault hook holds the reply that starts work instead, as long as a file exists."""
    cluster.timing.update(FAST)
    cluster.start_controller()
    hold = tmp_path / "hold-replies"
    hold.touch()
    cluster.start_agent("node01", env={FAULT_HOLD_REPLY_FILE: str(hold)})
    runs = tmp_path / "runs"
    jid = cluster.submit_script(
        tmp_path,
        "once",
        f'#!/bin/bash\necho "start $PHX_ATTEMPT_ID $SLURMD_NODENAME" >> {runs}\nsleep 2\n',
        requeue=True,
    )
    log = cluster.logs / "agent-node01.log"
    wait_for(
        lambda: "holding a reply that starts work" in log.read_text(),
        what="node01's agent to hold the reply that starts the job",
    )
    a1 = int(_job(cluster, jid)["attempts"][0]["id"])
    wait_for(lambda: _node(cluster, "node01")["down"], what="node01 to be DOWN", timeout=60)
    wait_for(
        lambda: _job(cluster, jid)["restart_count"] == 1,
        what="the job to be requeued",
        timeout=60,
    )
    cluster.start_agent("node02")
    a2 = int(_running_on(cluster, jid, "node02")["attempts"][-1]["id"])
    assert a2 != a1
    wait_for(lambda: runs.exists() and f"start {a2} node02" in runs.read_text(), what="run 2")

    hold.unlink()  # node01's agent reads the held reply now, long past its timeout
    wait_for(
        lambda: (n := _node(cluster, "node01"))["state"] == "IDLE" and not n["down"],
        what="node01 to return to service",
        timeout=60,
    )
    done = cluster.wait_terminal([jid])[jid]
    assert done["state"] == "COMPLETED", _job(cluster, jid)
    # before the fix: ["start 2 node02", "start 1 node01"], the job ran twice at once
    assert runs.read_text().splitlines() == [f"start {a2} node02"]
    dropped = [ln for ln in log.read_text().splitlines() if "dropped a heartbeat reply" in ln]
    assert dropped and f"[{a1}]" in dropped[0], dropped
    attempts = _job(cluster, jid)["attempts"]
    assert [x["nodes"] for x in attempts] == [["node01"], ["node02"]], attempts


@pytest.mark.timeout(180)
def test_controller_restart_declares_no_node_down(cluster: Cluster, tmp_path: Path) -> None:
    node_down_timeout = 10.0
    cluster.timing.update({"node_down_timeout": node_down_timeout})  # the default
    cluster.start(nodes=2, cpus=2)
    jobs = [
        cluster.submit_script(tmp_path, f"long{i}", "#!/bin/bash\nsleep 600\n", cpus_per_task=2)
        for i in range(2)
    ]
    for jid in jobs:
        cluster.wait_state(jid, "RUNNING")
    assert {_job(cluster, j)["nodelist"] for j in jobs} == {"node01", "node02"}
    tasks = [d for j in jobs for d in cluster.task_dirs_of(j)]
    assert len(tasks) == 2
    last_event = max((e["id"] for e in cluster.client().events(limit=10_000)), default=0)

    ctl = cluster.controller
    ctl.kill(signal.SIGKILL)
    # the control plane is away for most of the node-down timeout (and longer than the fence
    # timeout, 5 s), plus the time the restart itself takes
    time.sleep(node_down_timeout * 0.7)
    cluster.restart(ctl)
    restarted = time.time()

    def holds_cluster_duty() -> bool:
        leases = cluster.client().cluster()["this_controller"]["leases"]
        return leases.get("cluster") is not None

    wait_for(holds_cluster_duty, what="the restarted controller to take the cluster duty")
    since = time.monotonic()

    def no_harm_done() -> bool:
        events = cluster.client().events(since=last_event, limit=10_000)
        bad = [e for e in events if e["kind"] in ("node.down", "job.requeue")]
        assert not bad, f"the controller restart did harm: {bad}"
        for jid in jobs:
            j = _job(cluster, jid)
            assert j["state"] == "RUNNING" and j["restart_count"] == 0, j
            assert len(j["attempts"]) == 1, j["attempts"]
        for d in tasks:
            assert not (d / "exit.json").exists(), read_json(d / "exit.json")
        nodes = {n["name"]: n for n in cluster.client().nodes()}
        assert all(not n["down"] for n in nodes.values()), nodes
        # judge only once the new controller could have declared a node DOWN, with slack
        return time.monotonic() - since > node_down_timeout + 3

    wait_for(no_harm_done, what="a full node-down timeout after the restart", interval=0.5)
    beats = {n["name"]: n["last_heartbeat"] for n in cluster.client().nodes()}
    assert all(t > restarted for t in beats.values()), beats
    cluster.client().cancel(jobs)
    ends = cluster.wait_terminal(jobs)
    assert {j["state"] for j in ends.values()} == {"CANCELLED"}
