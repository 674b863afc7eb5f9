"""What an agent needs to start one task: argv, environment, paths, limits (pure).

The environment carries Phalanx's own variables and the Slurm names scripts already use, so a
Slurm batch script runs unchanged (SLURM-HABITS.md).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
from typing import Any

from phalanx.domain.hostlist import compress_hostlist
from phalanx.domain.layout import compress_counts, tasks_per_node
from phalanx.domain.values import parse_array, parse_export

BASE_MASTER_PORT = 29500
# What SLURM_JOB_ACCOUNT / SLURM_JOB_QOS say for a job stored before accounts existed (a job
# submitted since records the account and QOS it is charged to: docs/fairshare.md).
DEFAULT_ACCOUNT = "default"
DEFAULT_QOS = "normal"


# What a non-batch node of an allocation runs: nothing but a process that holds the node's
# share (its cgroup and self-fencing) until the store stops it.  Job signals (the checkpoint
# signal, --signal) are for the batch script and the steps, so the holder ignores them: an
# ignored signal stays ignored across exec.
HOLDER_ARGV = ("/bin/sh", "-c", "trap '' HUP USR1 USR2 ALRM URG; exec sleep infinity")


def is_holder(spec: dict[str, Any], rank: int) -> bool:
    """Whether this node's task of the job only holds the allocation (not the batch step)."""
    return rank > 0 and not spec.get("all_nodes")


def expand_pattern(
    pattern: str,
    *,
    job_id: int,
    array_job_id: int | None,
    array_task_id: int | None,
    name: str,
    user: str,
    node: str,
    rank: int,
) -> str:
    """Slurm filename patterns: %j %A %a %x %u %N %n %t %% (with optional zero padding, %4a)."""

    def repl(m: re.Match[str]) -> str:
        width, ch = m.group(1), m.group(2)
        if ch == "%":
            return "%"
        num: int | None = None
        if ch == "j":
            num = job_id
        elif ch == "A":
            num = array_job_id if array_job_id is not None else job_id
        elif ch == "a":
            num = array_task_id if array_task_id is not None else 4294967294
        elif ch in ("n", "t"):
            num = rank
        elif ch == "x":
            return name
        elif ch == "u":
            return user
        elif ch == "N":
            return node
        else:
            return m.group(0)
        return str(num).zfill(int(width)) if width else str(num)

    return re.sub(r"%(\d*)([jAaxuNnt%])", repl, pattern)


def default_output(array_job_id: int | None) -> str:
    """Slurm's default output file, in the job's working directory: every Slurm user types
    `tail -f slurm-<id>.out`, and scripts and tools (submitit's log readers, dashboards)
    look for that name."""
    return "slurm-%A_%a.out" if array_job_id is not None else "slurm-%j.out"


def build_launch(
    work: dict[str, Any], *, node: str, kill_wait: float, checkpoint_grace: float = 30.0
) -> dict[str, Any]:
    """Turn one row of Store.node_work into the agent's launch request."""
    spec = work["spec"]
    job_id = int(work["job_id"])
    rank = int(work["rank"])
    workdir = spec.get("workdir") or spec.get("submit_dir") or "/"
    fmt = {
        "job_id": job_id,
        "array_job_id": work["array_job_id"],
        "array_task_id": work["array_task_id"],
        "name": work["name"],
        "user": work["user"],
        "node": node,
        "rank": rank,
    }

    def path(p: str | None) -> str | None:
        if p is None:
            return None
        p = expand_pattern(p, **fmt)
        return p if os.path.isabs(p) else os.path.join(workdir, p)

    stdout = path(spec.get("output") or default_output(work["array_job_id"]))
    stderr = path(spec.get("error"))
    env = job_environment(work, node=node)
    holder = is_holder(spec, rank)
    if holder:
        # Slurm's batch step: the script runs once, on the first node; the other nodes hold
        # the allocation (cgroup, fencing, TMPDIR) for the job's srun steps and run nothing else
        command: dict[str, Any] = {"argv": list(HOLDER_ARGV)}
        stdout = stderr = os.devnull
    elif spec.get("script") is not None:
        command = {"script": spec["script"], "args": list(spec.get("argv") or [])}
    elif spec.get("wrap"):
        command = {"script": "#!/bin/sh\n" + spec["wrap"] + "\n", "args": []}
    else:
        command = {"argv": list(spec.get("argv") or [])}
    checkpoint = checkpoint_settings(work, checkpoint_grace=checkpoint_grace)
    return {
        "attempt_id": int(work["attempt_id"]),
        "token": work["token"],
        "job_id": job_id,
        "rank": rank,
        "node": node,
        "command": command,
        "env": env,
        "cwd": workdir,
        "stdout": stdout,
        "stderr": stderr,
        "open_mode": spec.get("open_mode") or ("append" if int(work["seq"]) > 0 else "truncate"),
        # a holder ends when the batch step does (the store stops it), never by itself
        "time_limit_s": None if holder else work["time_limit_s"],
        "kill_grace_s": kill_wait,
        "signal": None if holder else spec.get("signal_parsed"),
        "progress_timeout_s": None if holder else spec.get("progress_timeout_s"),
        "checkpoint": {**checkpoint, "enabled": False} if holder else checkpoint,
        "holder": holder,
        "all_nodes": bool(spec.get("all_nodes")),
        "gpu_ids": list(work["gpu_ids"] or []),
        "fence_term": int(work["fence_term"]),
        # containment on the node (docs/isolation.md): who runs it, and its share of the node
        "user": str(work["user"]),
        "cpus": int(work.get("cpus") or 1),
        "mem_mb": int(work.get("mem_mb") or 0),
    }


def checkpoint_dir(work: dict[str, Any]) -> str:
    """The job's checkpoint directory: --checkpoint-dir, else one per job under its workdir.

    The same for every attempt, so a requeued job finds what the previous one saved.
    """
    spec = work["spec"]
    workdir = spec.get("workdir") or spec.get("submit_dir") or "/"
    given = spec.get("checkpoint_dir")
    if given:
        return given if os.path.isabs(given) else os.path.join(workdir, given)
    return os.path.join(workdir, ".phalanx", "checkpoints", str(int(work["job_id"])))


def checkpoint_settings(work: dict[str, Any], *, checkpoint_grace: float) -> dict[str, Any]:
    """What the node side needs to ask this job for checkpoints (shepherd spec "checkpoint").

    `enabled` is true when the job gave a --checkpoint-* option: only then does the shepherd
    create the directory and send a request before the time limit.
    """
    spec = work["spec"]
    parsed = spec.get("checkpoint_parsed") or {}
    sig = spec.get("signal_parsed") or {}
    grace = parsed.get("grace_s")
    if grace is None:
        grace = sig.get("before_s") if sig else None
    return {
        "enabled": bool(parsed),
        "signum": int(parsed.get("signum") or sig.get("signum") or signal.SIGUSR1),
        "grace_s": float(checkpoint_grace if grace is None else grace),
        "batch_only": bool(sig.get("batch_only")),
        "dir": checkpoint_dir(work),
    }


def checkpoint_environment(work: dict[str, Any]) -> dict[str, str]:
    """PHX_CHECKPOINT_DIR and PHX_CHECKPOINT_SIGNAL (the agent adds the control-dir paths)."""
    settings = checkpoint_settings(work, checkpoint_grace=0.0)
    try:
        name = signal.Signals(settings["signum"]).name.removeprefix("SIG")
    except ValueError:
        name = str(settings["signum"])
    return {"PHX_CHECKPOINT_DIR": settings["dir"], "PHX_CHECKPOINT_SIGNAL": name}


def job_environment(work: dict[str, Any], *, node: str) -> dict[str, str]:
    """The job's environment: the submitter's (per --export) plus PHX_* and SLURM_* variables."""
    spec = work["spec"]
    submitted: dict[str, str] = dict(spec.get("env") or {})
    mode, extra = parse_export(spec.get("export") or "ALL")
    if mode == "ALL":
        env = dict(submitted)
    else:
        env = {
            k: submitted[k]
            for k in ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TERM")
            if k in submitted
        }
    for k, v in extra.items():
        if v is not None:
            env[k] = v
        elif k in submitted:
            env[k] = submitted[k]
    job_id = int(work["job_id"])
    nodes: list[str] = list(work["attempt_nodes"])
    rank = int(work["rank"])
    hostlist = compress_hostlist(nodes)
    cpus_per_task = int(spec.get("cpus_per_task") or 1)
    arr_job = work["array_job_id"]
    arr_task = work["array_task_id"]
    master_port = BASE_MASTER_PORT + job_id % 20000
    gpus = [str(g) for g in (work["gpu_ids"] or [])]
    counts = job_layout(spec, len(nodes))
    batch = not spec.get("all_nodes")
    # the batch step is task 0 on node 0; --all-nodes runs one copy per node, ranked by node
    procid = 0 if batch else rank
    phx = {
        "PHX_JOB_ID": str(job_id),
        "PHX_JOB_NAME": str(work["name"]),
        "PHX_ATTEMPT": str(work["seq"]),  # the job's own: 0, 1, 2, ... (= restart count)
        "PHX_ATTEMPT_ID": str(work["attempt_id"]),  # unique in the cluster (logs, tooling)
        "PHX_RESTART_COUNT": str(work["seq"]),
        "PHX_NODELIST": hostlist,
        "PHX_NNODES": str(len(nodes)),
        "PHX_NODE_RANK": str(rank),
        "PHX_NODENAME": node,
        "PHX_PARTITION": str(work["attempt_partition"]),
        "PHX_SUBMIT_DIR": str(spec.get("submit_dir") or ""),
        "PHX_CPUS_ON_NODE": str(work["cpus"]),
        "PHX_CPUS_PER_TASK": str(cpus_per_task),
        "MASTER_ADDR": nodes[0],
        "MASTER_PORT": str(master_port),
    }
    if arr_job is not None:
        phx["PHX_ARRAY_JOB_ID"] = str(arr_job)
        phx["PHX_ARRAY_TASK_ID"] = str(arr_task)
    phx.update(checkpoint_environment(work))
    cpus_per_node = int(work.get("cpus_per_node") or work["cpus"])
    slurm = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": str(work["name"]),
        "SLURM_JOB_USER": str(work["user"]),
        "SLURM_JOB_ACCOUNT": str(spec.get("account") or DEFAULT_ACCOUNT),
        "SLURM_JOB_QOS": str(spec.get("qos") or DEFAULT_QOS),
        "SLURM_JOB_NODELIST": hostlist,
        "SLURM_NODELIST": hostlist,
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_NNODES": str(len(nodes)),
        "SLURM_NODEID": str(rank),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": str(sum(counts)),
        "SLURM_NPROCS": str(sum(counts)),
        "SLURM_TASKS_PER_NODE": compress_counts(counts),
        "SLURM_JOB_CPUS_PER_NODE": compress_counts([cpus_per_node] * len(nodes)),
        "SLURM_RESTART_COUNT": str(work["seq"]),
        "SLURM_SUBMIT_DIR": str(spec.get("submit_dir") or ""),
        "SLURM_SUBMIT_HOST": str(spec.get("submit_host") or nodes[0]),
        "SLURM_CPUS_PER_TASK": str(cpus_per_task),
        "SLURM_CPUS_ON_NODE": str(work["cpus"]),
        "SLURM_JOB_PARTITION": str(work["attempt_partition"]),
        "SLURMD_NODENAME": node,
        "SLURM_TOPOLOGY_ADDR": node,
        "SLURM_CLUSTER_NAME": "phalanx",
        "SLURM_GTIDS": ",".join(str(t) for t in range(procid, procid + 1)),
    }
    if spec.get("ntasks_per_node") is not None or spec.get("ntasks") is None:
        slurm["SLURM_NTASKS_PER_NODE"] = str(counts[0])
    if spec.get("mem_per_cpu_mb") is not None:
        slurm["SLURM_MEM_PER_CPU"] = str(int(spec["mem_per_cpu_mb"]))
    elif int(work.get("mem_mb") or 0) > 0:
        slurm["SLURM_MEM_PER_NODE"] = str(int(work["mem_mb"]))
    if arr_job is not None:
        slurm["SLURM_ARRAY_JOB_ID"] = str(arr_job)
        slurm["SLURM_ARRAY_TASK_ID"] = str(arr_task)
        slurm.update(array_environment(spec.get("array")))
    if gpus:
        phx["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        slurm["SLURM_JOB_GPUS"] = ",".join(gpus)
        slurm["SLURM_GPUS_ON_NODE"] = str(len(gpus))
        slurm["SLURM_GPUS_PER_NODE"] = str(len(gpus))
        slurm["GPU_DEVICE_ORDINAL"] = ",".join(gpus)
    env.update(phx)
    env.update(slurm)
    return env


def job_layout(spec: dict[str, Any], nnodes: int) -> list[int]:
    """Tasks per node of the job's allocation (its --ntasks/--ntasks-per-node over the nodes
    the attempt got; an elastic job may run on fewer than it asked for)."""
    ntasks = spec.get("ntasks")
    per_node = spec.get("ntasks_per_node")
    if ntasks is not None and int(ntasks) < nnodes:
        ntasks = None  # elastic job on more nodes than tasks: one per node
    try:
        return tasks_per_node(
            nnodes,
            ntasks=int(ntasks) if ntasks is not None else None,
            ntasks_per_node=int(per_node) if per_node is not None else None,
        )
    except ValueError:
        return [1] * nnodes


def array_environment(array: str | None) -> dict[str, str]:
    """SLURM_ARRAY_TASK_COUNT/MIN/MAX/STEP of the whole array (a spec that no longer parses
    gives none: the job still runs)."""
    if not array:
        return {}
    try:
        indices, _limit = parse_array(array)
    except ValueError:
        return {}
    if not indices:
        return {}
    steps = {b - a for a, b in itertools.pairwise(indices)}
    return {
        "SLURM_ARRAY_TASK_COUNT": str(len(indices)),
        "SLURM_ARRAY_TASK_MIN": str(indices[0]),
        "SLURM_ARRAY_TASK_MAX": str(indices[-1]),
        "SLURM_ARRAY_TASK_STEP": str(steps.pop() if len(steps) == 1 else 1),
    }


# Job variables that differ from node to node: a step task gets its own node's values over
# the environment srun passed on (srun runs on the batch host).
NODE_KEYS = (
    "PHX_NODE_RANK",
    "PHX_NODENAME",
    "PHX_CPUS_ON_NODE",
    "SLURMD_NODENAME",
    "SLURM_TOPOLOGY_ADDR",
    "SLURM_CPUS_ON_NODE",
    "SLURM_JOB_GPUS",
    "SLURM_GPUS_ON_NODE",
    "SLURM_MEM_PER_NODE",
)


def expand_step_pattern(
    pattern: str,
    *,
    job_id: int,
    step_id: int,
    task: int,
    node_index: int,
    node: str,
    name: str,
    user: str,
    array_job_id: int | None,
    array_task_id: int | None,
) -> str:
    """srun's -o/-e patterns: %t task id, %n node index in the step, %s step id, %j %N %u %x
    %A %a %% as sbatch's."""

    def repl(m: re.Match[str]) -> str:
        width, ch = m.group(1), m.group(2)
        nums = {"t": task, "n": node_index, "s": step_id}
        if ch in nums:
            return str(nums[ch]).zfill(int(width)) if width else str(nums[ch])
        return expand_pattern(
            m.group(0),
            job_id=job_id,
            array_job_id=array_job_id,
            array_task_id=array_task_id,
            name=name,
            user=user,
            node=node,
            rank=node_index,
        )

    return re.sub(r"%(\d*)([tnsjAaxuN%])", repl, pattern)


def build_step_launch(
    w: dict[str, Any], *, node: str, kill_wait: float, now: float
) -> dict[str, Any]:
    """Turn one row of Store.node_step_work into the agent's step launch: the step's tasks on
    this node, each with its environment, GPUs and output (srun's socket, or -o/-e files)."""
    spec = w["step_spec"]
    job_id = int(w["job_id"])
    step_id = int(w["step_id"])
    nodes: list[str] = list(w["step_nodes"])
    counts: list[int] = [int(c) for c in w["step_tasks"]]
    index = nodes.index(node)
    task_ids: list[int] = list(spec["task_ids"][index])
    gpus: list[list[int]] = list((spec.get("gpus") or {}).get(node) or [[] for _ in task_ids])
    node_env = job_environment(w, node=node)
    env = dict(spec.get("env") or {})
    env.update({k: node_env[k] for k in NODE_KEYS if k in node_env})
    for k in ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"):
        env.pop(k, None)
    hostlist = compress_hostlist(nodes)
    env.update(
        {
            "SLURM_STEP_ID": str(step_id),
            "SLURM_STEPID": str(step_id),
            "SLURM_STEP_NODELIST": hostlist,
            "SLURM_STEP_NUM_NODES": str(len(nodes)),
            "SLURM_STEP_NUM_TASKS": str(sum(counts)),
            "SLURM_STEP_TASKS_PER_NODE": compress_counts(counts),
            "SLURM_NODELIST": hostlist,
            "SLURM_NNODES": str(len(nodes)),
            "SLURM_NTASKS": str(sum(counts)),
            "SLURM_NPROCS": str(sum(counts)),
            "SLURM_TASKS_PER_NODE": compress_counts(counts),
            "SLURM_NODEID": str(index),
            "SLURM_CPUS_PER_TASK": str(int(spec.get("cpus_per_task") or 1)),
            "SLURM_GTIDS": ",".join(str(t) for t in task_ids),
            "SLURM_SRUN_COMM_HOST": str(spec["io"]["host"]),
            "SLURM_LAUNCH_NODE_IPADDR": str(spec["io"]["host"]),
        }
    )
    pmi = spec.get("pmi")  # srun --mpi=pmi2: srun's PMI-1 server (slurm/srun/pmi.py)
    if pmi:
        env.update(
            {"PMI_PORT": f"{spec['io']['host']}:{pmi['port']}", "PMI_SIZE": str(sum(counts))}
        )
    cwd = spec.get("cwd") or "/"
    tasks = []
    for local, (task, task_gpus) in enumerate(zip(task_ids, gpus, strict=False)):
        task_env = {"SLURM_PROCID": str(task), "SLURM_LOCALID": str(local)}
        if pmi:
            task_env.update({"PMI_RANK": str(task), "PMI_ID": str(int(pmi["id_base"]) + task)})
        if task_gpus:
            ids = ",".join(str(g) for g in task_gpus)
            task_env.update(
                {"SLURM_STEP_GPUS": ids, "CUDA_VISIBLE_DEVICES": ids, "GPU_DEVICE_ORDINAL": ids}
            )
        fmt: dict[str, Any] = {
            "job_id": job_id,
            "step_id": step_id,
            "task": task,
            "node_index": index,
            "node": node,
            "name": str(w["name"]),
            "user": str(w["user"]),
            "array_job_id": w["array_job_id"],
            "array_task_id": w["array_task_id"],
        }
        out = spec.get("output")
        err = spec.get("error")
        tasks.append(
            {
                "task_id": task,
                "local_id": local,
                "env": task_env,
                "stdout": _step_path(out, fmt, cwd),
                "stderr": _step_path(err, fmt, cwd),
            }
        )
    sig = w["spec"].get("signal_parsed")
    expected_end = w.get("expected_end")
    return {
        "attempt_id": int(w["attempt_id"]),
        "step_id": step_id,
        "token": w["token"],
        "job_id": job_id,
        "node": node,
        "argv": list(spec["argv"]),
        "env": env,
        "cwd": cwd,
        "io": dict(spec["io"]),
        "label": bool(spec.get("label")),
        "open_mode": step_open_mode(spec, w["spec"]),
        "tasks": tasks,
        # a step ends with its job's time limit at the latest, and gets the job's --signal
        # (not a B: one, which is the batch shell's alone)
        "time_limit_s": max(1, int(expected_end - now)) if expected_end else None,
        "signal": None if not sig or sig.get("batch_only") else sig,
        "kill_grace_s": kill_wait,
        "user": str(w["user"]),
    }


def step_open_mode(step_spec: dict[str, Any], job_spec: dict[str, Any]) -> str:
    """How a step's -o/-e files open: srun's --open-mode (or $SLURM_OPEN_MODE) if given, else
    the job's own --open-mode, else truncate. A job that asked for append keeps its steps'
    output across requeues: submitit writes `#SBATCH --open-mode=append` and its `srun
    --output` log of the first attempt (the checkpoint and requeue lines) must survive."""
    mode = step_spec.get("open_mode") or job_spec.get("open_mode") or "truncate"
    return "append" if mode == "append" else "truncate"


def _step_path(pattern: str | None, fmt: dict[str, Any], cwd: str) -> str | None:
    if not pattern:
        return None
    p = expand_step_pattern(pattern, **fmt)
    return p if os.path.isabs(p) else os.path.join(cwd, p)
