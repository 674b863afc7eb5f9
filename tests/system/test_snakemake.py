"""Snakemake with its Slurm executor plugin, unchanged and pinned (tests/tools-requirements.txt,
in .venv-tools: scripts/ensure-tools.sh), runs a fan-out/gather workflow on a real local cluster
through Phalanx's Slurm commands only, as it would at a site running Slurm.

What the plugin relies on: `sbatch --parsable` with its options (`--job-name` a run UUID,
`--output`, `--export=ALL`, `--comment`, `-t`, `--mem`, `--ntasks`, `--cpus-per-task`, `-D`,
`--wrap`), `sacct -X --parsable2 --clusters all --noheader --format=JobIdRaw,State --starttime
... --endtime now --name UUID` to learn how each job ended, `scancel`, `sinfo` to tell that it
is on a Slurm cluster, and `srun` inside each job to run the rule.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from system.harness import Cluster
from system.test_pty import BIN

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("TOOLS_VENV") or REPO / ".venv-tools") / "bin"

SNAKEFILE = """\
SAMPLES = ["a", "b", "c"]

rule all:
    input: "gathered.txt"

rule fan:
    output: "out/{s}.txt"
    threads: 2
    resources: mem_mb=600, runtime=5
    shell: "echo {wildcards.s} cpus=$SLURM_CPUS_PER_TASK job=$SLURM_JOB_ID > {output}"

rule gather:
    input: expand("out/{s}.txt", s=SAMPLES)
    output: "gathered.txt"
    resources: mem_mb=600, runtime=5
    shell: "cut -d' ' -f1,2 {input} | sort > {output}"
"""


@pytest.mark.timeout(600)
def test_a_fan_out_gather_workflow_finishes_with_correct_outputs(
    cluster: Cluster, tmp_path: Path
) -> None:
    snakemake = TOOLS / "snakemake"
    if not snakemake.exists():
        pytest.skip(f"no {snakemake}: `bash scripts/ensure-tools.sh` installs it (make test does)")
    cluster.start(nodes=2, cpus=4, mem="8G")
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    env = cluster.env(
        PHALANX_URL=cluster.url,
        PHALANX_AUTH_SOCKET=str(cluster.agent_socket("node01")),
        # our commands first: a host may also have Debian's Slurm client in /usr/bin
        PATH=f"{BIN}:{TOOLS}:{os.environ['PATH']}",
        HOME=str(tmp_path),  # Snakemake's caches
    )
    p = subprocess.run(
        [
            str(snakemake),
            *("--executor", "slurm", "--jobs", "4", "--latency-wait", "30"),
            # the plugin waits 40 s before its first look and 10 s between looks: shorter
            *("--slurm-init-seconds-before-status-checks", "1"),
            *("--seconds-between-status-checks", "2"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    assert "5 of 5 steps (100%) done" in p.stderr, p.stderr[-3000:]
    # each fan-out rule ran as its own job with its 2 threads as CPUs per task
    assert (tmp_path / "gathered.txt").read_text() == "a cpus=2\nb cpus=2\nc cpus=2\n"
    ids = {
        s: int((tmp_path / "out" / f"{s}.txt").read_text().split("job=")[1])
        for s in ("a", "b", "c")
    }
    assert len(set(ids.values())) == 3, ids
    jobs = cluster.jobs_by_id(list(ids.values()))
    assert {j["state"] for j in jobs.values()} == {"COMPLETED"}, jobs
    assert {j["mem_per_node_mb"] for j in jobs.values()} == {600}, jobs
