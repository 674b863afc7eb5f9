"""cgroups.py over fake directory trees: backend detection, plans, setup, removal.

The trees mimic a v1 host (one hierarchy per controller) and a v2 host (one unified hierarchy)
in tmp_path; mountinfo and /proc/self/cgroup texts point at them.  Kernel behaviour (limits
enforced, OOM kills) is for the system tests; here it is what gets written where.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from phalanx.agent import cgroups
from phalanx.agent.health import IsolationCheck, Status

# The interface files a new cgroup comes with (the union of v1's and v2's: the fake kernel
# does not care which hierarchy); swap accounting files only where a test adds them.
KERNEL_FILES = {
    "cgroup.procs",
    "tasks",
    "cgroup.controllers",
    "cgroup.subtree_control",
    "memory.max",
    "memory.events",
    "memory.limit_in_bytes",
    "memory.oom_control",
    "pids.max",
    "cpuset.cpus",
    "cpuset.mems",
    "cpu.max",
    "cpu.cfs_quota_us",
    "cpu.cfs_period_us",
    "devices.deny",
}


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """mkdir in the fake tree makes a cgroup's interface files, as the kernel would; the test
    may add names to the returned set first."""
    files = set(KERNEL_FILES)
    real = cgroups._mkdir

    def mkdir(d: str) -> bool:
        made = real(d)
        if made:
            for name in files:
                Path(d, name).touch()
        return made

    monkeypatch.setattr(cgroups, "_mkdir", mkdir)
    return files


def v1_tree(
    root: Path, *, controllers: tuple[str, ...] = ("memory", "pids", "cpuset", "cpu", "devices")
) -> tuple[str, str]:
    """A v1 host: each controller mounted at root/<name>, this process in /agent.slice for
    memory and at the root elsewhere.  Returns (mountinfo, proc_cgroup)."""
    mounts, procs = [], []
    for i, c in enumerate(controllers):
        (root / c).mkdir(parents=True)
        mounts.append(f"{30 + i} 20 0:{30 + i} / {root / c} rw,relatime - cgroup cgroup rw,{c}")
        path = "/agent.slice" if c == "memory" else "/"
        procs.append(f"{i + 1}:{c}:{path}")
        (root / c / path.strip("/")).mkdir(parents=True, exist_ok=True)
    if "cpuset" in controllers:
        (root / "cpuset" / "cpuset.cpus").write_text("0-3\n")
        (root / "cpuset" / "cpuset.mems").write_text("0\n")
    # an unrelated named hierarchy and a v2 mount without memory/pids (a hybrid host)
    (root / "unified").mkdir()
    (root / "unified" / "cgroup.controllers").write_text("\n")
    mounts.append(f"50 20 0:50 / {root / 'unified'} rw - cgroup2 cgroup2 rw")
    mounts.append(f"51 20 0:51 / {root / 'systemd'} rw - cgroup cgroup rw,name=systemd")
    procs += ["9:name=systemd:/", "0::/"]
    return "\n".join(mounts) + "\n", "\n".join(procs) + "\n"


def v2_tree(
    root: Path,
    *,
    controllers: str = "cpuset cpu io memory pids",
    own: str = "/agent.slice/agent.service",
) -> tuple[str, str]:
    """A pure v2 host mounted at root, this process in `own`."""
    me = root / own.strip("/")
    me.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (me.parent / "cgroup.subtree_control").write_text(controllers + "\n")
    (me / "cgroup.controllers").write_text(controllers + "\n")
    mountinfo = f"31 23 0:28 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    return mountinfo, f"0::{own}\n"


# -- detection ---------------------------------------------------------------------------------


def test_v1_host_with_a_controllerless_v2_mount_uses_v1(tmp_path: Path) -> None:
    layout = cgroups.detect(*v1_tree(tmp_path))
    assert layout.backend == "v1" and layout.usable
    assert layout.bases["memory"] == str(tmp_path / "memory" / "agent.slice")  # nested in ours
    assert layout.bases["pids"] == str(tmp_path / "pids")
    assert (layout.cpuset_cpus, layout.cpuset_mems) == ("0-3", "0")
    assert "cgroup v1" in layout.describe() and "memory" in layout.describe()


def test_v2_with_memory_and_pids_goes_under_the_agents_parent(tmp_path: Path) -> None:
    layout = cgroups.detect(*v2_tree(tmp_path))
    assert layout.backend == "v2" and layout.usable
    assert set(layout.bases.values()) == {str(tmp_path / "agent.slice")}
    assert set(layout.controllers) == {"memory", "pids", "cpuset", "cpu"}


def test_v2_agent_in_the_root_puts_jobs_under_the_root(tmp_path: Path) -> None:
    layout = cgroups.detect(*v2_tree(tmp_path, own="/"))
    assert set(layout.bases.values()) == {str(tmp_path)}


def test_v2_without_memory_falls_back_to_v1_and_else_says_what_is_missing(tmp_path: Path) -> None:
    mountinfo, procs = v2_tree(tmp_path / "v2", controllers="cpu io")
    layout = cgroups.detect(mountinfo, procs)
    assert not layout.usable and layout.backend == "none"
    assert layout.missing == ("memory", "pids")
    assert layout.problem.startswith("no usable cgroup controller for memory, pids")
    assert "cgroup v2 looked at" in layout.problem and "lacks memory, pids" in layout.problem


def test_v1_without_pids_is_not_usable(tmp_path: Path) -> None:
    layout = cgroups.detect(*v1_tree(tmp_path, controllers=("memory", "cpu")))
    assert not layout.usable and layout.missing == ("pids",)
    assert "(cgroup v1 and v2 looked at)" in layout.problem


def test_nothing_mounted(tmp_path: Path) -> None:
    layout = cgroups.detect("", "")
    assert not layout.usable and "no cgroup mounted" in layout.problem


# -- CPUs --------------------------------------------------------------------------------------


def test_pick_cpus_prefers_unused_cpus() -> None:
    assert cgroups.pick_cpus([0, 1, 2, 3], [], 1) == [0]
    assert cgroups.pick_cpus([0, 1, 2, 3], [[0], [1]], 2) == [2, 3]
    assert cgroups.pick_cpus([0, 1, 2, 3], [[0, 1, 2]], 1) == [3]


def test_pick_cpus_shares_when_the_node_advertises_more_than_the_host_has() -> None:
    # a 4-cpu node on a 2-core host: the third 1-cpu job shares, never gets two CPUs
    assert cgroups.pick_cpus([0, 1], [[0], [1]], 1) == [0]
    assert cgroups.pick_cpus([0, 1], [[0], [1], [0]], 1) == [1]
    assert cgroups.pick_cpus([0, 1], [], 4) == [0, 1]  # at most the host's CPUs
    assert cgroups.pick_cpus([], [], 1) == []


def test_cpu_list_format() -> None:
    assert cgroups.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cgroups.cpu_list([3]) == "3"


def test_gpu_denials_deny_every_gpu_not_given() -> None:
    devs = [(0, 195, 0), (1, 195, 1), (2, 195, 2)]
    assert cgroups.gpu_denials(devs, [1]) == ["c 195:0 rwm", "c 195:2 rwm"]
    assert cgroups.gpu_denials(devs, [0, 1, 2]) == []


# -- plans and setup ---------------------------------------------------------------------------


def test_v1_plan_and_setup(tmp_path: Path, kernel: set[str]) -> None:
    kernel.add("memory.memsw.limit_in_bytes")
    layout = cgroups.ensure_parents(cgroups.detect(*v1_tree(tmp_path)), "node01")
    assert layout.usable
    node_cpuset = tmp_path / "cpuset" / "phalanx" / "node01"
    assert (node_cpuset / "cpuset.cpus").read_text() == "0-3"  # copied down from the base
    assert (node_cpuset / "cpuset.mems").read_text() == "0"
    p = cgroups.plan(
        layout,
        "node01",
        17,
        mem_bytes=50 << 20,
        pids_max=64,
        cpus=[2],
        cpu_count=1,
        gpu_deny=["c 195:0 rwm"],
    )
    assert p is not None and p["backend"] == "v1"
    mem = tmp_path / "memory" / "agent.slice" / "phalanx" / "node01" / "17"
    assert str(mem) in p["dirs"] and p["oom"] == f"{mem}/memory.oom_control"
    assert len(p["procs"]) == 4  # no cpu hierarchy: the cpuset is the limit
    cgroups.setup(p)
    assert (mem / "memory.limit_in_bytes").read_text() == str(50 << 20)
    assert (mem / "memory.memsw.limit_in_bytes").read_text() == str(50 << 20)
    assert (tmp_path / "pids" / "phalanx" / "node01" / "17" / "pids.max").read_text() == "64"
    cs = tmp_path / "cpuset" / "phalanx" / "node01" / "17"
    assert (cs / "cpuset.cpus").read_text() == "2" and (cs / "cpuset.mems").read_text() == "0"
    dev = tmp_path / "devices" / "phalanx" / "node01" / "17" / "devices.deny"
    assert dev.read_text() == "c 195:0 rwm"
    # no quota where there is a cpuset
    assert not (tmp_path / "cpu" / "phalanx" / "node01" / "17").exists()  # no quota needed
    # the shepherd's child joins through each hierarchy's `tasks`, as itself ("0")
    cgroups.attach_self(p)
    assert [Path(d, "tasks").read_text() for d in p["dirs"]] == ["0"] * 4
    assert all(Path(d, "cgroup.procs").read_text() == "" for d in p["dirs"])


def test_v2_plan_and_setup(tmp_path: Path, kernel: set[str]) -> None:
    layout = cgroups.ensure_parents(cgroups.detect(*v2_tree(tmp_path)), "node01")
    assert layout.usable
    base = tmp_path / "agent.slice"
    for d in (base, base / "phalanx", base / "phalanx" / "node01"):
        enabled = (d / "cgroup.subtree_control").read_text().split()
        assert {"+memory", "+pids", "+cpuset", "+cpu"} <= set(enabled), d
    p = cgroups.plan(layout, "node01", 5, mem_bytes=1 << 30, pids_max=100, cpus=[0, 1], cpu_count=2)
    assert p is not None
    leaf = base / "phalanx" / "node01" / "5"
    assert p["dirs"] == [str(leaf)] and p["procs"] == [f"{leaf}/cgroup.procs"]
    assert p["oom"] == f"{leaf}/memory.events"
    cgroups.setup(p)  # memory.swap.max absent (no swap accounting): skipped
    assert (leaf / "memory.max").read_text() == str(1 << 30)
    assert not (leaf / "memory.swap.max").exists()
    assert (leaf / "pids.max").read_text() == "100"
    assert (leaf / "cpuset.cpus").read_text() == "0-1"
    cgroups.attach(p, 4242)
    assert (leaf / "cgroup.procs").read_text() == "4242"
    # cgroupfs takes each write on its own (no truncation, as `_write` opens it); this plain
    # file would keep 4242's tail after a shorter pid, so it is emptied first
    (leaf / "cgroup.procs").write_text("")
    cgroups.attach_self(p)  # v2 takes whole processes only: cgroup.procs, by pid
    assert (leaf / "cgroup.procs").read_text() == str(os.getpid())
    assert (leaf / "tasks").read_text() == ""


def test_v2_without_cpuset_gets_a_cpu_quota(tmp_path: Path) -> None:
    layout = cgroups.detect(*v2_tree(tmp_path, controllers="cpu memory pids"))
    p = cgroups.plan(layout, "n1", 1, mem_bytes=None, pids_max=None, cpus=[0], cpu_count=1.5)
    assert p is not None
    assert [w[:2] for w in p["writes"]] == [
        [str(tmp_path / "agent.slice/phalanx/n1/1/cpu.max"), "150000 100000"]
    ]


def test_v1_without_cpuset_gets_a_cfs_quota(tmp_path: Path) -> None:
    layout = cgroups.detect(*v1_tree(tmp_path, controllers=("memory", "pids", "cpu")))
    p = cgroups.plan(layout, "n1", 1, mem_bytes=None, pids_max=None, cpus=[0], cpu_count=2)
    assert p is not None
    cpu = tmp_path / "cpu" / "phalanx" / "n1" / "1"
    assert [w[:2] for w in p["writes"]] == [
        [f"{cpu}/cpu.cfs_period_us", "100000"],
        [f"{cpu}/cpu.cfs_quota_us", "200000"],
    ]


def test_no_plan_without_a_usable_backend() -> None:
    layout = cgroups.Layout("none", missing=cgroups.REQUIRED, problem="nothing")
    assert cgroups.plan(layout, "n", 1, mem_bytes=1, pids_max=1, cpus=[0], cpu_count=1) is None


def test_setup_reports_the_file_that_failed(tmp_path: Path, kernel: set[str]) -> None:
    kernel.discard("memory.max")
    layout = cgroups.detect(*v2_tree(tmp_path))
    p = cgroups.plan(layout, "n1", 9, mem_bytes=1 << 20, pids_max=None, cpus=[], cpu_count=1)
    assert p is not None
    with pytest.raises(cgroups.CgroupError, match=r"cannot open .*memory\.max"):
        cgroups.setup(p)  # parents made on the way (no agent set them up), memory.max absent
    assert (tmp_path / "agent.slice" / "phalanx" / "n1" / "9").is_dir()


def test_oom_kills_reads_v1_and_v2_counters(tmp_path: Path) -> None:
    v2 = tmp_path / "memory.events"
    v2.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    assert cgroups.oom_kills({"oom": str(v2)}) == 2
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert cgroups.oom_kills({"oom": str(v1)}) == 1
    assert cgroups.oom_kills({"oom": str(tmp_path / "absent")}) is None


def test_remove_takes_empty_cgroups_away_and_reports_busy_ones(tmp_path: Path) -> None:
    gone = tmp_path / "a"
    gone.mkdir()
    busy = tmp_path / "b"
    busy.mkdir()
    (busy / "cgroup.procs").write_text("")  # a real cgroup's files do not block rmdir; these do
    assert cgroups.remove({"dirs": [str(gone), str(busy), str(tmp_path / "never")]}, 0.05) == [
        str(busy)
    ]
    assert not gone.exists()


# -- the health check --------------------------------------------------------------------------


def test_isolation_check_follows_require_cgroups() -> None:
    required = [True]
    missing = IsolationCheck(
        lambda: (
            False,
            "no usable cgroup controller for memory, pids (cgroup v1 and v2 looked at)",
        ),
        lambda: required[0],
    )
    r = missing.run()
    assert r.status is Status.FAIL
    assert r.reason == (
        "no usable cgroup controller for memory, pids (cgroup v1 and v2 looked at): jobs cannot "
        "be contained; set [isolation] require_cgroups = false to run them anyway"
    )
    required[0] = False
    r = missing.run()
    assert r.status is Status.OK and "uncontained" in r.reason
    ok = IsolationCheck(lambda: (True, "cgroup v1 (memory, pids)"), lambda: True).run()
    assert ok.status is Status.OK and ok.reason == "jobs contained by cgroup v1 (memory, pids)"
