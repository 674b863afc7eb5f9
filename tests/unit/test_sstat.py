"""sstat's pure parts (slurm/sstat.py): the field table held to Slurm 22.05's, its units, its
job references and how a job's usage answer becomes the steps it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.slurm import sstat
from phalanx.slurm.common import SlurmFatal, SlurmUsageError

DATA = Path(__file__).parents[1] / "data" / "slurm-22.05" / "sstat-format.txt"


def test_every_field_of_slurms_sstat_at_its_width() -> None:
    rows = [x.split() for x in DATA.read_text().splitlines() if x and not x.startswith("#")]
    slurm = {name: int(width) for name, width in rows}
    ours = {f.name: abs(f.width) for f in sstat.FIELDS.values()}
    assert ours == slurm
    assert [f.name for f, _ in sstat.parse_format(sstat.DEFAULT_FORMAT)][:3] == [
        "JobID",
        "MaxVMSize",
        "MaxVMSizeNode",
    ]


def test_sizes_as_convert_num_unit_prints_them() -> None:
    assert sstat.convert_num(0) == "0"
    assert sstat.convert_num(1024) == "1024"  # not above 1024: stays
    assert sstat.convert_num(4096) == "4K"
    assert sstat.convert_num(1.37 * 1024 * 1024) == "1.37M"
    assert sstat.convert_num(3 * 1024**3) == "3G"


def test_job_references() -> None:
    assert sstat.parse_refs("12,13.0,14.batch,7_2") == [
        ("12", None),
        ("13", "0"),
        ("14", "batch"),
        ("7_2", None),
    ]
    for bad in ("abc", "12.x", "12.", ".3"):
        with pytest.raises(SlurmFatal, match="Bad job/step specified"):
            sstat.parse_refs(bad)
    with pytest.raises(SlurmUsageError, match='Invalid field requested: "Nope"'):
        sstat.parse_format("JobID,Nope")


def task(step: object, rank: int, node: str, rss: int, cpu: float) -> dict[str, object]:
    return {
        "step": step, "task": rank, "node": node, "cpu_s": cpu, "rss": rss, "max_rss": rss,
        "vms": 2 * rss, "max_vms": 2 * rss, "pages": 0, "max_pages": 0, "read_bytes": 0,
        "write_bytes": 0, "pids": [100 + rank],
    }  # fmt: skip


def usage() -> dict[str, object]:
    return {
        "job_id": 5,
        "state": "RUNNING",
        "steps": [{"step_id": 1}, {"step_id": 3}],
        "batch_host": "n1",
        "tasks": [
            task("batch", 0, "n1", 10, 0.5),
            task(1, 1, "n2", 300, 2.0),
            task(1, 0, "n1", 100, 1.0),
            task(3, 0, "n1", 7, 0.1),
        ],
    }


def test_the_steps_a_reference_prints() -> None:
    steps, err = sstat.steps_of(usage(), None, False, True)
    assert err is None and [s.step for s in steps] == ["1"]  # the lowest running step
    one = steps[0]
    row = {f.name: f.get(one) for f, _ in sstat.parse_format(sstat.DEFAULT_FORMAT + ",Pids")}
    assert (row["JobID"], row["NTasks"], row["Pids"]) == ("5.1", 2, "100,101")
    assert (row["MaxRSS"], row["MaxRSSNode"], row["MaxRSSTask"]) == ("300", "n2", 1)
    assert (row["AveRSS"], row["MinCPU"], row["MinCPUNode"]) == ("200", "00:01.000", "n1")
    assert row["TRESUsageInMax"] == "cpu=00:02.000,fs/disk=0,mem=300,pages=0,vmem=600"
    assert row["TRESUsageInMaxNode"] == "cpu=n2,fs/disk=n1,mem=n2,pages=n1,vmem=n2"
    steps, _ = sstat.steps_of(usage(), None, True, True)
    assert [s.step for s in steps] == ["batch", "1", "3"]
    assert sstat.steps_of(usage(), "9", False, True) == ([], "StepId=5.9 not found running.")
    assert sstat.steps_of({**usage(), "state": "PENDING"}, None, False, True) == (
        [],
        "No steps running for job 5",
    )
