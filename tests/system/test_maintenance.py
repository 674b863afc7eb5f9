"""A maintenance window, end to end, with real controller, agents, shepherds and jobs.

Three one-job nodes. A requeue-able job runs on node01 when a window on node[01-02] is added a
few seconds ahead (short windows and a 3 s `maint_lead` keep the test fast). Then:

- a job whose time limit would cross the window starts on node03, outside it; the next one
  waits, and its pending reason names the maintenance; a job short enough to end before the
  window may still use a window node;
- the running job gets its checkpoint signal (a bash `trap ... USR1` writes a marker) about the
  lead time before the window, is stopped at the window's start (not a fixed grace later) and
  requeued, spending no retry;
- during the window both nodes are drained by it; an operator drains node02 meanwhile;
- after the window node01 returns (node02 keeps the operator's drain) and the requeued job
  runs again there and completes.
"""

from __future__ import annotations

import getpass
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from phalanx.cli import render
from system.harness import Cluster, run_cli, wait_for

pytestmark = pytest.mark.system

TIMING = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
    "kill_wait": 2.0,
    "maint_lead": 3.0,
}
LEAD = TIMING["maint_lead"]
PATH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
START_IN = 15  # seconds from adding the window to its start
LENGTH = 6  # seconds the window lasts

VICTIM = """#!/bin/bash
trap 'date +%s.%N >> {marker}; echo "USR1 on $SLURMD_NODENAME"' USR1
echo "run $SLURM_RESTART_COUNT on $SLURMD_NODENAME"
if [ "$SLURM_RESTART_COUNT" -ge 1 ]; then exit 0; fi
while true; do sleep 0.2; done
"""
HOLD = "#!/bin/bash\nwhile [ ! -e {go} ]; do sleep 0.2; done\n"


def submit(cluster: Cluster, tmp_path: Path, name: str, script: str, limit: int) -> int:
    return cluster.submit_script(
        tmp_path,
        name,
        script,
        time_limit_s=limit,
        cpus_per_task=2,  # a whole node each
        requeue=True,
        env=dict(PATH_ENV),
    )


def text_of(table: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    return out.getvalue()


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


@pytest.mark.timeout(240)
def test_maintenance_window_end_to_end(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(TIMING)
    cluster.start(nodes=3, cpus=2)
    c = cluster.client()
    marker = tmp_path / "usr1"
    go = tmp_path / "go"
    victim = submit(cluster, tmp_path, "victim", VICTIM.format(marker=marker), 600)
    assert cluster.wait_state(victim, "RUNNING")["nodelist"] == "node01"

    res = run_cli(
        [
            "maint",
            "add",
            "--nodes",
            "node[01-02]",
            "--start",
            f"now+{START_IN}",
            "--duration",
            f"{LENGTH}s",
            "--reason",
            "switch swap",
            "--json",
        ],
        url=cluster.url,
        root=cluster.root,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    w = json.loads(res.stdout)
    wid, start, end = w["id"], w["start"], w["end"]
    assert w["nodes"] == "node[01-02]" and w["state"] == "scheduled", w
    assert end - start == pytest.approx(LENGTH)

    # placement: a job that would cross the window runs outside it; the next one waits
    crossing = submit(cluster, tmp_path, "crossing", HOLD.format(go=go), 600)
    assert cluster.wait_state(crossing, "RUNNING")["nodelist"] == "node03"
    waiting = submit(cluster, tmp_path, "waiting", HOLD.format(go=go), 600)
    job = wait_for(
        lambda: (j := c.job(waiting)[0])["reason"] and j["reason"].startswith("Maintenance") and j,
        what="the waiting job's reason to name the maintenance",
    )
    assert job["state"] == "PENDING", job
    assert "nodes node[01-02] have maintenance at " in job["reason"], job["reason"]
    assert f"(window {wid})" in job["reason"], job["reason"]
    # a job short enough to end before the window may use a window node (or waits past it)
    short = submit(cluster, tmp_path, "short", "#!/bin/bash\nsleep 0.5\n", 2)
    # `phalanx nodes` and `show node` show the window (rendered here: a CLI process costs
    # seconds on a busy machine, and the window is only seconds away)
    assert time.time() < start, "too slow to see the window before it starts"
    table = text_of(render.nodes_table(c.nodes()))
    assert f"maintenance {wid} at" in table, table
    shown = render.node_detail(c.node("node02"))
    assert f"Maintenance={wid} State=scheduled" in shown, shown

    # the running job is told a lead time before the window, stopped at its start, requeued
    wait_for(lambda: marker.exists() and marker.read_text().strip(), what="the USR1 marker")
    signalled = float(marker.read_text().split()[0])
    # at least the lead (at most one cluster tick, 1 s here, more), give or take the heartbeat
    assert start - LEAD - 1.5 <= signalled < start, (signalled - start, w)
    assert signalled <= start - LEAD + 2.0, f"signalled {start - signalled:.2f}s before the start"
    job = wait_for(
        lambda: (j := c.job(victim)[0])["restart_count"] == 1 and j,
        timeout=START_IN + 30,
        what="the victim to be requeued",
    )
    first = job["attempts"][0]
    assert first["stop_reason"].startswith(f"requeue: maintenance {wid} (switch swap)"), first
    assert start - 0.5 <= first["end_time"] <= start + 4.0, (first["end_time"] - start, first)
    assert job.get("retries", 0) == 0, job  # a planned requeue spends no retry
    assert "maint.signal" in kinds(c.job_events(victim))
    print(
        f"signal {start - signalled:.2f}s before the window (lead {LEAD:g}s); "
        f"attempt ended {first['end_time'] - start:+.2f}s from its start"
    )

    # during the window its nodes are drained by it; an operator takes node02 over
    for name in ("node01", "node02"):
        node = wait_for(
            lambda name=name: (n := c.node(name))["drain_by"] == f"maint:{wid}" and n,
            what=f"{name} drained by the window",
        )
        assert node["drain_reason"].startswith(f"maintenance {wid}: switch swap until "), node
        assert time.time() < end + 1.0  # drained while the window lasts, not after it
    c.drain("node02", "cable check")

    # after the window node01 returns by itself, node02 keeps the operator's drain
    wait_for(
        lambda: [x["state"] for x in c.maintenance(all=True) if x["id"] == wid] == ["done"],
        timeout=LENGTH + 30,
        what="the window to end",
    )
    assert not c.node("node01")["drain"]
    node02 = c.node("node02")
    assert node02["drain"] and node02["drain_by"] == getpass.getuser(), node02
    assert node02["drain_reason"] == "cable check"
    assert c.node("node03")["jobs"] == [crossing]

    # the requeued job runs again on node01, after the window, and completes
    done = cluster.wait_terminal([victim])[victim]
    assert done["state"] == "COMPLETED", c.job(victim)[0]
    second = c.job(victim)[0]["attempts"][1]
    assert second["nodes"] == ["node01"] and second["start_time"] >= end, second
    out = (tmp_path / f"victim-{victim}.out").read_text().splitlines()
    assert out[0] == "run 0 on node01" and "run 1 on node01" in out, out

    # no job whose time limit crosses the window ran on its nodes during it
    short_job = cluster.wait_terminal([short])[short]
    assert short_job["state"] == "COMPLETED", c.job(short)[0]
    for a in c.job(short)[0]["attempts"]:
        if set(a["nodes"]) & {"node01", "node02"}:
            # placed only if it ends before the start (the start is reported a moment later)
            assert a["start_time"] + 2 <= start + 1.5 or a["start_time"] >= end, a

    all_kinds = kinds(c.events(limit=10_000))
    for k in ("maint.add", "maint.signal", "maint.start", "maint.end"):
        assert k in all_kinds, k
    listed = run_cli(["maint", "list", "--all"], url=cluster.url, root=cluster.root)
    assert "done" in listed.stdout, listed.stdout

    # the CLI refuses a bad window with what to do, and removes a window
    bad = run_cli(
        ["maint", "add", "--nodes", "node[03-05]", "--start", "now+1h", "--duration", "1h"],
        url=cluster.url,
        root=cluster.root,
    )
    assert bad.returncode == 1 and "unknown nodes node[04-05]" in bad.stderr, bad.stderr
    res = run_cli(
        ["maint", "add", "--nodes", "node03", "--start", "now+1h", "--duration", "1h", "--json"],
        url=cluster.url,
        root=cluster.root,
    )
    later = json.loads(res.stdout)["id"]
    res = run_cli(["maint", "remove", str(later)], url=cluster.url, root=cluster.root)
    assert res.returncode == 0 and f"maintenance {later} removed" in res.stdout, res.stderr
    assert c.maintenance() == []
    go.touch()
    c.cancel([waiting])
    cluster.wait_terminal([crossing, waiting])
