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
    "salloc",
    "sdiag",
    "sstat",
    "sreport",
    "sacctmgr",
    "sattach",
)


# the Slurm release whose commands these follow (their options, output and errors, checked
# against it): what `CMD --version` prints, as Slurm's do, for tools that look before they call
SLURM_RELEASE = "22.05.8"


def run(command: str, argv: list[str], *, fast: bool = True) -> int:
    """Run one Slurm command with its arguments; returns its exit status.  `fast`: srun tries
    the job's helper first (main() has already when it passes False)."""
    if command not in COMMANDS:
        sys.stderr.write(
            f"phalanx: '{command}' is not a Slurm command known here ({', '.join(COMMANDS)})\n"
        )
        return 1
    if argv[:1] in (["-V"], ["--version"]):
        sys.stdout.write(f"slurm {SLURM_RELEASE}\n")
        return 0
    if command == "srun" and fast:
        # the job's resident helper runs the step when it can: no heavy imports here
        from phalanx.slurm.srun import thin as srun_fast

        code = srun_fast.main(argv)
        if code is not None:
            return code
    # srun is a package (its in-job pieces beside it); its command is srun.command
    module = importlib.import_module(
        "phalanx.slurm.srun.command" if command == "srun" else f"phalanx.slurm.{command}"
    )
    return int(module.main(argv) or 0)


def main() -> None:
    """Entry point when called through a link named after a command (or as `... CMD ARGS`)."""
    name = os.path.basename(sys.argv[0])
    if name in COMMANDS:
        command, argv = name, sys.argv[1:]
    elif len(sys.argv) < 2:
        sys.stderr.write(f"usage: {name} COMMAND [ARGS...]   (COMMAND: {', '.join(COMMANDS)})\n")
        sys.exit(1)
    else:
        command, argv = sys.argv[1], sys.argv[2:]
    if command == "srun":
        from phalanx.slurm.srun import thin as srun_fast

        code = srun_fast.main(argv)
        if code is not None:
            # The thin srun has nothing to clean up (it writes with os.write), and in a loop
            # of `srun` the interpreter's finalisation is ~6 ms of every step: skip it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(run(command, argv, fast=False))
