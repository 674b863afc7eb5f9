"""The compiled thin srun (slurm/srun/thin.c): built by the agent once per installation, put on
jobs' PATH.

A loop of ``srun`` in a job starts one srun process per step; as a Python program that start
is ~15-20 ms of a trivial step's ~60 ms path (docs/slurm.md, "What a step costs"), even for
the thin client that only hands the step to the job's helper.  The same client in C starts
in about a millisecond.  It is built (phalanx/native.py) from the source shipped in this
package with the host's C compiler (``$CC``, else ``cc``) the first time an agent starts,
into ``_native/KEY/`` beside this module (or, where the package directory is read-only, into
the agent's state dir), KEY naming the source, the interpreter it falls back to and the
machine, so an upgrade or another
interpreter builds its own.  The agent puts that directory first on the PATH of its jobs and
steps (agent/jobenv.py); where no compiler is found the agent says so once and jobs use the
Python srun, as before.  Where the compiled srun cannot hand a step over it execs the full
srun with the interpreter that built it, so both behave the same.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from phalanx import native
from phalanx.native import BuildError

log = logging.getLogger("phalanx.agent.native_srun")

SOURCE = Path(__file__).parent.parent / "slurm" / "srun" / "thin.c"  # the srun it builds
PACKAGE_CACHE = Path(__file__).with_name("_native")

__all__ = ["BuildError", "build", "thin_srun_dir"]


def thin_srun_dir(state_dir: Path, python: str = sys.executable) -> Path | None:
    """The directory whose ``srun`` is the compiled thin srun, built now if no build exists;
    None (logged) where it cannot be built."""
    try:
        path = native.built(SOURCE, "srun", [PACKAGE_CACHE, state_dir / "native"], python)
    except (OSError, BuildError) as e:
        log.warning("srun in jobs is the Python one, not the compiled thin srun: %s", e)
        return None
    log.info("the compiled thin srun for jobs: %s", path)
    return path.parent


def build(compiler: str, python: str, target: Path) -> None:
    """Compile srun/thin.c to `target` (atomically: concurrent agents may race; one wins)."""
    native.build(compiler, python, SOURCE, target)
