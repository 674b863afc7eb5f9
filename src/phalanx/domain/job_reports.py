"""What a job reports through its control files, and which of it is worth a store write.

Agents read each task's checkpoint marker and progress file and put them in every heartbeat
(level-triggered, like the task states). Most heartbeats repeat what the store already holds,
so these pure rules decide when a report is news:

* a checkpoint is news when it differs from the job's recorded latest checkpoint (another
  attempt, path or finish time). Only rank 0's marker counts: every rank of a multi-node job
  runs the same script, and one `job.checkpoint` event per checkpoint (not one per node) is
  what the history, `phalanx show` and the measured checkpoint cost need;
* progress (rank 0's too) is news at most once per `PROGRESS_WRITE_INTERVAL_S` per attempt: a
  job may report every step (many per second) and the store only needs a recent value to show.
  Hang detection does not depend on these writes (the shepherd watches the progress file
  itself, on every node).

The agent side of the parsing (`parse_checkpoint_marker`, `parse_progress`) lives here too, so
the accepted forms are defined once: JSON from the helper, or plain text from a job that does
without it.
"""

from __future__ import annotations

import json
import math
from typing import Any

PROGRESS_WRITE_INTERVAL_S = 5.0
MAX_PATH_CHARS = 4096


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def parse_checkpoint_marker(text: str, mtime: float) -> dict[str, Any] | None:
    """The marker file's content: the helper's JSON, or a bare path (finished at its mtime)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("path"), str) and data["path"]:
        seq = data.get("request_seq")
        return {
            "path": data["path"][:MAX_PATH_CHARS],
            "finished_at": _number(data.get("finished_at")) or mtime,
            "duration_s": _number(data.get("duration_s")),
            "request_seq": seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
        }
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not first:
        return None
    return {
        "path": first[:MAX_PATH_CHARS],
        "finished_at": mtime,
        "duration_s": None,
        "request_seq": None,
    }


def parse_progress(text: str, mtime: float) -> dict[str, Any]:
    """The progress file's content: `{"step", "ts"}` from the helper, or anything (a touch)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    step = data.get("step") if isinstance(data, dict) else None
    if isinstance(data, int) and not isinstance(data, bool):
        step = data  # a bare number: the job's own step counter
    ts = _number(data.get("ts")) if isinstance(data, dict) else None
    return {
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
        "ts": ts or mtime,
    }


def is_new_checkpoint(
    stored: dict[str, Any] | None, reported: dict[str, Any] | None, *, rank: int
) -> bool:
    """Whether rank `rank` of a job's attempt reports a checkpoint the store has not recorded.

    A checkpoint is its path and the time it finished, whichever attempt reports it: a job
    that comes back from its checkpoint and announces it again (its marker rewritten with the
    same path and time) reports the checkpoint an earlier attempt took, not a new one, and
    recording it again gave the job's history each of its last checkpoints twice."""
    if reported is None or rank != 0 or not reported.get("path"):
        return False
    if stored is None:
        return True
    return (stored.get("path"), stored.get("finished_at")) != (
        reported.get("path"),
        reported.get("finished_at"),
    )


def checkpoint_record(reported: dict[str, Any], *, seq: int, node: str) -> dict[str, Any]:
    """jobs.checkpoint and the `job.checkpoint` event's data for a new checkpoint."""
    return {
        "path": reported.get("path"),
        "finished_at": reported.get("finished_at"),
        "duration_s": reported.get("duration_s"),
        "request_seq": reported.get("request_seq"),
        "seq": seq,
        "node": node,
    }


def progress_due(
    stored: dict[str, Any] | None, reported: dict[str, Any] | None, *, rank: int = 0
) -> bool:
    """Whether to write this progress report (rank 0's, at most one per
    PROGRESS_WRITE_INTERVAL_S: the nodes of a multi-node job report at the same moments)."""
    if reported is None or rank != 0:
        return False
    if stored is None:
        return True
    new_ts, old_ts = _number(reported.get("ts")), _number(stored.get("ts"))
    if new_ts is None or old_ts is None:
        return reported != stored
    return new_ts - old_ts >= PROGRESS_WRITE_INTERVAL_S
