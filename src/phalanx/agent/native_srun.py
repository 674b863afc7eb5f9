"""The compiled thin srun (slurm/srun/thin.c): built by the agent once per installation, put on
jobs' PATH.

A loop of ``srun`` in a job starts one srun process per step; as a Python program that start
is ~15-20 ms of a trivial step's ~60 ms path (docs/slurm.md, "What a step costs"), even for
the thin client that only hands the step to the job's helper.  The same client in C starts
in about a millisecond.  It is built from the source shipped in this package with the host's
C compiler (``$CC``, else ``cc``) the first time an agent starts, into ``_native/KEY/`` beside
this module (or, where the package directory is read-only, into the agent's state dir), KEY
naming the source, the interpreter it falls back to and the machine, so an upgrade or another
interpreter builds its own.  The agent puts that directory first on the PATH of its jobs and
steps (agent/jobenv.py); where no compiler is found the agent says so once and jobs use the
Python srun, as before.  Where the compiled srun cannot hand a step over it execs the full
srun with the interpreter that built it, so both behave the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("phalanx.agent.native_srun")

SOURCE = Path(__file__).parent.parent / "slurm" / "srun" / "thin.c"  # the srun it builds
PACKAGE_CACHE = Path(__file__).with_name("_native")
BUILD_TIMEOUT_S = 120.0


class BuildError(Exception):
    """The compiler is missing or refused the source: jobs use the Python srun."""


def cache_key(python: str, source: bytes) -> str:
    """Names one build: the source, the interpreter it falls back to, the machine."""
    digest = hashlib.sha256()
    for part in (source, python.encode(), platform.machine().encode()):
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[:16]


def thin_srun_dir(state_dir: Path, python: str = sys.executable) -> Path | None:
    """The directory whose ``srun`` is the compiled thin srun, built now if no build exists;
    None (logged) where it cannot be built."""
    try:
        source = SOURCE.read_bytes()
        key = cache_key(python, source)
        bases = [PACKAGE_CACHE, state_dir / "native"]
        for base in bases:
            if _usable(base / key / "srun"):
                return base / key
        compiler = shutil.which(os.environ.get("CC") or "cc")
        if compiler is None:
            raise BuildError("no C compiler (cc, or $CC) on this host")
        if any(c in python for c in '"\\\n'):
            raise BuildError(f"the interpreter's path {python!r} cannot be compiled in")
        for base in bases:
            try:
                _make_dirs(base / key)
            except OSError:
                continue  # a read-only installation: the next place
            build(compiler, python, base / key / "srun")
            log.info("built the compiled thin srun for jobs: %s", base / key / "srun")
            return base / key
        raise BuildError(f"no writable place for it ({', '.join(map(str, bases))})")
    except (OSError, BuildError) as e:
        log.warning("srun in jobs is the Python one, not the compiled thin srun: %s", e)
        return None


def build(compiler: str, python: str, target: Path) -> None:
    """Compile srun/thin.c to `target` (atomically: concurrent agents may race; one wins)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-Wall", f'-DPHX_PYTHON="{python}"', "-o", str(tmp), str(SOURCE)]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{compiler} did not run: {e}") from None
    try:
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise BuildError(f"{compiler} failed: {' / '.join(detail)}")
        os.chmod(tmp, 0o755)  # job users run it
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _make_dirs(path: Path) -> None:
    """Create `path` and its parents readable by everyone (job users exec what is inside)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
        os.chmod(d, 0o755)
    if not os.access(path, os.W_OK):
        raise PermissionError(f"{path} is not writable")
