"""Files a job controls never trick the node side (agent/jobfiles.py and every reader of it).

The agent and the shepherds run as root and read files on a job's behalf; the job's user owns
``control/`` (checkpoint marker, progress, and may replace the checkpoint request) and may put
anything there.  For each reader, each kind of hostile file is planted where it reads:

* a symbolic link to a root-only file, and to another job's ``spec.json`` (its environment);
* a hard link to the root-only file (``fs.protected_hardlinks`` off: a file not the job's);
* a FIFO (an open or read would block for ever: a wedged agent takes its node DOWN);
* a character device (``/dev/zero``: endless);
* a huge (sparse) file;
* a regular file owned by another user.

Each must come back as absent or invalid, promptly (a reader that blocks fails the test
instead of hanging it), with nothing of the planted file's content anywhere (the result, the
log), and with the refusal logged once with its reason.  Needs root (chown, mknod).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from phalanx.agent import (
    checkpoint_requests,
    files,
    gpu_usage,
    jobfiles,
    shepherd,
    shepherd_control,
    shepherd_files,
    shepherd_hang,
    shepherd_state,
)
from phalanx.agent.agent_status import read_job_reports
from phalanx.agent.agent_stops import signals_done
from phalanx.agent.steps import StepRunner

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown and mknod need root")

JOB_UID = 54321  # the job's user (no such account is needed: files carry numeric owners)
OTHER_UID = 54322  # another user
ROOT_SECRET = "ROOT-ONLY-SECRET-7f3a"
OTHER_JOB_KEY = "OTHER-JOBS-API-KEY-91bc"
HUGE_LINE = "HUGE-FILE-FIRST-LINE"
OTHER_USERS = "OTHER-USERS-FILE-22d0"
SECRETS = (ROOT_SECRET, OTHER_JOB_KEY, HUGE_LINE, OTHER_USERS)
KINDS = ["symlink-root", "symlink-spec", "hardlink-root", "fifo", "chardev", "huge", "foreign"]
PROMPT_S = 10.0


class Node:
    """A node's state dir: the job's task dir (0711) with its control/ given to JOB_UID,
    another job's task dir with a private spec.json, and a root-only file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        tasks = root / "tasks"
        tasks.mkdir()
        self.other_spec = tasks / "99" / "spec.json"
        self.other_spec.parent.mkdir(mode=0o711)
        files.write_private_json(self.other_spec, {"env": {"API_KEY": OTHER_JOB_KEY}})
        self.root_secret = root / "root-only"
        self.root_secret.write_text(ROOT_SECRET + "\n")
        self.root_secret.chmod(0o600)
        self.task = tasks / "7"
        self.task.mkdir(mode=0o711)
        self.control = self.task / shepherd_files.CONTROL_DIR
        self.control.mkdir(mode=0o700)
        os.chown(self.control, JOB_UID, JOB_UID)
        old = time.time() - 3600  # long idle, for hang detection
        for p in (self.root_secret, self.other_spec):
            os.utime(p, (old, old))

    def plant(self, kind: str, path: Path, owner: int = JOB_UID, huge: int = 1 << 30) -> None:
        """Put a hostile `kind` of file at `path`, owned (where it is a file of its own) by
        `owner`; its modification time an hour ago."""
        if kind == "symlink-root":
            path.symlink_to(self.root_secret)
        elif kind == "symlink-spec":
            path.symlink_to(self.other_spec)
        elif kind == "hardlink-root":
            os.link(self.root_secret, path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "chardev":
            try:
                os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers
            except OSError:  # no mknod here (a container): a link to the real one
                path.symlink_to("/dev/zero")
        elif kind == "huge":
            with open(path, "w") as f:
                f.write(HUGE_LINE + "\n" + json.dumps({"path": HUGE_LINE, "step": 1}) + "\n")
                f.truncate(huge)  # sparse: no disk is spent
        elif kind == "foreign":
            path.write_text(json.dumps({"path": OTHER_USERS, "step": 5, "seq": 77}) + "\n")
            owner = OTHER_UID
        else:
            raise AssertionError(kind)
        if not path.is_symlink() and kind != "hardlink-root":
            os.chown(path, owner, owner)
            old = time.time() - 3600
            os.utime(path, (old, old))


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


@pytest.fixture
def refusals(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    jobfiles._warned.clear()  # each test sees its own refusals reported
    with caplog.at_level(logging.WARNING, logger="phalanx.agent"):
        yield caplog
    jobfiles._warned.clear()


def prompt(fn: Callable[[], Any], *fifos: Path) -> Any:
    """fn() run in a thread: its result, or a failure if it has not returned within PROMPT_S
    (the reader blocked: on a FIFO, whose writer end is then opened and closed to free it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(PROMPT_S)
    if t.is_alive():
        for f in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"the reader blocked for more than {PROMPT_S}s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def no_secret(*things: Any) -> None:
    text = " ".join(str(t) for t in things)
    for s in SECRETS:
        assert s not in text, f"{s} leaked: {text[:300]}"


def refused_once(caplog: pytest.LogCaptureFixture, path: Path) -> None:
    """Exactly one warning names `path`, with a reason and nothing of any planted content."""
    said = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(said) == 1, f"warnings about {path}: {said}"
    assert "not reading" in said[0] and "taken as absent" in said[0], said
    no_secret(said)


# ---------------------------------------------------------------------- the primitive
@pytest.mark.parametrize("kind", KINDS)
def test_the_primitive_refuses_every_hostile_kind(
    node: Node, kind: str, refusals: pytest.LogCaptureFixture
) -> None:
    p = node.control / "checkpoint.json"
    node.plant(kind, p)
    with pytest.raises(jobfiles.Refused) as refused:
        prompt(lambda: jobfiles.read_bytes(p, (JOB_UID,)), p)
    no_secret(refused.value, refused.value.reason)
    assert isinstance(refused.value, OSError)  # callers taking OSError as absent stay right
    if kind != "huge":  # a huge regular file of the job's own may be stat'ed: it is read not
        with pytest.raises(jobfiles.Refused):
            jobfiles.stat_file(p, (JOB_UID,))
    assert prompt(lambda: jobfiles.read_or_none(p, (JOB_UID,)), p) is None
    assert prompt(lambda: jobfiles.read_or_none(p, (JOB_UID,)), p) is None
    refused_once(refusals, p)


def test_the_primitive_reads_a_plain_file_of_its_owner(node: Node) -> None:
    p = node.control / "progress.json"
    p.write_text('{"step": 3}')
    os.chown(p, JOB_UID, JOB_UID)
    data, st = jobfiles.read_bytes(p, (JOB_UID,))
    assert data == b'{"step": 3}' and st.st_uid == JOB_UID
    with pytest.raises(FileNotFoundError):
        jobfiles.read_bytes(node.control / "absent", (JOB_UID,))
    # exactly the bound is read; one byte more is refused, not cut
    p.write_bytes(b"x" * 64)
    assert jobfiles.read_bytes(p, (JOB_UID,), limit=64)[0] == b"x" * 64
    with pytest.raises(jobfiles.Refused, match="more than the 63"):
        jobfiles.read_bytes(p, (JOB_UID,), limit=63)


def test_node_side_writes_replace_links_and_never_write_through_them(node: Node) -> None:
    target = node.control / "checkpoint-request.json"
    target.symlink_to(node.root_secret)
    jobfiles.replace_file(target, b"{}")
    assert node.root_secret.read_text() == ROOT_SECRET + "\n"
    assert not target.is_symlink() and target.read_bytes() == b"{}"
    assert [p.name for p in node.control.iterdir()] == [target.name]  # no temporary left
    # a directory in the way: the write fails and leaves no temporary file behind
    (node.control / "busy").mkdir()
    with pytest.raises(OSError):
        jobfiles.replace_file(node.control / "busy", b"{}")
    assert sorted(p.name for p in node.control.iterdir()) == ["busy", target.name]


# ---------------------------------------------------------------------- the agent's readers
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["checkpoint", "progress"])
def test_agent_heartbeat_reports_ignore_hostile_control_files(
    node: Node, kind: str, which: str, refusals: pytest.LogCaptureFixture
) -> None:
    name = (
        shepherd_files.CHECKPOINT_MARKER_FILE
        if which == "checkpoint"
        else shepherd_files.PROGRESS_FILE
    )
    hostile = node.control / name
    node.plant(kind, hostile)
    other = "progress" if which == "checkpoint" else "checkpoint"
    good = node.control / (
        shepherd_files.PROGRESS_FILE
        if which == "checkpoint"
        else shepherd_files.CHECKPOINT_MARKER_FILE
    )
    good.write_text('{"path": "/ck/1", "step": 4}')
    os.chown(good, JOB_UID, JOB_UID)
    got = prompt(lambda: read_job_reports(node.task), hostile)
    assert which not in got, got
    assert other in got, got  # the other, honest file is still reported
    prompt(lambda: read_job_reports(node.task), hostile)  # every heartbeat reads them
    no_secret(got, refusals.text)
    refused_once(refusals, hostile)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "hardlink-root"])
def test_the_checkpoint_request_read_and_written_whatever_the_job_put_there(
    node: Node, kind: str, refusals: pytest.LogCaptureFixture
) -> None:
    """The agent (periodic requests) and the shepherd (planned stops) read the last request
    for its seq and write the next one: a link, FIFO, device, huge or foreign file there is
    no request (seq starts again at 1) and is replaced, never written through.  (A root-owned
    file there may be the node side's own request: the hard link is not refused, and nothing
    of it is shown anywhere but its seq.)"""
    path = node.control / shepherd_files.CHECKPOINT_REQUEST_FILE
    node.plant(kind, path)
    assert prompt(lambda: checkpoint_requests.read_checkpoint_request(node.task), path) is None
    seq = prompt(
        lambda: checkpoint_requests.write_checkpoint_request(
            node.task, "interval", deadline=None, stop=False
        ),
        path,
    )
    assert seq == 1
    assert node.root_secret.read_text() == ROOT_SECRET + "\n"
    assert OTHER_JOB_KEY in node.other_spec.read_text()
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    req = checkpoint_requests.read_checkpoint_request(node.task)
    assert req is not None and req["seq"] == 1
    no_secret(req, refusals.text)
    refused_once(refusals, path)


def test_the_request_lock_is_the_nodes_so_a_job_cannot_hold_it(node: Node) -> None:
    """Requests are serialised by a lock in the task dir (root's): a job that flocks the file
    the lock used to be (control/.request.lock, which it owns) wedges nobody."""
    held = node.control / ".request.lock"
    fd = os.open(held, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        seq = prompt(
            lambda: checkpoint_requests.write_checkpoint_request(
                node.task, "x", deadline=None, stop=False
            )
        )
        assert seq == 1
    finally:
        os.close(fd)
    lock = node.task / shepherd_files.REQUEST_LOCK_FILE
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600  # nobody else may open it to flock


# ---------------------------------------------------------------------- the shepherd's readers
def job_shepherd(node: Node) -> shepherd._Shepherd:
    """A shepherd object for the job (its user JOB_UID), not started: its readers are called
    directly, as its supervision loop calls them."""
    sh = shepherd._Shepherd(str(node.task))
    sh.user = shepherd_state._User("job", JOB_UID, JOB_UID, [JOB_UID], "/")
    sh.spec = {
        "progress_timeout_s": 1,
        "env": {"PHX_PROGRESS_FILE": str(node.control / shepherd_files.PROGRESS_FILE)},
    }
    return sh


@pytest.mark.parametrize("kind", KINDS)
def test_the_shepherd_ignores_a_hostile_checkpoint_marker(
    node: Node, kind: str, refusals: pytest.LogCaptureFixture
) -> None:
    """A planned stop's grace ends early once the job reports its checkpoint: a hostile
    marker is no report (and cannot block the shepherd, which must still stop its job)."""
    marker = node.control / shepherd_files.CHECKPOINT_MARKER_FILE
    sh = job_shepherd(node)
    sh.marker_before = sh._marker_stamp()  # none yet, at the request
    sh.checkpoint_sent_at = time.time() - 7200
    node.plant(kind, marker)
    assert prompt(sh._checkpoint_reported, marker) is False
    if kind == "huge":  # a regular file of the job's: it changed since the request, but
        assert sh._marker_stamp() is not None  # its content is not read (too large)
    else:
        assert prompt(sh._marker_stamp, marker) is None
    no_secret(refusals.text)
    refused_once(refusals, marker)


@pytest.mark.parametrize("kind", KINDS)
def test_hang_detection_ignores_a_hostile_progress_file(
    node: Node, kind: str, refusals: pytest.LogCaptureFixture
) -> None:
    """--progress-timeout watches the progress file's mtime and reads its step once the job
    looks hung: only a regular file of the job's user counts (an old link target, a FIFO or
    another's file is no progress), and its step is never read from anything else."""
    progress = node.control / shepherd_files.PROGRESS_FILE
    node.plant(kind, progress)
    sh = job_shepherd(node)
    now = time.monotonic()
    again = prompt(lambda: sh._check_progress(now), progress)
    if kind == "huge":  # the job's own regular file, unchanged for an hour: it is hung
        assert sh.hung is not None and sh.hung["step"] is None
    else:
        assert sh.hung is None and again is not None and again > now
    step = prompt(lambda: shepherd_hang._progress_step(str(progress), (JOB_UID,)), progress)
    assert step is None
    no_secret(sh.hung, refusals.text)
    refused_once(refusals, progress)


# ---------------------------------------------------------------------- files the node wrote
NODE_FILE_KINDS = ["symlink-root", "symlink-spec", "fifo", "chardev", "huge", "foreign"]


def plant_node_file(node: Node, kind: str, path: Path) -> None:
    """The node's own files live in root-only directories; should one ever not be the
    agent's regular file, it is refused the same way (root-owned FIFO and device, a file
    past the node's bound of 64 MiB, a file of another user)."""
    node.plant(kind, path, owner=os.geteuid(), huge=jobfiles.MAX_NODE_FILE + 1)


@pytest.mark.parametrize("kind", NODE_FILE_KINDS)
def test_task_dir_records_are_read_only_from_the_agents_own_regular_files(
    node: Node, kind: str, refusals: pytest.LogCaptureFixture
) -> None:
    """spec.json, meta.json, exit.json, gpu-usage.json and signals-done.json through
    files.read_json and the readers built on it; shepherd_control.read_status and its JSON."""
    for name in ("meta.json", gpu_usage.USAGE_FILE, "signals-done.json", "exit.json"):
        plant_node_file(node, kind, node.task / name)
    assert prompt(lambda: files.read_json(node.task / "meta.json"), node.task / "meta.json") is None
    usage = node.task / gpu_usage.USAGE_FILE
    assert prompt(lambda: gpu_usage.read(node.task), usage) is None
    done = node.task / "signals-done.json"
    assert prompt(lambda: signals_done(node.task), done) == 0
    status = prompt(lambda: shepherd_control.read_status(node.task), node.task / "exit.json")
    assert status == {"state": "absent"}  # no exit record, no shepherd: never launched
    no_secret(refusals.text)
    for name in ("meta.json", gpu_usage.USAGE_FILE, "signals-done.json", "exit.json"):
        refused_once(refusals, node.task / name)


@pytest.mark.parametrize("kind", NODE_FILE_KINDS)
def test_step_signal_records_are_read_only_from_the_agents_own_regular_files(
    node: Node, kind: str, refusals: pytest.LogCaptureFixture
) -> None:
    """A step task's ``signals-done`` (agent/steps.py): refused as absent, then replaced by the
    agent's own record, never written through."""
    steps_dir = node.root / "steps"
    d = steps_dir / "7.0.0"
    d.mkdir(parents=True, mode=0o711)
    done = d / "signals-done"
    plant_node_file(node, kind, done)
    runner = StepRunner(
        steps_dir, node.root / "tasks", job_env={}, fence=dict, launch=lambda _d: None
    )
    prompt(lambda: runner.deliver(7, 0, []), done)
    assert done.read_text() == "0" and not done.is_symlink()
    assert node.root_secret.read_text() == ROOT_SECRET + "\n"
    no_secret(refusals.text)
    refused_once(refusals, done)


# ---------------------------------------------------------------------- output files
def test_an_output_file_that_is_a_fifo_fails_the_launch_at_once(tmp_path: Path) -> None:
    """Output files are opened as the job's user (its rights decide); a FIFO nobody reads must
    not block the shepherd for ever (it could then neither stop nor fence its job): the
    launch fails at once, the job's own error."""
    from test_shepherd import Tasks

    tasks = Tasks(tmp_path)
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    try:
        job = tasks.script("echo never\n")
        td = tasks.launch(job, stdout=str(fifo), stderr=str(tmp_path / "err"))
        result = prompt(lambda: tasks.wait_exited(td), fifo)
        assert result["launch_failed"] is True and result.get("job_error") is True
        assert result["error"] == f"cannot open output file {fifo}: a FIFO with no reader"
    finally:
        # an old shepherd blocked in its open: a reader frees it, then cleanup kills it
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        tasks.cleanup()
