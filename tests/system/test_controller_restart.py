"""SIGKILL the only controller with ~30 jobs in flight; a restart on the same DB loses nothing.

Jobs keep running while the controller is away (agents retry, shepherds keep going); some end
while it is down, and their exits are reported to the restarted controller. The fence timeout is
raised so that a slow restart on a loaded machine tests recovery, not self-fencing.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from system.harness import ACTIVE_STATES, Cluster, alive, wait_for

pytestmark = pytest.mark.system

TIMING = {"fence_timeout": 30.0, "node_down_timeout": 40.0}
N_JOBS = 30


@pytest.mark.timeout(240)
def test_controller_sigkill_and_restart(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(TIMING)
    cluster.start(nodes=4, cpus=4)
    c = cluster.client()
    out = tmp_path / "out"
    out.mkdir()

    specs = []
    expected: dict[int, tuple[str, int]] = {}
    for i in range(N_JOBS):
        code = 4 if i % 5 == 4 else 0
        seconds = 5 if i < 12 else 1
        specs.append(
            {
                "script": (
                    "#!/bin/bash\n"
                    'echo "start $SLURM_JOB_ID $PHX_ATTEMPT_ID"\n'
                    f"sleep {seconds}\n"
                    'echo "end $SLURM_JOB_ID"\n'
                    f"exit {code}\n"
                ),
                "name": f"j{i}",
                "submit_dir": str(tmp_path),
                "output": str(out / "%j.out"),
                "time_limit_s": 120,
                "cpus_per_task": 2,  # 8 fit at once on 4 x 4 cpus; the rest wait
                "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
            }
        )
    res = c.submit_batch(specs)
    ids = [int(r["job_id"]) for r in res]
    for i, jid in enumerate(ids):
        expected[jid] = ("FAILED", 4) if i % 5 == 4 else ("COMPLETED", 0)

    def running_tasks() -> list[Path] | None:
        jobs = cluster.jobs_by_id(ids)
        running = [j for j in jobs.values() if j["state"] == "RUNNING"]
        if len(running) < 6:
            return None
        dirs = [d for j in running for d in cluster.task_dirs_of(int(j["id"]))]
        live = [d for d in dirs if cluster.shepherd_alive(d) and (d / "job.json").exists()]
        return live if len(live) >= 6 else None

    live = wait_for(running_tasks, what="at least 6 jobs running")
    before = cluster.jobs_by_id(ids)
    assert any(j["state"] == "PENDING" for j in before.values()), "no job was left pending"

    ctl = cluster.controller
    ctl.kill(signal.SIGKILL)
    shepherds = [cluster.shepherd_of(d) for d in live]
    assert all(s is not None and alive(*s) for s in shepherds), "shepherds died with the controller"
    assert all(cluster.job_pid_alive(d) for d in live), "jobs died with the controller"
    # let at least one running job end while the controller is away
    wait_for(
        lambda: any((d / "exit.json").exists() for d in live),
        what="a job to end while the controller is down",
    )
    assert not ctl.running()

    cluster.restart(ctl)
    jobs = cluster.wait_terminal(ids, timeout=150)

    wrong = {
        jid: (j["state"], j["exit_code"], j["reason"])
        for jid, j in jobs.items()
        if (j["state"], j["exit_code"]) != expected[jid]
    }
    assert not wrong, f"jobs in the wrong terminal state: {wrong}"
    assert len(c.jobs(limit=100_000)) == N_JOBS, "jobs were lost or duplicated"
    assert not c.jobs(state=list(ACTIVE_STATES))
    assert all(n["cpus_alloc"] == 0 for n in c.nodes())

    problems = {}
    for jid in ids:
        job = c.job(jid)[0]
        attempts = job["attempts"]
        lines = (out / f"{jid}.out").read_text().splitlines()
        starts = [ln for ln in lines if ln.startswith("start ")]
        ends = [ln for ln in lines if ln.startswith("end ")]
        if job["restart_count"] == 0:
            ok = len(attempts) == 1 and len(starts) == 1 and ends == [f"end {jid}"]
        else:  # requeued: the file was truncated by the last run, which must have finished
            ok = len(attempts) == job["restart_count"] + 1 and ends == [f"end {jid}"]
        if not ok:
            problems[jid] = (job["restart_count"], len(attempts), lines)
    assert not problems, f"lost or duplicated runs: {problems}"
    requeued = [jid for jid in ids if c.job(jid)[0]["restart_count"]]
    assert not requeued, f"jobs were requeued although nothing failed: {requeued}"

    wait_for(lambda: not cluster.live_shepherds(), what="every shepherd to exit")
