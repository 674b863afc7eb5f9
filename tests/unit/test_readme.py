"""The README's usage section runs as written on a fresh clone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from phalanx.domain.directives import parse_submission, split_cli_args

README = Path(__file__).resolve().parents[2] / "README.md"


def _usage_commands() -> list[str]:
    text = README.read_text()
    usage = text[text.index("## Using it") : text.index("## Running daemons yourself")]
    blocks = re.findall(r"```sh\n(.*?)```", usage, re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_plain_phalanx_comes_after_the_venv_is_on_path() -> None:
    lines = _usage_commands()
    on_path = next(i for i, ln in enumerate(lines) if ln.startswith("export PATH=$PWD/.venv/bin:"))
    first_plain = next(i for i, ln in enumerate(lines) if ln.startswith("phalanx "))
    assert on_path < first_plain, lines


def test_submit_examples_parse() -> None:
    submits = [ln.split("#")[0] for ln in _usage_commands() if ln.startswith("phalanx submit ")]
    assert len(submits) >= 5
    for line in submits:
        opts, rest = split_cli_args(shlex.split(line)[2:])
        assert rest == ["train.sh"] or rest == ["sweep.sh"], line
        parse_submission("#!/bin/bash\ntrue\n", opts, rest[0])


def test_gpu_examples_say_how_to_get_gpus() -> None:
    lines = _usage_commands()
    gres = next(i for i, ln in enumerate(lines) if "--gres=gpu:" in ln)
    assert "see below" in lines[gres]
    assert any(re.match(r"phalanx down; phalanx up .*--gpus h100:8", ln) for ln in lines)
