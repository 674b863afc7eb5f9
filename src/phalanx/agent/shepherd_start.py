"""Starting the job: read the spec, find the user, open the outputs, enter the working
directory, make the cgroup, fork and exec.

One part of the shepherd process (``shepherd._Shepherd``); everything that can
go wrong before the job runs ends here as a :class:`_LaunchError`, which the supervisor
records as ``launch_failed`` (with ``job_error`` when the job's own request is at fault).

Who the job runs as (spec ``user``): the user's uid, primary gid and supplementary groups from
the node's user database, with USER, LOGNAME and HOME set.  Output files are opened, the
checkpoint directory created and the working directory entered with that user's rights, so
``-o /etc/passwd`` fails ("cannot open output file /etc/passwd: Permission denied") without
touching the file.  An unknown user, or a file or directory the user may not use, ends the
launch with ``job_error: true`` in ``exit.json`` besides ``launch_failed``: the job's own
problem, which the controller does not blame on the node.  A shepherd that is not root runs
only its own user's jobs.  Without ``user`` in the spec the job runs as the shepherd does.

Containment (spec ``cgroup``, a plan made by the agent with :mod:`cgroups`, and ``cpus``):
the shepherd creates the attempt's cgroup, the child joins it before it drops root, sets its
CPU affinity, and the OOM-kill count read is that cgroup's.  When the job has ended (and its
process group been cleaned up), whatever is still in the cgroup, including processes that left
the process group, is killed and the cgroup removed, before ``exit.json`` is written.
"""

from __future__ import annotations

import errno  # builtin modules: free to import
import os
import pwd
import time

TYPE_CHECKING = False  # ``typing`` costs start-up (shepherd_files.py); annotations are strings
if TYPE_CHECKING:
    import signal as _signal
    from typing import Any

    from phalanx.agent import cgroups as _cgroups
    from phalanx.agent.shepherd_files import SPEC_FILE, _log, _read_json, _write_quiet
    from phalanx.agent.shepherd_state import _TaskState, _User
else:  # ``_signal`` avoids importing ``enum`` (shepherd.py)
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal
    # siblings: top-level modules in the shepherd process (see shepherd.py)
    if __package__:
        from . import cgroups as _cgroups
        from .shepherd_files import SPEC_FILE, _log, _read_json, _write_quiet
        from .shepherd_state import _TaskState, _User
    else:
        import cgroups as _cgroups
        from shepherd_files import SPEC_FILE, _log, _read_json, _write_quiet
        from shepherd_state import _TaskState, _User

# Python sets these to SIG_IGN at startup and SIG_IGN survives exec, so reset them for the job.
_RESTORE_DEFAULT = (_signal.SIGPIPE, _signal.SIGXFSZ)


class _LaunchError(Exception):
    """The job could not be started; the message is meant for humans (and the job's stderr).

    ``job_error``: the job's own request is the cause (its user is unknown here, it may not
    open its output file or enter its directory), not the node: exit.json says
    ``job_error: true`` and the controller ends the job FAILED instead of retrying it.
    """

    def __init__(self, message: str, *, job_error: bool = False) -> None:
        super().__init__(message)
        self.job_error = job_error


# errno values that mean "this user may not": the job's fault, not the node's.
_DENIED = (1, 13)  # EPERM, EACCES


class _JobStart(_TaskState):
    """The shepherd's part that starts the job (and makes and removes its cgroup)."""

    def _load_spec(self) -> dict[str, Any]:
        try:
            spec = _read_json(self._path(SPEC_FILE))
        except (OSError, ValueError) as exc:
            raise _LaunchError(f"cannot read {SPEC_FILE}: {exc}") from exc
        if spec is None:
            raise _LaunchError(f"{SPEC_FILE} not found in {self.task_dir}")
        if not isinstance(spec, dict):
            raise _LaunchError(f"invalid {SPEC_FILE}: not a JSON object")
        argv, env = spec.get("argv"), spec.get("env")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise _LaunchError(f"invalid {SPEC_FILE}: argv must be a non-empty list of strings")
        if not (
            isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise _LaunchError(f"invalid {SPEC_FILE}: env must map strings to strings")
        if not isinstance(spec.get("stdout"), str):
            raise _LaunchError(f"invalid {SPEC_FILE}: stdout must be a path")
        grace = spec.get("kill_grace_s")
        self.grace = float(grace) if isinstance(grace, int | float) else 10.0
        self.spec = spec
        return spec

    def _open_outputs(self, spec: dict[str, Any]) -> None:
        """Open stdout/stderr files; the same file (even via symlink) shares one fd.

        Two separate truncating descriptions of one file would overwrite each other's output.
        """
        io = spec.get("io")
        if isinstance(io, dict) and io.get("pty"):
            return self._open_terminal(io)
        if isinstance(io, dict) and io.get("stdout"):
            # a step task whose output streams to its srun (files given with srun -o/-e win)
            self.out_fd = _connect_stream(io, "out")
            self.err_fd = _connect_stream(io, "err") if io.get("stderr") else self.out_fd
            if io.get("stdin"):
                # srun forwards stdin (its own, and sattach's) on the task's stdout
                # connection, and shuts its sending side down at their end: the task reads
                # it as its stdin (without the flag: /dev/null, as an older srun expects)
                self.stdin_fd = self.out_fd
            if not io.get("stderr"):
                return self._open_one_output(spec)
            return
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_APPEND if spec.get("open_mode") == "append" else os.O_TRUNC
        cwd = spec.get("cwd") or "/"
        out_path = os.path.join(cwd, spec["stdout"])  # relative paths: to the job's cwd
        self.out_fd = _open_output(out_path, flags)
        err_path = spec.get("stderr")
        if isinstance(err_path, str):
            err_path = os.path.join(cwd, err_path)
        if not isinstance(err_path, str) or err_path == out_path:
            self.err_fd = self.out_fd
            return
        err_fd = _open_output(err_path, flags)
        a, b = os.fstat(self.out_fd), os.fstat(err_fd)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            os.close(err_fd)
            err_fd = self.out_fd
        self.err_fd = err_fd

    def _open_terminal(self, io: dict[str, Any]) -> None:
        """``srun --pty``: task 0 on a pseudo-terminal relayed to srun (agent/ptys.py); the
        other tasks' output goes nowhere, as Slurm's ``--pty`` does."""
        if io.get("task") != 0:
            self.out_fd = self.err_fd = os.open(os.devnull, os.O_WRONLY)
            return
        try:
            self.out_fd = self.err_fd = _ptys().task_terminal(io, _connect_stream)
        except OSError as exc:
            raise _LaunchError(f"cannot open the step's terminal: {exc}") from exc
        self.tty = True

    def _open_one_output(self, spec: dict[str, Any]) -> None:
        """A step task with its stdout streamed and its stderr to a file (srun -e FILE)."""
        err_path = spec.get("stderr")
        if not isinstance(err_path, str):
            self.err_fd = self.out_fd
            return
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_APPEND if spec.get("open_mode") == "append" else os.O_TRUNC
        err_path = os.path.join(spec.get("cwd") or "/", err_path)
        self.err_fd = _open_output(err_path, flags)

    def _write_stderr(self, msg: str) -> None:
        """Put launch errors where the user looks first: the job's own error file (Slurm does)."""
        fd = self.err_fd if self.err_fd >= 0 else self.out_fd
        if fd < 0:
            return
        _write_quiet(fd, f"phalanx-shepherd: error: {msg}\n")

    def _resolve_user(self, spec: dict[str, Any]) -> _User | None:
        """The job's user from the node's user database (None: the spec names none, run as
        the shepherd's own user).  Unknown here: a job error (the job ends FAILED)."""
        name = spec.get("user")
        if name is None:
            return None
        node = spec.get("node") or "this node"
        if not isinstance(name, str) or not name:
            raise _LaunchError(f"invalid {SPEC_FILE}: user must be a name")
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise _LaunchError(f"user {name} is unknown on {node}", job_error=True) from None
        euid = os.geteuid()
        if euid != 0 and pw.pw_uid != euid:
            try:
                me = pwd.getpwuid(euid).pw_name
            except KeyError:
                me = f"uid {euid}"
            raise _LaunchError(
                f"the agent on {node} runs as {me}, not root, so it cannot start jobs as {name}"
            )
        try:
            groups = os.getgrouplist(name, pw.pw_gid)
        except OSError as exc:
            raise _LaunchError(f"cannot read the groups of {name} on {node}: {exc}") from exc
        return _User(name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)

    def _as_user(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` with the job user's effective uid, gid and groups, so files are
        opened and directories entered with that user's rights (and created owned by the
        user).  The shepherd is single-threaded, so changing them for a moment is safe."""
        user = self.user
        if user is None or not user.switch:
            fn(*args)
            return
        saved = os.getgroups()
        os.setgroups(user.groups)
        os.setegid(user.gid)
        os.seteuid(user.uid)
        try:
            fn(*args)
        finally:
            os.seteuid(0)
            os.setegid(0)
            os.setgroups(saved)

    def _enter_workdir(self, spec: dict[str, Any]) -> None:
        """Create the checkpoint directory and enter the job's working directory, as the job's
        user (the shepherd's cwd becomes the job's, nothing else depends on it)."""
        cwd = spec.get("cwd") or "/"
        ck = spec.get("checkpoint")
        if isinstance(ck, dict) and ck.get("enabled") and isinstance(ck.get("dir"), str):
            try:
                os.makedirs(ck["dir"], exist_ok=True)
            except OSError as exc:  # the job may not need it; say why if it does
                self._write_stderr(f"cannot create checkpoint directory {ck['dir']}: {exc}")
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise _LaunchError(
                f"cannot change directory to {cwd}: {exc.strerror}",
                job_error=exc.errno in _DENIED,
            ) from exc

    def _setup_cgroup(self, spec: dict[str, Any]) -> None:
        """Create the attempt's cgroup from the agent's plan (spec ``cgroup``).  A failure ends
        the launch when the plan is required, else the job runs without (logged)."""
        cpus = spec.get("cpus")
        if isinstance(cpus, list) and all(isinstance(c, int) for c in cpus):
            self.cpus = cpus
        plan = spec.get("cgroup")
        if not isinstance(plan, dict):
            return
        if plan.get("join_only"):
            # a step task joins its job's cgroup on this node, which the job's own shepherd
            # made and removes: nothing to create, and never removed from here
            self.cgroup = plan
            return
        try:
            _cgroups.setup(plan)
        except OSError as exc:
            self.cgroup = plan  # remove what was made
            self._remove_cgroup()
            if plan.get("required", True):
                raise _LaunchError(f"cannot set up the job's cgroup: {exc}") from exc
            _log(f"running without a cgroup: {exc}")
            return
        self.cgroup = plan

    def _remove_cgroup(self) -> None:
        """Kill whatever is left in the job's cgroup and remove it."""
        plan, self.cgroup = self.cgroup, None
        if plan is None or plan.get("join_only"):
            return
        left = _cgroups.remove(plan)
        if left:
            _log(f"cannot remove cgroups {', '.join(left)} (the agent retries)")

    def _spawn(self, spec: dict[str, Any]) -> None:
        """Start the job as a new session (and process-group) leader, as its user.

        ``fork``, then in the child: new session, join the job's cgroup (while still root),
        CPU affinity, groups, gid, uid, stdio, ``execve``.  An exec error travels back on a
        close-on-exec pipe, so it is known before this returns (EOF = the exec happened).
        The working directory is already the job's (:meth:`_enter_workdir`).  SIG_IGN
        dispositions survive exec, so those Python set are reset to SIG_DFL; caught signals
        are reset by exec itself.
        """
        argv: list[str] = spec["argv"]
        env: dict[str, str] = dict(spec["env"])
        user = self.user
        if user is not None:
            env["USER"] = env["LOGNAME"] = user.name
            env["HOME"] = user.home
        devnull = os.open(os.devnull, os.O_RDONLY)
        err_r, err_w = os.pipe()  # both close-on-exec
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(err_r)
            os.close(err_w)
            os.close(devnull)
            raise _LaunchError(f"cannot fork the job: {exc.strerror}") from exc
        if pid == 0:  # the child: never returns
            self._exec_child(argv, env, devnull, err_w)
        os.close(err_w)
        os.close(devnull)
        chunks = []
        try:
            while chunk := os.read(err_r, 4096):
                chunks.append(chunk)
        finally:
            os.close(err_r)
        if chunks:
            os.waitpid(pid, 0)
            raise _LaunchError(b"".join(chunks).decode(errors="replace"))
        self.pid = pid
        self.started_at = time.time()
        self.start_mono = time.monotonic()

    def _exec_child(self, argv: list[str], env: dict[str, str], devnull: int, err_w: int) -> None:
        what = "cannot start a new session"
        try:
            os.setsid()
            if self.tty:
                what = "cannot make the step's terminal the controlling terminal"
                _ptys().make_controlling(self.out_fd)
            if self.cgroup is not None:
                what = "cannot join the job's cgroup"
                _cgroups.attach_self(self.cgroup)
            if self.cpus:
                what = f"cannot set the CPU affinity to {self.cpus}"
                os.sched_setaffinity(0, self.cpus)
            user = self.user
            if user is not None and user.switch:
                what = f"cannot switch to user {user.name}"
                os.setgroups(user.groups)
                os.setresgid(user.gid, user.gid, user.gid)
                os.setresuid(user.uid, user.uid, user.uid)
            what = "cannot set up the job's standard streams"
            stdin = self.out_fd if self.tty else self.stdin_fd
            os.dup2(stdin if stdin >= 0 else devnull, 0)
            os.dup2(self.out_fd, 1)
            os.dup2(self.err_fd, 2)
            for signum in _RESTORE_DEFAULT:
                _signal.signal(signum, _signal.SIG_DFL)
            what = f"cannot execute {argv[0]}"
            os.execve(argv[0], argv, env)
        except OSError as exc:
            _write_quiet(err_w, f"{what}: {exc.strerror or exc}")
        except BaseException as exc:  # e.g. ValueError: NUL byte or "=" in a variable name
            _write_quiet(err_w, f"{what}: {exc}")
        finally:
            os._exit(127)


def _open_output(path: str, flags: int) -> int:
    """Open one of the job's output files (the caller runs it as the job's user, so the user's
    rights decide what may be opened).  ``O_NONBLOCK``: a FIFO without a reader fails at once
    instead of blocking the shepherd for ever (it could then neither stop nor fence its job);
    the descriptor is made blocking again for the job.  ``O_NOCTTY``: a terminal named as the
    output never becomes the shepherd's controlling terminal."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise _LaunchError(
                f"cannot open output file {path}: a FIFO with no reader", job_error=True
            ) from exc
        raise _LaunchError(
            f"cannot open output file {path}: {exc.strerror}", job_error=exc.errno in _DENIED
        ) from exc
    os.set_blocking(fd, True)
    return fd


def _ptys() -> Any:
    """agent/ptys.py, imported only for ``srun --pty`` tasks (as ``cgroups`` is found)."""
    if __package__:
        from . import ptys
    else:
        import ptys  # type: ignore[no-redef]
    return ptys


def _connect_stream(io: dict[str, Any], what: str) -> int:
    """A connection to the step's srun carrying one stream of one task, as a plain fd.

    The first line names the step's cookie (so nobody else can inject output), the task and
    the stream (``out``, ``err`` or ``exit``); the task then writes straight into the socket.
    ``_socket`` rather than ``socket``: the latter imports ``enum`` (startup cost, see top).
    """
    import _socket

    try:
        sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect((str(io["host"]), int(io["port"])))
        sock.settimeout(None)
        sock.sendall(f"{io['cookie']} {int(io['task'])} {what}\n".encode())
        return int(sock.detach())
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise _LaunchError(
            f"cannot reach srun at {io.get('host')}:{io.get('port')}: {exc}"
        ) from exc
