"""The verdict after an attempt ends: end, requeue (maybe after a backoff), or hold; the retry
rules (kinds, exit codes, budget, backoff, avoided nodes) and their parsing."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.config import load_config
from phalanx.domain.directives import parse_submission
from phalanx.domain.policy import (
    DEFAULT_RETRY_ON,
    Action,
    FailureKind,
    FailurePolicy,
    RetryOn,
    TaskEnd,
    after_attempt,
    backoff,
    classify,
    parse_backoff,
    parse_retry_on,
    parse_seconds,
)
from phalanx.domain.states import JobState
from phalanx.errors import ConfigError, InvalidSpec

POLICY = FailurePolicy(
    max_launch_failures=3,
    launch_backoff_base=2.0,
    launch_backoff_max=5.0,
    max_retries=3,
    retry_backoff_base=2.0,
    retry_backoff_max=30.0,
)


def verdict(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "result": JobState.COMPLETED,
        "reason": None,
        "stop_reason": None,
        "requeue": True,
        "lost_nodes": [],
        "launch_failed": [],
        "launch_failures": 0,
        "policy": POLICY,
    }
    return after_attempt(**{**base, **kw})


def exit_task(code: int | None, node: str = "n3", **detail: Any) -> TaskEnd:
    return TaskEnd(node=node, exit_code=code, detail=detail)


def failed_with(code: int, node: str = "n3", **kw: Any) -> Any:
    return verdict(result=JobState.FAILED, tasks=[exit_task(code, node)], **kw)


# -- what was there before the retry rules: cancel, planned stops, node failures, launches --


def test_normal_failure_ends_and_says_no_rule_retries_it() -> None:
    v = verdict(result=JobState.FAILED, reason="exit 3")
    assert (v.action, v.state) == (Action.END, JobState.FAILED)
    assert v.reason == f"exit 3; not retried: exit is not in --retry-on ({DEFAULT_RETRY_ON})"
    assert not v.retry


def test_success_ends_completed_without_a_reason() -> None:
    v = verdict(tasks=[exit_task(0)])
    assert (v.action, v.state, v.reason, v.kind) == (Action.END, JobState.COMPLETED, None, None)


def test_cancel_wins_over_everything() -> None:
    v = verdict(result=JobState.NODE_FAIL, stop_reason="cancel: by bob", reason="by bob")
    assert (v.action, v.state) == (Action.END, JobState.CANCELLED)


def test_planned_stop_requeues_even_after_a_clean_exit_and_spends_no_retry() -> None:
    v = verdict(stop_reason="requeue: node n1 drained by ops: x", retries=3)
    assert (v.action, v.state, v.retry_after) == (Action.REQUEUE, JobState.PENDING, 0.0)
    assert not v.retry and v.kind is None


@pytest.mark.parametrize("requeue", [True, False])
def test_node_failure_requeues_only_requeueable_jobs(requeue: bool) -> None:
    v = verdict(result=JobState.NODE_FAIL, reason="lost", requeue=requeue, lost_nodes=["n2", "n1"])
    assert v.kind is FailureKind.NODE_FAIL
    if requeue:
        assert v.action is Action.REQUEUE and v.avoid == ("n1", "n2")
        assert v.retry and v.retry_after == 0.0, "node failures restart at once"
        assert v.reason == "requeued after node failure: lost (retry 1 of 3)"
    else:
        assert (v.action, v.state) == (Action.END, JobState.NODE_FAIL)
        assert "not requeue-able" in v.reason


@pytest.mark.parametrize(("before", "delay"), [(0, 2.0), (1, 4.0)])
def test_launch_failures_back_off_exponentially(before: int, delay: float) -> None:
    v = verdict(
        result=JobState.FAILED, launch_failed=[("n1", "no such dir")], launch_failures=before
    )
    assert v.action is Action.REQUEUE and v.launch_failure
    assert v.retry_after == delay
    assert v.avoid == ("n1",)
    assert "no such dir" in (v.reason or "")
    assert not v.retry, "launch failures have their own budget, not --retries"


def test_backoff_is_capped() -> None:
    policy = FailurePolicy(max_launch_failures=10, launch_backoff_base=2.0, launch_backoff_max=5.0)
    v = verdict(launch_failed=[("n1", "x")], launch_failures=6, policy=policy)
    assert v.retry_after == 5.0


def test_hold_after_max_launch_failures_says_what_and_where() -> None:
    v = verdict(
        launch_failed=[("n7", "cannot open output file /o: Permission denied")], launch_failures=2
    )
    assert (v.action, v.state) == (Action.HOLD, JobState.HELD)
    assert "3 times" in (v.reason or "") and "n7" in (v.reason or "")
    assert "Permission denied" in (v.reason or "")


def test_launch_not_in_retry_on_ends_the_job_failed() -> None:
    rules = POLICY.rules(retry_on="node_fail")
    v = verdict(launch_failed=[("n1", "no such dir")], rules=rules)
    assert (v.action, v.state) == (Action.END, JobState.FAILED)
    assert v.reason.endswith("not retried: launch is not in --retry-on (node_fail)")


# -- exit codes -----------------------------------------------------------------------------


def test_listed_exit_code_retries_with_backoff_and_avoids_the_node() -> None:
    rules = POLICY.rules(retry_on="exit:1")
    v = failed_with(1, rules=rules, retries=1)
    assert (v.action, v.state, v.kind) == (Action.REQUEUE, JobState.PENDING, FailureKind.EXIT)
    assert v.retry and v.retry_after == 4.0 and v.avoid == ("n3",)
    assert (
        v.reason
        == "task on n3 exited with code 1; requeued (retry 2 of 3, starts in 4s at the earliest)"
    )


def test_unlisted_exit_code_names_the_rule() -> None:
    v = failed_with(2, rules=POLICY.rules(retry_on="exit:1,hang"))
    assert (v.action, v.state) == (Action.END, JobState.FAILED)
    assert (
        v.reason
        == "task on n3 exited with code 2; not retried: exit code 2 is not in --retry-on (hang,exit:1)"
    )


def test_plain_exit_kind_retries_any_nonzero_code() -> None:
    v = failed_with(77, rules=POLICY.rules(retry_on="exit"))
    assert v.action is Action.REQUEUE


def test_death_by_signal_counts_as_128_plus_the_signal() -> None:
    task = TaskEnd(node="n1", signal=9)
    v = verdict(result=JobState.FAILED, tasks=[task], rules=POLICY.rules(retry_on="exit:137"))
    assert v.action is Action.REQUEUE
    assert "task on n1 was killed by signal 9 (exit code 137)" in v.reason


def test_budget_is_spent_then_the_job_ends_with_the_rule_that_stopped_it() -> None:
    rules = POLICY.rules(retry_on="exit")
    v = failed_with(1, rules=rules, retries=3)
    assert (v.action, v.state) == (Action.END, JobState.FAILED)
    assert (
        v.reason == "task on n3 exited with code 1; not retried: all 3 retries used (--retries=3)"
    )
    v0 = failed_with(1, rules=POLICY.rules(retry_on="exit", retries=0))
    assert v0.reason.endswith("the job allows no retries (--retries=0)")


def test_explicit_no_requeue_retries_nothing() -> None:
    rules = POLICY.rules(retry_on="all", no_requeue=True)
    v = failed_with(1, rules=rules)
    assert v.action is Action.END and "--no-requeue" in v.reason


def test_multi_node_failure_blames_the_task_that_failed_not_the_stopped_peers() -> None:
    tasks = [
        TaskEnd(node="n1", signal=15, detail={"cancelled": True}),
        TaskEnd(node="n2", exit_code=3),
        TaskEnd(node="n3", signal=15, detail={"cancelled": True}),
    ]
    f = classify(
        result=JobState.FAILED,
        reason=None,
        stop_reason="task on n2 exited with code 3; stopping the other nodes",
        lost_nodes=[],
        launch_failed=[],
        tasks=tasks,
    )
    assert f is not None and (f.kind, f.nodes, f.exit_code) == (FailureKind.EXIT, ("n2",), 3)


# -- other kinds ------------------------------------------------------------------------------


def test_hang_retries_by_default_with_its_story() -> None:
    hung = {"last_progress_at": 1.0, "timeout_s": 30, "step": 120}
    task = TaskEnd(node="n2", signal=15, detail={"hung": hung})
    v = verdict(result=JobState.FAILED, tasks=[task])
    assert (v.action, v.kind, v.avoid) == (Action.REQUEUE, FailureKind.HANG, ("n2",))
    assert v.reason.startswith(
        "hung: no progress for 30s since step 120 on n2; requeued (retry 1 of 3"
    )


def test_hung_job_that_exits_zero_on_sigterm_still_failed() -> None:
    task = TaskEnd(node="n2", exit_code=0, detail={"hung": {"timeout_s": 5}})
    v = verdict(result=JobState.COMPLETED, tasks=[task], rules=POLICY.rules(retry_on="none"))
    assert (v.action, v.state) == (Action.END, JobState.FAILED)
    assert (
        v.reason == "hung: no progress for 5s on n2; not retried: hang is not in --retry-on (none)"
    )


def test_health_drain_is_a_failure_that_spends_the_budget_without_backoff() -> None:
    stop = "requeue: n4 health check gpu: GPU 0: XID 79"
    v = verdict(stop_reason=stop, tasks=[exit_task(0, "n4")], retries=1)
    assert (v.action, v.kind, v.retry, v.retry_after) == (
        Action.REQUEUE,
        FailureKind.HEALTH,
        True,
        0.0,
    )
    assert v.avoid == ("n4",)
    assert "n4 health check gpu" in v.reason and "retry 2 of 3" in v.reason
    spent = verdict(stop_reason=stop, retries=3)
    assert (spent.action, spent.state) == (Action.END, JobState.NODE_FAIL)


@pytest.mark.parametrize(
    ("result", "kind"),
    [(JobState.TIMEOUT, FailureKind.TIMEOUT), (JobState.OUT_OF_MEMORY, FailureKind.OOM)],
)
def test_timeout_and_oom_do_not_retry_by_default_and_never_blame_the_node(
    result: JobState, kind: FailureKind
) -> None:
    task = exit_task(None, "n1", timed_out=result is JobState.TIMEOUT, oom=True)
    v = verdict(result=result, tasks=[task])
    assert (v.action, v.state, v.kind) == (Action.END, result, kind)
    assert f"{kind.value} is not in --retry-on" in v.reason
    again = verdict(result=result, tasks=[task], rules=POLICY.rules(retry_on=kind.value))
    assert again.action is Action.REQUEUE and again.avoid == () and again.retry_after == 2.0


# -- parsing -----------------------------------------------------------------------------------


def test_parse_retry_on_forms() -> None:
    r = parse_retry_on("node_fail,health,launch,hang,exit:1,exit:137")
    assert r.kinds == {
        FailureKind.NODE_FAIL,
        FailureKind.HEALTH,
        FailureKind.LAUNCH,
        FailureKind.HANG,
    }
    assert r.exit_codes == {1, 137}
    assert parse_retry_on("Node-Fail, exit:64-66").exit_codes == {64, 65, 66}
    assert parse_retry_on("none") == RetryOn()
    assert parse_retry_on("all").kinds == frozenset(FailureKind)
    assert parse_retry_on(r.text()) == r


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty item"),
        ("hang,,exit", "empty item"),
        ("bogus", "unknown failure kind 'bogus'"),
        ("exit:0", "1 to 255"),
        ("exit:256", "1 to 255"),
        ("exit:5-3", "1 to 255"),
        ("exit:x", "1 to 255"),
        ("none,hang", "must stand alone"),
    ],
)
def test_parse_retry_on_refuses_with_a_reason(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_retry_on(text)


def test_parse_backoff_and_seconds() -> None:
    assert parse_backoff("10") == (10.0, None)
    assert parse_backoff("2s:1m") == (2.0, 60.0)
    assert parse_backoff("0") == (0.0, None)
    assert parse_seconds("500ms") == 0.5 and parse_seconds("1h") == 3600.0
    with pytest.raises(ValueError, match="below the base"):
        parse_backoff("10:5")
    with pytest.raises(ValueError, match=r"e\.g\. 10, 2\.5s"):
        parse_backoff("soon")


def test_job_rules_override_cluster_defaults_field_by_field() -> None:
    rules = POLICY.rules(retries=7, retry_backoff="1")
    assert rules.max_retries == 7 and rules.retry_on == parse_retry_on(DEFAULT_RETRY_ON)
    assert (rules.backoff_base, rules.backoff_max) == (1.0, 30.0)
    assert POLICY.rules(retry_backoff="60").backoff_max == 60.0, "the cap never undercuts BASE"


# -- properties ----------------------------------------------------------------------------------

KINDS_OF_END = st.sampled_from(["exit", "node", "hang", "health", "planned", "timeout", "oom"])


def _end(kind: str, code: int) -> dict[str, Any]:
    """after_attempt arguments for one attempt that ended in `kind`."""
    if kind == "exit":
        return {"result": JobState.FAILED, "tasks": [exit_task(code)]}
    if kind == "node":
        return {"result": JobState.NODE_FAIL, "reason": "lost", "lost_nodes": ["n1"]}
    if kind == "hang":
        return {"result": JobState.FAILED, "tasks": [exit_task(143, hung={"timeout_s": 1})]}
    if kind == "health":
        return {"stop_reason": "requeue: n1 health check disk: full"}
    if kind == "timeout":
        return {"result": JobState.TIMEOUT, "tasks": [exit_task(None, timed_out=True)]}
    if kind == "oom":
        return {"result": JobState.OUT_OF_MEMORY, "tasks": [exit_task(None, oom=True)]}
    return {"stop_reason": "requeue: node n1 drained by ops: fw"}


@given(
    max_retries=st.integers(0, 6),
    ends=st.lists(st.tuples(KINDS_OF_END, st.integers(1, 255)), max_size=25),
    retry_on=st.sampled_from(["all", "exit,hang", DEFAULT_RETRY_ON, "none", "exit:1-100"]),
)
def test_budget_is_never_exceeded_and_planned_requeues_never_spend_it(
    max_retries: int, ends: list[tuple[str, int]], retry_on: str
) -> None:
    rules = POLICY.rules(retries=max_retries, retry_on=retry_on)
    used = 0
    for kind, code in ends:
        v = verdict(rules=rules, retries=used, **_end(kind, code))
        if kind == "planned":
            assert v.action is Action.REQUEUE and not v.retry
        if v.retry:
            assert v.action is Action.REQUEUE
            used += 1
        elif v.action is Action.END:
            break  # the job is over
        assert used <= max_retries


@given(base=st.floats(0, 1000), cap_extra=st.floats(0, 10_000), n=st.integers(1, 200))
def test_backoff_is_monotone_and_capped(base: float, cap_extra: float, n: int) -> None:
    cap = base + cap_extra
    assert 0.0 <= backoff(n, base, cap) <= backoff(n + 1, base, cap) <= cap
    if base > 0:
        assert backoff(1, base, cap) == base


# -- cluster defaults from the configuration ----------------------------------------------------


def test_retry_config_feeds_the_failure_policy() -> None:
    cfg = load_config(
        overrides={
            "retry": {"max_retries": 2, "retry_on": "hang,exit:3", "backoff_base": 1.0},
            "cluster": {"max_launch_failures": 4},
        }
    )
    policy = cfg.failure_policy()
    assert (policy.max_retries, policy.retry_on, policy.max_launch_failures) == (
        2,
        "hang,exit:3",
        4,
    )
    rules = policy.rules()
    assert rules.retry_on.retries(FailureKind.EXIT, 3) and not rules.retry_on.retries(
        FailureKind.NODE_FAIL
    )
    assert (rules.backoff_base, rules.backoff_max) == (1.0, 600.0)


@pytest.mark.parametrize(
    ("retry", "says"),
    [
        ({"retry_on": "often"}, "retry.retry_on: invalid --retry-on 'often'"),
        ({"backoff_base": 60.0, "backoff_max": 5.0}, "backoff_base (60) must not exceed"),
        ({"max_retries": -1}, "retry.max_retries"),
        ({"backoff_base": -1.0}, "retry.backoff_base"),
        ({"tries": 3}, "retry.tries"),
    ],
)
def test_bad_retry_config_is_refused_naming_the_setting(retry: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(overrides={"retry": retry})


# -- the options, from #SBATCH lines and the command line -----------------------------------------


def test_retry_options_from_a_script_and_the_command_line() -> None:
    script = "#!/bin/bash\n#SBATCH --retries=4\n#SBATCH --retry-on=node_fail,exit:75\ntrue\n"
    parsed = parse_submission(script, ["--retry-backoff=5:60"], "job.sh")
    keys = ("retries", "retry_on", "retry_backoff")
    assert {k: parsed.fields[k] for k in keys} == {
        "retries": 4,
        "retry_on": "node_fail,exit:75",
        "retry_backoff": "5:60",
    }
    with pytest.raises(
        InvalidSpec, match=r"job\.sh line 2: --retry-on: .*unknown failure kind 'flaky'"
    ):
        parse_submission("#!/bin/bash\n#SBATCH --retry-on=flaky\n", [], "job.sh")


def test_a_job_error_ends_the_job_failed_without_retry_or_blame() -> None:
    from phalanx.domain.policy import TaskEnd

    task = TaskEnd(
        "n1",
        detail={"launch_failed": True, "job_error": True, "error": "user al is unknown on n1"},
    )
    v = verdict(result=JobState.FAILED, tasks=[task], launch_failures=2)
    assert (v.action, v.state) == (Action.END, JobState.FAILED)
    assert v.reason.startswith("user al is unknown on n1; not retried")
    assert not v.launch_failure and not v.retry and v.avoid == ()
