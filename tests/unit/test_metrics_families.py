"""Pure parts of /metrics: labels stay bounded, families follow Prometheus naming, GPU events
are reported until confirmed, and the agent's collector shows what its loops saw."""

from __future__ import annotations

import re

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.agent.health import FakeGpu, FakeNvml, GpuCheck
from phalanx.agent.metrics import AgentCollector, AgentFigures
from phalanx.controller.metrics import (
    OTHER,
    build_families,
    drain_kind,
    observe_placements,
    reason_code,
    top_n,
    user_families,
)
from phalanx.store.metrics import Histo, StoreFigures

NAME = re.compile(r"^phalanx_[a-z0-9_]+$")


def test_top_n_keeps_the_largest_and_sums_the_rest() -> None:
    counts = {"a": 5, "b": 1, "c": 3, "d": 1}
    assert top_n(counts, 2) == {"a": 5, "c": 3, OTHER: 2}
    assert top_n(counts, 10) == counts
    assert sum(top_n(counts, 1).values()) == sum(counts.values())


def test_reason_and_drain_labels_are_bounded_words() -> None:
    assert reason_code("Resources") == "Resources"
    assert reason_code("Dependency (afterok:41 not met)") == "Dependency"
    assert reason_code("requeued by root after FAILED") == "requeued"
    assert reason_code(None) == "None"
    assert drain_kind("health:gpu") == "health"
    assert drain_kind("maint:3") == "maintenance"
    assert drain_kind("phalanx") == "phalanx"
    assert drain_kind("alice") == "operator"


def _figures() -> StoreFigures:
    h = Histo(bounds=(1.0, 10.0), counts=[1, 3], total=4, sum=25.0)
    return StoreFigures(
        db_now=1000.0,
        jobs=[("PENDING", "batch", 2), ("PENDING", "batch", 1), ("RUNNING", "gpu", 1)],
        pending_reasons=[("Resources", 2), ("Dependency (afterok:1)", 1), (None, 4)],
        users=[("u1", "PENDING", 5), ("u2", "PENDING", 1), ("u3", "RUNNING", 1)],
        checkpoint_durations=h,
        nodes=[
            {
                "name": "n1",
                "registered": True,
                "down": False,
                "drain": True,
                "drain_by": "health:gpu",
                "cpus": 4,
                "last_heartbeat": 998.0,
                "health": {"status": "fail", "checks": {"gpu": {"status": "fail"}}},
            },
            {
                "name": "n2",
                "registered": True,
                "down": True,
                "drain": False,
                "drain_by": None,
                "cpus": 4,
                "last_heartbeat": 900.0,
                "health": None,
            },
        ],
        busy_nodes={"n1": 2},
        leases=[{"name": "cluster", "holder": "c1", "term": 4, "valid": True}],
        requeues=[("job.requeue", "node_fail", True, 2), ("job.requeue", "planned", False, 3)],
        gpu_xid=[("n1", 3, 79, 2)],
        gpu_ecc=[("n1", 3, 7)],
    )


def _scrape(fams: list[object]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    class C:
        def collect(self) -> list[object]:
            return fams

    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())  # type: ignore[arg-type]
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        assert NAME.match(fam.name), fam.name
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_cluster_families_from_figures() -> None:
    m = _scrape(build_families(_figures(), max_users=1, max_reasons=1, intervals=[600.0]))
    assert m[("phalanx_jobs", (("partition", "batch"), ("state", "PENDING")))] == 3
    # one reason of its own (the largest: None, 4), the others under "other"
    assert m[("phalanx_jobs_pending", (("reason", "None"),))] == 4
    assert m[("phalanx_jobs_pending", (("reason", OTHER),))] == 3
    # no user names in the public families: how many users, by state
    assert not [k for k in m if "user" in dict(k[1])]
    users = m[("phalanx_users_active", (("state", "PENDING"),))]
    assert users == len({u for u, st, n in _figures().users if st == "PENDING" and n})
    # the per-user series, for operators' scrapes, capped with "other"
    u = _scrape(user_families(_figures(), max_users=1))
    assert u[("phalanx_user_jobs", (("state", "PENDING"), ("user", "u1")))] == 5
    assert u[("phalanx_user_jobs", (("state", "PENDING"), ("user", OTHER)))] == 1
    assert u[("phalanx_user_jobs", (("state", "RUNNING"), ("user", OTHER)))] == 1
    assert m[("phalanx_checkpoint_duration_seconds_bucket", (("le", "10.0"),))] == 3
    assert m[("phalanx_checkpoint_duration_seconds_count", ())] == 4
    assert m[("phalanx_nodes", (("state", "DRAINING"),))] == 1
    assert m[("phalanx_nodes", (("state", "DOWN"),))] == 1
    assert m[("phalanx_nodes_drained", (("kind", "health"),))] == 1
    assert m[("phalanx_node_health_checks", (("check", "gpu"), ("status", "fail")))] == 1
    # the DOWN node is left out of the heartbeat lag: 2 s for n1
    assert m[("phalanx_agent_heartbeat_lag_seconds_bucket", (("le", "2.0"),))] == 1
    assert m[("phalanx_lease_takeovers_total", (("lease", "cluster"),))] == 3
    assert m[("phalanx_lease_holder", (("holder", "c1"), ("lease", "cluster")))] == 1
    assert m[("phalanx_job_requeues_total", (("reason", "planned"),))] == 3
    assert m[("phalanx_job_retries_total", (("reason", "node_fail"),))] == 2
    assert ("phalanx_job_retries_total", (("reason", "planned"),)) not in m
    assert m[("phalanx_gpu_xid_errors_total", (("gpu", "3"), ("node", "n1"), ("xid", "79")))] == 2
    assert m[("phalanx_gpu_ecc_uncorrectable_errors_total", (("gpu", "3"), ("node", "n1")))] == 7
    assert m[("phalanx_checkpoint_interval_seconds_bucket", (("le", "600.0"),))] == 1


def test_gpu_check_reports_xids_and_ecc_changes_until_confirmed() -> None:
    nvml = FakeNvml([FakeGpu(), FakeGpu()])
    check = GpuCheck(nvml)
    check.run()
    assert check.pending_events() == []
    assert check.readings[1]["temperature"] == 40
    nvml.queue_xid(1, 79)
    nvml.gpus[0].ecc_uncorrectable = 2
    check.run()
    events = check.pending_events()
    assert sorted(("xid" in e, e["gpu"]) for e in events) == [(False, 0), (True, 1)]
    (ecc,) = [e for e in events if "total" in e]
    assert (ecc["count"], ecc["total"]) == (2, 2)
    check.run()  # nothing new: the same two stay pending (no controller confirmed them)
    assert len(check.pending_events()) == 2
    check.confirm({e["key"] for e in events})
    assert check.pending_events() == []
    nvml.gpus[0].ecc_uncorrectable = 5
    check.run()
    (more,) = check.pending_events()
    assert (more["count"], more["total"]) == (3, 5)
    assert more["key"] != ecc["key"]


def test_agent_collector_shows_the_loops_figures() -> None:
    coll = AgentCollector(
        "n1",
        lambda: AgentFigures(tasks={"running": 2, "exited": 1}, steps=1, fenced_total=3),
        lambda: {"status": "warn", "checks": {"disk": {"status": "warn"}}},
        lambda: {0: {"temperature": 55.0, "ecc_uncorrectable": 1.0}},
    )
    m = _scrape(list(coll.collect()))
    assert m[("phalanx_agent_shepherds", (("state", "running"),))] == 2
    assert m[("phalanx_agent_shepherds", (("state", "lost"),))] == 0
    assert m[("phalanx_agent_fenced_tasks_total", ())] == 3
    assert m[("phalanx_agent_health_check_status", (("check", "disk"), ("status", "warn")))] == 1
    assert m[("phalanx_agent_health_check_status", (("check", "disk"), ("status", "ok")))] == 0
    assert m[("phalanx_agent_gpu_temperature_celsius", (("gpu", "0"),))] == 55


def test_placements_feed_queue_wait_and_submit_to_start() -> None:
    def counts() -> tuple[float, float, float]:
        get = REGISTRY.get_sample_value
        return (
            get("phalanx_job_queue_wait_seconds_count") or 0,
            get("phalanx_job_queue_wait_seconds_bucket", {"le": "5.0"}) or 0,
            get("phalanx_job_submit_to_start_seconds_count") or 0,
        )

    before = counts()
    first = {"id": 1, "submit_time": 1000.0, "restart_count": 0}  # waited 100 s
    again = {"id": 2, "submit_time": 0.0, "restart_count": 1}  # requeued at 1097: waited 3 s
    observe_placements([first, again], 1100.0, {2: 1097.0})
    after = counts()
    # both are attempts placed; only the first is a job's first start; the requeued one
    # waited since its requeue, not since its submission
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (2, 1, 1)
