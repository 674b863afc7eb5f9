"""`phalanx eff`, sacct's MaxRSS/TotalCPU and `phalanx explain` on a real local cluster.

A job that burns a known amount of CPU and touches a known amount of memory must have those
figures recorded (measured by its shepherd from the attempt's cgroup or its rusage, sent by the
agent with the exit, stored per task) and shown by `eff` and `sacct`. A job held back by a
drained node, a busy node and a dependency must be explained as such through the CLI.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, base_env, run_cli, wait_for

pytestmark = pytest.mark.system

BIN = Path(sys.executable).parent
MB = 2**20

# burn ~2 s of CPU (user time, measured by the process itself) and hold 200 MB touched pages
BURN = f"""#!/bin/bash
#SBATCH --job-name=burn
#SBATCH --output=burn-%j.out
#SBATCH --time=5:00
#SBATCH --mem=1G
{sys.executable} - <<'EOF'
import time
block = bytearray(200 * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
while time.process_time() < 2.0:
    sum(range(10000))
print("cpu", time.process_time())
EOF
"""


def phx(cluster: Cluster, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    p = run_cli(list(args), url=cluster.url, cwd=cwd, root=cluster.root)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    assert p.returncode == 0, f"phalanx {' '.join(args)}: {p.stdout}{p.stderr}"
    return p


def submit(cluster: Cluster, cwd: Path, *args: str) -> int:
    p = phx(cluster, cwd, "submit", *args)
    m = re.fullmatch(r"Submitted batch job (\d+)\n", p.stdout)
    assert m, p.stdout
    return int(m.group(1))


@pytest.mark.timeout(300)
def test_usage_is_recorded_and_shown_by_eff_and_sacct(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=1, cpus=2, mem="4G")
    (tmp_path / "burn.sh").write_text(BURN)
    jid = submit(cluster, tmp_path, "burn.sh")
    job = cluster.wait_terminal([jid], timeout=180)[jid]
    out = (tmp_path / f"burn-{jid}.out").read_text()
    assert job["state"] == "COMPLETED", out
    burnt = float(out.split()[-1])
    view = cluster.client().job(jid)[0]
    usage = view["usage"]
    # where the figures came from: the attempt's cgroup where the host has one, else rusage
    assert view["attempts"][-1]["tasks"][0]["detail"]["usage"]["source"] in ("cgroup", "rusage")
    assert usage is not None and usage["measured_tasks"] == 1, usage
    # the python process alone burnt `burnt` seconds; bash and the interpreter's start add a bit
    assert burnt <= usage["cpu_time_s"] <= burnt + 3.0, (burnt, usage)
    # 200 MB touched; the interpreter and (from a cgroup) page cache add some, never 1 GB
    assert 200 * MB <= usage["max_rss_bytes"] <= 450 * MB, usage
    assert usage["mem_requested_bytes"] == 1024 * MB

    p = phx(cluster, tmp_path, "eff", str(jid))
    lines = p.stdout.splitlines()
    assert "State: COMPLETED (exit code 0)" in lines, p.stdout
    assert "Cores per node: 1" in lines, p.stdout
    cpu_line = next(x for x in lines if x.startswith("CPU Utilized: "))
    h, m, s = (int(x) for x in cpu_line.split(": ")[1].split(":"))
    assert abs(h * 3600 + m * 60 + s - usage["cpu_time_s"]) <= 1, cpu_line
    assert any(re.fullmatch(r"CPU Efficiency: \d+\.\d\d% of \d\d:\d\d:\d\d core-walltime", x)
               for x in lines), p.stdout  # fmt: skip
    mem_line = next(x for x in lines if x.startswith("Memory Utilized: "))
    assert abs(float(mem_line.split()[2]) - usage["max_rss_bytes"] / MB) < 0.01, mem_line
    assert any(x.startswith("Memory Efficiency: ") and x.endswith("of 1.00 GB") for x in lines)

    p = subprocess.run(
        [str(BIN / "sacct"), "-j", str(jid), "-o", "JobID,MaxRSS,TotalCPU", "-P"],
        env=base_env(
            cluster.root,
            PHALANX_URL=cluster.url,
            PHALANX_TOKEN_FILE=str(cluster.root / "admin.token"),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr
    rows = [r.split("|") for r in p.stdout.splitlines()]
    assert rows[0] == ["JobID", "MaxRSS", "TotalCPU"], p.stdout
    main = next(r for r in rows if r[0] == str(jid))
    assert main[1] == f"{(usage['max_rss_bytes'] + 1023) // 1024}K", p.stdout
    mm, ss = main[2].split(":")
    assert abs(int(mm) * 60 + float(ss) - usage["cpu_time_s"]) < 0.01, p.stdout


@pytest.mark.timeout(300)
def test_a_pending_job_is_explained_drained_node_busy_node_dependency(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=2, cpus=2, mem="4G")
    c = cluster.client()
    c.drain("node02", "PSU")
    (tmp_path / "long.sh").write_text(
        "#!/bin/bash\n#SBATCH --time=10:00\n#SBATCH -c 2\nsleep 300\n"
    )
    long_id = submit(cluster, tmp_path, "long.sh")
    cluster.wait_state(long_id, "RUNNING")
    (tmp_path / "next.sh").write_text("#!/bin/bash\n#SBATCH --time=5:00\n#SBATCH -c 2\ntrue\n")
    nxt = submit(cluster, tmp_path, f"--dependency=afterok:{long_id}", "next.sh")

    def explained() -> dict | None:
        p = phx(cluster, tmp_path, "explain", str(nxt), "--json")
        out = json.loads(p.stdout)
        return out if any("busy" in x for x in out["lines"]) else None

    out = wait_for(explained, timeout=60, what="the explanation of the waiting job")
    assert out["job"] == str(nxt) and out["state"] == "PENDING"
    assert out["summary"] == f"dependency afterok:{long_id} not met (job {long_id} is RUNNING)"
    head = next(x for x in out["lines"] if x.startswith("needs "))
    assert head.startswith("needs 2 CPUs"), head
    assert "2 nodes have them" in head, head
    assert re.search(r"1 is busy until ~\d\d:\d\d(:\d\d)? \(estimated\)", head), head
    assert "1 is drained: node02 'PSU' (by " in head, head

    # the plain form prints the summary, then the lines
    p = phx(cluster, tmp_path, "explain", str(nxt))
    assert p.stdout.startswith(f"job {nxt} PENDING: dependency afterok:{long_id} not met"), p.stdout
    assert "  dependency afterok:" in p.stdout

    # once the job it waits for is gone for good, explain says it can never run
    phx(cluster, tmp_path, "cancel", str(long_id))
    cluster.wait_terminal([long_id, nxt], timeout=120)
    p = phx(cluster, tmp_path, "explain", str(nxt))
    assert p.stdout.startswith(f"job {nxt} CANCELLED"), p.stdout
    assert "can never be satisfied" in p.stdout, p.stdout

    # an unknown job: one line, non-zero
    p = run_cli(["explain", "999999"], url=cluster.url, cwd=tmp_path, root=cluster.root)
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "999999" in p.stderr, p.stderr


GPU_JOB = """#!/bin/bash
#SBATCH --time=5:00
#SBATCH --gpus-per-node=2
#SBATCH --output=gpu-%j.out
# run until the agent has sampled this task's GPUs a few times (bounded: 60 s)
for i in $(seq 600); do
    if grep -q '"samples": [3-9]' "$PHX_TASK_DIR/gpu-usage.json" 2>/dev/null; then exit 0; fi
    sleep 0.1
done
echo "never sampled"
exit 1
"""


@pytest.mark.timeout(300)
def test_gpu_figures_come_from_nvml_samples(cluster: Cluster, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"gpus": [
        {"utilization": 75, "memory_used": 12 * 2**30},
        {"utilization": 25, "memory_used": 4 * 2**30},
    ]}))  # fmt: skip
    cluster.start_controller()
    cluster.start_agent(
        "node01",
        cpus=2,
        gpus="h100:2",
        env={"PHX_FAKE_NVML": str(nvml), "PHX_GPU_SAMPLE_S": "0.3"},
    )
    (tmp_path / "gpu.sh").write_text(GPU_JOB)
    jid = submit(cluster, tmp_path, "gpu.sh")
    job = cluster.wait_terminal([jid], timeout=180)[jid]
    assert job["state"] == "COMPLETED", (tmp_path / f"gpu-{jid}.out").read_text()
    p = phx(cluster, tmp_path, "eff", str(jid))
    lines = p.stdout.splitlines()
    assert "GPUs: 2" in lines, p.stdout  # (no type asked for: none named)
    util = next(x for x in lines if x.startswith("GPU Utilization: "))
    assert re.fullmatch(r"GPU Utilization: 50\.0% \(mean of \d+ samples\)", util), util
    assert "GPU Memory Utilized: 12.00 GB (peak)" in lines, p.stdout
