"""What a node adds to the environment of the jobs and steps it starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def node_environment(
    env: Mapping[str, str], job_env: Mapping[str, str], srun_dir: Path | None
) -> dict[str, str]:
    """`env` (the submitter's, or srun's for a step) with this node's additions: `job_env`
    (its credential socket wins over the submitter's; the submitter's own PHALANX_URL wins
    over the node's), and `srun_dir` (the compiled thin srun, agent/native_srun.py) first on PATH,
    once, so that ``srun`` in the job is the fast one.  A job without PATH keeps none."""
    out = dict(env)
    for key, value in job_env.items():
        if key == "PHALANX_URL":
            out.setdefault(key, value)
        else:
            out[key] = value
    path = out.get("PATH")
    if srun_dir is not None and path and path.split(os.pathsep, 1)[0] != str(srun_dir):
        out["PATH"] = f"{srun_dir}{os.pathsep}{path}"
    return out
