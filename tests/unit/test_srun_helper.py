"""srun through the job's resident helper (srund.py), with real processes and a real socket:
the thin srun passes its arguments, environment, directory and stdout/stderr to the helper,
which runs the step as the full srun does; anything the helper should not run falls back to
the full srun before a step exists.

The controller and the task's shepherd are played by this test (a real HTTP server on
loopback, real connections to the step's I/O port), so srun's whole protocol is exercised
without a cluster: tests/system/test_steps.py runs the same through real agents.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

from phalanx.slurm import native, srun_fast

# imported by the full srun only (srun.py itself is loaded by importlib.import_module, which
# -X importtime does not list)
FULL_SRUN = "phalanx.slurm.lean"


class FakeController:
    """Answers srun's step requests; plays one task that prints and exits with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.bodies: list[dict[str, Any]] = []
        ctl = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ctl.bodies.append(body)
                threading.Thread(target=ctl.play_task, args=(body,), daemon=True).start()
                step = {"job_id": 7, "step_id": 0, "attempt_id": 1, "nodes": ["n1"]}
                self._answer(201, {**step, "tasks": [1], "task_ids": [[0]]})

            def do_GET(self) -> None:
                self._answer(200, {"step_id": 0, "state": "RUNNING"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def play_task(self, body: dict[str, Any]) -> None:
        """What a shepherd does: streams first, then the exit record."""
        time.sleep(0.05)  # srun has the step's answer by now (it does not need it, though)
        addr = (body["host"], body["port"])
        head = body["cookie"] + " 0 "
        with socket.create_connection(addr) as out, socket.create_connection(addr) as err:
            out.sendall(f"{head}out\n".encode() + b"hello from the task\n")
            err.sendall(f"{head}err\n".encode() + b"task stderr\n")
        with socket.create_connection(addr) as ex:
            rec = {"exit_code": self.code, "started_at": time.time(), "ended_at": time.time()}
            ex.sendall(f"{head}exit\n".encode() + json.dumps(rec).encode())


@pytest.fixture
def job_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SLURM_JOB_ID": "7",
        "TMPDIR": str(tmp_path),
        "PHALANX_TOKEN": "test-token",
        "PHX_SRUN_HOST": "127.0.0.1",
    }
    yield env
    # a full srun run by the test starts its own helper on this test's socket (the first full
    # srun of a job does): stop it, found by that socket's path (unique to this test)
    path = srun_fast.socket_path(env)
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if path is not None and (p.info["cmdline"] or [])[-2:] == ["phalanx.slurm.srund", path]
    ]
    for p in left:
        p.terminate()
    psutil.wait_procs(left, timeout=30)


def start_helper(env: dict[str, str]) -> subprocess.Popen[bytes]:
    path = srun_fast.socket_path(env)
    assert path is not None
    helper = subprocess.Popen(
        [sys.executable, "-m", "phalanx.slurm.srund", path],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert helper.poll() is None, helper.stderr.read() if helper.stderr else b""
        assert time.monotonic() < deadline, "the helper never listened"
        time.sleep(0.02)
    return helper


def srun(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed srun's path through the multi-call entry point, with -X importtime so
    the test sees what the thin srun had to import."""
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "phalanx.slurm", "srun", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def imported(stderr: str) -> set[str]:
    return {
        ln.split("|")[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")
    }


def without_imports(stderr: str) -> str:
    return "".join(ln + "\n" for ln in stderr.splitlines() if not ln.startswith("import time:"))


@contextlib.contextmanager
def caller_and_helper(
    job_env: dict[str, str], tmp_path: Path
) -> Iterator[tuple[FakeController, dict[str, str], Path, subprocess.Popen[bytes]]]:
    """A controller whose task exits 3, the caller's environment (MY_VAR differs from the
    helper's own), a working directory, and the job's helper; stopped afterwards."""
    ctl = FakeController(code=3)
    env = {**job_env, "PHALANX_URL": ctl.url, "MY_VAR": "from the caller"}
    helper = start_helper({**env, "MY_VAR": "the helper's own"})
    workdir = tmp_path / "work"
    workdir.mkdir()
    try:
        yield ctl, env, workdir, helper
    finally:
        helper.terminate()
        helper.wait(timeout=30)
        ctl.server.shutdown()


def test_the_helper_runs_the_step_for_a_thin_srun(job_env: dict[str, str], tmp_path: Path) -> None:
    with caller_and_helper(job_env, tmp_path) as (ctl, env, workdir, helper):
        r = srun(env, "-l", "echo", "hi", cwd=workdir)
        # the task's output, labelled, on srun's own stdout and stderr; its exit code
        assert r.stdout == "0: hello from the task\n", r
        # (srun reports a task's exit as it arrives, maybe before the task's last output)
        assert sorted(without_imports(r.stderr).splitlines()) == [
            "0: task stderr",
            "srun: error: n1: task 0: Exited with exit code 3",
        ], r.stderr
        assert r.returncode == 3
        # the thin srun never loaded the full srun, its HTTP client or argparse
        mods = imported(r.stderr)
        assert "phalanx.slurm.srun_fast" in mods
        assert not mods & {FULL_SRUN, "phalanx.slurm.common", "http.client", "argparse", "json"}
        # the step has the caller's command, directory and environment, not the helper's
        (body,) = ctl.bodies
        assert body["argv"] == ["echo", "hi"] and body["label"] is True
        assert body["cwd"] == str(workdir)
        assert body["env"]["MY_VAR"] == "from the caller"
        # a second srun goes through the same helper
        r2 = srun(env, "true", cwd=workdir)
        assert r2.returncode == 3 and len(ctl.bodies) == 2
        assert FULL_SRUN not in imported(r2.stderr)
        # and keeps nothing of them: no thread, no listening port per step it ran (a job
        # runs thousands of steps through one helper)
        proc = psutil.Process(helper.pid)

        def leftovers() -> tuple[int, list[Any]]:
            listening = [c for c in proc.net_connections("tcp") if c.status == "LISTEN"]
            return proc.num_threads(), listening

        deadline = time.monotonic() + 30
        while leftovers() != (1, []):
            assert time.monotonic() < deadline, f"threads and listeners left: {leftovers()}"
            time.sleep(0.05)


def test_what_the_helper_should_not_run_falls_back_to_the_full_srun(
    job_env: dict[str, str], tmp_path: Path
) -> None:
    ctl = FakeController(code=0)
    env = {**job_env, "PHALANX_URL": ctl.url}
    helper = start_helper(env)
    try:
        # an option srun refuses: the full srun says so, as it always has; nothing started
        r = srun(env, "--bogus", "true", cwd=tmp_path)
        assert r.returncode == 1
        assert "srun: error: unrecognized arguments: --bogus" in r.stderr, r.stderr
        assert FULL_SRUN in imported(r.stderr)
        # another controller than the helper's: the full srun, to that controller
        other = FakeController(code=5)
        try:
            r = srun({**env, "PHALANX_URL": other.url}, "true", cwd=tmp_path)
            assert r.returncode == 5, r.stderr
            assert FULL_SRUN in imported(r.stderr)
            assert len(other.bodies) == 1
        finally:
            other.server.shutdown()
        assert ctl.bodies == []
    finally:
        helper.terminate()
        helper.wait(timeout=30)
        ctl.server.shutdown()


def test_the_helpers_socket_is_private_and_sigterm_ends_it(
    job_env: dict[str, str],
) -> None:
    path = srun_fast.socket_path(job_env)
    assert path is not None
    helper = start_helper(job_env)
    try:
        assert os.stat(path).st_mode & 0o077 == 0  # the job's user only
    finally:
        helper.terminate()
        helper.wait(timeout=30)
    # SIGTERM (the job's end) kills it at once: its socket file stays, and a thin srun that
    # finds nobody listening there runs the full srun
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.connect(path)


def test_no_helper_outside_a_job_or_for_an_attached_batch_step(job_env: dict[str, str]) -> None:
    assert srun_fast.socket_path(job_env) == f"{job_env['TMPDIR']}/.phx-srun-7.sock"
    assert srun_fast.socket_path({**job_env, "SLURM_JOB_ID": ""}) is None
    assert srun_fast.socket_path({k: v for k, v in job_env.items() if k != "TMPDIR"}) is None
    assert srun_fast.socket_path({**job_env, srun_fast.ATTACH_ENV: "h:1:c"}) is None
    assert srun_fast.socket_path({**job_env, srun_fast.NO_HELPER_ENV: "1"}) is None


# ----------------------------------------------------------------- the compiled thin srun
@pytest.fixture(scope="module")
def compiled_srun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """srun_thin.c built as the agents build it, falling back to this interpreter."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        pytest.skip("no C compiler on this host: agents use the Python srun there")
    target = tmp_path_factory.mktemp("native") / "srun"
    native.build(compiler, sys.executable, target)
    return target


def compiled(
    exe: Path, env: dict[str, str], *args: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(exe), *args], env=env, capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_the_compiled_srun_hands_the_step_to_the_helper(
    compiled_srun: Path, job_env: dict[str, str], tmp_path: Path
) -> None:
    """Byte for byte the thin srun's request: the helper runs the step with the caller's
    command, directory and environment and writes the task's output to the caller's own
    stdout and stderr; the exit status is the step's."""
    with caller_and_helper(job_env, tmp_path) as (ctl, env, workdir, _helper):
        r = compiled(compiled_srun, env, "-l", "echo", "two words", cwd=workdir)
        assert r.stdout == "0: hello from the task\n", r
        assert sorted(r.stderr.splitlines()) == [
            "0: task stderr",
            "srun: error: n1: task 0: Exited with exit code 3",
        ], r.stderr
        assert r.returncode == 3
        (body,) = ctl.bodies
        assert body["argv"] == ["echo", "two words"] and body["label"] is True
        assert body["cwd"] == str(workdir)
        assert body["env"]["MY_VAR"] == "from the caller"


def test_the_compiled_srun_runs_the_full_srun_where_the_helper_cannot(
    compiled_srun: Path, job_env: dict[str, str], tmp_path: Path
) -> None:
    ctl = FakeController(code=4)
    env = {**job_env, "PHALANX_URL": ctl.url}
    helper = start_helper(env)
    try:
        # the helper answers `fallback` to an option srun refuses: the full srun's error
        r = compiled(compiled_srun, env, "--bogus", "true", cwd=tmp_path)
        assert r.returncode == 1
        assert "srun: error: unrecognized arguments: --bogus" in r.stderr, r.stderr
        assert ctl.bodies == []
    finally:
        helper.terminate()
        helper.wait(timeout=30)
    # no helper listening: the full srun runs the step itself
    r = compiled(compiled_srun, env, "true", cwd=tmp_path)
    assert r.returncode == 4, r.stderr
    assert len(ctl.bodies) == 1
    ctl.server.shutdown()
    # outside a job: the full srun, which says there is no controller to make a job
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    outside["PHALANX_URL"] = "http://127.0.0.1:9"
    r = compiled(compiled_srun, outside, "true", cwd=tmp_path)
    assert r.returncode == 1
    assert "srun: error: not inside a job (no SLURM_JOB_ID)" in r.stderr, r.stderr
