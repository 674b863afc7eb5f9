"""Node-side isolation with real users, real cgroups and a real cluster (docs/isolation.md).

Real Unix users are made for the module (useradd) and removed afterwards, even on failure.
The cluster lives in a directory of our own under /tmp (pytest's tmp_path is 0700 root, which
the users could not traverse to their scripts and outputs), with one 4-CPU node and a small
`[isolation] pids_max` so a fork bomb hits it quickly.  Needs root and cgroups with memory and
pids (v1 or v2); skipped otherwise, with the reason.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from phalanx.agent import cgroups
from phalanx.agent.cgroup_roots import cgroup_name
from phalanx.cli import render
from system.harness import Cluster, wait_for

NODE = "node01"
PIDS_MAX = 64
USER_A = f"phxa{uuid.uuid4().hex[:6]}"
USER_B = f"phxb{uuid.uuid4().hex[:6]}"
GROUP = f"phxg{uuid.uuid4().hex[:6]}"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, cgroups)")


def _layout() -> cgroups.Layout:
    try:
        return cgroups.ensure_parents(cgroups.detect(), "phx-probe")
    finally:
        for base in {b for b in cgroups.detect().bases.values()}:
            with contextlib.suppress(OSError):
                os.rmdir(f"{base}/phalanx/phx-probe")


@dataclass
class Env:
    cluster: Cluster
    out: Path  # world-writable (1777): the jobs' outputs
    layout: cgroups.Layout

    def node_dirs(self) -> list[str]:
        name = cgroup_name(NODE, self.cluster.agent_dir(NODE))
        return sorted(set(cgroups.node_dirs(self.layout, name).values()))

    def attempt_dirs(self, attempt: int | str) -> list[str]:
        return [f"{d}/{attempt}" for d in self.node_dirs()]

    def leftover(self) -> list[str]:
        out = []
        for d in self.node_dirs():
            with contextlib.suppress(OSError):
                out += [f"{d}/{n}" for n in os.listdir(d) if n.isdigit()]
        return out


class IsoCluster(Cluster):
    """The harness's cluster, with a config file for the [isolation] settings."""

    config_file: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**extra)
        if self.config_file is not None:
            env["PHALANX_CONFIG"] = str(self.config_file)
        return env


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[str, str]]:
    if shutil.which("useradd") is None:
        pytest.skip("no useradd here")
    made: list[str] = []
    group_made = False
    try:
        _run("groupadd", GROUP)
        group_made = True
        for u in (USER_A, USER_B):
            _run("useradd", "-m", "-s", "/bin/sh", "-G", GROUP, u)
            made.append(u)
        yield USER_A, USER_B
    finally:
        for u in made:
            subprocess.run(["pkill", "-KILL", "-u", u], capture_output=True)
            subprocess.run(["userdel", "-r", u], capture_output=True)
        if group_made:
            subprocess.run(["groupdel", GROUP], capture_output=True)


@pytest.fixture(scope="module")
def env(users: tuple[str, str]) -> Iterator[Env]:
    layout = _layout()
    if not layout.usable:
        pytest.skip(f"cgroups not usable here: {layout.describe()}")
    top = Path(tempfile.mkdtemp(prefix="phx-iso-", dir="/tmp"))
    cluster: IsoCluster | None = None
    e: Env | None = None
    try:
        top.chmod(0o755)
        out = top / "out"
        out.mkdir()
        out.chmod(0o1777)
        config = top / "phalanx.toml"
        config.write_text(f"[isolation]\npids_max = {PIDS_MAX}\n")
        cluster = IsoCluster(top / "cluster")
        cluster.config_file = config
        cluster.start_controller()
        cluster.start_agent(NODE, cpus=4, mem="2G")
        e = Env(cluster, out, layout)
        yield e
    finally:
        if cluster is not None:
            cluster.cleanup()
        if e is not None:
            for d in e.leftover():
                cgroups.remove({"dirs": [d]}, timeout=10)
            for d in e.node_dirs():
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        if not os.environ.get("PHX_ISO_KEEP"):
            shutil.rmtree(top, ignore_errors=True)


def submit(e: Env, user: str | None, script: str, shell: str = "/bin/sh", **extra: Any) -> int:
    spec: dict[str, Any] = {
        "script": f"#!{shell}\n" + script,
        "name": "iso",
        "submit_dir": str(e.out),
        "output": str(e.out / "iso-%j.out"),
        "time_limit_s": 300,
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
        **extra,
    }
    if user is None:
        return int(e.cluster.client().submit(spec)["job_id"])
    with e.cluster.client_as(user) as c:
        return int(c.submit(spec)["job_id"])


def job(e: Env, jid: int) -> dict[str, Any]:
    return e.cluster.client().job(jid)[0]


def wait_end(e: Env, jid: int) -> dict[str, Any]:
    e.cluster.wait_terminal([jid], timeout=120)
    return job(e, jid)


def output(e: Env, jid: int) -> str:
    return (e.out / f"iso-{jid}.out").read_text()


def node_ok(e: Env) -> dict[str, Any]:
    n = e.cluster.client().node(NODE)
    assert not n.get("drain"), n
    assert n["state"] in ("IDLE", "MIXED", "ALLOCATED"), n
    return n


# ----------------------------------------------------------------------------------- tests


def test_agent_reports_its_isolation_backend(env: Env) -> None:
    n = node_ok(env)
    checks = (n.get("health") or {}).get("checks") or {}
    assert checks.get("isolation", {}).get("status") == "ok", n.get("health")
    assert f"cgroup {env.layout.backend}" in checks["isolation"]["reason"]
    # and `phalanx show node` says so while the check passes
    shown = [x for x in render.node_detail(n).splitlines() if "Isolation=" in x]
    assert shown and "jobs contained by" in shown[0], render.node_detail(n)
    assert f"cgroup {env.layout.backend}" in shown[0]


def test_job_runs_as_its_user_in_its_own_cgroup_on_one_cpu(env: Env) -> None:
    pw = pwd.getpwnam(USER_A)
    mine = env.out / f"{USER_A}-file"
    jid = submit(
        env,
        USER_A,
        f'id -u; id -g; id -G; echo "$USER $LOGNAME $HOME"; nproc; echo hi > {mine}\n'
        "grep -c phalanx/ /proc/self/cgroup\n",
        cpus_per_task=1,
    )
    j = wait_end(env, jid)
    assert j["state"] == "COMPLETED", j
    lines = output(env, jid).split("\n")
    groups = sorted(os.getgrouplist(USER_A, pw.pw_gid))
    assert lines[0] == str(pw.pw_uid) and lines[1] == str(pw.pw_gid)
    assert sorted(int(g) for g in lines[2].split()) == groups
    assert grp.getgrnam(GROUP).gr_gid in groups  # the supplementary group is there
    assert lines[3] == f"{USER_A} {USER_A} {pw.pw_dir}"
    assert lines[4] == "1", "-c 1 must see exactly one CPU"
    assert int(lines[5]) >= 2, "the job runs in the attempt's cgroups"
    st = mine.stat()
    assert (st.st_uid, st.st_gid) == (pw.pw_uid, pw.pw_gid)
    assert (env.out / f"iso-{jid}.out").stat().st_uid == pw.pw_uid
    assert env.leftover() == [], "the attempt's cgroup is removed when it ends"


def test_output_the_user_may_not_write_fails_the_job_not_the_node(env: Env) -> None:
    before = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    stat = os.stat("/etc/passwd")
    jid = submit(env, USER_A, "echo pwned\n", output="/etc/passwd")
    j = wait_end(env, jid)
    assert j["state"] == "FAILED", j
    assert "cannot open output file /etc/passwd: Permission denied" in j["reason"], j
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == before
    assert os.stat("/etc/passwd").st_mtime_ns == stat.st_mtime_ns
    assert j.get("restart_count", 0) == 0
    node_ok(env)


def test_unknown_user_fails_the_job_and_leaves_the_node_alone(env: Env) -> None:
    ghost = f"phxghost{uuid.uuid4().hex[:4]}"
    jid = submit(env, ghost, "true\n")
    j = wait_end(env, jid)
    assert j["state"] == "FAILED", j
    assert f"user {ghost} is unknown on {NODE}" in j["reason"], j
    assert j.get("restart_count", 0) == 0, "not retried"
    n = node_ok(env)
    assert n.get("launch_failures", 0) == 0, n


@pytest.mark.parametrize("backend", ["v1", "v2"])
def test_memory_limit_ends_the_job_out_of_memory(env: Env, backend: str) -> None:
    if env.layout.backend != backend:
        pytest.skip(
            f"this host's agent uses cgroup {env.layout.backend} (no {backend} memory "
            "controller usable here); the other backend's plan is unit-tested over a fake tree"
        )
    # tail keeps everything after the last newline in memory: /dev/zero has none
    jid = submit(env, USER_B, "head -c 200M /dev/zero | tail > /dev/null\n", mem_mb=50)
    j = wait_end(env, jid)
    assert j["state"] == "OUT_OF_MEMORY", j
    node_ok(env)
    assert env.leftover() == []


def test_fork_bomb_is_held_while_a_neighbour_completes(env: Env) -> None:
    # bash, not dash: dash exits when a fork fails, bash retries (the bomb keeps pushing);
    # the script itself becomes a sleep, so the job runs until it is cancelled
    bomb = submit(
        env,
        USER_A,
        'echo "$PHX_ATTEMPT_ID"\nb() { b | b & }\nb\nexec sleep 600\n',
        shell="/bin/bash",
        cpus_per_task=1,
        time_limit_s=600,
    )
    attempt = wait_for(
        lambda: (t := _first_line(env, bomb)) and t.isdigit() and t,
        timeout=60,
        what="the bomb to start",
    )
    pids_dir = next(d for d in env.attempt_dirs(attempt) if d.startswith(env.layout.bases["pids"]))

    def at_limit() -> bool:
        """pids.events counts the forks the limit refused (v1 and v2 alike)."""
        with contextlib.suppress(OSError, ValueError):
            text = Path(pids_dir, "pids.events").read_text()
            events = dict(line.split() for line in text.splitlines())
            return int(events.get("max", 0)) > 0
        return False

    try:
        wait_for(at_limit, timeout=60, what="the fork bomb to reach pids.max")
    except AssertionError as e:
        tdir = env.cluster.agent_dir(NODE) / "tasks" / str(attempt)
        raise AssertionError(
            f"{e}: {job(env, bomb)['reason']} {output(env, bomb)[-300:]}"
            + env.cluster.log_tails()
            + _text(tdir / "shepherd.log")
        ) from None
    try:
        neighbour = submit(env, USER_B, "echo fine\n", cpus_per_task=1)
        j = wait_end(env, neighbour)
        assert j["state"] == "COMPLETED", j
        assert output(env, neighbour) == "fine\n"
        assert int(Path(pids_dir, "pids.current").read_text()) <= PIDS_MAX
        node_ok(env)
    finally:
        env.cluster.client().cancel([bomb])
    # cancelled (or, if every shell of the bomb gave up retrying its forks, failed by itself)
    assert wait_end(env, bomb)["state"] in ("CANCELLED", "FAILED")
    wait_for(lambda: env.leftover() == [], timeout=60, what="the bomb's cgroup to go")


def test_restarted_agent_readopts_the_job_with_its_cgroup(env: Env) -> None:
    go = env.out / f"go-{uuid.uuid4().hex[:6]}"
    jid = submit(
        env,
        USER_A,
        f'echo "$PHX_ATTEMPT_ID"\nwhile [ ! -e {go} ]; do sleep 0.2; done\necho done\n',
    )
    attempt = wait_for(
        lambda: (t := _first_line(env, jid)) and t.isdigit() and t,
        timeout=60,
        what="the job to start",
    )
    dirs = [d for d in env.attempt_dirs(attempt) if os.path.isdir(d)]
    assert len(dirs) >= 2, dirs  # memory and pids at least (v1: cpuset too)
    task = env.cluster.agent_dir(NODE) / "tasks" / str(attempt)
    main = json.loads((task / "job.json").read_text())["pid"]
    assert main in cgroups.pids(dirs[0])
    agent = env.cluster.agent(NODE)
    agent.kill(signal.SIGKILL)
    env.cluster.restart(agent)
    gone = [d for d in dirs if not os.path.isdir(d)]
    assert not gone, (
        f"the restarted agent must keep the job's cgroups: {gone}, {job(env, jid)['reason']}"
        + env.cluster.log_tails()
        + _text(task / "shepherd.log")
    )
    assert all(main in cgroups.pids(d) for d in dirs), "the job is still in its cgroups"
    # the old agent may have died before it reported the job running: the new one does
    wait_for(lambda: job(env, jid)["state"] == "RUNNING", timeout=60, what="the job RUNNING")
    go.touch()
    j = wait_end(env, jid)
    assert j["state"] == "COMPLETED", j
    assert output(env, jid).endswith("done\n")
    wait_for(lambda: not any(os.path.isdir(d) for d in dirs), timeout=60, what="cgroup removal")


def _first_line(e: Env, jid: int) -> str:
    try:
        return (e.out / f"iso-{jid}.out").read_text().split("\n", 1)[0]
    except OSError:
        return ""


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        return f"({path}: {e.strerror})"
