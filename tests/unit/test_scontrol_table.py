"""scontrol held to scontrol(1) of Slurm 22.05 (tests/data/slurm-22.05/scontrol-commands.txt):
every command, `show` entity and long option is scontrol's own or refused by name with why
(slurm/scontrol_refused.py), in one line, before any controller is asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.slurm import scontrol
from phalanx.slurm.scontrol_refused import COMMANDS, OPTIONS, SHOW

DATA = Path(__file__).parents[1] / "data" / "slurm-22.05" / "scontrol-commands.txt"
OWN_COMMANDS = {*scontrol.CLIENT_COMMANDS, "ping", "version", "suspend", "resume"}
OWN_SHOW = {
    *("job", "node", "partition", "reservation", "licenses"),
    *("hostnames", "hostlist", "hostlistsorted"),
}
OWN_OPTIONS = {"all", "clusters", "details", "help", "oneliner", "quiet", "verbose", "version"}


def listed(kind: str) -> list[str]:
    rows = [x.split() for x in DATA.read_text().splitlines() if x and not x.startswith("#")]
    return [name for k, name in rows if k == kind]


def test_every_command_entity_and_option_is_handled_or_refused_by_name() -> None:
    assert len(listed("command")) == 42 and len(listed("show")) == 20
    for name in listed("command"):
        assert (name in OWN_COMMANDS) != (name in COMMANDS), name
    for name in listed("show"):
        assert (name in OWN_SHOW) != (name in SHOW), name
    for name in listed("option"):
        assert (name in OWN_OPTIONS) != (f"--{name}" in OPTIONS), name
    assert set(COMMANDS) <= set(listed("command")) and set(SHOW) <= set(listed("show"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["reconfigure"], "scontrol: error: reconfigure is not supported: Phalanx's controllers"),
        (["reboot", "node01"], "scontrol: error: reboot is not supported: Phalanx does not"),
        (["show", "config"], "scontrol: error: show config is not supported: Phalanx's"),
        (["show", "step", "12.0"], "scontrol: error: show step is not supported: a job's steps"),
        (["-F", "show", "node"], "scontrol: error: -F is not supported here: Phalanx has no"),
        (["--uid=5", "show", "job"], "scontrol: error: --uid is not supported here: commands"),
        (["oneliner"], "scontrol: error: oneliner is not supported: an interactive-mode command"),
    ],
)
def test_a_refused_one_says_why_without_asking_a_controller(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_URL", "http://127.0.0.1:9")  # nothing listens: never asked
    assert scontrol.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
