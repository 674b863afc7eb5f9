"""Reservations end to end: real controller, agents and jobs, driven by Slurm's own commands.

Three one-job nodes. `scontrol create reservation` sets node[01-02] aside for the test's user;
`scontrol show reservation` and `sinfo -T` show it as Slurm does. Then:

- jobs without the reservation run on node03 only; the next waits with Slurm's reason
  (`ReqNodeNotAvail, May be reserved for other job`) though the reserved nodes are free;
- a job with `--reservation=r1` runs on a reserved node; an unknown reservation is refused at
  submission in Slurm's words; deleting a reservation a job uses is refused;
- `scontrol update ReservationName=r1 EndTime=now+N` shortens it; the waiting job starts on a
  reserved node only once it has ended, and `show reservation` no longer lists it; the job
  running in it is stopped at its end and ends TIMEOUT (Slurm's ResvOverRun=0: see
  test_reservation_end.py);
- a MAINT reservation made with NodeCnt= round-trips through create, show and delete.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from system.harness import Cluster, base_env, wait_for
from system.test_preemption import CONFIG as PREEMPT_CONFIG

pytestmark = pytest.mark.system

HOLD = "#!/bin/bash\nwhile [ ! -e {go} ]; do sleep 0.2; done\n"


def slurm(
    cluster: Cluster, cwd: Path, command: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command as a user would, with the cluster's URL and admin credentials."""
    extra = {"PHALANX_URL": cluster.url, "PHALANX_TOKEN_FILE": str(cluster.root / "admin.token")}
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", command, *args],
        cwd=cwd,
        env=base_env(cluster.root, **extra),
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in p.stdout + p.stderr, (command, args, p.stdout, p.stderr)
    return p


@pytest.mark.timeout(300)
def test_a_reservation_keeps_others_off_its_nodes_until_it_ends(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=3, cpus=2)
    c = cluster.client()
    me = c.get("/v1/whoami")["user"]
    go = tmp_path / "go"

    p = slurm(
        cluster,
        tmp_path,
        "scontrol",
        "create",
        "reservation",
        "reservationname=r1",  # keys in any case, as Slurm takes them
        "StartTime=now",
        "Duration=10",  # minutes; shortened below
        "Nodes=node[01-02]",
        f"Users={me}",
    )
    assert (p.returncode, p.stdout) == (0, "Reservation created: r1\n"), p.stderr
    p = slurm(cluster, tmp_path, "scontrol", "show", "reservation", "r1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ReservationName=r1 StartTime="), p.stdout
    assert " Duration=00:10:00\n" in p.stdout, p.stdout
    assert "   Nodes=node[01-02] NodeCnt=2 CoreCnt=4 " in p.stdout, p.stdout
    assert "Flags=SPEC_NODES\n" in p.stdout and "   TRES=cpu=4\n" in p.stdout, p.stdout
    assert f"   Users={me} Groups=(null) Accounts=(null) " in p.stdout, p.stdout
    assert " State=ACTIVE " in p.stdout, p.stdout
    p = slurm(cluster, tmp_path, "sinfo", "-T")
    assert p.stdout.splitlines()[0].startswith("RESV_NAME     STATE"), p.stdout
    assert p.stdout.splitlines()[1].startswith("r1           ACTIVE"), p.stdout

    # jobs without the reservation: node03 only; the next one waits with Slurm's reason
    kw = {"cpus_per_task": 2}
    first = cluster.submit_script(tmp_path, "first", HOLD.format(go=go), **kw)
    assert cluster.wait_state(first, "RUNNING")["nodelist"] == "node03"
    second = cluster.submit_script(tmp_path, "second", HOLD.format(go=go), **kw)
    job = wait_for(
        lambda: (
            (j := c.job(second)[0])["reason"] and j["reason"].startswith("ReqNodeNotAvail") and j
        ),
        what="the outsider's reason to name the reservation",
    )
    assert job["state"] == "PENDING", job
    assert job["reason"].startswith("ReqNodeNotAvail, May be reserved for other job"), job
    assert "reservation r1 holds node[01-02] now" in job["reason"], job

    # a job with the reservation runs on its nodes (sbatch --reservation)
    script = tmp_path / "inside.sh"
    script.write_text(HOLD.format(go=go))
    p = slurm(cluster, tmp_path, "sbatch", "--reservation=r1", "-c", "2", str(script))
    assert p.returncode == 0, p.stderr
    inside = int(p.stdout.split()[-1])
    assert cluster.wait_state(inside, "RUNNING")["nodelist"] in ("node01", "node02")
    assert c.job(second)[0]["state"] == "PENDING"  # the other reserved node stays free

    # refusals in Slurm's words
    p = slurm(cluster, tmp_path, "sbatch", "--reservation=nope", str(script))
    assert p.returncode == 1, p.stdout
    assert "Requested reservation is invalid" in p.stderr, p.stderr
    p = slurm(cluster, tmp_path, "scontrol", "delete", "ReservationName=r1")
    assert p.returncode == 1, p.stdout
    assert p.stderr.startswith(
        f"delete_reservation ReservationName=r1: Requested reservation is in use: job {inside}"
    ), p.stderr

    # shortened to end soon: the outsider starts on a reserved node only after the end
    p = slurm(cluster, tmp_path, "scontrol", "update", "ReservationName=r1", "EndTime=now+8")
    assert (p.returncode, p.stdout) == (0, "Reservation updated.\n"), p.stderr
    end = c.reservation("r1")["end"]
    job = cluster.wait_state(second, "RUNNING")
    assert job["nodelist"] in ("node01", "node02"), job
    assert job["start_time"] >= end - 0.5, (job["start_time"] - end, job)
    p = slurm(cluster, tmp_path, "scontrol", "show", "reservation")
    assert (p.returncode, p.stdout) == (0, "No reservations in the system\n"), p.stderr

    # a MAINT reservation picked by node count: create, show, update, delete
    p = slurm(
        cluster,
        tmp_path,
        "scontrol",
        "create",
        "ReservationName=m1",
        "StartTime=now+1hour",
        "Duration=30",
        "NodeCnt=1",
        f"Accounts={c.job(first)[0]['account'] or 'root'}",
        "Flags=MAINT",
    )
    assert (p.returncode, p.stdout) == (0, "Reservation created: m1\n"), p.stderr
    p = slurm(cluster, tmp_path, "scontrol", "-o", "show", "res", "m1")
    assert "NodeCnt=1 " in p.stdout and " Flags=MAINT " in p.stdout, p.stdout
    assert " State=INACTIVE " in p.stdout and " Duration=00:30:00 " in p.stdout, p.stdout
    p = slurm(cluster, tmp_path, "scontrol", "update", "ReservationName=m1", "Duration=45")
    assert p.returncode == 0, p.stderr
    assert c.reservation("m1")["duration_s"] == 45 * 60
    p = slurm(cluster, tmp_path, "scontrol", "delete", "reservation=m1")
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "")
    p = slurm(cluster, tmp_path, "scontrol", "show", "reservation", "m1")
    assert (p.returncode, p.stderr) == (1, "Reservation m1 not found\n"), p.stdout
    changes = ("resv.create", "resv.update", "resv.delete")
    kinds = [e["kind"] for e in c.events(limit=500) if e["kind"] in changes]
    assert kinds == ["resv.create", "resv.update", "resv.create", "resv.update", "resv.delete"]
    # r1's start and end, once each (the cluster duty); m1 was deleted before it started
    wait_for(
        lambda: any(e["kind"] == "resv.end" for e in c.events(limit=500)),
        what="r1's end event",
    )
    moves = [
        (e["kind"], e["data"]["reservation"])
        for e in c.events(limit=500)
        if e["kind"] in ("resv.start", "resv.end")
    ]
    assert moves == [("resv.start", "r1"), ("resv.end", "r1")], moves

    go.touch()
    done = cluster.wait_terminal([first, second, inside])
    assert {i: j["state"] for i, j in done.items()} == {
        first: "COMPLETED",
        second: "COMPLETED",
        inside: "TIMEOUT",  # stopped when r1 ended
    }, done


@pytest.mark.timeout(300)
def test_preemption_never_stops_a_job_for_a_node_the_preemptor_may_not_use(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A high-tier job waits for a node; the only lower-tier job running sits on a reserved
    node the high job may not use. Stopping it would free nothing the high job can take, so
    preemption leaves it alone (its trial placements keep off what the pass keeps off)."""
    config = tmp_path / "phalanx.toml"
    config.write_text(PREEMPT_CONFIG)  # partitions low (tier 0) and high (tier 1)
    cluster.extra_env["PHALANX_CONFIG"] = str(config)
    cluster.start(nodes=2, cpus=2)
    c = cluster.client()
    me = c.get("/v1/whoami")["user"]
    go = tmp_path / "go"
    p = slurm(
        cluster, tmp_path, "scontrol", "create", "reservation", "ReservationName=r1",
        "StartTime=now", "Duration=30", "Nodes=node01", f"Users={me}",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    kw: dict[str, Any] = {"cpus_per_task": 2}
    inside = cluster.submit_script(
        tmp_path, "inside", HOLD.format(go=go), partition="low", reservation="r1", **kw
    )
    peer = cluster.submit_script(tmp_path, "peer", HOLD.format(go=go), partition="high", **kw)
    assert cluster.wait_state(inside, "RUNNING")["nodelist"] == "node01"
    assert cluster.wait_state(peer, "RUNNING")["nodelist"] == "node02"
    urgent = cluster.submit_script(tmp_path, "urgent", "#!/bin/sh\ntrue\n", partition="high", **kw)
    wait_for(lambda: c.job(urgent)[0]["reason"], what="a pass to give the urgent job a reason")

    def passes() -> float:
        text = httpx.get(cluster.url + "/metrics", timeout=30).text
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "phalanx_scheduling_pass_seconds_count"
        )

    seen = passes()  # two more whole passes (each with its preemption step) after this one
    wait_for(lambda: passes() >= seen + 2, what="two more scheduling passes")
    job = c.job(inside)[0]
    assert (job["state"], job["restart_count"]) == ("RUNNING", 0), job
    assert c.job(urgent)[0]["state"] == "PENDING"
    kinds = {e["kind"] for e in c.get("/v1/events", limit=1000)["events"] if e["job_id"] == inside}
    assert not any("preempt" in k for k in kinds), kinds
    go.touch()
    cluster.wait_terminal([inside, peer, urgent])
