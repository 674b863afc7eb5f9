"""The compiled thin srun's build and its place on jobs' PATH (agent/native_srun.py,
agent/jobenv.py), with the host's real C compiler."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

from phalanx.agent import native_srun as native
from phalanx.agent.jobenv import node_environment


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package cache of the test's own (the real one is shared by this checkout's agents)."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler on this host: agents use the Python srun there")
    monkeypatch.setattr(native, "PACKAGE_CACHE", tmp_path / "pkg" / "_native")
    return tmp_path / "pkg" / "_native"


def test_built_once_per_source_and_interpreter(cache: Path, tmp_path: Path) -> None:
    first = native.thin_srun_dir(tmp_path / "state")
    assert first is not None and first.parent == cache
    exe = first / "srun"
    assert exe.read_bytes()[:4] == b"\x7fELF" and os.access(exe, os.X_OK)
    assert exe.stat().st_mode & 0o777 == 0o755  # job users run it
    made = exe.stat().st_ino
    # the next agent finds it: nothing built again
    assert native.thin_srun_dir(tmp_path / "state") == first
    assert exe.stat().st_ino == made
    # another interpreter (an upgrade, another installation) gets a build of its own
    other = native.thin_srun_dir(tmp_path / "state", python="/opt/other/bin/python3")
    assert other is not None and other != first and other.parent == cache


def test_a_package_dir_it_cannot_write_to_builds_in_the_state_dir(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(native, "PACKAGE_CACHE", blocker / "_native")
    built = native.thin_srun_dir(tmp_path / "state")
    assert built is not None and built.parent == tmp_path / "state" / "native"
    assert (built / "srun").is_file()


def test_no_compiler_means_the_python_srun_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "PACKAGE_CACHE", tmp_path / "pkg")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="phalanx.agent.native_srun"):
        assert native.thin_srun_dir(tmp_path / "state", python=sys.executable) is None
    assert "no C compiler" in caplog.text
    assert not (tmp_path / "pkg").exists()


def test_a_compiler_that_fails_is_reported_and_leaves_nothing(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setenv("CC", false)
    with caplog.at_level(logging.WARNING, logger="phalanx.agent.native_srun"):
        assert native.thin_srun_dir(tmp_path / "state") is None
    assert "failed" in caplog.text
    assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_the_node_puts_the_compiled_srun_first_on_path_once() -> None:
    d = Path("/opt/phalanx/_native/abc")
    job_env = {"PHALANX_AUTH_SOCKET": "/run/phalanx/auth.sock", "PHALANX_URL": "http://ctl"}
    env = node_environment(
        {"PATH": "/venv/bin:/usr/bin", "PHALANX_URL": "http://mine", "PHALANX_AUTH_SOCKET": "x"},
        job_env,
        d,
    )
    assert env["PATH"] == "/opt/phalanx/_native/abc:/venv/bin:/usr/bin"
    assert env["PHALANX_URL"] == "http://mine"  # the submitter's controllers win
    assert env["PHALANX_AUTH_SOCKET"] == "/run/phalanx/auth.sock"  # the node's socket wins
    # a step's environment is srun's, which has it first already
    assert node_environment(env, job_env, d)["PATH"] == env["PATH"]
    # no compiled srun, or a job without PATH: PATH as it was
    assert node_environment({"PATH": "/usr/bin"}, {}, None)["PATH"] == "/usr/bin"
    assert "PATH" not in node_environment({}, {}, d)
