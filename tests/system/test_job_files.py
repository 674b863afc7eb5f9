"""A job's own files cannot trick its node: a real cluster, a real Unix user, a hostile job.

The job's user owns the job's ``control/`` directory, whose files the agent and the shepherd
(root) read on the job's behalf every heartbeat (docs/checkpoints.md).  The job here, run as a
user this module creates (``phxeve``), makes its checkpoint marker a symbolic link to a file
only root may read, then its progress file a FIFO (with ``--progress-timeout`` of 2 s, so that the
shepherd's hang detection looks at it too).  Before agent/jobfiles.py, the first line of the
root-only file came back as the job's checkpoint path in ``phalanx show`` and its events, and
the FIFO blocked the agent's heartbeat: its node went DOWN and every other job on it was
requeued.  Here nothing of the file may show anywhere, the node stays UP (its heartbeats go on
past ``node_down_timeout``), another job on the node keeps running in its first attempt, a job
submitted afterwards runs, and the hostile job's shepherd still stops it when it is cancelled.

Needs root (useradd, runuser); everything it makes is removed in ``finally`` blocks, even on
failure: the cluster's processes and the user's, the user and their home, the work dir under
/tmp, and the modes of the directories above the interpreter (system/unixusers.py).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from system.conftest import CLUSTERS
from system.harness import Cluster, base_env, wait_for
from system.unixusers import can_import, root_searchable, temporary_users

pytestmark = pytest.mark.system

EVE = "phxeve"
NODE_DOWN_TIMEOUT = 10.0  # the default [timing] node_down_timeout (the cluster keeps it)

TRICKS = """#!/bin/sh
#SBATCH --job-name=tricks
#SBATCH --output=tricks-%j.out
#SBATCH --time=10:00
#SBATCH --progress-timeout=00:02
ln -s {secret} "$PHX_CHECKPOINT_MARKER"
echo linked > stage-linked
while [ ! -e go-fifo ]; do sleep 0.1; done
mkfifo "$PHX_PROGRESS_FILE"
echo fifo > stage-fifo
exec sleep 600
"""


@dataclass
class Site:
    cluster: Cluster
    eve: pwd.struct_passwd
    work: Path  # eve's own directory (0700)
    secret_path: Path  # a root-only file (0600)
    secret: str  # its content

    def as_eve(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`phalanx ARGS` as eve, with node01's credential socket, as on a cluster host."""
        env = base_env(
            self.cluster.root,
            PHALANX_URL=self.cluster.url,
            PHALANX_AUTH_SOCKET=str(self.cluster.agent_socket("node01")),
            HOME=self.eve.pw_dir,
            COLUMNS="200",
            NO_COLOR="1",
        )
        p = subprocess.run(
            ["runuser", "-u", EVE, "--", sys.executable, "-m", "phalanx", *args],
            cwd=self.work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert p.returncode == 0 and "Traceback" not in p.stderr, (args, p.stdout, p.stderr)
        return p


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    top = Path(tempfile.mkdtemp(prefix="phx-jobfiles-", dir="/tmp"))
    cluster: Cluster | None = None
    try:
        top.chmod(0o755)  # the user traverses it to their dir and the agent's state dir
        with temporary_users([EVE]) as (eve,), root_searchable():
            can_import(EVE)
            work = top / "eve"
            work.mkdir(mode=0o700)
            os.chown(work, eve.pw_uid, eve.pw_gid)
            secret = f"ROOT-ONLY-{secrets.token_hex(8)}"
            secret_path = top / "root-only"
            secret_path.write_text(secret + "\nsecond line\n")
            secret_path.chmod(0o600)
            probe = subprocess.run(
                ["runuser", "-u", EVE, "--", "cat", str(secret_path)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert probe.returncode != 0, "the test's secret must be out of the user's reach"
            cluster = Cluster(top / "cluster")
            cluster.root.chmod(0o755)
            cluster.start(nodes=1, cpus=4)
            try:
                yield Site(cluster, eve, work, secret_path, secret)
            finally:
                swept = cluster.cleanup()
                if swept:
                    print(f"cleanup swept up stray processes: {swept}", file=sys.stderr)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _agent_log(site: Site) -> str:
    return (site.cluster.logs / "agent-node01.log").read_text(errors="replace")


def _everything_shown(site: Site, jid: int) -> str:
    """What anyone may see of the job: `phalanx show` and `phalanx events` as eve and as
    root, and the API's job and events."""
    client = site.cluster.client()
    parts = [
        site.as_eve("show", str(jid)).stdout,
        site.as_eve("events", str(jid)).stdout,
        json.dumps(client.job(jid)[0]),
        json.dumps(list(client.job_events(jid))),
    ]
    return "\n".join(parts)


def _node(site: Site) -> dict[str, Any]:
    return dict(site.cluster.client().node("node01"))


@pytest.mark.timeout(600)
def test_a_jobs_links_and_fifos_neither_leak_nor_wedge_the_node(
    site: Site, request: pytest.FixtureRequest
) -> None:
    request.node.stash[CLUSTERS] = [site.cluster]
    cluster = site.cluster
    # another job on the node (root's), which must keep running through all of it
    bystander = cluster.submit_script(site.work.parent, "bystander", "#!/bin/sh\nsleep 600\n")
    before = cluster.wait_state(bystander, "RUNNING")

    script = site.work / "tricks.sh"
    script.write_text(TRICKS.format(secret=site.secret_path))
    os.chown(script, site.eve.pw_uid, site.eve.pw_gid)
    out = site.as_eve("submit", "tricks.sh").stdout
    m = re.fullmatch(r"Submitted batch job (\d+)\n", out)
    assert m, out
    jid = int(m.group(1))
    cluster.wait_state(jid, "RUNNING")
    wait_for(lambda: (site.work / "stage-linked").exists(), what="the job to plant its link")
    (task,) = cluster.task_dirs_of(jid)
    marker = task / "control" / "checkpoint.json"
    assert marker.is_symlink() and marker.lstat().st_uid == site.eve.pw_uid

    # the agent has looked at the link (and said why it does not read it), or, as before,
    # read the root-only file through it and reported its first line as a checkpoint
    def link_seen() -> bool:
        said = f"not reading {marker} for the job: a symbolic link" in _agent_log(site)
        return said or site.secret in _everything_shown(site, jid)

    wait_for(link_seen, what="the agent to look at the job's checkpoint marker")
    shown = _everything_shown(site, jid)
    assert site.secret not in shown, shown
    assert "LastCheckpoint" not in site.as_eve("show", str(jid)).stdout  # none recorded

    # now the progress file: a FIFO
    go = site.work / "go-fifo"
    go.touch()
    os.chown(go, site.eve.pw_uid, site.eve.pw_gid)
    wait_for(lambda: (site.work / "stage-fifo").exists(), what="the job to make its FIFO")
    planted = time.time()
    progress = task / "control" / "progress.json"

    def fifo_seen() -> bool:
        if _node(site)["down"]:
            return True  # a wedged agent: judged below
        return f"not reading {progress} for the job: a FIFO" in _agent_log(site)

    wait_for(fifo_seen, what="the agent to look at the job's progress file")

    # the node's heartbeats go on well past node_down_timeout after the FIFO appeared
    def heartbeats_went_on() -> bool:
        node = _node(site)
        assert not node["down"] and node["state"] not in ("DOWN", "UNKNOWN"), node
        return float(node["last_heartbeat"] or 0) > planted + NODE_DOWN_TIMEOUT + 2

    wait_for(heartbeats_went_on, what="heartbeats past node_down_timeout", timeout=120)
    # the shepherd's hang detection (--progress-timeout of 2 s) saw no progress file to judge
    said = f"not reading {progress} for the job: a FIFO"
    shepherd_log = task / "shepherd.log"
    wait_for(
        lambda: said in shepherd_log.read_text(errors="replace"),
        what="the shepherd's hang detection to look at the progress file",
    )
    eve_job = cluster.client().job(jid)[0]
    assert eve_job["state"] == "RUNNING", eve_job
    # the bystander is still in its first attempt; a new job runs on the node
    now = cluster.client().job(bystander)[0]
    assert now["state"] == "RUNNING" and now["restart_count"] == 0, now
    assert now["start_time"] == before["start_time"], (before, now)
    after = cluster.submit_script(site.work.parent, "after", "#!/bin/sh\ntrue\n")
    assert cluster.wait_terminal([after])[after]["state"] == "COMPLETED"
    shown = _everything_shown(site, jid)
    assert site.secret not in shown, shown
    assert site.secret not in _agent_log(site)

    # the hostile job's shepherd is not wedged either: it stops the job when cancelled
    site.as_eve("cancel", str(jid))
    ended = cluster.wait_terminal([jid])[jid]
    assert ended["state"] == "CANCELLED", ended
    log = shepherd_log.read_text(errors="replace") if shepherd_log.exists() else ""
    assert site.secret not in log
    cluster.client().cancel([bystander])
    cluster.wait_terminal([bystander])
