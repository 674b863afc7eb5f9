"""``phalanx slurm-commands --install DIR``: the compiled Slurm commands, as links in DIR.

Builds slurm/commands.c (phalanx/native.py: the host's C compiler, this installation's
interpreter compiled in) and links ``sbatch``, ``squeue``, ... in DIR to it.  Each call then
runs in the host's command server when one serves (slurm/cmdserver.py) and as the Python
command otherwise, with the same output either way.  `make install` does it for the
project's .venv/bin, replacing the console scripts pip wrote there; a site does it for the
directory its users have on PATH.  What is in DIR under those names is replaced only where it
is this program's: a link to a build of it, or a console script of phalanx.slurm.  Anything
else (a real Slurm's sbatch) is left alone and named.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from phalanx import native
from phalanx.slurm.cmdserver import SERVED

SOURCE = Path(__file__).with_name("commands.c")
PACKAGE_CACHE = Path(__file__).parent.parent / "agent" / "_native"  # beside the thin srun's
PROGRAM = "phalanx-slurm"


@dataclass
class Installed:
    program: Path | None = None
    linked: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # (name: why) not ours, left alone


def replaceable(path: Path) -> bool:
    """Whether `path` may be replaced: absent, a link to a build of commands.c, or a console
    script of this package's commands."""
    if not os.path.lexists(path):
        return True
    if path.is_symlink():
        return os.path.basename(os.readlink(path)) == PROGRAM
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and b"phalanx.slurm.main" in head


def install(target: Path, python: str = sys.executable, cache: Path | None = None) -> Installed:
    """Build the compiled commands and link them in `target`; raises native.BuildError or
    OSError where it cannot be built."""
    bases = [cache] if cache else [PACKAGE_CACHE, Path.home() / ".cache" / "phalanx" / "native"]
    program = native.built(SOURCE, PROGRAM, bases, python)
    done = Installed(program=program)
    target.mkdir(parents=True, exist_ok=True)
    for name in SERVED:
        link = target / name
        if not replaceable(link):
            done.kept.append(f"{name}: {link} is not Phalanx's")
            continue
        tmp = target / f".{name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(program)
        os.replace(tmp, link)
        done.linked.append(name)
    return done
