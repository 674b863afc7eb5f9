"""Build checks from the agent's configuration, failing loudly on anything unexpected.

A typo in health configuration ("mount" for "mounts") would otherwise silently disable a
check, and a node that nobody checks is worse than one that refuses to start, so every unknown
key is a ValueError naming it.  Example::

    {"gpu": {"expected_count": 8},
     "disk": [{"path": "/ckpt", "min_free_mb": 10240, "max_write_ms": 500}],
     "mounts": ["/scratch"],
     "memory": {"min_available_mb": 1024},
     "infiniband": {"expect_ports": 4, "error_counters_warn": 10},
     "kernel_log": {},
     "scripts": [{"path": "/etc/phalanx/health.sh", "timeout": 30}],
     "interval": 30,            # default interval for checks that do not set their own
     "passes_to_recover": 3}    # used by build_monitor

A section set to ``false``/``null`` is disabled; ``true`` enables it with defaults.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from phalanx.agent.health.base import Check, HealthMonitor, Status
from phalanx.agent.health.gpu import GpuCheck, NvmlLike, nvml_from_env
from phalanx.agent.health.infiniband import InfinibandCheck
from phalanx.agent.health.kernel_log import DEFAULT_PATTERNS, KernelLogCheck
from phalanx.agent.health.script import ScriptCheck
from phalanx.agent.health.system import DiskCheck, MemoryCheck, MountCheck

_TOP = (
    "gpu",
    "disk",
    "mounts",
    "memory",
    "infiniband",
    "kernel_log",
    "scripts",
    "interval",
    "passes_to_recover",
    "hung_after",
)
_GPU = ("expected_count", "temp_warn_c", "temp_fail_c", "xid_hold_s", "interval")
_DISK = ("path", "min_free_mb", "max_write_ms", "interval")
_MOUNTS = ("paths", "interval")
_MEMORY = ("min_available_mb", "interval")
_IB = ("sysfs_root", "expect_ports", "error_counters_warn", "ports", "interval")
_KLOG = ("patterns", "path", "interval")
_SCRIPT = ("path", "timeout", "interval", "warn_exit_codes")

DEFAULT_MIN_AVAILABLE_MB = 256


def _err(where: str, message: str) -> ValueError:
    return ValueError(
        f"health config: {where}: {message}" if where else f"health config: {message}"
    )


def _keys(d: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for k in d:
        if k not in allowed:
            raise _err(where, f"unknown key '{k}' (known: {', '.join(allowed)})")


def _section(config: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """None (disabled), {} (defaults), or the section's mapping."""
    value = config.get(key)
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise _err(key, f"expected a mapping, got {type(value).__name__}")
    return dict(value)


def _number(
    d: Mapping[str, Any],
    key: str,
    where: str,
    default: Any = None,
    *,
    integer: bool = False,
    positive: bool = False,
) -> Any:
    """A non-negative number (int if `integer`), or `default` when absent/null."""
    value = d.get(key)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise _err(where, f"'{key}' must be {kind}, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise _err(
            where, f"'{key}' must be {'positive' if positive else 'non-negative'}, got {value}"
        )
    return value


def _string(d: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    value = d.get(key)
    if value is None:
        if required:
            raise _err(where, f"'{key}' is required")
        return None
    if not isinstance(value, str) or not value:
        raise _err(where, f"'{key}' must be a non-empty string, got {value!r}")
    return value


def _items(config: Mapping[str, Any], key: str) -> list[Any]:
    """A list section; a single mapping or string is accepted as a list of one."""
    value = config.get(key)
    if value is None or value is False:
        return []
    if isinstance(value, (Mapping, str)):
        return [value]
    if not isinstance(value, list):
        raise _err(key, f"expected a list, got {type(value).__name__}")
    return value


def build_checks(config: Mapping[str, Any], *, nvml: NvmlLike | None = None) -> list[Check]:
    """Checks for `config` (see the module docstring); `nvml` overrides the GPU adapter
    (default: `nvml_from_env()`, i.e. the real NVML unless ``PHX_FAKE_NVML`` is set)."""
    if not isinstance(config, Mapping):
        raise _err("", f"expected a mapping, got {type(config).__name__}")
    _keys(config, _TOP, "")
    default_interval = _number(config, "interval", "interval", positive=True)
    _number(config, "passes_to_recover", "passes_to_recover", integer=True, positive=True)
    _number(config, "hung_after", "hung_after", positive=True)

    def interval(section: Mapping[str, Any], where: str, fallback: float) -> float:
        value = _number(section, "interval", where, positive=True)
        return float(value if value is not None else default_interval or fallback)

    checks: list[Check] = []

    if (gpu := _section(config, "gpu")) is not None:
        _keys(gpu, _GPU, "gpu")
        warn = _number(gpu, "temp_warn_c", "gpu", 85)
        fail = _number(gpu, "temp_fail_c", "gpu", 95)
        if warn > fail:
            raise _err("gpu", f"temp_warn_c ({warn}) is above temp_fail_c ({fail})")
        checks.append(
            GpuCheck(
                nvml if nvml is not None else nvml_from_env(),
                _number(gpu, "expected_count", "gpu", integer=True),
                temp_warn_c=warn,
                temp_fail_c=fail,
                interval=interval(gpu, "gpu", 30),
                xid_hold_s=_number(gpu, "xid_hold_s", "gpu", 0.0),
            )
        )

    for i, item in enumerate(_items(config, "disk")):
        where = f"disk[{i}]"
        if not isinstance(item, Mapping):
            raise _err(where, f"expected a mapping with 'path', got {item!r}")
        _keys(item, _DISK, where)
        checks.append(
            DiskCheck(
                str(_string(item, "path", where, required=True)),
                min_free_mb=_number(item, "min_free_mb", where, 0, integer=True),
                max_write_ms=_number(item, "max_write_ms", where, positive=True),
                interval=interval(item, where, 60),
            )
        )

    mounts = config.get("mounts")
    if mounts:
        section = (
            {"paths": mounts}
            if isinstance(mounts, (list, str))
            else _section(config, "mounts") or {}
        )
        _keys(section, _MOUNTS, "mounts")
        paths = section.get("paths") or []
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            raise _err("mounts", f"expected a list of paths, got {paths!r}")
        checks.append(MountCheck(paths, interval=interval(section, "mounts", 60)))

    if (mem := _section(config, "memory")) is not None:
        _keys(mem, _MEMORY, "memory")
        checks.append(
            MemoryCheck(
                _number(mem, "min_available_mb", "memory", DEFAULT_MIN_AVAILABLE_MB, integer=True),
                interval=interval(mem, "memory", 30),
            )
        )

    if (ib := _section(config, "infiniband")) is not None:
        _keys(ib, _IB, "infiniband")
        ports = ib.get("ports")
        if ports is not None and (
            not isinstance(ports, list) or not all(isinstance(p, str) for p in ports)
        ):
            raise _err("infiniband", f"'ports' must be a list like ['mlx5_0/1'], got {ports!r}")
        checks.append(
            InfinibandCheck(
                _string(ib, "sysfs_root", "infiniband") or "/sys/class/infiniband",
                expect_ports=_number(ib, "expect_ports", "infiniband", integer=True),
                error_counters_warn=_number(
                    ib, "error_counters_warn", "infiniband", 10, integer=True
                ),
                interval=interval(ib, "infiniband", 30),
                ports=ports,
            )
        )

    if (klog := _section(config, "kernel_log")) is not None:
        _keys(klog, _KLOG, "kernel_log")
        checks.append(
            KernelLogCheck(
                _string(klog, "path", "kernel_log"),
                patterns=_patterns(klog.get("patterns")),
                interval=interval(klog, "kernel_log", 30),
            )
        )

    for i, item in enumerate(_items(config, "scripts")):
        where = f"scripts[{i}]"
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, Mapping):
            raise _err(where, f"expected a path or a mapping with 'path', got {item!r}")
        _keys(item, _SCRIPT, where)
        codes = item.get("warn_exit_codes", [])
        if not isinstance(codes, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in codes
        ):
            raise _err(
                where, f"'warn_exit_codes' must be a list of positive integers, got {codes!r}"
            )
        checks.append(
            ScriptCheck(
                str(_string(item, "path", where, required=True)),
                timeout=_number(item, "timeout", where, 30, positive=True),
                interval=interval(item, where, 60),
                warn_exit_codes=codes,
            )
        )

    names = [c.name for c in checks]
    for name in names:
        if names.count(name) > 1:
            raise _err("", f"the check '{name}' is configured twice")
    return checks


def _patterns(value: Any) -> dict[str, Status] | None:
    """Default patterns, overridden/extended by the configured ones ("ok" disables one)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _err("kernel_log", f"'patterns' must map regex -> ok|warn|fail, got {value!r}")
    merged = dict(DEFAULT_PATTERNS)
    for pattern, status in value.items():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise _err("kernel_log", f"pattern {pattern!r} is not a valid regex: {e}") from None
        try:
            merged[pattern] = Status(status)
        except ValueError:
            raise _err(
                "kernel_log",
                f"pattern {pattern!r}: status must be ok, warn or fail, not {status!r}",
            ) from None
    return merged


def build_monitor(
    config: Mapping[str, Any],
    *,
    nvml: NvmlLike | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> HealthMonitor:
    """`build_checks` plus the monitor settings (passes_to_recover, hung_after) — or the
    `default_checks` when `config` is empty."""
    checks = build_checks(config, nvml=nvml) if config else default_checks(nvml=nvml)
    return HealthMonitor(
        checks,
        passes_to_recover=int(config.get("passes_to_recover") or 3),
        clock=clock,
        wall=wall,
        hung_after=float(config.get("hung_after") or 120.0),
    )


def default_checks(*, nvml: NvmlLike | None = None) -> list[Check]:
    """What an agent without health configuration runs: the GPUs it has (no expected count:
    NVML absent = no GPUs = fine), a 256 MB available-memory warning, and the kernel log."""
    return [
        GpuCheck(nvml if nvml is not None else nvml_from_env(), None),
        MemoryCheck(DEFAULT_MIN_AVAILABLE_MB),
        KernelLogCheck(),
    ]
