"""Long options of the Slurm commands may be shortened to a unique prefix, as getopt_long
takes them in Slurm's own commands; an ambiguous prefix is refused as getopt_long refuses it.
The option lists come from each command's parser, so a new option is checked too."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from phalanx.slurm import sacct, sattach, scancel, sinfo, sprio, squeue, sshare
from phalanx.slurm.common import AmbiguousOption, SlurmParser, SlurmUsageError

PARSERS: dict[str, Callable[[], SlurmParser]] = {
    "squeue": squeue.parser,
    "sacct": sacct.build_parser,
    "sinfo": sinfo.parser,
    "scancel": scancel.parser,
    "sprio": sprio.parser,
    "sshare": sshare.parser,
    "sattach": sattach.parser,
}


def long_options(p: SlurmParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings if o.startswith("--")}


def outcome(p: SlurmParser, argv: list[str]) -> object:
    """What parsing gives: the namespace, the error's text, or the exit of an option that
    prints and exits (sattach's --usage, --version)."""
    try:
        return vars(p.parse_args(argv))
    except SlurmUsageError as e:
        return f"error: {e}"
    except SystemExit as e:
        return f"exit {e.code}"


def argv_for(option: str, action: argparse.Action) -> list[str]:
    takes = action.nargs not in (0, "?") and not isinstance(
        action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse._HelpAction
    )
    return [option, "1"] if takes else [option]


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_unique_prefix_means_its_option(command: str) -> None:
    p = PARSERS[command]()
    options = long_options(p)
    checked = 0
    for option, action in options.items():
        if isinstance(action, argparse._HelpAction):
            continue
        for n in range(3, len(option)):
            prefix = option[:n]
            starts = [o for o in options if o.startswith(prefix)]
            if option in starts and prefix not in options and len(starts) == 1:
                full = outcome(PARSERS[command](), argv_for(option, action))
                short = outcome(PARSERS[command](), argv_for(prefix, action))
                assert short == full, (command, prefix, option)
                checked += 1
                break
    assert checked > 0


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_an_ambiguous_prefix_is_refused_naming_the_possibilities(command: str) -> None:
    p = PARSERS[command]()
    options = list(long_options(p))
    ambiguous = {
        o[:n]
        for o in options
        for n in range(3, len(o))
        if len({x for x in options if x.startswith(o[:n])}) > 1 and o[:n] not in options
    }
    assert ambiguous, command
    for prefix in sorted(ambiguous):
        with pytest.raises(AmbiguousOption) as e:
            PARSERS[command]().parse_args([prefix])
        text = str(e.value)
        assert text.startswith(f"option '{prefix}' is ambiguous; possibilities: ")
        named = {w.strip("'") for w in text.split("possibilities: ")[1].split()}
        assert named == {o for o in options if o.startswith(prefix)}


def test_an_exact_name_wins_over_the_longer_options_it_starts() -> None:
    """squeue has --state and --states: --state is that option, not ambiguous."""
    assert squeue.parser().parse_args(["--state", "R"]).states == ["R"]
