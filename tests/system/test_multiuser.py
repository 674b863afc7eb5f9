"""Real Unix users on a real local cluster: who may do what, checked as the users themselves.

The module creates two users, ``phxalice`` and ``phxbob`` (``useradd -m``, each with its own
group, and both in the supplementary group ``phxmu``), starts a controller and two agents with
the harness, and runs the ``phalanx`` CLI *as* those users (``runuser -u phxalice -- python -m
phalanx ...``), with ``PHALANX_URL`` and ``PHALANX_AUTH_SOCKET`` pointing at node01's agent
credential socket, the way a user on a cluster host would: no token, no setup, the agent tells
the controller who they are (SO_PEERCRED).

Interpreter access (the helpers for users and access are in system/unixusers.py): the project's
Python lives under /root (mode 700), where other users cannot reach it. For the module's duration /root (and any other directory on the way to the interpreter
or the sources that others cannot search, e.g. a checkout in a mode-700 temporary directory)
gets o+x (search only: nobody can list it) and its
original mode is restored afterwards, even on failure. That suffices because everything under
/root/.pyenv and /work/main/.venv is already world-readable (the fixture checks by running
``import phalanx`` as phxalice and fails with a clear message otherwise).

Everything the module makes is undone in `finally` blocks, even when a test fails: the
cluster's processes (and any process left running as the test users), the users, their home
dirs and groups, the work dir under /tmp (pytest's tmp_path is 0700, so the users could not
reach it), and /root's mode. It needs root (CI runs as root); otherwise it is skipped.
"""

from __future__ import annotations

import contextlib
import grp
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
from typing import Any

import httpx
import pytest

from phalanx.auth import keys as keyfiles
from phalanx.auth.tokens import Verifier, mint_agent, mint_token
from system.conftest import CLUSTERS
from system.harness import Cluster, base_env, wait_for
from system.unixusers import add_user, clear_leftovers, remove_user, root_searchable, sh

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="creates Unix users (useradd) and runs commands as them: root only",
    ),
]

ALICE, BOB, SHARED = "phxalice", "phxbob", "phxmu"
CLUSTER_NAME = "phalanx"  # the default [cluster] name, the audience of every credential
CLOCK_SKEW = 30.0  # the default auth.clock_skew: how far past its exp a credential still passes


# ---------------------------------------------------------------------- users and files
_sh = sh
_root_searchable = root_searchable  # test_patroni.py takes it from here


def _clear_leftovers() -> None:
    """Users and the group of a run that was killed before its cleanup (system/unixusers.py)."""
    clear_leftovers((ALICE, BOB), (SHARED,))


def _add_user(name: str) -> pwd.struct_passwd:
    return add_user(name, groups=(SHARED,))


@dataclass
class Account:
    name: str
    uid: int
    gid: int
    groups: set[int]
    work: Path  # a dir only this user can write

    @classmethod
    def of(cls, pw: pwd.struct_passwd, work: Path) -> Account:
        groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, work)


@dataclass
class Site:
    cluster: Cluster
    alice: Account
    bob: Account
    work: Path

    @property
    def socket(self) -> Path:
        return self.cluster.agent_socket("node01")

    def env(self, home: str, **extra: str) -> dict[str, str]:
        given = {
            "PHALANX_URL": self.cluster.url,
            "PHALANX_AUTH_SOCKET": str(self.socket),
            "HOME": home,
            "COLUMNS": "200",
            "NO_COLOR": "1",
        }
        return base_env(self.cluster.root, **{**given, **extra})

    def run_as(
        self,
        who: Account | None,
        argv: list[str],
        *,
        cwd: Path | None = None,
        extra: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` as `who` (root when None) with the cluster's URL and node01's socket."""
        if who is None:
            cmd, home, cwd = argv, "/root", cwd or self.work
        else:
            cmd = ["runuser", "-u", who.name, "--", *argv]
            home, cwd = pwd.getpwnam(who.name).pw_dir, cwd or who.work
        return subprocess.run(
            cmd,
            cwd=cwd,
            env=self.env(home, **(extra or {})),
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )

    def phx(
        self, who: Account | None, *args: str, ok: bool = True, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        """`phalanx ARGS` as `who`; asserts the exit status and that no traceback showed."""
        p = self.run_as(who, [sys.executable, "-m", "phalanx", *args], extra=extra)
        shown = (
            f"{who.name if who else 'root'}$ phalanx {' '.join(args)} -> {p.returncode}\n"
            f"stdout: {p.stdout}\nstderr: {p.stderr}"
        )
        assert "Traceback" not in p.stdout + p.stderr, shown
        assert (p.returncode == 0) == ok, shown
        return p


def one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    """The CLI's refusal: exactly one line on stderr, starting with 'error:'."""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr: {p.stderr!r}"
    return lines[0]


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("useradd and runuser are needed to run commands as other users")
    _clear_leftovers()
    work = Path(tempfile.mkdtemp(prefix="phx-multiuser-", dir="/tmp"))
    cluster: Cluster | None = None
    try:
        work.chmod(0o755)  # others may traverse it (the socket, their dirs) but not write
        if _sh("groupadd", SHARED).returncode != 0:
            pytest.fail(f"groupadd {SHARED} failed")
        try:
            users = []
            for name in (ALICE, BOB):
                pw = _add_user(name)
                home = work / name.removeprefix("phx")
                home.mkdir(mode=0o700)
                os.chown(home, pw.pw_uid, pw.pw_gid)
                users.append(Account.of(pw, home))
            alice, bob = users
            assert grp.getgrnam(SHARED).gr_gid in alice.groups, alice
            with _root_searchable():
                probe = _sh(
                    "runuser", "-u", ALICE, "--", sys.executable, "-c", "import phalanx, jwt, httpx"
                )
                assert probe.returncode == 0, (
                    f"{ALICE} cannot run {sys.executable} even with /root o+x: "
                    f"{probe.stderr.strip()[-500:]}"
                )
                cluster = Cluster(work / "cluster")
                cluster.root.chmod(0o755)
                cluster.start(nodes=2, cpus=2)
                yield Site(cluster, alice, bob, work)
        finally:
            if cluster is not None:
                swept = cluster.cleanup()
                if swept:
                    print(f"cleanup swept up stray processes: {swept}", file=sys.stderr)
            for name in (ALICE, BOB):
                remove_user(name)
            with contextlib.suppress(KeyError):
                grp.getgrnam(SHARED)
                _sh("groupdel", SHARED)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest, site: Site) -> None:
    """The daemons' logs go into a failing test's report (as for the `cluster` fixture)."""
    request.node.stash[CLUSTERS] = [site.cluster]


@pytest.fixture(scope="module")
def long_job(site: Site) -> int:
    """One of alice's jobs, running (sleep), submitted by her with the CLI."""
    script = site.alice.work / "long.sh"
    script.write_text(
        "#!/bin/sh\n#SBATCH --job-name=alices-secret\n#SBATCH --output=long-%j.out\n"
        "#SBATCH --time=10:00\nsleep 600\n"
    )
    os.chown(script, site.alice.uid, site.alice.gid)
    p = site.phx(site.alice, "submit", "long.sh")
    m = re.fullmatch(r"Submitted batch job (\d+)\n", p.stdout)
    assert m, p.stdout
    jid = int(m.group(1))
    site.cluster.wait_state(jid, "RUNNING")
    return jid


def _job(site: Site, jid: int) -> dict[str, Any]:
    return dict(site.cluster.client().job(jid)[0])


def _events(site: Site, jid: int) -> list[dict[str, Any]]:
    return list(site.cluster.client().job_events(jid))


# ---------------------------------------------------------------------- identity
@pytest.mark.timeout(300)
def test_whoami_is_the_unix_user(site: Site) -> None:
    p = site.phx(site.alice, "whoami")
    assert p.stdout.strip() == f"{ALICE} (user, local credential)"
    me = json.loads(site.phx(site.alice, "whoami", "--json").stdout)
    assert me == {
        "user": ALICE,
        "role": "user",
        "kind": "local",
        "uid": site.alice.uid,
        "cluster": "phalanx",
    }
    me = json.loads(site.phx(site.bob, "whoami", "--json").stdout)
    assert me == {
        "user": BOB,
        "role": "user",
        "kind": "local",
        "uid": site.bob.uid,
        "cluster": "phalanx",
    }
    # root through the same socket: root is an admin because the kernel says uid 0
    me = json.loads(site.phx(None, "whoami", "--json").stdout)
    assert me == {"user": "root", "role": "admin", "kind": "local", "uid": 0, "cluster": "phalanx"}


FETCH = r"""
import json, socket, sys
from pathlib import Path
from phalanx.auth import localsock
path = sys.argv[1]
plain = localsock.fetch(Path(path))
# ask for root's credential: the service reads nothing, the kernel says who is asking
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(path)
try:
    s.sendall(json.dumps({"user": "root", "uid": 0, "gid": 0}).encode() + b"\n")
except BrokenPipeError:
    pass  # it answered and closed before reading: nothing sent is ever read
data = b""
try:
    while chunk := s.recv(4096):
        data += chunk
except ConnectionResetError:
    pass  # it closed without reading what was sent: the reply came before, that is the end
try:
    open(sys.argv[2]).read()
    key = "read"
except PermissionError:
    key = "refused"
print(json.dumps({"plain": plain, "asked_for_root": json.loads(data), "node_key": key}))
"""


@pytest.mark.timeout(300)
def test_the_credential_socket_gives_each_user_only_their_own(site: Site) -> None:
    key_file = site.cluster.agent_dir("node01") / "node.jwks"
    assert key_file.is_file()
    p = site.run_as(site.alice, [sys.executable, "-c", FETCH, str(site.socket), str(key_file)])
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["node_key"] == "refused", "alice could read node01's key"
    verifier = Verifier(site.cluster.keys, cluster=CLUSTER_NAME)
    for how in ("plain", "asked_for_root"):
        reply = got[how]
        assert reply["user"] == ALICE, (how, reply)
        ident = verifier.verify(reply["token"])
        assert (ident.user, ident.role, ident.kind, ident.uid, ident.node) == (
            ALICE,
            "user",
            "local",
            site.alice.uid,
            "node01",
        ), (how, ident)
    # and the controller takes it for alice too
    r = httpx.get(
        site.cluster.url + "/v1/whoami",
        headers={"Authorization": f"Bearer {got['asked_for_root']['token']}"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["user"] == ALICE, r.text


# ---------------------------------------------------------------------- jobs run as their user
IDS_SCRIPT = """#!/bin/sh
#SBATCH --job-name=ids
#SBATCH --output=ids-%j.out
#SBATCH --time=2:00
{ id -u; id -g; id -G; } > ids-$SLURM_JOB_ID.txt
"""


@pytest.fixture(scope="module")
def ids_job(site: Site) -> int:
    """Alice's job that writes `id -u; id -g; id -G` to a file in her dir; ended."""
    script = site.alice.work / "ids.sh"
    script.write_text(IDS_SCRIPT)
    os.chown(script, site.alice.uid, site.alice.gid)
    p = site.phx(site.alice, "submit", "ids.sh")
    m = re.fullmatch(r"Submitted batch job (\d+)\n", p.stdout)
    assert m, p.stdout
    jid = int(m.group(1))
    site.cluster.wait_terminal([jid])
    return jid


@pytest.mark.timeout(300)
def test_the_job_record_names_its_submitter(site: Site, ids_job: int) -> None:
    job = _job(site, ids_job)
    assert job["user"] == ALICE
    listed = json.loads(site.phx(site.alice, "queue", "--all", "--json").stdout)
    assert [j["user"] for j in listed if int(j["id"]) == ids_job] == [ALICE]
    submitted = [e for e in _events(site, ids_job) if e["kind"] == "job.submit"]
    assert [e["actor"] for e in submitted] == [ALICE], _events(site, ids_job)


@pytest.mark.timeout(300)
def test_a_job_runs_with_its_users_uid_gid_and_groups(site: Site, ids_job: int) -> None:
    job = _job(site, ids_job)
    out = site.alice.work / f"ids-{ids_job}.txt"
    assert job["state"] == "COMPLETED", (job["state"], job["reason"])
    uid, gid, groups = out.read_text().splitlines()
    assert (int(uid), int(gid)) == (site.alice.uid, site.alice.gid)
    assert {int(g) for g in groups.split()} == site.alice.groups
    assert grp.getgrnam(SHARED).gr_gid in site.alice.groups
    for f in (out, site.alice.work / f"ids-{ids_job}.out"):
        st = f.stat()
        assert (st.st_uid, st.st_gid) == (site.alice.uid, site.alice.gid), f"{f} is not hers"


# ---------------------------------------------------------------------- users and others' jobs
@pytest.mark.timeout(300)
def test_bob_cannot_touch_alices_job(site: Site, long_job: int) -> None:
    before = _job(site, long_job)
    n_events = len(_events(site, long_job))
    rule = f"job {long_job} belongs to {ALICE}; {BOB} may act only on their own jobs"
    for verb in ("cancel", "hold", "release"):
        line = one_error_line(site.phx(site.bob, verb, str(long_job), ok=False))
        assert rule in line and f"({verb})" in line, line
    # nor signal it (scancel --signal, POST /v1/jobs/signal): refused with the rule, one line
    p = site.run_as(
        site.bob,
        [
            sys.executable,
            "-m",
            "phalanx.slurm",
            "scancel",
            "--signal=USR1",
            "--full",
            str(long_job),
        ],
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, (p.returncode, p.stderr)
    assert lines[0].startswith("scancel: error: ") and rule in lines[0], lines
    assert "(signal)" in lines[0], lines
    # bob sees her job exists, but not what it runs or where
    shown = site.phx(site.bob, "show", str(long_job)).stdout
    assert f"UserId={ALICE}" in shown and "JobState=RUNNING" in shown, shown
    for field in ("Command", "WorkDir", "StdOut", "StdErr"):
        assert f"{field}=(private)" in shown, shown
    assert str(site.alice.work) not in shown and "long.sh" not in shown, shown
    viewed = json.loads(site.phx(site.bob, "show", str(long_job), "--json").stdout)[0]
    assert viewed["private"] is True
    for field in ("command", "workdir", "stdout", "stderr", "submit_dir"):
        assert field not in viewed, (field, viewed)
    line = one_error_line(site.phx(site.bob, "events", str(long_job), ok=False))
    assert f"events of job {long_job} are private to {ALICE}" in line, line
    # nor around the API: the store (SQLite here) is the controller's only
    db = site.cluster.state_dir / "phalanx.db"
    for f in (db, db.with_name("phalanx.db-wal")):
        p = site.run_as(site.bob, ["cat", str(f)])
        assert p.returncode != 0 and "Permission denied" in p.stderr, (f, p.returncode, p.stderr)
    # operators' actions are not a user's either
    line = one_error_line(site.phx(site.bob, "drain", "node01", "--reason", "mine", ok=False))
    assert "draining a node needs the operator role" in line, line
    # nothing changed
    after = _job(site, long_job)
    assert (after["state"], after["reason"], after["nodelist"]) == (
        before["state"],
        before["reason"],
        before["nodelist"],
    )
    assert len(_events(site, long_job)) == n_events, _events(site, long_job)[n_events:]
    # her own view has it all
    mine = site.phx(site.alice, "show", str(long_job)).stdout
    assert f"Command={site.alice.work / 'long.sh'}" in mine, mine
    assert f"WorkDir={site.alice.work}" in mine, mine


@pytest.mark.timeout(300)
def test_anonymous_writes_are_refused(site: Site, long_job: int) -> None:
    url = site.cluster.url
    n_events = len(_events(site, long_job))
    r = httpx.post(url + "/v1/jobs/cancel", json={"jobs": [str(long_job)]}, timeout=30)
    assert r.status_code == 401, r.text
    assert r.headers.get("www-authenticate") == "Bearer"
    assert r.json()["error"]["message"] == "no credential"
    r = httpx.post(url + "/v1/nodes/node01/drain", json={"reason": "anon"}, timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(url + "/v1/jobs", json={"script": "#!/bin/sh\ntrue\n"}, timeout=30)
    assert r.status_code == 401, r.text
    assert _job(site, long_job)["state"] == "RUNNING"
    assert len(_events(site, long_job)) == n_events
    node = site.cluster.client().node("node01")
    assert "DRAIN" not in node["state"] and not node.get("drain_reason"), node


@pytest.mark.timeout(300)
def test_forged_credentials_are_refused(site: Site, long_job: int) -> None:
    url = site.cluster.url
    cluster_kid = site.cluster.keys.signing.kid
    # right key ids, wrong secrets: an admin token, and a local credential for root from node01
    forged_cluster = keyfiles.KeySet([keyfiles.Key(cluster_kid, secrets.token_bytes(32))])
    forged_node = keyfiles.KeySet(
        [keyfiles.Key(f"{cluster_kid}:node:node01", secrets.token_bytes(32))]
    )
    from phalanx.auth.tokens import mint_local

    forged = {
        "admin token": mint_token(
            forged_cluster, user="root", role="admin", cluster=CLUSTER_NAME, lifetime=600
        ),
        "local root": mint_local(
            forged_node, user="root", uid=0, gid=0, cluster=CLUSTER_NAME, lifetime=600
        ),
    }
    for what, token in forged.items():
        r = httpx.post(
            url + "/v1/jobs/cancel",
            json={"jobs": [str(long_job)]},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert r.status_code == 401, (what, r.text)
        assert "signature is invalid" in r.json()["error"]["message"], (what, r.text)
    # through the CLI (bob with a forged admin token): one line that says why
    line = one_error_line(
        site.phx(site.bob, "cancel", str(long_job), ok=False, PHALANX_TOKEN=forged["admin token"])
    )
    assert "credential signature is invalid" in line, line
    assert _job(site, long_job)["state"] == "RUNNING"


@pytest.mark.timeout(300)
def test_an_agent_credential_speaks_only_for_its_node(site: Site) -> None:
    url = site.cluster.url
    node01 = site.cluster.keys.for_scope("node", "node01")
    token = mint_agent(node01, node="node01", cluster=CLUSTER_NAME, lifetime=600)
    auth = {"Authorization": f"Bearer {token}"}
    n_jobs = len(site.cluster.client().jobs(limit=100_000))
    r = httpx.post(url + "/v1/jobs", json={"script": "#!/bin/sh\ntrue\n"}, headers=auth, timeout=30)
    assert r.status_code == 403, r.text
    assert "agent credentials (node01) may only register and report" in r.text, r.text
    for path, body in (
        ("/v1/agents/node02/heartbeat", {"tasks": []}),
        ("/v1/agents/node02/register", {"cpus": 64, "mem_mb": 1024}),
    ):
        r = httpx.post(url + path, json=body, headers=auth, timeout=30)
        assert r.status_code == 403, (path, r.text)
        assert "the agent of node01 may report only for its own node, not for node02" in r.text
    # node01's key cannot make an agent credential that names node02 either
    claims_node02 = mint_agent(node01, node="node02", cluster=CLUSTER_NAME, lifetime=600)
    r = httpx.post(
        url + "/v1/agents/node02/heartbeat",
        json={"tasks": []},
        headers={"Authorization": f"Bearer {claims_node02}"},
        timeout=30,
    )
    assert r.status_code == 401, r.text
    assert "must be signed with its own node's key" in r.text, r.text
    assert len(site.cluster.client().jobs(limit=100_000)) == n_jobs
    node02 = site.cluster.client().node("node02")
    assert node02["cpus"] == 2, node02  # the refused registration changed nothing


# ---------------------------------------------------------------------- the CLI's 401s
@pytest.mark.timeout(300)
def test_the_cli_explains_a_missing_or_expired_credential(site: Site) -> None:
    missing = site.work / "no-such-dir" / "auth.sock"
    line = one_error_line(site.phx(site.alice, "queue", ok=False, PHALANX_AUTH_SOCKET=str(missing)))
    assert line.startswith("error: no credential: "), line
    assert str(missing) in line, line  # where it looked
    assert "phalanx authd" in line and "PHALANX_TOKEN" in line, line  # what to do
    # expired beyond the tolerated clock skew (a token a few seconds stale still passes)
    expired = site.cluster.token(ALICE, lifetime=-(CLOCK_SKEW + 60))
    line = one_error_line(site.phx(site.alice, "queue", ok=False, PHALANX_TOKEN=expired))
    assert re.search(r"credential expired at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", line), line
    assert "get a new one with `phalanx token create" in line, line
    assert "$PHALANX_TOKEN" in line, line  # where the stale token came from


@pytest.mark.timeout(300)
def test_alice_may_cancel_her_own_job(site: Site, long_job: int) -> None:
    """The refusals above are about whose job it is: its owner may."""
    p = site.phx(site.alice, "cancel", str(long_job))
    assert f"job {long_job}:" in p.stdout, p.stdout
    job = site.cluster.wait_state(long_job, "CANCELLED")
    cancelled = [e for e in _events(site, long_job) if e.get("actor") == ALICE]
    assert cancelled, (job, _events(site, long_job))
    wait_for(lambda: not site.cluster.live_shepherds(), what="the job's shepherd to end")
