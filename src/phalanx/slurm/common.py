"""What every Slurm front end shares: option parsing with Slurm's errors, time and state forms.

Tools parse what these commands print, so the forms here are Slurm's own:

* durations (``squeue %M``/``%l``, ``sacct Elapsed``/``Timelimit``): ``M:SS``, ``H:MM:SS``,
  ``D-HH:MM:SS``; ``UNLIMITED`` for no limit, ``INVALID`` for a negative time;
* timestamps: local ``YYYY-MM-DDTHH:MM:SS``, ``N/A`` (squeue) or ``Unknown`` (sacct) when unset;
* states: Phalanx's states named as Slurm's (``HELD`` is ``PENDING`` with a held reason,
  ``STARTING`` is ``CONFIGURING``), with Slurm's compact codes (``PD``, ``R``, ``CG``, ...).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from phalanx.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.client import Client

# Phalanx state -> Slurm state name (what squeue %T and sacct State print).
SLURM_STATE = {
    "PENDING": "PENDING",
    "HELD": "PENDING",
    "STARTING": "CONFIGURING",
    "RUNNING": "RUNNING",
    "COMPLETING": "COMPLETING",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
    "NODE_FAIL": "NODE_FAIL",
    "OUT_OF_MEMORY": "OUT_OF_MEMORY",
}
# Slurm state name -> its compact code (squeue %t, -t accepts either).
STATE_CODE = {
    "PENDING": "PD",
    "RUNNING": "R",
    "CONFIGURING": "CF",
    "COMPLETING": "CG",
    "COMPLETED": "CD",
    "FAILED": "F",
    "CANCELLED": "CA",
    "TIMEOUT": "TO",
    "NODE_FAIL": "NF",
    "OUT_OF_MEMORY": "OOM",
    "PREEMPTED": "PR",
    "SUSPENDED": "S",
    "BOOT_FAIL": "BF",
    "DEADLINE": "DL",
    "REQUEUED": "RQ",
    "REQUEUE_HOLD": "RH",
    "RESV_DEL_HOLD": "RD",
    "REQUEUE_FED": "RF",
    "RESIZING": "RS",
    "REVOKED": "RV",
    "SIGNALING": "SI",
    "SPECIAL_EXIT": "SE",
    "STAGE_OUT": "SO",
    "STOPPED": "ST",
}


class SlurmUsageError(Exception):
    """Bad command-line use: printed as ``CMD: error: ...`` with exit code 1, as Slurm does."""


class SlurmParser(argparse.ArgumentParser):
    """argparse with Slurm's manners: errors are one line naming the option, exit code 1.

    ``allow_abbrev`` is off: Slurm accepts unique prefixes of long options, but a prefix that
    silently turns into another option is how typos go unnoticed; exact spellings only.
    """

    def __init__(self, prog: str, **kw: Any) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(prog=prog, **kw)

    def error(self, message: str) -> NoReturn:
        raise SlurmUsageError(message)


def fail(prog: str, message: str, code: int = 1) -> NoReturn:
    """Print Slurm's one-line error (``squeue: error: ...``) and exit."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(code)


def run_command(prog: str, body: Any, argv: Sequence[str]) -> int:
    """Call ``body(argv)``; usage and client errors become one line and exit code 1."""
    try:
        return int(body(list(argv)) or 0)
    except SlurmUsageError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 1
    except PhalanxError as e:
        sys.stderr.write(f"{prog}: error: {e.message}\n")
        return 1
    except BrokenPipeError:  # `squeue | head`: the reader went away, which is not an error
        return 0


def client() -> Client:
    """The same client as `phalanx`: $PHALANX_URL, and the local credential socket or a token.
    (Imported here: httpx costs srun, which does not need it, 100+ ms a step.)"""
    from phalanx.client import Client

    return Client()


def slurm_state(state: str) -> str:
    return SLURM_STATE.get(state, state)


def state_code(state: str) -> str:
    return STATE_CODE.get(slurm_state(state), slurm_state(state)[:2])


def parse_states(text: str) -> set[str]:
    """``-t``/``--state`` values (names or codes, any case, comma list; ``all``) to Slurm names.

    Raises SlurmUsageError naming an unknown state, as squeue and sacct refuse them.
    """
    names = set(STATE_CODE)
    by_code = {code: name for name, code in STATE_CODE.items()}
    out: set[str] = set()
    for raw in text.split(","):
        word = raw.strip().upper()
        if not word:
            continue
        if word == "ALL":
            return set(names)
        if word in names:
            out.add(word)
        elif word in by_code:
            out.add(by_code[word])
        else:
            raise SlurmUsageError(f"Invalid job state specified: {raw.strip()}")
    return out


def phalanx_states(slurm_names: set[str]) -> list[str]:
    """The Phalanx states that show as these Slurm states."""
    return sorted(p for p, s in SLURM_STATE.items() if s in slurm_names)


def duration(seconds: float | None, *, unlimited: bool = False) -> str:
    """Slurm's duration form: ``0:00``, ``5:07``, ``1:02:03``, ``2-03:04:05``.

    ``None`` is ``UNLIMITED`` when ``unlimited`` (time limits), else ``0:00``.
    """
    if seconds is None:
        return "UNLIMITED" if unlimited else "0:00"
    if seconds < 0:
        return "INVALID"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{s:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{s:02d}"
    return f"{minutes}:{s:02d}"


def duration_full(seconds: float | None, *, unlimited: bool = False) -> str:
    """sacct's fixed form: ``HH:MM:SS`` or ``D-HH:MM:SS`` (``00:00:05``, ``1-00:00:00``)."""
    if seconds is None:
        return "UNLIMITED" if unlimited else "00:00:00"
    if seconds < 0:
        return "INVALID"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{s:02d}"
    return f"{hours:02d}:{minutes:02d}:{s:02d}"


def timestamp(t: float | None, missing: str = "N/A") -> str:
    """Local ``YYYY-MM-DDTHH:MM:SS`` (Slurm's default time format), ``missing`` when unset."""
    if t is None:
        return missing
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def job_id_text(job: dict[str, Any]) -> str:
    """A job's id as Slurm prints it: ``12`` or, for an array task, ``12_3``."""
    if job.get("array_job_id") is not None and job.get("array_task_id") is not None:
        return f"{job['array_job_id']}_{job['array_task_id']}"
    return str(job["job_id"])
