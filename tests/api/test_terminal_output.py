"""Stored text never acts on the terminal of whoever lists it: a job name, reason, comment,
a node's drain reason and events holding terminal escapes (rows stored before the API refused
them, or text from agents) print as visible escapes in every human-facing command, `phalanx`
and the Slurm ones alike, and cannot forge a row of their own.

The commands run in process against the real app (as test_cli_fuzz.py runs them)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator

import pytest
from api_auth import commands_against
from fastapi.testclient import TestClient
from sqlalchemy import update
from test_api import Agent, submit
from typer.testing import CliRunner

from phalanx.cli import main as cli
from phalanx.controller.runtime import Controller
from phalanx.domain.text import CONTROL
from phalanx.slurm import main as slurm_main
from phalanx.store import schema as s

# OSC 52 (write the clipboard), clear the screen, return and a forged row, a bidi override
EVIL = "x\x1b]52;c;ZXZpbA==\x07\x1b[2J\r\nFAKE 999 alice RUNNING\u202e\x9b1m"
SLURM = ("squeue", "scontrol", "sacct", "sinfo")


@pytest.fixture
def poisoned(client: TestClient, ctl: Controller, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A job and a node whose text fields hold EVIL, written to the store directly."""

    commands_against(client, monkeypatch)
    Agent(client, "n1").register()
    (jid,) = submit(client, comment="fine")
    with ctl.store.db.begin() as conn:
        row = conn.execute(s.jobs.select().where(s.jobs.c.id == jid)).mappings().one()
        spec = {**row["spec"], "comment": EVIL}
        conn.execute(
            update(s.jobs)
            .where(s.jobs.c.id == jid)
            .values(name=EVIL, reason=EVIL, spec=spec, state="HELD")
        )
        conn.execute(
            update(s.nodes)
            .where(s.nodes.c.name == "n1")
            .values(drain=True, drain_reason=EVIL, drain_by="ops")
        )
    ctl.store.add_event("note", EVIL, job_id=jid, node="n1")
    yield jid


def _phalanx(*args: str) -> str:
    result = CliRunner().invoke(cli.app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _slurm(command: str, *args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = slurm_main.run(command, list(args), fast=False)
    assert code == 0, out.getvalue()
    return out.getvalue()


def _safe(what: str, out: str) -> None:
    bad = {ch for ch in CONTROL.findall(out) if ch != "\n"}
    assert not bad, f"{what} printed {sorted(bad)!r}:\n{out!r}"
    assert not any(line.startswith("FAKE") for line in out.splitlines()), f"{what}: {out!r}"
    assert "\\x1b" in out, f"{what} shows no trace of the stored text: {out!r}"


COMMANDS: list[tuple[str, Callable[[int], str]]] = [
    ("phalanx queue", lambda j: _phalanx("queue", "--all")),
    ("phalanx show", lambda j: _phalanx("show", str(j))),
    ("phalanx nodes", lambda j: _phalanx("nodes")),
    ("phalanx show node", lambda j: _phalanx("show", "node", "n1")),
    ("phalanx events", lambda j: _phalanx("events", str(j))),
    ("squeue", lambda j: _slurm("squeue", "-t", "all")),
    ("squeue -o", lambda j: _slurm("squeue", "-t", "all", "-o", "%i %j %k %R %P")),
    ("scontrol show job", lambda j: _slurm("scontrol", "show", "job", str(j))),
    ("scontrol show job -o", lambda j: _slurm("scontrol", "-o", "show", "job", str(j))),
    ("scontrol show node", lambda j: _slurm("scontrol", "show", "node", "n1")),
    ("sacct", lambda j: _slurm("sacct", "-j", str(j), "-o", "JobID,JobName%40,State")),
    ("sacct -P", lambda j: _slurm("sacct", "-j", str(j), "-P", "-o", "JobID,JobName,Comment")),
    ("sinfo -R", lambda j: _slurm("sinfo", "-R")),
    ("phalanx explain", lambda j: _phalanx("explain", str(j))),
]


@pytest.mark.parametrize(("what", "run"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_stored_escapes_print_as_visible_text(
    poisoned: int, what: str, run: Callable[[int], str]
) -> None:
    _safe(what, run(poisoned))
