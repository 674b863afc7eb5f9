"""Every sinfo field Slurm 22.05 documents prints, with Slurm's header: the -o letters and the -O
names of sinfo(1), kept in tests/data/slurm-22.05/ with the headers Slurm's sinfo printed
(../shared/slurm-lab)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.slurm import sinfo
from phalanx.slurm.common import parse_format, parse_long_format

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm-22.05"


def _lines(name: str) -> list[str]:
    text = (DATA / name).read_text().splitlines()
    return [x for x in text if x and not x.startswith("#")]


NAMES = [tuple(x.split("|")) for x in _lines("sinfo-Format.txt")]
LETTERS = _lines("sinfo-format.txt")
NODE = {
    "name": "node01",
    "state": "IDLE",
    "cpus": 4,
    "cpus_alloc": 0,
    "mem_mb": 2000,
    "mem_alloc_mb": 0,
    "features": [],
    "gpus": [],
}
PART = {"name": "batch", "max_time_s": None, "default_time_s": 3600, "preempt_mode": "off"}


def test_the_lists_are_slurms_whole() -> None:
    assert len(NAMES) == 47 and len(LETTERS) == 42


@pytest.mark.parametrize(("name", "header"), NAMES, ids=[n for n, _ in NAMES])
def test_every_format_name_prints_with_slurms_header(name: str, header: str) -> None:
    mapping = {n: k for n, (k, _) in sinfo.FORMAT_NAMES.items()}
    (field,) = parse_long_format(name, mapping, prog="sinfo")
    assert sinfo.FORMAT_HEADERS[field.key] == header
    value = sinfo.node_values(NODE, PART, "batch")[field.key]
    assert isinstance(value, str) and value != ""


@pytest.mark.parametrize("letter", LETTERS)
def test_every_format_letter_prints(letter: str) -> None:
    _, (field,) = parse_format(f"%{letter}", sinfo.HEADERS, "sinfo")
    assert field.key in sinfo.node_values(NODE, PART, "batch")


def test_values_as_slurm_prints_them_for_an_idle_node() -> None:
    v = sinfo.node_values(NODE, PART, "batch")
    assert (v["B"], v["M"], v["S"], v["X"], v["Y"], v["Z"], v["V"]) == (
        "UNLIMITED",
        "OFF",
        "all",
        "4",
        "1",
        "1",
        "N/A",
    )
    assert (v["allocmem"], v["statecomplete"], v["P"]) == ("0", "idle", "batch*")
