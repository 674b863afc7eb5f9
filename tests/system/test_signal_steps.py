"""Who gets `--signal=[B:]SIG@N` before the time limit, with real processes and real signals.

Slurm: without `B:` every job step is signalled and not the batch shell; with `B:` the batch
shell alone. Phalanx follows it, and a job with no step running gets the signal in the batch
shell's whole process group instead (docs/slurm.md, "Signals before the time limit"), so a
script that runs its work without srun still hears it.

Each script records who trapped the signal in a file; bash runs a trap during `wait`, so a
batch shell that got the signal says so at once. The three jobs run at the same time (each
waits ~20 s for its signal).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, base_env, wait_for

pytestmark = pytest.mark.system

BIN = str(Path(sys.executable).parent)  # srun is installed here
PATH = f"{BIN}:/usr/local/bin:/usr/bin:/bin"
LIMIT_S = 90
BEFORE_S = 70  # the signal ~20 s into the run: time enough for srun to start its step

# a step task that records a USR1 and ends; it stays idle otherwise
STEP = (
    'srun bash -c \'trap "echo step $SLURM_PROCID >> $GOT; exit 0" USR1; '
    "while :; do sleep 0.1; done' &\n"
)


def run_all(cluster: Cluster, tmp_path: Path, scripts: dict[str, str]) -> dict[str, list[str]]:
    """Submit each script with --signal (its name says whether with B:); once all have
    ended, the lines each wrote to its $GOT file, sorted."""
    ids = {}
    for name, body in scripts.items():
        got = tmp_path / f"{name}.got"
        ids[name] = cluster.submit_script(
            tmp_path,
            name,
            f"#!/bin/bash\nexport GOT={got}\n{body}exit 0\n",
            env={"PATH": PATH},
            nodes=2,
            time_limit_s=LIMIT_S,
            signal=("B:" if name.startswith("b_") else "") + f"USR1@{BEFORE_S}",
        )
    ended = cluster.wait_terminal(list(ids.values()), timeout=180)
    out = {}
    for name, jid in ids.items():
        got = tmp_path / f"{name}.got"
        out[name] = sorted(got.read_text().splitlines()) if got.exists() else []
        log = (tmp_path / f"{name}-{jid}.out").read_text()
        assert ended[jid]["state"] == "COMPLETED", (name, ended[jid]["state"], out[name], log)
    return out


@pytest.mark.timeout(300)
def test_signal_goes_to_steps_else_to_the_batch_group_and_b_to_the_batch_shell(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start(nodes=2, cpus=4)
    got = run_all(
        cluster,
        tmp_path,
        {
            # without B:, a running step: its tasks get it (on both nodes), the shell does not
            "steps": "trap 'echo batch >> $GOT' USR1\n" + STEP + "wait; wait\n",
            # without B:, no step: the batch shell and its children (the process group)
            "nosteps": (
                "trap 'echo batch >> $GOT' USR1\n"
                'bash -c \'trap "echo child >> $GOT; exit 0" USR1; '
                "while :; do sleep 0.1; done' &\n"
                "wait; wait\n"
            ),
            # B: the batch shell alone, even with a step running; it then ends the step
            "b_steps": (
                "trap 'echo batch >> $GOT; kill -TERM $SRUN' USR1\n"
                + STEP
                + "SRUN=$!\nwait; wait\n"
            ),
        },
    )
    assert got["steps"] == ["step 0", "step 1"], got
    assert got["nosteps"] == ["batch", "child"], got
    assert got["b_steps"] == ["batch"], got


def scancel(cluster: Cluster, cwd: Path, *args: str) -> None:
    extra = {"PHALANX_URL": cluster.url}
    if (cluster.root / "admin.token").is_file():
        extra["PHALANX_TOKEN_FILE"] = str(cluster.root / "admin.token")
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", "scancel", *args],
        cwd=cwd,
        env=base_env(cluster.root, **extra),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0 and p.stderr == "", p


@pytest.mark.timeout(300)
def test_scancel_signal_stays_slurms_no_steps_nothing_full_everything(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`scancel --signal` has no fallback: without -b/-f a job with no step gets nothing
    (Slurm); `--full` reaches the batch shell, its children and every step."""
    cluster.start(nodes=1, cpus=4)
    go = tmp_path / "go"
    # every process records each USR1 it traps and goes on until `go` exists
    loop = f"while [ ! -e {go} ]; do sleep 0.1; done"
    child = f"bash -c 'trap \"echo $0 >> $GOT\" USR1; touch $GOT.$0; {loop}'"
    scripts = {
        "nosteps": f"{child} child &\n",
        "steps": f"srun {child} step &\n",
    }
    ids, files = {}, {}
    for name, body in scripts.items():
        files[name] = got = tmp_path / f"{name}.got"
        script = (
            f"#!/bin/bash\nexport GOT={got}\ntrap 'echo batch >> $GOT' USR1\n{body}"
            f"while [ ! -e {go} ]; do sleep 0.1; done\nwait\nexit 0\n"
        )
        ids[name] = cluster.submit_script(tmp_path, name, script, env={"PATH": PATH})
    for name, what in (("nosteps", "child"), ("steps", "step")):
        wait_for(Path(f"{files[name]}.{what}").exists, what=f"{name}: the {what} to trap USR1")

    def lines(name: str) -> list[str]:
        return sorted(files[name].read_text().split()) if files[name].exists() else []

    # without -b/-f: the step's task gets it, the batch shell does not; a job without steps:
    # nobody (the --full that follows is the first signal its processes see)
    scancel(cluster, tmp_path, "--signal=USR1", str(ids["steps"]))
    wait_for(lambda: lines("steps") == ["step"], what="the step alone to trap it", timeout=90)
    scancel(cluster, tmp_path, "--signal=USR1", str(ids["nosteps"]))
    for name in ("nosteps", "steps"):
        scancel(cluster, tmp_path, "--signal=USR1", "--full", str(ids[name]))
    # --full: the batch shell, its children, every step (srun, a child of the batch shell,
    # also passes it on to its step, so the step may hear it twice, as under Slurm)
    wait_for(
        lambda: lines("nosteps") == ["batch", "child"], what="nosteps: batch and child", timeout=90
    )
    wait_for(
        lambda: "batch" in lines("steps") and lines("steps").count("step") >= 2,
        what="steps: the batch shell and the step again",
        timeout=90,
    )
    go.touch()
    ended = cluster.wait_terminal(list(ids.values()), timeout=120)
    assert {ended[j]["state"] for j in ids.values()} == {"COMPLETED"}, ended
    assert lines("nosteps") == ["batch", "child"]  # and nothing more arrived later
    assert lines("steps").count("batch") == 1
