#!/usr/bin/env python3
"""Submission and throughput benchmark for Phalanx (a benchmark, not a test).

Each run starts a fresh local cluster with real processes

    python -m phalanx up --detach --state-dir TMP --port FREE --nodes 4 --cpus 8 --mem 16G \
        [--db URL]

on each store of `--stores` (bench/stores.py; all three by default): `pg`, a fresh database on
a throwaway PostgreSQL server with fsync and synchronous_commit on (the headline: what
production runs), `pg-nosync`, the same with them off, and `sqlite`, a file in TMP; or on the
one database `--db` names. It stops the cluster with `phalanx down` in a `finally`. Against it,
the run measures, in this order:

  latency   submit-to-start on an idle cluster: submit one `#!/bin/sh\\ntrue` job, poll
            GET /v1/jobs/{id} every few ms until it is RUNNING or later. Two numbers per
            sample: the job's own `start_time - submit_time` (server clocks) and the client's
            POST-to-first-poll-seeing-it-started time. Each sample waits for the job to end,
            so the next one starts on an idle cluster again.
  single    submissions/s, one job per POST /v1/jobs, as many `sbatch` calls in flight at
            once send them: `--single-conns` (default 8) keep-alive connections, each sending
            its next request once the previous one was answered (no pipelining), through
            common.KeepAliveSubmitter, a lean asyncio HTTP/1.1 client. Every request is real
            HTTP with a real credential from the cluster's local credential service in its
            Authorization header (verified by the controller as any other), carries exactly
            one job, and counts only when answered 201 with the job's id. The lean client is
            there because httpx costs ~1 ms of CPU per request, as much as the controller,
            and on a 2-core machine the two would compete. Jobs are submitted with
            `"hold": true` so nothing runs and perturbs the measure (the scheduler is still
            kicked and sees them), then cancelled in one POST /v1/jobs/cancel outside the
            timed window. Also the controller's CPU time per submission (/proc, its
            background loops included), which other load on the host distorts far less than
            the rate, and on PostgreSQL the database server's (all its processes, psutil).
  single_seq  the same, one request at a time over the httpx client (one lone `sbatch`
            loop: the client's CPU and the controller's add up on every request); shown for
            comparison, no bar.
  batch     submissions/s through POST /v1/jobs/batch (N requests of M held jobs each; the
            rate is total jobs / total time of the requests), then cancelled the same way.
  e2e       trivial jobs completed/s: one batch of `#!/bin/sh\\ntrue` jobs with output to
            /dev/null, from the client's clock just before the POST until the last job's
            end_time (and, second number, until the client's poll saw no job left active).
            Every job must end COMPLETED.

A fresh cluster and database per run keeps runs independent (with `--db` the same database is
reused, so later runs see earlier runs' ended jobs); runs go round the stores (run 1 on each,
then run 2, ...) so a change of load hits each store alike. The host's busy CPUs are sampled
for 1 s before the runs, and a warning is printed if something else is using them: on a 2-core
box, a concurrent test suite halves every rate here.

Results are, per store, the median (min, max) over `--runs` runs, with the Slurm 22.05
reference for this kind of machine and the bars Phalanx aims for, and the database server's CPU
over the whole run (% of one CPU; none for SQLite, which runs inside the controller); then the
stores' medians side by side with each one's ratio to SQLite. `--json FILE` also writes them
as JSON.

    .venv/bin/python bench/submit.py --stores pg,pg-nosync,sqlite --runs 3   # the headline
    .venv/bin/python bench/submit.py --quick
    .venv/bin/python bench/submit.py --stores sqlite --runs 3
    .venv/bin/python bench/submit.py --db postgresql://user@host/db   # DB is reused across runs
    .venv/bin/python bench/submit.py --prefill 1000000 --only single --runs 1

`--prefill N` (SQLite only: the default stores become `sqlite`) first fills each run's SQLite
store with N job rows copied from a real
submission (98% ended with their attempt and events, 1% pending with a begin time a day away,
1% held; `prefill_store`), to measure submitting into a store that has served for months
(issue 12: >= 500 submissions/s with 1,000,000 jobs in the store); `--only` runs just the named
measures. The bench's own jobs are told apart by user, so the backlog never counts as busy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
import stores
from common import busy_before, host_info, host_line, log, spread
from stores import Store

TRIVIAL = "#!/bin/sh\ntrue\n"
STARTED = {
    "RUNNING",
    "COMPLETING",
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
ACTIVE_STATES = "PENDING,HELD,STARTING,RUNNING,COMPLETING"
STEPS = ("latency", "single", "single_seq", "batch", "e2e")

# name: (label, unit, Slurm 22.05 reference (None: no such figure), bar (None: shown for
# comparison only), higher is better)
METRICS: dict[str, tuple[str, str, float | None, float | None, bool]] = {
    "single_per_s": ("submit, 1 job/request", "jobs/s", 170.0, 600.0, True),
    # the controller's CPU per single submission (background loops included); no Slurm figure
    "single_cpu_ms": ("controller CPU per submission", "ms", None, 1.0, False),
    "single_db_cpu_ms": ("  database CPU per submission", "ms", None, None, False),
    "single_seq_per_s": ("submit, 1 job/request, 1 at a time", "jobs/s", 170.0, None, True),
    "single_seq_cpu_ms": ("  controller CPU per submission", "ms", None, None, False),
    "batch_per_s": ("submit, batch", "jobs/s", 170.0, 5000.0, True),
    "start_latency_s": ("submit->start (job times)", "s", 2.5, 0.5, False),
    "client_latency_s": ("submit->start (client)", "s", 2.5, 0.5, False),
    "e2e_per_s": ("trivial jobs completed", "jobs/s", 10.0, 100.0, True),
    "e2e_client_per_s": ("trivial jobs completed (client)", "jobs/s", 10.0, 100.0, True),
    # the PostgreSQL server's CPU from the cluster up to the end of the last measure
    "db_cpu_pct": ("database CPU over the run, % of 1 CPU", "%", None, None, False),
}


@contextlib.contextmanager
def cluster(db: str | None, nodes: int, keep: bool, prefill: int = 0) -> Iterator[tuple[str, Path]]:
    state = common.state_dir("phalanx-bench-")
    port = common.free_port()
    up_args = ["--port", str(port), *common.node_args(nodes)]
    if db:
        up_args += ["--db", db]
    if prefill:
        # a first start creates the schema and one real job row, the template of the rest
        with common.phalanx_up(state, up_args, f"port {port}", keep=True):
            first = Api(f"http://127.0.0.1:{port}")
            template = first.post("/v1/jobs", spec(hold=True))["job_id"]
            first.cancel([template])  # its copies get their own states
            first.http.close()
        t0 = time.monotonic()
        prefill_store(state / "phalanx.db", int(template), prefill)
        log(f"store pre-filled with {prefill:,} jobs in {time.monotonic() - t0:.1f}s")
    with common.phalanx_up(state, up_args, f"port {port}", keep=keep):
        yield f"http://127.0.0.1:{port}", state


def prefill_store(path: Path, template: int, n: int) -> None:
    """Put ``n`` jobs in the (stopped) cluster's SQLite store, as a store that has served for
    months holds them: 98% ended (COMPLETED, some FAILED and CANCELLED, each with its ended
    attempt and its submit and end events), 1% PENDING with a begin time a day away (the
    scheduler reads and skips them every pass, as a backlog it cannot start yet), 1% HELD.
    Copies of the template job's row (a real submission), in a few INSERT ... SELECT
    statements: a million rows in a minute or so instead of hours through the API."""
    import sqlite3

    con = sqlite3.connect(path)
    try:
        cols = [r[1] for r in con.execute("PRAGMA table_info(jobs)") if r[1] != "id"]
        now = time.time()
        # i: 1..n; job i submitted (n - i) seconds / 10 ago, so ids grow with time
        over = {
            "name": "'fill' || (i % 1000)",
            "user": "'user' || (i % 200)",
            "state": "CASE WHEN i % 100 = 0 THEN 'PENDING' WHEN i % 100 = 1 THEN 'HELD' "
            "WHEN i % 100 < 4 THEN 'FAILED' WHEN i % 100 < 6 THEN 'CANCELLED' "
            "ELSE 'COMPLETED' END",
            "reason": "CASE WHEN i % 100 = 1 THEN 'held by user' ELSE NULL END",
            "submit_time": f"{now} - (:n - i) / 10.0",
            "eligible_time": f"CASE WHEN i % 100 = 0 THEN {now + 86400} ELSE NULL END",
            "start_time": f"CASE WHEN i % 100 < 2 THEN NULL ELSE {now} - (:n - i) / 10.0 + 5 END",
            "end_time": f"CASE WHEN i % 100 < 2 THEN NULL ELSE {now} - (:n - i) / 10.0 + 65 END",
            "exit_code": "CASE WHEN i % 100 < 2 THEN NULL WHEN i % 100 < 4 THEN 1 ELSE 0 END",
        }
        exprs = ", ".join(over.get(c, f't."{c}"') for c in cols)
        names = ", ".join(f'"{c}"' for c in cols)
        with con:
            con.execute(
                f"WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < :n) "
                f"INSERT INTO jobs ({names}) SELECT {exprs} FROM c, "
                f"(SELECT * FROM jobs WHERE id = :t) AS t",
                {"n": n, "t": template},
            )
            con.execute(
                "INSERT INTO attempts (job_id, seq, token, state, partition, nodes, fence_term, "
                "created_at, start_time, end_time, expected_end, result, exit_code, uncharged) "
                "SELECT id, 0, 'fill-' || id, 'ENDED', partition, '[\"node1\"]', 1, "
                "start_time, start_time, end_time, start_time + 3600, state, exit_code, 0 "
                "FROM jobs WHERE id > :t AND end_time IS NOT NULL",
                {"t": template},
            )
            con.execute(
                "UPDATE jobs SET attempt_id = (SELECT a.id FROM attempts a "
                "WHERE a.job_id = jobs.id) WHERE id > :t AND end_time IS NOT NULL",
                {"t": template},
            )
            for kind, ts in (("submit", "submit_time"), ("end", "end_time")):
                con.execute(
                    "INSERT INTO events (ts, kind, job_id, actor, message) "
                    f"SELECT {ts}, '{kind}', id, user, 'pre-filled' FROM jobs "
                    f"WHERE id > :t AND {ts} IS NOT NULL",
                    {"t": template},
                )
    finally:
        con.close()


def controller_cpu(state: Path) -> float:
    """CPU seconds (user + system) the cluster's controllers have used so far (/proc)."""
    total = 0.0
    for pidfile in (state / "run").glob("controller*.pid"):
        try:
            with open(f"/proc/{int(pidfile.read_text())}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


class Api(common.Api):
    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=300.0)

    def any_active(self) -> bool:
        # only this bench's own jobs: a pre-filled store (--prefill) keeps a backlog of other
        # users' pending and held jobs for ever
        return bool(self.get("/v1/jobs", state=ACTIVE_STATES, user=self.me, limit=1)["jobs"])

    @property
    def me(self) -> str:
        import getpass

        return getpass.getuser()

    def wait_idle(self, timeout: float = 120.0, every: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while self.any_active():
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs still active after {timeout:g}s")
            time.sleep(every)

    def cancel(self, ids: list[int]) -> None:
        for i in range(0, len(ids), 10_000):
            self.post(
                "/v1/jobs/cancel",
                {"jobs": [str(x) for x in ids[i : i + 10_000]], "reason": "bench"},
            )


def spec(**kw: Any) -> dict[str, Any]:
    return {"script": TRIVIAL, "output": "/dev/null", "name": "bench", "workdir": "/tmp", **kw}


def bench_latency(api: Api, samples: int) -> tuple[float, float]:
    server, client = [], []
    for _ in range(samples):
        t0 = time.time()
        jid = api.post("/v1/jobs", spec())["job_id"]
        while True:
            job = api.get(f"/v1/jobs/{jid}")["jobs"][0]
            if job["state"] in STARTED:
                client.append(time.time() - t0)
                break
            if time.time() - t0 > 60:
                raise RuntimeError(
                    f"job {jid} not started after 60s: {job['state']} {job['reason']}"
                )
            time.sleep(0.002)
        while job["state"] not in TERMINAL:
            time.sleep(0.02)
            job = api.get(f"/v1/jobs/{jid}")["jobs"][0]
        if job["state"] != "COMPLETED":
            raise RuntimeError(f"latency job {jid} ended {job['state']}")
        server.append(job["start_time"] - job["submit_time"])
        api.wait_idle()
    return statistics.median(server), statistics.median(client)


def bench_single(api: Api, n: int, state: Path, conns: int = 8) -> tuple[float, float]:
    """Submissions/s, one job per request over `conns` keep-alive connections at once
    (common.KeepAliveSubmitter), and the controller's CPU time per submission in ms (what
    other load on the host distorts least: the rate halves on a busy 2-core box, this
    barely moves)."""
    rate, cpu_ms, _ = single_with_db(api, n, state, conns, None)
    return rate, cpu_ms


def single_with_db(
    api: Api, n: int, state: Path, conns: int, store: Store | None
) -> tuple[float, float, float | None]:
    """bench_single, plus the database server's CPU per submission in ms over the same
    window (None for SQLite or an unknown server): what a submission costs the database."""
    client = common.KeepAliveSubmitter(str(api.http.base_url).rstrip("/"), conns)
    db = store.cpu() if store is not None else None
    cpu0 = controller_cpu(state)
    t0 = time.perf_counter()
    ids = client.submit(spec(hold=True), n)
    dt = time.perf_counter() - t0
    cpu = controller_cpu(state) - cpu0
    db_s = db.stop().get("db_cpu_s") if db is not None else None
    api.cancel(ids)
    api.wait_idle()
    return n / dt, cpu / n * 1000, None if db_s is None else db_s / n * 1000


def bench_single_seq(api: Api, n: int, state: Path) -> tuple[float, float]:
    """As bench_single, but one request at a time over the httpx client of `Api` (a lone
    `sbatch` loop: the client's and the controller's CPU add up on every request)."""
    body = spec(hold=True)
    ids = []
    cpu0 = controller_cpu(state)
    t0 = time.perf_counter()
    for _ in range(n):
        ids.append(api.post("/v1/jobs", body)["job_id"])
    dt = time.perf_counter() - t0
    cpu = controller_cpu(state) - cpu0
    api.cancel(ids)
    api.wait_idle()
    return n / dt, cpu / n * 1000


def bench_batch(api: Api, requests: int, per_request: int) -> float:
    body = {"jobs": [spec(hold=True)] * per_request}
    ids: list[int] = []
    total = 0.0
    for _ in range(requests):
        t0 = time.perf_counter()
        out = api.post("/v1/jobs/batch", body)["jobs"]
        total += time.perf_counter() - t0
        ids += [j["job_id"] for j in out]
    api.cancel(ids)
    api.wait_idle()
    return requests * per_request / total


def bench_e2e(api: Api, n: int) -> tuple[float, float]:
    t0 = time.time()
    ids = [j["job_id"] for j in api.post("/v1/jobs/batch", {"jobs": [spec()] * n})["jobs"]]
    api.wait_idle(timeout=max(120.0, n), every=0.1)
    t_client = time.time() - t0
    jobs = {}
    for i in range(0, len(ids), 200):  # only ours: a shared --db may hold other runs' jobs
        chunk = ",".join(str(x) for x in ids[i : i + 200])
        jobs.update({j["id"]: j for j in api.get("/v1/jobs", job=chunk, limit=100_000)["jobs"]})
    bad: dict[str, int] = {}
    for i in ids:
        st = jobs[i]["state"]
        if st != "COMPLETED":
            bad[st] = bad.get(st, 0) + 1
    if bad:
        raise RuntimeError(f"e2e: not all COMPLETED: {bad}")
    t_server = max(jobs[i]["end_time"] for i in ids) - t0
    return n / t_server, n / t_client


def one_run(args: argparse.Namespace, k: int, store: Store, db: str | None) -> dict[str, float]:
    """One run on a fresh cluster over `db` (None: SQLite in the state dir)."""
    res: dict[str, float] = {}
    with cluster(db, args.nodes, args.keep, args.prefill) as (url, state):
        api = Api(url)
        window = store.cpu()
        try:

            def step(name: str, fn: Callable[[], Any]) -> Any:
                t = time.monotonic()
                out = fn()
                log(f"{store.name} run {k}: {name} done in {time.monotonic() - t:.1f}s: {out}")
                return out

            only = set(args.only.split(",")) if args.only else set(STEPS)
            if "latency" in only:
                res["start_latency_s"], res["client_latency_s"] = step(
                    "latency", lambda: bench_latency(api, args.latency_samples)
                )
            if "single" in only:
                res["single_per_s"], res["single_cpu_ms"], db_ms = step(
                    "single",
                    lambda: single_with_db(api, args.single, state, args.single_conns, store),
                )
                if db_ms is not None:
                    res["single_db_cpu_ms"] = db_ms
            if "single_seq" in only:
                res["single_seq_per_s"], res["single_seq_cpu_ms"] = step(
                    "single_seq", lambda: bench_single_seq(api, args.single_seq, state)
                )
            if "batch" in only:
                res["batch_per_s"] = step(
                    "batch", lambda: bench_batch(api, args.batch_requests, args.batch_size)
                )
            if "e2e" in only:
                res["e2e_per_s"], res["e2e_client_per_s"] = step(
                    "e2e", lambda: bench_e2e(api, args.e2e)
                )
            if "db_cpu_pct" in (db_cpu := window.stop()):
                res["db_cpu_pct"] = db_cpu["db_cpu_pct"]
        finally:
            api.http.close()
    return res


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return dict(spread(runs, METRICS))


def fmt(v: float | None, unit: str) -> str:
    """Times with three decimals, rates and percentages as whole numbers."""
    if v is None:
        return "-"
    return f"{v:.3f}" if unit in ("s", "ms") else f"{v:,.0f}"


def table(summary: dict[str, dict[str, float]], nruns: int, store: Store) -> str:
    head = (
        f"{'metric':38} {'median':>9} {'min':>9} {'max':>9}  {'unit':6} "
        f"{'slurm':>6} {'vs slurm':>8} {'bar':>7}  ok"
    )
    lines = [
        f"Phalanx submit benchmark on {store.name} ({store.label}): medians over {nruns} run(s)",
        head,
        "-" * len(head),
    ]
    for key, (label, unit, ref, bar, higher) in METRICS.items():
        if key not in summary:
            continue
        m = summary[key]
        ratio = None if ref is None else m["median"] / ref if higher else ref / m["median"]
        vs = "-" if ratio is None else f"{ratio:.1f}x"
        if bar is None:
            shown, verdict = f"{'':>7}", "-"
        else:
            ok = m["median"] >= bar if higher else m["median"] < bar
            shown = f"{'>=' if higher else '<'}{fmt(bar, unit):>5}"
            verdict = "yes" if ok else "NO"
        lines.append(
            f"{label:38} {fmt(m['median'], unit):>9} {fmt(m['min'], unit):>9} "
            f"{fmt(m['max'], unit):>9}  {unit:6} {fmt(ref, unit):>6} {vs:>8} "
            f"{shown:>7}  {verdict}"
        )
    lines.append(
        "vs slurm: Phalanx/Slurm for rates, Slurm/Phalanx for latencies (higher is better)"
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="runs (default 5; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer and smaller runs")
    p.add_argument("--db", default=None, help="one database URL, reused across runs")
    stores.add_argument(p)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep each run's state dir (logs, DB)")
    p.add_argument("--single", type=int, default=None, help="jobs submitted one per request")
    p.add_argument("--single-conns", type=int, default=8, help="connections in flight for `single`")
    p.add_argument(
        "--single-seq", type=int, default=None, help="jobs submitted one request at a time"
    )
    p.add_argument("--batch-size", type=int, default=None, help="jobs per batch request")
    p.add_argument("--batch-requests", type=int, default=None, help="batch requests per run")
    p.add_argument("--latency-samples", type=int, default=None)
    p.add_argument("--e2e", type=int, default=None, help="trivial jobs in the end-to-end batch")
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="N",
        help="first put N jobs in the store (mostly ended, 1%% pending, 1%% held; SQLite only)",
    )
    p.add_argument(
        "--only", default=None, help=f"comma list of the measures to run (of {','.join(STEPS)})"
    )
    args = p.parse_args()
    if args.quick:
        defaults = dict(
            runs=2,
            single=500,
            single_seq=100,
            batch_size=1000,
            batch_requests=2,
            latency_samples=5,
            e2e=200,
        )
    else:
        defaults = dict(
            runs=5,
            single=2000,
            single_seq=500,
            batch_size=1000,
            batch_requests=5,
            latency_samples=20,
            e2e=500,
        )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.prefill and args.db:
        p.error("--prefill fills the run's own SQLite store: leave out --db")
    if args.prefill and args.stores is None:
        args.stores = "sqlite"
    names = stores.chosen(args.stores, args.db, p)
    if args.prefill and names != ["sqlite"]:
        p.error("--prefill fills the run's own SQLite store: --stores sqlite only")
    unknown = set(args.only.split(",")) - set(STEPS) if args.only else set()
    if unknown:
        p.error(f"--only: unknown measure {', '.join(sorted(unknown))} (of {', '.join(STEPS)})")

    load_before = busy_before(
        "other processes compete with the cluster and the numbers will be low"
    )
    with stores.open_stores(names, args.db) as chosen:
        runs: dict[str, list[dict[str, float]]] = {st.name: [] for st in chosen}
        for run in range(1, args.runs + 1):
            for st in chosen:
                with st.database("submit") as db:
                    runs[st.name].append(one_run(args, run, st, db))
    load_after = os.getloadavg()[0]
    summaries = {st.name: summarize(runs[st.name]) for st in chosen}
    for st in chosen:
        print(table(summaries[st.name], len(runs[st.name]), st))
        print()
    print(
        stores.side_by_side(
            f"submit: the stores side by side, medians over {args.runs} run(s) each",
            [(k, m[0] if m[1] == "%" else f"{m[0]} ({m[1]})") for k, m in METRICS.items()],
            {name: {k: v["median"] for k, v in s.items()} for name, s in summaries.items()},
        )
    )
    print(host_line(load_before, load_after))
    if args.json:
        doc = {
            "stores": {
                st.name: {"label": st.label, "summary": summaries[st.name], "runs": runs[st.name]}
                for st in chosen
            },
            "params": {
                k: getattr(args, k)
                for k in (
                    "runs",
                    "db",
                    "nodes",
                    "single",
                    "single_conns",
                    "single_seq",
                    "batch_size",
                    "batch_requests",
                    "latency_samples",
                    "e2e",
                    "prefill",
                    "only",
                )
            }
            | {"stores": names},
            "reference": {
                k: {
                    "label": v[0],
                    "unit": v[1],
                    "slurm_22_05": v[2],
                    "bar": v[3],
                    "higher_is_better": v[4],
                }
                for k, v in METRICS.items()
            },
            "host": host_info(load_before, load_after),
        }
        if args.db and "@" in args.db:
            doc["params"]["db"] = args.db.split("://")[0] + "://..."
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
