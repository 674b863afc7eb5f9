"""Retries and hang detection with real controllers, agents, shepherds and jobs.

* A 100-task array (`%10` throttle) where some tasks fail on their first two attempts (a marker
  file per task counts the attempts) and one task always fails: every task retries within its
  own budget, the flaky ones complete, the hopeless one ends FAILED with the rule that stopped
  it, and while a failed task waits out its backoff other tasks keep starting (a failing task
  never blocks the array).
* A job that reports progress through `PHX_PROGRESS_FILE` and then hangs is stopped within its
  `--progress-timeout`, requeued on another node, and its events say why.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, run_cli

pytestmark = pytest.mark.system

TASKS = 100
THROTTLE = 10
FLAKY = {t for t in range(TASKS) if t % 10 == 3}  # fail on attempts 0 and 1, then succeed
HOPELESS = 7  # always fails: spends its whole budget
RETRIES = 2
BACKOFF_S = 1.5  # constant (BASE:MAX equal): long enough to see others start meanwhile

ARRAY_JOB = """#!/bin/bash
t=$SLURM_ARRAY_TASK_ID
marks={marks}
n=$(cat "$marks/$t" 2>/dev/null || echo 0)
echo $((n + 1)) > "$marks/$t"
case " {flaky} " in *" $t "*) [ "$n" -lt 2 ] && exit 1 ;; esac
[ "$t" -eq {hopeless} ] && exit 1
exit 0
"""


def _story(c: Any, j: dict[str, Any]) -> str:
    """A task's events and attempts, for a failure message."""
    events = [(e["ts"], e["kind"], e["message"]) for e in c.job_events(j["id"])]
    attempts = [
        (a["id"], a["nodes"], a["state"], a["result"], a["stop_reason"], a["tasks"])
        for a in c.job(j["id"])[0]["attempts"]
    ]
    return f"task {j['job_id']}: {j['state']} {j['reason']}; events {events}; attempts {attempts}"


def starts_of(events: list[dict[str, Any]]) -> list[float]:
    return [e["ts"] for e in events if e["kind"] == "job.starting"]


@pytest.mark.timeout(420)
def test_array_tasks_retry_within_their_own_budgets(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=4, cpus=8)
    c = cluster.client()
    marks = tmp_path / "marks"
    marks.mkdir()
    script = ARRAY_JOB.format(
        marks=marks, flaky=" ".join(map(str, sorted(FLAKY))), hopeless=HOPELESS
    )
    sub = c.submit(
        {
            "script": script,
            "name": "sweep",
            "array": f"0-{TASKS - 1}%{THROTTLE}",
            "submit_dir": str(tmp_path),
            "output": "/dev/null",
            "time_limit_s": 600,
            "retries": RETRIES,
            "retry_on": "exit:1",
            "retry_backoff": f"{BACKOFF_S}:{BACKOFF_S}",
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
        }
    )
    ids: list[int] = sub["job_ids"]
    assert len(ids) == TASKS
    jobs = cluster.wait_terminal(ids, timeout=360)
    by_task = {j["array_task_id"]: j for j in jobs.values()}

    for t, j in sorted(by_task.items()):
        runs = int((marks / str(t)).read_text())
        if t == HOPELESS:
            assert (j["state"], j["retries"], runs) == ("FAILED", RETRIES, RETRIES + 1), j
            assert j["reason"].endswith(
                f"not retried: all {RETRIES} retries used (--retries={RETRIES})"
            ), j
            assert len(j["avoid_nodes"] or []) == RETRIES + 1, "each failed node is avoided"
        elif t in FLAKY:
            assert (j["state"], j["retries"], runs) == ("COMPLETED", 2, 3), j
        else:
            assert (j["state"], j["retries"], runs) == ("COMPLETED", 0, 1), _story(c, j)

    # the hopeless task's story, one requeue per retry, then the end with its rule
    hopeless = by_task[HOPELESS]
    events = c.job_events(hopeless["id"])
    requeues = [e["message"] for e in events if e["kind"] == "job.requeue"]
    assert len(requeues) == RETRIES, requeues
    for n, msg in enumerate(requeues, start=1):
        assert f"exited with code 1; requeued (retry {n} of {RETRIES}" in msg, msg
        assert f"starts in {BACKOFF_S:g}s at the earliest" in msg, msg
    # attempts on different nodes: each failure put its node on the avoid list
    shown = c.job(hopeless["id"])[0]
    nodes = [a["nodes"][0] for a in shown["attempts"]]
    assert len(set(nodes)) == len(nodes) == RETRIES + 1, nodes
    assert shown["retry"] == {
        "max_retries": RETRIES,
        "retry_on": "exit:1",
        "backoff_base_s": BACKOFF_S,
        "backoff_max_s": BACKOFF_S,
    }

    # while it waited out its backoff, other tasks of the array kept starting: the failing
    # task did not hold its throttle slot (`%N` counts only active tasks)
    requeue_ts = [e["ts"] for e in events if e["kind"] == "job.requeue"]
    own_starts = starts_of(events)
    others = sorted(
        ts
        for j in by_task.values()
        if j["id"] != hopeless["id"]
        for ts in starts_of(c.job_events(j["id"]))
    )
    first_gap = (requeue_ts[0], min(s for s in own_starts if s > requeue_ts[0]))
    assert first_gap[1] - first_gap[0] >= BACKOFF_S - 0.1, first_gap
    started_meanwhile = [ts for ts in others if first_gap[0] < ts < first_gap[1]]
    assert started_meanwhile, f"no other task started during the backoff {first_gap}"

    # the throttle held: never more than THROTTLE tasks between start and end at once
    spans = []
    for j in by_task.values():
        for a in c.job(j["id"])[0]["attempts"]:
            spans.append((a["created_at"], a["end_time"] or time.time()))
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    active = peak = 0
    for _, d in edges:
        active += d
        peak = max(peak, active)
    assert peak <= THROTTLE, peak

    # the listing shows retries used; show gives the budget and the avoided nodes
    res = run_cli(["queue", "--all"], url=cluster.url, root=cluster.root)
    assert res.returncode == 0, res.stderr
    assert "RETRIES" in res.stdout.splitlines()[0], res.stdout[:400]
    line = next(ln for ln in res.stdout.splitlines() if ln.split()[0] == f"{ids[0]}_{HOPELESS}")
    assert line.split()[5] == str(RETRIES), line
    res = run_cli(["show", f"{ids[0]}_{HOPELESS}"], url=cluster.url, root=cluster.root)
    assert res.returncode == 0, res.stderr
    assert f"Retries={RETRIES}/{RETRIES} RetryOn=exit:1" in res.stdout, res.stdout


HUNG_JOB = """#!/bin/bash
P="$PHX_PROGRESS_FILE"
if [ "$SLURM_RESTART_COUNT" = 0 ]; then
  for step in 40 80 120; do
    printf '{"step": %d}' "$step" > "$P.tmp" && mv "$P.tmp" "$P"
    sleep 0.2
  done
  echo "stuck in a collective on $SLURMD_NODENAME"
  exec sleep 600
fi
echo "run $SLURM_RESTART_COUNT on $SLURMD_NODENAME finished"
"""
PROGRESS_TIMEOUT_S = 3


@pytest.mark.timeout(240)
def test_hung_job_is_detected_within_its_timeout_and_requeued(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=2, cpus=2)
    c = cluster.client()
    jid = cluster.submit_script(
        tmp_path,
        "hung",
        HUNG_JOB,
        progress_timeout_s=PROGRESS_TIMEOUT_S,
        retry_backoff="0",
    )
    done = cluster.wait_terminal([jid], timeout=180)[jid]
    job = c.job(jid)[0]
    assert done["state"] == "COMPLETED", job
    assert (job["restart_count"], job["retries"]) == (1, 1), job
    first, second = job["attempts"]
    assert first["nodes"] != second["nodes"], "the next attempt avoids the node it hung on"
    (task,) = first["tasks"]
    hung = task["detail"]["hung"]
    node = first["nodes"][0]
    assert (hung["timeout_s"], hung["step"]) == (PROGRESS_TIMEOUT_S, 120), hung
    assert task["exit_signal"] == 15, task

    events = c.job_events(jid)
    (requeue,) = [e for e in events if e["kind"] == "job.requeue"]
    assert requeue["message"].endswith(
        f"hung: no progress for {PROGRESS_TIMEOUT_S}s since step 120 on {node}; "
        "requeued (retry 1 of 5)"
    ), requeue
    # detected within its timeout: the shepherd judged it on time (plus one check interval),
    # and the controller requeued it promptly after
    detected_after = hung["idle_s"]
    assert PROGRESS_TIMEOUT_S <= detected_after < PROGRESS_TIMEOUT_S + 1.5, hung
    assert requeue["ts"] - hung["last_progress_at"] < PROGRESS_TIMEOUT_S + 15, (requeue, hung)
    print(
        f"hang: stopped {detected_after:.2f}s after the last progress (timeout "
        f"{PROGRESS_TIMEOUT_S}s), requeued {requeue['ts'] - hung['last_progress_at']:.2f}s after it"
    )
    out = (tmp_path / f"hung-{jid}.out").read_text().splitlines()
    assert out == [f"stuck in a collective on {node}", f"run 1 on {second['nodes'][0]} finished"]
