"""Node health checks (DESIGN.md §6): what drains a node, and what lets it come back.

The agent builds a `HealthMonitor` (`build_monitor(config)` or ``HealthMonitor(checks)``),
calls `preflight()` once before registering, `run_due()` about once a second on a thread of its
own (`start_thread`; checks block), and sends `summary()` in every heartbeat.  The controller
drains on "fail"/"warn" and resumes on "ok"; the monitor's recovery rule (a failed check must
pass `passes_to_recover` times in a row) keeps flapping hardware out.

Hardware sits behind thin adapters (`NvmlLike`, sysfs roots, paths, callables) so tests inject
faults — `FakeNvml`, also from a JSON file named by ``PHX_FAKE_NVML`` for system tests — while
production runs the real ones.
"""

from phalanx.agent.health.base import Check, CheckResult, HealthMonitor, Status, worst
from phalanx.agent.health.config import build_checks, build_monitor, default_checks
from phalanx.agent.health.gpu import (
    CRITICAL_XIDS,
    FAKE_NVML_ENV,
    FakeGpu,
    FakeNvml,
    GpuCheck,
    NvmlLike,
    NvmlProbeError,
    RealNvml,
    nvml_from_env,
)
from phalanx.agent.health.infiniband import InfinibandCheck
from phalanx.agent.health.isolation import IsolationCheck
from phalanx.agent.health.kernel_log import (
    DEFAULT_PATTERNS,
    FileSource,
    JournalSource,
    KernelLogCheck,
    KmsgSource,
)
from phalanx.agent.health.script import ScriptCheck
from phalanx.agent.health.system import DiskCheck, MemoryCheck, MountCheck

__all__ = [
    "CRITICAL_XIDS",
    "DEFAULT_PATTERNS",
    "FAKE_NVML_ENV",
    "Check",
    "CheckResult",
    "DiskCheck",
    "FakeGpu",
    "FakeNvml",
    "FileSource",
    "GpuCheck",
    "HealthMonitor",
    "InfinibandCheck",
    "IsolationCheck",
    "JournalSource",
    "KernelLogCheck",
    "KmsgSource",
    "MemoryCheck",
    "MountCheck",
    "NvmlLike",
    "NvmlProbeError",
    "RealNvml",
    "ScriptCheck",
    "Status",
    "build_checks",
    "build_monitor",
    "default_checks",
    "nvml_from_env",
    "worst",
]
