"""The simulator's workload files and the heartbeat rule (docs/sim.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.config import Timing
from phalanx.sim import workload as wl
from phalanx.sim.run import config_toml, histogram, quantile

EXAMPLE = Path(__file__).parents[2] / "examples" / "sim" / "mixed.toml"


def test_example_workload_expands_to_its_job_count() -> None:
    w = wl.load(EXAMPLE)
    subs = w.submissions()
    tasks = 0
    for user, spec in subs:
        assert spec["account"] == w.accounts[user]
        if "array" in spec:
            lo, hi = map(int, spec["array"].split("-"))
            tasks += hi - lo + 1
        else:
            tasks += 1
    assert tasks == w.total_jobs == 8200
    gang = [s for _, s in subs if s["name"] == "train"]
    assert len(gang) == 200 and all(s["nodes"] == 4 and s["gpus_per_node"] == 8 for s in gang)
    # the same seed gives the same workload; every job's run is in its command
    assert [s["wrap"] for _, s in subs] == [s["wrap"] for _, s in wl.load(EXAMPLE).submissions()]


def test_failure_rate_sets_the_exit_codes() -> None:
    w = wl.parse({"jobs": [{"count": 2000}], "failures": {"task_fail_rate": 0.25}})
    codes = [wl.run_of({"script": s["wrap"]}, 60)[1] for _, s in w.submissions()]
    assert 400 < codes.count(1) < 600 and set(codes) == {0, 1}


def test_run_of_reads_the_command_or_runs_the_time_limit() -> None:
    assert wl.run_of({"script": "#!/bin/sh\nsleep 2.5; exit 3\n"}, 60) == (2.5, 3, False)
    assert wl.run_of({"script": "sleep 100; exit 0"}, 60) == (60.0, 0, True)
    assert wl.run_of({"argv": ["python", "train.py"]}, 30) == (30.0, 0, True)


def test_node_classes_take_their_share() -> None:
    w = wl.parse(
        {
            "nodes": [{"share": 3, "cpus": 8}, {"share": 1, "cpus": 16, "gpus": 4}],
            "jobs": [{"count": 1}],
        }
    )
    classes = [w.node_class(i, 100) for i in range(100)]
    assert sum(c.gpus == 4 for c in classes) == 25
    assert sum(c.cpus == 8 for c in classes) == 75


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"jobs": []}, "no [[jobs]]"),
        ({"jobs": [{"count": -1}]}, "count must be a whole number"),
        ({"jobs": [{"duration": [3, 1]}]}, "duration must be seconds or [low, high]"),
        ({"jobs": [{"users": ["nobody"]}]}, "users must name users of [[users]]"),
        ({"jobs": [{"mem": "lots"}]}, "jobs[0]: mem"),
        ({"jobs": [{}], "failures": {"task_fail_rate": 2}}, "task_fail_rate must be a number"),
        ({"jobs": [{}], "colour": "red"}, "unknown keys ['colour']"),
        ({"jobs": [{}], "users": [{"name": "a b"}]}, "name must be a name"),
    ],
)
def test_bad_workloads_are_refused_with_the_field_named(data: dict, says: str) -> None:
    with pytest.raises(wl.WorkloadError) as e:
        wl.parse(data)
    assert says in str(e.value)


def test_unreadable_workload_file(tmp_path: Path) -> None:
    with pytest.raises(wl.WorkloadError, match="cannot read workload"):
        wl.load(tmp_path / "missing.toml")
    bad = tmp_path / "w.json"
    bad.write_text("{nope")
    with pytest.raises(wl.WorkloadError, match="is not valid json"):
        wl.load(bad)


def test_heartbeat_rule_scales_interval_and_detection_together() -> None:
    t = Timing(heartbeat_budget=500)
    assert t.cluster_interval(100) == 1.0  # under budget: as configured
    assert t.for_cluster(100) == t
    big = t.for_cluster(10_000)
    assert big.heartbeat_interval == pytest.approx(20.0)
    assert big.fence_timeout == pytest.approx(100.0)
    assert big.node_down_timeout == pytest.approx(200.0)
    # the heartbeat rate stays within the budget at every size
    for n in (10, 499, 501, 5_000, 50_000):
        assert n / t.for_cluster(n).heartbeat_interval <= 500 + 1e-9


def test_heartbeat_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="heartbeat_budget"):
        Timing(heartbeat_budget=0)


def test_config_written_for_the_cluster_loads(tmp_path: Path) -> None:
    from phalanx.config import load_config

    w = wl.load(EXAMPLE)
    p = tmp_path / "sim.toml"
    p.write_text(config_toml(Timing().for_cluster(3000), w))  # the default budget: 300/s
    cfg = load_config(p)
    assert cfg.timing.heartbeat_interval == pytest.approx(10.0)
    assert cfg.timing.node_down_timeout == pytest.approx(100.0)
    assert {u.name: u.account for u in cfg.fairshare.users} == w.accounts
    # the load generator is not throttled: at the default 200 jobs/s a user's submissions,
    # not the controller, bounded the placements measured once the burst was spent
    assert cfg.limits.submit_rate == 1e6 and cfg.limits.submit_burst == 1e8
    assert cfg.limits.api_rate == 1e6


def test_histogram_quantiles_from_metrics_text() -> None:
    text = "\n".join(
        [
            'x_bucket{le="0.1"} 5',
            'x_bucket{le="0.5"} 9',
            'x_bucket{le="+Inf"} 10',
            "x_count 10",
            "x_sum 2.5",
        ]
    )
    count, total, buckets = histogram(text, "x")
    assert (count, total) == (10, 2.5)
    assert quantile(buckets, 0.5) == 0.1
    assert quantile(buckets, 0.9) == 0.5
