"""An ordinary user on a shared cluster, trying what an attacker would, as a real Unix user.

The module makes three users (``phxmal``, who attacks, ``phxvic``, a victim sharing the
cluster, and ``phxflood``, who floods the queue), starts a real cluster (controller and agent, a small submission burst), and runs
the commands *as* them (``runuser``), authenticated by the node's credential socket as users
on a cluster host are. One test per hole the attacker found in the API's policy
(docs/security.md, "Threat model"); each failed before its fix:

- releasing a hold an operator placed on their own job;
- jumping the queue with ``--priority`` or a negative ``--nice``;
- flooding the queue with an array that cost one token of the submission rate limit;
- control characters in a job name or comment, which reached other users' terminals through
  ``squeue``/``scontrol``;
- another user's private paths, read from the node's page (a launch error names them);
- per-user job counts on the public ``/metrics``.

The holes of the node side (a job's links and FIFOs: test_job_files.py), of the HTTP server
(sizes, depths, slow clients: test_hostile_clients.py) and of the srun helper's socket
(tests/unit/test_srun_helper.py) have their own tests.

Needs root (useradd, runuser); everything it makes is removed even when it fails: the
cluster's processes and the users', the users and their homes, the work dir under /tmp, and
the modes of the directories above the interpreter (system/unixusers.py).
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from system.conftest import CLUSTERS
from system.harness import Cluster, base_env, wait_for
from system.unixusers import can_import, root_searchable, temporary_users

pytestmark = pytest.mark.system

MAL, VIC = "phxmal", "phxvic"
FLOOD = "phxflood"  # floods the queue: left in debt with the rate limit, so nobody else is
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
BURST = 50  # [limits] submit_burst: a user's submissions in a burst (admins are exempt)
CONFIG = f"""
[limits]
submit_rate = 0.5
submit_burst = {BURST}
"""


@dataclass
class Site:
    cluster: Cluster
    users: dict[str, pwd.struct_passwd]
    work: Path  # /tmp/phx-hostile-*/: one 0700 directory per user in it

    def home(self, user: str) -> Path:
        return self.work / user

    def run(self, user: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A command (`phalanx ...` or a Slurm command) as `user` on the node, with the node's
        credential socket, as on a cluster host."""
        env = base_env(
            self.cluster.root,
            PHALANX_URL=self.cluster.url,
            PHALANX_AUTH_SOCKET=str(self.cluster.agent_socket("node01")),
            HOME=self.users[user].pw_dir,
            PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",
            COLUMNS="200",
            NO_COLOR="1",
        )
        argv = [sys.executable, "-m", "phalanx", *cmd[1:]] if cmd[0] == "phalanx" else list(cmd)
        p = subprocess.run(
            [RUNUSER, "-u", user, "--", *argv],
            cwd=self.home(user),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert "Traceback" not in p.stderr, (cmd, p.stdout, p.stderr)
        if check:
            assert p.returncode == 0, (cmd, p.stdout, p.stderr)
        return p

    def script(self, user: str, name: str, body: str) -> Path:
        path = self.home(user) / name
        path.write_text("#!/bin/sh\n" + body)
        os.chown(path, self.users[user].pw_uid, self.users[user].pw_gid)
        return path

    def submit(self, user: str, *options: str, script: str = "job.sh") -> int:
        out = self.run(user, "phalanx", "submit", *options, script).stdout
        m = re.search(r"Submitted batch job (\d+)", out)
        assert m, out
        return int(m.group(1))


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    top = Path(tempfile.mkdtemp(prefix="phx-hostile-", dir="/tmp"))
    cluster: Cluster | None = None
    try:
        top.chmod(0o755)  # the users traverse it to their dirs and the agent's socket
        with temporary_users([MAL, VIC, FLOOD]) as users, root_searchable():
            for u in users:
                can_import(u.pw_name)
                d = top / u.pw_name
                d.mkdir(mode=0o700)
                os.chown(d, u.pw_uid, u.pw_gid)
            cluster = Cluster(top / "cluster")
            cluster.root.chmod(0o755)
            config = cluster.root / "phalanx.toml"
            config.write_text(CONFIG)
            cluster.extra_env["PHALANX_CONFIG"] = str(config)
            cluster.start(nodes=1, cpus=4)
            s = Site(cluster, {u.pw_name: u for u in users}, top)
            for name in (MAL, VIC, FLOOD):
                s.script(name, "job.sh", "sleep 600\n")
            try:
                yield s
            finally:
                swept = cluster.cleanup()
                if swept:
                    print(f"cleanup swept up stray processes: {swept}", file=sys.stderr)
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(autouse=True)
def _logs_on_failure(site: Site, request: pytest.FixtureRequest) -> None:
    request.node.stash[CLUSTERS] = [site.cluster]


def state(site: Site, jid: int) -> str:
    return str(site.cluster.client().job(jid)[0]["state"])


@pytest.mark.timeout(300)
def test_a_user_cannot_release_an_operators_hold(site: Site) -> None:
    blocker = site.submit(MAL, "--exclusive")  # the node is busy: what follows waits
    site.cluster.wait_state(blocker, "RUNNING")
    jid = site.submit(MAL)
    assert state(site, jid) == "PENDING"
    assert site.cluster.client().hold([jid]) == {str(jid): "held"}  # root: an admin hold
    said = site.run(MAL, "phalanx", "release", str(jid), check=False)
    assert "admin hold" in said.stdout + said.stderr, said
    assert state(site, jid) == "HELD"
    site.run(MAL, "scontrol", "release", str(jid), check=False)
    assert state(site, jid) == "HELD"
    # a hold of their own they may release
    own = site.submit(MAL)
    site.run(MAL, "phalanx", "hold", str(own))
    assert state(site, own) == "HELD"
    site.run(MAL, "phalanx", "release", str(own))
    assert state(site, own) == "PENDING"
    site.cluster.client().cancel([blocker, jid, own])


@pytest.mark.timeout(300)
def test_a_user_cannot_jump_the_queue(site: Site) -> None:
    c = site.cluster.client()
    before = {int(j["id"]) for j in c.jobs(user=MAL, limit=100_000)}
    for option in ("--priority=1000000", "--nice=-10000"):
        p = site.run(MAL, "phalanx", "submit", "--hold", option, "job.sh", check=False)
        assert p.returncode != 0 and "Submitted" not in p.stdout, (option, p.stdout)
        assert "operator" in p.stderr or "admin" in p.stderr, (option, p.stderr)
    p = site.run(MAL, "sbatch", "-H", "--priority=1000000", "job.sh", check=False)
    assert p.returncode != 0 and "Submitted" not in p.stdout, p
    assert {int(j["id"]) for j in c.jobs(user=MAL, limit=100_000)} == before
    polite = site.submit(MAL, "--hold", "--nice=100")  # lowering one's own standing is fine
    assert c.job(polite)[0]["state"] == "HELD"
    c.cancel([polite])


@pytest.mark.timeout(300)
def test_an_array_costs_the_rate_limit_one_token_a_task(site: Site) -> None:
    """One array of four times the burst goes in (as Slurm's does), and leaves the user in
    debt: the next submission is refused for now, with the limit to raise named."""
    c = site.cluster.client()
    site.run(FLOOD, "phalanx", "submit", "--hold", f"--array=0-{BURST * 4 - 1}", "job.sh")
    p = site.run(FLOOD, "phalanx", "submit", "--hold", "job.sh", check=False)
    assert p.returncode != 0, p.stdout
    assert "rate limit" in p.stderr, p.stderr
    c.cancel([str(j["id"]) for j in c.jobs(user=FLOOD, limit=100_000)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "option",
    ["--job-name=\x1b]0;owned\x07\x1b[2Jx", "--comment=ok\r\x1b[1Aforged line"],
)
def test_control_characters_never_reach_another_users_terminal(site: Site, option: str) -> None:
    before = {int(j["id"]) for j in site.cluster.client().jobs(user=MAL, limit=100_000)}
    p = site.run(MAL, "phalanx", "submit", "--hold", option, "job.sh", check=False)
    assert p.returncode != 0 and "control character" in p.stderr, (p.stdout, p.stderr)
    p = site.run(MAL, "sbatch", "-H", option, "job.sh", check=False)
    assert p.returncode != 0, p.stdout
    after = {int(j["id"]) for j in site.cluster.client().jobs(user=MAL, limit=100_000)}
    assert after == before
    shown = site.run(VIC, "squeue", "-a").stdout + site.run(VIC, "phalanx", "queue").stdout
    assert "\x1b" not in shown and "\r" not in shown


@pytest.mark.timeout(300)
def test_another_users_paths_stay_off_the_node_page(site: Site) -> None:
    """The victim's job fails to launch on node01 (its output directory is missing); the
    launch error names the victim's paths. The attacker reads the node's page."""
    secret = f"project-{secrets.token_hex(6)}"
    jid = site.submit(VIC, f"--output={site.home(VIC)}/{secret}/missing/%j.out")
    wait_for(  # the launch failed on node01; an operator sees why on the node's page
        lambda: secret in json.dumps(site.cluster.client().node("node01")),
        what="the launch failure to reach node01's events",
    )
    mine = site.run(VIC, "phalanx", "show", str(jid)).stdout
    assert secret in mine  # the owner sees why
    page = site.run(MAL, "phalanx", "show", "node", "node01").stdout
    assert "node01" in page
    assert secret not in page, page
    api = site.run(MAL, "phalanx", "show", "node", "node01", "--json").stdout
    assert secret not in api
    site.cluster.client().cancel([jid])


@pytest.mark.timeout(300)
def test_the_public_metrics_name_no_user(site: Site) -> None:
    jid = site.submit(VIC, "--hold")
    text = httpx.get(site.cluster.url + "/metrics", timeout=30).text
    assert "phalanx_jobs" in text  # it is the real page
    assert VIC not in text and MAL not in text
    site.cluster.client().cancel([jid])
