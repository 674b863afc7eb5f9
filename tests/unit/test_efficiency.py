"""Usage figures: what the store keeps of a task's report, attempt sums, seff lines, sacct
forms, and the cgroup files the shepherd reads them from (fake trees; the real kernel counts
are checked by tests/system/test_explain.py)."""

from __future__ import annotations

from pathlib import Path

from phalanx.agent import cgroups, gpu_usage
from phalanx.agent.health.gpu import FakeGpu, FakeNvml
from phalanx.domain import efficiency

NOW = 1_800_000_000.0


def test_task_usage_keeps_plausible_numbers_and_drops_the_rest() -> None:
    ok = efficiency.task_usage(
        {
            "usage": {"cpu_s": 12.3456, "max_rss_bytes": 200 * 2**20},
            "gpu": {
                "samples": 4,
                "util_mean": 55.55,
                "mem_peak_bytes": 2**30,
                "per_gpu": {"0": {"util_mean": 55.55, "mem_peak_bytes": 2**30}},
            },
        }
    )
    assert ok["cpu_time_s"] == 12.346
    assert ok["max_rss_bytes"] == 200 * 2**20
    assert ok["gpu_usage"]["util_mean"] == 55.5 or ok["gpu_usage"]["util_mean"] == 55.6
    assert ok["gpu_usage"]["per_gpu"]["0"]["mem_peak_bytes"] == 2**30
    for bad in (
        {"usage": {"cpu_s": -1, "max_rss_bytes": "lots"}},
        {"usage": {"cpu_s": float("nan"), "max_rss_bytes": True}},
        {"usage": "x", "gpu": {"samples": 0}},
        {},
        None,
    ):
        assert efficiency.task_usage(bad) == {  # type: ignore[arg-type]
            "cpu_time_s": None,
            "max_rss_bytes": None,
            "gpu_usage": None,
        }
    assert efficiency.task_usage({"gpu": {"samples": 3, "util_mean": 101}})["gpu_usage"] == {
        "samples": 3
    }


def _attempt(**kw: object) -> dict[str, object]:
    tasks = [
        {"node": "n1", "cpus": 4, "mem_mb": 1024, "gpu_ids": [0, 1], "cpu_time_s": 100.0,
         "max_rss_bytes": 512 * 2**20, "gpu_usage": {"samples": 2, "per_gpu": {
             "0": {"util_mean": 80.0, "mem_peak_bytes": 3 * 2**30},
             "1": {"util_mean": 40.0, "mem_peak_bytes": 2**30}}}},
        {"node": "n2", "cpus": 4, "mem_mb": 1024, "gpu_ids": [0, 1], "cpu_time_s": 60.0,
         "max_rss_bytes": 256 * 2**20, "gpu_usage": None},
        {"node": "n3", "cpus": 4, "mem_mb": 1024, "gpu_ids": [0, 1], "spare": True},
    ]  # fmt: skip
    base = {"id": 7, "seq": 0, "state": "ENDED", "result": "COMPLETED", "start_time": NOW - 100,
            "end_time": NOW, "tasks": tasks}  # fmt: skip
    base.update(kw)
    return base


def test_attempt_usage_sums_cpu_and_memory_and_leaves_spares_out() -> None:
    u = efficiency.attempt_usage(_attempt(), NOW)
    assert u["nodes"] == 2 and u["cpus"] == 8 and u["gpus"] == 4
    assert u["cpu_time_s"] == 160.0
    assert u["core_wall_s"] == 800.0
    assert u["mem_used_bytes"] == 768 * 2**20
    assert u["max_rss_bytes"] == 512 * 2**20
    assert u["mem_requested_bytes"] == 2048 * 2**20
    assert u["gpu_util_mean"] == 60.0
    assert u["gpu_mem_peak_bytes"] == 3 * 2**30


def test_report_reads_like_seff() -> None:
    job = {"job_id": "12", "user": "alice", "state": "COMPLETED", "exit_code": 0,
           "time_limit_s": 1000, "gpu_type": "h100", "restart_count": 0}  # fmt: skip
    lines = efficiency.report(job, [_attempt()], NOW)
    assert "State: COMPLETED (exit code 0)" in lines
    assert "Nodes: 2" in lines and "Cores per node: 4" in lines
    assert "CPU Utilized: 00:02:40" in lines
    assert "CPU Efficiency: 20.00% of 00:13:20 core-walltime" in lines
    assert "Job Wall-clock time: 00:01:40 (10.00% of the 00:16:40 time limit)" in lines
    assert "Memory Utilized: 768.00 MB (largest node: 512.00 MB)" in lines
    assert "Memory Efficiency: 37.50% of 2.00 GB (1.00 GB per node)" in lines
    assert "GPUs: 4 (h100)" in lines
    assert "GPU Utilization: 60.0% (mean of 2 samples)" in lines
    assert "GPU Memory Utilized: 3.00 GB (peak)" in lines
    pending = efficiency.report({**job, "state": "PENDING"}, [], NOW)
    assert pending[-1] == "Efficiency: the job has not run yet"
    running = _attempt(state="RUNNING", end_time=None)
    for t in running["tasks"]:  # type: ignore[attr-defined]
        t["cpu_time_s"] = t["max_rss_bytes"] = None
    lines = efficiency.report({**job, "state": "RUNNING"}, [running], NOW)
    assert "CPU Utilized: measured when the job ends" in lines


def test_sacct_forms() -> None:
    assert efficiency.total_cpu(None) == ""
    assert efficiency.total_cpu(5.25) == "00:05.250"
    assert efficiency.total_cpu(125.5) == "02:05.500"
    assert efficiency.total_cpu(3725) == "01:02:05"
    assert efficiency.total_cpu(90000) == "1-01:00:00"
    assert efficiency.max_rss(None) == ""
    assert efficiency.max_rss(1) == "1K"
    assert efficiency.max_rss(200 * 2**20) == "204800K"


def test_cgroup_usage_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2" / "7"
    v2.mkdir(parents=True)
    (v2 / "memory.peak").write_text("123456789\n")
    (v2 / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    plan = {"backend": "v2", "dirs": [str(v2)], "oom": f"{v2}/memory.events"}
    assert cgroups.usage(plan) == {"cpu_s": 2.5, "max_rss_bytes": 123456789}
    mem, cpu = tmp_path / "memory" / "7", tmp_path / "cpu,cpuacct" / "7"
    for d in (mem, cpu):
        d.mkdir(parents=True)
    (mem / "memory.max_usage_in_bytes").write_text("4096\n")
    (cpu / "cpuacct.usage").write_text("1500000000\n")
    plan = {"backend": "v1", "dirs": [str(cpu), str(mem)], "oom": f"{mem}/memory.oom_control"}
    assert cgroups.usage(plan) == {"cpu_s": 1.5, "max_rss_bytes": 4096}
    # an old kernel without memory.peak, a v1 host without cpuacct: only what exists
    (v2 / "memory.peak").unlink()
    (cpu / "cpuacct.usage").unlink()
    assert cgroups.usage({"backend": "v2", "dirs": [str(v2)], "oom": f"{v2}/x"}) == {"cpu_s": 2.5}
    assert cgroups.usage(plan) == {"max_rss_bytes": 4096}


# ------------------------------------------------------------------ GPU samples (agent side)


def test_gpu_samples_fold_into_a_mean_and_a_peak_per_gpu() -> None:
    acc = None
    for util, used in ((20, 1 * 2**30), (60, 5 * 2**30), (40, 3 * 2**30)):
        acc = gpu_usage.add_sample(acc, {0: (util, used, 80 * 2**30), 1: (None, None, None)})
    s = gpu_usage.summary(acc)
    assert s == {
        "samples": 3,
        "per_gpu": {"0": {"util_mean": 40.0, "mem_peak_bytes": 5 * 2**30,
                          "mem_total_bytes": 80 * 2**30}, "1": {}},
        "util_mean": 40.0,
        "mem_peak_bytes": 5 * 2**30,
    }  # fmt: skip
    assert gpu_usage.summary(None) is None
    # what the agent sends is what the store keeps
    kept = efficiency.task_usage({"gpu": s})["gpu_usage"]
    assert kept["util_mean"] == 40.0 and kept["per_gpu"]["0"]["mem_peak_bytes"] == 5 * 2**30


def test_sampler_reads_only_the_tasks_gpus_and_skips_ended_and_lost_ones(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(utilization=90, memory_used=7 * 2**30), FakeGpu(utilization=10),
                     FakeGpu(lost=True)])  # fmt: skip
    a, b, done = tmp_path / "1", tmp_path / "2", tmp_path / "3"
    for d in (a, b, done):
        d.mkdir()
    (done / "exit.json").write_text("{}")
    sampler = gpu_usage.GpuSampler(fake)
    assert sampler.sample([(a, [0]), (b, [1, 2]), (done, [0]), (tmp_path / "4", [])]) == 2
    fake.gpus[0].utilization = 70
    sampler.sample([(a, [0]), (b, [1, 2])])
    sa = gpu_usage.summary(gpu_usage.read(a))
    sb = gpu_usage.summary(gpu_usage.read(b))
    assert sa is not None and sa["samples"] == 2 and sa["util_mean"] == 80.0
    assert sa["mem_peak_bytes"] == 7 * 2**30
    assert sb is not None and set(sb["per_gpu"]) == {"1"}  # GPU 2 is lost: no reading
    assert gpu_usage.read(done) is None
    # no NVML: nothing sampled, nothing written
    assert gpu_usage.GpuSampler(FakeNvml(available=False)).sample([(done, [0])]) == 0
