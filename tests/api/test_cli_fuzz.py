"""No input to any command ends in a traceback: random arguments to `phalanx` and to the Slurm
commands, against the real API in process (typer's runner for `phalanx`, the commands' own
`main(argv)` for Slurm's), give a clear error and an exit status, or do what they say.

The arguments mix each command's real option names with hostile values: empty strings,
control characters, huge and negative numbers, malformed ids, hostlists and times, long text.
Commands that start daemons, write key files, or wait for a job to end (`up`, `agent`,
`keys`, `wait`, `srun`, ...) are left out: they are not argument parsers with a quick answer.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from api_auth import commands_against
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api import submit
from typer.testing import CliRunner

from phalanx.cli import main as cli
from phalanx.slurm import main as slurm_main

# not quick argument parsers: daemons, key/token files, waiting, running a step
SKIP = {
    *("up", "down", "agent", "controller", "authd", "command-server", "sim", "keys", "wait"),
    *("token", "slurm-commands"),  # writes files: tokens, the compiled commands' links
}
SLURM = ("sbatch", "squeue", "scancel", "sinfo", "scontrol", "sacct", "sshare", "sprio", "sattach")

HOSTILE = st.sampled_from(
    [
        "",
        " ",
        "-",
        "--",
        "0",
        "-1",
        "1",
        "2_3",
        "99999999999999999999999",
        "1e308",
        "nan",
        "inf",
        "1-",
        "1_",
        "_1",
        "node[",
        "node[3-1]",
        "node[01-99999999]",
        "a,b,,c",
        "%",
        "%j%x%A",
        "1:2:3:4:5",
        "-5-00:00:00",
        "UNLIMITED",
        "now+",
        "now+-5",
        "\x1b[31mred",
        "line\nbreak",
        "tab\there",
        "é✓漢字",
        "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
        "x" * 5000,
        "{}",
        '{"a": [' * 50,
        "../../etc/passwd",
        "/dev/zero",
        "gpu:h100:-1",
        "gpu:0",
        "afterok:",
        "afterok:abc",
        "USR1@",
        "B:KILL@-1",
        "=",
        "key=",
        "=value",
    ]
)
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30
)


def _command_options() -> dict[tuple[str, ...], list[str]]:
    """Every `phalanx` command path (with groups' subcommands) and its option names."""
    root = typer.main.get_command(cli.app)
    out: dict[tuple[str, ...], list[str]] = {}

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        if hasattr(cmd, "commands"):  # a group (typer's own click classes)
            for name, sub in cmd.commands.items():
                walk(sub, (*path, name))
            return
        out[path] = [o for p in cmd.params for o in getattr(p, "opts", []) if o.startswith("-")]

    assert hasattr(root, "commands")
    for name, sub in root.commands.items():
        if name not in SKIP:
            walk(sub, (name,))
    return out


PHALANX = _command_options()
SLURM_OPTIONS: dict[str, list[str]] = {
    "sbatch": ["-N", "-n", "-c", "-t", "-J", "-p", "--array", "--dependency", "--wrap", "-o"],
    "squeue": ["-j", "-u", "-t", "-o", "-O", "--format", "-p", "-w", "-h", "--states"],
    "scancel": ["-u", "-t", "-s", "--signal", "-n", "-b", "-f"],
    "sinfo": ["-N", "-n", "-o", "-O", "-p", "-t", "-R", "-h"],
    "scontrol": ["show", "job", "node", "update", "hold", "release", "requeue", "JobId="],
    "sacct": ["-j", "-u", "-S", "-E", "-o", "--format", "-s", "-X", "-n", "-P", "--name"],
    "sshare": ["-A", "-u", "-l", "-a", "-o", "-P"],
    "sprio": ["-j", "-u", "-l", "-o", "-w"],
    "sattach": ["-l", "--layout", "--input-filter", "--output-filter", "-Q", "-v", "1.0"],
}


def _args(options: list[str]) -> st.SearchStrategy[list[str]]:
    word = st.one_of(st.sampled_from(options or ["--help"]), HOSTILE, TEXT)
    return st.lists(word, max_size=6)


@pytest.fixture
def api(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """Both command families talk to `client`'s app, as an operator; a job exists (1)."""

    commands_against(client, monkeypatch)
    submit(client)
    yield client


def _no_traceback(what: str, code: int, out: str, exc: BaseException | None) -> None:
    shown = f"{what} -> {code}\n{out[-3000:]}"
    if exc is not None and not isinstance(exc, SystemExit):
        raise AssertionError(f"{shown}\nraised {exc!r}") from exc
    assert "Traceback" not in out, shown
    assert code in (0, 1, 2), shown
    if code:  # says what is wrong (Slurm's own words where the command mimics Slurm's)
        assert out.strip(), shown


def run_phalanx(path: tuple[str, ...], args: list[str]) -> None:
    result = CliRunner().invoke(cli.app, [*path, *args], catch_exceptions=True)
    exc = result.exception
    code = result.exit_code if exc is None or isinstance(exc, SystemExit) else -1
    _no_traceback(f"phalanx {' '.join([*path, *args])!r}", code, result.output, exc)


@contextlib.contextmanager
def _stdin(stream: io.TextIOWrapper) -> Iterator[None]:
    """sbatch without a script reads it from standard input, as Slurm's does."""
    import sys

    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def run_slurm(command: str, args: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    exc: BaseException | None = None
    code = 0
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _stdin(io.TextIOWrapper(io.BytesIO(b"#!/bin/sh\necho from stdin\n"))),
    ):
        try:
            code = slurm_main.run(command, args, fast=False)
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else 1
        except BaseException as e:
            exc, code = e, -1
    _no_traceback(f"{command} {args!r}", code, out.getvalue() + err.getvalue(), exc)


FUZZ = settings(
    max_examples=int(os.environ.get("PHX_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(data=st.data())
def test_phalanx_commands_never_trace_back(api: TestClient, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(PHALANX)), label="command")
    args = data.draw(_args(PHALANX[path]), label="args")
    run_phalanx(path, args)


@FUZZ
@given(data=st.data())
def test_slurm_commands_never_trace_back(api: TestClient, data: st.DataObject) -> None:
    command = data.draw(st.sampled_from(SLURM), label="command")
    args = data.draw(_args(SLURM_OPTIONS[command]), label="args")
    run_slurm(command, args)


@pytest.mark.parametrize(
    "args",
    [
        ("show", ""),
        ("show", " "),
        ("show", "job", ""),
        ("show", "node", ""),
        ("cancel", ""),
        ("hold", ""),
        ("explain", ""),
        ("eff", ""),
        ("drain", "", "--reason", "x"),
        ("cancel", "²"),
        ("show", "1²"),
        ("hold", "³_1"),
    ],
)
def test_empty_and_odd_ids_are_refused_in_one_line(api: TestClient, args: tuple[str, ...]) -> None:
    """`phalanx show ""` ended in a JSONDecodeError traceback, and `phalanx cancel ²` in a
    500 from the controller: "²".isdigit() is true, and int("²") raises."""
    result = CliRunner().invoke(cli.app, list(args), catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "error" in result.output.lower(), result.output


def test_an_endless_script_file_is_refused_not_read_whole(api: TestClient) -> None:
    """`sbatch /dev/zero` read until memory ran out; a script longer than a controller
    stores is refused after reading just past the limit."""
    run_slurm("sbatch", ["/dev/zero"])
    result = CliRunner().invoke(cli.app, ["submit", "/dev/zero"], catch_exceptions=True)
    assert result.exit_code == 1 and "longer than 4 MiB" in result.output, result.output


def test_the_clients_script_limit_is_the_controllers() -> None:
    """The client reads a script up to what a controller stores (it keeps its own copy of
    the number: the CLI does not import the job model's pydantic classes to start)."""
    from phalanx.domain.spec import MAX_SCRIPT_BYTES
    from phalanx.submitting import MAX_SCRIPT_READ

    assert MAX_SCRIPT_READ == MAX_SCRIPT_BYTES
