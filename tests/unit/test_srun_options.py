"""srun's options held to srun(1) of Slurm 22.05 (tests/data/slurm-22.05/srun-options.txt):
each is srun's own (srun/command.py) or refused by name with why (srun/refused.py), in one
line, whatever form it is given in; never accepted and ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.slurm.common import SlurmUsageError
from phalanx.slurm.srun.command import USAGE, parser, prepare
from phalanx.slurm.srun.refused import REFUSED

DATA = Path(__file__).parents[1] / "data" / "slurm-22.05" / "srun-options.txt"


def test_every_srun_option_slurm_documents_is_handled_or_refused_by_name() -> None:
    listed = [x for x in DATA.read_text().splitlines() if x and not x.startswith("#")]
    assert len(listed) == 121
    known = {o[2:] for a in parser()._actions for o in a.option_strings if o.startswith("--")}
    refused = {long for long, *_ in REFUSED}
    for name in listed:
        assert name in known or name == "version", name  # -V/--version: phalanx.slurm.main
    assert refused <= set(listed)  # nothing refused that srun(1) does not have
    assert all(len(why) > 10 for *_, why in REFUSED)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus=1", "true"], "--gpus is not supported here: an option of the job's allocation"),
        (["-G", "1", "true"], "-G is not supported here: an option of the job's allocation"),
        (["--multi", "true"], "--multi-prog is not supported here: no multi-program steps"),
        (["-O", "true"], "-O is not supported here: an option of the job's allocation"),
        (["--x11", "true"], "--x11 is not supported here: no X11 forwarding"),
        (["--bcast", "true"], "--bcast is not supported here: no file broadcast"),
        (["--resv-ports", "true"], "--resv-ports is not supported here: no reserved port"),
    ],
)
def test_a_refused_option_says_why_in_any_form(argv: list[str], message: str) -> None:
    with pytest.raises(SlurmUsageError) as info:
        prepare(argv)
    assert str(info.value).startswith(message), info.value


def test_the_commands_own_arguments_are_not_srun_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert prepare(["echo", "--gpus=1", "-O"]).command == ["echo", "--gpus=1", "-O"]
    with pytest.raises(SystemExit) as done:
        prepare(["--usage"])
    assert done.value.code == 0 and capsys.readouterr().out == USAGE
