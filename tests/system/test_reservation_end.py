"""The end of a reservation, end to end: real controllers, agents, shepherds and jobs, driven by
Slurm's commands.

What Slurm 22.05 does (checked on a real one, ResvOverRun=0, the default): a job may start in
a reservation whatever its time limit; when the reservation ends, a job still running in it is
killed and ends TIMEOUT (Reason=TimeLimit; its output says "Reservation r1, which this job was
running under, has ended"). With ResvOverRun=UNLIMITED it runs on.

- Three controllers on one store, two nodes: a job in a reservation that ends a few seconds
  later gets its checkpoint signal its grace (`--signal=USR1@4`) before the end, is stopped at
  the end and ends TIMEOUT with Slurm's reason, shown by `scontrol show job`, the events and
  `phalanx explain`; the reservation's start and end are one event each, whichever controller
  holds the cluster duty.
- `reservation_overrun = UNLIMITED`: the job runs on past the end; the end's event says so;
  the name is not taken again while it runs; released, it completes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, free_port, run_cli, wait_for
from system.test_reservations import slurm

pytestmark = pytest.mark.system

TIMING = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
    "kill_wait": 2.0,
}
PATH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
LEAD = 4.0  # the job's own warning: --signal=USR1@4
TRAPPER = """#!/bin/bash
trap 'date +%s.%N >> {marker}' USR1
while [ ! -e {go} ]; do sleep 0.2; done
"""


def events_of(cluster: Cluster, kind: str, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.client().events(limit=10_000)
        if e["kind"] == kind and (e.get("data") or {}).get("reservation") == name
    ]


def create(cluster: Cluster, tmp_path: Path, name: str, end_in: int, user: str) -> float:
    """A reservation of node01 from now to `end_in` seconds from now; its end."""
    p = slurm(
        cluster, tmp_path, "scontrol", "create", "reservation", f"ReservationName={name}",
        "StartTime=now", f"EndTime=now+{end_in}", "Nodes=node01", f"Users={user}",
    )  # fmt: skip
    assert (p.returncode, p.stdout) == (0, f"Reservation created: {name}\n"), p.stderr
    return float(cluster.client().reservation(name)["end"])


@pytest.mark.timeout(420)
def test_a_job_is_stopped_when_its_reservation_ends_once_with_three_controllers(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster()
    cluster.timing.update(TIMING)
    for i, cid in enumerate(("ctl-1", "ctl-2", "ctl-3")):
        cluster.start_controller(cid, port=cluster.port if i == 0 else free_port())
    url = cluster.use_all_controllers()
    for n in ("node01", "node02"):
        cluster.start_agent(n, cpus=2, mem="2G", url=url, wait=False)
    cluster.wait_agents(["node01", "node02"])
    c = cluster.client()
    me = c.get("/v1/whoami")["user"]
    marker, go = tmp_path / "usr1", tmp_path / "go"

    end = create(cluster, tmp_path, "r1", 25, me)
    started = wait_for(
        lambda: events_of(cluster, "resv.start", "r1"), what="the reservation's start event"
    )
    assert started[0]["message"].startswith("reservation r1 on node01 started (until "), started
    # a job whose time limit (10 min) runs far past the end starts, as in Slurm
    job = cluster.submit_script(
        tmp_path,
        "inside",
        TRAPPER.format(marker=marker, go=go),
        reservation="r1",
        time_limit_s=600,
        cpus_per_task=2,
        signal=f"USR1@{LEAD:g}",
        env=dict(PATH_ENV),
    )
    assert cluster.wait_state(job, "RUNNING")["nodelist"] == "node01"
    shown = run_cli(["explain", str(job)], url=url, root=cluster.root)
    assert shown.returncode == 0, shown.stderr
    assert "reservation r1 ends at " in shown.stdout, shown.stdout
    assert "the job is stopped then, with its checkpoint signal" in shown.stdout, shown.stdout

    done = cluster.wait_terminal([job], timeout=end - time.time() + 120)[job]
    reason = "Reservation r1, which this job was running under, has ended (at "
    assert done["state"] == "TIMEOUT" and done["reason"].startswith(reason), done
    assert done["restart_count"] == 0, done
    signalled = [float(x) for x in marker.read_text().split()]
    assert len(signalled) == 1, signalled
    # the checkpoint signal its grace before the end (a cluster tick early at most), the
    # stop at the end (SIGTERM then; it dies of it at once)
    assert end - LEAD - 2.5 <= signalled[0] <= end - LEAD + 1.5, (signalled[0] - end, done)
    assert end - 0.5 <= done["end_time"] <= end + TIMING["kill_wait"] + 3, done["end_time"] - end

    p = slurm(cluster, tmp_path, "scontrol", "show", "job", str(job))
    assert "JobState=TIMEOUT Reason=TimeLimit " in p.stdout, p.stdout
    ended = wait_for(lambda: events_of(cluster, "resv.end", "r1"), what="the end event")
    assert len(ended) == 1, ended
    assert ended[0]["message"].startswith("reservation r1 on node01 ended at "), ended
    # (the job was stopped at the end, usually before this event: the job's own resv.stop
    # event says so; a job still in it, running on with an overrun, is named here)
    stops = [e for e in c.job_events(job) if e["kind"] == "resv.stop"]
    assert len(stops) == 1, stops
    explained = run_cli(["explain", str(job)], url=url, root=cluster.root)
    assert explained.returncode == 0, explained.stderr
    assert f"TIMEOUT: {reason}" in explained.stdout, explained.stdout
    assert "resv.stop: stopped as reservation r1 ended" in explained.stdout, explained.stdout
    # one start and one end, whichever of the three controllers held the cluster duty; the
    # ended reservation is gone from the listings
    assert len(events_of(cluster, "resv.start", "r1")) == 1
    p = slurm(cluster, tmp_path, "scontrol", "show", "reservation")
    assert (p.returncode, p.stdout) == (0, "No reservations in the system\n"), p.stderr


@pytest.mark.timeout(300)
def test_with_an_unlimited_overrun_a_job_runs_on_past_its_reservation(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update(TIMING)
    cluster.extra_env["PHALANX_TIMING_RESERVATION_OVERRUN"] = "UNLIMITED"
    cluster.start(nodes=1, cpus=2)
    c = cluster.client()
    me = c.get("/v1/whoami")["user"]
    marker, go = tmp_path / "usr1", tmp_path / "go"
    end = create(cluster, tmp_path, "r2", 12, me)
    job = cluster.submit_script(
        tmp_path,
        "inside",
        TRAPPER.format(marker=marker, go=go),
        reservation="r2",
        time_limit_s=600,
        cpus_per_task=2,
        signal="USR1@4",
        env=dict(PATH_ENV),
    )
    assert cluster.wait_state(job, "RUNNING")["nodelist"] == "node01"
    ended = wait_for(
        lambda: events_of(cluster, "resv.end", "r2"),
        timeout=end - time.time() + 60,
        what="the reservation's end event",
    )
    assert ended[0]["ts"] >= end - 0.5, ended
    said = ended[0]["message"]
    assert f"job {job} still in it runs on to its time limit (reservation_overrun UNLIMITED)" in (
        said
    ), ended
    assert c.job(job)[0]["state"] == "RUNNING"
    assert not marker.exists()  # no checkpoint signal: it is not stopped
    # both listed where the cluster's events are
    listed = run_cli(["events"], url=cluster.url, root=cluster.root)
    assert listed.returncode == 0, listed.stderr
    lines = [x for x in listed.stdout.splitlines() if " resv." in x]
    assert [x.split()[1] for x in lines] == ["resv.create", "resv.start", "resv.end"], lines
    assert "cluster" in lines[1] and "reservation r2 on node01 started" in lines[1], lines
    # the name stays taken while the job runs in the ended reservation
    p = slurm(
        cluster, tmp_path, "scontrol", "create", "reservation", "ReservationName=r2",
        "StartTime=now+1hour", "Duration=10", "Nodes=node01", f"Users={me}",
    )  # fmt: skip
    assert p.returncode == 1, p.stdout
    assert f"job {job} still runs in it" in p.stderr, p.stderr
    go.touch()
    assert cluster.wait_terminal([job])[job]["state"] == "COMPLETED"
    assert events_of(cluster, "resv.stop", "r2") == []
