"""Signals and stops: what the shepherd does when it is signalled, asked to stop, reaches the
job's ``--signal`` time, is fenced, or finds stragglers in the job's process group.

One part of the shepherd process (``shepherd._Shepherd``).  A planned stop (a
checkpoint signal and a grace, ``stop.json``) is here too: the grace's end, the job's
checkpoint marker that ends it early, the checkpoint request before the time limit, and the
job's steps on this node that a holder (or a batch shell that exits early) waits for.

Signals understood by the shepherd:

* SIGTERM / SIGINT: stop the job, ``cancelled=true``.  The first one reads ``stop.json``; with a
  ``checkpoint_signal`` the shepherd first delivers it (to the group, or to the main process
  only if the spec's ``signal.batch_only`` is true, then SIGCONT to the group so a suspended
  job can act on it) and waits up to ``checkpoint_grace`` seconds for the job to exit by
  itself.  Then (or at once, without a checkpoint signal) the usual stop: SIGTERM to the group,
  SIGKILL after ``kill_grace_s``.  Further SIGTERMs neither restart nor cut short a running
  grace; the time limit and the fence still apply during it (and win, as the first reason).
* SIGHUP: process ``signal-*.json`` requests.
* SIGUSR1 / SIGUSR2: forwarded as-is to the job's whole process group.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # ``typing`` costs start-up (shepherd_files.py); annotations are strings
if TYPE_CHECKING:
    import signal as _signal
    from typing import Any

    from phalanx.agent import jobfiles as _jobfiles
    from phalanx.agent.checkpoint_requests import write_checkpoint_request
    from phalanx.agent.shepherd_files import (
        CHECKPOINT_MARKER_FILE,
        CONTROL_DIR,
        EXIT_FILE,
        SIGNAL_REQUEST_PREFIX,
        STEPS_SIGNALLED,
        STOP_FILE,
        _live_shepherd,
        _loads,
        _log,
        _proc_stat,
        _read_json,
    )
    from phalanx.agent.shepherd_state import _TaskState
else:  # ``_signal`` avoids importing ``enum`` (shepherd.py)
    try:
        import _signal
    except ImportError:  # pragma: no cover - non-CPython
        import signal as _signal
    # siblings: top-level modules in the shepherd process (see shepherd.py)
    if __package__:
        from . import jobfiles as _jobfiles
        from .checkpoint_requests import write_checkpoint_request
        from .shepherd_files import (
            CHECKPOINT_MARKER_FILE,
            CONTROL_DIR,
            EXIT_FILE,
            SIGNAL_REQUEST_PREFIX,
            STEPS_SIGNALLED,
            STOP_FILE,
            _live_shepherd,
            _loads,
            _log,
            _proc_stat,
            _read_json,
        )
        from .shepherd_state import _TaskState
    else:
        import jobfiles as _jobfiles
        from checkpoint_requests import write_checkpoint_request
        from shepherd_files import (
            CHECKPOINT_MARKER_FILE,
            CONTROL_DIR,
            EXIT_FILE,
            SIGNAL_REQUEST_PREFIX,
            STEPS_SIGNALLED,
            STOP_FILE,
            _live_shepherd,
            _loads,
            _log,
            _proc_stat,
            _read_json,
        )
        from shepherd_state import _TaskState

_STRAGGLER_GRACE_CAP_S = 2.0
# Signals the shepherd catches; the job gets them reset to SIG_DFL before exec.
_HANDLED = (
    _signal.SIGTERM,
    _signal.SIGINT,
    _signal.SIGHUP,
    _signal.SIGUSR1,
    _signal.SIGUSR2,
    _signal.SIGCHLD,
)


class _Stopping(_TaskState):
    """The shepherd's part that takes signals and requests and stops the job."""

    def _install_signals(self) -> None:
        """Record signals in ``pending``; the wakeup fd interrupts ``poll`` when one arrives."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wake_r = r
        _signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for signum in _HANDLED:
            _signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self.wake_r, 256):
                pass
        except BlockingIOError:
            pass

    def _handle_pending(self) -> None:
        pending, self.pending = self.pending, []
        for signum in pending:
            if signum in (_signal.SIGTERM, _signal.SIGINT):
                self._stop_requested()
            elif signum == _signal.SIGHUP:
                self._process_requests()
            elif signum in (_signal.SIGUSR1, _signal.SIGUSR2):
                self._deliver(signum, batch_only=False)

    def _stop_requested(self) -> None:
        """A stop request: checkpoint signal and grace first if ``stop.json`` asks for them.

        Only the first request is read.  Later ones leave a running grace alone and are
        otherwise plain stops (no-ops once the stop sequence has begun).
        """
        if not self.stop_requested and not self.reaped:
            self.stop_requested = True
            signum, grace, self.stop_reason, wait = self._read_stop_request()
            if signum is None and wait and grace > 0 and self.reason is None and self.pid:
                # a planned stop whose signal goes elsewhere: the grace, without a signal
                what = "the job's steps here" if self.spec.get("holder") else "the task"
                _log(
                    f"stop requested ({self.stop_reason or 'no reason given'}): waiting up to"
                    f" {grace:g}s for {what} to end before stopping"
                )
                self.marker_before = self._marker_stamp()
                if self.spec.get("holder"):  # ranks here poll the request file it writes
                    self.stop_request_seq = self._write_request(
                        self.stop_reason or "stop", time.time() + grace
                    )
                self.checkpoint_until = time.monotonic() + grace
                self.grace_ends_at = self.checkpoint_until
                return
            if signum is not None and self.reason is None and self.pid:
                sig = self.spec.get("signal")
                batch_only = isinstance(sig, dict) and bool(sig.get("batch_only"))
                _log(
                    f"stop requested ({self.stop_reason or 'no reason given'}): checkpoint"
                    f" signal {signum}{' to the main process' if batch_only else ''},"
                    f" stopping in {grace:g}s unless the job exits"
                )
                self.marker_before = self._marker_stamp()
                self.stop_request_seq = self._write_request(
                    self.stop_reason or "stop", time.time() + grace
                )
                self.checkpoint_sent_at = time.time()  # before: the job may answer at once
                self._deliver(signum, batch_only)
                self._killpg(_signal.SIGCONT)  # a suspended job must run to checkpoint
                self.checkpoint_until = time.monotonic() + grace
                self.grace_ends_at = self.checkpoint_until
                return
        if self.checkpoint_until is None:
            self._stop("cancelled")

    def _time_signal(self, sig: dict[str, Any]) -> None:
        """``--signal=[B:]SIG@N`` is due.  With ``B:``: the batch shell alone.  Without: as in
        Slurm, the job's steps and not the batch shell, while it has any running here (their
        own shepherds deliver it to them); a job with none gets it in its whole process group
        (a Phalanx extension: scripts that run their work without srun still hear it)."""
        signum, batch_only = sig.get("signum"), bool(sig.get("batch_only"))
        if "step_id" in self.spec:
            _mark_steps_signalled(self.spec)
        elif not batch_only and _steps_running(self.spec, self.task_dir):
            _log(f"time limit approaching: signal {signum} is for the job's running steps")
            return
        _log(f"time limit approaching: delivering signal {signum}")
        self._deliver(signum, batch_only)

    def _write_request(self, reason: str, deadline: float | None) -> int | None:
        """Tell the job in its request file, too (for jobs that poll rather than trap)."""
        try:
            seq = write_checkpoint_request(self.task_dir, reason, deadline=deadline, stop=True)
            _log(f"checkpoint request {seq}: {reason}")
            return seq
        except (OSError, ValueError) as exc:
            _log(f"cannot write the checkpoint request: {exc!r}")
            return None

    def _grace_done(self) -> bool:
        """Whether a planned stop's grace may end before its deadline: for a holder, once
        the job's steps on this node have ended (they live in its cgroup, so it must not go
        before them, and has nothing else to wait for); for a task, once the job reported
        the checkpoint the stop asked for."""
        if self.spec.get("holder"):
            if _live_step_tasks(self.spec):
                return False
            _log("the job's steps on this node have ended: stopping the holder")
            return True
        if self._checkpoint_reported():
            _log("checkpoint reported: the grace ends early, stopping the job")
            return True
        return False

    def _await_steps(self) -> None:
        """After a planned stop ended this task's main process, keep the job's cgroup (which
        this shepherd removes) while the job's steps on this node still run, until the
        stop's grace and then their own kill grace are over: a batch shell that exits on the
        checkpoint signal, or a holder whose grace ran out, must not kill a rank that is
        still writing its checkpoint. Steps' own shepherds stop them at the grace's end."""
        if self.grace_ends_at is None or self.reason == "fenced" or "step_id" in self.spec:
            return
        plan = self.cgroup
        if plan is None or plan.get("join_only"):
            return
        deadline = self.grace_ends_at + self.grace
        if _live_step_tasks(self.spec) and time.monotonic() < deadline:
            _log("the job's steps on this node still run: keeping its cgroup until they end")
        while _live_step_tasks(self.spec) and time.monotonic() < deadline:
            if self._fence_stale():
                _log("fenced while waiting for the job's steps: removing the cgroup now")
                return
            time.sleep(0.1)

    def _checkpoint_reported(self) -> bool:
        """Whether the job reported a checkpoint that answers the planned stop's request
        (the marker's ``request_seq`` reaches it, or a marker written since the signal): its
        grace then ends at once, since work after the checkpoint would be lost anyway."""
        path = os.path.join(self.task_dir, CONTROL_DIR, CHECKPOINT_MARKER_FILE)
        stamp = self._marker_stamp()
        if stamp is None or stamp == self.marker_before:
            return False  # no marker, or the one there before the request
        got = _jobfiles.read_or_none(path, self._job_uids())  # the job's: never a link, a FIFO
        if got is None:
            return False
        text = got[0].decode("utf-8", errors="replace")
        try:
            data = _loads(text)
        except ValueError:
            data = None
        sent = self.checkpoint_sent_at or 0.0
        if isinstance(data, dict):
            seq = data.get("request_seq")
            if (
                isinstance(seq, int)
                and not isinstance(seq, bool)
                and self.stop_request_seq is not None
            ):
                return seq >= self.stop_request_seq
            done = data.get("finished_at")
            if isinstance(done, int | float) and not isinstance(done, bool):
                return float(done) >= sent
        # a plain path (a script's `echo PATH > $PHX_CHECKPOINT_MARKER`): written since the
        # request (its mtime comes from the kernel's coarse clock, which may lag the signal's
        # time.time() by a tick, so a change of the file is what counts)
        return bool(text.strip())

    def _marker_stamp(self) -> tuple[int, int, int] | None:
        """(inode, mtime ns, size) of the checkpoint marker, None when there is none (or it
        is not a regular file of the job's user: :mod:`jobfiles`)."""
        path = os.path.join(self.task_dir, CONTROL_DIR, CHECKPOINT_MARKER_FILE)
        st = _jobfiles.stat_or_none(path, self._job_uids())
        if st is None:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _checkpoint_before_limit(self, limit_at: float | None) -> float | None:
        """When (monotonic) to ask for a checkpoint before the time limit, or None.

        Only for jobs with a checkpoint spec, and only when the grace fits in the limit.
        """
        ck = self.spec.get("checkpoint")
        if limit_at is None or not isinstance(ck, dict) or not ck.get("enabled"):
            return None
        grace = ck.get("grace_s")
        if not isinstance(grace, int | float) or grace < 0:
            return None
        at = limit_at - float(grace)
        return at if at > self.start_mono else None

    def _checkpoint_at_limit(self, limit_at: float) -> None:
        """The time limit is a planned stop: request a checkpoint and send the signal."""
        ck = self.spec["checkpoint"]
        wall_limit = time.time() + max(0.0, limit_at - time.monotonic())
        self._write_request("time limit", wall_limit)
        sig = self.spec.get("signal")
        same = isinstance(sig, dict) and sig.get("signum") == ck.get("signum")
        if (
            same
            and isinstance(sig, dict)
            and float(sig.get("before_s") or 0) == float(ck.get("grace_s") or 0)
        ):
            return  # --signal delivers the same signal at the same moment
        _log(f"time limit approaching: checkpoint signal {ck.get('signum')}")
        self._deliver(ck.get("signum"), bool(ck.get("batch_only")))
        self.checkpoint_sent_at = time.time()

    def _read_stop_request(self) -> tuple[int | None, float, str | None, bool]:
        """(checkpoint signal, grace, reason, wait) from ``stop.json``; a plain stop if
        absent or bad. ``wait``: give the grace even without a signal (`request_stop`)."""
        try:
            req = _read_json(self._path(STOP_FILE))
        except (OSError, ValueError) as exc:
            _log(f"unreadable {STOP_FILE} ({exc}): stopping without a checkpoint")
            return None, 0.0, None, False
        if not isinstance(req, dict):
            return None, 0.0, None, False
        reason = req.get("reason")
        reason = reason if isinstance(reason, str) else None
        wait = req.get("wait") is True
        grace = req.get("checkpoint_grace")
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
            grace = 0.0
        grace = min(float(grace), 1e9)
        signum = req.get("checkpoint_signal")
        if signum is None:
            return None, grace if wait else 0.0, reason, wait
        if isinstance(signum, bool) or not isinstance(signum, int) or not 0 < signum < _signal.NSIG:
            _log(f"invalid checkpoint signal {signum!r}: stopping without a checkpoint")
            return None, 0.0, reason, False
        return signum, grace, reason, wait

    def _stop(self, reason: str) -> None:
        """Begin graceful termination; the first reason wins (a timed-out job stays timed out)."""
        if self.reason is not None:
            return
        self.reason = reason
        if not self.pid or self.reaped:
            return
        grace = self.grace
        fence = self.spec.get("fence")
        if reason == "fenced" and isinstance(fence, dict) and fence.get("kill_grace_s") is not None:
            # self-fencing must finish before the controller may requeue the job elsewhere
            # (fence_timeout + fence_kill_grace + margin < node_down_timeout)
            grace = min(grace, float(fence["kill_grace_s"]))
        _log(f"stopping job ({reason}): SIGTERM, SIGKILL in {grace:g}s")
        self._killpg(_signal.SIGTERM)
        self._killpg(_signal.SIGCONT)  # a stopped job must run to see its SIGTERM
        self.kill_at = time.monotonic() + grace

    def _hurry_for_fence(self, now: float) -> None:
        """Fenced while already stopping (a cancel, the time limit): never wait longer than the
        fence's kill grace, or the job could outlive the moment it is requeued elsewhere."""
        fence = self.spec.get("fence")
        if not isinstance(fence, dict) or fence.get("kill_grace_s") is None:
            return
        deadline = now + float(fence["kill_grace_s"])
        if self.kill_at is None or self.kill_at > deadline:
            _log("fenced while stopping: SIGKILL moved forward")
            self.kill_at = deadline

    def _killpg(self, signum: int) -> bool:
        """Signal the job's process group; False if the group no longer exists."""
        if not self.pid:
            return False
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def _deliver(self, signum: Any, batch_only: bool) -> None:
        if not isinstance(signum, int) or not 0 < signum < _signal.NSIG:
            _log(f"ignoring invalid signal number {signum!r}")
            return
        if not self.pid or self.reaped:
            return
        try:
            if batch_only:
                os.kill(self.pid, signum)  # still our unreaped child, so the pid is ours
            else:
                os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def _process_requests(self) -> None:
        """Deliver and delete ``signal-*.json`` requests (in the order they were made)."""
        if not self.pid or self.reaped:
            return
        try:
            names = sorted(
                n
                for n in os.listdir(self.task_dir)
                if n.startswith(SIGNAL_REQUEST_PREFIX) and n.endswith(".json")
            )
        except OSError as exc:
            _log(f"cannot list signal requests: {exc}")
            return
        for name in names:
            path = self._path(name)
            try:
                req = _read_json(path)
                os.unlink(path)
            except (OSError, ValueError) as exc:
                _log(f"bad signal request {name}: {exc}")
                continue
            if isinstance(req, dict):
                self._deliver(req.get("signum"), bool(req.get("batch_only")))

    def _fence_stale(self) -> bool:
        """True if the agent's heartbeat is older than the fence timeout.

        A missing file only counts as stale once the shepherd itself has run for the timeout,
        so an agent that writes the heartbeat just after launching is not fenced at once.
        """
        fence = self.spec.get("fence")
        if not isinstance(fence, dict):
            return False
        timeout = float(fence.get("timeout_s") or 30.0)
        try:
            mtime = os.stat(fence["heartbeat_file"]).st_mtime
        except OSError:
            return time.monotonic() - self.start_mono > timeout
        return time.time() - mtime > timeout

    def _cleanup_stragglers(self) -> None:
        """Terminate whatever the main process left in its process group, as Slurm does.

        The main process is already reaped; its pgid stays reserved while any member lives, so
        ``killpg`` cannot hit an unrelated group.  Zombie members (orphans awaiting a slow
        PID 1) still make ``killpg(pgid, 0)`` succeed, hence the /proc scan.
        """
        if not self._group_alive():
            return
        if self.kill_at is None:
            self._killpg(_signal.SIGTERM)
            self._killpg(_signal.SIGCONT)
            deadline = time.monotonic() + min(self.grace, _STRAGGLER_GRACE_CAP_S)
        else:
            deadline = self.kill_at
        while time.monotonic() < deadline:
            if not self._group_alive():
                return
            time.sleep(0.05)
        _log("stragglers survived SIGTERM: SIGKILL to the process group")
        self._killpg(_signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def _group_alive(self) -> bool:
        """True if a non-zombie process is still in the job's process group."""
        if not self.pid:
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _proc_stat(name)
                if st is not None and st[1] == self.pid and st[0] not in ("Z", "X", "x"):
                    return True
        return False

    def _emergency_kill(self) -> None:
        """After an internal error, never leave an unsupervised job behind."""
        if self.pid and not self.reaped:
            self._killpg(_signal.SIGKILL)
            try:
                os.waitpid(self.pid, 0)
                self.reaped = True
            except ChildProcessError:
                pass


def _steps_running(spec: dict[str, Any], task_dir: str) -> bool:
    """True when this attempt's steps (srun) take ``--signal`` here: a step task directory
    ``<attempt>.<step>.<task>`` in ``steps_dir`` without ``exit.json`` (one still starting
    counts: its own shepherd delivers the signal once it runs), or a step task that already
    got it (``STEPS_SIGNALLED`` in the job's task directory): a step's shepherd times the
    same signal itself, from a limit rounded to whole seconds, and its task may have exited
    on it a moment before the batch shell's is due."""
    steps_dir, attempt = spec.get("steps_dir"), spec.get("attempt_id")
    if not isinstance(steps_dir, str) or "step_id" in spec or attempt is None:
        return False
    if os.path.exists(os.path.join(task_dir, STEPS_SIGNALLED)):
        return True
    prefix = f"{attempt}."
    try:
        names = [n for n in os.listdir(steps_dir) if n.startswith(prefix)]
    except OSError:
        return False
    return any(not os.path.exists(os.path.join(steps_dir, n, EXIT_FILE)) for n in names)


def _live_step_tasks(spec: dict[str, Any]) -> int:
    """How many step tasks of this attempt on this node have not ended: a task directory
    ``<attempt>.<step>.<task>`` in ``steps_dir`` without ``exit.json`` whose shepherd is alive
    (one that vanished without a word ends nothing more by being waited for)."""
    steps_dir, attempt = spec.get("steps_dir"), spec.get("attempt_id")
    if not isinstance(steps_dir, str) or "step_id" in spec or attempt is None:
        return 0
    prefix = f"{attempt}."
    try:
        names = [n for n in os.listdir(steps_dir) if n.startswith(prefix)]
    except OSError:
        return 0
    live = 0
    for name in names:
        d = os.path.join(steps_dir, name)
        if not os.path.exists(os.path.join(d, EXIT_FILE)) and _live_shepherd(d) is not None:
            live += 1
    return live


def _mark_steps_signalled(spec: dict[str, Any]) -> None:
    """A step task's ``--signal`` is due: say so in its job's task directory (above)."""
    job_dir = spec.get("job_dir")
    if not isinstance(job_dir, str):
        return
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        os.close(os.open(os.path.join(job_dir, STEPS_SIGNALLED), flags, 0o600))
    except OSError as exc:
        _log(f"cannot mark the job's steps signalled: {exc}")
