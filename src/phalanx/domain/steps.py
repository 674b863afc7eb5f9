"""Job steps (`srun` inside an allocation): where a step's tasks go, and how a step ended (pure).

A step runs inside the job's allocation, never beyond it: asking for more nodes, tasks, CPUs
or GPUs than the allocation holds fails at once with the reason (as Slurm's srun does), it
does not wait.  Steps running at the same time share the allocation (Slurm's ``--overlap``):
``srun ... &`` then ``wait`` is a common pattern and each of those steps fits on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.domain.layout import task_ranks, tasks_per_node
from phalanx.errors import InvalidSpec


@dataclass(frozen=True)
class AllocNode:
    """One node of the job's allocation as a step sees it."""

    name: str
    cpus: int
    gpu_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepRequest:
    """What `srun` asked for (None: take it from the allocation, as Slurm does)."""

    nodes: int | None = None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int = 1
    gpus_per_task: int | None = None
    gpus_per_node: int | None = None
    nodelist: Sequence[str] = ()
    job_ntasks_per_node: Sequence[int] = ()  # the job's own layout: srun's default


@dataclass
class StepPlan:
    nodes: list[str]
    tasks: list[int]  # per node
    task_ids: list[list[int]]  # global task ids (SLURM_PROCID) per node
    gpus: dict[str, list[list[int]]] = field(default_factory=dict)  # node -> GPUs of each task


def _refuse(message: str) -> InvalidSpec:
    return InvalidSpec(message, field="step")


def plan_step(req: StepRequest, alloc: Sequence[AllocNode]) -> StepPlan:
    """Place a step's tasks on the allocation, or refuse with the reason."""
    if not alloc:
        raise _refuse("the job holds no nodes")
    names = [n.name for n in alloc]
    by_name = {n.name: n for n in alloc}
    unknown = [n for n in req.nodelist if n not in by_name]
    if unknown:
        raise _refuse(
            f"requested nodes {','.join(unknown)} are not in the job's allocation "
            f"({','.join(names)})"
        )
    want_nodes = req.nodes
    if want_nodes is not None and want_nodes > len(alloc):
        raise _refuse(
            f"asked for {want_nodes} nodes but the allocation has only {len(alloc)} "
            f"({','.join(names)})"
        )
    if want_nodes is None:
        if req.nodelist:
            want_nodes = len(set(req.nodelist))
        elif req.ntasks is not None and req.ntasks_per_node is None:
            want_nodes = min(len(alloc), req.ntasks)
        else:
            want_nodes = len(alloc)
    if req.ntasks is not None and req.ntasks < want_nodes:
        want_nodes = req.ntasks  # Slurm shrinks the node count to the task count
    chosen = list(dict.fromkeys(req.nodelist))
    if len(chosen) > want_nodes:
        raise _refuse(f"--nodelist names {len(chosen)} nodes but the step asks for {want_nodes}")
    chosen += [n for n in names if n not in chosen][: want_nodes - len(chosen)]
    if req.ntasks is None and req.ntasks_per_node is None and req.job_ntasks_per_node:
        # srun without a layout runs the job's tasks on the chosen nodes (Slurm's default)
        layout = dict(zip(names, req.job_ntasks_per_node, strict=False))
        counts = [max(1, layout.get(n, 1)) for n in chosen]
    else:
        try:
            counts = tasks_per_node(
                len(chosen), ntasks=req.ntasks, ntasks_per_node=req.ntasks_per_node
            )
        except ValueError as e:
            raise _refuse(str(e)) from None
    plan = StepPlan(nodes=chosen, tasks=counts, task_ids=task_ranks(counts))
    for name, n in zip(chosen, counts, strict=True):
        node = by_name[name]
        need = n * req.cpus_per_task
        if need > node.cpus:
            raise _refuse(
                f"{n} tasks x {req.cpus_per_task} CPUs need {need} CPUs on {name}, "
                f"but the job holds {node.cpus} there"
            )
        per_task = req.gpus_per_task
        if per_task is None and req.gpus_per_node is not None:
            per_task = req.gpus_per_node // n if n else 0
            if req.gpus_per_node > len(node.gpu_ids):
                raise _refuse(
                    f"asked for {req.gpus_per_node} GPUs on {name}, "
                    f"but the job holds {len(node.gpu_ids)} there"
                )
        if per_task is None:
            # no GPU request: every task sees the job's GPUs on its node (Slurm's default)
            plan.gpus[name] = [list(node.gpu_ids) for _ in range(n)]
            continue
        if per_task * n > len(node.gpu_ids):
            raise _refuse(
                f"{n} tasks x {per_task} GPUs need {per_task * n} GPUs on {name}, "
                f"but the job holds {len(node.gpu_ids)} there"
            )
        ids = list(node.gpu_ids)
        plan.gpus[name] = [ids[i * per_task : (i + 1) * per_task] for i in range(n)]
    return plan


def step_usage(exits: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """What a step's tasks used, from their (node, exit record) pairs: total CPU seconds, and
    the largest resident set with the node and task it was seen on; None when no record
    carries a figure (sacct prints blanks then)."""
    cpu, peak, where = 0.0, -1, ("", 0)
    seen = False
    for node, ex in exits:
        usage = ex.get("usage")
        if not isinstance(usage, dict):
            continue
        seen = True
        cpu += float(usage.get("cpu_s") or 0.0)
        rss = int(usage.get("max_rss_bytes") or 0)
        if rss > peak:
            peak, where = rss, (node, int(ex.get("task") or 0))
    if not seen:
        return None
    return {
        "cpu_s": round(cpu, 3),
        "max_rss_bytes": max(peak, 0),
        "max_rss_node": where[0],
        "max_rss_task": where[1],
    }


def step_outcome(
    exits: Sequence[dict[str, Any]], *, lost: bool, stop_reason: str | None
) -> tuple[str, int | None, int | None]:
    """A step's state, exit code and signal from its tasks' exit records (srun's rule: the
    worst task wins; a task killed by a signal counts as that signal)."""
    code: int | None = None
    sig: int | None = None
    for ex in exits:
        c = ex.get("exit_code")
        if isinstance(c, int) and (code is None or c > code):
            code = c
        s = ex.get("signal")
        if isinstance(s, int) and s and sig is None:
            sig = s
    if lost:
        return "NODE_FAIL", code, sig
    if any(ex.get("fenced") for ex in exits):
        return "NODE_FAIL", code, sig
    if stop_reason and stop_reason.startswith("cancel"):
        return "CANCELLED", code, sig
    if any(ex.get("timed_out") for ex in exits):
        return "TIMEOUT", code, sig
    if any(ex.get("oom") for ex in exits):
        return "OUT_OF_MEMORY", code, sig
    if any(ex.get("launch_failed") for ex in exits):
        return "FAILED", code if code is not None else 1, sig
    if stop_reason:
        return "CANCELLED", code, sig
    if sig or (code or 0) != 0:
        return "FAILED", code, sig
    return "COMPLETED", code or 0, None
