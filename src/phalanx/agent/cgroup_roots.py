"""The agent's own node cgroups, ``<base>/phalanx/<node>-<hash>``: remembered, removed when empty.

An agent makes its node root in every cgroup hierarchy at start (:func:`cgroups.ensure_parents`);
the attempts' cgroups beneath come and go with the jobs, and the agent sweeps those of ended
attempts.  The root itself used to stay for ever, so every test or local cluster with a fresh
state dir left one directory per node and hierarchy behind.  Now:

* the agent remembers its roots in ``<state dir>/cgroup-roots.json`` when it starts
  (:func:`record`).  Where they are depends on the cgroup the agent ran in (v1: its own cgroup
  in each hierarchy; v2: its parent), which a later ``phalanx down`` from another shell need
  not share, so they are written down rather than detected again;
* an agent that stops cleanly removes the cgroups of ended attempts, then those roots that are
  empty (:func:`release`).  A root with running jobs beneath stays (the kernel refuses to
  remove a cgroup with processes or children, and nothing here kills): a restarted agent uses
  it again and sweeps as before;
* ``phalanx down`` and the test harness, once the agents are stopped and their jobs asked to
  stop, do the same for each node (:func:`teardown`).

The shared ``phalanx`` directory above the roots is never removed (see :func:`cgroups.node_roots`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

from phalanx.agent import cgroups, shepherd_control
from phalanx.agent.files import read_json, write_json

ROOTS_FILE = "cgroup-roots.json"


def cgroup_name(node: str, state_dir: Path) -> str:
    """``<node>-<8 hex digits of the state dir's path>`` (see Agent.cgroup_name)."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(state_dir))).hexdigest()[:8]
    return f"{node}-{digest}"


def merge(recorded: Iterable[str], current: Iterable[str], name: str) -> list[str]:
    """The roots to remember (pure): those recorded before (an agent restarted from another
    cgroup still has its old roots to remove) and the current ones; only paths that are roots
    of ``name`` (:func:`cgroups.is_node_root`), in removal order."""
    return cgroups.removal_order(d for d in (*recorded, *current) if cgroups.is_node_root(d, name))


def recorded(state_dir: Path, name: str) -> list[str]:
    """The roots remembered in ``state_dir`` (none when the file is missing or damaged)."""
    data = read_json(state_dir / ROOTS_FILE)
    roots = data.get("roots") if data else None
    if not isinstance(roots, list):
        return []
    return merge([r for r in roots if isinstance(r, str)], (), name)


def record(state_dir: Path, layout: cgroups.Layout, name: str) -> list[str]:
    """Remember this agent's roots under ``layout`` (added to those already remembered)."""
    roots = merge(recorded(state_dir, name), cgroups.node_roots(layout, name), name)
    write_json(state_dir / ROOTS_FILE, {"name": name, "roots": roots})
    return roots


def ended_attempts(node_dirs: Iterable[str], tasks_dir: Path) -> dict[str, list[str]]:
    """Attempt id -> its cgroup directories, for the attempt cgroups under ``node_dirs`` whose
    attempt is over: its task directory is gone, or its shepherd exited or was lost."""
    found: dict[str, list[str]] = {}
    for d in sorted(set(node_dirs)):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            if n.isdigit() and os.path.isdir(f"{d}/{n}"):
                found.setdefault(n, []).append(f"{d}/{n}")
    ended: dict[str, list[str]] = {}
    for aid, dirs in found.items():
        td = tasks_dir / aid
        if td.is_dir() and shepherd_control.read_status(td)["state"] not in ("exited", "lost"):
            continue
        ended[aid] = dirs
    return ended


def release(state_dir: Path, name: str) -> list[str]:
    """Remove the remembered roots that are empty.  Returns the roots kept (jobs still run
    beneath them).  Kills nothing.  The record stays: a shepherd launched just before the
    stop may make its root again (cgroups.setup), and a later teardown must still find it."""
    roots = recorded(state_dir, name)
    if not roots:
        return []
    _gone, kept = cgroups.remove_empty(roots)
    return kept


def _tasks_running(tasks_dir: Path) -> bool:
    try:
        dirs = [d for d in tasks_dir.iterdir() if d.is_dir() and not d.name.startswith(".")]
    except OSError:
        return False
    return any(shepherd_control.read_status(d)["state"] in ("running", "starting") for d in dirs)


def teardown(state_dir: Path, name: str, timeout: float = 0.0) -> list[str]:
    """After the node's agent has stopped and its jobs were asked to stop (``phalanx down``,
    the test harness): wait up to ``timeout`` for its tasks to end, remove the cgroups of its
    ended attempts (killing stragglers left there by a lost shepherd, as the agent's sweep
    does), then :func:`release` its roots.  Returns the roots kept."""
    roots = recorded(state_dir, name)
    if not roots:
        return []
    tasks_dir = state_dir / "tasks"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _tasks_running(tasks_dir):
        time.sleep(0.1)
    for dirs in ended_attempts(roots, tasks_dir).values():
        cgroups.remove({"dirs": dirs}, timeout=1.0)
    return release(state_dir, name)
