"""The multi-call entry point: ``sbatch``, ``squeue``, ... are one program told apart by argv[0].

``phalanx slurm-commands --install DIR`` puts links to it in DIR for sites that do not want
the console scripts on every user's PATH; ``python -m phalanx.slurm squeue ...`` works too.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = (
    "sbatch",
    "srun",
    "squeue",
    "scancel",
    "sinfo",
    "scontrol",
    "sacct",
    "sshare",
    "sprio",
)


def run(command: str, argv: list[str]) -> int:
    """Run one Slurm command with its arguments; returns its exit status."""
    if command not in COMMANDS:
        sys.stderr.write(
            f"phalanx: '{command}' is not a Slurm command known here ({', '.join(COMMANDS)})\n"
        )
        return 1
    if command == "srun":
        # the job's resident helper runs the step when it can: no heavy imports here
        from phalanx.slurm import srun_fast

        code = srun_fast.main(argv)
        if code is not None:
            return code
    module = importlib.import_module(f"phalanx.slurm.{command}")
    return int(module.main(argv) or 0)


def main() -> None:
    """Entry point when called through a link named after a command (or as `... CMD ARGS`)."""
    name = os.path.basename(sys.argv[0])
    if name in COMMANDS:
        sys.exit(run(name, sys.argv[1:]))
    if len(sys.argv) < 2:
        sys.stderr.write(f"usage: {name} COMMAND [ARGS...]   (COMMAND: {', '.join(COMMANDS)})\n")
        sys.exit(1)
    sys.exit(run(sys.argv[1], sys.argv[2:]))
