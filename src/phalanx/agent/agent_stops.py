"""What the controllers ask of a running job besides its start: stops (planned stops with a
checkpoint signal and a grace, and plain ones), signals (``scancel --signal``), and periodic
checkpoint requests.

A part of :class:`agent.Agent` (a mixin).  Every request is level-triggered: replies repeat
them, so each is made idempotent here (a stop request's file is created once, a signal's seq
is remembered in the task directory, a checkpoint is asked for once per interval), and the
shepherd carries it out (shepherd_control.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from phalanx.agent import checkpoint_requests, shepherd_control, shepherd_files
from phalanx.agent.agent_status import read_job_reports
from phalanx.agent.files import read_json as _read_json
from phalanx.agent.files import write_json as _write_json
from phalanx.agent.steps import StepRunner

log = logging.getLogger("phalanx.agent")


class AgentStops:
    """The agent's handling of a reply's ``stop``, ``signal`` and ``checkpoint`` lists."""

    tasks_dir: Path
    steps: StepRunner
    _intervals: dict[int, dict[str, Any]]

    def _request_stops(self, stops: list[dict[str, Any]]) -> bool:
        """Ask the shepherds of the attempts in a reply's ``stop`` list to stop (and their
        steps here with them); True when any of it is news: a stop not requested before, or
        steps that were stopped."""
        news = False
        for stop in stops:
            d = self.tasks_dir / str(stop["attempt_id"])
            if not d.is_dir():
                # Already forgotten: the reply was made from a report taken before this
                # attempt's end was recorded (a long-poll woken by that end). Not a repeat to
                # wait out: the next heartbeat no longer reports the attempt, so asking again
                # at once cannot spin, and its long-poll is parked for the next start at once.
                news = True
            elif not (d / shepherd_files.STOP_FILE).exists():
                news = True
                log.info("stopping attempt %s: %s", stop["attempt_id"], stop.get("reason"))
            if d.is_dir():
                holder = bool((_read_json(d / "spec.json") or {}).get("holder"))
                planned = stop.get("checkpoint_signal") is not None
                shepherd_control.request_stop(
                    d,
                    # a holder gets no signal, but keeps the job's cgroup here until the
                    # steps in it have checkpointed and ended, or the grace is over
                    checkpoint_signal=None if holder else stop.get("checkpoint_signal"),
                    checkpoint_grace=float(stop.get("checkpoint_grace") or 0.0),
                    reason=stop.get("reason"),
                    wait=holder and planned,
                )
            # the job's steps here stop with it (a planned stop checkpoints them first)
            news = self.steps.stop(int(stop["attempt_id"]), None, stop) > 0 or news
        return news

    def _periodic_checkpoint(self, d: Path, attempt_id: int, started_at: float | None) -> None:
        """Ask a running job for a checkpoint when its interval in force has passed."""
        item = self._intervals.get(int(attempt_id))
        if item is None:
            return
        marker = read_job_reports(d).get("checkpoint") or {}
        request = checkpoint_requests.read_checkpoint_request(d) or {}
        if not checkpoint_due(
            time.time(),
            item.get("interval_s"),
            started_at=started_at,
            last_checkpoint_at=marker.get("finished_at"),
            last_request_at=request.get("requested_at"),
        ):
            return
        try:
            seq = shepherd_control.request_checkpoint(
                d, "interval", int(item["signal"]), batch_only=bool(item.get("batch_only"))
            )
        except (OSError, ValueError) as e:
            log.warning("cannot request a checkpoint of attempt %s: %s", attempt_id, e)
            return
        if seq is not None:
            log.info("periodic checkpoint request %d to attempt %s", seq, attempt_id)
            if not item.get("batch_only"):
                # the job's srun steps get it too: they are where training runs
                self.steps.signal_attempt(int(attempt_id), int(item["signal"]))

    def _deliver_signals(self, items: list[dict[str, Any]]) -> None:
        """Deliver the signals the controller lists (scancel --signal), each seq once.

        The highest seq handled is kept in the task dir (``signals-done``) and reported in
        heartbeats, so a repeated reply or a restarted agent never sends one twice. Targets, as
        Slurm's: ``batch`` the batch shell only, ``full`` the batch shell's whole process group
        and every step, ``steps`` every step only. A signal that cannot be delivered yet (the
        shepherd is still starting) is tried again with the next reply; one for a job that has
        already exited is done.
        """
        for item in sorted(items, key=lambda i: (int(i["attempt_id"]), int(i["seq"]))):
            aid, seq = int(item["attempt_id"]), int(item["seq"])
            d = self.tasks_dir / str(aid)
            if not d.is_dir() or seq <= signals_done(d):
                continue
            signum, target = int(item["signum"]), str(item["target"])
            if target in ("batch", "full") and not self._signal_batch(d, signum, target):
                continue  # not running yet (or its shepherd is gone): next reply
            if target in ("steps", "full"):
                self._signal_steps(aid, signum)
            log.info("signal %d (%s, seq %d) delivered to attempt %s", signum, target, seq, aid)
            _write_json(d / SIGNALS_DONE_FILE, {"seq": seq})

    @staticmethod
    def _signal_batch(d: Path, signum: int, target: str) -> bool:
        """Signal the batch shell (``batch``) or its process group (``full``) through its
        shepherd; True when done with it (delivered, or the job has already exited)."""
        if (d / shepherd_files.EXIT_FILE).exists():
            return True
        sent = shepherd_control.forward_signal(d, signum, batch_only=target == "batch")
        return sent or (d / shepherd_files.EXIT_FILE).exists()

    def _signal_steps(self, attempt_id: int, signum: int) -> None:
        """Signal every job step (srun) of this attempt running on this node: each step task's
        process group, through its shepherd (agent/steps.py). A job without steps gets nothing,
        exactly as Slurm's ``scancel --signal`` without ``--batch``/``--full``."""
        sent = self.steps.signal_attempt(attempt_id, signum)
        if sent:
            log.info("signal %d to %d step task(s) of attempt %s", signum, sent, attempt_id)


def checkpoint_due(
    now: float,
    interval_s: float | None,
    *,
    started_at: float | None,
    last_checkpoint_at: float | None,
    last_request_at: float | None,
) -> bool:
    """Whether a periodic checkpoint is due: the interval has passed since the attempt
    started, its last checkpoint, or the last request (so a job that is slow to answer, or
    ignores requests, is asked once per interval rather than on every heartbeat)."""
    if not interval_s or interval_s <= 0 or started_at is None:
        return False
    times = [t for t in (started_at, last_checkpoint_at, last_request_at) if t is not None]
    return now - max(times) >= interval_s


SIGNALS_DONE_FILE = "signals-done.json"


def signals_done(task_dir: Path) -> int:
    """The highest signal seq delivered to this task (0: none)."""
    data = _read_json(task_dir / SIGNALS_DONE_FILE) or {}
    try:
        return max(0, int(data.get("seq") or 0))
    except (TypeError, ValueError):
        return 0
