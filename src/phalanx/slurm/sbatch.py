"""``sbatch``: submit a batch script as Slurm's sbatch does, over the same client as ``phalanx``.

Every option ``phalanx submit`` knows is taken (``build_spec`` reads ``#SBATCH`` lines and the
command line); sbatch's own flags are handled here: ``--parsable`` prints only the id (what
``jid=$(sbatch --parsable job.sh)`` captures), ``--wait``/``-W`` returns when the job has ended
with its exit status (0 if COMPLETED, else its exit code, or 1), ``--test-only`` validates the
job fully on the controller and submits nothing. Without a script file (and without
``--wrap``) the script is read from stdin, and the job is named ``sbatch``, as Slurm names it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from phalanx.domain.directives import split_cli_args
from phalanx.errors import PhalanxError
from phalanx.slurm.common import (
    SlurmUsageError,
    SubmitFlags,
    check_clusters,
    client,
    run_command,
    script_file_flags,
    script_submit_flags,
    split_submit_flags,
    wait_exit_code,
    wait_for_jobs,
)
from phalanx.submitting import build_spec, read_script

PROG = "sbatch"
STDIN_NAME = "sbatch"  # Slurm's name for a job whose script came on stdin

HELP = """Usage: sbatch [OPTIONS...] [executable [args...]]

Submits a batch script (a file, or stdin when none is given) to Phalanx. Options are
sbatch's; `phalanx submit --help-options` lists the ones understood here. Also:
  --parsable      print only the job id
  -W, --wait      return when the job ends, with its exit status
  --test-only     validate the job fully and submit nothing
  --wrap=CMD      run CMD in a /bin/sh script instead of a script file
"""


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    if argv[:1] in (["--help"], ["-h"], ["--usage"]):
        sys.stdout.write(HELP)
        return 0
    flags, rest = split_submit_flags(argv)
    spec, warnings, _ignored = _spec(rest, flags)
    for w in warnings:
        sys.stderr.write(f"{PROG}: warning: {w}\n")
    return submit_and_report(spec, flags, prog=PROG)


def _spec(argv: list[str], flags: SubmitFlags) -> tuple[dict[str, Any], list[str], list[str]]:
    """The job spec from options and the script file, or the script on stdin."""
    opts, script = split_cli_args(argv)
    if script or any(t == "--wrap" or t.startswith("--wrap=") for t in opts):
        script_file_flags(argv, flags)
        return build_spec(argv)
    text = read_script(sys.stdin.buffer, "on standard input")
    if not text.strip():
        raise SlurmUsageError("Batch script is empty!")
    script_submit_flags(text, flags)
    import tempfile  # only a script on stdin needs it (6 ms of every sbatch's start-up)

    with tempfile.TemporaryDirectory(prefix="phalanx-sbatch-") as tmp:
        path = Path(tmp) / STDIN_NAME
        path.write_text(text)
        try:
            spec, warnings, ignored = build_spec([*opts, "--", str(path)])
        except PhalanxError as e:  # it names the script: ours is "sbatch" (stdin)
            e.message = e.message.replace(str(path), STDIN_NAME)
            raise
    spec.pop("script_path", None)  # the file was ours, and is gone
    if not spec.get("name"):
        spec["name"] = STDIN_NAME
    warnings = [w.replace(str(path), STDIN_NAME) for w in warnings]
    return spec, warnings, ignored


def submit_and_report(spec: dict[str, Any], flags: SubmitFlags, *, prog: str) -> int:
    """Submit (or only validate), print what sbatch prints, wait if asked; the exit status."""
    with client() as c:
        cluster = check_clusters(c, flags.clusters)
        if flags.test_only:
            c.submit(spec, test_only=True)
            where = f" in partition {spec['partition']}" if spec.get("partition") else ""
            sys.stderr.write(
                f"{prog}: Job would be accepted{where}: validated by the controller, nothing "
                "submitted (Phalanx does not predict start times or nodes)\n"
            )
            return 0
        res = c.submit(spec)
        jid = res["job_id"]
        # with -M, Slurm names the cluster: "ID;CLUSTER" (--parsable), "... on cluster C"
        if flags.parsable:
            sys.stdout.write(f"{jid}\n" if cluster is None else f"{jid};{cluster}\n")
        else:
            on = "" if cluster is None else f" on cluster {cluster}"
            sys.stdout.write(f"Submitted batch job {jid}{on}\n")
        sys.stdout.flush()
        if not flags.wait:
            return 0
        return wait_exit_code(wait_for_jobs(c, jid))
