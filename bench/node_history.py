"""A heartbeat's read of its node's work against the node's history (issue 12: the rate
after 30 minutes within 10% of the first minute's).

    python bench/node_history.py --history 0 1000 10000 100000 --reads 200 --runs 3

Every heartbeat reads the tasks of its node whose attempt still holds resources
(`Store.node_work`). By the node alone that walked every task the node had ever run, joined
to its attempt to find the few not ENDED, so a heartbeat cost more the longer the cluster
ran; now the (node, held) index holds the node's live tasks only (tasks.held, migration
0011). For each history size this fills a fresh SQLite store with one node that ran that
many jobs to the end and runs one job now, then times the read both ways on the same store:
`held` (the query the controller runs) and `by node` (the same query without the held term,
the read before migration 0011). Prints medians over the runs of the per-read time, the
ratio, and as the last line

    node_history: history=H held_ms=X by_node_ms=Y purge_ms=P purge_by_state_ms=Q (per size)

The same history also counts as that many finished jobs (each a copy of the first one's row)
for the accounting purge's search (`Store.purge_finished`, every purge interval), which finds
no job old enough in a cluster younger than its retention: `purge` is the store's call (by
ix_jobs_end_time, migration 0012), `purge by state` the search before it (the state index,
every finished job's row read and sorted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Select, func, select

from phalanx.config import load_config
from phalanx.controller.runtime import partition_rows
from phalanx.domain.states import TERMINAL
from phalanx.store import schema as s
from phalanx.store.exchange import _NODE_WORK
from phalanx.store.store import Store, TaskReport

sys.path.insert(0, str(Path(__file__).parent))
from snapshot import item


def node_work_query() -> Select[Any]:
    """The heartbeat's read of a node's work (Store.node_work), as a SQLAlchemy statement."""
    q = _NODE_WORK.statement
    assert isinstance(q, Select)
    return q


def by_node_query() -> Select[Any]:
    """The read before migration 0011: the same query without its held term."""
    q = node_work_query()
    where = q.whereclause
    assert where is not None
    kept: list[Any] = [c for c in where.get_children() if s.tasks.c.held not in c.get_children()]
    return select(*q.selected_columns).select_from(q.get_final_froms()[0]).where(*kept)


def run_job(store: Store, node: str, finish: bool) -> int:
    (ids,) = store.submit([item(store)], "bench")
    job = store.get_job(ids[0])
    start = {
        "job_id": ids[0],
        "partition": job["partition"],
        "nodes": [node],
        "cpus_per_node": job["cpus_per_node"],
        "mem_per_node_mb": [job["mem_per_node_mb"]],
        "gpu_ids": [[]],
        "exclusive": False,
    }
    assert store.start_attempts([start], None) == ids
    att = store.attempts_of(ids[0])[-1]
    if finish:
        rep = TaskReport(att["id"], att["token"], "exited", exit={"exit_code": 0})
        store.apply_reports(node, [rep], time.time())
    return int(att["id"])


def copy_history(conn: Connection, attempt_id: int, n: int) -> None:
    """`n` more ended attempts like `attempt_id`, each with its task on the same node, in two
    INSERT ... SELECT statements (running that many jobs through the store takes minutes)."""
    a_cols = [c.name for c in s.attempts.c if c.name != "id"]
    t_cols = [c.name for c in s.tasks.c if c.name != "attempt_id"]
    top = conn.execute(select(func.max(s.attempts.c.id))).scalar_one()
    fresh = {"token": "token || '-' || x", "seq": "seq + x"}  # unique per attempt
    conn.exec_driver_sql(
        f"WITH RECURSIVE k(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM k WHERE x < {n}) "
        f"INSERT INTO attempts (id, {', '.join(a_cols)}) "
        f"SELECT {top} + x, {', '.join(fresh.get(c, c) for c in a_cols)} "
        f"FROM attempts, k WHERE attempts.id = {attempt_id}"
    )
    conn.exec_driver_sql(
        f"INSERT INTO tasks (attempt_id, {', '.join(t_cols)}) "
        f"SELECT a.id, {', '.join('t.' + c for c in t_cols)} FROM attempts a, tasks t "
        f"WHERE a.id > {top} AND t.attempt_id = {attempt_id}"
    )


def copy_jobs(conn: Connection, job_id: int, n: int) -> None:
    """`n` more finished jobs like `job_id` (the purge's search reads jobs rows only)."""
    cols = [c.name for c in s.jobs.c if c.name != "id"]
    conn.exec_driver_sql(
        f"WITH RECURSIVE k(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM k WHERE x < {n}) "
        f"INSERT INTO jobs ({', '.join(cols)}) SELECT {', '.join(cols)} "
        f"FROM jobs, k WHERE jobs.id = {job_id}"
    )


def purge_by_state_query(older_than: float) -> Select[Any]:
    """The purge's search before migration 0012."""
    return (
        select(s.jobs.c.id)
        .where(s.jobs.c.state.in_([t.value for t in TERMINAL]), s.jobs.c.end_time < older_than)
        .order_by(s.jobs.c.id)
        .limit(500)
    )


def timed_purges(store: Store, reads: int) -> tuple[float, float]:
    """Per search: the store's purge call (finds none), and the search before it."""
    older = time.time() - 30 * 86400
    assert store.purge_finished(older) == 0  # warm
    t0 = time.perf_counter()
    for _ in range(reads):
        store.purge_finished(older)
    now_s = (time.perf_counter() - t0) / reads
    with store.db.begin(write=False) as conn:
        assert conn.execute(purge_by_state_query(older)).all() == []
        t0 = time.perf_counter()
        for _ in range(reads):
            conn.execute(purge_by_state_query(older)).all()
        return now_s, (time.perf_counter() - t0) / reads


def timed_reads(store: Store, q: Select[Any], node: str, reads: int) -> tuple[float, int]:
    with store.db.begin(write=False) as conn:
        conn.execute(q, {"node": node}).all()  # warm
        t0 = time.perf_counter()
        for _ in range(reads):
            rows = conn.execute(q, {"node": node}).all()
        return (time.perf_counter() - t0) / reads, len(rows)


def one_run(history: int, reads: int) -> tuple[float, float, float, float]:
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-hist-") as d:
        store = Store(f"sqlite:///{d}/h.db")
        try:
            store.migrate()
            store.sync_partitions(partition_rows(load_config()))
            store.register_node(
                "n1",
                cpus=64,
                mem_mb=65536,
                gpus=[],
                features=[],
                addr=None,
                boot_id=None,
                version=None,
            )
            first = run_job(store, "n1", finish=True) if history else 0
            if history > 1:
                with store.db.begin() as conn:
                    copy_history(conn, first, history - 1)
                    job = conn.execute(
                        select(s.attempts.c.job_id).where(s.attempts.c.id == first)
                    ).scalar_one()
                    copy_jobs(conn, job, history - 1)
            live = run_job(store, "n1", finish=False)
            held_s, n_held = timed_reads(store, node_work_query(), "n1", reads)
            node_s, n_node = timed_reads(store, by_node_query(), "n1", reads)
            assert n_held == n_node == 1, (n_held, n_node, live)
            purge_s, by_state_s = timed_purges(store, max(1, reads // 10))
            return held_s, node_s, purge_s, by_state_s
        finally:
            store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, nargs="+", default=[0, 1000, 10000, 100000])
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    out = []
    for h in args.history:
        runs = [one_run(h, args.reads) for _ in range(args.runs)]
        held_ms = statistics.median(r[0] for r in runs) * 1000
        node_ms = statistics.median(r[1] for r in runs) * 1000
        purge_ms = statistics.median(r[2] for r in runs) * 1000
        by_state_ms = statistics.median(r[3] for r in runs) * 1000
        print(
            f"history {h:>7} ended tasks on the node: held {held_ms:.3f} ms a read, "
            f"by node {node_ms:.3f} ms ({node_ms / held_ms:.1f}x); purge search "
            f"{purge_ms:.3f} ms, by state {by_state_ms:.3f} ms ({by_state_ms / purge_ms:.1f}x); "
            f"medians of {args.runs}",
            flush=True,
        )
        out.append(
            f"history={h} held_ms={held_ms:.3f} by_node_ms={node_ms:.3f} "
            f"purge_ms={purge_ms:.3f} purge_by_state_ms={by_state_ms:.3f}"
        )
    print("node_history: " + " ".join(out))


if __name__ == "__main__":
    main()
