"""`phalanx sim` at the issue's size: a simulated 1,000-node cluster runs a 10,000-job workload
to completion against a real controller and store, every job ending in one terminal state."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from phalanx.domain.states import TERMINAL
from phalanx.sim import workload as wl
from phalanx.sim.run import Options, Sim

WORKLOAD = """
seed = 11
[[nodes]]
share = 0.8
cpus = 8
mem = "32G"
[[nodes]]
share = 0.2
cpus = 16
mem = "128G"
gpus = 8
gpu_type = "h100"
[[users]]
name = "alice"
account = "physics"
[[users]]
name = "bob"
account = "physics"
[[users]]
name = "carol"
account = "ml"
[[jobs]]
name = "single"
count = 5000
users = ["alice", "bob"]
duration = [0.1, 0.4]
[[jobs]]
name = "sweep"
count = 4800
array = 200
users = ["bob", "alice"]
duration = [0.1, 0.4]
[[jobs]]
name = "train"
count = 200
nodes = 4
gpus_per_node = 8
gpu_type = "h100"
users = ["carol"]
duration = [0.2, 0.8]
[failures]
task_fail_rate = 0.01
node_stop_fraction = 0.003
node_stop_window = [2, 10]
"""


@pytest.mark.soak  # make soak: minutes on the 2-core machine
@pytest.mark.timeout(2400)  # a busy 2-core machine: the conditions end the waits, not this
def test_thousand_nodes_run_ten_thousand_jobs_to_one_terminal_state_each(tmp_path: Path) -> None:
    path = tmp_path / "workload.toml"
    path.write_text(WORKLOAD)
    work = wl.load(path)
    assert work.total_jobs == 10_000
    # how many tasks the workload makes exit 1 (each array task runs its array's command)
    failing = 0
    for _user, spec in work.submissions():
        tasks = int(spec["array"].split("-")[1]) + 1 if "array" in spec else 1
        if re.search(r"exit 1\b", spec["wrap"]):
            failing += tasks
    sim = Sim(
        Options(
            nodes=1000,
            workload=work,
            state_dir=tmp_path / "sim",
            timeout=1800.0,  # generous: the condition ends the wait, not the clock
            timing={"heartbeat_budget": 100.0},
        )
    )
    try:
        sim.start()
        result = sim.run()
        engine = sa.create_engine(sim.db)
        with engine.connect() as c:
            rows = c.execute(sa.text("SELECT state, count(*) FROM jobs GROUP BY state")).all()
            states: dict[str, int] = {str(k): int(v) for k, v in rows}
            live = c.execute(
                sa.text("SELECT count(*) FROM attempts WHERE state != 'ENDED'")
            ).scalar_one()
            down = {str(r[0]) for r in c.execute(sa.text("SELECT name FROM nodes WHERE down"))}
        engine.dispose()
    finally:
        sim.close()
    assert sum(states.values()) == 10_000, states
    assert set(states) <= {s.value for s in TERMINAL}, states  # one terminal state each
    assert live == 0  # no attempt left holding a node
    assert result.not_terminal == 0
    # the injected task failures fail their jobs; nothing else fails
    assert states.get("FAILED", 0) == failing, (states, failing)
    assert states.get("COMPLETED", 0) + states.get("NODE_FAIL", 0) == 10_000 - failing
    # the nodes stopped on purpose were found DOWN, and no other node was
    stopped = {ln.split()[0] for ln in sim.stopped_file.read_text().splitlines() if ln}
    assert len(stopped) == 3
    assert result.false_down == 0 and down <= stopped, (down, stopped)
    assert result.placements >= 10_000


def test_phalanx_sim_command_prints_its_summary_line(tmp_path: Path) -> None:
    path = tmp_path / "small.toml"
    path.write_text(
        "[[nodes]]\ncpus = 4\nmem = '8G'\n"
        "[[jobs]]\ncount = 60\nduration = [0.1, 0.3]\n"
        "[[jobs]]\ncount = 40\narray = 20\nduration = 0.2\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "phalanx", "sim", "--nodes", "10", "--workload", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(
        r"sim: nodes=10 jobs=100 placements_per_s=\d+ false_down=0 controller_cpu=\d+% "
        r"detect_timeout=10s",
        last,
    )
    assert m, out.stdout
    assert "COMPLETED 100" in out.stdout


def test_phalanx_sim_refuses_a_bad_workload_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[[jobs]]\ncount = 0\n")
    out = subprocess.run(
        [sys.executable, "-m", "phalanx", "sim", "--workload", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "phalanx sim: jobs[0]: count must be a whole number from 1 to 10000000, not 0"
    )
