"""`normalize`: how a submitted spec becomes per-node resources (Slurm's arithmetic)."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.domain.spec import JobSpec, PartitionInfo, ResolvedJob, normalize
from phalanx.errors import InvalidSpec
from phalanx.submitting import build_spec

PARTS = {"gpu": PartitionInfo("gpu", True, 3600, None)}
GPU_TEMPLATE = """\
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --gpus-per-node=a100:4
#SBATCH --cpus-per-gpu=8
#SBATCH --mem-per-gpu=32G
#SBATCH --time=1:00:00
srun python train.py
"""


def _norm(**kw: Any) -> ResolvedJob:
    return normalize(JobSpec(**kw), PARTS, default_mem_per_cpu_mb=100, default_requeue=True)


def _refused(**kw: Any) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        _norm(**kw)
    return info.value


def test_a_gpu_site_template_runs_with_per_gpu_cpus_and_memory(tmp_path: Any) -> None:
    """The whole template is accepted; CPUs and memory per node scale with the node's GPUs."""
    (tmp_path / "train.sh").write_text(GPU_TEMPLATE)
    body, warnings, ignored = build_spec(["train.sh"], cwd=str(tmp_path), environ={})
    assert (warnings, ignored) == ([], [])
    r = normalize(JobSpec(**body), PARTS, default_mem_per_cpu_mb=100, default_requeue=True)
    assert (r.nodes, r.gpus_per_node, r.gpu_type) == (2, 4, "a100")
    assert r.cpus_per_node == 8 * 4
    assert r.mem_per_node_mb == 32 * 1024 * 4


@pytest.mark.parametrize(
    ("gpus", "per_node"),
    [
        ({"gpus_per_node": 2}, 2),
        ({"gpus_total": 8, "nodes": 2}, 4),
        ({"gpus_per_task": 1, "ntasks_per_node": 3}, 3),
    ],
)
def test_per_gpu_counts_follow_every_way_of_asking_for_gpus(
    gpus: dict[str, int], per_node: int
) -> None:
    r = _norm(wrap="true", cpus_per_gpu=2, mem_per_gpu_mb=1000, **gpus)
    assert r.gpus_per_node == per_node
    assert (r.cpus_per_node, r.mem_per_node_mb) == (2 * per_node, 1000 * per_node)


def test_mem_per_cpu_with_cpus_per_gpu_counts_the_gpu_cpus() -> None:
    r = _norm(wrap="true", gpus_per_node=2, cpus_per_gpu=4, mem_per_cpu_mb=500)
    assert (r.cpus_per_node, r.mem_per_node_mb) == (8, 8 * 500)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"gpus_per_node": 1, "cpus_per_gpu": 2, "cpus_per_task": 2},
            "--cpus-per-task and --cpus-per-gpu are mutually exclusive",
        ),
        ({"gpus_per_node": 1, "mem_per_gpu_mb": 10, "mem_mb": 10}, "--mem, --mem-per-gpu"),
        ({"gpus_per_node": 1, "mem_per_gpu_mb": 10, "mem_per_cpu_mb": 10}, "--mem-per-cpu, --mem"),
        ({"mem_mb": 10, "mem_per_cpu_mb": 10}, "--mem, --mem-per-cpu are mutually exclusive"),
        ({"cpus_per_gpu": 2}, "--cpus-per-gpu needs GPUs"),
        ({"mem_per_gpu_mb": 1000}, "--mem-per-gpu needs GPUs"),
    ],
)
def test_conflicting_or_gpu_less_requests_are_refused(kw: dict[str, int], message: str) -> None:
    assert message in _refused(wrap="true", **kw).message


def test_cpus_per_task_still_defaults_to_one() -> None:
    r = _norm(wrap="true", ntasks_per_node=3)
    assert (r.cpus_per_node, r.mem_per_node_mb) == (3, 300)


# --- the default job name, as Slurm gives it ------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["train.sh"], "train.sh"),
        (["jobs/train.sh", "--epochs", "3"], "train.sh"),
        (["-J", "llama", "train.sh"], "llama"),
        (["--wrap", "hostname"], "wrap"),
    ],
)
def test_a_job_is_named_after_its_script_file(tmp_path: Any, argv: list[str], name: str) -> None:
    (tmp_path / "jobs").mkdir()
    for path in ("train.sh", "jobs/train.sh"):
        (tmp_path / path).write_text("#!/bin/bash\nhostname\n")
    body, _, _ = build_spec(argv, cwd=str(tmp_path), environ={})
    assert (
        normalize(JobSpec(**body), PARTS, default_mem_per_cpu_mb=1, default_requeue=True).name
        == name
    )


def test_a_script_without_a_file_is_named_sbatch_as_from_stdin() -> None:
    assert _norm(script="#!/bin/bash\ntrue\n").name == "sbatch"
    assert (
        _norm(script="#!/bin/bash\ntrue\n", script_path="/home/u/run.sbatch").name == "run.sbatch"
    )
