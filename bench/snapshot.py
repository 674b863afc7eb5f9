"""The scheduling loop's read of the pending queue from the store (issue 12): whole, or
incremental through the pending mirror (store/pending.py, docs/scheduling.md).

    python bench/snapshot.py --pending 100000 --changes 200 --passes 9 --runs 3

Fills a fresh SQLite store (or `--store URL`) with `--pending` pending jobs (arrays of 1,000
tasks, as a real backlog is mostly arrays) on `--nodes` registered nodes, then times per pass:

* whole: every pending row read afresh (what ordering the whole queue by multifactor priority
  would cost each pass without the mirror);
* capped: the first 5,000 by (--priority, id), what the controller read before the mirror
  (fair share then ordered those 5,000 alone);
* mirror: the mirror's read, with `--changes` jobs submitted and `--changes` reasons set
  before each pass (a busy queue: the pass's own reason writes come back to it);
* snapshot: the whole `Store.sched_snapshot` of a scheduling pass with the mirror (nodes,
  allocations, and the split of the pending jobs by begin time), after the same changes.

Prints per-pass wall and CPU medians for each, the mirror's ratio to the whole read, and as
the last line

    snapshot: pending=N changes=C whole_s=X capped_s=Y mirror_s=Z

    python bench/snapshot.py --busy --runs 5 [--store URL]

measures instead a small busy cluster, as in a loop of `sbatch` with the jobs running (issue
27): 4 nodes, 8 jobs running, 2 pending; the controller-side CPU of one `sched_snapshot`
(median of 500 a run; the last line `busy: snapshot_ms=X`). With a PostgreSQL `--store URL`,
give it an empty database and `--runs 1` (each run fills the store it is given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select

from phalanx.config import load_config
from phalanx.controller.runtime import partition_rows
from phalanx.domain import scheduling
from phalanx.domain.spec import JobSpec, normalize
from phalanx.domain.states import JobState
from phalanx.store import schema as s
from phalanx.store.scheduling import _PENDING_COLUMNS
from phalanx.store.store import Store


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def item(store: Store, **kw: Any) -> tuple[Any, dict[str, Any]]:
    spec = JobSpec(argv=["/bin/true"], **kw)
    resolved = normalize(
        spec, store.partition_infos(), default_mem_per_cpu_mb=512, default_requeue=True
    )
    return resolved, spec.model_dump(exclude={"ignored"})


def fill(store: Store, pending: int, nodes: int) -> None:
    for i in range(nodes):
        store.register_node(
            f"n{i:05d}",
            cpus=64,
            mem_mb=256 * 1024,
            gpus=[],
            features=[],
            addr=None,
            boot_id=None,
            version=None,
        )
    left, users = pending, [f"user{u}" for u in range(24)]
    while left > 0:
        n = min(1000, left)
        store.submit([item(store, array=f"0-{n - 1}", nice=left % 7)], users[left % len(users)])
        left -= n


def read_pending(store: Store, limit: int | None) -> list[dict[str, Any]]:
    """The pending rows read afresh (the read before the mirror): all, or the first `limit`
    by (--priority, id)."""
    q = (
        select(*_PENDING_COLUMNS)
        .where(s.jobs.c.state == JobState.PENDING.value)
        .order_by(s.jobs.c.priority.desc(), s.jobs.c.id)
    )
    with store.db.begin(write=False) as conn:
        return [dict(r) for r in conn.execute(q if limit is None else q.limit(limit)).mappings()]


def sync(store: Store) -> list[dict[str, Any]]:
    """The mirror's read alone (what replaced `read_pending`)."""
    with store.db.begin(write=False, snapshot=True) as conn:
        return store.pending_mirror.sync(conn).rows


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def new_store(url: str) -> Store:
    """The store at `url`, migrated, with one partition `batch` (the default)."""
    store = Store(url, actor="bench")
    store.migrate()
    cfg = load_config(overrides={"cluster": {"partitions": [{"name": "batch", "default": True}]}})
    store.sync_partitions(partition_rows(cfg))
    return store


def one_run(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    store = new_store(url)
    try:
        t0 = time.perf_counter()
        fill(store, args.pending, args.nodes)
        log(f"filled {args.pending} pending jobs in {time.perf_counter() - t0:.1f}s")
        keys = ("whole", "capped", "mirror", "snapshot")
        out: dict[str, list[float]] = {k + c: [] for k in keys for c in ("", "_cpu")}
        for _ in range(args.passes):
            for key, limit in (("whole", None), ("capped", 5000)):
                w, c, rows = timed(lambda lim=limit: read_pending(store, lim))  # type: ignore[misc]
                assert len(rows) == min(args.pending, limit or args.pending)
                out[key].append(w)
                out[key + "_cpu"].append(c)
        mirror = store.pending_mirror
        store.sched_snapshot(eligible_by=time.time())  # the whole read at the start
        ids = sorted(int(j["id"]) for j in store.sched_snapshot(eligible_by=time.time()).pending)
        for p in range(args.passes):
            for key in ("mirror", "snapshot"):
                store.submit([item(store, array=f"0-{args.changes - 1}")], "user0")
                store.set_pending_reasons(
                    {jid: f"Priority {p}" for jid in ids[p * args.changes : (p + 1) * args.changes]}
                )
                if key == "mirror":
                    w, c, rows = timed(lambda: sync(store))
                else:
                    w, c, snap = timed(lambda: store.sched_snapshot(eligible_by=time.time()))
                    rows = snap.pending
                assert len(rows) == args.pending + (2 * p + 1 + (key == "snapshot")) * args.changes
                out[key].append(w)
                out[key + "_cpu"].append(c)
        assert mirror.whole_reads == 1
        return out
    finally:
        store.close()


def busy_run(url: str, snapshots: int = 500) -> float:
    """CPU seconds of one snapshot of a small busy cluster (see the module docstring)."""
    store = new_store(url)
    try:
        for i in range(4):
            store.register_node(
                f"n{i}", cpus=2, mem_mb=8192, gpus=[], features=[], addr=None, boot_id=None,
                version=None,
            )  # fmt: skip
        for _ in range(10):
            store.submit([item(store)], "user0")
        snap = store.sched_snapshot(eligible_by=time.time())
        starts = [p.start_item() for p in scheduling.plan(snap, time.time()).starts]
        assert len(store.start_attempts(starts, None)) == 8  # 2 CPUs a node, 1 a job
        c = time.process_time()
        for _ in range(snapshots):
            store.sched_snapshot(eligible_by=time.time())
        return (time.process_time() - c) / snapshots
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pending", type=int, default=100_000)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--changes", type=int, default=200, help="submissions and reasons a pass")
    ap.add_argument("--passes", type=int, default=9)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--store", default="sqlite", help="sqlite (a temporary file) or a URL")
    ap.add_argument("--busy", action="store_true", help="a small busy cluster's snapshot")
    args = ap.parse_args()
    if args.busy:
        cpu = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="phalanx-bench-snapshot-") as d:
                url = f"sqlite:///{Path(d) / 'store.db'}" if args.store == "sqlite" else args.store
                cpu.append(busy_run(url))
            log(f"run {len(cpu)}: {1000 * cpu[-1]:.2f} ms a snapshot")
        print(f"busy: snapshot_ms={1000 * statistics.median(cpu):.2f} (median of {args.runs} runs)")
        return
    runs: list[dict[str, list[float]]] = []
    for r in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="phalanx-bench-snapshot-") as d:
            url = f"sqlite:///{Path(d) / 'store.db'}" if args.store == "sqlite" else args.store
            runs.append(one_run(args, url))
        log(
            f"run {r + 1}: "
            + ", ".join(f"{k} {statistics.median(v):.3f}s" for k, v in runs[-1].items())
        )
    med = {k: statistics.median(statistics.median(run[k]) for run in runs) for k in runs[0]}
    print(
        f"pending {args.pending}, {args.changes} submissions and {args.changes} reasons a pass, "
        f"{args.passes} passes x {args.runs} runs (medians; wall / CPU per pass)"
    )
    for k in ("whole", "capped", "mirror", "snapshot"):
        print(f"  {k:8s} {med[k]:7.3f} s / {med[k + '_cpu']:7.3f} s")
    print(f"  mirror / whole: {med['mirror'] / med['whole']:.3f}")
    print(
        f"snapshot: pending={args.pending} changes={args.changes} whole_s={med['whole']:.3f} "
        f"capped_s={med['capped']:.3f} mirror_s={med['mirror']:.3f} "
        f"snapshot_s={med['snapshot']:.3f}"
    )


if __name__ == "__main__":
    main()
