"""sbatch, squeue, scancel and sinfo end to end: real processes against a real local cluster,
their output checked byte for byte where tools parse it (docs/slurm.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from system.harness import Cluster, base_env, run_cli, wait_for

pytestmark = pytest.mark.system

TRAP = """#!/bin/bash
#SBATCH --job-name=trapper
#SBATCH --time=10:00
trap 'echo "USR1 at $(date +%s)" >> trapped-$SLURM_JOB_ID.txt' USR1
echo ready > ready-$SLURM_JOB_ID.txt
for i in $(seq 300); do sleep 1; done
"""


def slurm(
    cluster: Cluster, cwd: Path, command: str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command as a user would, with the cluster's URL and admin credentials."""
    extra = {"PHALANX_URL": cluster.url}
    if (cluster.root / "admin.token").is_file():
        extra["PHALANX_TOKEN_FILE"] = str(cluster.root / "admin.token")
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", command, *args],
        cwd=cwd,
        env=base_env(cluster.root, **extra),
        capture_output=True,
        text=True,
        timeout=180,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )
    assert "Traceback" not in p.stdout + p.stderr, (command, args, p.stdout, p.stderr)
    return p


def _submitted(p: subprocess.CompletedProcess[str], rc: int = 0) -> int:
    m = re.fullmatch(r"Submitted batch job (\d+)\n", p.stdout)
    assert m and p.returncode == rc, (p.returncode, p.stdout, p.stderr)
    return int(m.group(1))


@pytest.mark.timeout(300)
def test_sbatch_forms_and_exit_codes(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=2, cpus=2)
    c = cluster.client()
    (tmp_path / "ok.sh").write_text("#!/bin/bash\necho fine\n")

    # --parsable: the id and a newline, nothing else (jid=$(sbatch --parsable ...))
    p = slurm(cluster, tmp_path, "sbatch", "--parsable", "ok.sh")
    assert p.returncode == 0 and re.fullmatch(r"\d+\n", p.stdout), (p.stdout, p.stderr)
    parsable = int(p.stdout)
    assert c.job(parsable)[0]["job_id"] == str(parsable)
    # phalanx submit --parsable is real too
    p = run_cli(["submit", "--parsable", "ok.sh"], url=cluster.url, cwd=tmp_path, root=cluster.root)
    assert p.returncode == 0 and re.fullmatch(r"\d+\n", p.stdout), (p.stdout, p.stderr)

    # Slurm's default output files: slurm-<id>.out, slurm-<array id>_<task>.out for arrays
    assert cluster.wait_terminal([parsable])[parsable]["state"] == "COMPLETED"
    assert (tmp_path / f"slurm-{parsable}.out").read_text() == "fine\n"
    arr = _submitted(
        slurm(cluster, tmp_path, "sbatch", "--array=1-2", "--wrap=echo task $SLURM_ARRAY_TASK_ID")
    )
    wait_for(
        lambda: all(
            (tmp_path / f"slurm-{arr}_{i}.out").is_file()
            and (tmp_path / f"slurm-{arr}_{i}.out").read_text() == f"task {i}\n"
            for i in (1, 2)
        ),
        what="both array tasks' output files",
    )

    # the script on stdin; the job is named "sbatch", as Slurm names it
    jid = _submitted(
        slurm(cluster, tmp_path, "sbatch", "-o", "stdin-%j.out", stdin="#!/bin/bash\necho in\n")
    )
    done = cluster.wait_terminal([jid])[jid]
    assert done["state"] == "COMPLETED" and done["name"] == "sbatch", done
    assert (tmp_path / f"stdin-{jid}.out").read_text() == "in\n"
    p = slurm(cluster, tmp_path, "sbatch", stdin="")
    assert p.returncode == 1 and p.stderr == "sbatch: error: Batch script is empty!\n"

    # --wrap; --wait returns when the job has ended, with Slurm's exit status
    p = slurm(cluster, tmp_path, "sbatch", "--wait", "--wrap=exit 3")
    wrapped = _submitted(p, rc=3)
    job = c.job(wrapped)[0]
    assert job["state"] == "FAILED" and job["exit_code"] == 3 and job["name"] == "wrap", job
    p = slurm(cluster, tmp_path, "sbatch", "-W", "--parsable", "--wrap=echo ok")
    assert p.returncode == 0 and re.fullmatch(r"\d+\n", p.stdout), (p.stdout, p.stderr)
    assert c.job(int(p.stdout))[0]["state"] == "COMPLETED"
    p = run_cli(
        ["submit", "--wait", "--wrap=exit 5"], url=cluster.url, cwd=tmp_path, root=cluster.root
    )
    assert p.returncode == 5 and p.stdout.startswith("Submitted batch job "), p.stderr

    # --test-only validates on the controller and submits nothing
    before = len(c.jobs(limit=100_000))
    p = slurm(cluster, tmp_path, "sbatch", "--test-only", "ok.sh")
    assert p.returncode == 0 and p.stdout == "" and "would be accepted" in p.stderr, p.stderr
    p = slurm(cluster, tmp_path, "sbatch", "--test-only", "-c", "64", "ok.sh")
    assert p.returncode == 1 and p.stderr.startswith("sbatch: error: "), p.stderr
    assert len(c.jobs(limit=100_000)) == before

    # -M/--clusters: this cluster's name or "all", as workflow tools pass it on every call
    name = c.get("/v1/whoami")["cluster"]
    p = slurm(cluster, tmp_path, "sbatch", "--parsable", "-M", "all", "--wrap=true")
    assert p.returncode == 0 and re.fullmatch(rf"(\d+);{name}\n", p.stdout), (p.stdout, p.stderr)
    on = int(p.stdout.split(";")[0])
    p = slurm(cluster, tmp_path, "sbatch", f"--clusters={name}", "--wrap=true")
    assert re.fullmatch(rf"Submitted batch job \d+ on cluster {name}\n", p.stdout), p.stdout
    cluster.wait_terminal([on])
    p = slurm(
        cluster, tmp_path, "sacct", "-X", "--parsable2", "--clusters", "all", "--noheader",
        "--format=JobIdRaw,State", "-j", str(on),
    )  # fmt: skip
    assert (p.returncode, p.stdout) == (0, f"{on}|COMPLETED\n"), p.stderr
    # long options shortened to unique prefixes, as getopt_long takes them
    p = slurm(cluster, tmp_path, "sacct", "-X", "--parsable2", "--clus=all", "--nohead",
              "--form=JobIdRaw,State", "-j", str(on))  # fmt: skip
    assert (p.returncode, p.stdout) == (0, f"{on}|COMPLETED\n"), p.stderr
    p = slurm(cluster, tmp_path, "squeue", "--st=R")
    assert p.returncode == 1 and p.stderr.startswith("squeue: option '--st=R' is ambiguous"), (
        p.stderr
    )
    p = slurm(cluster, tmp_path, "squeue", "-M", "all", "-h", "-j", str(on))
    assert (p.returncode, p.stdout) == (0, f"CLUSTER: {name}\n"), p.stderr
    p = slurm(cluster, tmp_path, "sinfo", "-M", name, "-h", "-o", "%P")
    assert p.returncode == 0 and p.stdout.startswith(f"CLUSTER: {name}\n"), p.stderr
    for cmd in ("squeue", "sacct", "sinfo", "scancel"):
        p = slurm(cluster, tmp_path, cmd, "-M", "elsewhere", *(["1"] if cmd == "scancel" else []))
        assert p.returncode == 1 and p.stdout == "", (cmd, p.stdout)
        assert p.stderr.startswith(f"{cmd}: error: 'elsewhere' can't be reached now"), p.stderr

    # --begin: pending with reason BeginTime until then, as Slurm shows it
    later = int(
        slurm(cluster, tmp_path, "sbatch", "--parsable", "--begin=now+1hour", "ok.sh").stdout
    )
    wait_for(
        lambda: (
            slurm(cluster, tmp_path, "squeue", "-h", "-o", "%r", "-j", str(later)).stdout
            == "BeginTime\n"
        ),
        what="squeue to show BeginTime",
    )
    t0 = time.time()
    soon = _submitted(slurm(cluster, tmp_path, "sbatch", "-b", "now+3", "ok.sh"))
    job = cluster.wait_terminal([soon])[soon]
    assert job["state"] == "COMPLETED" and job["start_time"] >= t0 + 2.9, (job, t0)
    assert slurm(cluster, tmp_path, "scancel", str(later)).returncode == 0
    p = slurm(cluster, tmp_path, "sbatch", "--begin=whenever", "ok.sh")
    assert p.returncode == 1 and "--begin" in p.stderr and len(p.stderr.splitlines()) == 1

    # options Slurm has but Phalanx cannot honour are named, one line, exit 1
    p = slurm(cluster, tmp_path, "sbatch", "--input=data.txt", "ok.sh")
    assert p.returncode == 1 and "--input" in p.stderr and len(p.stderr.splitlines()) == 1


@pytest.mark.timeout(300)
def test_squeue_scancel_sinfo(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=2, cpus=2)
    c = cluster.client()
    (tmp_path / "trap.sh").write_text(TRAP)
    trapper = _submitted(slurm(cluster, tmp_path, "sbatch", "trap.sh"))
    held = _submitted(slurm(cluster, tmp_path, "sbatch", "-H", "-J", "waiting", "--wrap=true"))
    cluster.wait_state(trapper, "RUNNING")
    wait_for(lambda: (tmp_path / f"ready-{trapper}.txt").exists(), what="the trap to be set")

    # default columns, Slurm's header
    p = slurm(cluster, tmp_path, "squeue")
    lines = p.stdout.splitlines()
    assert lines[0] == (
        "             JOBID PARTITION     NAME     USER ST       TIME  NODES NODELIST(REASON)"
    )
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows[str(held)].endswith(" PD       0:00      1 (JobHeldUser)"), rows
    running = c.job(trapper)[0]
    assert re.fullmatch(
        rf" +{trapper} +{running['partition']} +trapper +{running['user']} +R +\d+:\d\d +1 "
        + re.escape(running["nodelist"]),
        rows[str(trapper)],
    ), rows

    # -o with fields checked one by one against the job record
    fmt = "%i|%j|%u|%T|%t|%l|%D|%R|%P|%N|%A|%a|%C|%b|%r|%S|%V"
    p = slurm(cluster, tmp_path, "squeue", "-h", "-j", str(trapper), "-o", fmt)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 1, p.stdout
    got = dict(zip(fmt.replace("%", "").split("|"), p.stdout.rstrip("\n").split("|"), strict=True))
    assert got == {
        "i": str(trapper),
        "j": "trapper",
        "u": running["user"],
        "T": "RUNNING",
        "t": "R",
        "l": "10:00",
        "D": "1",
        "R": running["nodelist"],
        "P": running["partition"],
        "N": running["nodelist"],
        "A": str(trapper),
        "a": "default",  # %a: the account (the default one here)
        "C": str(running["cpus_per_node"]),
        "b": "N/A",
        "r": "None",
        "S": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(running["start_time"])),
        "V": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(running["submit_time"])),
    }
    # scripts tag running jobs: scontrol update Comment= / JobName=, as Slurm allows them
    p = slurm(cluster, tmp_path, "scontrol", "update", f"JobId={trapper}", "Comment=epoch 3")
    assert p.returncode == 0, p.stderr
    p = slurm(cluster, tmp_path, "scontrol", "update", f"JobId={trapper}", "JobName=trap2")
    assert p.returncode == 0, p.stderr
    p = slurm(cluster, tmp_path, "squeue", "-h", "-j", str(trapper), "-o", "%k|%j")
    assert p.stdout == "epoch 3|trap2\n", p.stdout
    p = slurm(cluster, tmp_path, "scontrol", "update", f"JobId={trapper}", "TimeLimit=5")
    assert p.returncode == 1 and "only a pending job" in p.stderr, p.stderr
    p = slurm(cluster, tmp_path, "scontrol", "update", f"JobId={trapper}", "JobName=trapper")
    assert p.returncode == 0, p.stderr  # (the name the checks below filter on)

    # -t by code; -u; -n
    p = slurm(cluster, tmp_path, "squeue", "-h", "-t", "PD", "-o", "%i")
    assert p.stdout == f"{held}\n"
    me = running["user"]
    p = slurm(cluster, tmp_path, "squeue", "-h", "-n", "trapper", "-u", me, "-o", "%.8i")
    assert p.stdout == f"{trapper:>8}\n"
    p = slurm(cluster, tmp_path, "squeue", "-t", "bogus")
    assert p.returncode == 1 and p.stderr == "squeue: error: Invalid job state specified: bogus\n"

    # scancel --signal=USR1 --batch: the batch shell's trap runs; the job keeps running
    p = slurm(cluster, tmp_path, "scancel", "--signal=USR1", "--batch", str(trapper))
    assert p.returncode == 0 and p.stdout == p.stderr == "", p.stderr
    trapped = tmp_path / f"trapped-{trapper}.txt"
    wait_for(trapped.exists, what="the USR1 trap to write its file")
    assert c.job(trapper)[0]["state"] == "RUNNING"
    # a second signal is a second delivery (each request once, never replayed)
    p = slurm(cluster, tmp_path, "scancel", "-s", "SIGUSR1", "-b", str(trapper))
    assert p.returncode == 0, p.stderr
    wait_for(lambda: len(trapped.read_text().splitlines()) == 2, what="the second trap")
    time.sleep(1.5)  # several heartbeats: a replayed signal would add a line
    assert len(trapped.read_text().splitlines()) == 2
    # a pending job cannot be signalled; an unknown id is Slurm's error
    p = slurm(cluster, tmp_path, "scancel", "--signal=USR1", str(held))
    assert p.returncode == 1
    assert (
        p.stderr == f"scancel: error: Kill job error on job id {held}: Job is pending execution\n"
    )
    p = slurm(cluster, tmp_path, "scancel", "99999")
    assert p.returncode == 1
    assert p.stderr == "scancel: error: Kill job error on job id 99999: Invalid job id specified\n"
    # scontrol wait_job: a running job is ready at once; an unknown one is Slurm's error
    p = slurm(cluster, tmp_path, "scontrol", "wait_job", str(trapper))
    assert (p.returncode, p.stdout, p.stderr) == (0, "", ""), p
    p = slurm(cluster, tmp_path, "scontrol", "wait_job", "99999")
    assert (p.returncode, p.stderr) == (1, "Invalid job id specified for job 99999\n"), p

    # sinfo: the default summary and the node-oriented long form
    nodes = {n["name"]: n for n in c.nodes()}
    p = slurm(cluster, tmp_path, "sinfo")
    lines = p.stdout.splitlines()
    assert lines[0] == "PARTITION AVAIL  TIMELIMIT  NODES  STATE NODELIST"
    busy = running["nodelist"]
    idle = next(n for n in nodes if n != busy)
    part = running["partition"]
    assert any(re.fullmatch(rf"{part}\*? +up +\S+ +1 +mix {busy}", x) for x in lines), lines
    assert any(re.fullmatch(rf"{part}\*? +up +\S+ +1 +idle {idle}", x) for x in lines), lines
    p = slurm(cluster, tmp_path, "sinfo", "-N", "-l")
    lines = p.stdout.splitlines()
    time.strptime(lines[0], "%a %b %d %H:%M:%S %Y")  # the date line sinfo -l starts with
    assert lines[1].split() == [
        "NODELIST",
        "NODES",
        "PARTITION",
        "STATE",
        "CPUS",
        "S:C:T",
        "MEMORY",
        "TMP_DISK",
        "WEIGHT",
        "AVAIL_FE",
        "REASON",
    ]
    by_node = {x.split()[0]: x.split() for x in lines[2:]}
    assert set(by_node) == set(nodes)
    assert by_node[busy][3] == "mixed" and by_node[idle][3] == "idle"
    assert by_node[busy][4] == str(nodes[busy]["cpus"])
    assert by_node[busy][6] == str(nodes[busy]["mem_mb"])

    # plain scancel ends it; then squeue -j of the finished job prints only the header
    p = slurm(cluster, tmp_path, "scancel", str(trapper))
    assert p.returncode == 0 and p.stderr == ""
    assert cluster.wait_terminal([trapper])[trapper]["state"] == "CANCELLED"
    p = slurm(cluster, tmp_path, "squeue", "-j", str(trapper))
    assert p.returncode == 0 and p.stdout.splitlines() == [lines_header()]
    p = slurm(cluster, tmp_path, "squeue", "-h", "-j", str(trapper))
    assert p.returncode == 0 and p.stdout == ""
    p = slurm(cluster, tmp_path, "squeue", "-j", "99999")
    assert p.returncode == 1 and p.stderr == "slurm_load_jobs error: Invalid job id specified\n"
    # a signal to a finished job is refused as Slurm refuses it
    p = slurm(cluster, tmp_path, "scancel", "-s", "USR1", str(trapper))
    assert p.returncode == 1 and p.stderr == (
        f"scancel: error: Kill job error on job id {trapper}: "
        "Job/step already completing or completed\n"
    )


def lines_header() -> str:
    return "             JOBID PARTITION     NAME     USER ST       TIME  NODES NODELIST(REASON)"


BIN = str(Path(sys.executable).parent)  # where srun is installed


@pytest.mark.timeout(300)
def test_scancel_signal_goes_to_the_steps_not_the_batch_shell(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Without --batch/--full, Slurm's scancel --signal reaches every task of the job's steps
    (here on two nodes) and not the batch shell."""
    cluster.start(nodes=2, cpus=2)
    script = f"""#!/bin/bash
#SBATCH -N 2
#SBATCH -o steps-%j.out
export PATH={BIN}:$PATH
trap 'echo batch >> batch-$SLURM_JOB_ID.txt' USR1
srun -N 2 bash -c 'trap "echo step $SLURM_PROCID >> step-$SLURM_JOB_ID-$SLURM_PROCID.txt" USR1
  echo ok > ready-$SLURM_JOB_ID-$SLURM_PROCID
  while [ ! -e go-$SLURM_JOB_ID ]; do sleep 0.1; done'
echo "srun=$?"
"""
    (tmp_path / "steps.sh").write_text(script)
    jid = _submitted(slurm(cluster, tmp_path, "sbatch", "steps.sh"))
    for rank in (0, 1):
        wait_for((tmp_path / f"ready-{jid}-{rank}").exists, what=f"step task {rank}")
    p = slurm(cluster, tmp_path, "scancel", "--signal=USR1", str(jid))
    assert p.returncode == 0 and p.stderr == "", p.stderr
    for rank in (0, 1):
        f = tmp_path / f"step-{jid}-{rank}.txt"
        wait_for(f.exists, what=f"the trap of step task {rank}")
    (tmp_path / f"go-{jid}").touch()
    job = cluster.wait_terminal([jid])[jid]
    out = (tmp_path / f"steps-{jid}.out").read_text()
    assert job["state"] == "COMPLETED" and "srun=0" in out, out
    for rank in (0, 1):
        assert (tmp_path / f"step-{jid}-{rank}.txt").read_text() == f"step {rank}\n"
    # the batch shell was not signalled: its trap would have run once srun returned
    assert not (tmp_path / f"batch-{jid}.txt").exists()
