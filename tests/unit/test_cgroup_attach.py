"""A shepherd's child joins its job's cgroups by itself, between fork and exec
(cgroups.attach_self), with the real kernel's cgroup v1 hierarchies: through each
hierarchy's ``tasks`` with ``0``, which moves the calling thread alone and spares the global
threadgroup lock's RCU grace period (docs/slurm.md, "What a step costs").  What must hold is
what a job relies on: the process is in every cgroup of the plan, and so are the processes it
starts afterwards.  Skipped where this process cannot make cgroup v1 memory and pids cgroups.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.agent import cgroups

CONTROLLERS = ("memory", "pids")


def _own_v1_dir(controller: str) -> Path | None:
    """This process's cgroup in the v1 hierarchy of `controller`, where mounted as usual."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            d = Path(f"/sys/fs/cgroup/{controller}{path}")
            return d if (d / "tasks").exists() else None
    return None


@pytest.fixture
def v1_cgroups() -> Iterator[dict[str, Path]]:
    """A fresh cgroup per controller under this process's own, removed afterwards."""
    made: dict[str, Path] = {}
    try:
        for c in CONTROLLERS:
            parent = _own_v1_dir(c)
            if parent is None:
                pytest.skip(f"no cgroup v1 {c} hierarchy here")
            d = parent / f"phx-attach-test-{os.getpid()}"
            try:
                d.mkdir()
            except OSError as e:
                pytest.skip(f"cannot make a {c} cgroup: {e}")
            made[c] = d
        yield made
    finally:
        for d in made.values():
            deadline = time.monotonic() + 30
            while True:  # the test's processes leave the cgroup as they are reaped
                try:
                    d.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def _cgroups_of_child(plan: dict[str, object]) -> tuple[str, str]:
    """Fork a child that joins `plan` and then forks a grandchild; return both processes'
    /proc/self/cgroup as they read them."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: like the shepherd's, one thread between fork and exec
        code = 1
        try:
            os.close(r)
            cgroups.attach_self(plan)
            mine = Path("/proc/self/cgroup").read_text()
            gr, gw = os.pipe()
            grandchild = os.fork()
            if grandchild == 0:
                os.close(gr)
                os.write(gw, Path("/proc/self/cgroup").read_text().encode())
                os._exit(0)
            os.close(gw)
            theirs = b""
            while chunk := os.read(gr, 4096):
                theirs += chunk
            os.waitpid(grandchild, 0)
            os.write(w, mine.encode() + b"\0" + theirs)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    mine, theirs = data.decode().split("\0")
    return mine, theirs


def _path_in(proc_cgroup: str, controller: str) -> str:
    for line in proc_cgroup.splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    raise AssertionError(f"no {controller} line in {proc_cgroup!r}")


def test_the_child_and_what_it_starts_are_in_every_cgroup_of_the_plan(
    v1_cgroups: dict[str, Path],
) -> None:
    plan = {"backend": "v1", "dirs": [str(d) for d in v1_cgroups.values()]}
    before = Path("/proc/self/cgroup").read_text()
    mine, theirs = _cgroups_of_child(plan)
    for c, d in v1_cgroups.items():
        want = "/" + str(d.relative_to(f"/sys/fs/cgroup/{c}"))
        assert _path_in(mine, c) == want
        assert _path_in(theirs, c) == want
    assert Path("/proc/self/cgroup").read_text() == before  # the parent stayed where it was


def test_a_cgroup_that_cannot_be_joined_says_which(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    with pytest.raises(cgroups.CgroupError) as err:
        cgroups.attach_self({"backend": "v1", "dirs": [str(missing)]})
    assert str(missing / "tasks") in str(err.value)
