"""Cluster licences end to end: two jobs that each need the only `fluent` licence run one after
the other, the second pending with the reason Licenses (in squeue's %r and scontrol) meanwhile;
an unknown licence, or more than the cluster has, is refused at submit (docs/configuration.md).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from system.conftest import CLUSTERS
from system.harness import Cluster, base_env, run_cli, wait_for

pytestmark = pytest.mark.system

# Each job records when it started, then holds its licence until the test lets it go.
JOB = """#!/bin/bash
#SBATCH --time=10:00
echo "start $(date +%s.%N)" > {out}/lic-$SLURM_JOB_ID.txt
while [ ! -e {out}/go-$SLURM_JOB_ID ]; do sleep 0.1; done
echo "end $(date +%s.%N)" >> {out}/lic-$SLURM_JOB_ID.txt
"""


class LicenseCluster(Cluster):
    """The harness's cluster, its controller given a config with `cluster.licenses`."""

    config_file: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**extra)
        if self.config_file is not None:
            env["PHALANX_CONFIG"] = str(self.config_file)
        return env


def slurm(
    cluster: Cluster, cwd: Path, command: str, *args: str
) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", command, *args],
        cwd=cwd,
        env=base_env(
            cluster.root,
            PHALANX_URL=cluster.url,
            PHALANX_TOKEN_FILE=str(cluster.root / "admin.token"),
        ),
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in p.stdout + p.stderr, (command, args, p.stdout, p.stderr)
    return p


def _times(path: Path) -> dict[str, float]:
    return {k: float(v) for k, v in (line.split() for line in path.read_text().splitlines())}


@pytest.mark.timeout(300)
def test_one_licence_two_jobs_run_one_after_the_other(
    request: pytest.FixtureRequest, make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = LicenseCluster(tmp_path / "lic")
    request.node.stash[CLUSTERS].append(cluster)  # torn down and its logs shown like others
    config = tmp_path / "phalanx.toml"
    config.write_text('[cluster]\nlicenses = "fluent:1,matlab:4"\n')
    cluster.config_file = config
    cluster.start(nodes=2, cpus=2)  # room for both jobs: only the licence keeps them apart
    (tmp_path / "job.sh").write_text(JOB.format(out=tmp_path))

    ids = []
    for _ in range(2):
        p = slurm(cluster, tmp_path, "sbatch", "--parsable", "-L", "fluent:1", "job.sh")
        assert p.returncode == 0, p.stderr
        ids.append(int(p.stdout))
    first, second = ids

    cluster.wait_state(first, "RUNNING")

    def second_waits_for_licence() -> str | None:
        p = slurm(cluster, tmp_path, "squeue", "-h", "-j", str(second), "-o", "%T|%r")
        return p.stdout if p.stdout == "PENDING|Licenses\n" else None

    wait_for(second_waits_for_licence, what="the second job pending with reason Licenses")
    shown = slurm(cluster, tmp_path, "scontrol", "show", "job", str(second)).stdout
    assert "Reason=Licenses" in shown and "Licenses=fluent:1" in shown, shown
    # it stays pending while the first holds the licence, though a node is free
    assert cluster.client().job(second)[0]["state"] == "PENDING"
    lic = slurm(cluster, tmp_path, "scontrol", "show", "lic", "fluent")
    assert lic.stdout == (
        "LicenseName=fluent\n   Total=1 Used=1 Free=0 Reserved=0 Remote=no\n\n"
    ), lic.stdout
    table = run_cli(["show", "licenses"], url=cluster.url, cwd=tmp_path, root=cluster.root)
    assert table.stdout.split("\n")[1:3] == [
        "fluent       1       1       0",
        "matlab       4       0       4",
    ], table.stdout

    (tmp_path / f"go-{first}").touch()
    cluster.wait_state(second, "RUNNING")
    (tmp_path / f"go-{second}").touch()
    done = cluster.wait_terminal(ids)
    assert all(done[i]["state"] == "COMPLETED" for i in ids), done
    a, b = _times(tmp_path / f"lic-{first}.txt"), _times(tmp_path / f"lic-{second}.txt")
    assert a["end"] <= b["start"], (a, b)  # never both holding the one licence

    # refused at submit with the reason, and nothing stored
    before = len(cluster.client().jobs(limit=100_000))
    p = slurm(cluster, tmp_path, "sbatch", "-L", "ansys:1", "job.sh")
    assert p.returncode == 1 and "unknown licence 'ansys'" in p.stderr, p.stderr
    assert p.stderr.endswith("\n") and p.stderr.count("\n") == 1, p.stderr
    p = slurm(cluster, tmp_path, "sbatch", "-L", "matlab:5", "job.sh")
    assert p.returncode == 1 and "only 4 matlab" in p.stderr, p.stderr
    assert len(cluster.client().jobs(limit=100_000)) == before
