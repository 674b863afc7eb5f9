"""``python -m phalanx.slurm.srun.full ARGS``: the full srun, without first trying the job's
helper.  The compiled thin srun (srun/thin.c) execs this where it cannot hand the step over
(no job, no helper, or the helper answered ``fallback``): asking the helper again would only
get the same answer."""

from __future__ import annotations

import sys

from phalanx.slurm.main import run

if __name__ == "__main__":
    raise SystemExit(run("srun", sys.argv[1:], fast=False))
