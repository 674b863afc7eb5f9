"""The JSON views of jobs and nodes that every reader of them shares: the API's job and node
routes, the dashboard and accounting. Pure functions of store rows, so each is tested without a
server and no router needs another router's module to render a job."""

from __future__ import annotations

from typing import Any

from phalanx.controller.launch import default_output, expand_pattern
from phalanx.domain.hostlist import compress_hostlist
from phalanx.domain.states import JobState, node_display_state
from phalanx.domain.values import format_duration


def job_view(row: dict[str, Any], *, detail: bool = False) -> dict[str, Any]:
    arr = row["array_job_id"]
    display = f"{arr}_{row['array_task_id']}" if arr is not None else str(row["id"])
    view: dict[str, Any] = {
        "id": row["id"],
        "job_id": display,
        "array_job_id": arr,
        "array_task_id": row["array_task_id"],
        "name": row["name"],
        "user": row["user"],
        "partition": row["partition"],
        "state": row["state"],
        "reason": row["reason"],
        "priority": row["priority"],
        "nice": int(row.get("nice") or 0),
        # while HELD: who held it and whether its owner may release it (admin: only operators)
        **_hold_view(row),
        "submit_time": row["submit_time"],
        "start_time": row["start_time"],
        "end_time": row["end_time"],
        "time_limit_s": row["time_limit_s"],
        "time_limit": format_duration(row["time_limit_s"]),
        "nodes": row["nodes"],
        "nodelist": compress_hostlist(row["nodelist_run"]) if row["nodelist_run"] else None,
        "cpus_per_node": row["cpus_per_node"],
        "mem_per_node_mb": row["mem_per_node_mb"],
        "gpus_per_node": row["gpus_per_node"],
        "gpu_type": row["gpu_type"],
        "exclusive": bool(row["exclusive"]),
        "requeue": bool(row["requeue"]),
        "dependency": row["dependency"],
        "exit_code": row["exit_code"],
        "exit_signal": row["exit_signal"],
        "restart_count": row["restart_count"],
        "retries": int(row.get("retries") or 0),  # failure retries used (docs/retries.md)
        "avoid_nodes": row.get("avoid_nodes"),  # nodes it failed on, kept off its next attempt
        "exclude": row.get("exclude") or [],  # --exclude (scontrol's ExcNodeList)
        "req_nodes": row.get("nodelist") or [],  # --nodelist (squeue's REQ_NODES)
        "account": row.get("account"),
        "qos": row.get("qos"),
        "constraint": row.get("constraint_expr"),
        "array_limit": row.get("array_limit"),  # its array's %P (ArrayTaskThrottle)
        # a restart reservation (elastic/spare job after a node failure), while pending
        "reserved_nodes": row.get("reserved_nodes"),
        "reserved_until": row.get("reserved_until"),
        # nodes the current/last attempt ran on (an elastic job: anywhere from MIN to MAX)
        "nodes_alloc": len(row["nodelist_run"]) if row["nodelist_run"] else None,
        # rank 0 of the current/last attempt: where the batch script runs (Slurm's BatchHost)
        "batch_host": row["nodelist_run"][0] if row["nodelist_run"] else None,
    }
    if detail:
        spec = row["spec"]
        workdir = spec.get("workdir") or spec.get("submit_dir")
        fmt = {
            "job_id": row["id"],
            "array_job_id": arr,
            "array_task_id": row["array_task_id"],
            "name": row["name"],
            "user": row["user"],
            "node": (row["nodelist_run"] or ["%N"])[0],
            "rank": 0,
        }
        out = expand_pattern(spec.get("output") or default_output(arr), **fmt)
        err = expand_pattern(spec["error"], **fmt) if spec.get("error") else out
        view.update(
            {
                "command": _command(spec),
                "workdir": workdir,
                "submit_dir": spec.get("submit_dir"),
                "stdout": out if out.startswith("/") or not workdir else f"{workdir}/{out}",
                "stderr": err if err.startswith("/") or not workdir else f"{workdir}/{err}",
                "constraint": row["constraint_expr"],
                "signal": spec.get("signal"),
                "array": spec.get("array"),
                "account": row.get("account") or spec.get("account"),
                "qos": row.get("qos") or spec.get("qos"),
                "comment": spec.get("comment"),
                "reservation": spec.get("reservation"),  # --reservation (squeue's %v)
                "nodes_max": spec.get("nodes_max"),
                "ntasks": spec.get("ntasks"),
                "ntasks_per_node": spec.get("ntasks_per_node"),
                "cpus_per_task": spec.get("cpus_per_task"),
                "spares": int(spec.get("spares") or 0),
                "licenses": spec.get("licenses"),
                "checkpoint_spec": spec.get("checkpoint_parsed"),
                "checkpoint": row.get("checkpoint"),  # the latest recorded checkpoint
            }
        )
    return view


def _hold_view(row: dict[str, Any]) -> dict[str, Any]:
    if row["state"] != JobState.HELD.value:
        return {"held_by": None, "hold_kind": None}
    return {"held_by": row.get("held_by"), "hold_kind": row.get("hold_kind") or "user"}


def allocation_view(attempts: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """Spare nodes of the current attempt and the node time every attempt held (accounting).

    Node-seconds count every node an attempt held from its start to its end (or now), spares
    included: a hot spare runs nothing but nobody else can use it, so it is charged to the job.
    """
    total = spare = 0.0
    for a in attempts:
        if not a.get("start_time"):
            continue
        held = max(0.0, (a.get("end_time") or now) - a["start_time"])
        tasks = a.get("tasks") or []
        total += held * len(tasks)
        spare += held * sum(1 for t in tasks if t.get("spare"))
    current = attempts[-1] if attempts else None
    live = current is not None and current.get("state") != "ENDED"
    spares = [t["node"] for t in (current or {}).get("tasks") or [] if t.get("spare")]
    return {
        "spare_nodes": spares if live else [],
        "node_seconds": round(total, 1),
        "spare_node_seconds": round(spare, 1),
    }


def _command(spec: dict[str, Any]) -> str | None:
    """What `show` prints as Command= (scripts read it, as from scontrol show job)."""
    if spec.get("script") is not None:
        return spec.get("script_path") or "(batch script submitted through the API)"
    if spec.get("wrap"):
        return str(spec["wrap"])
    argv = spec.get("argv") or []
    return " ".join(argv) or None


def node_view(n: dict[str, Any], cluster_version: int | None = None) -> dict[str, Any]:
    """A node as the API shows it; `cluster_version`: the cluster configuration's current
    version, against which the one its agent runs (`config_version`) is behind or not."""
    used = n["used"]
    busy = bool(used["jobs"])
    applied = n.get("config_version")
    return {
        "name": n["name"],
        "state": node_display_state(
            registered=bool(n["registered"]),
            down=bool(n["down"]),
            drain=bool(n["drain"]),
            used_cpus=used["cpus"],
            total_cpus=n["cpus"],
            busy=busy,
        ),
        "cpus": n["cpus"],
        "cpus_alloc": used["cpus"],
        "mem_mb": n["mem_mb"],
        "mem_alloc_mb": used["mem_mb"],
        "gpus": n["gpus"],
        "gpus_alloc": used["gpus"],
        "features": n["features"],
        "down": bool(n["down"]),
        "down_reason": n["down_reason"],
        "drain": bool(n["drain"]),
        "drain_reason": n["drain_reason"],
        "drain_by": n["drain_by"],
        "drain_time": n["drain_time"],
        "last_heartbeat": n["last_heartbeat"],
        "registered_at": n["registered_at"],
        "addr": n["addr"],
        "jobs": sorted(set(used["jobs"])),
        "spare_for": n.get("spare_for") or [],  # jobs this node is held for as a hot spare
        "health": n.get("health"),
        "launch_failures": n.get("launch_failures", 0),
        # the cluster configuration version whose node settings its agent runs (heartbeats)
        "config_version": applied,
        "cluster_config_version": cluster_version,
        "config_behind": applied is not None
        and cluster_version is not None
        and applied < cluster_version,
    }
