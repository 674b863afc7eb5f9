"""What a Slurm command costs a user or a workflow tool, call by call, beside Slurm (issue 27).

    python bench/cli.py --runs 3            # Phalanx, and Slurm when its lab is up
    python bench/cli.py --runs 3 --loop 500

Users and workflow engines call the commands one process at a time: `sbatch` in a shell
loop, Snakemake and Nextflow per rule, tools polling `squeue` and `sacct`. So this runs the
installed commands as separate processes, as they do, against a local cluster (`phalanx up`,
4 nodes, SQLite), and measures

* `sbatch --wrap=true`: seconds a call (median of `--calls` sequential calls);
* `squeue` with 1,000 jobs queued (held): seconds a call;
* `sacct -j N` of a finished job: seconds a call;
* a shell loop of `--loop` sequential `sbatch --wrap=true` (`for i in ...; do sbatch ...;
  done` in bash): jobs submitted a second, and all of them completed a second (from the
  loop's start to the last one's end).

Column "phalanx" is the compiled commands `make install` puts in .venv/bin (`phalanx
slurm-commands --install`), served by the cluster's command server (slurm/cmdserver.py);
column "python" is the same commands with the server turned off (PHALANX_COMMAND_SOCKET=off:
each call starts the interpreter and runs the Python command), as before the server
(`--no-python` leaves it out).

The same calls go to Slurm 22.05 when its lab (../shared/slurm-lab, `./up.sh`) is running:
`/tmp/slurmlab.current` names its state dir, whose etc/slurm.conf the calls use, and
Debian's commands in /usr/bin run them. Each figure is the median over `--runs` runs, and
the ratio is Slurm's time over Phalanx's (higher is better for Phalanx). The lab runs without
slurmdbd, so Slurm's `sacct` has no figure there ("-").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
from common import Api, log

BIN = Path(sys.executable).parent  # the project's console scripts (sbatch, squeue, ...)
SLURM_BIN = Path("/usr/bin")
LAB_POINTER = Path("/tmp/slurmlab.current")


class Target:
    """A scheduler's commands: where they are and the environment they run in."""

    def __init__(self, name: str, bindir: Path, env: dict[str, str], cwd: Path) -> None:
        self.name = name
        self.bindir = bindir
        self.env = env
        self.cwd = cwd  # where the calls run: their jobs write slurm-<id>.out there

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [str(self.bindir / argv[0]), *argv[1:]],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        if p.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} failed: {p.stderr.strip()}")
        return p

    def per_call(self, calls: int, *argv: str) -> float:
        """Median seconds of one call, over `calls` sequential calls."""
        took = []
        for _ in range(calls):
            t0 = time.perf_counter()
            self.run(*argv)
            took.append(time.perf_counter() - t0)
        return statistics.median(took)

    def submit(self) -> int:
        return int(self.run("sbatch", "--parsable", "--wrap=true").stdout.split(";")[0])

    def loop(self, n: int) -> tuple[float, list[int]]:
        """`n` sequential sbatch calls in a bash loop: seconds taken, and the job ids."""
        script = f'for i in $(seq {n}); do "{self.bindir}/sbatch" --parsable --wrap=true; done'
        t0 = time.perf_counter()
        p = subprocess.run(
            ["bash", "-c", script],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        took = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"{self.name}: the sbatch loop failed: {p.stderr.strip()[-500:]}")
        return took, [int(x.split(";")[0]) for x in p.stdout.split()]


def phalanx_target(url: str, cwd: Path, state: Path, *, server: bool) -> Target:
    """The compiled commands through the cluster's command server, or (not `server`) the
    Python commands they fall back to."""
    sock = str(state / "commands.sock") if server else "off"
    env = {**os.environ, "PHALANX_URL": url, "PHALANX_COMMAND_SOCKET": sock}
    return Target("phalanx" if server else "python", BIN, env, cwd)


def slurm_target(cwd: Path) -> Target | None:
    """Slurm's lab, when it is up (its state dir named in /tmp/slurmlab.current)."""
    if not LAB_POINTER.is_file() or not (SLURM_BIN / "sbatch").is_file():
        return None
    conf = Path(LAB_POINTER.read_text().strip()) / "etc" / "slurm.conf"
    if not conf.is_file():
        return None
    t = Target("slurm", SLURM_BIN, {**os.environ, "SLURM_CONF": str(conf)}, cwd)
    try:
        t.run("sinfo", "-h")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        log(f"Slurm's lab does not answer ({e}); Phalanx alone")
        return None
    return t


def wait_done(t: Target, ids: list[int], timeout: float = 1800.0) -> float:
    """Wait until none of `ids` is queued or running (squeue lists none of them); the
    monotonic time it was seen so."""
    want = {str(i) for i in ids}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = set(t.run("squeue", "-h", "-o", "%i").stdout.split()) & want
        if not left:
            return time.monotonic()
        time.sleep(0.2)  # polling interval of a wait on a condition
    raise RuntimeError(f"{t.name}: jobs still queued after {timeout:.0f}s")


def one_run(t: Target, args: argparse.Namespace, queued: Callable[[], None]) -> dict[str, float]:
    out: dict[str, float] = {}
    out["sbatch_s"] = t.per_call(args.calls, "sbatch", "--wrap=true")
    done = t.submit()
    wait_done(t, [done])
    try:
        out["sacct_s"] = t.per_call(args.calls, "sacct", "-j", str(done))
    except RuntimeError as e:  # Slurm's lab runs without slurmdbd: no accounting
        log(f"{e}: no sacct figure")
        out["sacct_s"] = float("nan")
    t0 = time.monotonic()
    took, ids = t.loop(args.loop)
    out["loop_jobs_per_s"] = len(ids) / took
    end = wait_done(t, ids)
    out["loop_done_jobs_per_s"] = len(ids) / (end - t0)
    queued()
    out["squeue_s"] = t.per_call(args.calls, "squeue")
    return out


ROWS = (
    ("sbatch_s", "sbatch --wrap=true, s a call", "s", 0.035),
    ("squeue_s", "squeue, 1,000 jobs queued, s a call", "s", 0.05),
    ("sacct_s", "sacct -j N, s a call", "s", 0.05),
    ("loop_jobs_per_s", "sbatch loop, jobs submitted/s", "/s", 100.0),
    ("loop_done_jobs_per_s", "sbatch loop, jobs completed/s", "/s", 50.0),
)


def report(runs: dict[str, list[dict[str, float]]]) -> None:
    names = list(runs)
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k, *_ in ROWS} for n in names}
    shown = {n: {k: "-" if v != v else f"{v:.3f}" for k, v in m.items()} for n, m in med.items()}
    head = f"{'':38}" + "".join(f"{n:>10}" for n in names)
    if "slurm" in med:
        head += f"{'vs slurm':>10}"
    print(head + f"{'bar':>9}  ok")
    print("-" * len(head + " " * 13))
    for key, label, unit, bar in ROWS:
        line = f"{label:38}" + "".join(f"{shown[n][key]:>10}" for n in names)
        p = med["phalanx"][key]
        if "slurm" in med:
            s = med["slurm"][key]
            ratio = s / p if unit == "s" else p / s
            line += f"{ratio:>9.2f}x" if ratio == ratio else f"{'-':>10}"
        ok = p <= bar if unit == "s" else p >= bar
        line += f"{('<=' if unit == 's' else '>=') + f'{bar:g}':>9}  {'yes' if ok else 'no'}"
        print(line)
    print(f"medians over {len(runs['phalanx'])} run(s); vs slurm: how many times faster Phalanx is")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="sequential calls a per-call figure")
    ap.add_argument("--loop", type=int, default=500, help="sbatch calls in the shell loop")
    ap.add_argument("--no-slurm", action="store_true", help="Phalanx alone")
    ap.add_argument("--no-python", action="store_true", help="not the Python commands' column")
    args = ap.parse_args()
    state = common.state_dir("phalanx-bench-cli-")
    work = state / "work"  # the jobs' working directory (their output files), removed after
    work.mkdir()
    slurm = None if args.no_slurm else slurm_target(work)
    if not (BIN / "sbatch").is_symlink():
        log(f"{BIN / 'sbatch'} is not the compiled command: `phalanx slurm-commands --install`")
    runs: dict[str, list[dict[str, float]]] = {"phalanx": []}
    if not args.no_python:
        runs["python"] = []
    if slurm is not None:
        runs["slurm"] = []
    port = common.free_port()
    url = f"http://127.0.0.1:{port}"
    with common.phalanx_up(state, ["--port", str(port), *common.node_args(4)], url, keep=False):
        api = Api(url, timeout=60.0)
        phalanx = phalanx_target(url, work, state, server=True)
        python = phalanx_target(url, work, state, server=False)
        held: dict[str, list[Any]] = {"phalanx": [], "slurm": []}

        def queue_phalanx() -> None:  # 1,000 held jobs for squeue to list
            if not held["phalanx"]:
                held["phalanx"] = api.post(
                    "/v1/jobs/batch",
                    {"jobs": [{"script": "#!/bin/sh\ntrue\n", "hold": True}] * 1000},
                )["jobs"]

        def queue_slurm() -> None:
            if slurm is not None and not held["slurm"]:
                p = slurm.run("sbatch", "--parsable", "--hold", "--array=1-1000", "--wrap=true")
                held["slurm"] = [p.stdout.split(";")[0].strip()]

        try:
            for i in range(args.runs):
                r = one_run(phalanx, args, queue_phalanx)
                log(f"phalanx run {i + 1}: " + " ".join(f"{k}={v:.3f}" for k, v in r.items()))
                runs["phalanx"].append(r)
                if not args.no_python:
                    r = one_run(python, args, queue_phalanx)
                    log(f"python run {i + 1}: " + " ".join(f"{k}={v:.3f}" for k, v in r.items()))
                    runs["python"].append(r)
                if slurm is not None:
                    r = one_run(slurm, args, queue_slurm)
                    log(f"slurm run {i + 1}: " + " ".join(f"{k}={v:.3f}" for k, v in r.items()))
                    runs["slurm"].append(r)
        finally:
            if slurm is not None and held["slurm"]:
                subprocess.run(
                    [str(SLURM_BIN / "scancel"), *held["slurm"]], env=slurm.env, check=False
                )
            api.http.close()
    report(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
