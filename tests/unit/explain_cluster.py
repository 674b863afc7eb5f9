"""Hand-built scheduling snapshots (store.SchedSnapshot, plain data) for the tests of what a
scheduling pass decides and says: explain, queue depth, preemption, maintenance windows and
reservations (`small_cluster`, `small_job`: nodes of 4 CPUs and jobs that fill one)."""

from __future__ import annotations

from typing import Any

from phalanx.domain.states import JobState
from phalanx.store.store import SchedSnapshot

NOW = 1_800_000_000.0


def node(
    name: str,
    *,
    cpus: int = 16,
    mem_mb: int = 64_000,
    gpus: int = 0,
    gpu_type: str = "h100",
    features: tuple[str, ...] = (),
    drain: str | None = None,
    drain_by: str | None = None,
    down: str | None = None,
    registered: bool = True,
) -> dict[str, Any]:
    return {
        "name": name,
        "registered": registered,
        "cpus": cpus,
        "mem_mb": mem_mb,
        "gpus": [[i, gpu_type] for i in range(gpus)],
        "features": list(features),
        "down": down is not None,
        "down_reason": down,
        "drain": drain is not None,
        "drain_reason": drain,
        "drain_by": drain_by,
    }


def partition(name: str, nodes: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "nodes": nodes, "is_default": True, "max_time_s": None, **kw}


def alloc(
    job_id: int,
    node_name: str,
    *,
    cpus: int = 1,
    mem_mb: int = 1000,
    gpu_ids: tuple[int, ...] = (),
    exclusive: bool = False,
    end: float | None = None,
) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "node": node_name,
        "cpus": cpus,
        "mem_mb": mem_mb,
        "gpu_ids": list(gpu_ids),
        "exclusive": exclusive,
        "expected_end": end,
    }


def job(jid: int, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": jid,
        "name": f"job{jid}",
        "user": "alice",
        "partitions": "batch",
        "state": JobState.PENDING.value,
        "reason": None,
        "priority": 0,
        "nodes": 1,
        "cpus_per_node": 1,
        "mem_per_node_mb": 1000,
        "gpus_per_node": 0,
        "gpu_type": None,
        "exclusive": False,
        "constraint_expr": None,
        "nodelist": [],
        "exclude": [],
        "avoid_nodes": None,
        "time_limit_s": 3600,
        "dependency": [],
        "array_job_id": None,
        "array_task_id": None,
        "array_limit": None,
        "eligible_time": None,
        "reserved_nodes": None,
        "reserved_until": None,
        "nodes_max": None,
        "spares": 0,
    }
    row.update(kw)
    return row


def snapshot(
    nodes: list[dict[str, Any]],
    partitions: list[dict[str, Any]],
    *,
    allocations: list[dict[str, Any]] | None = None,
    pending: list[dict[str, Any]] | None = None,
    dep_states: dict[int, JobState] | None = None,
    maintenance: list[dict[str, Any]] | None = None,
    reservations: list[dict[str, Any]] | None = None,
    resv: list[dict[str, Any]] | None = None,
) -> SchedSnapshot:
    return SchedSnapshot(
        nodes=nodes,
        partitions={p["name"]: p for p in partitions},
        allocations=allocations or [],
        pending=pending or [],
        dep_states=dep_states or {},
        dep_started={},
        active_names=set(),
        array_active={},
        reservations=reservations or [],
        maintenance=maintenance or [],
        resv=resv or [],
    )


def small_cluster(
    names: list[str],
    pending: list[dict[str, Any]],
    *,
    maintenance: list[dict[str, Any]] | None = None,
    resv: list[dict[str, Any]] | None = None,
) -> SchedSnapshot:
    """Nodes of 4 CPUs and 4096 MB, all in partition `batch`, nothing running; `pending` jobs
    (`small_job`), maintenance windows' and reservations' rows."""
    return snapshot(
        [node(n, cpus=4, mem_mb=4096) for n in names],
        [{"name": "batch", "nodes": "*"}],
        pending=pending,
        maintenance=maintenance,
        resv=resv,
    )


def small_job(jid: int, time_limit_s: int | None, nodes: int = 1, **kw: Any) -> dict[str, Any]:
    """A pending job that needs whole nodes of `small_cluster` (4 CPUs, 1024 MB each)."""
    return job(
        jid, nodes=nodes, cpus_per_node=4, mem_per_node_mb=1024, time_limit_s=time_limit_s, **kw
    )
