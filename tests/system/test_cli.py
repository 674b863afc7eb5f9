"""The `phalanx` command end to end, as a user runs it: subprocesses with $PHALANX_URL set."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from system.harness import Cluster, run_cli

pytestmark = pytest.mark.system

SCRIPT = """#!/bin/bash
#SBATCH --job-name=hello
#SBATCH --output=out-%j.txt
#SBATCH --mail-type=END
#SBATCH --time=1:00
echo "hello from $SLURM_JOB_ID on $PHX_NODENAME"
"""


class Cli:
    def __init__(self, cluster: Cluster, cwd: Path) -> None:
        self.cluster, self.cwd = cluster, cwd

    def __call__(self, *args: str, ok: bool | None = True) -> subprocess.CompletedProcess[str]:
        p = run_cli(list(args), url=self.cluster.url, cwd=self.cwd, root=self.cluster.root)
        shown = (
            f"phalanx {' '.join(args)} -> {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
        )
        assert "Traceback" not in p.stdout + p.stderr, shown
        if ok is True:
            assert p.returncode == 0, shown
        elif ok is False:
            assert p.returncode != 0, shown
        return p

    def submit(self, *args: str) -> int:
        p = self("submit", *args)
        m = re.fullmatch(r"Submitted batch job (\d+)\n", p.stdout)
        assert m, p.stdout
        return int(m.group(1))


def _script(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/bash\n" + body)
    return name


@pytest.mark.timeout(240)
def test_cli_end_to_end(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=2, cpus=2)
    c = cluster.client()
    phx = Cli(cluster, tmp_path)
    (tmp_path / "hello.sh").write_text(SCRIPT)

    # submit with #SBATCH lines; an option with no effect here is accepted with a note
    p = phx("submit", "hello.sh")
    m = re.fullmatch(r"Submitted batch job (\d+)\n", p.stdout)
    assert m, p.stdout
    hello = int(m.group(1))
    assert "--mail-type" in p.stderr and "note" in p.stderr.lower()

    # an unknown (misspelt) option is refused like sbatch, naming the line and the spelling
    (tmp_path / "typo.sh").write_text("#!/bin/bash\n#SBATCH --ntask-per-node=2\nhostname\n")
    p = phx("submit", "typo.sh", ok=False)
    assert p.stderr.strip() == (
        "error: typo.sh line 2: unknown option --ntask-per-node: did you mean --ntasks-per-node?"
    )
    assert "Submitted" not in p.stdout

    # an invalid option value fails before anything is submitted, naming the option
    n_jobs = len(c.jobs(limit=100_000))
    p = phx("submit", "--time=abc", "hello.sh", ok=False)
    assert "--time" in p.stderr and "abc" in p.stderr
    assert "Submitted" not in p.stdout

    # more than any node has: refused at submit time, with the reason
    p = phx("submit", "--cpus-per-task=64", "hello.sh", ok=False)
    assert "64" in p.stderr and "cpu" in p.stderr.lower()
    p = phx("submit", "--gres=gpu:2", "hello.sh", ok=False)
    assert "gpu" in p.stderr.lower()
    assert len(c.jobs(limit=100_000)) == n_jobs, "a refused submission created a job"

    # wait: 0 for a completed job, 1 for a failed one
    p = phx("wait", str(hello))
    assert "COMPLETED" in p.stdout
    assert (tmp_path / f"out-{hello}.txt").read_text().startswith(f"hello from {hello} on node0")
    failing = phx.submit(_script(tmp_path, "fail.sh", "exit 2\n"))
    p = phx("wait", str(failing), ok=False)
    assert p.returncode == 1
    assert "FAILED" in p.stdout and "2" in p.stdout

    # show and queue
    p = phx("show", str(hello))
    assert f"Command={tmp_path / 'hello.sh'}" in p.stdout
    assert f"WorkDir={tmp_path}" in p.stdout
    assert "JobName=hello" in p.stdout
    long = phx.submit("--time=10:00", _script(tmp_path, "long.sh", "sleep 300\n"))
    cluster.wait_state(long, "RUNNING")
    waiting = phx.submit(f"--dependency=afterok:{long}", "hello.sh")
    queue = json.loads(phx("queue", "--json").stdout)
    states = {int(j["id"]): j["state"] for j in queue}
    assert states == {long: "RUNNING", waiting: "PENDING"}, states
    everything = json.loads(phx("queue", "--all", "--json").stdout)
    assert {hello, failing, long, waiting} <= {int(j["id"]) for j in everything}

    # hold / release a pending job; then cancel the running one
    phx("hold", str(waiting))
    assert c.job(waiting)[0]["state"] == "HELD"
    phx("release", str(waiting))
    assert c.job(waiting)[0]["state"] == "PENDING"
    phx("cancel", str(long))
    cluster.wait_state(long, "CANCELLED", timeout=60)
    cluster.wait_state(waiting, ["PENDING", "CANCELLED", "FAILED"])
    if c.job(waiting)[0]["state"] == "PENDING":
        phx("cancel", str(waiting))
    cluster.wait_terminal([waiting])

    # submit --hold, then release: it runs
    held = phx.submit("--hold", "hello.sh")
    assert c.job(held)[0]["state"] == "HELD"
    phx("release", str(held))
    phx("wait", str(held), "--timeout", "90")

    # drain: the node shows it and new jobs avoid it; resume brings it back
    p = phx("drain", "node01", "--reason", "disk-check")
    nodes = phx("nodes").stdout
    row = next(ln for ln in nodes.splitlines() if ln.startswith("node01"))
    assert re.search(r"DRAIN(ED|ING)", row) and "disk-check" in row, nodes
    quick = [phx.submit(_script(tmp_path, "quick.sh", "sleep 0.2\n"))]
    quick += [
        int(r["job_id"])
        for r in c.submit_batch(
            [
                {
                    "script": "#!/bin/bash\nsleep 0.2\n",
                    "submit_dir": str(tmp_path),
                    "output": str(tmp_path / "q-%j.out"),
                    "time_limit_s": 60,
                }
            ]
            * 5
        )
    ]
    done = cluster.wait_terminal(quick)
    assert {j["nodelist"] for j in done.values()} == {"node02"}, done
    assert {j["state"] for j in done.values()} == {"COMPLETED"}
    p = phx("resume", "node01")
    assert "node01" in p.stdout
    row = next(ln for ln in phx("nodes").stdout.splitlines() if ln.startswith("node01"))
    assert "DRAIN" not in row and "IDLE" in row, row
    on1 = phx.submit("--nodelist=node01", "hello.sh")
    phx("wait", str(on1), "--timeout", "90")
    assert c.job(on1)[0]["nodelist"] == "node01"
