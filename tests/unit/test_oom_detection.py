"""OOM detection in the shepherd, with the kernel's real OOM killer.

The shepherd runs in a small memory cgroup made for the test (cgroup v1 memory controller;
skipped where the test cannot make one). A job that allocates past the limit is killed by the
kernel with SIGKILL and its exit record says `oom`; a job that SIGKILLs itself in the same
cgroup is not mistaken for one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_shepherd import Tasks, tasks

from phalanx.agent import shepherd

__all__ = ["tasks"]

LIMIT = 64 << 20


def _memory_cgroup_v1() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root = Path(f"/sys/fs/cgroup/memory{path}")
            return root if (root / "memory.oom_control").exists() else None
    return None


@pytest.fixture
def small_cgroup() -> Iterator[Path]:
    """A child memory cgroup with a 64 MiB limit (and no swap), removed afterwards."""
    parent = _memory_cgroup_v1()
    if parent is None:
        pytest.skip("no cgroup v1 memory controller here")
    cg = parent / f"phx-oom-test-{os.getpid()}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(LIMIT))
        if (cg / "memory.memsw.limit_in_bytes").exists():
            (cg / "memory.memsw.limit_in_bytes").write_text(str(LIMIT))
    except OSError as e:
        with contextlib.suppress(OSError):
            cg.rmdir()
        pytest.skip(f"cannot make a memory cgroup: {e}")
    try:
        yield cg
    finally:
        deadline = time.monotonic() + 30
        while True:
            try:
                cg.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def run_shepherd_in(cg: Path, td: Path) -> subprocess.Popen[bytes]:
    """The shepherd in the foreground, moved into `cg` first (its job inherits the cgroup)."""
    return subprocess.Popen(
        [
            "/bin/sh",
            "-c",
            f'echo $$ > "{cg}/cgroup.procs" && exec "$0" -I -S "$1" "$2"',
            sys.executable,
            str(Path(shepherd.__file__)),
            str(td),
        ],
        env={"PATH": "/usr/bin:/bin"},
    )


def test_kernel_oom_kill_is_recorded_as_oom(tasks: Tasks, small_cgroup: Path) -> None:
    job = [sys.executable, "-c", "b = b'x' * (512 << 20); print(len(b))"]
    td = tasks.task(job)
    proc = run_shepherd_in(small_cgroup, td)
    tasks.popens.append(proc)
    result = tasks.wait_exited(td)
    assert proc.wait(30) == 0
    assert result["signal"] == 9 and result.get("oom") is True, result


def test_a_sigkill_without_an_oom_kill_is_not_oom(tasks: Tasks, small_cgroup: Path) -> None:
    td = tasks.task(["/bin/sh", "-c", "kill -9 $$"])
    proc = run_shepherd_in(small_cgroup, td)
    tasks.popens.append(proc)
    result = tasks.wait_exited(td)
    assert proc.wait(30) == 0
    assert result["signal"] == 9 and "oom" not in result, result
