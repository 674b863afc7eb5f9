"""Every squeue field Slurm 22.05 documents is handled or refused by name (slurm/squeue_fields.py),
with Slurm's header: the lists are squeue(1)'s, kept in tests/data/slurm-22.05/ with the headers
Slurm's own squeue printed for them (../shared/slurm-lab)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_slurm_commands import NOW
from test_slurm_commands import job as listing_job

from phalanx.slurm import squeue, squeue_fields
from phalanx.slurm.common import SlurmUsageError, parse_format, parse_long_format

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm-22.05"


def _lines(name: str) -> list[str]:
    text = (DATA / name).read_text().splitlines()
    return [x for x in text if x and not x.startswith("#")]


FORMAT_NAMES = [tuple(x.split("|")) for x in _lines("squeue-Format.txt")]
LETTERS = _lines("squeue-format.txt")


def job(**kw: Any) -> dict[str, Any]:
    """squeue's test record (test_slurm_commands.py) with what these fields read besides."""
    more: dict[str, Any] = {
        "user": "root",  # a user this host knows: uid and group come from it
        "priority": 10,
        "mem_per_node_mb": 1000,
        "exclude": ["node09"],
        "req_nodes": [],
        "batch_host": "node01",
        "account": "physics",
        "qos": "normal",
        "exit_code": None,
        "restart_count": 0,
    }
    return listing_job(**{**more, **kw})


def test_the_lists_are_slurms_whole() -> None:
    assert len(FORMAT_NAMES) == 118 and len(LETTERS) == 51


@pytest.mark.parametrize(("name", "header"), FORMAT_NAMES, ids=[n for n, _ in FORMAT_NAMES])
def test_every_format_name_prints_with_slurms_header_or_is_refused_as_slurm_does(
    name: str, header: str
) -> None:
    if header == "-":  # a job step's field: Slurm refuses it for jobs, in these words
        assert name.lower() in squeue_fields.STEP_ONLY
        with pytest.raises(SlurmUsageError, match=f"^Invalid job format specification: {name}$"):
            parse_long_format(name, squeue.LONG_FIELDS)
        return
    (field,) = parse_long_format(name, squeue.LONG_FIELDS)
    assert squeue.LONG_HEADERS[field.key] == header
    for record in (job(), job(state="PENDING", start_time=None, reason="Priority")):
        value = squeue.field_values(record, NOW, [field.key])[field.key]
        assert isinstance(value, str) and "\n" not in value, (name, value)


@pytest.mark.parametrize("letter", LETTERS)
def test_every_format_letter_prints(letter: str) -> None:
    _, (field,) = parse_format(f"%{letter}", squeue.HEADERS)
    value = squeue.field_values(job(), NOW, [field.key])[field.key]
    assert isinstance(value, str), (letter, value)


def test_the_fields_slurm_scripts_read_have_slurms_values() -> None:
    """As Slurm 22.05 prints them for such a job (../shared/slurm-lab)."""
    keys = ["a", "B", "c", "h", "m", "q", "x", "y", "z", "H", "s", "v", "O", "d"]
    got = squeue.field_values(job(), NOW, keys)
    assert got == {
        "a": "physics",
        "B": "node01",
        "c": "4",
        "h": "OK",
        "m": "1000M",
        "q": "normal",
        "x": "node09",
        "y": "0",
        "z": "*:*:*",
        "H": "*",
        "s": "",
        "v": "(null)",
        "O": "0",
        "d": "0",
    }
    pending = squeue.field_values(job(state="PENDING", start_time=None), NOW, ["B", "tres-alloc"])
    assert pending == {"B": "n/a", "tres-alloc": "(null)"}
    assert squeue.field_values(job(), NOW, ["tres-alloc"])["tres-alloc"] == (
        "cpu=8,mem=2000M,node=2"
    )
    # queued since its submission (no --begin): Slurm's ISO form, local time
    submitted = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW - 100))
    assert squeue.field_values(job(), NOW, ["accruetime"]) == {"accruetime": submitted}


def test_fields_from_a_jobs_detail_are_asked_for_in_the_same_call() -> None:
    for name in ("Command", "WorkDir", "STDOUT", "Comment", "Licenses", "NumTasks"):
        (field,) = parse_long_format(name, squeue.LONG_FIELDS)
        assert field.key in squeue_fields.DETAIL, name


def test_a_reservations_job_and_reason_print_as_slurms() -> None:
    assert squeue.field_values(job(reservation="maint1"), NOW, ["v"]) == {"v": "maint1"}
    assert "v" in squeue_fields.DETAIL  # the reservation is in the job's detail
    waiting = job(
        state="PENDING",
        start_time=None,
        reason="ReqNodeNotAvail, Reserved for maintenance (maint1 holds node01 from 12:00)",
    )
    # Slurm's phrase as Slurm prints it; our own reasons stay one word
    assert squeue.slurm_reason(waiting) == "ReqNodeNotAvail, Reserved for maintenance"
    assert squeue.slurm_reason({**waiting, "reason": "waiting for a node"}) == "waiting_for_a_node"
