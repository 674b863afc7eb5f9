"""The node's prolog and epilog, end to end: real agents whose node files name them.

A prolog that exits 1 keeps the job from starting on its node, drains the node with the
prolog's exit status and output as the reason (``drain_by = prolog``), and the job goes back
to the queue without spending a retry, then runs and completes on another node whose prolog
passes (and sees the job's Slurm variables).  An epilog that fails drains its node while the
job it ran after stays COMPLETED.  Both show in the events and in ``phalanx explain``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, run_cli, wait_for

pytestmark = pytest.mark.system

FAST = {"heartbeat_interval": 0.5}


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _node_file(path: Path, **hooks: Path) -> Path:
    lines = []
    for name, script in hooks.items():
        lines += [f"[{name}]", f'path = "{script}"', "timeout = 20"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _node(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.client().node(name)


def _wait_drained(cluster: Cluster, name: str, what: str) -> dict[str, Any]:
    return wait_for(
        lambda: (n := _node(cluster, name))["drain"] and n, what=f"{name} to be drained ({what})"
    )


def _explain(cluster: Cluster, tmp_path: Path, job_id: int) -> str:
    p = run_cli(["explain", str(job_id)], url=cluster.url, cwd=tmp_path, root=cluster.root)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    return p.stdout


@pytest.mark.timeout(240)
def test_a_failing_prolog_drains_its_node_and_the_job_runs_elsewhere_without_a_retry(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    bad = _script(
        tmp_path / "bad-prolog.sh",
        "echo 'ERROR: /scratch is not mounted'\necho 'see the admins' >&2\nexit 1\n",
    )
    seen = tmp_path / "prolog-saw"
    good = _script(
        tmp_path / "good-prolog.sh",
        'echo "$SLURM_JOB_ID $SLURM_JOB_USER $SLURM_JOB_UID $SLURM_JOB_NODELIST '
        f'$SLURM_JOB_PARTITION $SLURMD_NODENAME" >> {seen}\n',
    )
    ran = tmp_path / "ran"
    # only node01 exists when the job is submitted, so its first attempt is there
    cluster.start_agent(
        "node01", extra_args=["--health-config", str(_node_file(tmp_path / "n1.toml", prolog=bad))]
    )
    jid = cluster.submit_script(
        tmp_path,
        "work",
        "#!/bin/bash\n"
        f'echo "$SLURMD_NODENAME $SLURM_RESTART_COUNT" >> {ran}\n'
        'echo "ran on $SLURMD_NODENAME"\n',
    )

    drained = _wait_drained(cluster, "node01", "its prolog failed")
    assert drained["drain_by"] == "prolog", drained
    reason = drained["drain_reason"]
    assert reason.startswith("prolog failed (exit status 1): "), reason
    assert "ERROR: /scratch is not mounted" in reason and "see the admins" in reason, reason
    assert f"(job {jid})" in reason, reason
    job = cluster.wait_state(jid, "PENDING")
    assert job["retries"] == 0 and job["restart_count"] == 1, job
    assert not ran.exists(), "the job's script ran on the node whose prolog failed"

    cluster.start_agent(
        "node02", extra_args=["--health-config", str(_node_file(tmp_path / "n2.toml", prolog=good))]
    )
    done = cluster.wait_terminal([jid])[jid]
    job = cluster.client().job(jid)[0]
    assert done["state"] == "COMPLETED", job
    assert job["retries"] == 0, job  # no retry spent on the node's fault
    assert [a["nodes"] for a in job["attempts"]] == [["node01"], ["node02"]], job["attempts"]
    assert ran.read_text().split() == ["node02", "1"]
    uid = os.getuid()
    assert seen.read_text().split() == [
        str(jid),
        job["user"],
        str(uid),
        "node02",
        job["partition"],
        "node02",
    ], seen.read_text()
    assert _node(cluster, "node01")["drain"], "a prolog's drain stays until an operator resumes"

    events = cluster.client().job_events(jid)
    requeue = [e for e in events if e["kind"] == "job.requeue"]
    assert len(requeue) == 1, events
    assert "prolog failed (exit status 1)" in requeue[0]["message"], requeue
    assert "without spending a retry" in requeue[0]["message"], requeue
    assert (requeue[0]["data"] or {}).get("why") == "prolog", requeue
    assert (requeue[0]["data"] or {}).get("retry") is False, requeue
    node_events = cluster.client().get("/v1/events", node="node01", limit=1000)["events"]
    drains = [e for e in node_events if e["kind"] == "node.drain"]
    assert drains and drains[-1]["message"].startswith("drained by prolog: prolog failed"), drains

    said = _explain(cluster, tmp_path, jid)
    assert "node01: prolog failed (exit status 1): ERROR: /scratch is not mounted" in said, said
    assert "drained by prolog" in said, said
    assert "without spending a retry" in said, said


@pytest.mark.timeout(240)
def test_a_failing_epilog_drains_its_node_and_leaves_the_job_completed(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    order = tmp_path / "order"
    epilog = _script(
        tmp_path / "epilog.sh",
        f'echo "epilog $SLURM_JOB_ID" >> {order}\necho "cannot wipe /tmp/job$SLURM_JOB_ID"\nexit 3\n',
    )
    cluster.start_agent(
        "node01",
        extra_args=["--health-config", str(_node_file(tmp_path / "n1.toml", epilog=epilog))],
    )
    jid = cluster.submit_script(tmp_path, "work", f"#!/bin/bash\necho job >> {order}\n")

    done = cluster.wait_terminal([jid])[jid]
    job = cluster.client().job(jid)[0]
    assert done["state"] == "COMPLETED", job
    assert job["exit_code"] == 0 and job["retries"] == 0 and job["restart_count"] == 0, job
    assert order.read_text().split("\n")[:2] == ["job", f"epilog {jid}"], order.read_text()
    # drained in the same write as the task's end, so as soon as the job is COMPLETED
    node = _node(cluster, "node01")
    assert node["drain"] and node["drain_by"] == "epilog", node
    assert node["drain_reason"] == (
        f"epilog failed (exit status 3): cannot wipe /tmp/job{jid} (job {jid})"
    ), node

    said = _explain(cluster, tmp_path, jid)
    assert f"node01: epilog failed (exit status 3): cannot wipe /tmp/job{jid}" in said, said
    assert "drained by epilog" in said, said


@pytest.mark.timeout(240)
def test_prolog_and_epilog_run_on_every_node_and_the_task_prolog_before_each_task(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A two-node job: the prolog and epilog run once on each node (the batch host and the
    other), the task prolog before the batch script and before each srun task, its `export`
    reaching them and its `print` their output."""
    cluster.timing.update(FAST)
    cluster.start_controller()
    log = tmp_path / "hooks.log"
    prolog = _script(
        tmp_path / "prolog.sh", f'echo "prolog $SLURMD_NODENAME $SLURM_JOB_ID" >> {log}\n'
    )
    epilog = _script(
        tmp_path / "epilog.sh", f'echo "epilog $SLURMD_NODENAME $SLURM_JOB_ID" >> {log}\n'
    )
    task_prolog = _script(
        tmp_path / "task_prolog.sh",
        'echo "export SCRATCH=/scratch/$SLURM_JOB_ID"\necho "print task prolog on $SLURMD_NODENAME"\n',
    )
    conf = _node_file(tmp_path / "node.toml", prolog=prolog, epilog=epilog, task_prolog=task_prolog)
    for node in ("node01", "node02"):
        cluster.start_agent(node, wait=False, extra_args=["--health-config", str(conf)])
    cluster.wait_agents(["node01", "node02"])
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    jid = cluster.submit_script(
        tmp_path,
        "two",
        "#!/bin/bash\n"
        'echo "batch SCRATCH=$SCRATCH"\n'
        "srun -N 2 --ntasks-per-node=1 bash -c 'echo \"task $SLURM_NODEID SCRATCH=$SCRATCH\"'\n",
        nodes=2,
        env={"PATH": path},
    )
    done = cluster.wait_terminal([jid])[jid]
    out = (tmp_path / f"two-{jid}.out").read_text()
    assert done["state"] == "COMPLETED", out
    lines = out.splitlines()
    assert lines[:2] == ["task prolog on node01", f"batch SCRATCH=/scratch/{jid}"], out
    assert sorted(lines[2:]) == [
        f"task 0 SCRATCH=/scratch/{jid}",
        f"task 1 SCRATCH=/scratch/{jid}",
        "task prolog on node01",
        "task prolog on node02",
    ], out
    ran = log.read_text().splitlines()
    assert sorted(ran) == sorted(
        f"{hook} {node} {jid}" for hook in ("prolog", "epilog") for node in ("node01", "node02")
    ), ran
    for node in ("node01", "node02"):  # each node's epilog after its prolog
        assert ran.index(f"prolog {node} {jid}") < ran.index(f"epilog {node} {jid}"), ran
    assert not any(_node(cluster, n)["drain"] for n in ("node01", "node02"))
