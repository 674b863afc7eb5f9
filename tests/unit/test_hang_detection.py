"""Hang detection in the shepherd (--progress-timeout), with real jobs and real signals.

A job that reported progress and then stops reporting for the timeout is stopped (SIGTERM,
then SIGKILL after the kill grace) and its exit record says it hung; a job that keeps
reporting, or never reports at all, is left alone.
"""

from __future__ import annotations

import time
from pathlib import Path

from test_shepherd import Tasks, tasks

from phalanx.agent.shepherd_launch import launch

__all__ = ["tasks"]


def progress_job(tasks: Tasks, body: str) -> Path:
    """A script that reports progress to $PHX_PROGRESS_FILE (the protocol's file)."""
    return tasks.script(
        'P="$PHX_PROGRESS_FILE"; mkdir -p "$(dirname "$P")"\n'
        'report() { printf \'{"step": %s, "ts": 0}\' "$1" > "$P.tmp"; mv "$P.tmp" "$P"; }\n' + body
    )


def env_with_progress(td_root: Path, name: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PHX_PROGRESS_FILE": str(td_root / f"{name}-control" / "progress.json"),
    }


def test_job_that_stops_reporting_is_stopped_as_hung(tasks: Tasks) -> None:
    job = progress_job(tasks, "report 1; report 120; exec sleep 300\n")
    env = env_with_progress(tasks.root, "hang")
    began = time.monotonic()
    td = tasks.launch(job, env=env, progress_timeout_s=1)
    result = tasks.wait_exited(td)
    took = time.monotonic() - began
    assert result["signal"] == 15, "stopped with SIGTERM"
    assert not result["cancelled"] and not result["timed_out"]
    hung = result["hung"]
    assert hung["timeout_s"] == 1 and hung["step"] == 120 and hung["idle_s"] >= 1.0
    progress = Path(env["PHX_PROGRESS_FILE"])
    assert hung["last_progress_at"] == progress.stat().st_mtime
    assert 1.0 <= took < 15, f"detected within its timeout plus a check interval ({took:.1f}s)"


def test_hang_that_ignores_sigterm_is_killed_after_the_grace(tasks: Tasks) -> None:
    job = progress_job(tasks, "trap '' TERM; report 7; while :; do sleep 0.1; done\n")
    td = tasks.launch(
        job, env=env_with_progress(tasks.root, "stubborn"), progress_timeout_s=1, kill_grace_s=0.5
    )
    result = tasks.wait_exited(td)
    assert result["signal"] == 9 and result["hung"]["step"] == 7


def test_steady_progress_and_no_progress_file_are_left_alone(tasks: Tasks) -> None:
    steady = progress_job(tasks, "for i in $(seq 1 12); do report $i; sleep 0.25; done\n")
    silent = tasks.script("sleep 2\n")
    td_steady = tasks.launch(
        steady, env=env_with_progress(tasks.root, "steady"), progress_timeout_s=1
    )
    # never reports: the timeout never starts (the job may not use the protocol at all)
    td_silent = tasks.launch(
        silent, env=env_with_progress(tasks.root, "silent"), progress_timeout_s=1
    )
    for td in (td_steady, td_silent):
        result = tasks.wait_exited(td)
        assert result["exit_code"] == 0 and "hung" not in result


def test_default_progress_file_is_in_the_task_control_dir(tasks: Tasks) -> None:
    job = tasks.script(
        'mkdir -p "$PHX_TASK_DIR/control"; echo 5 > "$PHX_TASK_DIR/control/progress.json"\n'
        "exec sleep 300\n"
    )
    td = tasks.task(job, progress_timeout_s=1)
    spec_path = td / "spec.json"
    spec_path.write_text(
        spec_path.read_text().replace('"PATH": ', f'"PHX_TASK_DIR": "{td}", "PATH": ')
    )
    launch(td)
    result = tasks.wait_exited(td)
    assert result["hung"]["step"] is None, "plain text: touching counts, no step"
    assert result["signal"] == 15
