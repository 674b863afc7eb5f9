"""submitit, a real Slurm client, runs unchanged against Phalanx's Slurm commands.

submitit (pinned in the `test` extra) writes its own batch script (`#SBATCH` lines, then
`srun --unbuffered --output ... python -u -m submitit.core._submit FOLDER`), submits it with
`sbatch`, follows it with `sacct -o JobID,State,NodeList --parsable2`, cancels with `scancel`
and requeues itself with `scontrol requeue`. These tests use only its public API against a
real local cluster: the commands are found on PATH in this process (the virtualenv's bin), and
reach the controller through $PHALANX_URL with the node's credential socket, as a user on a
cluster host does. The jobs' Python is this interpreter, with this test module importable.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, wait_for

submitit = pytest.importorskip("submitit")

pytestmark = pytest.mark.system

BIN = str(Path(sys.executable).parent)  # sbatch, srun, sacct, scancel, scontrol
TESTS = str(Path(__file__).resolve().parents[1])  # where `system.test_submitit` imports from


@pytest.fixture
def slurm(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A 2-node cluster (2 GPUs each, declared: no device is touched) whose Slurm commands
    this process (and so submitit) runs from PATH."""
    cluster.start(nodes=2, cpus=2, gpus="a100:2")
    env = cluster.env(
        PHALANX_URL=cluster.url,
        PHALANX_AUTH_SOCKET=str(cluster.agent_socket("node01")),
        PATH=f"{BIN}:{os.environ['PATH']}",
        PYTHONPATH=os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p),
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # submitit keeps one state cache for every Slurm job of the process, by id: each test's
    # cluster numbers its jobs from 1 again
    submitit.SlurmJob.watcher.clear()
    yield cluster
    submitit.SlurmJob.watcher.clear()


def executor(tmp_path: Path, **params: Any) -> Any:
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", slurm_python=sys.executable)
    assert ex.cluster == "slurm"  # it found srun on PATH
    ex.update_parameters(timeout_min=5, **params)
    return ex


def final_state(job: Any) -> str:
    """The job's state as submitit reads it from sacct, once the job has ended (a result can
    be read before the job is over: the job writes it, then exits)."""
    live = ("", "UNKNOWN", "PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING")
    state = wait_for(
        lambda: (st := job.get_info(mode="force").get("State", "")) not in live and st,
        what=f"job {job.job_id} to end in sacct",
        timeout=120,
        interval=1.0,  # each look runs sacct
    )
    return str(state)


def where_am_i(x: int) -> dict[str, Any]:
    """Runs in the job: its result and what submitit's JobEnvironment reads from SLURM_*."""
    env = submitit.JobEnvironment()
    return {
        "square": x * x,
        "job_id": env.job_id,
        "hostnames": env.hostnames,
        "num_tasks": env.num_tasks,
        "global_rank": env.global_rank,
        "array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def fails(x: int) -> None:
    raise ValueError(f"bad value {x} on {os.environ.get('SLURMD_NODENAME')}")


@pytest.mark.timeout(300)
def test_submit_a_function_get_its_result_and_a_failures_traceback(
    slurm: Cluster, tmp_path: Path
) -> None:
    ex = executor(tmp_path, name="sq")
    job = ex.submit(where_am_i, 7)
    out = job.result()
    assert out["square"] == 49
    assert out["job_id"] == job.job_id and (out["num_tasks"], out["global_rank"]) == (1, 0)
    assert out["hostnames"][0] in ("node01", "node02") and len(out["hostnames"]) == 1
    # its state and node, as submitit reads them from `sacct --parsable2`
    assert final_state(job) == "COMPLETED" and job.state == "COMPLETED"
    assert job.get_info()["NodeList"] == out["hostnames"][0]

    bad = ex.submit(fails, 3)
    with pytest.raises(submitit.core.utils.FailedJobError) as err:
        bad.result()
    text = str(err.value)
    # the remote traceback: the job's own frames and the exception it raised, on a node
    assert "ValueError: bad value 3 on node0" in text, text
    assert "in fails" in text and "submitit/core/submission.py" in text, text
    assert isinstance(bad.exception(), submitit.core.utils.FailedJobError)
    assert final_state(bad) == "FAILED"


@pytest.mark.timeout(300)
def test_a_two_node_job_gives_every_task_its_rank_and_cancel_stops_a_job(
    slurm: Cluster, tmp_path: Path
) -> None:
    """nodes=2 (`--gpus-per-node=1`): srun starts one task per node, each with its rank and
    its node's GPU, and job.results() has both; job.cancel() (scancel ID) ends a running job,
    which sacct then shows CANCELLED."""
    ex = executor(tmp_path, name="two", nodes=2, tasks_per_node=1, gpus_per_node=1)
    job = ex.submit(where_am_i, 3)
    results = job.results()
    assert [(r["global_rank"], r["num_tasks"], r["square"]) for r in results] == [
        (0, 2, 9),
        (1, 2, 9),
    ]
    assert all(r["gpus"] in ("0", "1") for r in results), results
    assert results[0]["hostnames"] == ["node01", "node02"]
    assert final_state(job) == "COMPLETED"

    sleeper = executor(tmp_path, name="sleeper").submit(time.sleep, 600)
    wait_for(
        lambda: sleeper.get_info().get("State") == "RUNNING",
        what="the sleeper to run",
        timeout=120,
        interval=1.0,
    )
    sleeper.cancel()
    assert final_state(sleeper).startswith("CANCELLED")


@pytest.mark.timeout(300)
def test_map_array_runs_a_job_array(slurm: Cluster, tmp_path: Path) -> None:
    ex = executor(tmp_path, name="arr", slurm_array_parallelism=2)
    jobs = ex.map_array(where_am_i, [1, 2, 3])
    array_id = jobs[0].job_id.split("_")[0]
    assert [j.job_id for j in jobs] == [f"{array_id}_{i}" for i in range(3)]
    results = [j.result() for j in jobs]
    assert [r["square"] for r in results] == [1, 4, 9]
    assert [r["job_id"] for r in results] == [j.job_id for j in jobs]
    assert [r["array_task_id"] for r in results] == ["0", "1", "2"]
    assert [final_state(j) for j in jobs] == ["COMPLETED"] * 3
    # one array of three tasks under one id, as sbatch --array made it
    tasks = slurm.client().job(int(array_id))
    assert sorted((t["array_job_id"], t["array_task_id"]) for t in tasks) == [
        (int(array_id), i) for i in range(3)
    ], tasks


class Counter(submitit.helpers.Checkpointable):  # type: ignore[name-defined]
    """Counts to `n`; the first run stops halfway and waits until its time-limit signal: its
    checkpoint (the default one, this object as it is then) is what the requeued run resumes."""

    def __init__(self, marks: str) -> None:
        self.marks = marks
        self.count = 0
        self.runs: list[tuple[str, int]] = []  # (restart count, count at the start of a run)

    def __call__(self, n: int) -> dict[str, Any]:
        restart = os.environ.get("SLURM_RESTART_COUNT", "?")
        self.runs.append((restart, self.count))
        while self.count < n:
            self.count += 1
            if self.count == n // 2 and restart == "0":
                Path(self.marks, "halfway").touch()
                while True:  # until USR2 (--signal=USR2@N): checkpoint, requeue, exit
                    time.sleep(0.1)
        return {"count": self.count, "runs": self.runs}


@pytest.mark.timeout(400)
def test_checkpointable_job_is_requeued_on_its_signal_and_resumes(
    slurm: Cluster, tmp_path: Path
) -> None:
    """submitit asks for `--signal=USR2@N`; at N seconds before the time limit its job gets
    USR2, checkpoints, calls `scontrol requeue $SLURM_JOB_ID` and exits; the job runs again
    (restart count 1) from the checkpoint and finishes with the right result."""
    marks = tmp_path / "marks"
    marks.mkdir()
    # a 1-minute limit, USR2 45 s before it: the signal comes about 15 s into the run
    ex = executor(tmp_path, name="ckpt")
    ex.update_parameters(timeout_min=1, slurm_signal_delay_s=45)
    job = ex.submit(Counter(str(marks)), 10)
    wait_for(lambda: (marks / "halfway").exists(), what="the first run to get halfway", timeout=120)
    out = job.result()
    assert out["count"] == 10
    # the second run started from the checkpoint (5), not from 0, after one requeue
    assert out["runs"] == [("0", 0), ("1", 5)], out
    assert final_state(job) == "COMPLETED"
    (row,) = slurm.client().job(int(job.job_id))
    assert row["restart_count"] == 1 and row["state"] == "COMPLETED", row
    # --open-mode=append: the log keeps the first run's signal and requeue lines
    log = job.stdout() + job.stderr()
    assert log.count("Starting with JobEnvironment") == 2, log
    assert "Caught signal SIGUSR2" in log and f"Requeued job {job.job_id}" in log, log
