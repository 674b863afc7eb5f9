"""Job steps, the pure parts: placing a step in its allocation, its outcome, the step half of
the agent protocol, what a node gets to start a step's tasks, and srun's exit status."""

from __future__ import annotations

import time
from typing import Any

import pytest

from phalanx.controller.exchange import decide_steps
from phalanx.controller.launch import build_step_launch, expand_step_pattern
from phalanx.domain.steps import AllocNode, StepRequest, plan_step, step_outcome
from phalanx.errors import InvalidSpec
from phalanx.slurm.common import SlurmUsageError
from phalanx.slurm.srun.command import open_mode, worst_exit
from phalanx.store.steps import StepReport

ALLOC = [AllocNode("n1", 4, (0, 1)), AllocNode("n2", 4, (0, 1)), AllocNode("n3", 4, (0, 1))]


def test_default_step_runs_the_jobs_layout() -> None:
    plan = plan_step(StepRequest(job_ntasks_per_node=(2, 2, 2)), ALLOC)
    assert plan.nodes == ["n1", "n2", "n3"] and plan.tasks == [2, 2, 2]
    assert plan.task_ids == [[0, 1], [2, 3], [4, 5]]
    assert plan.gpus["n2"] == [[0, 1], [0, 1]]  # no GPU request: the job's GPUs


def test_step_layouts() -> None:
    plan = plan_step(StepRequest(ntasks=1), ALLOC)
    assert (plan.nodes, plan.tasks) == (["n1"], [1])
    plan = plan_step(StepRequest(nodes=2, ntasks_per_node=2, gpus_per_task=1), ALLOC)
    assert plan.tasks == [2, 2] and plan.gpus["n1"] == [[0], [1]]
    plan = plan_step(StepRequest(nodelist=("n3",), ntasks=2), ALLOC)
    assert plan.nodes == ["n3"] and plan.tasks == [2]
    plan = plan_step(StepRequest(nodes=3, ntasks=5), ALLOC)
    assert plan.tasks == [2, 2, 1] and plan.task_ids[2] == [4]


@pytest.mark.parametrize(
    ("req", "why"),
    [
        (StepRequest(nodes=4), "asked for 4 nodes but the allocation has only 3"),
        (StepRequest(nodelist=("n9",)), "n9 are not in the job's allocation"),
        (StepRequest(ntasks=1, cpus_per_task=5), "need 5 CPUs on n1, but the job holds 4"),
        (StepRequest(ntasks_per_node=2, gpus_per_task=2), "need 4 GPUs on n1"),
        (StepRequest(gpus_per_node=3), "asked for 3 GPUs on n1"),
    ],
)
def test_more_than_the_allocation_is_refused_at_once(req: StepRequest, why: str) -> None:
    with pytest.raises(InvalidSpec, match=why):
        plan_step(req, ALLOC)


def test_step_outcome() -> None:
    ok = {"exit_code": 0, "signal": None}
    assert step_outcome([ok, ok], lost=False, stop_reason=None) == ("COMPLETED", 0, None)
    bad = {"exit_code": 3, "signal": None}
    assert step_outcome([ok, bad], lost=False, stop_reason=None) == ("FAILED", 3, None)
    killed = {"exit_code": None, "signal": 9}
    assert step_outcome([ok, killed], lost=False, stop_reason=None)[0] == "FAILED"
    assert step_outcome([ok], lost=True, stop_reason=None)[0] == "NODE_FAIL"
    assert step_outcome([{**ok, "fenced": True}], lost=False, stop_reason=None)[0] == "NODE_FAIL"
    assert step_outcome([killed], lost=False, stop_reason="cancel: srun ^C")[0] == "CANCELLED"
    assert step_outcome([{**ok, "timed_out": True}], lost=False, stop_reason=None)[0] == "TIMEOUT"
    assert step_outcome([{**bad, "oom": True}], lost=False, stop_reason=None)[0] == "OUT_OF_MEMORY"


def test_srun_exit_status_is_the_worst_task() -> None:
    assert worst_exit([{"exit_code": 0}, {"exit_code": 0}]) == 0
    assert worst_exit([{"exit_code": 2}, {"exit_code": 5}]) == 5
    assert worst_exit([{"exit_code": None, "signal": 9}]) == 137
    assert worst_exit([{"exit_code": None, "lost": True}]) == 1
    # --kill-on-bad-exit: the tasks stopped because of task 1 do not hide its code
    assert worst_exit([{"exit_code": 7}, {"signal": 15, "cancelled": True}]) == 7
    assert worst_exit([]) == 0


def row(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "attempt_id": 5,
        "step_id": 0,
        "node_state": "STARTING",
        "step_state": "RUNNING",
        "step_stop_reason": None,
        "step_nodes": ["n1", "n2"],
        "step_tasks": [2, 1],
        "step_spec": {
            "argv": ["python", "train.py"],
            "env": {"PATH": "/usr/bin", "SLURMD_NODENAME": "n1", "MINE": "1"},
            "cwd": "/work",
            "cpus_per_task": 2,
            "task_ids": [[0, 1], [2]],
            "gpus": {"n1": [[0], [1]], "n2": [[3]]},
            "io": {"host": "10.0.0.1", "port": 4000, "cookie": "c" * 32, "stdout": True},
            "output": None,
            "error": "err-%j.%s.%t.%n.txt",
        },
        "signals": [],
        "token": "tok",
        "seq": 0,
        "attempt_state": "RUNNING",
        "stop_reason": None,
        "attempt_nodes": ["n1", "n2"],
        "attempt_partition": "batch",
        "fence_term": 1,
        "expected_end": time.time() + 100,
        "rank": 1,
        "cpus": 4,
        "mem_mb": 1000,
        "gpu_ids": [3],
        "job_id": 9,
        "name": "train",
        "user": "alice",
        "array_job_id": None,
        "array_task_id": None,
        "time_limit_s": 600,
        "cpus_per_node": 4,
        "spec": {"signal_parsed": {"signum": 10, "before_s": 60, "batch_only": True}},
    }
    base.update(kw)
    return base


def test_step_launch_on_a_node() -> None:
    """Each task gets its ids and GPUs; the node's own variables win over srun's (which ran
    on the batch host); -e patterns expand per task; a B: signal stays the batch shell's."""
    item = build_step_launch(row(), node="n2", kill_wait=3.0, now=time.time())
    assert item["argv"] == ["python", "train.py"] and item["cwd"] == "/work"
    env = item["env"]
    assert env["MINE"] == "1" and env["SLURMD_NODENAME"] == "n2"
    assert env["SLURM_STEP_ID"] == "0" and env["SLURM_NODEID"] == "1"
    assert env["SLURM_STEP_NUM_TASKS"] == env["SLURM_NTASKS"] == "3"
    assert env["SLURM_STEP_TASKS_PER_NODE"] == "2,1" and env["SLURM_STEP_NODELIST"] == "n[1-2]"
    (task,) = item["tasks"]
    assert task["task_id"] == 2 and task["local_id"] == 0
    assert task["env"]["SLURM_PROCID"] == "2" and task["env"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert task["stderr"] == "/work/err-9.0.2.1.txt" and task["stdout"] is None
    assert item["signal"] is None  # --signal=B:... is for the batch shell only
    assert 90 <= item["time_limit_s"] <= 100  # what is left of the job's time limit
    assert (
        expand_step_pattern(
            "o-%4t-%N-%%",
            job_id=1,
            step_id=2,
            task=3,
            node_index=0,
            node="n1",
            name="x",
            user="u",
            array_job_id=None,
            array_task_id=None,
        )
        == "o-0003-n1-%"
    )


def test_step_files_open_as_srun_or_the_job_asked() -> None:
    """A job submitted with --open-mode=append (submitit's) keeps its steps' -o/-e output
    across requeues; srun's own --open-mode wins; Slurm's default is truncate."""
    base = row()

    def mode(step: str | None, job: str | None) -> str:
        r = row(
            step_spec={**base["step_spec"], "open_mode": step},
            spec={**base["spec"], "open_mode": job},
        )
        return str(build_step_launch(r, node="n1", kill_wait=3.0, now=time.time())["open_mode"])

    assert mode(None, None) == "truncate"
    assert mode(None, "append") == "append"
    assert mode("truncate", "append") == "truncate"
    assert mode("append", None) == "append"
    assert (open_mode("A"), open_mode("truncate")) == ("append", "truncate")
    with pytest.raises(SlurmUsageError, match="use append or truncate"):
        open_mode("sometimes")


def report(state: str, **kw: Any) -> StepReport:
    return StepReport(**{"attempt_id": 5, "step_id": 0, "token": "tok", "state": state, **kw})


def test_step_protocol_start_signal_stop_forget() -> None:
    # a step to start here, not yet reported: start it
    r = decide_steps([row()], [], set())
    assert [w["step_id"] for w in r.start] == [0] and not r.stop
    # running, with signal requests: they are repeated (the agent dedupes by seq)
    sigs = [{"seq": 1, "signum": 10}]
    r = decide_steps([row(node_state="RUNNING", signals=sigs)], [report("running")], set())
    assert not r.start and r.signal == [{"attempt_id": 5, "step_id": 0, "signals": sigs}]
    # cancelled step: stop it
    r = decide_steps([row(step_stop_reason="cancel: x")], [report("running")], set())
    assert r.stop and r.stop[0]["reason"] == "cancel: x"
    # the job's attempt is stopping for a planned requeue: the step gets the checkpoint signal
    w = row(attempt_state="STOPPING", stop_reason="requeue: drain node01")
    r = decide_steps([w], [report("running")], set())
    assert r.stop[0]["checkpoint_signal"] and r.stop[0]["reason"].startswith("requeue")
    # (--signal=B:USR1@60: the signal is the batch shell's; the steps get the grace only)
    assert r.stop[0]["batch_only"] is True and r.stop[0]["checkpoint_grace"] == 60
    assert not r.signal
    # without B:, the steps' tasks get it too; signals the batch shell forwards through
    # srun during the grace still reach the tasks
    spec = {**w["spec"], "signal_parsed": {"signum": 10, "before_s": 30, "batch_only": False}}
    w = row(attempt_state="STOPPING", stop_reason="requeue: drain node01", signals=sigs, spec=spec)
    r = decide_steps([w], [report("running")], set())
    assert r.stop[0]["batch_only"] is False and r.stop[0]["checkpoint_grace"] == 30
    assert r.signal == [{"attempt_id": 5, "step_id": 0, "signals": sigs}]
    # unknown to the store (ended with its job): stop; exited and recorded: forget
    r = decide_steps([], [report("running")], set())
    assert r.stop[0]["reason"] == "step is no longer current"
    r = decide_steps([], [report("exited")], set())
    assert r.forget == [[5, 0]]
    # a stale token is not this attempt's
    r = decide_steps([row(node_state="RUNNING")], [report("running", token="old")], set())
    assert r.stop and r.stop[0]["reason"] == "step is no longer current"


def test_step_report_memo_skips_only_reports_that_change_nothing() -> None:
    """A controller records each step report of a node once: "starting" never changes the
    store, a repeated "running" or "exited" changes nothing more once applied, and a step
    recorded as ended there stays ended (reports are monotonic); another node's report, or
    another attempt token's, is still applied."""
    from phalanx.controller.exchange import StepReportMemo

    memo = StepReportMemo(limit=3)
    starting = StepReport(1, 0, "tok", "starting")
    running = StepReport(1, 0, "tok", "running", started_at=1.0)
    exited = StepReport(1, 0, "tok", "exited", started_at=1.0, exits=[{"task": 0}])
    assert memo.fresh("n1", [starting, running]) == [running]
    memo.applied("n1", [running])
    assert memo.fresh("n1", [running]) == []
    assert memo.fresh("n1", [exited]) == [exited]  # running -> ended is news
    assert memo.fresh("n2", [running]) == [running]  # another node
    assert memo.fresh("n1", [StepReport(1, 0, "other", "running")]) != []
    assert memo.ended("n1", [(1, 0, "tok")]) == set()
    memo.applied("n1", [exited])
    assert memo.fresh("n1", [exited, running]) == []  # ended stays ended
    assert memo.ended("n1", [(1, 0, "tok"), (1, 1, "tok")]) == {(1, 0)}
    for sid in (1, 2, 3):  # the oldest entries go first
        memo.applied("n1", [StepReport(1, sid, "tok", "running")])
    assert memo.fresh("n1", [exited]) == [exited]


@pytest.mark.parametrize("node_state", ["STARTING", "RUNNING"])
@pytest.mark.parametrize("step_state", ["RUNNING", "COMPLETED", "CANCELLED"])
def test_idle_node_skips_the_step_query_only_where_it_could_decide_nothing(
    node_state: str, step_state: str
) -> None:
    """steps_to_decide: with no task of a live attempt on the node and no step reported, the
    step rows that can be left for the node are those of ENDED attempts, and decide_steps does
    nothing with them, so the heartbeat need not read them."""
    from phalanx.controller.exchange import steps_to_decide

    left = [row(attempt_state="ENDED", node_state=node_state, step_state=step_state)]
    assert decide_steps(left, [], set()).empty and not decide_steps(left, [], set()).forget
    assert not steps_to_decide([], [])
    # a live task on the node, or any step report, and the step work is read as before
    assert steps_to_decide([{"attempt_id": 5}], [])
    assert steps_to_decide([], [report("exited")])


def test_a_stream_header_is_read_without_a_byte_of_the_stream() -> None:
    """srun's StepIO reads each task connection's header line, then hands the socket on to
    the copy of the task's output: the header's reader must leave the output alone, whether
    both came in one segment, the header in pieces, or no header at all."""
    import socket

    from phalanx.slurm.srun.command import _read_line

    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"cookie 3 out\nfirst line of output\n")
        assert _read_line(b) == "cookie 3 out"
        assert b.recv(100) == b"first line of output\n"
        a.sendall(b"cook")
        a.sendall(b"ie 0 exit\n{}")
        assert _read_line(b) == "cookie 0 exit"
        assert b.recv(100) == b"{}"
        a.sendall(b"x" * 600)
        with pytest.raises(OSError, match="short header"):
            _read_line(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"no newline then EOF")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(OSError, match="short header"):
            _read_line(b)


def test_a_steps_usage_from_its_tasks_exit_records() -> None:
    from phalanx.domain.steps import step_usage

    exits = [
        ("n1", {"task": 0, "usage": {"cpu_s": 1.0, "max_rss_bytes": 10}}),
        ("n2", {"task": 1, "usage": {"cpu_s": 2.0, "max_rss_bytes": 30}}),
        ("n2", {"task": 2}),  # lost, or from an agent that sends no figures
    ]
    assert step_usage(exits) == {
        "cpu_s": 3.0,
        "max_rss_bytes": 30,
        "max_rss_node": "n2",
        "max_rss_task": 1,
    }
    assert step_usage([("n1", {"task": 0})]) is None


def test_a_pmi2_step_gives_each_task_its_rank_and_id_and_every_task_the_server() -> None:
    """srun --mpi=pmi2 (slurm/srun/pmi.py): PMI_RANK and PMI_ID (the step's base + rank) per
    task, PMI_PORT (srun's host and the server's port) and PMI_SIZE for all."""
    r = row()
    r["step_spec"]["pmi"] = {"port": 5000, "id_base": 77}
    item = build_step_launch(r, node="n1", kill_wait=3.0, now=time.time())
    envs = [{**item["env"], **t["env"]} for t in item["tasks"]]
    assert [(e["PMI_RANK"], e["PMI_ID"]) for e in envs] == [("0", "77"), ("1", "78")]
    assert {(e["PMI_PORT"], e["PMI_SIZE"]) for e in envs} == {("10.0.0.1:5000", "3")}
    plain = build_step_launch(row(), node="n1", kill_wait=3.0, now=time.time())
    assert not any(
        k.startswith("PMI_") for t in plain["tasks"] for k in {**plain["env"], **t["env"]}
    )
