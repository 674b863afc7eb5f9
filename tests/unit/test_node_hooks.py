"""A node's prolog, epilog and task prolog: their configuration and its checks (agent/hooks.py),
the shepherd's runner and its pure rules (agent/shepherd_hooks.py), a shepherd running them
around a real job, and the controller's decisions on a failure (domain/outcome.py, policy.py,
explain.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx.agent import hooks, shepherd_hooks
from phalanx.agent.hooks import Hook, NodeHooks, parse_hooks
from phalanx.agent.main import health_table
from phalanx.domain.explain import _task_text
from phalanx.domain.outcome import describe_exit, hook_drain, launch_error
from phalanx.domain.policy import Action, FailurePolicy, TaskEnd, after_attempt
from phalanx.domain.states import JobState

SHEPHERD = Path(shepherd_hooks.__file__).with_name("shepherd.py")


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


# -- configuration ----------------------------------------------------------------------------


def test_hooks_take_their_defaults_and_a_bare_path(tmp_path: Path) -> None:
    pro = script(tmp_path, "pro.sh", "exit 0\n")
    epi = script(tmp_path, "epi.sh", "exit 0\n")
    got = parse_hooks({"prolog": {"path": pro}, "epilog": epi, "task_prolog": False})
    assert got == NodeHooks(prolog=Hook(pro, 30.0), epilog=Hook(epi, 60.0), task_prolog=None)
    assert parse_hooks({}) == NodeHooks()
    assert parse_hooks({"prolog": {"path": pro, "timeout": 5}}).prolog == Hook(pro, 5.0)


@pytest.mark.parametrize(
    ("table", "field", "message"),
    [
        ({"path": "pro.sh"}, "prolog.path", "must be an absolute path"),
        ({"path": ""}, "prolog.path", "must be a non-empty string"),
        ({"timeout": 3}, "prolog.path", "must be a non-empty string"),
        ({"path": "/nonexistent/prolog.sh"}, "prolog.path", "does not exist"),
        ({"path": "@PRO", "timeout": 0}, "prolog.timeout", "above 0"),
        ({"path": "@PRO", "timeout": -1}, "prolog.timeout", "above 0"),
        ({"path": "@PRO", "timeout": 3601}, "prolog.timeout", "at most 3600"),
        ({"path": "@PRO", "timeout": "30"}, "prolog.timeout", "number of seconds"),
        ({"path": "@PRO", "timeout": True}, "prolog.timeout", "number of seconds"),
        ({"path": "@PRO", "timeout": float("inf")}, "prolog.timeout", "number of seconds"),
        ({"path": "@PRO", "timout": 3}, "prolog", "unknown key 'timout'"),
        (["@PRO"], "prolog", "expected a table"),
    ],
)
def test_bad_hook_configuration_is_refused_naming_the_field(
    tmp_path: Path, table: Any, field: str, message: str
) -> None:
    pro = script(tmp_path, "pro.sh", "exit 0\n")
    if isinstance(table, dict):
        table = {k: (pro if v == "@PRO" else v) for k, v in table.items()}
    with pytest.raises(ValueError, match=f"^{field}: .*{message}"):
        parse_hooks({"prolog": table})


def test_a_hook_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pro.sh"
    path.write_text("exit 0\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"^epilog.path: .* is not executable"):
        parse_hooks({"epilog": {"path": str(path)}})
    assert parse_hooks({"epilog": {"path": str(path)}}, check_file=False).epilog is not None


def test_the_node_file_holds_health_and_hooks_side_by_side() -> None:
    data = {"health": {"interval": 5}, "prolog": {"path": "/p"}}
    assert health_table(data) == {"interval": 5}
    # a file of health keys alone (no [health] table) keeps working; the hooks are not checks
    assert health_table({"interval": 5, "prolog": {"path": "/p"}}) == {"interval": 5}
    assert health_table({"prolog": {"path": "/p"}}) == {}


def test_launch_timeout_warning_when_the_prologs_may_outlast_launch_timeout() -> None:
    both = NodeHooks(prolog=Hook("/p", 40.0), task_prolog=Hook("/t", 20.0))
    said = hooks.launch_timeout_warning(both, 60.0)
    assert said is not None and "launch_timeout (60s)" in said and "60s together" in said
    assert hooks.launch_timeout_warning(NodeHooks(prolog=Hook("/p", 30.0)), 60.0) is None
    assert hooks.launch_timeout_warning(NodeHooks(epilog=Hook("/e", 600.0)), 60.0) is None
    assert hooks.launch_timeout_warning(both, None) is None


def test_root_hooks_get_the_jobs_slurm_variables_not_the_submitters() -> None:
    job_env = {
        "SLURM_JOB_ID": "12",
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_PARTITION": "gpu",
        "PHX_JOB_ID": "12",
        "PATH": "/home/alice/bin:/usr/bin",
        "LD_PRELOAD": "/home/alice/evil.so",
    }
    env = hooks.hook_environment(job_env, "n1", "prolog")
    assert env["SLURM_JOB_ID"] == "12" and env["SLURM_JOB_PARTITION"] == "gpu"
    assert env["SLURMD_NODENAME"] == "n1" and env["SLURM_SCRIPT_CONTEXT"] == "prolog_slurmd"
    assert env["PATH"] == hooks.ROOT_PATH and "LD_PRELOAD" not in env
    spec = hooks.task_spec(
        NodeHooks(epilog=Hook("/e", 9.0), task_prolog=Hook("/t", 3.0)), job_env, "n1"
    )
    assert spec["epilog"]["path"] == "/e" and spec["epilog"]["timeout"] == 9.0
    assert spec["epilog"]["env"]["SLURM_SCRIPT_CONTEXT"] == "epilog_slurmd"
    assert spec["task_prolog"] == {"path": "/t", "timeout": 3.0} and "prolog" not in spec
    assert hooks.task_spec(None, job_env, "n1") == {}


# -- the shepherd's rules and runner ------------------------------------------------------------


def test_task_prolog_output_follows_slurms_rule() -> None:
    out = (
        b"export A=1\n"
        b"export B=x=y z\n"
        b"print hello there\n"
        b"unset C\n"
        b"export 9BAD=1\n"
        b"export A=2\n"
        b"something else\n"
        b"export D=4\n"
        b"unset D\n"
    )
    sets, unsets, prints = shepherd_hooks._task_prolog_effects(out)
    assert sets == {"A": "2", "B": "x=y z"}
    assert unsets == ["C", "D"]
    assert prints == ["hello there"]


def _run(status: int | None, output: bytes = b"", **kw: Any) -> Any:
    run = shepherd_hooks._HookRun()
    run.status, run.output = status, output
    for k, v in kw.items():
        setattr(run, k, v)
    return run


def test_failure_text_carries_the_status_and_a_bounded_excerpt() -> None:
    assert shepherd_hooks._failure_text("prolog", _run(0, b"fine"), 5) is None
    said = shepherd_hooks._failure_text("prolog", _run(1 << 8, b"no /scratch\n\nbye\n"), 5)
    assert said == "prolog failed (exit status 1): no /scratch | bye"
    assert (
        shepherd_hooks._failure_text("epilog", _run(9), 5) == "epilog failed (killed by signal 9)"
    )
    timed = shepherd_hooks._failure_text("prolog", _run(None, timed_out=True), 7.5)
    assert timed == "prolog failed (timed out after 7.5s, killed)"
    long = shepherd_hooks._failure_text("prolog", _run(2 << 8, b"x" * 100_000), 5)
    assert long is not None and len(long) < 400 and long.endswith("...")


def test_run_hook_captures_output_exit_status_and_environment(tmp_path: Path) -> None:
    path = script(tmp_path, "h.sh", 'echo "job $SLURM_JOB_ID"; echo oops >&2; exit 3\n')
    run = shepherd_hooks._run_hook(path, {"SLURM_JOB_ID": "7"}, 30)
    assert os.WEXITSTATUS(run.status) == 3 and not run.timed_out
    assert run.output == b"job 7\noops\n"


def test_run_hook_kills_the_whole_session_at_its_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    path = script(tmp_path, "slow.sh", f"sleep 60 & echo $! > {pidfile}; echo started; wait\n")
    began = time.monotonic()
    run = shepherd_hooks._run_hook(path, {"PATH": "/usr/bin:/bin"}, 1.0)
    assert run.timed_out and run.status is None and run.output == b"started\n"
    assert time.monotonic() - began < 15
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 15
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the hook's child outlived its timeout"


def test_run_hook_does_not_wait_for_a_child_that_keeps_its_output(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    path = script(tmp_path, "bg.sh", f"sleep 60 & echo $! > {pidfile}; echo done\n")
    began = time.monotonic()
    run = shepherd_hooks._run_hook(path, {"PATH": "/usr/bin:/bin"}, 30)
    took = time.monotonic() - began
    os.kill(int(pidfile.read_text()), 9)
    assert run.ok and run.output == b"done\n" and took < 15


def test_run_hook_that_cannot_execute_fails_with_why(tmp_path: Path) -> None:
    run = shepherd_hooks._run_hook(str(tmp_path / "missing.sh"), {}, 5)
    said = shepherd_hooks._failure_text("prolog", run, 5)
    assert said is not None and said.startswith("prolog failed (exit status 127): cannot execute")


def _alive(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


# -- a shepherd running them around a job --------------------------------------------------------


def run_task(tmp_path: Path, job: str, hooks_spec: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """Run one task's shepherd in the foreground; its exit record."""
    td = tmp_path / "task"
    td.mkdir()
    (td / "spec.json").write_text(
        json.dumps(
            {
                "attempt_id": 1,
                "job_id": 12,
                "token": "ab" * 8,
                "node": "node01",
                "rank": 0,
                "argv": [job],
                "env": {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "12"},
                "cwd": str(tmp_path),
                "stdout": str(tmp_path / "out"),
                "stderr": str(tmp_path / "err"),
                "open_mode": "truncate",
                "time_limit_s": None,
                "kill_grace_s": 1.0,
                "signal": None,
                "fence": None,
                "hooks": hooks_spec,
                **spec,
            }
        )
    )
    subprocess.run([sys.executable, "-I", "-S", str(SHEPHERD), str(td)], check=True, timeout=120)
    result: dict[str, Any] = json.loads((td / "exit.json").read_text())
    return result


def test_prolog_job_and_epilog_run_in_order_with_the_jobs_variables(tmp_path: Path) -> None:
    log = tmp_path / "log"
    pro = script(tmp_path, "pro.sh", f'echo "prolog $SLURM_JOB_ID uid=$SLURM_JOB_UID" >> {log}\n')
    epi = script(tmp_path, "epi.sh", f'echo "epilog $SLURMD_NODENAME" >> {log}\n')
    job = script(tmp_path, "job.sh", f"echo job >> {log}\n")
    env = {"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "node01"}
    result = run_task(
        tmp_path,
        job,
        {
            "prolog": {"path": pro, "timeout": 30, "env": env},
            "epilog": {"path": epi, "timeout": 30, "env": env},
        },
    )
    assert result["exit_code"] == 0 and not result["launch_failed"]
    assert "prolog_failed" not in result and "epilog_failed" not in result
    assert log.read_text().splitlines() == [f"prolog 12 uid={os.getuid()}", "job", "epilog node01"]


def test_a_failing_prolog_keeps_the_job_from_starting_and_says_why(tmp_path: Path) -> None:
    log = tmp_path / "log"
    pro = script(tmp_path, "pro.sh", "echo 'no /scratch here'; exit 1\n")
    epi = script(tmp_path, "epi.sh", f"echo epilog >> {log}\n")
    job = script(tmp_path, "job.sh", f"echo job >> {log}\n")
    result = run_task(
        tmp_path,
        job,
        {"prolog": {"path": pro, "timeout": 30}, "epilog": {"path": epi, "timeout": 30}},
    )
    assert result["launch_failed"] and result["started_at"] is None
    assert result["prolog_failed"] == "prolog failed (exit status 1): no /scratch here"
    assert result["error"] == "prolog failed (exit status 1): no /scratch here on node01"
    assert not log.exists(), "neither the job nor the epilog may run after a failed prolog"


def test_a_failing_epilog_is_recorded_and_leaves_the_jobs_outcome(tmp_path: Path) -> None:
    epi = script(tmp_path, "epi.sh", "echo 'cannot clean /tmp' >&2; exit 2\n")
    job = script(tmp_path, "job.sh", "exit 3\n")
    result = run_task(tmp_path, job, {"epilog": {"path": epi, "timeout": 30}})
    assert result["exit_code"] == 3 and not result["launch_failed"]
    assert result["epilog_failed"] == "epilog failed (exit status 2): cannot clean /tmp"


def test_task_prolog_sets_the_tasks_environment_and_prints_to_its_output(tmp_path: Path) -> None:
    tp = script(
        tmp_path,
        "tp.sh",
        'echo "export SCRATCH=/scratch/$SLURM_JOB_ID"\necho "unset DROPME"\n'
        'echo "print welcome to node01"\necho "warned" >&2\n',
    )
    job = script(tmp_path, "job.sh", 'echo "scratch=$SCRATCH dropme=${DROPME-unset}"\n')
    result = run_task(
        tmp_path,
        job,
        {"task_prolog": {"path": tp, "timeout": 30}},
        env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "12", "DROPME": "x"},
    )
    assert result["exit_code"] == 0
    assert (tmp_path / "out").read_text() == "welcome to node01\nscratch=/scratch/12 dropme=unset\n"
    assert (tmp_path / "err").read_text() == "warned\n"


def test_a_failing_task_prolog_is_a_launch_failure_without_a_drain(tmp_path: Path) -> None:
    tp = script(tmp_path, "tp.sh", "exit 4\n")
    job = script(tmp_path, "job.sh", "exit 0\n")
    result = run_task(tmp_path, job, {"task_prolog": {"path": tp, "timeout": 30}})
    assert result["launch_failed"] and "prolog_failed" not in result
    assert result["error"] == "task prolog failed (exit status 4) on node01"


# -- the controller's decisions ---------------------------------------------------------------------

POLICY = FailurePolicy(
    max_launch_failures=3,
    launch_backoff_base=2.0,
    launch_backoff_max=5.0,
    max_retries=3,
    retry_backoff_base=2.0,
    retry_backoff_max=30.0,
)
PROLOG = "prolog failed (exit status 1): no /scratch"


def prolog_task(node: str = "n2") -> TaskEnd:
    return TaskEnd(
        node=node,
        detail={"launch_failed": True, "prolog_failed": PROLOG, "error": f"{PROLOG} on {node}"},
    )


def decide(tasks: list[TaskEnd], **kw: Any) -> Any:
    base: dict[str, Any] = {
        "result": JobState.FAILED,
        "reason": "task on n2 did not start",
        "stop_reason": None,
        "requeue": True,
        "lost_nodes": [],
        "launch_failed": [],
        "launch_failures": 0,
        "policy": POLICY,
        "tasks": tasks,
        "retries": 0,
    }
    return after_attempt(**{**base, **kw})


def test_a_failed_prolog_requeues_at_once_avoiding_the_node_and_spends_no_retry() -> None:
    v = decide([prolog_task()])
    assert v.action is Action.REQUEUE and v.state is JobState.PENDING
    assert not v.retry and not v.launch_failure and v.retry_after == 0
    assert v.avoid == ("n2",) and v.why == "prolog"
    assert v.reason == f"{PROLOG} on n2; requeued without spending a retry (n2 drained)"
    # even a job that allows no retries at all, or asked never to be requeued: it never ran
    assert decide([prolog_task()], retries=3).action is Action.REQUEUE
    assert decide([prolog_task()], requeue=False).action is Action.REQUEUE


def test_a_failed_prolog_ends_a_non_requeueable_job_that_had_started_elsewhere() -> None:
    ran = TaskEnd(node="n1", exit_code=None, signal=15, detail={"started_at": 5.0})
    v = decide([ran, prolog_task()], requeue=False)
    assert v.action is Action.END and v.state is JobState.NODE_FAIL
    assert "had started on n1" in v.reason
    assert decide([ran, prolog_task()], requeue=True).action is Action.REQUEUE


def test_cancel_and_planned_requeues_win_over_a_failed_prolog() -> None:
    assert decide([prolog_task()], stop_reason="cancel: by alice").action is Action.END
    planned = decide([prolog_task()], stop_reason="requeue: node n2 drained by ops: x")
    assert planned.action is Action.REQUEUE and planned.why is None


def test_hook_failures_drain_with_the_hooks_sentence() -> None:
    assert hook_drain({"prolog_failed": PROLOG}, 12) == ("prolog", f"{PROLOG} (job 12)")
    assert hook_drain({"epilog_failed": "epilog failed (exit status 2)"}, None) == (
        "epilog",
        "epilog failed (exit status 2)",
    )
    assert hook_drain({"exit_code": 1}, 12) is None and hook_drain(None, 1) is None
    row = {"node": "n2", "state": "EXITED", "started_at": None, "exit_code": None}
    detail = dict(prolog_task().detail)
    # the node's drain is the prolog's: no failed launch counted towards a second drain
    assert launch_error({**row, "detail": detail}) is None
    assert describe_exit({**row, "exit_signal": None, "detail": detail}).startswith(
        "did not start: prolog failed"
    )


def test_explain_shows_an_epilog_failure_beside_the_tasks_end() -> None:
    ok = {"node": "n1", "state": "EXITED", "exit_code": 0, "exit_signal": None}
    said = _task_text({**ok, "detail": {"epilog_failed": "epilog failed (exit status 2): x"}})
    assert (
        said
        == "n1: epilog failed (exit status 2): x (node drained; the job's outcome is unchanged)"
    )
    bad = {**ok, "exit_code": 3, "detail": {"epilog_failed": "epilog failed (exit status 2)"}}
    assert _task_text(bad) == (
        "n1: exit code 3; epilog failed (exit status 2) (node drained; the job's outcome is unchanged)"
    )
    assert _task_text({**ok, "detail": {}}) is None
