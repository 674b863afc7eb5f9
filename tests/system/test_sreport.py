"""sreport end to end (slurm/sreport.py, GET /v1/report/usage): jobs of known CPUs and run
times on a real local cluster, then the cluster and user reports over a window around them,
checked against the jobs' own start and end times."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from system.harness import Cluster
from system.test_pty import run_command

pytestmark = pytest.mark.system


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def sreport(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return run_command(cluster, "sreport", *args)


@pytest.mark.timeout(300)
def test_sreport_sums_the_cpu_time_of_the_jobs_in_the_window(
    cluster: Cluster, tmp_path: Path
) -> None:
    t0 = time.time() - 2
    cluster.start(nodes=2, cpus=2)
    wide = cluster.submit_script(tmp_path, "wide", "#!/bin/sh\nsleep 2\n", cpus_per_task=2)
    narrow = cluster.submit_script(tmp_path, "narrow", "#!/bin/sh\nsleep 3\n", cpus_per_task=1)
    jobs = cluster.wait_terminal([wide, narrow])
    assert {j["state"] for j in jobs.values()} == {"COMPLETED"}
    t1 = time.time() + 2
    ran = {jid: j["end_time"] - j["start_time"] for jid, j in jobs.items()}
    cpu_s = 2 * ran[wide] + 1 * ran[narrow]
    window = [f"start={iso(t0)}", f"end={iso(t1)}"]

    p = sreport(cluster, "cluster", "utilization", *window, "-t", "seconds", "-P")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "-" * 80 and lines[3] == "-" * 80
    assert lines[1] == f"Cluster Utilization {iso(t0)} - {iso(t1 - 1)}"
    assert lines[2] == "Usage reported in CPU Seconds"
    assert lines[4] == "Cluster|Allocated|Down|PLND Down|Idle|Planned|Reported"
    name, alloc, down, plnd, idle, planned, reported = lines[5].split("|")
    assert abs(int(alloc) - cpu_s) <= 2, (alloc, cpu_s)  # whole seconds, as Slurm prints
    assert (down, plnd, planned) == ("0", "0", "0")
    assert int(reported) >= int(alloc) + int(idle) - 1
    assert int(reported) <= 4 * (t1 - t0)  # two nodes of 2 CPUs, registered in the window

    # the users' report: the same seconds, all of them this user's
    p = sreport(cluster, "user", "top", *window, "-t", "seconds", "-n", "-P")
    assert p.returncode == 0, p.stderr
    (row,) = p.stdout.splitlines()
    _, login, _, _, used, energy = row.split("|")
    assert login == jobs[wide]["user"] and int(used) == int(alloc) and energy == "0", row
    # the account tree starts with root's total, in percent of the allocated time
    p = sreport(cluster, "cluster", "AccountUtilizationByUser", *window, "-t", "percent")
    root = p.stdout.splitlines()[6]
    assert root.split()[:2] == [name, "root"] and root.split()[-2] == "100.00%", p.stdout

    # the fixed-width form at Slurm's column widths (-n: no banner, no header)
    p = sreport(cluster, "cluster", "utilization", *window, "-n")
    assert p.stdout.splitlines() == [
        f"{name:>9} {int(alloc) // 60:>12} {0:>10} {0:>10} {int(idle) // 60:>12} {0:>9} "
        f"{int(reported) // 60:>12} "
    ]
    # what Phalanx cannot report is refused by name
    for words, why in (
        (["job", "sizesbyaccount"], "job size reports"),
        (["reservation", "utilization"], "no reservations"),
        (["cluster", "utilization", "bogus=1"], "Unknown condition: bogus=1"),
    ):
        p = sreport(cluster, *words)
        assert p.returncode == 1 and why in p.stderr, (words, p.stderr)
