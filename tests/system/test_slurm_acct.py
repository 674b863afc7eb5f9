"""`scontrol` and `sacct` end to end on a real local cluster, run as scripts run them.

The self-requeue idiom of Slurm batch scripts (`--signal=B:USR1@N`, a trap that calls
`scontrol requeue $SLURM_JOB_ID` and exits 0) must bring the job back with restart count 1,
both attempts' output in one `--open-mode=append` file, and end COMPLETED only after the
second attempt; `sacct -P -o` prints what the job records say, field by field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.domain.hostlist import expand_hostlist
from system.harness import Cluster, base_env, run_cli, wait_for

pytestmark = pytest.mark.system

BIN = Path(sys.executable).parent  # where the console scripts (scontrol, sacct) are installed

REQUEUE_SCRIPT = f"""#!/bin/bash
#SBATCH --job-name=selfrq
#SBATCH --output=selfrq-%j.out
#SBATCH --open-mode=append
#SBATCH --time=1:00
#SBATCH --signal=B:USR1@50
export PATH={BIN}:$PATH
trap 'echo "attempt $SLURM_RESTART_COUNT: USR1, requeueing"; scontrol requeue $SLURM_JOB_ID; exit 0' USR1
echo "attempt $SLURM_RESTART_COUNT: started on $SLURMD_NODENAME"
if [ "$SLURM_RESTART_COUNT" -ge 1 ]; then
    echo "attempt $SLURM_RESTART_COUNT: resumed, finishing"
    exit 0
fi
sleep 300 &
wait
echo "attempt $SLURM_RESTART_COUNT: not requeued"
"""


def slurm(cluster: Cluster, cmd: str, *args: str, cwd: Path, env: dict[str, str] | None = None):
    """Run a Slurm front end as a user does: the cluster URL and the admin token file."""
    extra = {"PHALANX_URL": cluster.url, **(env or {})}
    if (cluster.root / "admin.token").is_file():
        extra["PHALANX_TOKEN_FILE"] = str(cluster.root / "admin.token")
    p = subprocess.run(
        [str(BIN / cmd), *args],
        cwd=cwd,
        env=base_env(cluster.root, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    return p


def stamp(t: float | None) -> str:
    return "Unknown" if t is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


@pytest.mark.timeout(300)
def test_self_requeue_show_job_and_sacct(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=2, cpus=2)
    c = cluster.client()

    # --- the self-requeue idiom ------------------------------------------------------
    (tmp_path / "selfrq.sh").write_text(REQUEUE_SCRIPT)
    p = run_cli(["submit", "selfrq.sh"], url=cluster.url, cwd=tmp_path, root=cluster.root)
    assert p.returncode == 0, p.stderr
    rq = int(p.stdout.split()[-1])
    # a 2-node job that completes and one that fails, for show job and sacct
    (tmp_path / "two.sh").write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --time=5:00\n"
                                     "echo two\n")  # fmt: skip
    (tmp_path / "bad.sh").write_text("#!/bin/bash\nexit 3\n")
    two = int(run_cli(["submit", "two.sh"], url=cluster.url, cwd=tmp_path,
                      root=cluster.root).stdout.split()[-1])  # fmt: skip
    bad = int(run_cli(["submit", "bad.sh"], url=cluster.url, cwd=tmp_path,
                      root=cluster.root).stdout.split()[-1])  # fmt: skip

    job = cluster.wait_terminal([rq, two, bad], timeout=180)[rq]
    out = (tmp_path / f"selfrq-{rq}.out").read_text()
    assert job["state"] == "COMPLETED", out
    assert job["restart_count"] == 1, out
    lines = out.splitlines()
    assert lines[0].startswith("attempt 0: started on node0"), out
    assert "attempt 0: USR1, requeueing" in lines, out
    assert "attempt 0: not requeued" not in out, out
    assert "attempt 1: resumed, finishing" in lines, out
    assert lines.index("attempt 0: USR1, requeueing") < lines.index("attempt 1: resumed, finishing")
    events = [e["kind"] for e in c.job_events(rq)]
    assert "job.requeue" in events, events
    # the user's requeue is a planned stop: no retry spent, one USR1 only (no checkpoint signal)
    assert c.job(rq)[0]["retries"] == 0
    assert out.count("USR1") == 1, out

    # --- scontrol show hostnames / hostlist --------------------------------------------
    p = slurm(cluster, "scontrol", "show", "hostnames", "node[01-03],gpu7", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == "node01\nnode02\nnode03\ngpu7\n", p
    p = slurm(cluster, "scontrol", "show", "hostnames", cwd=tmp_path,
              env={"SLURM_JOB_NODELIST": "node[01-02]"})  # fmt: skip
    assert p.stdout == "node01\nnode02\n"
    p = slurm(cluster, "scontrol", "show", "hostlist", "node01,node02,node03", cwd=tmp_path)
    assert p.stdout == "node[01-03]\n"

    # --- scontrol show job: the fields scripts grep --------------------------------------
    p = slurm(cluster, "scontrol", "show", "job", str(two), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    rec = c.job(two)[0]
    assert text.startswith(f"JobId={two} JobName={rec['name']}\n"), text
    for want in (
        f"   Command={tmp_path / 'two.sh'}\n",
        f"   WorkDir={tmp_path}\n",
        f"   StdOut={rec['stdout']}\n",
        "JobState=COMPLETED Reason=None",
        "   NodeList=node[01-02]\n",
        "   BatchHost=node01\n",
        "   NumNodes=2 NumCPUs=",
        f"StartTime={stamp(rec['start_time'])} EndTime={stamp(rec['end_time'])}",
        "ExitCode=0:0",
    ):
        assert want in text, (want, text)
    grep = [ln.split("JobState=")[1].split()[0] for ln in text.splitlines() if "JobState=" in ln]
    assert grep == ["COMPLETED"]
    p = slurm(cluster, "scontrol", "show", "job", "999999", cwd=tmp_path)
    assert p.returncode == 1
    assert p.stderr == "slurm_load_jobs error: Invalid job id specified\n"
    p = slurm(cluster, "scontrol", "suspend", str(two), cwd=tmp_path)
    assert p.returncode == 1 and "not supported" in p.stderr and p.stderr.count("\n") == 1

    # --- sacct -P -o, field by field against the job records ----------------------------
    fields = (
        "JobID,JobIDRaw,JobName,Partition,User,State,ExitCode,Elapsed,ElapsedRaw,Start,End,"
        "Submit,NodeList,NNodes,NCPUS,Timelimit,Restarts,WorkDir"
    )
    p = slurm(cluster, "sacct", "-P", "-n", "-o", fields, "-j", f"{rq},{two},{bad}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = {r.split("|")[0]: r.split("|") for r in p.stdout.splitlines()}
    assert set(rows) == {f"{j}{s}" for j in (rq, two, bad) for s in ("", ".batch")}, p.stdout
    for jid in (rq, two, bad):
        r = c.job(jid)[0]
        row = dict(zip(fields.split(","), rows[str(jid)], strict=True))
        elapsed = int(r["end_time"] - r["start_time"])
        assert row == {
            "JobID": str(jid),
            "JobIDRaw": str(jid),
            "JobName": r["name"],
            "Partition": r["partition"],
            "User": r["user"],
            "State": {rq: "COMPLETED", two: "COMPLETED", bad: "FAILED"}[jid],
            "ExitCode": {bad: "3:0"}.get(jid, "0:0"),
            "Elapsed": hms(elapsed),
            "ElapsedRaw": str(elapsed),
            "Start": stamp(r["start_time"]),
            "End": stamp(r["end_time"]),
            "Submit": stamp(r["submit_time"]),
            "NodeList": r["nodelist"],
            "NNodes": str(r["nodes_alloc"]),
            "NCPUS": str(r["nodes_alloc"] * r["cpus_per_node"]),
            "Timelimit": hms(r["time_limit_s"]),
            "Restarts": {rq: "1"}.get(jid, "0"),
            "WorkDir": str(tmp_path),
        }, (jid, row, r)
        batch = dict(zip(fields.split(","), rows[f"{jid}.batch"], strict=True))
        assert batch["JobName"] == "batch"
        assert batch["NodeList"] == expand_hostlist(r["nodelist"])[0]
        assert batch["State"] == {bad: "FAILED"}.get(jid, "COMPLETED")
    assert rows[str(two)][12] == "node[01-02]"

    # -X: allocations only; the default table has Slurm's header and dashes
    p = slurm(cluster, "sacct", "-X", "-j", str(bad), cwd=tmp_path)
    assert p.stdout.splitlines()[:2] == [
        "JobID           JobName  Partition    Account  AllocCPUS      State ExitCode ",
        "------------ ---------- ---------- ---------- ---------- ---------- -------- ",
    ], p.stdout
    assert len(p.stdout.splitlines()) == 3
    # an unsupported option is named, exit 1
    p = slurm(cluster, "sacct", "--units=M", cwd=tmp_path)
    assert p.returncode == 1 and "--units" in p.stderr

    # nodes, partitions, ping, node drain/resume, tokens
    p = slurm(cluster, "scontrol", "ping", cwd=tmp_path)
    host = cluster.url.removeprefix("http://")
    assert (p.returncode, p.stdout) == (0, f"Slurmctld(primary) at {host} is UP\n"), p
    p = slurm(cluster, "scontrol", "show", "node", "node02", cwd=tmp_path)
    assert p.stdout.startswith("NodeName=node02 ") and "   Partitions=batch\n" in p.stdout
    p = slurm(cluster, "scontrol", "show", "partition", cwd=tmp_path)
    assert p.stdout.startswith("PartitionName=batch\n") and "   Nodes=node[01-02]\n" in p.stdout
    p = slurm(cluster, "scontrol", "update", "NodeName=node02", "State=DRAIN",
              "Reason=bad disk", cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert c.node("node02")["drain_reason"] == "bad disk"
    assert (
        "State=DRAINED" in slurm(cluster, "scontrol", "show", "node", "node02", cwd=tmp_path).stdout
    )
    slurm(cluster, "scontrol", "update", "NodeName=node02", "State=RESUME", cwd=tmp_path)
    assert not c.node("node02")["drain"]
    p = slurm(cluster, "scontrol", "token", "lifespan=600", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("SLURM_JWT=ey"), p
    user_env = {"PHALANX_TOKEN": cluster.token("alice")}
    p = slurm(cluster, "scontrol", "token", cwd=tmp_path, env=user_env)
    assert p.returncode == 1 and "alice may not mint a token" in p.stderr, p
    # alice may not requeue root's job: refused, nothing changes
    p = slurm(cluster, "scontrol", "requeue", str(two), cwd=tmp_path, env=user_env)
    assert p.returncode == 1 and "belongs to root" in p.stderr, p
    assert c.job(two)[0]["state"] == "COMPLETED"

    # requeue a finished job: it comes back with restart count + 1 (Slurm allows it)
    p = slurm(cluster, "scontrol", "requeuehold", str(bad), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    again = wait_for(lambda: c.job(bad)[0] if c.job(bad)[0]["state"] == "HELD" else None,
                     what="the failed job to be held after requeuehold")  # fmt: skip
    assert again["restart_count"] == 1
    p = slurm(cluster, "scontrol", "update", f"JobId={bad}", "TimeLimit=2:00", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert c.job(bad)[0]["time_limit_s"] == 120
    p = slurm(cluster, "scontrol", "update", f"JobId={bad}", "Shared=1", cwd=tmp_path)
    assert p.returncode == 1 and "Shared" in p.stderr
    slurm(cluster, "scontrol", "release", str(bad), cwd=tmp_path)
    final = cluster.wait_terminal([bad])[bad]
    assert final["state"] == "FAILED" and final["restart_count"] == 1

    # no -j: the caller's jobs active in the window (-S defaults to midnight); -s filters
    p = slurm(cluster, "sacct", "-X", "-n", "-P", "-o", "JobID", "-S", "now-1hour", cwd=tmp_path)
    assert p.stdout.split() == [str(rq), str(two), str(bad)], p
    p = slurm(cluster, "sacct", "-X", "-n", "-P", "-o", "JobID,State", "-s", "F", "-S",
              "now-1hour", cwd=tmp_path)  # fmt: skip
    assert p.stdout == f"{bad}|FAILED\n", p
    p = slurm(cluster, "sacct", "-X", "-n", "-P", "-o", "JobID", "-E", "2000-01-01", "-S",
              "1999-01-01", cwd=tmp_path)  # fmt: skip
    assert (p.returncode, p.stdout) == (0, ""), p
    p = slurm(cluster, "sacct", "--json", "-j", str(two), cwd=tmp_path)
    (doc,) = json.loads(p.stdout)["jobs"]
    assert doc["job_id"] == two and doc["state"]["current"] == "COMPLETED"
    assert doc["nodes"] == "node[01-02]" and [s["step"]["id"] for s in doc["steps"]] == [
        f"{two}.batch"
    ]
