"""What an agent gets to start a task: filename patterns, environment, launch request (pure)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from phalanx.controller.launch import (
    BASE_MASTER_PORT,
    HOLDER_ARGV,
    build_launch,
    default_output,
    expand_pattern,
    job_environment,
)

FMT: dict[str, Any] = {
    "job_id": 42,
    "array_job_id": 40,
    "array_task_id": 7,
    "name": "train",
    "user": "alice",
    "node": "gpu3",
    "rank": 2,
}


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("%j", "42"),
        ("%A_%a", "40_7"),
        ("%x-%u", "train-alice"),
        ("%N.%n.%t", "gpu3.2.2"),
        ("%4a", "0007"),
        ("%8j", "00000042"),
        ("100%%", "100%"),
        ("%%j", "%j"),
        ("out-%j-%q", "out-42-%q"),  # unknown letters stay as they are
        ("plain.txt", "plain.txt"),
    ],
)
def test_expand_pattern(pattern: str, expected: str) -> None:
    assert expand_pattern(pattern, **FMT) == expected


def test_expand_pattern_outside_arrays() -> None:
    fmt = {**FMT, "array_job_id": None, "array_task_id": None}
    assert expand_pattern("%A", **fmt) == "42"  # %A is the job id for a non-array job
    assert expand_pattern("%a", **fmt) == "4294967294"  # Slurm's NO_VAL for a non-array job


def test_default_output() -> None:
    assert default_output(None) == "slurm-%j.out"
    assert default_output(5) == "slurm-%A_%a.out"


def work(**kw: Any) -> dict[str, Any]:
    spec = {
        "argv": ["python", "train.py"],
        "submit_dir": "/home/alice/p",
        "workdir": "/scratch/p",
        "export": "ALL",
        "env": {"PATH": "/usr/bin", "HOME": "/home/alice", "SECRET": "s", "FOO": "1"},
        "cpus_per_task": 4,
    }
    spec.update(kw.pop("spec", {}))
    base: dict[str, Any] = {
        "attempt_id": 11,
        "token": "tok",
        "job_id": 9,
        "rank": 1,
        "seq": 0,
        "name": "train",
        "user": "alice",
        "array_job_id": None,
        "array_task_id": None,
        "time_limit_s": 600,
        "attempt_nodes": ["n1", "n2", "n3"],
        "attempt_partition": "batch",
        "cpus": 8,
        "gpu_ids": [],
        "fence_term": 3,
        "spec": spec,
    }
    base.update(kw)
    return base


def test_environment_slurm_and_phx_variables() -> None:
    # --all-nodes: the script runs on every node, ranked by node (the batch step is below)
    env = job_environment(work(spec={"all_nodes": True}), node="n2")
    expected = {
        "SLURM_JOB_ID": "9",
        "SLURM_JOBID": "9",
        "PHX_JOB_ID": "9",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_NODELIST": "n[1-3]",
        "PHX_NODELIST": "n[1-3]",
        "SLURM_NNODES": "3",
        "SLURM_JOB_NUM_NODES": "3",
        "PHX_NNODES": "3",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "1",
        "PHX_NODE_RANK": "1",
        "SLURM_RESTART_COUNT": "0",
        "PHX_RESTART_COUNT": "0",
        "SLURM_SUBMIT_DIR": "/home/alice/p",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURM_CPUS_ON_NODE": "8",
        "SLURM_JOB_PARTITION": "batch",
        "SLURMD_NODENAME": "n2",
        "PHX_NODENAME": "n2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": str(BASE_MASTER_PORT + 9),
        "PHX_ATTEMPT": "0",  # the job's own attempt number, not the cluster-wide id 11
    }
    assert {k: env.get(k) for k in expected} == expected
    assert env["SECRET"] == "s" and env["FOO"] == "1"  # export=ALL keeps the submitter's env
    assert not any(k.startswith("SLURM_ARRAY") or k == "CUDA_VISIBLE_DEVICES" for k in env)


def test_environment_export_none_keeps_only_basics() -> None:
    env = job_environment(work(spec={"export": "NONE"}), node="n1")
    assert env["PATH"] == "/usr/bin" and env["HOME"] == "/home/alice"
    assert "SECRET" not in env and "FOO" not in env
    extra = {k for k in env if not k.startswith(("SLURM", "PHX_"))}
    assert extra == {"PATH", "HOME", "MASTER_ADDR", "MASTER_PORT"}


def test_environment_export_list() -> None:
    env = job_environment(work(spec={"export": "FOO,BAR=2"}), node="n1")  # list without ALL = NONE+
    assert env["FOO"] == "1" and env["BAR"] == "2" and "SECRET" not in env
    env = job_environment(work(spec={"export": "ALL,BAR=2"}), node="n1")
    assert env["SECRET"] == "s" and env["BAR"] == "2"


def test_job_variables_beat_the_submitters() -> None:
    env = job_environment(work(spec={"env": {"SLURM_JOB_ID": "1", "MASTER_ADDR": "x"}}), node="n1")
    assert env["SLURM_JOB_ID"] == "9" and env["MASTER_ADDR"] == "n1"


def test_environment_array_gpus_and_restart() -> None:
    w = work(
        array_job_id=7,
        array_task_id=3,
        job_id=10,
        seq=2,
        gpu_ids=[1, 3],
        spec={"checkpoint_dir": "/ckpt"},
    )
    env = job_environment(w, node="n1")
    assert env["SLURM_ARRAY_JOB_ID"] == "7" and env["SLURM_ARRAY_TASK_ID"] == "3"
    assert env["PHX_ARRAY_JOB_ID"] == "7" and env["PHX_ARRAY_TASK_ID"] == "3"
    assert env["SLURM_JOB_ID"] == "10"
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["SLURM_JOB_GPUS"] == "1,3"
    assert env["SLURM_GPUS_ON_NODE"] == "2"
    assert env["SLURM_RESTART_COUNT"] == "2" and env["PHX_CHECKPOINT_DIR"] == "/ckpt"


def test_build_launch_argv() -> None:
    L = build_launch(work(rank=0, attempt_nodes=["n2", "n3"]), node="n2", kill_wait=12.5)
    assert L["command"] == {"argv": ["python", "train.py"]}
    assert (L["attempt_id"], L["token"], L["job_id"], L["rank"], L["node"]) == (
        11,
        "tok",
        9,
        0,
        "n2",
    )
    assert L["holder"] is False
    assert L["cwd"] == "/scratch/p"
    assert L["stdout"] == "/scratch/p/slurm-9.out"  # relative to the working directory
    assert L["stderr"] is None  # stderr goes with stdout
    assert L["time_limit_s"] == 600 and L["kill_grace_s"] == 12.5 and L["fence_term"] == 3
    assert L["open_mode"] == "truncate" and L["gpu_ids"] == []
    assert L["env"]["SLURMD_NODENAME"] == "n2"


def test_build_launch_script_wrap_and_paths() -> None:
    w = work(
        spec={
            "script": "#!/bin/bash\necho hi\n",
            "argv": ["a1"],
            "output": "/logs/%x-%j.%N.out",
            "error": "err-%4a.txt",
        },
        array_job_id=5,
        array_task_id=2,
        rank=0,
        attempt_nodes=["n3"],
    )
    L = build_launch(w, node="n3", kill_wait=1)
    assert L["command"] == {"script": "#!/bin/bash\necho hi\n", "args": ["a1"]}
    assert L["stdout"] == "/logs/train-9.n3.out"
    assert L["stderr"] == "/scratch/p/err-0002.txt"
    L = build_launch(work(rank=0, spec={"wrap": "hostname", "argv": []}), node="n1", kill_wait=1)
    assert L["command"] == {"script": "#!/bin/sh\nhostname\n", "args": []}
    L = build_launch(work(spec={"workdir": None}), node="n1", kill_wait=1)
    assert L["cwd"] == "/home/alice/p"  # falls back to the submit directory


def test_build_launch_open_mode() -> None:
    assert build_launch(work(seq=1), node="n1", kill_wait=1)["open_mode"] == "append"
    assert (
        build_launch(work(seq=1, spec={"open_mode": "truncate"}), node="n1", kill_wait=1)[
            "open_mode"
        ]
        == "truncate"
    )
    assert (
        build_launch(work(seq=0, spec={"open_mode": "append"}), node="n1", kill_wait=1)["open_mode"]
        == "append"
    )


def test_batch_step_runs_once_on_the_first_node_others_hold() -> None:
    """Slurm's batch step: rank 0 runs the script; the other nodes run only a holder that
    writes no output, has no limit or signal of its own and ignores job signals."""
    spec = {"script": "#!/bin/sh\necho hi\n", "signal": "USR1@60", "progress_timeout_s": 30}
    spec["signal_parsed"] = {"signum": 10, "before_s": 60, "batch_only": False}
    first = build_launch(work(rank=0, spec=spec), node="n1", kill_wait=1)
    other = build_launch(work(rank=2, spec=spec), node="n3", kill_wait=1)
    assert first["command"]["script"].startswith("#!/bin/sh") and not first["holder"]
    assert first["time_limit_s"] == 600 and first["signal"]
    assert other["holder"] and other["command"] == {"argv": list(HOLDER_ARGV)}
    assert other["stdout"] == other["stderr"] == os.devnull
    assert other["time_limit_s"] is None and other["signal"] is None
    assert other["progress_timeout_s"] is None and other["checkpoint"]["enabled"] is False
    # --all-nodes keeps the script on every node
    spec_all = {**spec, "all_nodes": True}
    every = build_launch(work(rank=2, spec=spec_all), node="n3", kill_wait=1)
    assert not every["holder"] and every["command"]["script"].startswith("#!/bin/sh")
    assert every["all_nodes"] is True


def test_holder_ignores_job_signals_and_stops_on_term() -> None:
    """The holder really is a process that survives USR1/USR2/HUP and ends on SIGTERM."""
    import signal as sig
    import subprocess
    import time

    p = subprocess.Popen(list(HOLDER_ARGV), start_new_session=True)
    try:
        for s in (sig.SIGUSR1, sig.SIGUSR2, sig.SIGHUP):
            deadline = time.monotonic() + 5
            # the shell must have set its traps (and exec'd sleep) before the signal counts
            while time.monotonic() < deadline:
                try:
                    with open(f"/proc/{p.pid}/comm") as f:
                        if f.read().strip() == "sleep":
                            break
                except OSError:
                    break
            os.killpg(p.pid, s)
        assert p.poll() is None or p.wait(timeout=0.5) is None
    except subprocess.TimeoutExpired:
        pass
    finally:
        os.killpg(p.pid, sig.SIGTERM)
    assert p.wait(timeout=10) == -sig.SIGTERM


def test_batch_step_environment_has_the_allocation() -> None:
    """SLURM_NTASKS is nodes x tasks per node, the batch step is task 0 on node 0, and the
    allocation's other figures are set (world-size arithmetic in scripts must not give 0)."""
    spec = {
        "ntasks_per_node": 2,
        "cpus_per_task": 3,
        "mem_mb": 4096,
        "account": "proj",
        "qos": "high",
        "submit_host": "login1",
        "array": "1-7:2",
    }
    w = work(
        rank=0,
        spec=spec,
        cpus=6,
        mem_mb=4096,
        gpu_ids=[0, 1],
        cpus_per_node=6,
        array_job_id=40,
        array_task_id=3,
        attempt_nodes=["n1", "n2", "n3"],
    )
    env = job_environment(w, node="n1")
    expected = {
        "SLURM_NTASKS": "6",
        "SLURM_NPROCS": "6",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "2(x3)",
        "SLURM_JOB_CPUS_PER_NODE": "6(x3)",
        "SLURM_CPUS_ON_NODE": "6",
        "SLURM_PROCID": "0",
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_GPUS_PER_NODE": "2",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SLURM_MEM_PER_NODE": "4096",
        "SLURM_JOB_ACCOUNT": "proj",
        "SLURM_JOB_QOS": "high",
        "SLURM_SUBMIT_HOST": "login1",
        "SLURM_ARRAY_TASK_COUNT": "4",
        "SLURM_ARRAY_TASK_MIN": "1",
        "SLURM_ARRAY_TASK_MAX": "7",
        "SLURM_ARRAY_TASK_STEP": "2",
    }
    assert {k: env.get(k) for k in expected} == expected
    assert int(env["SLURM_NNODES"]) * int(env["SLURM_GPUS_PER_NODE"]) == 6
    # defaults when the job named no account/QOS; --mem-per-cpu gives SLURM_MEM_PER_CPU
    env = job_environment(work(rank=0, spec={"mem_per_cpu_mb": 500, "ntasks": 5}), node="n1")
    assert env["SLURM_JOB_ACCOUNT"] == "default" and env["SLURM_JOB_QOS"] == "normal"
    assert env["SLURM_MEM_PER_CPU"] == "500" and "SLURM_MEM_PER_NODE" not in env
    assert env["SLURM_NTASKS"] == "5" and env["SLURM_TASKS_PER_NODE"] == "2(x2),1"
    assert "SLURM_NTASKS_PER_NODE" not in env  # -n alone: no fixed count per node
