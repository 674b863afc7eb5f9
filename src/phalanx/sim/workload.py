"""A simulator workload: the cluster's node classes, its users and accounts, the jobs to
submit and the failures to inject, read from a TOML or JSON file (format: docs/sim.md).

Pure: parsing and expansion into job specs only; `phalanx sim` (sim/run.py) submits them and
the virtual nodes (sim/nodes.py) "run" them. A job's simulated run time travels in its own
command (`sleep D; exit E`), so the same workload also runs unchanged on real agents, and the
virtual nodes need nothing but the launch request the controller sends.
"""

from __future__ import annotations

import json
import random
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.domain.values import parse_memory_mb

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SLEEP = re.compile(r"\bsleep\s+([0-9]+(?:\.[0-9]+)?)")
_EXIT = re.compile(r"\bexit\s+([0-9]+)")


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the field and what to do."""


@dataclass(frozen=True)
class NodeClass:
    share: float  # fraction of the simulated nodes of this class
    cpus: int
    mem_mb: int
    gpus: int
    gpu_type: str
    features: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobKind:
    name: str
    count: int  # jobs (array tasks count one each)
    users: tuple[str, ...]
    nodes: int
    cpus: int  # per node
    mem_mb: int  # per node
    gpus_per_node: int
    gpu_type: str | None
    array: int  # tasks per array job; 0: plain jobs
    duration: tuple[float, float]  # simulated run time, uniform in [lo, hi] seconds
    time_limit_s: int
    exclusive: bool


@dataclass(frozen=True)
class Failures:
    task_fail_rate: float = 0.0  # fraction of jobs whose task exits 1
    node_stop_fraction: float = 0.0  # fraction of nodes that stop heartbeating
    node_stop_window: tuple[float, float] = (5.0, 30.0)  # when they stop (s after start)


@dataclass
class Workload:
    seed: int
    nodes: list[NodeClass]
    accounts: dict[str, str]  # user -> account
    kinds: list[JobKind]
    failures: Failures = field(default_factory=Failures)

    @property
    def total_jobs(self) -> int:
        return sum(k.count for k in self.kinds)

    def fairshare_config(self) -> dict[str, Any]:
        """The [fairshare] table for the cluster's config: one account per workload account,
        every user in theirs."""
        accounts = sorted(set(self.accounts.values()))
        return {
            "open": True,
            "accounts": [{"name": a} for a in accounts],
            "users": [{"name": u, "account": a} for u, a in sorted(self.accounts.items())],
        }

    def node_class(self, index: int, total: int) -> NodeClass:
        """The class of virtual node `index` of `total` (classes take consecutive blocks)."""
        start = 0
        for i, c in enumerate(self.nodes):
            n = round(c.share * total) if i < len(self.nodes) - 1 else total - start
            if index < start + n:
                return c
            start += n
        return self.nodes[-1]

    def submissions(self) -> list[tuple[str, dict[str, Any]]]:
        """(user, JobSpec body) for every submission, shuffled by the seed; an array is one
        submission of `array` tasks."""
        rng = random.Random(self.seed)
        out: list[tuple[str, dict[str, Any]]] = []
        for k in self.kinds:
            left = k.count
            while left > 0:
                tasks = min(k.array, left) if k.array else 1
                left -= tasks
                user = rng.choice(k.users)
                spec: dict[str, Any] = {
                    "name": k.name,
                    "nodes": k.nodes,
                    "cpus_per_task": k.cpus,
                    "mem_mb": k.mem_mb,
                    "time_limit_s": k.time_limit_s,
                    "account": self.accounts[user],
                    "exclusive": k.exclusive,
                    "workdir": "/tmp",
                    "output": "/dev/null",
                    "wrap": self._command(rng, k),
                }
                if k.gpus_per_node:
                    spec["gpus_per_node"] = k.gpus_per_node
                    if k.gpu_type:
                        spec["gpu_type"] = k.gpu_type
                if k.array:
                    spec["array"] = f"0-{tasks - 1}"
                out.append((user, spec))
        rng.shuffle(out)
        return out

    def _command(self, rng: random.Random, k: JobKind) -> str:
        d = rng.uniform(*k.duration)
        code = 1 if rng.random() < self.failures.task_fail_rate else 0
        return f"sleep {d:.3f}; exit {code}"


def run_of(command: dict[str, Any] | None, time_limit_s: float | None) -> tuple[float, int, bool]:
    """(seconds, exit code, timed out) a virtual node simulates for a launch's command: the
    `sleep D` and `exit E` in its script (sim workloads write them), else the job runs its
    whole time limit and is stopped by it, as a real shepherd would."""
    text = ""
    if command:
        text = str(command.get("script") or " ".join(map(str, command.get("argv") or [])))
    m = _SLEEP.search(text)
    e = _EXIT.search(text)
    code = int(e.group(1)) if e else 0
    if m:
        d = float(m.group(1))
        if time_limit_s is not None and d > time_limit_s:
            return float(time_limit_s), 0, True
        return d, code, False
    return float(time_limit_s or 3600), 0, True


# ------------------------------------------------------------------------ parsing


def load(path: Path) -> Workload:
    """Read a workload file (.toml, or .json); WorkloadError says what is wrong."""
    try:
        text = path.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read workload {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise WorkloadError(
            f"workload {path} is not valid {path.suffix[1:] or 'TOML'}: {e}"
        ) from None
    if not isinstance(data, dict):
        raise WorkloadError(f"workload {path}: the top level must be a table")
    return parse(data)


def _num(d: dict[str, Any], key: str, default: float, lo: float, hi: float, where: str) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise WorkloadError(f"{where}: {key} must be a number from {lo:g} to {hi:g}, not {v!r}")
    return float(v)


def _int(d: dict[str, Any], key: str, default: int, lo: int, hi: int, where: str) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise WorkloadError(f"{where}: {key} must be a whole number from {lo} to {hi}, not {v!r}")
    return v


def _mem(d: dict[str, Any], key: str, default: str, where: str) -> int:
    v = d.get(key, default)
    try:
        return parse_memory_mb(str(v))
    except ValueError as e:
        raise WorkloadError(f"{where}: {key}: {e}") from None


def _pair(v: Any, key: str, where: str) -> tuple[float, float]:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v), float(v)
    if (
        isinstance(v, list)
        and len(v) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        and 0 <= v[0] <= v[1]
    ):
        return float(v[0]), float(v[1])
    raise WorkloadError(f"{where}: {key} must be seconds or [low, high] seconds, not {v!r}")


_TOP = {"seed", "nodes", "users", "jobs", "failures"}


def parse(data: dict[str, Any]) -> Workload:
    extra = set(data) - _TOP
    if extra:
        raise WorkloadError(f"workload: unknown keys {sorted(extra)} (known: {sorted(_TOP)})")
    seed = _int(data, "seed", 1, 0, 2**31, "workload")
    nodes = [_node_class(i, d) for i, d in enumerate(_tables(data, "nodes"))] or [
        NodeClass(1.0, 64, 256_000, 0, "")
    ]
    total = sum(c.share for c in nodes)
    if total <= 0:
        raise WorkloadError("workload: the [[nodes]] shares must add up to more than 0")
    nodes = [NodeClass(c.share / total, *_rest(c)) for c in nodes]
    accounts: dict[str, str] = {}
    for i, u in enumerate(_tables(data, "users")):
        where = f"users[{i}]"
        name, acct = u.get("name"), u.get("account", "default")
        for what, v in (("name", name), ("account", acct)):
            if not isinstance(v, str) or not _NAME.match(v):
                raise WorkloadError(f"{where}: {what} must be a name like 'alice', not {v!r}")
        assert isinstance(name, str) and isinstance(acct, str)
        accounts[name] = acct
    if not accounts:
        accounts = {"simuser": "default"}
    kinds = [_kind(i, d, accounts) for i, d in enumerate(_tables(data, "jobs"))]
    if not kinds:
        raise WorkloadError("workload: no [[jobs]]: give at least one kind of job")
    f = data.get("failures", {})
    if not isinstance(f, dict):
        raise WorkloadError("workload: [failures] must be a table")
    failures = Failures(
        task_fail_rate=_num(f, "task_fail_rate", 0.0, 0.0, 1.0, "failures"),
        node_stop_fraction=_num(f, "node_stop_fraction", 0.0, 0.0, 1.0, "failures"),
        node_stop_window=_pair(
            f.get("node_stop_window", [5.0, 30.0]), "node_stop_window", "failures"
        ),
    )
    return Workload(seed, nodes, accounts, kinds, failures)


def _rest(c: NodeClass) -> tuple[int, int, int, str, tuple[str, ...]]:
    return c.cpus, c.mem_mb, c.gpus, c.gpu_type, c.features


def _tables(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    v = data.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise WorkloadError(f"workload: {key} must be a list of tables ([[{key}]] in TOML)")
    return v


def _node_class(i: int, d: dict[str, Any]) -> NodeClass:
    where = f"nodes[{i}]"
    feats = d.get("features", [])
    if not isinstance(feats, list) or not all(isinstance(x, str) for x in feats):
        raise WorkloadError(f"{where}: features must be a list of names")
    gtype = d.get("gpu_type", "gpu")
    if not isinstance(gtype, str) or not _NAME.match(gtype):
        raise WorkloadError(f"{where}: gpu_type must be a name like 'h100', not {gtype!r}")
    return NodeClass(
        share=_num(d, "share", 1.0, 0.0, 1e9, where),
        cpus=_int(d, "cpus", 64, 1, 100_000, where),
        mem_mb=_mem(d, "mem", "256G", where),
        gpus=_int(d, "gpus", 0, 0, 1024, where),
        gpu_type=gtype,
        features=tuple(feats),
    )


def _kind(i: int, d: dict[str, Any], accounts: dict[str, str]) -> JobKind:
    where = f"jobs[{i}]"
    users = d.get("users", d.get("user", sorted(accounts)))
    if isinstance(users, str):
        users = [users]
    if not isinstance(users, list) or not users or not all(u in accounts for u in users):
        raise WorkloadError(
            f"{where}: users must name users of [[users]] ({sorted(accounts)}), not {users!r}"
        )
    name = d.get("name", f"sim{i}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise WorkloadError(f"{where}: name must be a name like 'train', not {name!r}")
    gtype = d.get("gpu_type")
    if gtype is not None and (not isinstance(gtype, str) or not _NAME.match(gtype)):
        raise WorkloadError(f"{where}: gpu_type must be a name like 'h100', not {gtype!r}")
    time_limit = _int(d, "time_limit", 3600, 1, 365 * 86400, where)
    return JobKind(
        name=name,
        count=_int(d, "count", 1, 1, 10_000_000, where),
        users=tuple(users),
        nodes=_int(d, "nodes", 1, 1, 100_000, where),
        cpus=_int(d, "cpus", 1, 1, 100_000, where),
        mem_mb=_mem(d, "mem", "1G", where),
        gpus_per_node=_int(d, "gpus_per_node", 0, 0, 1024, where),
        gpu_type=gtype,
        array=_int(d, "array", 0, 0, 1_000_000, where),
        duration=_pair(d.get("duration", 1.0), "duration", where),
        time_limit_s=time_limit,
        exclusive=bool(d.get("exclusive", False)),
    )
