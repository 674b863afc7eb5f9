"""Host checks: disk space and write latency, required mounts, available memory.

All I/O sits behind constructor parameters (paths, `disk_usage`, `timer`, `ismount`,
`mountinfo`, `virtual_memory`) so tests use tmp dirs and fakes instead of the real machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

from phalanx.agent.health.base import CheckResult, Status, one_line

MB = 1024 * 1024
PROBE_BYTES = 4096


class DiskCheck:
    """A job-critical directory (checkpoints, scratch) must exist, be writable, have room, and
    answer a small write+fsync in reasonable time.

    Missing/unwritable -> FAIL (a filesystem remounted read-only after errors is the classic
    silent killer of checkpointing jobs); free space below `min_free_mb` -> FAIL; a probe write
    slower than `max_write_ms` -> WARN (a sick disk or overloaded NFS: stop new work, let
    running jobs be).  The probe is always written, even without a latency limit, because
    writability is the point.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        min_free_mb: int = 0,
        max_write_ms: float | None = None,
        interval: float = 60,
        *,
        disk_usage: Callable[[str], Any] = shutil.disk_usage,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.path = Path(path)
        self.min_free_mb = min_free_mb
        self.max_write_ms = max_write_ms
        self.interval = float(interval)
        self.name = f"disk:{self.path}"
        self._disk_usage = disk_usage
        self._timer = timer

    def run(self) -> CheckResult:
        p = self.path
        if not p.exists():
            return self._r(Status.FAIL, f"{p} does not exist")
        if not p.is_dir():
            return self._r(Status.FAIL, f"{p} is not a directory")
        free_mb = int(self._disk_usage(str(p)).free // MB)
        if free_mb < self.min_free_mb:
            return self._r(
                Status.FAIL, f"{p}: {free_mb} MB free, below the {self.min_free_mb} MB minimum"
            )
        probe = p / f".phalanx-health-probe-{os.getpid()}"
        start = self._timer()
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * PROBE_BYTES)
                os.fsync(fd)
            finally:
                os.close(fd)
            ms = (self._timer() - start) * 1000.0
        except OSError as e:
            return self._r(Status.FAIL, f"{p} is not writable: {e.strerror or e}")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)
        if self.max_write_ms is not None and ms > self.max_write_ms:
            return self._r(
                Status.WARN,
                f"{p}: probe write+fsync took {ms:.0f} ms (limit {self.max_write_ms:g} ms)",
            )
        return self._r(Status.OK, f"{p}: {free_mb} MB free, write+fsync {ms:.0f} ms")

    def _r(self, status: Status, reason: str) -> CheckResult:
        return CheckResult(self.name, status, one_line(reason))


class MountCheck:
    """Every listed path must be a mount point, or jobs would silently write to the root disk
    (an unmounted /scratch looks like an empty directory).

    A path counts as mounted if `os.path.ismount` says so or it appears as a mount point in
    /proc/self/mountinfo — the latter catches bind mounts, which ismount cannot see.
    """

    def __init__(
        self,
        paths: Iterable[str | os.PathLike[str]],
        interval: float = 60,
        *,
        ismount: Callable[[str], bool] = os.path.ismount,
        mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo",
        name: str = "mounts",
    ) -> None:
        self.paths = [os.path.normpath(os.fspath(p)) for p in paths]
        self.interval = float(interval)
        self.name = name
        self._ismount = ismount
        self._mountinfo = Path(mountinfo)

    def run(self) -> CheckResult:
        table: set[str] | None = None
        missing: list[str] = []
        for path in self.paths:
            if self._ismount(path):
                continue
            if table is None:
                table = self._mount_points()
            if path not in table:
                missing.append(path)
        if missing:
            more = f" (+{len(missing) - 1} more: {', '.join(missing[1:])})" if missing[1:] else ""
            return CheckResult(self.name, Status.FAIL, f"{missing[0]} is not mounted{more}")
        return CheckResult(self.name, Status.OK, f"{len(self.paths)} mounts present")

    def _mount_points(self) -> set[str]:
        try:
            text = self._mountinfo.read_text()
        except OSError:
            return set()
        out = set()
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 4:  # field 5 is the mount point, octal-escaped (\040 = space)
                out.add(os.path.normpath(_unescape(parts[4])))
        return out


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` etc.)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


class MemoryCheck:
    """Available memory below `min_available_mb` -> WARN: something (a leaked daemon, a page
    cache that will not drop, a stuck job's memory) is eating the node, and new jobs would be
    OOM-killed.  Only WARN because running jobs are not harmed by the check itself."""

    def __init__(
        self,
        min_available_mb: int,
        interval: float = 30,
        *,
        virtual_memory: Callable[[], Any] = psutil.virtual_memory,
        name: str = "memory",
    ) -> None:
        self.min_available_mb = min_available_mb
        self.interval = float(interval)
        self.name = name
        self._vm = virtual_memory

    def run(self) -> CheckResult:
        avail = int(self._vm().available // MB)
        if avail < self.min_available_mb:
            return CheckResult(
                self.name,
                Status.WARN,
                f"{avail} MB memory available, below {self.min_available_mb} MB",
            )
        return CheckResult(self.name, Status.OK, f"{avail} MB memory available")
