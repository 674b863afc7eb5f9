"""What scontrol(1) of Slurm 22.05 offers that Phalanx's scontrol does not, each with why.

Every command, `show` entity and option of scontrol(1) is either scontrol's own
(slurm/scontrol.py) or listed here: naming one fails in one line that says why and what to
use instead, never an "invalid command" that leaves a user guessing whether they misspelled
it. tests/unit/test_scontrol_table.py holds both to the man page
(tests/data/slurm-22.05/scontrol-commands.txt).
"""

from __future__ import annotations

NO_DAEMONS = "Phalanx has no slurmctld or slurmd to tell that: see `phalanx cluster` and the logs"
CONFIG = (
    "Phalanx's controllers read their configuration at start (docs/configuration.md): change "
    "the file and restart them one at a time; `phalanx cluster` shows what each runs"
)

COMMANDS = {
    "abort": NO_DAEMONS,
    "cancel_reboot": "Phalanx does not reboot nodes (drain them with `phalanx drain`)",
    "cluster": "one cluster per set of controllers: -M takes its name",
    "completing": "Phalanx has no COMPLETING jobs: a job ends when its tasks have",
    "errnumstr": "Phalanx's errors are said in words, not numbers",
    "fsdampeningfactor": "fair share is configured in [fairshare] (docs/fairshare.md)",
    "listpids": "`sstat -i -j JOB` lists the pids of a job's running steps",
    "notify": "Phalanx cannot write into a job's output; `scancel --signal` reaches its tasks",
    "pidinfo": "`sstat -i -j JOB` lists the pids of a job's running steps",
    "reboot": "Phalanx does not reboot nodes (drain them with `phalanx drain`)",
    "reconfigure": CONFIG,
    "schedloglevel": NO_DAEMONS,
    "setdebug": NO_DAEMONS,
    "setdebugflags": NO_DAEMONS,
    "shutdown": "stop the controllers and agents with their service manager (or `phalanx down`)",
    "takeover": "the controllers elect the holder of each duty themselves (docs/ha.md)",
    "top": "job priorities come from the policy (`sprio` shows them); hold or release a job "
    "to move it",
    "write": "`write batch_script` and `write config` are not offered: the script is the "
    "file you submitted, the configuration the controllers' file",
    # (suspend and resume are answered in scontrol.py: Phalanx does not suspend jobs)
}
# scontrol's interactive mode (no command on the line) is not offered; its commands are
# the options of a one-shot call
INTERACTIVE = "an interactive-mode command: give the option on the command line instead"
COMMANDS.update(
    {
        "all": f"{INTERACTIVE} (-a)",
        "details": f"{INTERACTIVE} (-d)",
        "exit": INTERACTIVE,
        "help": "see `scontrol --help`",
        "hide": INTERACTIVE,
        "oneliner": f"{INTERACTIVE} (-o)",
        "quiet": f"{INTERACTIVE} (-Q)",
        "quit": INTERACTIVE,
        "verbose": f"{INTERACTIVE} (-v)",
    }
)

SHOW = {
    "aliases": NO_DAEMONS,
    "assoc_mgr": "accounts and their usage: `sshare`",
    "bbstat": "no burst buffers",
    "burstbuffer": "no burst buffers",
    "config": CONFIG,
    "daemons": NO_DAEMONS,
    "dwstat": "no burst buffers",
    "federation": "Phalanx clusters do not federate",
    "frontend": "Phalanx has no front-end nodes",
    "slurmd": NO_DAEMONS,
    "step": "a job's steps: `sacct -j JOB` (all) or `sstat -a -j JOB` (running)",
    "topology": "the placement topology: `phalanx cluster` and docs/topology.md",
}

OPTIONS = {
    "--federation": "Phalanx clusters do not federate",
    "--future": "Phalanx has no FUTURE nodes",
    "--hide": "every partition is shown",
    "--local": "Phalanx clusters do not federate",
    "--sibling": "Phalanx clusters do not federate",
    "--uid": "commands act as the caller (the credential says who)",
}
SHORT = {"--future": "-F", "--uid": "-u"}
