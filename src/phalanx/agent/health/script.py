"""Site health scripts, run the way Slurm's HealthCheckProgram / LBNL NHC sites expect.

Exit 0 is healthy; any other exit is FAIL with the first line of the script's output (stdout,
else stderr) as the reason — NHC prints "ERROR: nhc: ..." and exits non-zero, so an existing
NHC setup works unchanged.  Exit codes listed in `warn_exit_codes` (none by default, to stay
NHC-compatible; a site may choose e.g. ``[2]``) give WARN instead.  A script that outlives its
timeout has its whole process group killed and FAILs "timed out after Ns".
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

from phalanx.agent.health.base import CheckResult, Status, one_line


class ScriptCheck:
    """Run `path` (no arguments, stdin from /dev/null) every `interval` seconds."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        timeout: float = 30,
        interval: float = 60,
        *,
        warn_exit_codes: Iterable[int] = (),
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.timeout = float(timeout)
        self.interval = float(interval)
        self.warn_exit_codes = frozenset(warn_exit_codes)
        self.env = dict(env) if env is not None else None
        self.name = name or f"script:{self.path}"

    def run(self) -> CheckResult:
        try:
            # A session of its own, so a timeout kills the script's children too (NHC forks).
            proc = subprocess.Popen(
                [str(self.path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=self.env,
                cwd="/",
            )
        except OSError as e:
            return self._r(Status.FAIL, f"cannot run {self.path}: {e.strerror or e}")
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            try:
                proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a grandchild escaped the group, holding a pipe
                proc.kill()
                proc.wait()
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
            return self._r(Status.FAIL, f"timed out after {self.timeout:g}s")
        code = proc.returncode
        if code == 0:
            return self._r(Status.OK, _first_line(out) or "exit 0")
        status = Status.WARN if code in self.warn_exit_codes else Status.FAIL
        reason = _first_line(out) or _first_line(err)
        if not reason:
            if code < 0:
                reason = f"{self.path} killed by signal {-code}"
            else:
                reason = f"{self.path} exited with status {code}"
        return self._r(status, reason)

    def _r(self, status: Status, reason: str) -> CheckResult:
        return CheckResult(self.name, status, one_line(reason))


def _first_line(data: bytes) -> str:
    for line in data.decode("utf-8", "replace").splitlines():
        if line.strip():
            return line.strip()
    return ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session made it a leader
    except ProcessLookupError:
        pass
    except PermissionError:
        proc.kill()
