"""sacctmgr on a real cluster: accounts, users and QOS added and changed at run time round-trip
field by field through `sacctmgr show ... -P format=...`, a user added with `sacctmgr add user`
submits at once (refused before: `open = false`), limits set with `sacctmgr modify` apply to the
next job (a submit limit refuses it, a run-time limit keeps it waiting), sshare ranks what was
added, every change is an event with its actor, and without -i nothing is committed unless the
answer is y.

Jobs of the users added here never run (they wait for a --begin far ahead), so no Unix user is
made; the run-time limit is shown on root's jobs (the cluster's admin).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from system.conftest import CLUSTERS
from system.harness import Cluster, base_env, wait_for

pytestmark = [pytest.mark.system]

NODE = "node01"
CONFIG = """
[fairshare]
open = false
accounts = [ { name = "phys", shares = 2 } ]
users = [ { name = "root", account = "phys" } ]
"""


class AcctCluster(Cluster):
    config_file: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**extra)
        if self.config_file is not None:
            env["PHALANX_CONFIG"] = str(self.config_file)
        return env


def sacctmgr(cluster: Cluster, *args: str, ok: bool = True, stdin: str | None = None) -> Any:
    env = base_env(
        cluster.root,
        PHALANX_URL=cluster.url,
        PHALANX_TOKEN_FILE=str(cluster.root / "admin.token"),
    )
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", "sacctmgr", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
    )
    assert "Traceback" not in p.stderr, p.stderr
    if ok:
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


def rows(cluster: Cluster, *args: str) -> list[list[str]]:
    out = sacctmgr(cluster, "show", *args, "-P", "-n").stdout
    return [line.split("|") for line in out.splitlines()]


def later_job(cluster: Cluster, user: str, **kw: Any) -> Any:
    """A job that waits an hour for its --begin (it never runs here)."""
    spec = {"argv": ["/bin/true"], "begin_time": time.time() + 3600, "workdir": "/tmp", **kw}
    with cluster.client_as(user) as c:
        return c.submit(spec)


@pytest.mark.timeout(300)
def test_sacctmgr_round_trips(tmp_path: Path, make_cluster: Any, request: Any) -> None:
    config = tmp_path / "phalanx.toml"
    config.write_text(CONFIG)
    cluster = AcctCluster(tmp_path / "cluster")
    cluster.config_file = config
    request.node.stash[CLUSTERS].append(cluster)
    cluster.start_controller()
    cluster.start_agent(NODE, cpus=2, mem="2G")
    cluster.wait_agents([NODE])

    # the configuration's [fairshare] was imported once
    assert rows(cluster, "assoc", "format=Account,User,ParentName,Share") == [
        ["root", "", "", "1"],
        ["default", "", "root", "1"],
        ["phys", "", "root", "2"],
        ["phys", "root", "phys", "1"],
    ]

    # carol is in no account: refused
    with pytest.raises(Exception) as e:
        later_job(cluster, "carol")
    assert "is in no account" in str(e.value)

    out = sacctmgr(
        cluster, "-i", "add", "account", "bio", "Parent=phys", "Fairshare=3",
        "Description=Biology", "Organization=sci", "GrpJobs=5", "GrpTRES=gres/gpu=4",
    ).stdout  # fmt: skip
    assert " Adding Account(s)\n  bio\n" in out and "Description     = Biology" in out
    sacctmgr(cluster, "-i", "add", "user", "carol", "Account=bio", "MaxSubmitJobs=4")
    sacctmgr(cluster, "-i", "add", "qos", "gold", "Priority=10", "MaxJobsPU=2", "MaxWall=1:00:00")
    # the same names again: Slurm's "Nothing new added", exit 1
    again = sacctmgr(cluster, "-i", "add", "account", "bio", ok=False)
    assert again.returncode == 1 and "Nothing new added" in again.stderr

    fields = "format=Account,User,ParentName,Share,GrpJobs,GrpTRES,MaxSubmit,MaxJobs"
    assert rows(cluster, "assoc", "where", "account=bio", fields) == [
        ["bio", "", "phys", "3", "5", "gres/gpu=4", "", ""],
        ["bio", "carol", "bio", "1", "", "", "4", ""],
    ]
    assert rows(cluster, "account", "where", "name=bio") == [["bio", "Biology", "sci"]]
    assert rows(cluster, "user", "carol") == [["carol", "bio", "None"]]
    assert rows(cluster, "qos", "gold", "format=Name,Priority,MaxJobsPU,MaxWall") == [
        ["gold", "10", "2", "01:00:00"]
    ]

    # carol submits at once, to her account, in the new QOS
    job = later_job(cluster, "carol", qos="gold")
    got = cluster.client().job(int(job["job_id"]))[0]
    assert (got["account"], got["qos"]) == ("bio", "gold")

    # modify ... set: each field back as set
    sacctmgr(cluster, "-i", "modify", "user", "where", "name=carol", "set",
             "MaxSubmitJobs=1", "Fairshare=7", "MaxWall=30:00")  # fmt: skip
    sacctmgr(cluster, "-i", "modify", "account", "bio", "set", "GrpTRES=gres/gpu=-1",
             "Description=Life sciences")  # fmt: skip
    sacctmgr(cluster, "-i", "modify", "qos", "where", "name=gold", "set", "Priority=20",
             "MaxJobsPU=-1")  # fmt: skip
    fields = "format=Account,User,Share,GrpTRES,MaxSubmit,MaxWall"
    assert rows(cluster, "assoc", "where", "account=bio", fields) == [
        ["bio", "", "3", "", "", ""],
        ["bio", "carol", "7", "", "1", "00:30:00"],
    ]
    assert rows(cluster, "account", "bio", "format=Account,Descr") == [["bio", "Life sciences"]]
    assert rows(cluster, "qos", "gold", "format=Name,Priority,MaxJobsPU") == [["gold", "20", ""]]

    # the submit limit applies to her next job, with Slurm's reason
    with pytest.raises(Exception) as e:
        later_job(cluster, "carol")
    assert "AssocMaxSubmitJobLimit (user carol in account bio" in str(e.value)

    # a run-time limit set now keeps root's second job waiting
    sacctmgr(cluster, "-i", "modify", "user", "root", "set", "MaxJobs=1")
    spec = {"argv": ["/bin/sleep", "300"], "workdir": "/tmp", "cpus_per_task": 1}
    first = int(cluster.client().submit(spec)["job_id"])
    cluster.wait_state(first, "RUNNING")
    second = int(cluster.client().submit(spec)["job_id"])
    wait_for(
        lambda: (cluster.client().job(second)[0]["reason"] or "").startswith("AssocMaxJobsLimit"),
        what="root's second job to wait on the MaxJobs set by sacctmgr",
    )
    # lifted: it starts (the node has a CPU for it)
    sacctmgr(cluster, "-i", "modify", "user", "root", "set", "MaxJobs=-1")
    cluster.wait_state(second, "RUNNING")
    cluster.client().cancel([first, second])

    # sshare ranks what was added
    env = base_env(cluster.root, PHALANX_URL=cluster.url,
                   PHALANX_TOKEN_FILE=str(cluster.root / "admin.token"))  # fmt: skip
    share = subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", "sshare", "-a", "-P", "-n"],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert share.returncode == 0, share.stderr
    assert any(r.split("|")[:3] == ["  bio", "carol", "7"] for r in share.stdout.splitlines())

    # refusals: in use, not empty, unknown keys named
    busy = sacctmgr(cluster, "-i", "delete", "user", "carol", ok=False)
    assert busy.returncode == 1 and "Job(s) active" in busy.stderr
    full = sacctmgr(cluster, "-i", "delete", "account", "bio", ok=False)
    assert "still has users carol" in full.stderr
    odd = sacctmgr(cluster, "-i", "modify", "qos", "gold", "set", "GrpTRESMins=cpu=1", ok=False)
    assert odd.returncode == 1 and "GrpTRESMins is not supported for a qos here" in odd.stderr

    # without -i and without an answer, nothing is committed
    asked = sacctmgr(cluster, "add", "qos", "silver")
    assert "Would you like to commit changes?" in asked.stdout
    assert "Changes Discarded" in asked.stdout
    assert rows(cluster, "qos", "silver") == []
    answered = sacctmgr(cluster, "add", "qos", "silver", stdin="y\n")
    assert "Changes Discarded" not in answered.stdout
    assert rows(cluster, "qos", "silver", "format=Name") == [["silver"]]

    events = [
        (e["kind"], e["actor"])
        for e in cluster.client().get("/v1/events", limit=1000)["events"]
        if e["kind"].startswith("acct.")
    ]
    assert events[0] == ("acct.import", "ctl-1")
    assert ("acct.add", "root") in events and ("acct.modify", "root") in events
