"""GPU health through NVML: count, temperature, ECC, page retirement / row remapping, XIDs.

Hardware is reached only through `NvmlLike`, a handful of per-GPU probes.  `RealNvml` wraps
nvidia-ml-py for production; `FakeNvml` lets unit tests (in memory) and system tests (through a
JSON file named by ``PHX_FAKE_NVML``) inject faults into the very same `GpuCheck`.

Verdicts, and why:

* fewer GPUs than ``expected_count`` -> FAIL: a GPU fell off the bus or the driver lost it, and
  jobs sized for the node would be placed on hardware that is not there.
* temperature >= ``temp_fail_c`` -> FAIL, >= ``temp_warn_c`` -> WARN (stop new work while it
  cools or the fans get fixed; running jobs are only throttled).
* uncorrectable ECC errors since driver load (volatile counter) > 0 -> FAIL: data may have been
  corrupted, and NVIDIA's remedy is a GPU reset.  The counter only clears on reset/reboot, so
  the node stays out until an operator has dealt with it.
* row-remapping *failure* -> FAIL: the GPU ran out of spare rows and needs replacing.
* retired pages *pending* / row remap *pending* -> WARN (our choice): the bad memory is already
  fenced off and only a GPU reset applies the retirement, which needs an idle GPU — so we stop
  new work and let running jobs finish rather than killing them.  The uncorrectable error that
  usually caused the pending state fails the node through the ECC counter anyway.
* a critical XID (table `CRITICAL_XIDS`) -> FAIL naming the GPU and the XID.  XIDs that are
  normally the application's fault (13, 31, 43, 45, ...) are ignored: they would let one buggy
  job drain the whole cluster.
* a GPU NVML reports as lost / needing reset -> FAIL; any other NVML error on a probe -> WARN;
  a probe the GPU does not support (NotSupported) is skipped.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from phalanx.agent.health.base import CheckResult, Status, one_line, worst

log = logging.getLogger("phalanx.agent.health")

FAKE_NVML_ENV = "PHX_FAKE_NVML"

#: XIDs that mean the node's hardware (not the job) is in trouble, with what they mean.
#: Source: NVIDIA "XID Errors" catalog and the GPU memory error management guide.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


class NvmlProbeError(Exception):
    """A probe failed for a reason other than "not supported".

    `fatal` marks the GPU as gone (lost, needs reset): that fails the node, while other errors
    (a transient "unknown error") only warn.
    """

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class NvmlLike(Protocol):
    """The probes `GpuCheck` needs.  A probe returns None when the GPU does not support it and
    raises `NvmlProbeError` when it fails."""

    def refresh(self) -> None:
        """Called once at the start of every check run (re-init, re-read a fake's file)."""

    def available(self) -> bool:
        """False when there is no NVML library or driver: a node without GPUs."""

    def device_count(self) -> int: ...

    def temperature(self, index: int) -> int | None:
        """Core temperature in degrees C."""

    def ecc_uncorrectable(self, index: int) -> int | None:
        """Uncorrectable (double-bit) ECC errors since the driver loaded (volatile counter)."""

    def retired_pages_pending(self, index: int) -> bool | None: ...

    def remapped_rows(self, index: int) -> tuple[bool, bool] | None:
        """(remap pending, remap failure) on GPUs with row remapping (A100 and later)."""

    def xid_events(self) -> list[tuple[int, int]]:
        """(GPU index, XID) for critical-XID events since the last call; -1 if unknown GPU."""


MAX_PENDING_EVENTS = 1024  # GPU events kept for the controllers while none confirms them


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "noboot"


# ---------------------------------------------------------------------------------- the check
class GpuCheck:
    """Probe every GPU through `nvml`; see the module docstring for the verdicts.

    `xid_hold_s` keeps a GPU failed for that long after its last critical XID (0: only the run
    that saw the event fails, and the monitor's recovery rule does the rest).  Persistent damage
    — a lost GPU, ECC counters, a remap failure — keeps failing on its own anyway.
    """

    def __init__(
        self,
        nvml: NvmlLike,
        expected_count: int | None = None,
        temp_warn_c: float = 85,
        temp_fail_c: float = 95,
        interval: float = 30,
        *,
        critical_xids: Mapping[int, str] = CRITICAL_XIDS,
        xid_hold_s: float = 0.0,
        clock: Callable[[], float] | None = None,
        name: str = "gpu",
    ) -> None:
        if temp_warn_c > temp_fail_c:
            raise ValueError(f"temp_warn_c ({temp_warn_c}) is above temp_fail_c ({temp_fail_c})")
        self.nvml = nvml
        self.expected_count = expected_count
        self.temp_warn_c = temp_warn_c
        self.temp_fail_c = temp_fail_c
        self.interval = float(interval)
        self.critical_xids = dict(critical_xids)
        self.xid_hold_s = xid_hold_s
        self.name = name
        self._clock = clock or time.monotonic
        self._held: dict[int, tuple[float, str]] = {}  # gpu -> (seen at, reason)
        # For /metrics (agent/metrics.py, controller/metrics.py): the last readings per GPU,
        # and GPU events not yet confirmed by a controller (XIDs; ECC counter increases)
        self.readings: dict[int, dict[str, float]] = {}
        self._outbox: list[dict[str, Any]] = []
        self._outbox_lock = threading.Lock()
        self._ecc_seen: dict[int, int] = {}  # gpu -> volatile counter last reported
        self._run_id = os.urandom(6).hex()  # keys of XID events: unique per agent process
        self._seq = 0

    def run(self) -> CheckResult:
        self.nvml.refresh()
        if not self.nvml.available():
            if self.expected_count:
                return self._result(
                    Status.FAIL, f"NVML not available: expected {self.expected_count} GPUs"
                )
            return self._result(Status.OK, "no NVML: 0 GPUs")
        problems: list[tuple[Status, str]] = []
        count = self.nvml.device_count()
        if self.expected_count is not None and count < self.expected_count:
            problems.append((Status.FAIL, f"found {count} GPUs, expected {self.expected_count}"))
        problems.extend(self._xids())
        temps: list[int] = []
        for i in range(count):
            problems.extend(self._probe(i, temps))
        if problems:
            top = worst(s for s, _ in problems)
            same = [r for s, r in problems if s is top]
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            return self._result(top, same[0] + more)
        hottest = f", hottest {max(temps)} C" if temps else ""
        return self._result(Status.OK, f"{count} GPUs healthy{hottest}")

    def _xids(self) -> list[tuple[Status, str]]:
        now = self._clock()
        out: list[tuple[Status, str]] = []
        for gpu, xid in self.nvml.xid_events():
            self._seq += 1
            self._emit({"key": f"{self._run_id}:{self._seq}", "gpu": gpu, "xid": xid})
            meaning = self.critical_xids.get(xid)
            if meaning is None:
                log.info("GPU %s: XID %s (not a node fault; ignored)", gpu, xid)
                continue
            where = f"GPU {gpu}" if gpu >= 0 else "GPU ?"
            reason = f"{where}: XID {xid} ({meaning})"
            out.append((Status.FAIL, reason))
            self._held[gpu] = (now, reason)
        for gpu, (seen, reason) in list(self._held.items()):
            if now - seen >= self.xid_hold_s:
                del self._held[gpu]
            elif not any(r == reason for _, r in out):
                out.append((Status.FAIL, reason))
        return out

    def _probe(self, i: int, temps: list[int]) -> list[tuple[Status, str]]:
        out: list[tuple[Status, str]] = []
        probes: list[tuple[str, Callable[[int], Any]]] = [
            ("temperature", self.nvml.temperature),
            ("ECC counters", self.nvml.ecc_uncorrectable),
            ("retired pages", self.nvml.retired_pages_pending),
            ("remapped rows", self.nvml.remapped_rows),
        ]
        for what, probe in probes:
            try:
                value = probe(i)
            except NvmlProbeError as e:
                if e.fatal:
                    return [(Status.FAIL, f"GPU {i}: {e}")]
                out.append((Status.WARN, f"GPU {i}: cannot read {what}: {e}"))
                continue
            if value is None:  # not supported on this GPU
                continue
            if what in ("temperature", "ECC counters"):
                key = "temperature" if what == "temperature" else "ecc_uncorrectable"
                self.readings.setdefault(i, {})[key] = float(value)
            if what == "ECC counters":
                self._note_ecc(i, int(value))
            if what == "temperature":
                temps.append(int(value))
                if value >= self.temp_fail_c:
                    out.append(
                        (Status.FAIL, f"GPU {i}: temperature {value} C >= {self.temp_fail_c:g} C")
                    )
                elif value >= self.temp_warn_c:
                    out.append(
                        (Status.WARN, f"GPU {i}: temperature {value} C >= {self.temp_warn_c:g} C")
                    )
            elif what == "ECC counters" and value > 0:
                out.append(
                    (Status.FAIL, f"GPU {i}: {value} uncorrectable ECC errors since driver load")
                )
            elif what == "retired pages" and value:
                out.append((Status.WARN, f"GPU {i}: page retirement pending (reset the GPU)"))
            elif what == "remapped rows":
                pending, failure = value
                if failure:
                    out.append((Status.FAIL, f"GPU {i}: row remapping failed (replace the GPU)"))
                elif pending:
                    out.append((Status.WARN, f"GPU {i}: row remapping pending (reset the GPU)"))
        return out

    def _result(self, status: Status, reason: str) -> CheckResult:
        return CheckResult(self.name, status, one_line(reason))

    # ------------------------------------------------------------------ events for /metrics
    def _emit(self, event: dict[str, Any]) -> None:
        with self._outbox_lock:
            if len(self._outbox) < MAX_PENDING_EVENTS:  # a controller outage: keep the first
                self._outbox.append({**event, "ts": time.time()})

    def _note_ecc(self, gpu: int, count: int) -> None:
        """A change of the volatile counter is an event carrying its total since boot: the
        controllers count the largest total per boot (so an agent restarted mid-boot, which
        reports the total again, adds nothing twice; its key names boot and value)."""
        last = self._ecc_seen.get(gpu)
        self._ecc_seen[gpu] = count
        if count > 0 and count != last:
            boot = _boot_id()
            new = count if last is None or count < last else count - last
            self._emit(
                {
                    "key": f"{boot}:ecc:{gpu}:{count}",
                    "gpu": gpu,
                    "count": new,
                    "total": count,
                    "boot": boot,
                }
            )

    def pending_events(self) -> list[dict[str, Any]]:
        """GPU events to report with the next heartbeat (until `confirm`ed)."""
        with self._outbox_lock:
            return list(self._outbox)

    def confirm(self, keys: set[str]) -> None:
        """A controller stored these events: stop reporting them."""
        with self._outbox_lock:
            self._outbox = [e for e in self._outbox if e["key"] not in keys]


# ------------------------------------------------------------------------------ real adapter
class RealNvml:
    """nvidia-ml-py (`pynvml`) behind `NvmlLike`.  Every call is guarded: no library or no
    driver is a node with zero GPUs; NotSupported skips that probe; a lost GPU is fatal.

    NVML stays initialised for the process lifetime because the XID event set must outlive a
    single run.  Initialisation is retried on every run until it succeeds, so a driver that
    loads after the agent started is picked up.  `module` injects a stand-in for tests.
    """

    def __init__(self, module: ModuleType | Any | None = None, *, xid_events: bool = True) -> None:
        self._m: Any = module
        self._want_events = xid_events
        self._ok = False
        self._handles: list[Any] = []
        self._handle_errors: dict[int, NvmlProbeError] = {}
        self._events: Any = None
        self._registered: dict[int, int] = {}  # handle address -> index
        self._lock = threading.Lock()

    # -- lifecycle
    def refresh(self) -> None:
        with self._lock:
            if not self._ok:
                self._init()
            if self._ok:
                self._load_handles()

    def _init(self) -> None:
        m = self._m
        if m is None:
            try:
                import pynvml
            except ImportError:
                log.debug("pynvml is not installed: no GPUs")
                return
            m = self._m = pynvml
        try:
            m.nvmlInit()
        except Exception as e:  # no library, no driver, no GPU: a node without GPUs
            log.debug("NVML unavailable: %s", e)
            return
        self._ok = True

    def _load_handles(self) -> None:
        m = self._m
        try:
            count = int(m.nvmlDeviceGetCount())
        except Exception as e:
            log.warning("nvmlDeviceGetCount failed: %s", e)
            count = 0
        self._handles, self._handle_errors = [], {}
        for i in range(count):
            try:
                self._handles.append(m.nvmlDeviceGetHandleByIndex(i))
            except Exception as e:
                self._handles.append(None)
                self._handle_errors[i] = self._translate(e) or NvmlProbeError(
                    "not supported", fatal=True
                )
        if self._want_events:
            self._register_events()

    def _register_events(self) -> None:
        m = self._m
        if self._events is None:
            try:
                self._events = m.nvmlEventSetCreate()
            except Exception as e:
                log.info("NVML events unavailable (no XID monitoring): %s", e)
                self._want_events = False
                return
        for i, h in enumerate(self._handles):
            if h is None or _addr(h) in self._registered:
                continue
            try:
                m.nvmlDeviceRegisterEvents(h, m.nvmlEventTypeXidCriticalError, self._events)
            except Exception as e:
                log.info("GPU %d: XID events not available: %s", i, e)
            self._registered[_addr(h)] = i  # registered or unsupported: do not retry every run

    def available(self) -> bool:
        return self._ok

    def device_count(self) -> int:
        return len(self._handles)

    # -- probes
    def _call(self, index: int, fn: Callable[[Any], Any]) -> Any:
        if index in self._handle_errors:
            raise self._handle_errors[index]
        try:
            return fn(self._handles[index])
        except Exception as e:
            err = self._translate(e)
            if err is None:
                return None
            raise err from e

    def temperature(self, index: int) -> int | None:
        m = self._m
        v = self._call(index, lambda h: m.nvmlDeviceGetTemperature(h, m.NVML_TEMPERATURE_GPU))
        return None if v is None else int(v)

    def ecc_uncorrectable(self, index: int) -> int | None:
        m = self._m
        v = self._call(
            index,
            lambda h: m.nvmlDeviceGetTotalEccErrors(
                h, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC
            ),
        )
        return None if v is None else int(v)

    def retired_pages_pending(self, index: int) -> bool | None:
        v = self._call(index, self._m.nvmlDeviceGetRetiredPagesPendingStatus)
        return None if v is None else bool(v)

    def remapped_rows(self, index: int) -> tuple[bool, bool] | None:
        v = self._call(index, self._m.nvmlDeviceGetRemappedRows)
        if v is None:
            return None
        _corr, _unc, pending, failure = v
        return bool(pending), bool(failure)

    def xid_events(self) -> list[tuple[int, int]]:
        m = self._m
        if not self._ok or self._events is None:
            return []
        out: list[tuple[int, int]] = []
        for _ in range(1000):  # bounded: a storm of events must not stall the check
            try:
                data = m.nvmlEventSetWait(self._events, 0)
            except Exception as e:
                if getattr(e, "value", None) != getattr(m, "NVML_ERROR_TIMEOUT", object()):
                    log.info("nvmlEventSetWait failed: %s", e)
                break
            if int(data.eventType) & int(m.nvmlEventTypeXidCriticalError):
                out.append((self._index_of(data.device), int(data.eventData)))
        return out

    def utilization(self, index: int) -> int | None:
        """Percent of the last sample period the GPU was busy (`phalanx eff`)."""
        m = self._m
        return self._call(index, lambda h: int(m.nvmlDeviceGetUtilizationRates(h).gpu))

    def memory(self, index: int) -> tuple[int, int] | None:
        """(bytes in use, bytes total) of the GPU's memory."""
        m = self._m

        def probe(h: Any) -> tuple[int, int]:
            info = m.nvmlDeviceGetMemoryInfo(h)
            return int(info.used), int(info.total)

        return self._call(index, probe)

    def _index_of(self, handle: Any) -> int:
        try:
            return int(self._m.nvmlDeviceGetIndex(handle))
        except Exception:
            return self._registered.get(_addr(handle), -1)

    def _translate(self, e: Exception) -> NvmlProbeError | None:
        """NVML error -> None (skip the probe), or a probe error (fatal if the GPU is gone)."""
        m = self._m
        code = getattr(e, "value", None)
        skip = {
            getattr(m, n, object())
            for n in (
                "NVML_ERROR_NOT_SUPPORTED",
                "NVML_ERROR_FUNCTION_NOT_FOUND",  # an older driver
                "NVML_ERROR_NO_PERMISSION",  # a site policy, not a sick GPU: never drain for it
            )
        }
        if code in skip:
            return None
        gone = {
            getattr(m, n, object()) for n in ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")
        }
        return NvmlProbeError(str(e) or type(e).__name__, fatal=code in gone)


def _addr(handle: Any) -> int:
    """A stable key for an NVML device handle (a ctypes pointer) or a test stand-in."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except Exception:
        return id(handle)


# ------------------------------------------------------------------------------ fake adapter
@dataclass
class FakeGpu:
    """One fake GPU.  None for a probe means "not supported on this GPU"; `lost` makes every
    probe fail as NVML does for a GPU that fell off the bus."""

    temperature: int | None = 40
    ecc_uncorrectable: int | None = 0
    retired_pages_pending: bool | None = False
    remap_pending: bool | None = False
    remap_failure: bool | None = False
    lost: bool = False
    # usage, sampled for `phalanx eff` (agent/gpu_usage.py): percent busy, bytes in use/total
    utilization: int | None = 0
    memory_used: int | None = 0
    memory_total: int | None = 80 * 2**30


class FakeNvml:
    """A FAKE NVML for tests — never used unless a test or ``PHX_FAKE_NVML`` asks for it.

    In memory: ``FakeNvml([FakeGpu(), FakeGpu(temperature=97)])`` or ``FakeNvml(8)``; mutate
    ``fake.gpus[i]`` and call ``fake.queue_xid(3, 79)`` to inject faults.

    From a file (``FakeNvml(path=...)`` or `FakeNvml.from_env()` with ``PHX_FAKE_NVML=/path``)
    the file is re-read on every run, so a system test can break a GPU under a running agent::

        {
          "available": true,          # optional; false = no NVML/driver on this node
          "gpus": [                   # one object per GPU (index = position), or an integer
            {"temperature": 45,       #   count of healthy GPUs.  Every field is optional;
             "ecc_uncorrectable": 0,  #   defaults as in FakeGpu; null = probe not supported
             "retired_pages_pending": false,
             "remap_pending": false,
             "remap_failure": false,
             "lost": false}           # true: GPU fell off the bus (every probe fails)
          ],
          "xid": [[3, 79], {"gpu": 1, "xid": 48}]   # XID events, [gpu, xid] or {"gpu","xid"}
        }

    XIDs are events, delivered once: each run delivers the entries past those already
    delivered, so append to inject another (a new process delivers all entries present at its
    first read; a list that got shorter starts counting again from its new length).  Write the
    file atomically (write a temp file, then rename); a file that does not parse keeps the last
    good state, and a missing file reads as a node without NVML.
    """

    def __init__(
        self,
        gpus: int | list[FakeGpu] | None = None,
        *,
        available: bool = True,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.gpus: list[FakeGpu] = (
            [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else list(gpus or [])
        )
        self.is_available = available
        self.path = Path(path) if path is not None else None
        self._queue: deque[tuple[int, int]] = deque()
        self._file_xids_seen = 0
        if self.path is not None:
            self.is_available = False
            self.refresh()

    @classmethod
    def from_env(cls) -> FakeNvml | None:
        """The fake named by ``PHX_FAKE_NVML``, or None when the variable is unset/empty."""
        path = os.environ.get(FAKE_NVML_ENV, "").strip()
        return cls(path=path) if path else None

    def queue_xid(self, gpu: int, xid: int) -> None:
        self._queue.append((gpu, xid))

    # -- NvmlLike
    def refresh(self) -> None:
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            self.is_available, self.gpus = False, []
            return
        except (OSError, ValueError) as e:
            log.warning("fake NVML file %s unreadable (keeping last state): %s", self.path, e)
            return
        self._load(data)

    def _load(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"fake NVML file {self.path}: top level must be an object")
        unknown = set(data) - {"available", "gpus", "xid"}
        if unknown:
            raise ValueError(f"fake NVML file {self.path}: unknown keys {sorted(unknown)}")
        gpus = data.get("gpus", [])
        known = {f.name for f in fields(FakeGpu)}
        if isinstance(gpus, int):
            self.gpus = [FakeGpu() for _ in range(gpus)]
        else:
            parsed = []
            for g in gpus:
                if not isinstance(g, dict) or set(g) - known:
                    raise ValueError(f"fake NVML file {self.path}: bad GPU entry {g!r}")
                parsed.append(FakeGpu(**g))
            self.gpus = parsed
        self.is_available = bool(data.get("available", True))
        try:
            xids = [
                (int(e["gpu"]), int(e["xid"])) if isinstance(e, dict) else (int(e[0]), int(e[1]))
                for e in data.get("xid", [])
            ]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(
                f"fake NVML file {self.path}: 'xid' entries must be [gpu, xid] or "
                f'{{"gpu": N, "xid": N}}: {e!r}'
            ) from None
        if len(xids) < self._file_xids_seen:
            self._file_xids_seen = len(xids)
        self._queue.extend(xids[self._file_xids_seen :])
        self._file_xids_seen = len(xids)

    def available(self) -> bool:
        return self.is_available

    def device_count(self) -> int:
        return len(self.gpus) if self.is_available else 0

    def _gpu(self, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        if gpu.lost:
            raise NvmlProbeError("GPU is lost", fatal=True)
        return gpu

    def temperature(self, index: int) -> int | None:
        return self._gpu(index).temperature

    def ecc_uncorrectable(self, index: int) -> int | None:
        return self._gpu(index).ecc_uncorrectable

    def retired_pages_pending(self, index: int) -> bool | None:
        return self._gpu(index).retired_pages_pending

    def remapped_rows(self, index: int) -> tuple[bool, bool] | None:
        gpu = self._gpu(index)
        if gpu.remap_pending is None and gpu.remap_failure is None:
            return None
        return bool(gpu.remap_pending), bool(gpu.remap_failure)

    def xid_events(self) -> list[tuple[int, int]]:
        out = list(self._queue)
        self._queue.clear()
        return out

    def utilization(self, index: int) -> int | None:
        return self._gpu(index).utilization

    def memory(self, index: int) -> tuple[int, int] | None:
        gpu = self._gpu(index)
        if gpu.memory_used is None or gpu.memory_total is None:
            return None
        return gpu.memory_used, gpu.memory_total


def nvml_from_env() -> NvmlLike:
    """The adapter an agent should use: the fake named by ``PHX_FAKE_NVML`` if set (system
    tests), otherwise the real NVML."""
    fake = FakeNvml.from_env()
    return fake if fake is not None else RealNvml()


__all__ = [
    "CRITICAL_XIDS",
    "FAKE_NVML_ENV",
    "FakeGpu",
    "FakeNvml",
    "GpuCheck",
    "NvmlLike",
    "NvmlProbeError",
    "RealNvml",
    "nvml_from_env",
]
