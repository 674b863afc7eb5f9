"""Fair share on a real cluster: two users in two accounts with equal shares, one of whom has
used the cluster and one who has not; on a full cluster their new jobs start in fair-share
order (not submission order), `phalanx priority` shows the factors behind it and `phalanx
share` the tree.

The users are real Unix users (``useradd``, removed afterwards), because a job runs as its
submitter: root only, skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from system.conftest import CLUSTERS
from system.harness import Cluster, base_env, run_cli, wait_for

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(os.geteuid() != 0, reason="creates Unix users (useradd): root only"),
]

HEAVY, LIGHT = "phxfsheavy", "phxfslight"
NODE = "node01"


class FsCluster(Cluster):
    """The harness's cluster with a config file (the [priority] and [fairshare] settings)."""

    config_file: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**extra)
        if self.config_file is not None:
            env["PHALANX_CONFIG"] = str(self.config_file)
        return env


@pytest.fixture
def users() -> Iterator[tuple[str, str]]:
    if shutil.which("useradd") is None:
        pytest.skip("no useradd here")
    made: list[str] = []
    try:
        for u in (HEAVY, LIGHT):
            subprocess.run(["userdel", u], capture_output=True)  # a leftover of a killed run
            subprocess.run(["useradd", "-M", "-s", "/bin/sh", u], check=True, capture_output=True)
            made.append(u)
        yield HEAVY, LIGHT
    finally:
        for u in made:
            subprocess.run(["userdel", u], capture_output=True)


CONFIG = f"""
[priority]
# only fair share counts here, so the order it gives is the order seen
weight_fairshare = 10000
weight_age = 0
weight_jobsize = 0
weight_partition = 0
weight_qos = 0
calc_period = 0.5

[fairshare]
accounts = [
  {{ name = "heavy", shares = 1 }},
  {{ name = "light", shares = 1 }},
]
users = [
  {{ name = "{HEAVY}", account = "heavy" }},
  {{ name = "{LIGHT}", account = "light", max_running_jobs = 1 }},
]
"""


def _job(cluster: Cluster, user: str, seconds: int, name: str) -> int:
    """A job of `user` (root: the cluster's admin) that takes the whole node."""
    spec: dict[str, Any] = {
        "script": f"#!/bin/bash\nsleep {seconds}\n",
        "name": name,
        "workdir": "/tmp",
        "output": "/dev/null",
        "cpus_per_task": 2,  # the whole node
        "time_limit_s": 600,
        "env": {"PATH": "/usr/bin:/bin"},
    }
    if user == "root":
        return int(cluster.client().submit(spec)["job_id"])
    with cluster.client_as(user) as c:
        return int(c.submit(spec)["job_id"])


def _state(cluster: Cluster, jid: int) -> dict[str, Any]:
    job: dict[str, Any] = cluster.client().job(jid)[0]
    return job


def _slurm(env: dict[str, str], command: str, *args: str) -> str:
    """A Slurm command's output (it must succeed)."""
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", command, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, (command, p.stdout, p.stderr)
    return p.stdout


@pytest.fixture
def top() -> Iterator[Path]:
    """The cluster's directory: the jobs' users must reach their scripts under the agent's
    state dir, so not tmp_path (mode 700) but a directory of its own under /tmp, removed after
    the cluster is stopped (fixtures are torn down in reverse order: ask for this one before
    make_cluster)."""
    path = Path(tempfile.mkdtemp(prefix="phx-fs-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(300)
def test_new_jobs_start_in_fair_share_order(
    users: tuple[str, str], top: Path, make_cluster: Any, request: pytest.FixtureRequest
) -> None:
    heavy, light = users
    config = top / "phalanx.toml"
    config.write_text(CONFIG)
    cluster = FsCluster(top / "cluster")
    cluster.config_file = config
    request.node.stash[CLUSTERS].append(cluster)  # torn down (and its logs shown) as others
    cluster.start_controller()
    cluster.start_agent(NODE, cpus=2, mem="2G")
    cluster.wait_agents([NODE])

    # the heavy user uses the whole node for a while; the light one never has
    used = _job(cluster, heavy, 3, "history")
    cluster.wait_terminal([used])
    assert _state(cluster, used)["state"] == "COMPLETED"

    def heavy_usage() -> float:
        rows = cluster.client().get("/v1/share")["rows"]
        return next(r["raw_usage"] for r in rows if r["user"] == heavy)

    # charged at 2 CPUs x 1.0 a second for the seconds it ran (some decay aside)
    assert wait_for(lambda: heavy_usage() >= 4.0, what="the heavy user's usage to be charged")

    # a full cluster: root's job holds the node while both users submit, heavy first
    blocker = _job(cluster, "root", 300, "blocker")
    cluster.wait_state(blocker, "RUNNING")
    first = _job(cluster, heavy, 300, "heavy-new")
    second = _job(cluster, light, 300, "light-new")
    assert first < second

    def waiting() -> bool:
        return bool(_state(cluster, first)["reason"] and _state(cluster, second)["reason"])

    wait_for(waiting, what="both new jobs to be judged by the scheduler")
    # the light user's job is at the head of the queue (Resources), the heavy's behind it
    assert _state(cluster, second)["reason"] == "Resources"
    assert _state(cluster, first)["reason"] == "Priority"

    # `phalanx priority` shows the factors: equal shares, so the one who used more ranks last
    out = run_cli(["priority", str(first), "--json"], url=cluster.url, root=cluster.root)
    assert out.returncode == 0, out.stderr
    p_heavy = json.loads(out.stdout)["jobs"][0]
    p_light = cluster.client().get(f"/v1/jobs/{second}/priority")["jobs"][0]
    assert p_light["factors"]["fairshare"] > p_heavy["factors"]["fairshare"]
    assert p_light["factors"]["fairshare"] == 1.0
    assert p_light["priority"] == 10000
    assert p_heavy["priority"] == round(10000 * p_heavy["factors"]["fairshare"])
    text = run_cli(["priority", str(first)], url=cluster.url, root=cluster.root)
    assert text.returncode == 0, text.stderr
    assert "fairshare   10000 x" in text.stdout
    assert "priority = round(" in text.stdout

    share = run_cli(["share"], url=cluster.url, root=cluster.root)
    assert share.returncode == 0, share.stderr
    lines = share.stdout.splitlines()
    light_row = next(line for line in lines if light in line)
    heavy_row = next(line for line in lines if heavy in line)
    assert lines.index(light_row) < lines.index(heavy_row)  # Fair Tree's visiting order
    assert light_row.split()[-1] == "1.000000"

    # the Slurm front ends say the same
    env = base_env(
        cluster.root,
        PHALANX_URL=cluster.url,
        PHALANX_TOKEN_FILE=str(cluster.root / "admin.token"),
    )
    sshare = _slurm(env, "sshare", "-a", "-l", "-P", "-n")
    assert sshare.index(f"|{light}|") < sshare.index(f"|{heavy}|")
    sprio = _slurm(env, "sprio", "-l", "-h", "-j", f"{first},{second}").splitlines()
    assert [row.split()[0] for row in sprio] == [str(first), str(second)]
    assert int(sprio[1].split()[4]) == 10000  # light's PRIORITY: all fair share
    assert int(sprio[0].split()[4]) < 10000

    # the node frees: the light user's job starts first, though submitted second
    cluster.client().cancel([blocker])
    cluster.wait_state(second, "RUNNING")
    assert _state(cluster, first)["state"] == "PENDING"

    # a run-time limit: the light user may run one job at a time; the next one waits with
    # Slurm's reason, which squeue's %r shows
    third = _job(cluster, light, 300, "light-more")
    wait_for(
        lambda: (_state(cluster, third)["reason"] or "").startswith("AssocMaxJobsLimit"),
        what="the light user's second job to wait on its limit",
    )
    reason = _slurm(env, "squeue", "-h", "-j", str(third), "-o", "%r")
    assert reason.startswith("AssocMaxJobsLimit"), reason
    cluster.client().cancel([first, second, third])
    cluster.wait_terminal([first, second, third])
