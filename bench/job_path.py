"""The store's share of a job's life in the controller (issue 12: placements per second).

    python bench/job_path.py --jobs 2000 --nodes 50 --runs 3

In the placement runs of `bench/sim.py` the controller holds the interpreter lock for a full
core, and most of that time is the store's write path per job: its start (`start_attempts`,
in a scheduling pass), the node's "running" report and its "exited" report
(`apply_reports`, from heartbeats). This times exactly those three calls on a fresh SQLite
store, without HTTP, scheduling or agents, for `--jobs` single-CPU jobs spread over `--nodes`
nodes: starts in batches of 100 (as a pass makes them), then one heartbeat per node with its
"running" reports, then one per node with its "exited" reports, until every job has ended.
CPU is this process's (the store's Python, SQLAlchemy and SQLite; there is nothing else), per
job. Prints each run, medians over the runs, and as the last line

    job_path: jobs=J start_ms=A running_ms=B exited_ms=C total_ms=T per_s=R

where the ms are CPU per job and `per_s` is 1000 / total_ms: the jobs a second one core could
carry through the store alone, a ceiling for the whole controller.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from phalanx.config import load_config
from phalanx.controller.runtime import partition_rows
from phalanx.store.store import Store, TaskReport

sys.path.insert(0, str(Path(__file__).parent))
from snapshot import item


def one_run(jobs: int, nodes: int) -> tuple[float, float, float]:
    """CPU seconds per job of starts, running reports and exited reports."""
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-jobpath-") as d:
        store = Store(f"sqlite:///{d}/j.db")
        try:
            store.migrate()
            store.sync_partitions(partition_rows(load_config()))
            names = [f"n{i:04d}" for i in range(nodes)]
            for n in names:
                store.register_node(
                    n,
                    cpus=256,
                    mem_mb=1_000_000,
                    gpus=[],
                    features=[],
                    addr=None,
                    boot_id=None,
                    version=None,
                )
            ids = [
                i for one in store.submit([item(store) for _ in range(jobs)], "bench") for i in one
            ]
            job = store.get_job(ids[0])
            starts: list[dict[str, Any]] = [
                {
                    "job_id": jid,
                    "partition": job["partition"],
                    "nodes": [names[i % nodes]],
                    "cpus_per_node": job["cpus_per_node"],
                    "mem_per_node_mb": [job["mem_per_node_mb"]],
                    "gpu_ids": [[]],
                    "exclusive": False,
                }
                for i, jid in enumerate(ids)
            ]
            c0 = time.process_time()
            for k in range(0, jobs, 100):
                assert len(store.start_attempts(starts[k : k + 100], None)) == len(
                    starts[k : k + 100]
                )
            start_s = time.process_time() - c0
            by_node: dict[str, list[TaskReport]] = defaultdict(list)
            for st in starts:
                att = store.attempts_of(int(st["job_id"]))[-1]
                by_node[st["nodes"][0]].append(
                    TaskReport(att["id"], att["token"], "running", started_at=time.time())
                )
            c0 = time.process_time()
            for n, reps in by_node.items():
                store.apply_reports(n, reps, None)
            running_s = time.process_time() - c0
            exited = {
                n: [
                    TaskReport(r.attempt_id, r.token, "exited", exit={"exit_code": 0}) for r in reps
                ]
                for n, reps in by_node.items()
            }
            c0 = time.process_time()
            # one report per heartbeat, as jobs that end at different times arrive
            for k in range(jobs // nodes + 1):
                for n, reps in exited.items():
                    if k < len(reps):
                        store.apply_reports(n, [reps[k]], None)
            exited_s = time.process_time() - c0
            states = {store.get_job(j)["state"] for j in ids[:: max(1, jobs // 50)]}
            assert states == {"COMPLETED"}, states
            return start_s / jobs, running_s / jobs, exited_s / jobs
        finally:
            store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        r = one_run(args.jobs, args.nodes)
        runs.append(r)
        print(
            f"run {i + 1}: CPU per job: start {r[0] * 1e3:.3f} ms, running report "
            f"{r[1] * 1e3:.3f} ms, exited report {r[2] * 1e3:.3f} ms",
            flush=True,
        )
    start, running, exited = (statistics.median(r[k] for r in runs) * 1e3 for k in range(3))
    total = start + running + exited
    print(
        f"medians of {args.runs}: start {start:.3f} ms + running {running:.3f} ms + exited "
        f"{exited:.3f} ms = {total:.3f} ms of CPU a job: at most {1000 / total:.0f} jobs/s "
        "on one core for the store alone"
    )
    print(
        f"job_path: jobs={args.jobs} start_ms={start:.3f} running_ms={running:.3f} "
        f"exited_ms={exited:.3f} total_ms={total:.3f} per_s={1000 / total:.0f}"
    )


if __name__ == "__main__":
    main()
