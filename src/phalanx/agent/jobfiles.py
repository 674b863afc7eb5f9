"""Files a job controls, opened safely by the node side (the agent and shepherds run as root).

Why this exists: the agent and each task's shepherd read files on a job's behalf, and some of
them live where the job's user may put anything.  ``<task dir>/control/`` belongs to the job's
user (docs/checkpoints.md): the job writes its checkpoint marker and progress file there, and
may replace the checkpoint request the node side writes there.  A plain ``open()`` by root
would let that user

* plant a symbolic link to any file (``/etc/shadow``, another job's ``spec.json`` with its
  environment and tokens): root reads it, and its first line comes back in ``phalanx show``
  and the job's events;
* plant a FIFO: the open (or the read) blocks for ever.  A wedged agent stops heartbeating,
  its node goes DOWN and every other user's job on it is requeued; a wedged shepherd can no
  longer stop or fence its job;
* plant an endless or huge file (a link to ``/dev/zero``, a sparse terabyte): an unbounded
  read exhausts the reader's memory;
* hard-link someone else's file there (where ``fs.protected_hardlinks`` is off).

So every file the node side opens for a job goes through :func:`read_bytes` (or
:func:`stat_file` where only its times matter):

1. ``lstat`` first: only a regular file owned by one of the uids the caller allows (the job's
   user for what the job writes; also the node side's own uid for what it wrote) is opened at
   all.  Opening a device or a FIFO can have effects of its own, so those are never opened.
2. ``open`` with ``O_NOFOLLOW`` (a link put there after the ``lstat`` fails), ``O_NONBLOCK``
   (nor can a FIFO block the open), ``O_NOCTTY`` (a terminal never becomes the reader's
   controlling terminal) and ``O_CLOEXEC``.
3. ``fstat`` on the open descriptor, checked again: this is the file that is read.
4. a bounded read: a file larger than the bound is refused, not truncated.

A refused file raises :class:`Refused`, an ``OSError``: callers that already take an
unreadable file as absent keep doing so.  :func:`read_or_none` does that for them and reports
the reason (never the content) once per file and reason (:func:`warn_once`).

Writes the node side makes into a directory the job's user can write go through
:func:`replace_file`: a temporary file created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a
name unique to the writer (an existing file or link there makes it fail rather than be written
through), then ``rename`` over the target (which replaces a link, never follows it).

Standard library only, and nothing that is not loaded already by ``os``: the shepherd imports
this module at its start-up, whose cost matters (see shepherd.py), as a top-level module
(``jobfiles``) or as ``phalanx.agent.jobfiles``.
"""

from __future__ import annotations

import errno  # built-in modules: free to import
import os
import stat

TYPE_CHECKING = False  # as in shepherd.py: ``typing`` costs start-up, annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable, Collection

MAX_JOB_FILE = 64 << 10  # what a job writes for the node side: a path, a step, a small JSON
MAX_NODE_FILE = 64 << 20  # what the node side wrote itself (spec.json holds the environment)
_WARNED_MAX = 4096  # (path, reason) pairs already reported, at most

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

# Where refusals are reported: the shepherd process sets its own log (shepherd_files._log); None
# means the ``phalanx.agent`` logger (the agent, tests).
warn: Callable[[str], None] | None = None
_warned: dict[tuple[str, str], None] = {}


class Refused(OSError):
    """A file the node side will not read for a job; ``reason`` says why, never what is in it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def check(path: str, st: os.stat_result, owners: Collection[int]) -> None:
    """Raise :class:`Refused` unless ``st`` is a regular file owned by one of ``owners``."""
    if not stat.S_ISREG(st.st_mode):
        raise Refused(path, f"{_kind(st.st_mode)}, not a regular file")
    if st.st_uid not in owners:
        allowed = " or ".join(f"uid {u}" for u in sorted(set(owners)))
        raise Refused(path, f"owned by uid {st.st_uid}, not by {allowed}")


def stat_file(path: str | os.PathLike[str], owners: Collection[int]) -> os.stat_result:
    """The file's ``lstat``, once :func:`check` passed: for readers that need only its times
    or size.  FileNotFoundError when absent; :class:`Refused` otherwise."""
    p = os.fspath(path)
    st = os.lstat(p)
    check(p, st, owners)
    return st


def read_bytes(
    path: str | os.PathLike[str], owners: Collection[int], limit: int = MAX_JOB_FILE
) -> tuple[bytes, os.stat_result]:
    """The content and ``fstat`` of a regular file owned by one of ``owners``, at most
    ``limit`` bytes long, opened without following a link or blocking (see the module's
    docstring).  FileNotFoundError when absent, :class:`Refused` when it is anything else
    than such a file, other OSErrors as ``open``/``read`` raise them."""
    p = os.fspath(path)
    check(p, os.lstat(p), owners)  # never open a device or a FIFO
    try:
        fd = os.open(p, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the lstat
            raise Refused(p, "a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        check(p, st, owners)  # what was opened, whatever the path names now
        if st.st_size > limit:
            raise Refused(p, f"{st.st_size} bytes, more than the {limit} read")
        chunks = []
        have = 0
        while have <= limit:
            chunk = os.read(fd, limit + 1 - have)
            if not chunk:
                break
            chunks.append(chunk)
            have += len(chunk)
        if have > limit:  # it grew since the fstat
            raise Refused(p, f"more than the {limit} bytes read")
        return b"".join(chunks), st
    finally:
        os.close(fd)


def read_or_none(
    path: str | os.PathLike[str], owners: Collection[int], limit: int = MAX_JOB_FILE
) -> tuple[bytes, os.stat_result] | None:
    """:func:`read_bytes`, or None when the file is absent, unreadable or refused (a refusal
    is reported once, :func:`warn_once`)."""
    try:
        return read_bytes(path, owners, limit)
    except Refused as exc:
        warn_once(exc.path, exc.reason)
    except OSError:
        pass
    return None


def stat_or_none(path: str | os.PathLike[str], owners: Collection[int]) -> os.stat_result | None:
    """:func:`stat_file`, or None when absent, unreadable or refused (reported once)."""
    try:
        return stat_file(path, owners)
    except Refused as exc:
        warn_once(exc.path, exc.reason)
    except OSError:
        pass
    return None


def dir_owner(path: str | os.PathLike[str]) -> int:
    """The uid owning the directory at ``path`` (not a link to one): the agent gives a job's
    ``control/`` to the job's user, so its owner is whose files belong in it."""
    p = os.fspath(path)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(p, f"{_kind(st.st_mode)}, not a directory")
    return st.st_uid


def warn_once(path: str, reason: str) -> None:
    """Report that ``path`` was refused (``reason``), once per path and reason."""
    key = (path, reason)
    if key in _warned:
        return
    _warned[key] = None
    while len(_warned) > _WARNED_MAX:
        del _warned[next(iter(_warned))]
    msg = f"not reading {path} for the job: {reason}; taken as absent"
    if warn is not None:
        warn(msg)
        return
    import logging

    logging.getLogger("phalanx.agent").warning("%s", msg)


_tmp_counter = 0


def write_new(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> str:
    """Write ``data`` to a fresh temporary file next to ``path`` and return its name: created
    exclusively and without following a link, under a name unique to this process, thread
    and call, so a link or file a job's user planted at a predictable name makes it fail
    rather than be written through (a root writer would clobber the link's target)."""
    global _tmp_counter
    p = os.fspath(path)
    _tmp_counter += 1
    from _thread import get_ident

    head, name = os.path.split(p)
    tmp = os.path.join(head, f".{name}.tmp.{os.getpid()}.{get_ident()}.{_tmp_counter}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def replace_file(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Atomically replace ``path`` with ``data``, safely in a directory the job's user may
    write: :func:`write_new`, then ``rename`` over ``path`` (it replaces a link or file there,
    never writes through it).  The temporary file is removed on failure."""
    tmp = write_new(path, data, mode)
    try:
        os.replace(tmp, os.fspath(path))
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: str) -> None:
    try:  # noqa: SIM105  (no contextlib: it costs the shepherd's start-up)
        os.unlink(path)
    except OSError:
        pass


__all__ = [
    "MAX_JOB_FILE",
    "MAX_NODE_FILE",
    "Refused",
    "check",
    "dir_owner",
    "read_bytes",
    "read_or_none",
    "replace_file",
    "stat_file",
    "stat_or_none",
    "warn_once",
    "write_new",
]
