"""Job containment with cgroups (docs/isolation.md): detect, plan, set up, attach, remove.

Stdlib only and cheap to import (``os`` and ``errno``): the shepherd imports it for every job.

Three layers, kept apart so the decisions can be tested over fake directory trees:

* **Detection** (:func:`detect`): which backend this host offers, read from
  ``/proc/self/mountinfo``, ``/proc/self/cgroup`` and the hierarchies themselves.  cgroup v2
  (one unified hierarchy) is used when memory and pids are available there; else v1 (one
  hierarchy per controller) when its memory and pids hierarchies are mounted; else none.
  The result is a :class:`Layout`: the backend, the directory per controller under which the
  agent puts ``phalanx/<node>/``, and what is missing and why.
* **Planning** (:func:`plan`, pure): for one attempt, the directories to create, the files to
  write (memory limit, pids limit, CPU set or quota, device rules), where to attach the job's
  pid and where to read its OOM kills.  A plan is plain JSON data: the agent puts it into the
  task's ``spec.json``, so a restarted agent (or the shepherd, or a cleanup after the agent was
  down) knows the attempt's cgroups without deciding again.
* **Execution** (:func:`setup`, :func:`attach`, :func:`oom_kills`, :func:`remove`): the few
  syscalls that carry out a plan, run by the shepherd (and by the agent for cleanups).

Where the cgroups live: ``<base>/phalanx/<node>/<attempt-id>``, where the agent passes as
``node`` its node name plus a hash of its state dir (``node01-1a2b3c4d``): several agents of a
local cluster share one host, and so may several local clusters with the same node names, and
each agent must sweep only its own.  On v1 ``<base>`` is the agent's own
cgroup in each hierarchy (jobs stay inside whatever the agent itself was given).  On v2 a
cgroup holding processes cannot hand controllers to children, so ``<base>`` is the parent of
the agent's cgroup (or the root, when the agent runs there); see :func:`detect`.
"""

from __future__ import annotations

import errno
import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from typing import Any

__all__ = [
    "REQUIRED",
    "CgroupError",
    "Layout",
    "attach",
    "detect",
    "ensure_parents",
    "is_node_root",
    "node_roots",
    "oom_kills",
    "pick_cpus",
    "plan",
    "removal_order",
    "remove",
    "remove_empty",
    "setup",
    "usage",
]

# Controllers without which a job is not contained (a runaway allocation or fork bomb would
# harm the node); cpu/cpuset/devices are used where present.
REQUIRED = ("memory", "pids")
_OPTIONAL_V2 = ("cpuset", "cpu")
_V1 = ("memory", "pids", "cpuset", "cpu", "devices")
CPU_PERIOD_US = 100_000
_REMOVE_TIMEOUT_S = 10.0


class CgroupError(OSError):
    """A cgroup step failed; the message says which file and why (``errno`` is the cause's)."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = code


# --------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------


class Layout:
    """What this host offers: ``backend`` is "v2", "v1" or "none".

    ``bases`` maps each usable controller to the directory under which ``phalanx/`` goes (v2:
    every controller shares one directory).  ``missing`` names required controllers that are
    not usable and ``problem`` says why (empty when the backend is usable).  ``cpuset_cpus`` /
    ``cpuset_mems`` are the base's (v1 needs them copied into every new cpuset cgroup).
    """

    def __init__(
        self,
        backend: str,
        bases: dict[str, str] | None = None,
        *,
        missing: tuple[str, ...] = (),
        problem: str = "",
        cpuset_cpus: str = "",
        cpuset_mems: str = "",
    ) -> None:
        self.backend = backend
        self.bases = dict(bases or {})
        self.missing = missing
        self.problem = problem
        self.cpuset_cpus = cpuset_cpus
        self.cpuset_mems = cpuset_mems

    @property
    def usable(self) -> bool:
        return self.backend in ("v1", "v2") and not self.missing

    @property
    def controllers(self) -> list[str]:
        return [c for c in (*REQUIRED, *_OPTIONAL_V2, "devices") if c in self.bases]

    def describe(self) -> str:
        """One line for logs and the health check."""
        if not self.usable:
            return self.problem or "no usable cgroup controller"
        where = sorted(set(self.bases.values()))
        return f"cgroup {self.backend} ({', '.join(self.controllers)}) under {', '.join(where)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "bases": self.bases,
            "missing": list(self.missing),
            "problem": self.problem,
            "cpuset_cpus": self.cpuset_cpus,
            "cpuset_mems": self.cpuset_mems,
        }


def parse_mountinfo(text: str) -> list[tuple[str, str, str, set[str]]]:
    """(mount point, fs type, root within the fs, super options) of cgroup mounts."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append((point, rfields[0], fields[3], set(rfields[2].split(","))))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Controller -> this process's cgroup path ("" is the v2 hierarchy)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            out[""] = parts[2]
        for c in parts[1].split(","):
            if c and not c.startswith("name="):
                out[c] = parts[2]
    return out


def _join(mount: str, mount_root: str, path: str) -> str:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount`` (fs root ``mount_root``)."""
    if mount_root not in ("", "/") and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root) :]
    return (mount.rstrip("/") + "/" + path.strip("/")).rstrip("/") or "/"


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read().strip()


def detect(mountinfo: str | None = None, proc_cgroup: str | None = None) -> Layout:
    """The best backend here (v2 with memory+pids, else v1 with memory+pids, else none).

    v2: with the agent in cgroup C, jobs go under C's parent when C is not the root and the
    parent hands memory and pids to its children (they are in C's ``cgroup.controllers``);
    under C itself when C is the root (the root may hold processes and enable controllers).
    Reading only: :func:`ensure_parents` creates and configures ``phalanx/<node>``.
    """
    if mountinfo is None:
        mountinfo = _read("/proc/self/mountinfo")
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup")
    mounts = parse_mountinfo(mountinfo)
    own = parse_proc_cgroup(proc_cgroup)
    looked: list[str] = []
    v2_problem = ""
    for point, fstype, mroot, _opts in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        looked.append("v2")
        me = _join(point, mroot, own[""])
        try:
            mine = set(_read(me + "/cgroup.controllers").split())
        except OSError as e:
            v2_problem = f"cgroup v2: cannot read {me}/cgroup.controllers: {e.strerror or e}"
            continue
        at_root = me.rstrip("/") == point.rstrip("/")
        base = me if at_root else os.path.dirname(me)
        lacking = tuple(c for c in REQUIRED if c not in mine)
        if lacking:
            v2_problem = f"cgroup v2 at {point} lacks {', '.join(lacking)}"
            continue
        bases = {c: base for c in (*REQUIRED, *_OPTIONAL_V2) if c in mine}
        return Layout("v2", bases)
    bases = {}
    for point, fstype, mroot, opts in mounts:
        if fstype != "cgroup":
            continue
        for c in _V1:
            if c in opts and c in own and c not in bases:
                bases[c] = _join(point, mroot, own[c])
    if bases:
        looked.append("v1")
    missing = tuple(c for c in REQUIRED if c not in bases)
    cpus = mems = ""
    if "cpuset" in bases:
        try:
            cpus = _read(bases["cpuset"] + "/cpuset.cpus")
            mems = _read(bases["cpuset"] + "/cpuset.mems")
        except OSError:
            del bases["cpuset"]
    if not missing:
        return Layout("v1", bases, cpuset_cpus=cpus, cpuset_mems=mems)
    seen = f"cgroup {' and '.join(sorted(looked))} looked at" if looked else "no cgroup mounted"
    problem = f"no usable cgroup controller for {', '.join(missing)} ({seen})"
    if v2_problem:
        problem += f"; {v2_problem}"
    return Layout("none", {}, missing=missing, problem=problem)


def node_dirs(layout: Layout, node: str) -> dict[str, str]:
    """Controller -> ``<base>/phalanx/<node>``."""
    return {c: f"{b.rstrip('/')}/phalanx/{node}" for c, b in layout.bases.items()}


def removal_order(dirs: Iterable[str]) -> list[str]:
    """``dirs`` once each, children before parents (pure): a cgroup can only be removed once
    nothing is below it, so the deepest paths come first (ties by name, for a stable order)."""
    unique = {d.rstrip("/") or "/" for d in dirs}
    return sorted(unique, key=lambda d: (-d.count("/"), d))


def node_roots(layout: Layout, node: str) -> list[str]:
    """The agent's own ``<base>/phalanx/<node>`` directories, each once (v2: one for every
    controller), in :func:`removal_order` (pure).  Never the shared ``phalanx`` above them:
    other agents' roots live there, and one agent removing it while another is between making
    ``phalanx`` and its own root would leave that one without containment."""
    return removal_order(node_dirs(layout, node).values())


def is_node_root(path: str, node: str) -> bool:
    """``path`` is an absolute ``.../phalanx/<node>`` (pure): what a remembered root must look
    like before it is removed, so a damaged record never names another directory."""
    parts = path.rstrip("/").split("/")
    return (
        path.startswith("/")
        and len(parts) >= 3
        and parts[-2:] == ["phalanx", node]
        and ".." not in parts
        and bool(node)
    )


def parent_steps(layout: Layout, node: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(directory, writes) to create ``phalanx`` and ``phalanx/<node>``, top-down (pure).

    v2: each level hands the controllers down (``cgroup.subtree_control``), starting at the
    base.  v1 cpuset: a new cgroup starts with no CPUs and no memory nodes, so the base's are
    copied down.
    """
    steps: list[tuple[str, list[tuple[str, str]]]] = []
    if layout.backend == "v2":
        base = next(iter(layout.bases.values()))
        enable = " ".join("+" + c for c in layout.controllers)
        steps.append((base, [("cgroup.subtree_control", enable)]))
        for d in (f"{base.rstrip('/')}/phalanx", f"{base.rstrip('/')}/phalanx/{node}"):
            steps.append((d, [("cgroup.subtree_control", enable)]))
        return steps
    by_dir: dict[str, set[str]] = {}
    for c, base in layout.bases.items():
        for d in (f"{base.rstrip('/')}/phalanx", f"{base.rstrip('/')}/phalanx/{node}"):
            by_dir.setdefault(d, set()).add(c)
    for d, controllers in by_dir.items():  # insertion order: each "phalanx" before its node
        writes = []
        if "cpuset" in controllers:
            writes = [("cpuset.cpus", layout.cpuset_cpus), ("cpuset.mems", layout.cpuset_mems)]
        steps.append((d, writes))
    return steps


def ensure_parents(layout: Layout, node: str) -> Layout:
    """Create and configure ``phalanx/<node>`` in every hierarchy; return the layout, or a
    "none" layout saying what failed (not root, a read-only cgroupfs, v2 controllers that
    cannot be enabled)."""
    if not layout.usable:
        return layout
    try:
        for d, writes in parent_steps(layout, node):
            _mkdir(d)
            for name, value in writes:
                _write(f"{d}/{name}", value)
    except OSError as e:
        return Layout(
            "none",
            {},
            missing=REQUIRED,
            problem=f"cgroup {layout.backend} found but not usable: {e}",
        )
    return layout


# --------------------------------------------------------------------------------------------
# Planning (pure)
# --------------------------------------------------------------------------------------------


def pick_cpus(pool: list[int], in_use: list[list[int]], count: int) -> list[int]:
    """The host CPUs for an attempt that needs ``count`` CPUs (pure).

    ``pool`` is the agent's CPUs (its affinity, at most as many as the node advertises);
    ``in_use`` the CPU lists of its other running attempts.  Takes the ``count`` least-used
    CPUs of the pool (ties: lowest id first), so attempts get CPUs nobody else on the node uses
    while there are any.  When the node advertises more CPUs than the host has, attempts
    share: never more than ``len(pool)`` CPUs, always exactly ``min(count, len(pool))``.
    """
    if not pool:
        return []
    load = {c: 0 for c in pool}
    for cpus in in_use:
        for c in cpus:
            if c in load:
                load[c] += 1
    order = sorted(pool, key=lambda c: (load[c], c))
    return sorted(order[: max(1, min(count, len(order)))])


def cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's list format)."""
    out: list[str] = []
    for c in sorted(set(cpus)):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def gpu_denials(devices: list[tuple[int, int, int]], allowed: list[int]) -> list[str]:
    """v1 ``devices.deny`` lines for GPU device files the attempt was not given (pure).

    ``devices``: (index, major, minor) of each ``/dev/nvidiaN``.  The control devices
    (``/dev/nvidiactl``, ``nvidia-uvm``) stay usable; CUDA needs them.
    """
    keep = {int(g) for g in allowed}
    return [f"c {major}:{minor} rwm" for idx, major, minor in devices if idx not in keep]


def plan(
    layout: Layout,
    node: str,
    attempt: int | str,
    *,
    mem_bytes: int | None,
    pids_max: int | None,
    cpus: list[int],
    cpu_count: float,
    gpu_deny: Sequence[str] = (),
    required: bool = True,
) -> dict[str, Any] | None:
    """The cgroups of one attempt, as JSON data (see the module docstring); None without a
    usable backend.

    ``mem_bytes``: hard memory limit (swap included); ``pids_max``: most tasks; ``cpus``: the
    host CPUs it may run on (a cpuset where the controller is there); ``cpu_count``: the CPUs
    it was allocated, a CFS quota when there is no cpuset controller; ``gpu_deny``: v1
    ``devices.deny`` lines.  Writes whose file may not exist on every kernel are optional
    (the third element is true).
    """
    if not layout.usable:
        return None
    dirs: dict[str, str] = {}
    for c, d in node_dirs(layout, node).items():
        dirs[c] = f"{d}/{attempt}"
    writes: list[list[Any]] = []
    v2 = layout.backend == "v2"
    if mem_bytes:
        m = dirs["memory"]
        if v2:
            writes += [[f"{m}/memory.max", str(mem_bytes), False]]
            writes += [[f"{m}/memory.swap.max", "0", True]]
        else:
            writes += [[f"{m}/memory.limit_in_bytes", str(mem_bytes), False]]
            writes += [[f"{m}/memory.memsw.limit_in_bytes", str(mem_bytes), True]]
    if pids_max:
        writes.append([f"{dirs['pids']}/pids.max", str(int(pids_max)), False])
    if cpus and "cpuset" in dirs:
        writes.append([f"{dirs['cpuset']}/cpuset.cpus", cpu_list(cpus), False])
        mems = layout.cpuset_mems
        if not v2 and mems:
            writes.append([f"{dirs['cpuset']}/cpuset.mems", mems, False])
    elif cpu_count and "cpu" in dirs:
        quota = max(1000, int(cpu_count * CPU_PERIOD_US))
        if v2:
            writes.append([f"{dirs['cpu']}/cpu.max", f"{quota} {CPU_PERIOD_US}", False])
        else:
            writes.append([f"{dirs['cpu']}/cpu.cfs_period_us", str(CPU_PERIOD_US), False])
            writes.append([f"{dirs['cpu']}/cpu.cfs_quota_us", str(quota), False])
    if not v2 and "devices" in dirs:
        for line in gpu_deny:
            writes.append([f"{dirs['devices']}/devices.deny", line, False])
    # only the hierarchies the attempt is limited in (each costs a mkdir, an attach, an rmdir)
    used = {path.rsplit("/", 1)[0] for path, _v, _o in writes}
    used |= {dirs[c] for c in REQUIRED}
    unique = sorted(used)
    return {
        "backend": layout.backend,
        "dirs": unique,
        "parents": [[d, [list(w) for w in ws]] for d, ws in parent_steps(layout, node)],
        "writes": writes,
        "procs": [f"{d}/cgroup.procs" for d in unique],
        "oom": f"{dirs['memory']}/memory.events" if v2 else f"{dirs['memory']}/memory.oom_control",
        "required": bool(required),
    }


# --------------------------------------------------------------------------------------------
# Execution
# --------------------------------------------------------------------------------------------


def _write(path: str, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        raise CgroupError(e.errno, f"cannot open {path}: {e.strerror}") from None
    try:
        os.write(fd, value.encode())
    except OSError as e:
        raise CgroupError(e.errno, f"cannot write {value!r} to {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def _mkdir(d: str) -> bool:
    """Create directory ``d``; False if it was there already."""
    try:
        os.mkdir(d, 0o755)
    except FileExistsError:
        return False
    return True


def _kill(pid: int, d: str) -> None:
    """SIGKILL ``pid`` if it is still in cgroup ``d``.

    The pid was read from ``cgroup.procs`` a moment ago; if that process has exited since, the
    pid may already belong to someone else (a fork bomb recycles pids fast).  A pidfd pins the
    process first, the check reads its cgroups, and the signal goes to the pinned process (to
    nobody if it has died meanwhile), so an unrelated process is never hit.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already (or no pidfds: then no kill without cgroup.kill)
        return
    try:
        suffix = "/phalanx/" + "/".join(d.rstrip("/").split("/")[-2:])
        try:
            with open(f"/proc/{pid}/cgroup", encoding="ascii", errors="replace") as f:
                mine = any(line.rstrip("\n").endswith(suffix) for line in f)
        except OSError:
            return
        if mine:
            try:
                _signal_pidfd(fd, 9)
            except OSError:
                return
    finally:
        os.close(fd)


def _signal_pidfd(fd: int, signum: int) -> None:
    try:
        import _signal as sig
    except ImportError:  # pragma: no cover - non-CPython
        import signal as sig
    sig.pidfd_send_signal(fd, signum)


def setup(p: dict[str, Any]) -> None:
    """Create the attempt's cgroups and write its limits (idempotent: a second run of the same
    plan rewrites the same values).  Missing parents are created first.  Raises
    :class:`CgroupError`."""
    for d in p["dirs"]:
        try:
            _mkdir(d)
        except FileNotFoundError:
            _make_parents(p)
            try:
                _mkdir(d)
            except OSError as e:
                raise CgroupError(e.errno, f"cannot create {d}: {e.strerror}") from None
        except OSError as e:
            raise CgroupError(e.errno, f"cannot create {d}: {e.strerror}") from None
    for path, value, optional in p["writes"]:
        if optional and not os.path.exists(path):
            continue
        _write(path, value)


def _make_parents(p: dict[str, Any]) -> None:
    for d, writes in p.get("parents") or ():
        try:
            if not _mkdir(d):
                continue  # already set up (by the agent at its start)
        except OSError as e:
            raise CgroupError(e.errno, f"cannot create {d}: {e.strerror}") from None
        for name, value in writes:
            _write(f"{d}/{name}", value)


def attach(p: dict[str, Any], pid: int) -> None:
    """Move ``pid`` into the attempt's cgroups (its children follow)."""
    text = str(pid)
    for path in p["procs"]:
        _write(path, text)


def attach_self(p: dict[str, Any]) -> None:
    """Move the calling process into the attempt's cgroups: a single-threaded one, the
    shepherd's child between its fork and its exec (its children follow).

    On v1 this writes ``0`` to each hierarchy's ``tasks``, which moves the calling thread
    alone: the kernel then skips the global lock that keeps a whole thread group still while
    it moves, whose write side waits for an RCU grace period whenever attaches are sporadic
    (~7 ms per attach on the development machine, whatever the number of hierarchies, and
    longer when several tasks start at once: the largest wait on a step's start, docs/slurm.md
    "What a step costs"); 0.4 ms here (bench/cgroup_attach.py).  A forked child has exactly
    one thread, so moving it moves the process.  v2's domain cgroups take whole processes only
    (``cgroup.procs``)."""
    if p.get("backend") == "v2":
        attach(p, os.getpid())
        return
    for d in p["dirs"]:
        _write(f"{d}/tasks", "0")


def oom_kills(p: dict[str, Any]) -> int | None:
    """How many processes the kernel's OOM killer killed in the attempt's memory cgroup
    (``memory.events`` on v2, ``memory.oom_control`` on v1), or None if unreadable."""
    try:
        with open(p["oom"], encoding="ascii") as f:
            for row in f:
                key, _, value = row.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None


def _read_int(path: str, key: str | None = None) -> int | None:
    """An integer file (``memory.peak``), or the value of ``key`` in a flat-keyed one
    (``cpu.stat``); None if absent or unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            if key is None:
                text = f.read().strip()
                return int(text) if text.isdigit() else None
            for row in f:
                k, _, value = row.partition(" ")
                if k == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None


def usage(p: dict[str, Any]) -> dict[str, Any]:
    """What the attempt's processes used, read from its cgroups before they are removed:
    ``cpu_s`` (user + system seconds, every process that ever ran in it) and
    ``max_rss_bytes`` (the memory high-water mark, page cache included, as the kernel
    counts it against the limit).  Keys are absent where this kernel does not keep the
    figure (``memory.peak`` needs Linux 5.19; v1 CPU time needs ``cpuacct`` beside ``cpu``)."""
    out: dict[str, Any] = {}
    mem_dir = os.path.dirname(p["oom"])
    if p.get("backend") == "v2":
        peak = _read_int(f"{mem_dir}/memory.peak")
        usec = _read_int(f"{mem_dir}/cpu.stat", "usage_usec")
        if usec is not None:
            out["cpu_s"] = usec / 1e6
    else:
        peak = _read_int(f"{mem_dir}/memory.max_usage_in_bytes")
        for d in p.get("dirs") or ():
            ns = _read_int(f"{d}/cpuacct.usage")
            if ns is not None:
                out["cpu_s"] = ns / 1e9
                break
    if peak is not None:
        out["max_rss_bytes"] = peak
    return out


def pids(d: str) -> list[int]:
    """The processes in cgroup directory ``d`` (empty if it does not exist)."""
    try:
        with open(f"{d}/cgroup.procs", encoding="ascii") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def remove_empty(dirs: Iterable[str]) -> tuple[list[str], list[str]]:
    """rmdir each of ``dirs`` in :func:`removal_order`, once, killing nothing: the kernel
    refuses (EBUSY) a cgroup that still holds processes or child cgroups, and so it stays.
    Returns (gone, kept): gone includes directories that were not there."""
    gone: list[str] = []
    kept: list[str] = []
    for d in removal_order(dirs):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError:  # EBUSY / ENOTEMPTY: in use; EACCES, EROFS: not ours to remove
            kept.append(d)
            continue
        gone.append(d)
    return gone, kept


def remove(p: dict[str, Any], timeout: float = _REMOVE_TIMEOUT_S) -> list[str]:
    """Kill whatever still runs in the attempt's cgroups, then remove them; retried until
    ``timeout`` (a cgroup is busy until its last process has exited).  Returns the
    directories that could not be removed (empty on success)."""
    left = list(p["dirs"])
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        still = []
        for d in left:
            if not os.path.isdir(d):
                continue
            kill = f"{d}/cgroup.kill"
            killed = False
            if os.path.exists(kill):
                try:
                    _write(kill, "1")
                    killed = True
                except OSError:
                    pass
            if not killed:
                for pid in pids(d):
                    _kill(pid, d)
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    still.append(d)  # unlikely (EACCES...): keep trying until the deadline
                    continue
                still.append(d)
        if not still or time.monotonic() >= deadline:
            return still
        left = still
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
