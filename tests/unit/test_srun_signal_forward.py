"""srun forwards a signal to its step even when the signal lands while srun is in the middle of
a request to the controller.

srun polls its step's record every half second; the forward runs in srun's signal handler, in
the same thread. It once sent on the poll's own connection, which is then half-used
(http.client: "Request-sent"), so the forward failed: a batch script's `kill -USR1 $SRUN`
at a planned stop was lost, no rank checkpointed, and the work since the last checkpoint with
it (seen under load in tests/system/test_ddp.py). Here a real HTTP server stands in for the
controller and sends srun the signal while it holds srun's poll open.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx.lean_client import LeanClient
from phalanx.slurm.srun import command

JOB, STEP = "7", 0


class Controller(ThreadingHTTPServer):
    """The two routes srun's supervision uses: the step's record and the step's signal."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.signals: list[int] = []
        self.forwarded = threading.Event()
        self.polls = 0


class Handler(BaseHTTPRequestHandler):
    server: Controller

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        assert self.path == f"/v1/jobs/{JOB}/steps/{STEP}", self.path
        self.server.polls += 1
        if self.server.polls == 1:
            # srun now waits for this answer: the signal comes in the middle of its request
            os.kill(os.getpid(), signal.SIGUSR1)
            self.server.forwarded.wait(10)
        self._answer({"state": "RUNNING"})

    def do_POST(self) -> None:
        assert self.path == f"/v1/jobs/{JOB}/steps/signal", self.path
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.signals.append(int(body["signal"]))
        self._answer({"step_ids": [STEP]})
        self.server.forwarded.set()


@pytest.fixture
def controller(monkeypatch: pytest.MonkeyPatch) -> Iterator[Controller]:
    monkeypatch.setenv("PHALANX_TOKEN", "a-token")  # the stand-in does not check it
    server = Controller()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(60)
def test_a_signal_during_a_poll_of_the_step_is_forwarded(
    controller: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    caller = command.Caller.this_process()
    monkeypatch.setattr(command.Caller, "say", lambda self, text: said.append(text))
    url = f"http://127.0.0.1:{controller.server_address[1]}"
    io = command.StepIO(label=False)
    step = {"step_id": STEP, "task_ids": [[0]], "nodes": ["node01"]}
    opts = SimpleNamespace(kill_on_bad_exit=None, output="/dev/null", error=None)

    def task_ends() -> None:  # the task exits once its signal has been forwarded (or never)
        controller.forwarded.wait(20)
        with io.cond:
            io.exits[0] = {"exit_code": 0}
            io.cond.notify_all()

    ender = threading.Thread(target=task_ends, daemon=True)
    ender.start()
    before = signal.getsignal(signal.SIGUSR1)
    client = LeanClient(url)
    try:
        code = command._supervise(client, JOB, step, io, opts, caller)
    finally:
        client.close()
        io.listener.close()
    ender.join(20)
    assert signal.getsignal(signal.SIGUSR1) == before  # srun's handler is gone with the step
    assert controller.signals == [signal.SIGUSR1], said
    assert not said, said
    assert code == 0
