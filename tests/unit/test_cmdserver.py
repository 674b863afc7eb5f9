"""The command server's decisions (slurm/cmdserver.py): how a request is read, which calls it
serves, and how a worker's end is reported to the compiled command."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.slurm.cmdserver import (
    SERVED,
    BadRequest,
    Request,
    exit_line,
    parse_request,
    refusal,
)

PY = sys.executable


def payload(
    command: str = "squeue",
    args: list[str] | None = None,
    env: list[str] | None = None,
    *,
    cwd: str = "/tmp",
    umask: str = "22",
    python: str = PY,
) -> bytes:
    """What slurm/commands.c sends: fields joined by NUL, no trailing NUL."""
    a = args or []
    fields = ["cmd1", python, command, cwd, umask, str(len(a)), *a, *(env or [])]
    return b"\0".join(os.fsencode(f) for f in fields)


def test_a_request_read_field_by_field() -> None:
    r = parse_request(
        payload("sbatch", ["-J", "a b", "--wrap=echo =x"], ["A=1", "B=x=y", "EMPTY="])
    )
    assert r == Request(
        python=PY,
        command="sbatch",
        cwd="/tmp",
        umask=0o22,
        args=["-J", "a b", "--wrap=echo =x"],
        env={"A": "1", "B": "x=y", "EMPTY": ""},
    )


def test_empty_arguments_and_environment_are_kept_apart() -> None:
    # an empty argument is an argument ("" in sbatch -J ""), not the end of the list
    r = parse_request(payload("squeue", ["", "-h"], []))
    assert r.args == ["", "-h"] and r.env == {}


@given(
    args=st.lists(
        st.text(
            alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
            max_size=8,
        )
    ),
    env=st.dictionaries(
        st.text(
            alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0="),
            min_size=1,
            max_size=6,
        ),
        st.text(
            alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
            max_size=6,
        ),
        max_size=5,
    ),
)
def test_any_arguments_and_environment_come_through(args: list[str], env: dict[str, str]) -> None:
    r = parse_request(payload("sacct", args, [f"{k}={v}" for k, v in env.items()]))
    assert r.args == args and r.env == env


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"cmd2\0" + os.fsencode(PY) + b"\0squeue\0/tmp\0022\x000",
        payload(umask="9"),  # not octal
        payload(umask="1777"),  # more than permission bits
        payload(args=["a"]).replace(b"\x001\0a", b"\x005\0a"),  # more arguments than sent
        payload().replace(b"\x000", b"\0-1"),
    ],
)
def test_what_is_not_a_request_is_refused(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_request(raw)


def test_who_is_served() -> None:
    r = parse_request(payload("sbatch"))
    assert refusal(r, peer_uid=1000, server_uid=0, python=PY) is None  # root serves all
    assert refusal(r, peer_uid=1000, server_uid=1000, python=PY) is None  # a user: itself
    why = refusal(r, peer_uid=1001, server_uid=1000, python=PY)
    assert why is not None and "uid 1001" in why
    # another installation's compiled command: its own Python commands, not ours
    why = refusal(r, peer_uid=0, server_uid=0, python="/opt/other/bin/python3")
    assert why is not None and "another installation" in why
    # srun has its own thin client; a name outside the list is never run here
    for name in ("srun", "phalanx", "../sbatch"):
        assert refusal(parse_request(payload(name)), 0, 0, PY) is not None
    assert set(SERVED) == {
        "sbatch",
        "squeue",
        "scancel",
        "sinfo",
        "scontrol",
        "sacct",
        "sshare",
        "sprio",
        "sdiag",
        "sstat",
        "sreport",
        "sacctmgr",
    }


def test_how_a_worker_ended() -> None:
    assert exit_line(0) == b"exit 0\n"
    assert exit_line(3 << 8) == b"exit 3\n"
    assert exit_line(signal.SIGINT) == b"signal 2\n"  # killed: the status's low bits
    assert exit_line(signal.SIGKILL) == b"signal 9\n"


def test_the_compiled_command_serves_the_same_names_as_the_server() -> None:
    """commands.c's list and SERVED are the same list (a name only one knows would be linked
    but never served, or served but never linked)."""
    import re
    from pathlib import Path

    import phalanx.slurm

    source = (Path(phalanx.slurm.__file__).parent / "commands.c").read_text()
    block = re.search(r"SERVED\[\] = \{(.*?)\};", source, re.S)
    assert block is not None
    assert re.findall(r'"([a-z]+)"', block.group(1)) == list(SERVED)
