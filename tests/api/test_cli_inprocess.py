"""`phalanx` user commands against the real API in process: typer's runner drives the CLI,
its Client speaks HTTP to the app through the test transport (no sockets, no threads)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from api_auth import token_for
from click.testing import Result
from fastapi.testclient import TestClient
from test_api import Agent, error_of, run_to_start, submit
from typer.testing import CliRunner

from phalanx.cli import main as cli
from phalanx.cli import output, render
from phalanx.client import Client
from phalanx.controller.runtime import Controller

Phx = Callable[..., Result]


@pytest.fixture
def phx(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> Phx:
    """Run `phalanx ARGS` as alice (an operator) against `client`'s app."""
    monkeypatch.setattr(
        output,
        "client",
        lambda _url: Client(
            "http://testserver",
            token=token_for("alice", "operator"),
            transport=client._transport,
        ),
    )
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> Result:
        result = runner.invoke(cli.app, list(args), catch_exceptions=False)
        shown = f"phalanx {' '.join(args)} -> {result.exit_code}\n{result.output}"
        assert result.exit_code == code, shown
        assert "Traceback" not in result.output, shown
        return result

    return run


@pytest.fixture
def node(client: TestClient) -> Agent:
    return Agent(client, "n1")


def _events_for(ctl: Controller, n: int) -> None:
    for i in range(n):
        ctl.store.add_event("note", f"event number {i}")


# ------------------------------------------------------------------ events


def test_events_without_a_job_shows_the_latest(ctl: Controller, phx: Phx) -> None:
    _events_for(ctl, 12)
    out = phx("events", "--limit", "5").output
    messages = re.findall(r"event number (\d+)", out)
    assert messages == ["7", "8", "9", "10", "11"], out
    assert "event number 11" in phx("events").output


def test_events_of_a_job_are_not_padded_to_the_longest_message(
    client: TestClient, ctl: Controller, phx: Phx
) -> None:
    (jid,) = submit(client)
    ctl.store.add_event("note", "x" * 150, job_id=jid)
    lines = phx("events", str(jid)).output.splitlines()
    assert len(lines) >= 3, lines  # header, submit, the long note
    assert lines[-1].endswith("x" * 150)
    assert all(line == line.rstrip() for line in lines), lines
    submitted = next(line for line in lines if "submit" in line)
    assert len(submitted) < 120, submitted


def test_events_limit_out_of_bounds(client: TestClient, phx: Phx) -> None:
    err = error_of(client.get("/v1/events", params={"limit": 100_000}))
    assert err["message"] == (
        "limit: at most 10000 events per request; ask for the next ones with since=ID "
        "(the id of the last event you got)"
    )
    out = phx("events", "--limit", "0", code=2).output
    assert "--limit" in out


def test_events_pages_through_a_long_history(
    ctl: Controller, phx: Phx, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "EVENTS_PAGE", 4)
    _events_for(ctl, 13)
    out = phx("events", "--limit", "3").output
    assert re.findall(r"event number (\d+)", out) == ["10", "11", "12"], out


# ------------------------------------------------------------------ queue -t


def _queued(phx: Phx, *args: str) -> set[int]:
    out = phx("queue", *args).output.splitlines()
    return {int(line.split()[0]) for line in out[1:] if line.strip()}


def test_queue_state_filter_takes_slurm_names_and_codes(
    client: TestClient, ctl: Controller, node: Agent, phx: Phx
) -> None:
    node.register(cpus=1)
    (running,) = submit(client)
    run_to_start(ctl, node)
    (pending,) = submit(client)
    (held,) = submit(client, hold=True)
    assert _queued(phx) == {running, pending, held}
    assert _queued(phx, "-t", "PD") == {pending, held}  # HELD shows as PENDING in Slurm
    assert _queued(phx, "-t", "pending") == {pending, held}
    assert _queued(phx, "-t", "HELD") == {held}
    assert _queued(phx, "--state", "R,CF") == {running}
    assert _queued(phx, "-t", "CD") == set()
    assert _queued(phx, "-t", "all") == {running, pending, held}


def test_queue_refuses_an_unknown_state(phx: Phx) -> None:
    out = phx("queue", "-t", "bogus", code=1).output
    assert out.startswith("error: unknown job state 'bogus': ")
    assert "PD" in out and len(out.strip().splitlines()) == 1


def test_api_refuses_an_unknown_state_filter(client: TestClient) -> None:
    err = error_of(client.get("/v1/jobs", params={"state": "PENDING,R"}))
    assert err["message"].startswith("state: unknown job state 'R'")


# ------------------------------------------------------------------ cancel / hold / release


def test_actions_answer_in_the_users_job_ids(client: TestClient, phx: Phx) -> None:
    (first, second) = submit(client, array="0-1")
    assert second != first  # the task has an internal id of its own, which must not leak
    assert phx("hold", f"{first}_1").output == f"job {first}_1: held\n"
    assert phx("release", f"{first}_1").output == f"job {first}_1: released\n"
    assert phx("cancel", f"{first}_1").output == f"job {first}_1: cancelled\n"
    assert phx("cancel", str(first)).output == (
        f"job {first}_0: cancelled\njob {first}_1: already CANCELLED\n"
    )


# ------------------------------------------------------------------ show


def test_show_numbers_attempts_per_job(
    client: TestClient, ctl: Controller, node: Agent, phx: Phx
) -> None:
    node.register(cpus=4)
    for _ in range(3):  # other jobs' attempts take the first cluster-wide attempt ids
        submit(client)
    (jid,) = submit(client)
    assert ctl.schedule_tick().startswith("started 4 jobs")
    starts = {s["job_id"]: s for s in node.heartbeat()["start"]}
    assert starts[jid]["attempt_id"] == 4
    lines = [ln.strip() for ln in phx("show", str(jid)).output.splitlines()]
    attempts = [ln for ln in lines if ln.startswith("Attempt=")]
    assert len(attempts) == 1 and attempts[0].startswith("Attempt=0 State="), lines


# ------------------------------------------------------------------ wait


@pytest.fixture
def driven(
    client: TestClient, ctl: Controller, node: Agent, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """A job that moves one step on each of `phalanx wait`'s polls: started, running, done."""
    node.register(cpus=1)
    steps: list[str] = []
    start: dict[str, Any] = {}

    def step(_seconds: float) -> None:
        if not steps:
            start.update(run_to_start(ctl, node))
            steps.append("started")
        elif len(steps) == 1:
            node.heartbeat([Agent.report(start, "running")])
            steps.append("running")
        else:
            node.heartbeat([Agent.report(start, "exited", exit_code=0)])
            steps.append("exited")

    monkeypatch.setattr(cli, "_pause", step)
    return steps


def test_wait_on_a_terminal_shows_state_changes_and_a_live_line(
    client: TestClient, driven: list[str], phx: Phx, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "_is_tty", lambda: True)
    (jid,) = submit(client)
    out = phx("wait", str(jid)).output
    assert driven == ["started", "running", "exited"]
    lines = out.split("\n")
    # each line: the live line cleared, then a state change (or the outcome, then a clear)
    shown = [line.rsplit("\r\x1b[K", 1)[-1] for line in lines]
    assert shown == [
        f"job {jid}: PENDING",
        f"job {jid}: STARTING on n1",
        f"job {jid}: RUNNING on n1",
        f"job {jid}: COMPLETED exit code 0",
        "",
    ], out
    assert f"\r\x1b[Kwaiting: {jid} RUNNING (00:00:00 elapsed)" in out


def test_wait_piped_prints_only_the_outcome(
    client: TestClient, driven: list[str], phx: Phx
) -> None:
    (jid,) = submit(client)
    assert phx("wait", str(jid)).output == f"job {jid}: COMPLETED exit code 0\n"
    assert driven == ["started", "running", "exited"]


def test_wait_live_line_counts_states_of_many_jobs() -> None:
    jobs = [{"job_id": str(i), "state": "RUNNING" if i % 2 else "PENDING"} for i in range(5)]
    line = render.WaitProgress.live_line(jobs, 65.4)
    assert line == "waiting: 5 jobs: 3 PENDING, 2 RUNNING (00:01:05 elapsed)"


def test_wait_timeout_piped_prints_no_terminal_codes(client: TestClient, phx: Phx) -> None:
    (jid,) = submit(client)  # no node: it stays pending
    result = phx("wait", str(jid), "--timeout", "0.01", code=2)
    assert result.stdout == ""
    assert f"timed out after 0.01s waiting for {jid}" in result.output
