"""Real Unix users for system tests: made for a module or a test, removed afterwards, even when
it fails (test_multiuser.py, test_job_files.py).

Users are made with ``useradd -m -U`` (a group of their own, a home) and carry `COMMENT` in
their GECOS field, so that a run killed before its cleanup (SIGKILL, power loss) is cleaned up
by the next one, and an unrelated account of the same name is never touched (the test fails
instead).  Removing a user first kills, by pid, every process whose real uid is theirs (every
such process was started by the test), then ``userdel -r``.

Interpreter access: the project's Python lives under /root (mode 700), where other users cannot
reach it.  `root_searchable` gives /root, and any other directory on the way to the interpreter
or the sources that others cannot search (a checkout in a mode-700 temporary directory), o+x
(search only: nobody can list it) for the block, and restores the original modes afterwards.
That suffices because everything under /root/.pyenv and the venv is already world-readable
(`can_import` checks it as the user).

All of it needs root; the modules using it skip otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

COMMENT = "phalanx system test user"  # marks users a crashed earlier run may have left behind


def sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def kill_processes_of(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid` (a user made by a test, so every such
    process was started by it), by pid, and wait until they are gone."""

    def pids() -> list[int]:
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    line = next(x for x in f if x.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if int(line.split()[1]) == uid:
                out.append(int(entry))
        return out

    for pid in pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids() and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_user(name: str) -> None:
    """Kill the user's processes, remove the user, their home and their own group."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        uid = None
    if uid is not None:
        kill_processes_of(uid)
        if sh("userdel", "-r", name).returncode != 0:
            sh("userdel", "-r", "-f", name)
    with contextlib.suppress(KeyError):
        grp.getgrnam(name)
        sh("groupdel", name)


def clear_leftovers(names: Iterable[str], groups: Iterable[str] = ()) -> None:
    """Users (and shared groups, once empty) a run killed before its cleanup left behind:
    only users carrying `COMMENT`, never an unrelated account of the same name."""
    for name in names:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_gecos != COMMENT:
            pytest.fail(f"a user {name} exists and was not made by this test: not touching it")
        remove_user(name)
    for group in groups:
        with contextlib.suppress(KeyError):
            if not grp.getgrnam(group).gr_mem:
                sh("groupdel", group)


def add_user(name: str, groups: Iterable[str] = ()) -> pwd.struct_passwd:
    """``useradd -m -U`` (a home, a group of its own), in the supplementary `groups`."""
    extra = list(groups)
    more = ["-G", ",".join(extra)] if extra else []
    p = sh("useradd", "-m", "-U", *more, "-c", COMMENT, "-s", "/bin/sh", name)
    assert p.returncode == 0, f"useradd {name}: {p.stderr.strip()}"
    return pwd.getpwnam(name)


@contextlib.contextmanager
def temporary_users(names: Iterable[str]) -> Iterator[list[pwd.struct_passwd]]:
    """Users made for the block (leftovers of a killed run removed first), removed with
    everything they run when it ends, however it ends."""
    wanted = list(names)
    if os.geteuid() != 0:
        pytest.skip("creates Unix users (useradd) and runs commands as them: root only")
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("useradd and runuser are needed to run commands as other users")
    clear_leftovers(wanted)
    try:
        yield [add_user(n) for n in wanted]
    finally:
        for n in wanted:
            remove_user(n)


def reach_dirs() -> list[Path]:
    """Every directory above the interpreter (its real path under /root/.pyenv and the venv's
    link) and above the project's sources: the ones other users must be able to search."""
    import phalanx

    out: list[Path] = []
    for target in (Path(sys.executable), Path(sys.executable).resolve(), Path(phalanx.__file__)):
        for d in target.parents:
            if d not in out and d != Path("/"):
                out.append(d)
    return out


# Which processes have the directories open for search, and the modes to restore when the last
# one is done: modules that run at once (make test's parallel workers) share one opening, and
# a module's end never closes the directories under another's users. A holder killed before
# its end is pruned by the next one; the modes it recorded are the original ones still.
_SEARCHABLE = Path("/tmp/phalanx-test-searchable.json")
_SEARCHABLE_LOCK = Path("/tmp/phalanx-test-searchable.lock")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def _searchable_registry() -> Iterator[dict[str, Any]]:
    """The registry, read and written under an exclusive lock, with dead holders pruned."""
    with open(_SEARCHABLE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(_SEARCHABLE.read_text())
        except (OSError, ValueError):
            state = {}
        state.setdefault("modes", {})
        state["holders"] = [p for p in state.get("holders", []) if _alive(int(p))]
        yield state
        if state["holders"] or state["modes"]:
            tmp = _SEARCHABLE.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(_SEARCHABLE)
        else:
            _SEARCHABLE.unlink(missing_ok=True)


@contextlib.contextmanager
def root_searchable() -> Iterator[None]:
    """/root, and any other directory on the way to the interpreter or the sources that others
    may not search (a checkout under a mode-700 temporary directory), get o+x for the block
    (search only: nobody can list them), then their old modes back once no other process
    (a parallel test worker) still needs them."""
    with _searchable_registry() as state:
        for d in reach_dirs():
            mode = stat.S_IMODE(d.stat().st_mode)
            if not mode & stat.S_IXOTH:
                state["modes"].setdefault(str(d), mode)
                os.chmod(d, mode | stat.S_IXOTH)
        state["holders"].append(os.getpid())
    try:
        yield
    finally:
        with _searchable_registry() as state:
            if os.getpid() in state["holders"]:
                state["holders"].remove(os.getpid())  # one entry: a nested block keeps its own
            if not state["holders"]:
                for d, mode in sorted(state["modes"].items(), reverse=True):  # deepest first
                    with contextlib.suppress(FileNotFoundError):
                        os.chmod(d, mode)
                state["modes"] = {}


def can_import(name: str, modules: str = "phalanx, jwt, httpx") -> None:
    """Fail the test with a clear message when `name` cannot run this interpreter and import
    `modules` (inside `root_searchable`)."""
    probe = sh("runuser", "-u", name, "--", sys.executable, "-c", f"import {modules}")
    assert probe.returncode == 0, (
        f"{name} cannot run {sys.executable} even with /root o+x: {probe.stderr.strip()[-500:]}"
    )
