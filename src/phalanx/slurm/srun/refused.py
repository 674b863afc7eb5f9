"""The options of srun(1) (Slurm 22.05) that Phalanx's srun does not honour, each refused by
name with the reason, in one line: never accepted and silently ignored.

Each entry: the long option, its short form (or None), how many values it takes as Slurm's
srun takes them (0: a flag; "?": an optional value; None: one value), and why. The options
srun honours are its parser's (srun/command.py `parser`); together the two cover every long
option of srun(1) (tests/data/slurm-22.05/srun-options.txt, held by tests/unit/test_srun.py).
"""

from __future__ import annotations

from typing import Any

from phalanx.slurm.common import SlurmParser, refuse

ALLOCATION = (
    "an option of the job's allocation, not of a step: give it to sbatch or salloc (srun "
    "outside a job takes -N, -n, -c, -p, -t, --mem, --mem-per-cpu, -A, -q, -C, -w)"
)
BINDING = (
    "no CPU, memory or accelerator binding or frequency control: the job's cgroup and CPU set apply"
)
BROADCAST = "no file broadcast to the nodes: put the program where every node can read it"
PROLOGS = "no per-step prolog or epilog: run the commands in the step itself"
INTERNALS = "a setting of Slurm's own daemons, which Phalanx does not have"

# (long, short, nargs, why)
REFUSED: tuple[tuple[str, str | None, Any, str], ...] = (
    ("accel-bind", None, None, BINDING),
    ("acctg-freq", None, None, "agents sample every accounting.gather_interval (sstat)"),
    ("bb", None, None, "no burst buffers"),
    ("bbf", None, None, "no burst buffers"),
    ("bcast", None, "?", BROADCAST),
    ("bcast-exclude", None, None, BROADCAST),
    ("begin", "-b", None, ALLOCATION),
    ("cluster-constraint", None, None, ALLOCATION),
    ("clusters", "-M", None, "a step runs in its job's cluster"),
    ("comment", None, None, ALLOCATION),
    ("compress", None, "?", BROADCAST),
    ("container", None, None, "no OCI containers: run the container runtime in the step"),
    ("contiguous", None, 0, ALLOCATION),
    ("core-spec", "-S", None, ALLOCATION),
    ("cores-per-socket", None, None, ALLOCATION),
    ("cpu-freq", None, None, BINDING),
    ("cpus-per-gpu", None, None, ALLOCATION),
    ("deadline", None, None, ALLOCATION),
    ("delay-boot", None, None, ALLOCATION),
    ("dependency", "-d", None, ALLOCATION),
    ("disable-status", "-X", 0, "srun forwards SIGINT to the tasks; it prints no status"),
    ("epilog", None, None, PROLOGS),
    ("extra-node-info", "-B", None, ALLOCATION),
    ("gid", None, None, "a step runs as its job's user and group"),
    ("gpu-freq", None, None, BINDING),
    ("gpus", "-G", None, ALLOCATION + "; a step takes --gpus-per-task or --gpus-per-node"),
    ("gpus-per-socket", None, None, ALLOCATION),
    ("gres-flags", None, None, ALLOCATION),
    ("het-group", None, None, "no heterogeneous jobs"),
    ("immediate", "-I", "?", ALLOCATION),
    ("input", "-i", None, "stdin goes to every task as srun reads it; redirect it instead"),
    ("licenses", "-L", None, ALLOCATION),
    ("mail-type", None, None, ALLOCATION),
    ("mail-user", None, None, ALLOCATION),
    ("mcs-label", None, None, ALLOCATION),
    ("mem-bind", None, None, BINDING),
    ("mem-per-gpu", None, None, ALLOCATION),
    ("mincpus", None, None, ALLOCATION),
    ("msg-timeout", None, None, INTERNALS),
    ("multi-prog", None, 0, "no multi-program steps: branch on $SLURM_PROCID in one program"),
    ("network", None, None, ALLOCATION),
    ("nice", None, "?", ALLOCATION),
    ("no-allocate", "-Z", 0, "a step always runs inside its job's allocation"),
    ("nodefile", "-F", None, "name the nodes with -w/--nodelist"),
    ("ntasks-per-core", None, None, ALLOCATION),
    ("ntasks-per-gpu", None, None, ALLOCATION),
    ("ntasks-per-socket", None, None, ALLOCATION),
    ("overcommit", "-O", 0, ALLOCATION),
    ("oversubscribe", "-s", 0, ALLOCATION),
    ("power", None, None, ALLOCATION),
    ("prefer", None, None, ALLOCATION),
    ("preserve-env", "-E", 0, "a step's layout comes from its own options, -N and -n"),
    ("priority", None, None, ALLOCATION),
    ("profile", None, None, INTERNALS),
    ("prolog", None, None, PROLOGS),
    ("propagate", None, "?", "tasks run with the node's limits and the job's cgroup"),
    ("quit-on-interrupt", None, 0, "srun forwards SIGINT to the tasks; one more ends it"),
    ("reboot", None, 0, ALLOCATION),
    ("relative", "-r", None, "name the nodes with -w/--nodelist"),
    ("reservation", None, None, ALLOCATION),
    ("resv-ports", None, "?", "no reserved port ranges"),
    ("send-libs", None, "?", BROADCAST),
    ("signal", None, None, ALLOCATION + " (sbatch --signal; scancel --signal for a step)"),
    ("slurmd-debug", None, None, INTERNALS),
    ("sockets-per-node", None, None, ALLOCATION),
    ("spread-job", None, 0, ALLOCATION),
    ("switches", None, None, ALLOCATION),
    ("task-epilog", None, None, PROLOGS),
    ("task-prolog", None, None, PROLOGS),
    ("test-only", None, 0, ALLOCATION),
    ("thread-spec", None, None, ALLOCATION),
    ("threads", "-T", None, INTERNALS),
    ("threads-per-core", None, None, ALLOCATION),
    ("time-min", None, None, ALLOCATION),
    ("tmp", None, None, ALLOCATION),
    ("uid", None, None, "a step runs as its job's user"),
    ("use-min-nodes", None, 0, ALLOCATION),
    ("wait", "-W", None, "a step ends when its last task does"),
    ("wckey", None, None, ALLOCATION),
    ("x11", None, "?", "no X11 forwarding"),
)


def add_refused(parser: SlurmParser) -> None:
    """Every REFUSED option, so that naming one (or a unique prefix of it) fails with why."""
    for long, short, nargs, why in REFUSED:
        flags = (short, f"--{long}") if short else (f"--{long}",)
        refuse(parser, *flags, why=why, nargs=nargs)
