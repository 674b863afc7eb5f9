"""The node's prolog, epilog and task prolog, run by the task's shepherd (agent/hooks.py says
why the shepherd and how they are configured; spec ``hooks`` holds them).

* The prolog runs as root just before the job's processes start on the node.  A failure (a
  nonzero exit, a signal, its timeout, or no way to run it) ends the launch: ``exit.json``
  says ``launch_failed`` with ``prolog_failed``, a sentence with the exit status and the start
  of the script's output, which the controller makes the node's drain reason; the job is
  requeued without spending a retry.
* The epilog runs as root once the job's processes here have all ended (and whenever a
  successful prolog ran, even if the job then could not start).  A failure adds
  ``epilog_failed`` to ``exit.json``: the node is drained, the job's own outcome is unchanged.
* The task prolog runs as the job's user in the job's directory before the batch script (or a
  step's task) starts, with the task's environment.  As Slurm's TaskProlog: each stdout line
  ``export NAME=value`` sets a variable for the task, ``unset NAME`` removes one, ``print
  TEXT`` writes TEXT to the task's output; other lines are ignored, its stderr goes to the
  task's stderr.  A failure is a launch failure (the job is retried elsewhere, as any launch).

Stdlib only and cheap to import, like every module of the shepherd (shepherd.py says why);
the runner uses fork and exec rather than ``subprocess`` (which imports ``signal``, hence
``enum``, and ``selectors``).  A hook runs in a session of its own, so a timeout kills its
children too; its output is read as it comes, and only the first ``OUTPUT_LIMIT`` bytes kept.
"""

from __future__ import annotations

import os
import select
import time

TYPE_CHECKING = False  # ``typing`` costs start-up (shepherd_files.py); annotations are strings
if TYPE_CHECKING:
    from typing import Any

    from phalanx.agent.shepherd_files import _log, _write_quiet
    from phalanx.agent.shepherd_state import _TaskState, _User
else:
    if __package__:
        from .shepherd_files import _log, _write_quiet
        from .shepherd_state import _TaskState, _User
    else:
        from shepherd_files import _log, _write_quiet
        from shepherd_state import _TaskState, _User

OUTPUT_LIMIT = 65536  # bytes of a hook's output kept (the rest is read and dropped)
REASON_OUTPUT_CHARS = 300  # how much of it a failure's sentence (a drain reason) carries
_SIGKILL = 9
_SIGPIPE, _SIGXFSZ = 13, 25  # Python ignores these; SIG_IGN would survive the exec
_POLL_MS = 50  # at most this long between looks at the hook's exit while it keeps its pipe


class _HookRun:
    """How one run of a hook ended: its wait status (None if it never ran, or was killed at
    its timeout), whether it timed out, what it wrote (bounded) and why it could not run."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.timed_out = False
        self.output = b""
        self.error: str | None = None

    @property
    def ok(self) -> bool:
        status = self.status
        return status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _run_hook(
    path: str,
    env: dict[str, str],
    timeout: float,
    *,
    user: _User | None = None,
    cwd: str = "/",
    err_fd: int = -1,
) -> _HookRun:
    """Run `path` (no arguments, stdin /dev/null) in a new session, as `user` when given,
    stdout (and stderr unless `err_fd`) captured; kill its session at `timeout` seconds."""
    run = _HookRun()
    try:
        r, w = os.pipe()
    except OSError as exc:
        run.error = f"cannot make a pipe: {exc.strerror or exc}"
        return run
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        run.error = f"cannot fork: {exc.strerror or exc}"
        return run
    if pid == 0:  # the child: never returns
        _exec_hook(path, env, user, cwd, w, err_fd)
    os.close(w)
    deadline = time.monotonic() + timeout
    kept: list[bytes] = []
    size = 0
    eof = False
    poller = select.poll()
    poller.register(r, select.POLLIN | select.POLLHUP)
    registered = True
    os.set_blocking(r, False)
    try:
        while True:
            while not eof:
                try:
                    data = os.read(r, 65536)
                except BlockingIOError:
                    break
                if not data:
                    eof = True
                elif size < OUTPUT_LIMIT:
                    kept.append(data[: OUTPUT_LIMIT - size])
                    size += len(kept[-1])
            if run.status is None:
                wpid, status = os.waitpid(pid, os.WNOHANG)
                if wpid == pid:
                    run.status = status
                    # what it wrote before it exited is in the pipe already (read above, or
                    # by one more pass); a child it left behind may hold the pipe: no wait
                    if not eof:
                        continue
            if run.status is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                run.timed_out = True
                _kill_session(pid)
                os.waitpid(pid, 0)
                break
            if eof and registered:
                poller.unregister(r)  # a closed pipe would wake every poll at once
                registered = False
            # never longer than _POLL_MS: a child the hook left behind may keep the pipe open
            # after the hook itself has exited
            poller.poll(min(int(left * 1000) + 1, _POLL_MS))
    finally:
        os.close(r)
    run.output = b"".join(kept)
    return run


def _exec_hook(
    path: str, env: dict[str, str], user: _User | None, cwd: str, out_w: int, err_fd: int
) -> None:
    what = "cannot start a new session"
    try:
        os.setsid()
        if user is not None and user.switch:
            what = f"cannot switch to user {user.name}"
            os.setgroups(user.groups)
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
        what = f"cannot change directory to {cwd}"
        os.chdir(cwd)
        what = "cannot set up its standard streams"
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_fd if err_fd >= 0 else out_w, 2)
        import _signal

        for signum in (_SIGPIPE, _SIGXFSZ):
            _signal.signal(signum, _signal.SIG_DFL)
        what = f"cannot execute {path}"
        os.execve(path, [path], env)
    except OSError as exc:
        _write_quiet(out_w, f"{what}: {exc.strerror or exc}\n")
    except BaseException as exc:
        _write_quiet(out_w, f"{what}: {exc}\n")
    finally:
        os._exit(127)


def _kill_session(pid: int) -> bool:
    """SIGKILL to the hook's whole session (the shepherd is root, or the hook runs as the
    shepherd's own user: permission is never refused); False if it was gone."""
    try:
        os.killpg(pid, _SIGKILL)  # pgid == pid: setsid made it a leader
    except ProcessLookupError:
        return False
    return True


def _excerpt(output: bytes, limit: int = REASON_OUTPUT_CHARS) -> str:
    """A hook's output as one bounded line: its non-blank lines joined with " | "."""
    text = output.decode("utf-8", "replace")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    joined = " | ".join(line for line in lines if line)
    return joined if len(joined) <= limit else joined[: limit - 3].rstrip() + "..."


def _failure_text(name: str, run: _HookRun, timeout: float) -> str | None:
    """The sentence a failed hook leaves (a drain reason), or None if it succeeded: the exit
    status, a signal, its timeout or why it could not run, then the start of its output."""
    if run.ok:
        return None
    status = run.status
    if run.error is not None:
        how = f"could not run: {run.error}"
    elif run.timed_out or status is None:
        how = f"timed out after {timeout:g}s, killed"
    elif os.WIFSIGNALED(status):
        how = f"killed by signal {os.WTERMSIG(status)}"
    else:
        how = f"exit status {os.WEXITSTATUS(status)}"
    said = _excerpt(run.output)
    return f"{name} failed ({how})" + (f": {said}" if said else "")


def _task_prolog_effects(output: bytes) -> tuple[dict[str, str], list[str], list[str]]:
    """Slurm's TaskProlog rule for its stdout: (variables to set, to unset, lines to print).
    ``export NAME=value`` sets (a later line wins), ``unset NAME`` unsets, ``print TEXT``
    prints TEXT; anything else, and a name that is not a valid variable name, is ignored."""
    sets: dict[str, str] = {}
    unsets: list[str] = []
    prints: list[str] = []
    for line in output.decode("utf-8", "replace").splitlines():
        word, _, rest = line.lstrip().partition(" ")
        if word == "export":
            name, eq, value = rest.strip().partition("=")
            if eq and _valid_name(name):
                sets[name] = value
                if name in unsets:
                    unsets.remove(name)
        elif word == "unset":
            name = rest.strip()
            if _valid_name(name):
                sets.pop(name, None)
                unsets.append(name)
        elif word == "print":
            prints.append(rest)
    return sets, unsets, prints


def _valid_name(name: str) -> bool:
    return bool(name) and not name[0].isdigit() and all(c == "_" or c.isalnum() for c in name)


class _Hooks(_TaskState):
    """The shepherd's part that runs the node's hooks around the job."""

    def _hook(self, name: str) -> dict[str, Any] | None:
        hooks = self.spec.get("hooks")
        hook = hooks.get(name) if isinstance(hooks, dict) else None
        if not isinstance(hook, dict) or not isinstance(hook.get("path"), str):
            return None
        return hook

    def _root_hook_env(self, hook: dict[str, Any]) -> dict[str, str]:
        env = hook.get("env")
        out = {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}
        user = self.user
        if user is not None:
            out["SLURM_JOB_UID"], out["SLURM_JOB_GID"] = str(user.uid), str(user.gid)
        else:
            out["SLURM_JOB_UID"], out["SLURM_JOB_GID"] = str(os.getuid()), str(os.getgid())
        return out

    def _run_root_hook(self, name: str) -> str | None:
        """Run the prolog or epilog if the spec has one; the failure's sentence, or None."""
        hook = self._hook(name)
        if hook is None:
            return None
        timeout = float(hook.get("timeout") or 30.0)
        began = time.monotonic()
        run = _run_hook(hook["path"], self._root_hook_env(hook), timeout)
        failed = _failure_text(name, run, timeout)
        took = time.monotonic() - began
        if failed:
            _log(f"{failed} (after {took:.1f}s)")
        return failed

    def _prolog(self) -> str | None:
        """The prolog (if any), before the job starts here; the epilog is due from now on
        whatever happens next, unless the prolog failed (Slurm runs no epilog then either)."""
        failed = self._run_root_hook("prolog")
        if failed:
            self.prolog_failed = failed
        else:
            self.epilog_due = True
        return failed

    def _epilog(self, result: dict[str, Any]) -> None:
        """The epilog, once the job's processes here have all ended; its failure goes into
        the exit record (`result`), which is not otherwise changed."""
        if not self.epilog_due:
            return
        self.epilog_due = False
        failed = self._run_root_hook("epilog")
        if failed:
            result["epilog_failed"] = failed

    def _task_prolog(self, env: dict[str, str]) -> str | None:
        """The task prolog (if any, and not for a holder task that runs nothing of the
        job's) as the job's user in the job's directory: its exports change `env` in place,
        its prints go to the task's output.  Returns the failure's sentence, or None."""
        hook = self._hook("task_prolog")
        if hook is None or self.spec.get("holder"):
            return None
        timeout = float(hook.get("timeout") or 30.0)
        run_env = dict(env)
        user = self.user
        if user is not None:
            run_env["USER"] = run_env["LOGNAME"] = user.name
            run_env["HOME"] = user.home
        run = _run_hook(
            hook["path"], run_env, timeout, user=user, cwd=os.getcwd(), err_fd=self.err_fd
        )
        failed = _failure_text("task prolog", run, timeout)
        if failed:
            return failed
        sets, unsets, prints = _task_prolog_effects(run.output)
        for name in unsets:
            env.pop(name, None)
        env.update(sets)
        if prints and self.out_fd >= 0:
            _write_quiet(self.out_fd, "".join(f"{line}\n" for line in prints))
        return None
