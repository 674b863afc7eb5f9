"""The agent's own node cgroups (agent/cgroup_roots.py, cgroups.node_roots / remove_empty).

Which directories are the node's roots and in which order they go is pure; removing them is
tried over plain directories in tmp_path, where rmdir refuses a non-empty directory as the
kernel refuses a cgroup with children (the real kernel is in tests/system/test_cgroup_cleanup.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from phalanx.agent import cgroup_roots, cgroups

NAME = "node01-1a2b3c4d"


def v1(top: Path) -> cgroups.Layout:
    return cgroups.Layout(
        "v1",
        {
            "memory": f"{top}/memory/agent",
            "pids": f"{top}/pids",
            "cpuset": f"{top}/cpuset",
            "cpu": f"{top}/cpu,cpuacct",
        },
    )


def v2(top: Path) -> cgroups.Layout:
    base = f"{top}/unified/system.slice"
    return cgroups.Layout("v2", {c: base for c in ("memory", "pids", "cpuset", "cpu")})


def test_node_roots_are_one_per_hierarchy_deepest_first(tmp_path: Path) -> None:
    t = str(tmp_path)
    assert cgroups.node_roots(v1(tmp_path), NAME) == [
        f"{t}/memory/agent/phalanx/{NAME}",
        f"{t}/cpu,cpuacct/phalanx/{NAME}",
        f"{t}/cpuset/phalanx/{NAME}",
        f"{t}/pids/phalanx/{NAME}",
    ]
    assert cgroups.node_roots(v2(tmp_path), NAME) == [f"{t}/unified/system.slice/phalanx/{NAME}"]
    assert cgroups.node_roots(cgroups.Layout("none"), NAME) == []


def test_removal_order_puts_children_before_parents() -> None:
    dirs = ["/c/phalanx", "/c/phalanx/n-1/7", "/c/phalanx/n-1", "/c/phalanx/n-1/"]
    assert cgroups.removal_order(dirs) == ["/c/phalanx/n-1/7", "/c/phalanx/n-1", "/c/phalanx"]


def test_only_a_nodes_own_root_counts_as_one() -> None:
    assert cgroups.is_node_root(f"/sys/fs/cgroup/pids/phalanx/{NAME}", NAME)
    assert cgroups.is_node_root(f"/sys/fs/cgroup/pids/phalanx/{NAME}/", NAME)
    assert not cgroups.is_node_root("/sys/fs/cgroup/pids/phalanx", NAME)
    assert not cgroups.is_node_root(f"/sys/fs/cgroup/pids/phalanx/{NAME}/12", NAME)
    assert not cgroups.is_node_root("/sys/fs/cgroup/pids/phalanx/node01-99999999", NAME)
    assert not cgroups.is_node_root(f"pids/phalanx/{NAME}", NAME)  # relative
    assert not cgroups.is_node_root(f"/x/../phalanx/{NAME}", NAME)
    assert not cgroups.is_node_root("/x/phalanx/", "")


def test_merge_keeps_roots_recorded_before_and_drops_foreign_paths() -> None:
    old = [f"/a/phalanx/{NAME}", "/etc", f"/b/phalanx/{NAME}/5"]
    new = [f"/c/d/phalanx/{NAME}", f"/a/phalanx/{NAME}"]
    assert cgroup_roots.merge(old, new, NAME) == [f"/c/d/phalanx/{NAME}", f"/a/phalanx/{NAME}"]


def test_remove_empty_removes_only_empty_directories(tmp_path: Path) -> None:
    empty, busy, gone = (tmp_path / n / "phalanx" / NAME for n in ("a", "b", "c"))
    empty.mkdir(parents=True)
    (busy / "17").mkdir(parents=True)  # an attempt's cgroup: the root must stay
    removed, kept = cgroups.remove_empty([str(busy), str(empty), str(gone)])
    assert sorted(removed) == sorted([str(empty), str(gone)])
    assert kept == [str(busy)]
    assert not empty.exists() and (busy / "17").is_dir()
    assert (tmp_path / "a" / "phalanx").is_dir(), "the shared parent is not touched"


def test_record_then_release(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    layout = v1(tmp_path / "cg")
    name = cgroup_roots.cgroup_name("node01", state)
    assert cgroup_roots.record(state, layout, name) == cgroups.node_roots(layout, name)
    for d in cgroups.node_roots(layout, name):
        os.makedirs(d)
    busy = cgroups.node_dirs(layout, name)["pids"]
    os.mkdir(f"{busy}/42")

    assert cgroup_roots.release(state, name) == [busy]
    assert [d for d in cgroups.node_roots(layout, name) if os.path.isdir(d)] == [busy]
    assert cgroup_roots.recorded(state, name) == cgroups.node_roots(layout, name)

    # an agent restarted from another cgroup adds its roots to those remembered
    other = v2(tmp_path / "cg2")
    both = cgroup_roots.record(state, other, name)
    assert set(both) == {*cgroups.node_roots(layout, name), *cgroups.node_roots(other, name)}

    os.rmdir(f"{busy}/42")
    assert cgroup_roots.release(state, name) == []
    assert not os.path.isdir(busy)
    # remembered still: a root made again after the stop (a late launch) is found and removed
    os.makedirs(busy)
    assert cgroup_roots.release(state, name) == []
    assert not os.path.isdir(busy)
    assert cgroup_roots.release(tmp_path, name) == [], "nothing remembered: nothing to do"


def test_a_damaged_record_names_nothing(tmp_path: Path) -> None:
    (tmp_path / cgroup_roots.ROOTS_FILE).write_text('{"roots": ["/tmp", 3, "/x/phalanx/other"]}')
    assert cgroup_roots.recorded(tmp_path, NAME) == []
    (tmp_path / cgroup_roots.ROOTS_FILE).write_text("not json")
    assert cgroup_roots.recorded(tmp_path, NAME) == []


def test_ended_attempts_are_those_without_a_live_task(tmp_path: Path) -> None:
    root = tmp_path / "pids" / "phalanx" / NAME
    tasks = tmp_path / "tasks"
    for aid in ("7", "8", "9"):
        (root / aid).mkdir(parents=True)
    (root / "not-an-attempt").mkdir()
    (tasks / "8").mkdir(parents=True)
    (tasks / "8" / "exit.json").write_text('{"exit_code": 0}')
    (tasks / "9").mkdir()
    (tasks / "9" / "shepherd.pid").write_text(f'{{"pid": {os.getpid()}}}')  # alive: running
    ended = cgroup_roots.ended_attempts([str(root)], tasks)
    assert ended == {"7": [f"{root}/7"], "8": [f"{root}/8"]}
