"""`make demo`: a local Phalanx cluster running a small mixed workload, shown as it drains.

It runs the same `phalanx` commands a user would type (each is printed before it runs):
start a 4-node cluster on SQLite, submit an array, a dependency chain, a multi-node job and a
job that fails, watch the queue, show the final states and outputs, and stop the cluster.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "demo-state"
STATE = WORK / "cluster"
JOBS = WORK / "jobs"
PHALANX = [sys.executable, "-m", "phalanx"]


def free_port(preferred: int = 6817) -> int:
    for port in [preferred, 0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise SystemExit("no free port")


def run(*args: str, capture: bool = False, check: bool = True) -> str:
    print(f"\n$ phalanx {shlex.join(args)}", flush=True)
    res = subprocess.run([*PHALANX, *args], cwd=JOBS, text=True, capture_output=capture)
    if capture:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
    if check and res.returncode != 0:
        raise SystemExit(f"`phalanx {shlex.join(args)}` failed with code {res.returncode}")
    return res.stdout if capture else ""


def job_id(out: str) -> str:
    return out.strip().split()[-1]


def write_scripts() -> None:
    JOBS.mkdir(parents=True, exist_ok=True)
    scripts = {
        "array.sh": """\
            #!/bin/bash
            #SBATCH --job-name=sweep
            #SBATCH --array=0-11%4
            #SBATCH --time=2:00
            #SBATCH --cpus-per-task=1
            #SBATCH --output=sweep-%A_%a.out
            #SBATCH --mail-type=END
            echo "task $SLURM_ARRAY_TASK_ID of array $SLURM_ARRAY_JOB_ID on $SLURMD_NODENAME"
            sleep 1
            """,
        "prepare.sh": """\
            #!/bin/bash
            #SBATCH --job-name=prepare
            #SBATCH --output=chain-%j.out
            echo "preparing data" > data.txt
            sleep 1
            """,
        "train.sh": """\
            #!/bin/bash
            #SBATCH --job-name=train
            #SBATCH --nodes=2
            #SBATCH --cpus-per-task=2
            #SBATCH --output=train-%j.out
            echo "batch step on $SLURMD_NODENAME: $SLURM_NNODES nodes ($SLURM_JOB_NODELIST), $SLURM_NTASKS tasks"
            srun bash -c 'echo "rank $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME, master $MASTER_ADDR:$MASTER_PORT"'
            sleep 1
            """,
        "report.sh": """\
            #!/bin/bash
            #SBATCH --job-name=report
            #SBATCH --output=chain-%j.out
            echo "report after training: $(cat data.txt)"
            """,
        "broken.sh": """\
            #!/bin/bash
            #SBATCH --job-name=broken
            #SBATCH --output=broken-%j.out
            echo "this job fails on purpose" >&2
            exit 3
            """,
    }
    for name, body in scripts.items():
        (JOBS / name).write_text(textwrap.dedent(body))


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    os.environ["PHALANX_URL"] = url
    # commands below get their credential from the local cluster's credential service
    os.environ["PHALANX_AUTH_SOCKET"] = str(STATE.absolute() / "auth.sock")
    # srun, sbatch, ... (installed with the package) on the jobs' PATH, as on a cluster's nodes
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    write_scripts()
    run(
        "up",
        "--detach",
        "--nodes",
        "4",
        "--cpus",
        "4",
        "--mem",
        "8G",
        "--state-dir",
        str(STATE),
        "--port",
        str(port),
    )
    try:
        run("nodes")
        array = job_id(run("submit", "array.sh", capture=True))
        prep = job_id(run("submit", "prepare.sh", capture=True))
        train = job_id(run("submit", f"--dependency=afterok:{prep}", "train.sh", capture=True))
        report = job_id(run("submit", f"--dependency=afterok:{train}", "report.sh", capture=True))
        broken = job_id(run("submit", "broken.sh", capture=True))
        terminal = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            out = subprocess.run(
                [*PHALANX, "queue", "--all", "--json"], capture_output=True, text=True
            )
            jobs = json.loads(out.stdout or "[]")
            active = [j for j in jobs if j["state"] not in terminal]
            print(
                f"\n--- {time.strftime('%H:%M:%S')}: {len(active)} of {len(jobs)} jobs not finished"
            )
            run("queue")
            if not active:
                break
            time.sleep(1.5)
        run("queue", "--all")
        run("show", train)
        run("wait", report)
        run("wait", broken, check=False)
        run("events", broken)
        print("\nOutputs:")
        for f in sorted(JOBS.glob("*.out")):
            print(f"--- {f.name}\n{f.read_text().rstrip()}")
        print(f"\nArray {array}, chain {prep} -> {train} -> {report}, failing job {broken}: done.")
    finally:
        run("down", "--state-dir", str(STATE), check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
