"""Tests for the node health-check framework (phalanx.agent.health).

Every check runs against tmp dirs, a fake sysfs tree, fake NVML or real tiny shell scripts; the
monitor runs on a fake clock.  Nothing here needs a GPU, InfiniBand or root-only files, and the
only waits are on conditions (events, process exits) with generous deadlines.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from collections import namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx.agent.health import (
    CRITICAL_XIDS,
    FAKE_NVML_ENV,
    Check,
    CheckResult,
    DiskCheck,
    FakeGpu,
    FakeNvml,
    FileSource,
    GpuCheck,
    HealthMonitor,
    InfinibandCheck,
    KernelLogCheck,
    MemoryCheck,
    MountCheck,
    RealNvml,
    ScriptCheck,
    Status,
    build_checks,
    build_monitor,
    default_checks,
    nvml_from_env,
    worst,
)

WAIT_S = 20.0


def wait_for(cond: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _no_fake_nvml_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests must not pick up a PHX_FAKE_NVML from the developer's shell."""
    monkeypatch.delenv(FAKE_NVML_ENV, raising=False)
    yield


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Scripted:
    """A check that returns the given statuses in order (the last one repeats)."""

    def __init__(self, name: str, *statuses: Status, interval: float = 10.0) -> None:
        self.name = name
        self.interval = interval
        self.statuses = list(statuses)
        self.runs = 0

    def run(self) -> CheckResult:
        status = self.statuses[min(self.runs, len(self.statuses) - 1)]
        self.runs += 1
        return CheckResult(self.name, status, f"{self.name} run {self.runs}: {status}")


def monitor(*checks: Check, passes: int = 3, clock: FakeClock | None = None) -> HealthMonitor:
    return HealthMonitor(
        list(checks), passes_to_recover=passes, clock=clock or FakeClock(), wall=lambda: 5e8
    )


# ----------------------------------------------------------------------------------- monitor
def test_status_order_and_worst() -> None:
    assert worst([Status.OK, Status.FAIL, Status.WARN]) is Status.FAIL
    assert worst([]) is Status.OK
    assert Status.WARN == "warn"


def test_recovery_needs_three_passes_in_a_row() -> None:
    ok, fail = Status.OK, Status.FAIL
    check = Scripted("gpu", fail, ok, ok, ok, ok, interval=0)
    mon = monitor(check)
    mon.run_due()
    s = mon.summary()
    assert (s["status"], s["check"], s["reason"]) == ("fail", "gpu", "gpu run 1: fail")
    mon.run_due()
    mon.run_due()
    assert mon.summary()["status"] == "fail", "two passes are not enough"
    assert mon.summary()["reason"] == "gpu run 1: fail", "the failure reason is kept meanwhile"
    mon.run_due()
    s = mon.summary()
    assert (s["status"], s["check"], s["reason"]) == ("ok", None, None)
    assert s["checks"]["gpu"] == {"status": "ok", "reason": "gpu run 4: ok", "since": 5e8}


def test_a_relapse_resets_the_pass_count_and_warn_does_not_downgrade_fail() -> None:
    ok, warn, fail = Status.OK, Status.WARN, Status.FAIL
    check = Scripted("x", fail, ok, ok, warn, ok, ok, ok, interval=0)
    mon = monitor(check)
    for _ in range(4):  # fail, ok, ok, warn
        mon.run_due()
    assert mon.summary()["status"] == "fail"
    assert mon.summary()["reason"] == "x run 1: fail"
    mon.run_due()
    mon.run_due()
    assert mon.summary()["status"] == "fail"
    mon.run_due()
    assert mon.summary()["status"] == "ok"


def test_warn_escalates_to_fail_with_the_new_reason() -> None:
    check = Scripted("x", Status.WARN, Status.FAIL, interval=0)
    mon = monitor(check)
    mon.run_due()
    assert mon.summary()["status"] == "warn"
    mon.run_due()
    assert (mon.summary()["status"], mon.summary()["reason"]) == ("fail", "x run 2: fail")


def test_summary_is_the_worst_over_checks() -> None:
    mon = monitor(Scripted("a", Status.OK), Scripted("b", Status.WARN), Scripted("c", Status.FAIL))
    worst_result = mon.preflight()
    assert worst_result == CheckResult("c", Status.FAIL, "c run 1: fail")
    s = mon.summary()
    assert (s["status"], s["check"], s["reason"]) == ("fail", "c", "c run 1: fail")
    assert {k: v["status"] for k, v in s["checks"].items()} == {"a": "ok", "b": "warn", "c": "fail"}

    only_warn = monitor(Scripted("a", Status.OK), Scripted("b", Status.WARN))
    only_warn.preflight()
    assert (only_warn.summary()["status"], only_warn.summary()["check"]) == ("warn", "b")


def test_a_crashing_check_is_a_fail() -> None:
    class Boom:
        name = "boom"
        interval = 1.0

        def run(self) -> CheckResult:
            raise RuntimeError("sensor exploded")

    mon = monitor(Boom())
    result = mon.preflight()
    assert result.status is Status.FAIL
    assert result.reason == "check boom crashed: RuntimeError: sensor exploded"
    assert mon.summary()["reason"] == "check boom crashed: RuntimeError: sensor exploded"


def test_run_due_respects_intervals() -> None:
    clock = FakeClock(100.0)
    fast, slow = Scripted("fast", Status.OK, interval=1), Scripted("slow", Status.OK, interval=30)
    mon = monitor(fast, slow, clock=clock)
    mon.preflight()
    assert mon.run_due(100.5) == []
    assert [r.check for r in mon.run_due(101.0)] == ["fast"]
    assert [r.check for r in mon.run_due(130.0)] == ["fast", "slow"]
    clock.t = 131.0
    assert [r.check for r in mon.run_due()] == ["fast"]
    assert (fast.runs, slow.runs) == (4, 2)


def test_monitor_rejects_duplicates_and_bad_passes() -> None:
    with pytest.raises(ValueError, match="repeated: a"):
        HealthMonitor([Scripted("a", Status.OK), Scripted("a", Status.OK)])
    with pytest.raises(ValueError, match="passes_to_recover"):
        HealthMonitor([], passes_to_recover=0)
    assert HealthMonitor([]).preflight().status is Status.OK
    assert HealthMonitor([]).summary() == {
        "status": "ok",
        "check": None,
        "reason": None,
        "checks": {},
    }


def test_a_hung_check_is_reported_as_failed_while_it_hangs() -> None:
    release, entered = threading.Event(), threading.Event()

    class Stuck:
        name = "nfs"
        interval = 10.0

        def run(self) -> CheckResult:
            entered.set()
            release.wait(WAIT_S)
            return CheckResult("nfs", Status.OK, "fine after all")

    clock = FakeClock(0.0)
    mon = HealthMonitor([Stuck()], clock=clock, hung_after=60, passes_to_recover=1)
    t = threading.Thread(target=mon.run_due)
    t.start()
    try:
        assert entered.wait(WAIT_S)
        assert mon.summary()["status"] == "ok"  # running, but not for long yet
        clock.t = 61.0
        s = mon.summary()
        assert s["status"] == "fail"
        assert s["reason"] == "check nfs hung: still running after 61s"
    finally:
        release.set()
        t.join(WAIT_S)
    assert mon.summary()["status"] == "ok"  # it returned and passes_to_recover=1


def test_start_thread_runs_checks_until_stopped() -> None:
    ran = threading.Event()

    class Signal:
        name = "sig"
        interval = 0.0

        def run(self) -> CheckResult:
            ran.set()
            return CheckResult("sig", Status.OK, "ok")

    mon = HealthMonitor([Signal()])
    stop = threading.Event()
    thread = mon.start_thread(stop, period=0.01)
    assert ran.wait(WAIT_S)
    stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert mon.summary()["checks"]["sig"]["status"] == "ok"


# --------------------------------------------------------------------------------------- GPU
def test_gpu_healthy_and_xid_79_names_gpu_and_xid() -> None:
    nvml = FakeNvml(8)
    check = GpuCheck(nvml, expected_count=8)
    assert check.run() == CheckResult("gpu", Status.OK, "8 GPUs healthy, hottest 40 C")
    nvml.queue_xid(3, 79)
    result = check.run()
    assert result.status is Status.FAIL
    assert result.reason == "GPU 3: XID 79 (GPU has fallen off the bus)"
    assert check.run().status is Status.OK, "an XID is an event; the monitor keeps the node out"


def test_gpu_application_xids_are_ignored() -> None:
    nvml = FakeNvml(2)
    nvml.queue_xid(0, 13)  # graphics engine exception: the job's bug, not the node's
    nvml.queue_xid(1, 31)
    assert GpuCheck(nvml).run().status is Status.OK
    assert 13 not in CRITICAL_XIDS and {48, 63, 64, 74, 79, 92, 94, 95, 119, 120} <= set(
        CRITICAL_XIDS
    )


def test_gpu_xid_hold_keeps_the_gpu_failed() -> None:
    clock = FakeClock(0.0)
    nvml = FakeNvml(4)
    check = GpuCheck(nvml, xid_hold_s=300, clock=clock)
    nvml.queue_xid(2, 74)
    assert check.run().reason == "GPU 2: XID 74 (NVLink error)"
    clock.t = 299
    assert check.run().reason == "GPU 2: XID 74 (NVLink error)"
    clock.t = 300
    assert check.run().status is Status.OK


def test_gpu_uncorrectable_ecc_fails() -> None:
    nvml = FakeNvml([FakeGpu(), FakeGpu(ecc_uncorrectable=2)])
    result = GpuCheck(nvml).run()
    assert result.status is Status.FAIL
    assert result.reason == "GPU 1: 2 uncorrectable ECC errors since driver load"


def test_gpu_count_mismatch_fails() -> None:
    result = GpuCheck(FakeNvml(6), expected_count=8).run()
    assert (result.status, result.reason) == (Status.FAIL, "found 6 GPUs, expected 8")
    assert GpuCheck(FakeNvml(8), expected_count=4).run().status is Status.OK


@pytest.mark.parametrize(
    ("temp", "status", "reason"),
    [
        (84, Status.OK, "2 GPUs healthy, hottest 84 C"),
        (85, Status.WARN, "GPU 1: temperature 85 C >= 85 C"),
        (96, Status.FAIL, "GPU 1: temperature 96 C >= 95 C"),
    ],
)
def test_gpu_temperature(temp: int, status: Status, reason: str) -> None:
    result = GpuCheck(FakeNvml([FakeGpu(temperature=50), FakeGpu(temperature=temp)])).run()
    assert (result.status, result.reason) == (status, reason)


def test_gpu_retirement_and_remapping() -> None:
    pending = GpuCheck(FakeNvml([FakeGpu(retired_pages_pending=True)])).run()
    assert (pending.status, pending.reason) == (
        Status.WARN,
        "GPU 0: page retirement pending (reset the GPU)",
    )
    remap = GpuCheck(FakeNvml([FakeGpu(remap_pending=True)])).run()
    assert remap.status is Status.WARN
    failed = GpuCheck(FakeNvml([FakeGpu(remap_pending=True), FakeGpu(remap_failure=True)])).run()
    assert (failed.status, failed.reason) == (
        Status.FAIL,
        "GPU 1: row remapping failed (replace the GPU) (+1 more)",
    )


def test_gpu_lost_unsupported_and_absent_nvml() -> None:
    lost = GpuCheck(FakeNvml([FakeGpu(), FakeGpu(), FakeGpu(lost=True)])).run()
    assert (lost.status, lost.reason) == (Status.FAIL, "GPU 2: GPU is lost")
    unsupported = FakeGpu(
        temperature=None,
        ecc_uncorrectable=None,
        retired_pages_pending=None,
        remap_pending=None,
        remap_failure=None,
    )
    assert GpuCheck(FakeNvml([unsupported])).run() == CheckResult(
        "gpu", Status.OK, "1 GPUs healthy"
    )
    absent = FakeNvml(available=False)
    assert GpuCheck(absent).run() == CheckResult("gpu", Status.OK, "no NVML: 0 GPUs")
    expected = GpuCheck(absent, expected_count=8).run()
    assert (expected.status, expected.reason) == (
        Status.FAIL,
        "NVML not available: expected 8 GPUs",
    )


def test_gpu_check_rejects_inverted_thresholds() -> None:
    with pytest.raises(ValueError, match="temp_warn_c"):
        GpuCheck(FakeNvml(1), temp_warn_c=99, temp_fail_c=90)


def write_json(path: Path, data: Any) -> None:
    """Atomically, as the FakeNvml docstring asks system tests to."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def test_fake_nvml_file_is_reread_on_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "nvml.json"
    write_json(path, {"gpus": 4})
    monkeypatch.setenv(FAKE_NVML_ENV, str(path))
    nvml = nvml_from_env()
    assert isinstance(nvml, FakeNvml)
    check = GpuCheck(nvml, expected_count=4)
    assert check.run().status is Status.OK

    write_json(path, {"gpus": [{}, {}, {"temperature": 99}, {}]})
    assert check.run().reason == "GPU 2: temperature 99 C >= 95 C"

    write_json(path, {"gpus": 4, "xid": [[3, 79]]})
    assert check.run().reason == "GPU 3: XID 79 (GPU has fallen off the bus)"
    assert check.run().status is Status.OK, "each XID entry is delivered once"
    write_json(path, {"gpus": 4, "xid": [[3, 79], {"gpu": 1, "xid": 48}]})
    assert check.run().reason == "GPU 1: XID 48 (double-bit ECC error)"

    path.write_text('{"gpus": [{"lost": tr')  # torn write: keep the last good state
    assert check.run().status is Status.OK
    write_json(path, {"gpus": [{"lost": True}, {}, {}, {}]})
    assert check.run().reason == "GPU 0: GPU is lost"

    path.unlink()
    assert check.run().reason == "NVML not available: expected 4 GPUs"


def test_fake_nvml_file_with_unknown_keys_is_loud(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    write_json(path, {"gpus": [{"temprature": 50}]})
    with pytest.raises(ValueError, match="temprature"):
        FakeNvml(path=path)
    write_json(path, {"gpus": 1, "xid": [[79]]})
    with pytest.raises(ValueError, match="'xid' entries"):
        FakeNvml(path=path)


def test_nvml_from_env_without_the_variable_is_real(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_NVML_ENV, raising=False)
    assert isinstance(nvml_from_env(), RealNvml)


class _NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({3: "Not Supported", 10: "Timeout", 15: "GPU is lost"}.get(value, "?"))
        self.value = value


def fake_pynvml(temps: dict[int, Any], xids: list[tuple[int, int]]) -> SimpleNamespace:
    """A stand-in for the `pynvml` module: temperature per GPU (an int, or an error code to
    raise), no ECC/retirement/remapping support, and queued XID events."""
    queue = list(xids)

    def raise_or(value: Any) -> Any:
        if isinstance(value, _NVMLError):
            raise value
        return value

    def not_supported(*_: Any) -> Any:
        raise _NVMLError(3)

    def wait(_set: Any, _timeout: int) -> Any:
        if not queue:
            raise _NVMLError(10)
        gpu, xid = queue.pop(0)
        return SimpleNamespace(device=("handle", gpu), eventType=0x8, eventData=xid)

    return SimpleNamespace(
        NVMLError=_NVMLError,
        NVML_ERROR_NOT_SUPPORTED=3,
        NVML_ERROR_NO_PERMISSION=4,
        NVML_ERROR_TIMEOUT=10,
        NVML_ERROR_GPU_IS_LOST=15,
        NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlEventTypeXidCriticalError=0x8,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: len(temps),
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetIndex=lambda h: h[1],
        nvmlDeviceGetTemperature=lambda h, _s: raise_or(temps[h[1]]),
        nvmlDeviceGetTotalEccErrors=not_supported,
        nvmlDeviceGetRetiredPagesPendingStatus=not_supported,
        nvmlDeviceGetRemappedRows=not_supported,
        nvmlEventSetCreate=lambda: "event-set",
        nvmlDeviceRegisterEvents=lambda h, types, s: None,
        nvmlEventSetWait=wait,
    )


def test_real_nvml_adapter_guards_every_call() -> None:
    module = fake_pynvml({0: 50, 1: _NVMLError(3), 2: 60}, xids=[(1, 79), (0, 13)])
    check = GpuCheck(RealNvml(module), expected_count=3)
    result = check.run()
    assert (result.status, result.reason) == (
        Status.FAIL,
        "GPU 1: XID 79 (GPU has fallen off the bus)",
    )
    assert check.run() == CheckResult("gpu", Status.OK, "3 GPUs healthy, hottest 60 C")

    lost = GpuCheck(RealNvml(fake_pynvml({0: 50, 1: _NVMLError(15)}, xids=[]))).run()
    assert (lost.status, lost.reason) == (Status.FAIL, "GPU 1: GPU is lost")

    denied = GpuCheck(RealNvml(fake_pynvml({0: _NVMLError(4)}, xids=[]))).run()
    assert denied == CheckResult("gpu", Status.OK, "1 GPUs healthy"), "a policy, not a fault"

    flaky = GpuCheck(RealNvml(fake_pynvml({0: _NVMLError(999)}, xids=[]))).run()
    assert flaky.status is Status.WARN and flaky.reason.startswith("GPU 0: cannot read temperature")


def test_real_nvml_without_a_driver_is_a_node_without_gpus() -> None:
    def no_driver() -> None:
        raise _NVMLError(12)

    module = fake_pynvml({}, xids=[])
    module.nvmlInit = no_driver
    assert GpuCheck(RealNvml(module)).run() == CheckResult("gpu", Status.OK, "no NVML: 0 GPUs")

    real = RealNvml()  # the actual pynvml on this machine
    real.refresh()
    if real.available() and real.device_count():
        pytest.skip("this machine has GPUs")
    assert GpuCheck(real).run().status is Status.OK


# -------------------------------------------------------------------------------------- disk
Usage = namedtuple("Usage", "total used free")


def test_disk_ok_and_probe_file_removed(tmp_path: Path) -> None:
    result = DiskCheck(tmp_path, min_free_mb=1, max_write_ms=60_000).run()
    assert result.status is Status.OK, result.reason
    assert result.check == f"disk:{tmp_path}"
    assert list(tmp_path.iterdir()) == []


def test_disk_low_space_fails(tmp_path: Path) -> None:
    usage = lambda _p: Usage(10 * 2**30, 0, 512 * 2**20)  # noqa: E731
    result = DiskCheck(tmp_path, min_free_mb=10240, disk_usage=usage).run()
    assert (result.status, result.reason) == (
        Status.FAIL,
        f"{tmp_path}: 512 MB free, below the 10240 MB minimum",
    )


def test_disk_slow_write_warns(tmp_path: Path) -> None:
    ticks = iter([0.0, 0.8])
    result = DiskCheck(tmp_path, max_write_ms=500, timer=lambda: next(ticks)).run()
    assert (result.status, result.reason) == (
        Status.WARN,
        f"{tmp_path}: probe write+fsync took 800 ms (limit 500 ms)",
    )


def test_disk_missing_or_unwritable_fails(tmp_path: Path) -> None:
    missing = DiskCheck(tmp_path / "ckpt").run()
    assert (missing.status, missing.reason) == (Status.FAIL, f"{tmp_path / 'ckpt'} does not exist")
    (tmp_path / "file").write_text("x")
    assert DiskCheck(tmp_path / "file").run().reason == f"{tmp_path / 'file'} is not a directory"
    if not sys.platform.startswith("linux"):
        pytest.skip("uses /proc as a directory nobody can create files in")
    ro = DiskCheck("/proc").run()  # even root cannot create files there
    assert ro.status is Status.FAIL and ro.reason.startswith("/proc is not writable: ")


# ------------------------------------------------------------------------------ mounts, memory
def test_mounts(tmp_path: Path) -> None:
    assert MountCheck(["/"]).run().status is Status.OK
    scratch, ckpt = tmp_path / "scratch", tmp_path / "my ckpt"
    result = MountCheck([scratch], mountinfo=tmp_path / "none").run()
    assert (result.status, result.reason) == (Status.FAIL, f"{scratch} is not mounted")
    mountinfo = tmp_path / "mountinfo"
    escaped = str(ckpt).replace(" ", "\\040")
    mountinfo.write_text(
        "22 1 0:21 / / rw,relatime - ext4 /dev/vda rw\n"
        f"36 22 98:0 /data {escaped} rw,noatime master:1 - ext4 /dev/sdb rw\n"
    )
    assert MountCheck([ckpt], mountinfo=mountinfo).run().status is Status.OK  # a bind mount
    both = MountCheck([scratch, "/", tmp_path / "b"], mountinfo=mountinfo).run()
    assert both.reason == f"{scratch} is not mounted (+1 more: {tmp_path / 'b'})"


def test_memory() -> None:
    vm = lambda: SimpleNamespace(available=512 * 2**20)  # noqa: E731
    low = MemoryCheck(1024, virtual_memory=vm).run()
    assert (low.status, low.reason) == (Status.WARN, "512 MB memory available, below 1024 MB")
    assert MemoryCheck(256, virtual_memory=vm).run().status is Status.OK
    assert MemoryCheck(0).run().status is Status.OK  # the real psutil


# --------------------------------------------------------------------------------- infiniband
def ib_port(root: Path, dev: str, port: int, state: str = "4: ACTIVE", **counters: int) -> Path:
    p = root / dev / "ports" / str(port)
    (p / "counters").mkdir(parents=True, exist_ok=True)
    (p / "state").write_text(state + "\n")
    (p / "phys_state").write_text("5: LinkUp\n" if "ACTIVE" in state else "2: Polling\n")
    for name, value in counters.items():
        (p / "counters" / name).write_text(f"{value}\n")
    return p


def test_infiniband_states(tmp_path: Path) -> None:
    assert InfinibandCheck(tmp_path / "absent").run() == CheckResult(
        "infiniband", Status.OK, "no InfiniBand ports"
    )
    ib_port(tmp_path, "mlx5_0", 1)
    ib_port(tmp_path, "mlx5_1", 1)
    assert InfinibandCheck(tmp_path, expect_ports=2).run().reason == "2 IB ports active"
    short = InfinibandCheck(tmp_path, expect_ports=4).run()
    assert (short.status, short.reason) == (Status.FAIL, "expected 4 IB ports, found 2")
    ib_port(tmp_path, "mlx5_1", 1, state="1: DOWN")
    down = InfinibandCheck(tmp_path).run()
    assert (down.status, down.reason) == (Status.FAIL, "mlx5_1 port 1: DOWN (phys Polling)")
    assert InfinibandCheck(tmp_path, ports=["mlx5_0/1"]).run().status is Status.OK
    (tmp_path / "mlx5_1" / "ports" / "1" / "phys_state").write_text("3: Disabled\n")
    assert InfinibandCheck(tmp_path).run().reason == "1 IB ports active"


def test_infiniband_error_counters_growing_warn(tmp_path: Path) -> None:
    port = ib_port(tmp_path, "mlx5_0", 1, symbol_error=100, link_downed=0)
    check = InfinibandCheck(tmp_path, error_counters_warn=5)
    assert check.run().status is Status.OK  # first run: baselines only
    (port / "counters" / "symbol_error").write_text("105\n")
    assert check.run().status is Status.OK  # +5 is within the threshold
    (port / "counters" / "symbol_error").write_text("150\n")
    result = check.run()
    assert (result.status, result.reason) == (
        Status.WARN,
        "mlx5_0 port 1: symbol_error +45 since last check",
    )
    (port / "counters" / "symbol_error").write_text("0\n")  # counters reset: re-baseline
    assert check.run().status is Status.OK


# --------------------------------------------------------------------------------- kernel log
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


def test_kernel_log_patterns_from_a_callable() -> None:
    batches: list[list[str]] = [
        ["eth0: link up", "NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception"],
        ["INFO: task python:4242 blocked for more than 120 seconds.", XID79],
        ["sd 0:0:0:0: blk_update_request: I/O error, dev sda, sector 42"],
        [],
    ]
    check = KernelLogCheck(lambda: batches.pop(0))
    assert check.run().status is Status.OK
    assert check.run() == CheckResult("kernel_log", Status.FAIL, XID79 + " (+1 more)")
    io = check.run()
    assert io.status is Status.WARN and "I/O error" in io.reason
    assert check.run().status is Status.OK


def test_kernel_log_custom_patterns() -> None:
    check = KernelLogCheck(lambda: ["EDAC MC0: 1 UE memory error"], {r"EDAC .* UE": "fail"})
    assert check.run().status is Status.FAIL
    assert KernelLogCheck(lambda: [XID79], {}).run().status is Status.OK


def test_kernel_log_unreadable_is_ok(caplog: pytest.LogCaptureFixture) -> None:
    def denied() -> list[str]:
        raise PermissionError(1, "Operation not permitted")

    check = KernelLogCheck(denied)
    first, second = check.run(), check.run()
    assert first.status is Status.OK and first.reason.startswith("kernel log not readable")
    assert second.status is Status.OK
    assert sum("kernel log not readable" in r.message for r in caplog.records) == 1


def test_kernel_log_file_source_reads_only_new_complete_lines(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old: Machine check events logged\n")
    check = KernelLogCheck(log)
    assert check.run().status is Status.OK, "history before the agent started is not new"
    with log.open("a") as f:
        f.write(XID79 + "\nhalf a li")
    assert check.run().reason == XID79
    with log.open("a") as f:
        f.write("ne\n")
    assert check.run().status is Status.OK
    log.write_text("mce: [Hardware Error]: Machine check events logged\n")  # rotated, shorter
    assert check.run().status is Status.WARN
    src = FileSource(log, start_at_end=False)
    assert src() == ["mce: [Hardware Error]: Machine check events logged"]
    assert KernelLogCheck(tmp_path / "missing").run().reason.startswith("kernel log not readable")


# ------------------------------------------------------------------------------------ scripts
def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_script_exit_zero_is_ok(tmp_path: Path) -> None:
    result = ScriptCheck(script(tmp_path, "ok.sh", "exit 0\n")).run()
    assert result.status is Status.OK
    assert result.check == f"script:{tmp_path / 'ok.sh'}"


def test_script_failure_reports_first_line(tmp_path: Path) -> None:
    body = 'echo "ERROR: nhc: disk full on /scratch (98%)"\necho second line\nexit 1\n'
    result = ScriptCheck(script(tmp_path, "full.sh", body)).run()
    assert (result.status, result.reason) == (
        Status.FAIL,
        "ERROR: nhc: disk full on /scratch (98%)",
    )


def test_script_output_only_on_stderr(tmp_path: Path) -> None:
    body = "echo >&2\necho 'mount /scratch missing' >&2\nexit 7\n"
    result = ScriptCheck(script(tmp_path, "err.sh", body)).run()
    assert (result.status, result.reason) == (Status.FAIL, "mount /scratch missing")


def test_script_exit_codes(tmp_path: Path) -> None:
    silent = script(tmp_path, "silent.sh", "exit 3\n")
    assert ScriptCheck(silent).run().reason == f"{silent} exited with status 3"
    warn = script(tmp_path, "warn.sh", "echo degraded\nexit 2\n")
    assert ScriptCheck(warn).run().status is Status.FAIL, "NHC habit: any non-zero fails"
    assert ScriptCheck(warn, warn_exit_codes=[2]).run().status is Status.WARN
    missing = ScriptCheck(tmp_path / "nope.sh").run()
    assert missing.status is Status.FAIL and missing.reason.startswith("cannot run ")


def test_script_timeout_kills_the_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    body = f"sleep 60 &\necho $! > {pidfile}\nwait\n"
    result = ScriptCheck(script(tmp_path, "hang.sh", body), timeout=0.5).run()
    assert (result.status, result.reason) == (Status.FAIL, "timed out after 0.5s")
    child = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), "pid file"))

    def gone() -> bool:
        try:
            data = Path(f"/proc/{child}/stat").read_text()
        except OSError:
            return True
        return data[data.rfind(")") + 2] in "ZX"

    wait_for(gone, "the script's child to be killed")


# ------------------------------------------------------------------------------------- config
FULL = {
    "gpu": {"expected_count": 8},
    "disk": [{"path": "/ckpt", "min_free_mb": 10240, "max_write_ms": 500}],
    "mounts": ["/scratch"],
    "memory": {"min_available_mb": 1024},
    "infiniband": {"expect_ports": 2, "ports": ["mlx5_0/1", "mlx5_1/1"]},
    "kernel_log": {},
    "scripts": [{"path": "/etc/phalanx/health.sh", "timeout": 30}],
    "interval": 20,
    "passes_to_recover": 2,
}


def test_build_checks_from_full_config() -> None:
    checks = build_checks(FULL, nvml=FakeNvml(8))
    assert [c.name for c in checks] == [
        "gpu",
        "disk:/ckpt",
        "mounts",
        "memory",
        "infiniband",
        "kernel_log",
        "script:/etc/phalanx/health.sh",
    ]
    assert all(isinstance(c, Check) for c in checks)
    assert {c.interval for c in checks} == {20.0}
    gpu = checks[0]
    assert isinstance(gpu, GpuCheck) and gpu.expected_count == 8
    disk = checks[1]
    assert isinstance(disk, DiskCheck) and (disk.min_free_mb, disk.max_write_ms) == (10240, 500)
    script_check = checks[-1]
    assert isinstance(script_check, ScriptCheck) and script_check.timeout == 30
    mon = build_monitor(FULL, nvml=FakeNvml(8))
    assert mon.passes_to_recover == 2


def test_build_checks_defaults_and_per_check_interval() -> None:
    checks = build_checks({"gpu": True, "memory": {"interval": 5}, "scripts": ["/x.sh"]})
    assert [(c.name, c.interval) for c in checks] == [
        ("gpu", 30.0),
        ("memory", 5.0),
        ("script:/x.sh", 60.0),
    ]
    assert build_checks({"gpu": False, "kernel_log": None}) == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"gpus": {}}, "unknown key 'gpus'"),
        ({"gpu": {"expected": 8}}, "gpu: unknown key 'expected'"),
        ({"gpu": {"expected_count": "8"}}, "'expected_count' must be an integer"),
        ({"gpu": {"temp_warn_c": 99, "temp_fail_c": 90}}, "temp_warn_c"),
        ({"gpu": []}, "gpu: expected a mapping"),
        ({"disk": [{"min_free_mb": 1}]}, r"disk\[0\]: 'path' is required"),
        ({"disk": [{"path": "/a", "min_free_mb": -1}]}, "must be non-negative"),
        ({"disk": [{"path": "/a"}, {"path": "/a"}]}, "configured twice"),
        ({"mounts": [1]}, "mounts: expected a list of paths"),
        ({"memory": {"min_available_mb": True}}, "must be an integer"),
        ({"infiniband": {"ports": "mlx5_0/1"}}, "'ports' must be a list"),
        ({"kernel_log": {"patterns": {"(": "fail"}}}, "not a valid regex"),
        ({"kernel_log": {"patterns": {"x": "panic"}}}, "must be ok, warn or fail"),
        ({"scripts": [{"path": "/a", "timeout": 0}]}, "'timeout' must be positive"),
        ({"scripts": [{"path": "/a", "warn_exit_codes": [0]}]}, "warn_exit_codes"),
        ({"scripts": [{"path": "/a", "args": []}]}, r"scripts\[0\]: unknown key 'args'"),
        ({"interval": 0}, "'interval' must be positive"),
        ({"passes_to_recover": 0}, "passes_to_recover"),
        ([], "expected a mapping"),
    ],
)
def test_build_checks_config_errors(config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_checks(config, nvml=FakeNvml(0))


def test_default_checks_and_an_empty_config() -> None:
    nvml = FakeNvml(available=False)
    checks = default_checks(nvml=nvml)
    assert [c.name for c in checks] == ["gpu", "memory", "kernel_log"]
    gpu, mem = checks[0], checks[1]
    assert isinstance(gpu, GpuCheck) and gpu.expected_count is None
    assert isinstance(mem, MemoryCheck) and mem.min_available_mb == 256
    assert [c.name for c in build_monitor({}, nvml=nvml).checks] == ["gpu", "memory", "kernel_log"]


# ------------------------------------------------------------------------------- end to end
def test_monitor_drains_and_recovers_a_node_with_a_fake_gpu_fault(tmp_path: Path) -> None:
    """The agent's view: preflight, then run_due once a second; an XID drains the node and
    three clean GPU runs bring it back."""
    clock = FakeClock(0.0)
    nvml = FakeNvml(8)
    mon = HealthMonitor(
        [GpuCheck(nvml, 8, interval=30), DiskCheck(tmp_path, interval=60)], clock=clock
    )
    assert mon.preflight().status is Status.OK
    assert mon.summary()["status"] == "ok"
    nvml.queue_xid(5, 95)
    for second in range(1, 121):
        clock.t = float(second)
        mon.run_due()
        summary = mon.summary()
        if second < 30:
            assert summary["status"] == "ok"
        elif second < 120:
            assert summary["status"] == "fail", second
            assert summary["reason"] == "GPU 5: XID 95 (uncontained ECC error)"
            assert summary["check"] == "gpu"
    assert mon.summary()["status"] == "ok"  # runs at 60, 90, 120 passed
