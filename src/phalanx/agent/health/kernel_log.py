"""Kernel-log patterns: the kernel often knows about a dying GPU, disk or DIMM first.

Only lines logged after the check started are scanned (each source keeps a cursor), so an
agent restart does not re-drain a node for history an operator has already dealt with.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from phalanx.agent.health.base import CheckResult, Status, one_line
from phalanx.agent.health.gpu import CRITICAL_XIDS

log = logging.getLogger("phalanx.agent.health")

KernelLogSource = Callable[[], Iterable[str]]

#: Regular expressions (searched anywhere in a line) and what a match means.
#:  * a critical NVIDIA XID ("NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the
#:    bus") -> FAIL; application XIDs (13, 31, 43...) do not match;
#:  * a machine check (CPU/memory/PCIe hardware error reported by the CPU) -> WARN: most are
#:    corrected errors, but they are the early sign of a failing DIMM or CPU;
#:  * "I/O error" (block layer) -> WARN: a failing local disk or a lost SAN path;
#:  * "blocked for more than N seconds" (hung task) -> WARN: usually a stuck NFS/Lustre mount
#:    that will hang the next job too.
DEFAULT_PATTERNS: dict[str, Status] = {
    r"NVRM: Xid \([^)]*\): (?:" + "|".join(str(x) for x in sorted(CRITICAL_XIDS)) + r")\b": (
        Status.FAIL
    ),
    r"[Mm]achine [Cc]heck": Status.WARN,
    r"\bI/O error\b": Status.WARN,
    r"blocked for more than \d+ seconds": Status.WARN,
}

_MAX_RECORDS = 10000  # per run: a log storm must not keep the check busy forever


class KmsgSource:
    """New records from /dev/kmsg, read non-blocking.  The first call seeks to the end."""

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self.path = path
        self._fd: int | None = None

    def __call__(self) -> list[str]:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
            return []
        lines = []
        for _ in range(_MAX_RECORDS):
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before we read them; go on
                continue
            if not record:
                break
            # "<prio>,<seq>,<usec>,<flags>;message\n continuation key=value lines"
            text = record.decode("utf-8", "replace")
            message = text.partition(";")[2].split("\n", 1)[0]
            lines.append(message)
        return lines

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JournalSource:
    """New kernel lines from `journalctl -k`, following the journal's cursor."""

    def __init__(self, exe: str = "journalctl", timeout: float = 10.0) -> None:
        self.exe = exe
        self.timeout = timeout
        self._cursor: str | None = None
        self._since: float | None = None

    def __call__(self) -> list[str]:
        args = [self.exe, "-k", "-o", "cat", "--no-pager", "-q", "--show-cursor"]
        first = self._cursor is None and self._since is None
        if self._cursor is not None:
            args.append(f"--after-cursor={self._cursor}")
        elif first:
            args += ["-n", "1"]
        else:
            args.append(f"--since=@{int(self._since or 0)}")
        started = time.time()
        try:
            proc = subprocess.run(
                args, capture_output=True, text=True, timeout=self.timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as e:
            raise OSError(f"journalctl timed out after {self.timeout:g}s") from e
        if proc.returncode != 0:
            why = one_line(proc.stderr or proc.stdout) or f"exit status {proc.returncode}"
            raise OSError(f"journalctl -k failed: {why}")
        lines = proc.stdout.splitlines()
        if lines and lines[-1].startswith("-- cursor: "):
            self._cursor = lines.pop()[len("-- cursor: ") :]
        elif self._cursor is None and self._since is None:
            self._since = started
        return [] if first else lines


class FileSource:
    """New complete lines appended to a plain file (e.g. /var/log/kern.log, or a test's file).
    Starts at the end; a file that shrank or was replaced (rotation) is read from the start."""

    def __init__(self, path: str | os.PathLike[str], *, start_at_end: bool = True) -> None:
        self.path = Path(path)
        self._offset: int | None = None if start_at_end else 0
        self._inode: int | None = None
        self._partial = b""

    def __call__(self) -> list[str]:
        st = self.path.stat()
        if self._offset is None:
            self._offset, self._inode = st.st_size, st.st_ino
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._offset, self._partial = 0, b""
        self._inode = st.st_ino
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read(4 * 1024 * 1024)
        self._offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        return [line.decode("utf-8", "replace") for line in complete]


class DefaultKernelSource:
    """/dev/kmsg if readable, else `journalctl -k` if installed; OSError when neither works.
    Retried on every call until one works, so a late-granted permission is picked up."""

    def __init__(self) -> None:
        self._source: KernelLogSource | None = None

    def __call__(self) -> Iterable[str]:
        if self._source is not None:
            return self._source()
        errors = []
        candidates: list[KernelLogSource] = [KmsgSource()]
        if shutil.which("journalctl"):
            candidates.append(JournalSource())
        for source in candidates:
            try:
                lines = source()
            except OSError as e:
                errors.append(str(e))
                continue
            self._source = source
            return lines
        raise OSError("; ".join(errors))


class KernelLogCheck:
    """Scan NEW kernel log lines for `patterns` (regex -> Status; OK disables a pattern).

    A matching line fails/warns the run with the line itself as the reason: "NVRM: Xid
    (PCI:0000:3b:00): 79, ... GPU has fallen off the bus" says more than any paraphrase.  Log
    lines are events, so the next run without matches passes and the monitor's recovery rule
    decides when the node returns.  An unreadable log is reported OK ("kernel log not
    readable: ...") and logged once: lacking this signal is no reason to drain a node.
    """

    def __init__(
        self,
        source: KernelLogSource | str | os.PathLike[str] | None = None,
        patterns: Mapping[str, Status | str] | None = None,
        interval: float = 30,
        *,
        name: str = "kernel_log",
    ) -> None:
        if source is None:
            self.source: KernelLogSource = DefaultKernelSource()
        elif isinstance(source, (str, os.PathLike)):
            self.source = FileSource(source)
        else:
            self.source = source
        compiled = []
        for pattern, status in (DEFAULT_PATTERNS if patterns is None else patterns).items():
            st = Status(status)
            if st is not Status.OK:
                compiled.append((re.compile(pattern), st))
        self.patterns = compiled
        self.interval = float(interval)
        self.name = name
        self._warned_unreadable = False

    def run(self) -> CheckResult:
        try:
            lines = list(self.source())
        except OSError as e:
            if not self._warned_unreadable:
                log.warning("kernel log not readable (no kernel-log health check): %s", e)
                self._warned_unreadable = True
            return CheckResult(self.name, Status.OK, one_line(f"kernel log not readable: {e}"))
        hits: list[tuple[Status, str]] = []
        for line in lines:
            for regex, status in self.patterns:
                if regex.search(line):
                    hits.append((status, line))
                    break
        if not hits:
            return CheckResult(self.name, Status.OK, f"{len(lines)} new kernel log lines, no match")
        top = Status.FAIL if any(s is Status.FAIL for s, _ in hits) else Status.WARN
        first = next(line for s, line in hits if s is top)
        more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
        return CheckResult(self.name, top, one_line(first.strip(), 280) + more)
