"""sstat end to end (slurm/sstat.py, agent/taskstat.py, GET /v1/jobs/{ref}/usage): the live
usage of a running job's step, sampled on both of its nodes while its tasks hold memory they
allocated, in Slurm 22.05's fields; the batch step; and sstat's errors, as Slurm's lab gave
them (../shared/slurm-lab)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, wait_for
from system.test_pty import BIN, run_command

pytestmark = pytest.mark.system

MIB = 1024 * 1024
HELD = 150  # MiB each task allocates and touches

ALLOC = f"""
import os, pathlib, sys, time
d = pathlib.Path(sys.argv[1])
buf = bytearray({HELD} * 1024 * 1024)
for i in range(0, len(buf), 4096):
    buf[i] = 1
began = time.process_time()
while time.process_time() - began < 0.3:
    pass
(d / ("ready-" + os.environ["SLURM_PROCID"])).write_text("1")
while not (d / "release").exists():
    time.sleep(0.05)
"""

# Slurm 22.05's field widths (sstat --helpformat, each field's dashes line in the lab)
DATA = Path(__file__).parents[1] / "data" / "slurm-22.05" / "sstat-format.txt"


def slurm_widths() -> dict[str, int]:
    rows = [x.split() for x in DATA.read_text().splitlines() if x and not x.startswith("#")]
    return {name: int(width) for name, width in rows}


def sstat(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return run_command(cluster, "sstat", *args)


@pytest.mark.timeout(300)
def test_sstat_shows_a_running_steps_memory_and_cpu_on_every_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=2, cpus=2)
    (tmp_path / "alloc.py").write_text(ALLOC)
    script = f"#!/bin/sh\n{BIN}/srun -N 2 -n 2 {sys.executable} {tmp_path}/alloc.py {tmp_path}\n"
    jid = cluster.submit_script(tmp_path, "hold", script, nodes=2, mem_mb=1024)
    try:
        wait_for(
            lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)),
            timeout=120,
            what="both tasks to hold their memory",
        )
        fields = "JobID,NTasks,Nodelist,MaxRSS,MaxRSSNode,MaxRSSTask,AveRSS,MinCPU,AveCPU"
        p = sstat(cluster, "-j", str(jid), "-P", "--noconvert", "-o", fields)
        assert p.returncode == 0 and p.stderr == "", p.stderr
        header, row = p.stdout.splitlines()
        assert header == fields.replace(",", "|")
        got = dict(zip(fields.split(","), row.split("|"), strict=True))
        assert got["JobID"] == f"{jid}.0"  # no step named: the lowest running one
        assert got["NTasks"] == "2" and got["Nodelist"] == "node[01-02]", got
        # each task holds HELD MiB it touched (the interpreter's own memory on top)
        assert int(got["MaxRSS"]) >= HELD * MIB, got
        assert int(got["AveRSS"]) >= HELD * MIB, got
        assert got["MaxRSSNode"] in ("node01", "node02") and got["MaxRSSTask"] in ("0", "1")
        minutes, seconds = got["MinCPU"].split(":")
        assert int(minutes) * 60 + float(seconds) >= 0.3, got  # each burned 0.3 s of CPU

        # -a: every running step, the batch script's first; .batch: the script's processes
        p = sstat(cluster, "-a", "-j", str(jid), "-n", "-P", "-o", "JobID,NTasks")
        assert p.stdout.splitlines() == [f"{jid}.batch|1", f"{jid}.0|2"], p.stdout
        p = sstat(cluster, "-j", f"{jid}.batch", "-n", "-p", "-o", "JobID,Nodelist,Pids")
        jobid, nodelist, pids, end = p.stdout.strip().split("|")
        assert (jobid, nodelist, end) == (f"{jid}.batch", "node01", ""), p.stdout
        assert pids and all(x.isdecimal() for x in pids.split(",")), p.stdout

        # the default format: Slurm's 47 fields, each at Slurm's width and justification
        p = sstat(cluster, "-j", str(jid))
        head, dashes, line = p.stdout.splitlines()
        widths = [len(d) for d in dashes.split()]
        names = head.split()
        wanted = slurm_widths()
        assert len(names) == len(widths) == 47, head
        assert all(wanted[n] == w for n, w in zip(names, widths, strict=True)), head
        assert head.startswith("JobID         MaxVMSize  MaxVMSizeNode ")  # JobID left
        assert line.startswith(f"{jid}.0 ".ljust(13))

        # errors, as Slurm 22.05 words them
        p = sstat(cluster, "-j", f"{jid}.7", "-n")
        assert (p.returncode, p.stdout) == (0, ""), p
        assert p.stderr == f"sstat: error: StepId={jid}.7 not found running.\n"
        p = sstat(cluster, "-j", "99999", "-n")
        assert (p.returncode, p.stderr) == (0, "sstat: error: couldn't get steps for job 99999\n")
        p = sstat(cluster, "-j", "abc")
        assert (p.returncode, p.stderr) == (1, "sstat: fatal: Bad job/step specified: abc\n")
        p = sstat(cluster)
        assert (p.returncode, p.stderr) == (
            1,
            "sstat: error: You didn't give me any jobs to stat.\n",
        )
        p = sstat(cluster, "-j", str(jid), "-o", "Bogus")
        assert (p.returncode, p.stderr) == (1, 'sstat: error: Invalid field requested: "Bogus"\n')
    finally:
        (tmp_path / "release").write_text("1")
    assert cluster.wait_terminal([jid])[jid]["state"] == "COMPLETED"
    p = sstat(cluster, "-j", str(jid), "-n")
    assert (p.returncode, p.stderr) == (0, f"sstat: error: No steps running for job {jid}\n")
    # once ended, sacct's step line keeps what its tasks used (their exit records)
    p = run_command(
        cluster, "sacct", "-j", str(jid), "-n", "-P", "-o", "JobID,MaxRSS,MaxRSSNode,TotalCPU"
    )
    step0 = next(x.split("|") for x in p.stdout.splitlines() if x.startswith(f"{jid}.0|"))
    assert int(step0[1].rstrip("K")) * 1024 >= HELD * MIB, step0
    assert step0[2] in ("node01", "node02") and step0[3], step0
