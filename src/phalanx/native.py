"""Building the small C programs shipped as source in this package: the compiled thin srun
(slurm/srun/thin.c, built by each agent: agent/native_srun.py) and the compiled Slurm
commands (slurm/commands.c, built by ``phalanx slurm-commands --install``: slurm/install.py).

Each is compiled with the host's C compiler (``$CC``, else ``cc``) and the interpreter of the
installation that builds it compiled in (``-DPHX_PYTHON``): where the C program cannot do its
job alone it execs the Python program with that interpreter, so both behave the same.  A build
is named by a key of the source, the interpreter and the machine, so an upgrade or another
interpreter builds its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

BUILD_TIMEOUT_S = 120.0


class BuildError(Exception):
    """The compiler is missing or refused the source: the Python program is used instead."""


def cache_key(python: str, source: bytes) -> str:
    """Names one build: the source, the interpreter it falls back to, the machine."""
    digest = hashlib.sha256()
    for part in (source, python.encode(), platform.machine().encode()):
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[:16]


def find_compiler() -> str:
    """The host's C compiler, or BuildError saying there is none."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        raise BuildError("no C compiler (cc, or $CC) on this host")
    return compiler


def check_python(python: str) -> None:
    """BuildError where the interpreter's path cannot be a C string literal as it is."""
    if any(c in python for c in '"\\\n'):
        raise BuildError(f"the interpreter's path {python!r} cannot be compiled in")


def build(compiler: str, python: str, source: Path, target: Path) -> None:
    """Compile `source` to `target` (atomically: concurrent builders may race; one wins)."""
    check_python(python)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-Wall", f'-DPHX_PYTHON="{python}"', "-o", str(tmp), str(source)]
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
        os.chmod(tmp, 0o755)  # every user runs it
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def make_dirs(path: Path) -> None:
    """Create `path` and its parents readable by everyone (other users exec what is inside)."""
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


def built(source: Path, program: str, bases: list[Path], python: str) -> Path:
    """The path of `program` compiled from `source`, built now under the first writable of
    `bases` unless a build for this source, interpreter and machine exists in one of them;
    BuildError (or OSError) where it cannot be."""
    key = cache_key(python, source.read_bytes())
    for base in bases:
        if usable(base / key / program):
            return base / key / program
    compiler = find_compiler()
    check_python(python)
    for base in bases:
        try:
            make_dirs(base / key)
        except OSError:
            continue  # a read-only installation: the next place
        build(compiler, python, source, base / key / program)
        return base / key / program
    raise BuildError(f"no writable place for it ({', '.join(map(str, bases))})")
