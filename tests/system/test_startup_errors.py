"""Daemon start-up failures are one clear line and a non-zero exit; `up`/`down` leave nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from system.harness import (
    Cluster,
    agent_cgroup_roots,
    alive,
    base_env,
    cgroup_layout,
    free_port,
    phalanx_cmd,
    run_cli,
    wait_for,
)

pytestmark = pytest.mark.system

QUICK = 45.0  # seconds; interpreter start-up alone takes a few on a loaded 2-core machine


def _controller(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        phalanx_cmd("controller", "--id", "ctl-1", *args),
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=QUICK + 30,
        stdin=subprocess.DEVNULL,
    )
    return proc, time.monotonic() - t0


def _one_clear_line(proc: subprocess.CompletedProcess[str], elapsed: float, *words: str) -> str:
    assert proc.returncode != 0, f"exited 0: {proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got: {lines}"
    for w in words:
        assert w.lower() in lines[0].lower(), f"{w!r} not in {lines[0]!r}"
    assert elapsed < QUICK, f"took {elapsed:.1f}s to fail"
    return lines[0]


@pytest.mark.timeout(120)
def test_unwritable_state_dir(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("x")
    state = not_a_dir / "state"
    proc, elapsed = _controller(tmp_path, "--state-dir", str(state), "--port", str(free_port()))
    _one_clear_line(proc, elapsed, str(state), "state dir")


@pytest.mark.timeout(120)
def test_unreachable_database(tmp_path: Path) -> None:
    proc, elapsed = _controller(
        tmp_path,
        "--state-dir",
        str(tmp_path / "state"),
        "--port",
        str(free_port()),
        "--db",
        "postgresql://127.0.0.1:1/x",
    )
    _one_clear_line(proc, elapsed, "database", "127.0.0.1:1")


@pytest.mark.timeout(120)
def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc, elapsed = _controller(
            tmp_path, "--state-dir", str(tmp_path / "state"), "--port", str(port)
        )
    _one_clear_line(proc, elapsed, str(port), "in use")


@pytest.mark.timeout(180)
def test_up_detach_then_down_leaves_nothing(cluster: Cluster, tmp_path: Path) -> None:
    state = cluster.root / "up-state"  # under the cluster root, so cleanup finds it on failure
    port = free_port()
    up = run_cli(
        [
            "up",
            "--detach",
            "--json",
            "--state-dir",
            str(state),
            "--port",
            str(port),
            "--nodes",
            "4",
        ],
        root=cluster.root,
    )
    assert up.returncode == 0, up.stderr
    info = json.loads(up.stdout)
    pidfiles = {p.stem: int(p.read_text()) for p in (state / "run").glob("*.pid")}
    cluster.extra_pids.update(pidfiles.values())
    assert set(pidfiles) == {
        "controller-1",
        "authd",
        "cmdserver",  # the host's command server for the compiled Slurm commands
        *(f"agent-node0{i}" for i in range(1, 5)),
    }
    assert pidfiles == info["pids"]
    assert all(alive(pid) for pid in pidfiles.values())

    # a job that would run for a minute: `down` must stop it and its shepherd as well
    url = info["url"]
    sub = run_cli(
        ["submit", "--time=5:00", "--wrap", "sleep 60"],
        url=url,
        cwd=tmp_path,
        root=cluster.root,
        auth_socket=Path(info["auth_socket"]),
    )
    assert sub.returncode == 0, sub.stderr
    job_id = int(sub.stdout.split()[-1])

    def running_task() -> list[int] | None:
        dirs = [d for d in state.glob("nodes/*/tasks/*") if (d / "job.json").exists()]
        pids = [int(json.loads((d / "job.json").read_text())["pid"]) for d in dirs]
        return pids or None

    job_pids = wait_for(running_task, what=f"job {job_id} to start")

    # the commands find the cluster's credentials with nothing exported: `up` linked its
    # socket at the default path, which is free here unless a site's own service holds it
    published = info["published_socket"]
    if published is not None:
        assert os.readlink(published) == str(Path(info["auth_socket"]).absolute())
        p = subprocess.run(
            [sys.executable, "-m", "phalanx.slurm", "squeue", "-h", "-o", "%i"],
            env=base_env(cluster.root, PHALANX_URL=url),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0 and str(job_id) in p.stdout.split(), p.stderr
    # and the compiled commands find its command server there (a link, as the socket's)
    commands = info["published_command_socket"]
    if commands is not None:
        assert os.readlink(commands) == info["command_socket"]
    # the node names that did not resolve now do, to this host (a job's MASTER_ADDR recipe)
    for name in info["published_names"]:
        assert socket.gethostbyname(name) == "127.0.0.1", name
    shepherds = cluster.live_shepherds()
    assert shepherds
    # each agent's own cgroups (where this host has usable ones): `down` removes them too
    layout = cgroup_layout()
    node_cgroups = [
        r
        for n in range(1, 5)
        for r in agent_cgroup_roots(layout, state / "nodes" / f"node0{n}", f"node0{n}")
    ]
    assert [r for r in node_cgroups if os.path.isdir(r)] == node_cgroups

    down = run_cli(["down", "--state-dir", str(state)], root=cluster.root)
    assert down.returncode == 0, down.stderr
    assert not list((state / "run").glob("*.pid"))
    assert published is None or not os.path.lexists(published), "`down` removes its link"
    assert commands is None or not os.path.lexists(commands), "and the command server's"
    marker = f"# phalanx up {state.absolute()}"
    assert not [x for x in Path("/etc/hosts").read_text().splitlines() if x.endswith(marker)]
    everything = [*pidfiles.values(), *shepherds, *job_pids]
    wait_for(
        lambda: not [p for p in everything if alive(p)],
        timeout=30,
        what="every process of the local cluster to be gone (or a zombie)",
    )
    left = [r for r in node_cgroups if os.path.exists(r)]
    assert left == [], "`down` removes the nodes' cgroups once their jobs are gone"
