"""One scheduling pass at scale: the pure core (`scheduling.plan`) on a synthetic cluster.

    python bench/scale.py --nodes 10000 --jobs 100000 --passes 7

No controller, no store, no I/O: a synthetic `SchedSnapshot` of N nodes (CPU nodes and 8-GPU
nodes of two types, three partitions), running allocations that fill most of them with staggered
time limits, and M pending jobs of mixed shapes (single-node CPU jobs, array tasks counted one
per task, multi-node exclusive gang jobs with GPUs), from 24 users in 6 accounts with fair share
on (a Fair Tree table over random decayed usage, multifactor priority as the controller uses).

A simulated clock advances `--step` seconds between passes: the running work whose time limit
has passed ends, each pass's starts become allocations of the next snapshot and leave the queue,
so the passes see a cluster that moves. Printed per pass: wall and process CPU seconds, starts;
then medians/p99 over the passes, memory per pending job and per node (tracemalloc over the
snapshot rows, and the peak of one pass), the issue's references, and as the last line:

    scale: nodes=N pending=M cycle_p50=Xs cycle_p99=Ys placements_per_s=Z

``placements_per_s`` is the starts of the timed passes over their summed wall time (how fast the core
decides starts; applying them to a store is another matter). Timings taken on a loaded machine are
noisy: the CPU seconds and the load average are printed beside them.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc
from typing import Any

from phalanx.domain import fairshare as fs
from phalanx.domain import limits as lim
from phalanx.domain import priority as prio
from phalanx.domain.scheduling import DEFAULT_QUEUE_DEPTH, plan
from phalanx.store.store import SchedSnapshot

REFERENCES = (
    "references (issue 12): kube-scheduler CI 680-810 pods/s at 5,000 fake nodes; Nomad 1,500 "
    "placements/s; Slurm ~500 jobs/s sustained; Flux ~870 jobs/s (147 -> 69 jobs/s as the queue "
    "grows, flux-core #6690); bar: one pass at 10,000 nodes x 100,000 pending p50 < 0.5 s, "
    "p99 < 1 s"
)

T0 = 1_800_000_000.0
ACCOUNTS = ("physics", "chem", "bio", "ml", "climate", "ops")
USERS = [f"u{i:02d}" for i in range(24)]


def build_nodes(n: int) -> list[dict[str, Any]]:
    """70% CPU nodes (cpu0001...), 30% GPU nodes (gpu0001..., 8 a100 or h100 each)."""
    n_gpu = n * 3 // 10
    out = []
    for i in range(n - n_gpu):
        out.append(
            {
                "name": f"cpu{i:05d}",
                "cpus": 64,
                "mem_mb": 256_000,
                "gpus": [],
                "features": ["avx512"] if i % 2 else [],
                "registered": True,
                "down": False,
                "drain": False,
                "topology": None,  # a store row has the column (no place here)
            }
        )
    for i in range(n_gpu):
        gtype = "h100" if i % 3 == 0 else "a100"
        out.append(
            {
                "name": f"gpu{i:05d}",
                "cpus": 96,
                "mem_mb": 1_000_000,
                "gpus": [[d, gtype] for d in range(8)],
                "features": ["ib"],
                "registered": True,
                "down": i % 500 == 7,
                "drain": False,
                "topology": None,  # a store row has the column (no place here)
            }
        )
    return out


PARTITIONS = {
    "cpu": {"name": "cpu", "nodes": "cpu*", "priority": 10},
    "gpu": {"name": "gpu", "nodes": "gpu*", "priority": 20},
    "all": {"name": "all", "nodes": "cpu*,gpu*", "priority": 0},
}


def job_row(jid: int, rng: random.Random, now: float, **kw: Any) -> dict[str, Any]:
    user = rng.choice(USERS)
    row: dict[str, Any] = {
        "id": jid,
        "name": f"j{jid}",
        "user": user,
        "account": ACCOUNTS[int(user[1:]) % len(ACCOUNTS)],
        "qos": None,
        "nice": 0,
        "priority": 0,
        "submit_time": now - rng.uniform(0, 86400),
        "eligible_time": None,
        "partitions": "cpu",
        "nodes": 1,
        "cpus_per_node": 1,
        "mem_per_node_mb": 2048,
        "gpus_per_node": 0,
        "gpu_type": None,
        "exclusive": False,
        "constraint_expr": None,
        "nodelist": [],
        "exclude": [],
        "time_limit_s": rng.choice((600, 1800, 3600, 4 * 3600, 12 * 3600)),
        "dependency": [],
        "array_job_id": None,
        "array_limit": None,
        "reason": None,
    }
    row.update(kw)
    return row


def build_pending(m: int, rng: random.Random, now: float, first_id: int) -> list[dict[str, Any]]:
    """60% single-node CPU jobs, 25% array tasks (arrays of 50-500 tasks), 15% gang jobs."""
    out: list[dict[str, Any]] = []
    jid = first_id
    while len(out) < m:
        r = rng.random()
        if r < 0.60:
            out.append(
                job_row(
                    jid,
                    rng,
                    now,
                    cpus_per_node=rng.choice((1, 2, 4, 8, 16)),
                    mem_per_node_mb=rng.choice((1024, 4096, 16384)),
                    partitions=rng.choice(("cpu", "cpu", "cpu,all")),
                    constraint_expr="avx512" if rng.random() < 0.1 else None,
                )
            )
            jid += 1
        elif r < 0.85:
            tasks = min(rng.randint(50, 500), m - len(out))
            arr = jid
            limit = rng.choice((None, None, 20, 100))
            cpus = rng.choice((1, 2, 4))
            tl = rng.choice((600, 3600))
            base = rng.uniform(0, 86400)
            for _ in range(tasks):
                out.append(
                    job_row(
                        jid,
                        rng,
                        now,
                        cpus_per_node=cpus,
                        time_limit_s=tl,
                        array_job_id=arr,
                        array_limit=limit,
                        submit_time=now - base,
                    )
                )
                jid += 1
        else:
            out.append(
                job_row(
                    jid,
                    rng,
                    now,
                    partitions="gpu",
                    nodes=rng.choice((2, 4, 8, 16, 32)),
                    cpus_per_node=48,
                    mem_per_node_mb=0,
                    gpus_per_node=8,
                    gpu_type=rng.choice((None, "a100", "h100")),
                    exclusive=True,
                    time_limit_s=rng.choice((3600, 4 * 3600, 24 * 3600)),
                )
            )
            jid += 1
    return out[:m]


def fill_running(
    nodes: list[dict[str, Any]], rng: random.Random, now: float, busy: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Allocations on ``busy`` of the nodes (partly used CPU nodes, whole GPU nodes), and the
    active job rows behind them; job ids from 1."""
    allocs: list[dict[str, Any]] = []
    active: list[dict[str, Any]] = []
    jid = 1
    for n in nodes:
        if n["down"] or rng.random() >= busy:
            continue
        end = now + rng.uniform(60, 12 * 3600)
        if n["gpus"]:
            allocs.append(
                {
                    "job_id": jid,
                    "node": n["name"],
                    "cpus": 48,
                    "mem_mb": n["mem_mb"],
                    "gpu_ids": list(range(8)),
                    "exclusive": True,
                    "expected_end": end,
                }
            )
        else:
            cpus = rng.choice((16, 32, 48, 60))
            allocs.append(
                {
                    "job_id": jid,
                    "node": n["name"],
                    "cpus": cpus,
                    "mem_mb": cpus * 2048,
                    "gpu_ids": [],
                    "exclusive": False,
                    "expected_end": end,
                }
            )
        user = rng.choice(USERS)
        active.append({"id": jid, "user": user, "account": None, "qos": None, "nodes": 1})
        jid += 1
    return allocs, active


def queue_policy(rng: random.Random) -> prio.QueuePolicy:
    """Fair share on: a two-level tree (6 accounts, 24 users) ranked from random usage."""
    accounts = [fs.Account(a, fs.ROOT, rng.choice((1, 2, 4))) for a in ACCOUNTS]
    members = [fs.Member(u, ACCOUNTS[int(u[1:]) % len(ACCOUNTS)], 1) for u in USERS]
    usage = {(m.account, m.user): rng.uniform(0, 1e6) for m in members}
    table = fs.fair_tree(accounts, members, usage)
    return prio.QueuePolicy(
        weights=prio.Weights(),
        fairshare=table.factor,
        qos_priority={"normal": 0},
        limits=lim.Limits(),
        default_account="physics",
    )


def snapshot(
    nodes: list[dict[str, Any]],
    allocs: list[dict[str, Any]],
    pending: list[dict[str, Any]],
    active: list[dict[str, Any]],
) -> SchedSnapshot:
    array_active: dict[int, int] = {}
    for j in active:
        if j.get("array_job_id") is not None:
            array_active[j["array_job_id"]] = array_active.get(j["array_job_id"], 0) + 1
    return SchedSnapshot(
        nodes=nodes,
        partitions=PARTITIONS,
        allocations=allocs,
        pending=pending,
        dep_states={},
        dep_started={},
        active_names=set(),
        array_active=array_active,
        active_jobs=active,
    )


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a small sample."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def rows_bytes(make: Any) -> tuple[Any, int]:
    """What building ``make()`` allocates and keeps (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = make()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return obj, after - before


def standing_bytes(pending: list[dict[str, Any]]) -> int:
    """What the standing queue (priority._Standing, kept from pass to pass) holds for these
    pending jobs: built afresh under tracemalloc."""
    fields = {int(j["id"]): prio._FIELDS(j) for j in pending}
    standing = prio._Standing()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    standing.update(fields)
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return size + sys.getsizeof(fields) + sum(sys.getsizeof(f) for f in fields.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=10000, help="pending jobs (array tasks count)")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--step", type=float, default=30.0, help="simulated seconds between passes")
    ap.add_argument("--busy", type=float, default=0.9, help="share of nodes busy at the start")
    ap.add_argument(
        "--depth",
        type=int,
        default=DEFAULT_QUEUE_DEPTH,
        help=f"queue depth (cluster.queue_depth; default {DEFAULT_QUEUE_DEPTH})",
    )
    ap.add_argument("--profile", help="write a cProfile of the passes to this file")
    a = ap.parse_args()
    if a.nodes < 1 or a.jobs < 0 or a.passes < 1:
        print("error: --nodes >= 1, --jobs >= 0, --passes >= 1", file=sys.stderr)
        return 2

    rng = random.Random(a.seed)
    now = T0
    nodes, node_bytes = rows_bytes(lambda: build_nodes(a.nodes))
    allocs, active = fill_running(nodes, rng, now, a.busy)
    pending, pend_bytes = rows_bytes(lambda: build_pending(a.jobs, rng, now, 10_000_000))
    policy = queue_policy(rng)
    by_node = {n["name"]: n for n in nodes}
    print(
        f"cluster: {a.nodes} nodes, {len(allocs)} running allocations, {len(pending)} pending "
        f"(seed {a.seed}, queue depth {a.depth}, load average {os.getloadavg()[0]:.2f})"
    )

    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    walls: list[float] = []
    cpus: list[float] = []
    timed_starts = 0
    peak = 0
    for i in range(a.passes):
        snap = snapshot(nodes, allocs, pending, active)
        trace = i == a.passes - 1  # one traced pass, not timed, for the peak
        gc.collect()
        if trace:
            tracemalloc.start()
        if prof is not None:
            prof.enable()
        w0, c0 = time.perf_counter(), time.process_time()
        out = plan(snap, now, policy=policy, queue_depth=a.depth)
        w1, c1 = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.disable()
        if trace:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        else:
            walls.append(w1 - w0)
            cpus.append(c1 - c0)
            timed_starts += len(out.starts)
        print(
            f"pass {i + 1}: {w1 - w0:.3f} s wall, {c1 - c0:.3f} s CPU, "
            f"{len(out.starts)} started, {len(snap.pending)} pending, "
            f"{len(allocs)} allocations" + (" (traced, not timed)" if trace else "")
        )
        # apply: starts become allocations, leave the queue; time passes; work ends
        by_id = {int(j["id"]): j for j in pending}
        placed = set()
        for p in out.starts:
            job = by_id[p.job_id]
            placed.add(p.job_id)
            end = now + job["time_limit_s"] * rng.uniform(0.2, 1.0)
            for k, name in enumerate(p.nodes):
                allocs.append(
                    {
                        "job_id": p.job_id,
                        "node": name,
                        "cpus": p.cpus_per_node,
                        "mem_mb": p.mem_per_node_mb[k],
                        "gpu_ids": list(p.gpu_ids[k]),
                        "exclusive": bool(job["exclusive"]),
                        "expected_end": end,
                    }
                )
            active.append(job)
        never = {jid for jid, _ in out.never}
        pending = [j for j in pending if int(j["id"]) not in placed and int(j["id"]) not in never]
        now += a.step
        ended = {x["job_id"] for x in allocs if x["expected_end"] <= now}
        allocs = [x for x in allocs if x["job_id"] not in ended]
        active = [j for j in active if int(j["id"]) not in ended]
        assert all(x["node"] in by_node for x in allocs)
    if prof is not None:
        prof.dump_stats(a.profile)

    timed = walls or [0.0]
    p50, p99 = statistics.median(timed), pct(timed, 0.99)
    # starts per second of deciding: the timed passes' starts over their wall time
    rate = timed_starts / (sum(walls) or 1e-9)
    print(
        f"cycle wall: p50 {p50:.3f} s, p99 {p99:.3f} s, max {max(timed):.3f} s over "
        f"{len(walls)} timed passes; CPU p50 {statistics.median(cpus or [0.0]):.3f} s, "
        f"p99 {pct(cpus or [0.0], 0.99):.3f} s"
    )
    print(
        f"memory: {pend_bytes / max(1, a.jobs):.0f} B per pending job row, "
        f"{node_bytes / a.nodes:.0f} B per node row; one pass peaks at "
        f"{peak / 2**20:.1f} MiB ({peak / max(1, a.jobs + a.nodes):.0f} B per job+node)"
    )
    kept = standing_bytes(pending)
    print(
        f"kept between passes: the standing queue, {kept / max(1, len(pending)):.0f} B per "
        f"pending job ({kept / 2**20:.1f} MiB for {len(pending)})"
    )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(REFERENCES)
    print(
        f"scale: nodes={a.nodes} pending={a.jobs} cycle_p50={p50:.3f}s cycle_p99={p99:.3f}s "
        f"placements_per_s={rate:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
