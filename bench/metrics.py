#!/usr/bin/env python3
"""`/metrics` benchmark for Phalanx (a benchmark, not a test; docs/metrics.md).

Starts a local cluster (`phalanx up`, SQLite in a temporary state dir unless `--db`), fills its
store with `--jobs` jobs (default 100,000) through the batch submit path (POST /v1/jobs/batch,
10,000 held jobs a request; a tenth of them then cancelled, so the store holds active and
finished jobs), then measures:

  scrape    GET /metrics, median of `--samples` (5): "cold", each after the cache
            (metrics.cache_seconds, default 5 s) expired, so the controller reads every figure
            from the store; and "warm", answered from the cache. Also the controller's CPU time
            per cold scrape (/proc), which other load on the host distorts far less than the
            wall clock. The bar: a cold scrape under 200 ms.
  overhead  bench/submit.py's single-submission rate (one held job per POST /v1/jobs, one
            keep-alive client) without and with a Prometheus-like scraper hitting /metrics
            every `--every` seconds (5) from another thread, alternating `--pairs` times (3);
            prints the ratio of the medians. The bar: the rate changes by less than 5%.

Timing figures measured while other processes load the host are noisy: the load average at
the end is printed with the results.

    .venv/bin/python bench/metrics.py
    .venv/bin/python bench/metrics.py --jobs 20000 --pairs 2     # quicker
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import threading
import time
from pathlib import Path

import httpx
from common import busy_before, host_line, log
from submit import Api, cluster, controller_cpu, spec

BATCH = 10_000  # the API's largest batch


def fill(api: Api, jobs: int) -> None:
    """`jobs` jobs in the store: held ones, a tenth of them cancelled (finished)."""
    t0 = time.monotonic()
    ids: list[int] = []
    while len(ids) < jobs:
        n = min(BATCH, jobs - len(ids))
        ids += [
            j["job_id"] for j in api.post("/v1/jobs/batch", {"jobs": [spec(hold=True)] * n})["jobs"]
        ]
    api.cancel(ids[: jobs // 10])
    log(f"stored {len(ids)} jobs in {time.monotonic() - t0:.1f}s")


def finish_history(db: Path, fraction: float) -> int:
    """Turn `fraction` of the held jobs into finished ones with an attempt each, by direct
    inserts into the SQLite store (running 90,000 jobs would take hours): a store that has
    run jobs, whose queue-wait histograms read every attempt. Returns the attempts made."""
    con = sqlite3.connect(db, timeout=60)
    try:
        ids = [r[0] for r in con.execute("SELECT id FROM jobs WHERE state = 'HELD' ORDER BY id")]
        ids = ids[: int(len(ids) * fraction)]
        now = time.time()
        rows = []
        for k, jid in enumerate(ids):
            sub = now - 86400 + k * 0.5
            rows.append((jid, f"bench-{jid}", sub + 5 + k % 600, sub + 6 + k % 600))
        with con:
            con.executemany(
                "INSERT INTO attempts (job_id, seq, token, state, partition, nodes, fence_term, "
                "created_at, start_time, end_time, result, exit_code) "
                "VALUES (?, 0, ?, 'ENDED', 'batch', '[\"node01\"]', 1, ?, ?, ? + 30, "
                "'COMPLETED', 0)",
                [(j, tok, c, st, st) for j, tok, c, st in rows],
            )
            con.executemany(
                "UPDATE jobs SET state = 'COMPLETED', reason = NULL, submit_time = ?, "
                "start_time = ?, end_time = ? WHERE id = ?",
                [(c - 5, st, st + 30, j) for j, _tok, c, st in rows],
            )
        return len(rows)
    finally:
        con.close()


def scrape_once(http: httpx.Client) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = http.get("/metrics")
    took = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"/metrics: HTTP {r.status_code}: {r.text[:300]}")
    return took, r.text


def bench_scrape(http: httpx.Client, state: Path, samples: int, cache_s: float) -> dict[str, float]:
    cold, warm, cpu = [], [], []
    for _ in range(samples):
        time.sleep(cache_s + 0.2)  # the cached figures expired: this scrape reads the store
        c0 = controller_cpu(state)
        took, text = scrape_once(http)
        cpu.append(controller_cpu(state) - c0)
        cold.append(took)
        if "phalanx_store_up 1.0" not in text:
            raise RuntimeError("the scrape did not read the store (phalanx_store_up is not 1)")
        warm.append(scrape_once(http)[0])
    return {
        "cold_ms": statistics.median(cold) * 1000,
        "cold_max_ms": max(cold) * 1000,
        "warm_ms": statistics.median(warm) * 1000,
        "cold_cpu_ms": statistics.median(cpu) * 1000,
    }


def submit_rate(api: Api, n: int, state: Path) -> tuple[float, float]:
    """Submissions/s, one held job per POST /v1/jobs (as bench/submit.py's `single`), and the
    controller's CPU ms per submission over the same window (scrapes included); the jobs are
    cancelled afterwards, outside the timed window."""
    body = spec(hold=True)
    ids = []
    c0 = controller_cpu(state)
    t0 = time.perf_counter()
    for _ in range(n):
        ids.append(api.post("/v1/jobs", body)["job_id"])
    rate = n / (time.perf_counter() - t0)
    cpu = (controller_cpu(state) - c0) / n * 1000
    api.cancel(ids)
    return rate, cpu


class Scraper:
    """Scrapes /metrics every `every` seconds on a thread, as Prometheus would."""

    def __init__(self, url: str, every: float) -> None:
        self.url, self.every = url, every
        self.stop = threading.Event()
        self.count = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.is_set():
                scrape_once(http)
                self.count += 1
                self.stop.wait(self.every)

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=100_000, help="jobs in the store (default 100000)")
    p.add_argument("--samples", type=int, default=5, help="scrapes measured (median; default 5)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between scrapes (default 5)")
    p.add_argument("--pairs", type=int, default=3, help="without/with scraping pairs (default 3)")
    p.add_argument("--submits", type=int, default=2000, help="submissions per rate run")
    p.add_argument(
        "--finished",
        type=float,
        default=0.8,
        help="share of the jobs made COMPLETED with an attempt (SQLite only; default 0.8)",
    )
    p.add_argument("--db", default=None, help="database URL (default: SQLite in the state dir)")
    p.add_argument("--cache", type=float, default=5.0, help="the cluster's metrics.cache_seconds")
    p.add_argument("--keep", action="store_true", help="keep the state dir")
    args = p.parse_args()
    os.environ["PHALANX_METRICS_CACHE_SECONDS"] = repr(args.cache)
    load_before = busy_before("other processes compete with the cluster; timings will be high")
    with cluster(args.db, 2, args.keep) as (url, state):
        api = Api(url)
        fill(api, args.jobs)
        if args.db is None and args.finished > 0:
            n = finish_history(state / "phalanx.db", args.finished)
            log(f"{n} of them made COMPLETED with an attempt each (direct store inserts)")
        with httpx.Client(base_url=url, timeout=60) as http:
            scrape = bench_scrape(http, state, args.samples, args.cache)
        log(f"scrape: {scrape}")
        without, with_, cpu_without, cpu_with, scrapes = [], [], [], [], 0
        for k in range(args.pairs):
            rate, cpu = submit_rate(api, args.submits, state)
            without.append(rate)
            cpu_without.append(cpu)
            with Scraper(url, args.every) as s:
                rate, cpu = submit_rate(api, args.submits, state)
            with_.append(rate)
            cpu_with.append(cpu)
            scrapes += s.count
            log(f"pair {k + 1}: {without[-1]:.0f}/s without, {with_[-1]:.0f}/s with scraping")
    a, b = statistics.median(without), statistics.median(with_)
    ratio = b / a
    ca, cb = statistics.median(cpu_without), statistics.median(cpu_with)
    print(f"/metrics with {args.jobs} jobs in the store (median of {args.samples}):")
    print(
        f"  cold (read from the store): {scrape['cold_ms']:.1f} ms (max {scrape['cold_max_ms']:.1f}),"
        f" controller CPU {scrape['cold_cpu_ms']:.1f} ms; bar < 200 ms: "
        f"{'OK' if scrape['cold_ms'] < 200 else 'MISSED'}"
    )
    print(f"  warm (cached, {args.cache:g} s): {scrape['warm_ms']:.1f} ms")
    print(
        f"submit rate, 1 job/request (median of {args.pairs}): {a:.0f}/s without scraping, "
        f"{b:.0f}/s with a scrape every {args.every:g} s ({scrapes} scrapes): ratio {ratio:.3f}; "
        f"bar |1 - ratio| < 5%: {'OK' if abs(1 - ratio) < 0.05 else 'MISSED'}"
    )
    print(
        f"controller CPU per submission: {ca:.2f} ms without, {cb:.2f} ms with scraping "
        f"(ratio {cb / ca if ca else float('nan'):.3f}); a cold scrape every {args.every:g} s "
        f"costs {scrape['cold_cpu_ms'] / args.every / 10:.2f}% of one core"
    )
    print(host_line(load_before, os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
