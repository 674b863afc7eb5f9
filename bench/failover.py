#!/usr/bin/env python3
"""Controller failover benchmark for Phalanx (a benchmark, not a test).

Each run starts a fresh local cluster of real processes with three controllers on one store

    python -m phalanx up --detach --json --controllers 3 --nodes 2 --cpus 8 --mem 16G \\
        --state-dir TMP --port FREE [--db URL]

on each store of `--stores` (bench/stores.py; all three by default): `pg`, a fresh database per
run on a throwaway PostgreSQL server (tests/pgserver.py) with fsync and synchronous_commit on
(the headline: what production runs), `pg-nosync`, the same with them off, and `sqlite`, one
file in TMP shared by the three controllers; or on the one database `--db URL` names. The
timing of one setting is passed as PHALANX_TIMING_<NAME> environment variables; the cluster is
stopped with `phalanx down` in a `finally` (then any shepherd or job process group still alive
is SIGKILLed). Runs go round the stores (run 1 on each, then run 2, ...), so a change of load
on the host hits each store alike. In each run:

  1. wait until the `cluster` lease and a scheduling lease (`sched` or `sched:<partition>`) are
     held, and the holders stayed the same for two renewal intervals (leases may be spread
     over the controllers; the victim is the holder of the scheduling lease);
  2. submit a trivial job every 0.1 s for ~2 s through a Client given all three URLs, the
     victim's first (so the client has to fail over), and note every acknowledged job id;
  3. SIGKILL the victim (pid from `<state>/run/controller-N.pid`) right after the last
     acknowledgement and note the client's wall clock (the kill time);
  4. submit one new job through the same client, retrying until acknowledged, then poll every
     20 ms until that job is RUNNING and every lease the victim held is validly held by
     another controller (GET /v1/cluster `leases`);
  5. look up every job acknowledged before the kill, and wait until all of them have ended.

Measured from the kill time:

  submit     the first submission acknowledged after the kill (client clock)
  running    the first job submitted after the kill seen RUNNING (client poll)
  start      that job's own start_time (server clock)
  leases     every lease the victim held seen held by another controller (client poll)
  take       the latest `lease.take` event ts of those takeovers (server clock)
  kept       jobs acknowledged before the kill that exist afterwards (bar: all), and
  completed  how many of them ended COMPLETED

and over the whole run (from the cluster up to the end of step 5, and at least
node_down_timeout + 2 heartbeat intervals + 1 s after the kill, the time a node left without
heartbeats by the failover takes to be declared DOWN):

  false DOWN `node.down` events (GET /v1/events): no node is stopped here, so each one is a
             node declared DOWN because the controllers or the store fell behind (bar: 0)
  db CPU     the PostgreSQL server's CPU, all its processes (psutil), in % of one CPU; none
             for SQLite, which runs inside the controllers

Two settings by default: the built-in timing (lease_ttl 6 s) and a tightened set (lease_ttl
3 s, checked against the timing rules of phalanx.config before the runs). Results are the
median and max over `--runs` runs per setting and store, beside the Slurm 22.05 reference,
then per setting the stores side by side with each one's ratio to SQLite. `--json FILE` also
writes them as JSON.

    .venv/bin/python bench/failover.py --stores pg,pg-nosync,sqlite --runs 5   # the headline
    .venv/bin/python bench/failover.py --quick
    .venv/bin/python bench/failover.py --stores pg --only tight
    .venv/bin/python bench/failover.py --db postgresql://user@host/db   # DB reused across runs

`--pg` is the old spelling of `--stores pg-nosync` (the test suite's server, no sync).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import httpx
import stores
from common import busy_before, host_info, host_line, log, spread
from stores import Store

from phalanx.client import Client
from phalanx.errors import PhalanxError

TRIVIAL = "#!/bin/sh\ntrue\n"
POLL_S = 0.02
BEFORE_S = 2.0  # seconds of submissions before the kill
SUBMIT_EVERY = 0.1
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STARTED = TERMINAL | {"RUNNING", "COMPLETING"}

SETTINGS: dict[str, dict[str, float]] = {
    "default": {},
    "tight": {
        "lease_ttl": 3.0,
        "renew_interval": 0.5,
        "heartbeat_interval": 0.5,
        "node_down_timeout": 6.0,
        "fence_timeout": 4.0,
        "fence_kill_grace": 0.5,
        "fence_margin": 1.0,
    },
}
SHOWN_TIMING = ("lease_ttl", "renew_interval", "heartbeat_interval", "node_down_timeout")

# name: (label, Slurm 22.05 reference with SlurmctldTimeout tuned to 5 s)
METRICS: dict[str, tuple[str, str]] = {
    "submit_s": ("kill -> first submit acknowledged", ">=6"),
    "running_s": ("kill -> new job RUNNING (client)", ">=6"),
    "start_s": ("kill -> new job start_time", ">=6"),
    "leases_s": ("kill -> leases held again (client)", "~6"),
    "take_s": ("kill -> lease.take event", "~6"),
}


@contextlib.contextmanager
def cluster(
    db: str | None, nodes: int, timing: dict[str, float], keep: bool
) -> Iterator[tuple[list[str], Path, set[str]]]:
    """The controllers' URLs, the state dir and the names of the cluster's nodes."""
    state = common.state_dir("phalanx-failover-")
    port = common.free_ports(3)
    env = common.timing_env(timing, "PHALANX_")
    up_args = ["--json", "--controllers", "3", *common.node_args(nodes), "--port", str(port)]
    if db:
        up_args += ["--db", db]
    where = f"ports {port}-{port + 2}"
    with common.phalanx_up(
        state, up_args, where, keep=keep, env=env, capture=True, leftovers=True, name_node=False
    ) as out:
        assert out is not None
        up = json.loads(out)
        names = {n.removeprefix("agent-") for n in up["pids"] if n.startswith("agent-")}
        yield up["url"].split(","), state, names


def is_sched(lease: str) -> bool:
    return lease == "sched" or lease.startswith("sched:")


def held(view: dict[str, Any]) -> dict[str, tuple[str, int]]:
    return {
        lease["name"]: (str(lease["holder"]), int(lease["term"]))
        for lease in view["leases"]
        if lease["valid"] and lease["holder"]
    }


def events(client: Client) -> list[dict[str, Any]]:
    return common.all_events(lambda since: client.events(since=since, limit=10_000))


def spec(name: str) -> dict[str, Any]:
    return {"script": TRIVIAL, "output": "/dev/null", "workdir": "/tmp", "name": name}


def one_run(args: argparse.Namespace, store: Store, setting: str, k: int) -> dict[str, Any]:
    """One run on a fresh cluster (and, on PostgreSQL, a fresh database) of `store`."""
    with (
        store.database("failover") as db,
        cluster(db, args.nodes, SETTINGS[setting], args.keep) as (
            urls,
            state,
            nodes,
        ),
    ):
        window = store.cpu()
        try:
            res = measure(urls, state, nodes, f"{store.name} {setting}", SETTINGS[setting], k)
        except Exception:
            log(
                f"{store.name} {setting} run {k} failed; controller logs:\n"
                f"{common.controller_log_tail(state, 15)}"
            )
            raise
        res.update(window.stop())
        if "db_cpu_s" in res:
            log(
                f"{store.name} {setting} run {k}: database CPU {res['db_cpu_s']:.1f}s "
                f"({res['db_cpu_pct']:.0f}% of one CPU)"
            )
        return res


def measure(
    urls: list[str], state: Path, nodes: set[str], setting: str, want: dict[str, float], k: int
) -> dict[str, Any]:
    """Steps 1-5 of the module docstring on a running cluster of `nodes`; `setting` names
    the run in the log, `want` is the timing the controllers must run with."""
    timeout = httpx.Timeout(10.0, connect=2.0)
    t_start = time.time()
    with Client(urls, timeout=timeout) as watch:
        tm = watch.cluster()["this_controller"]["timing"]
        common.check_timing(tm, want)
        ttl, renew = float(tm["lease_ttl"]), float(tm["renew_interval"])

        # 1. duty leases held, and the holders stable for two renewal intervals
        deadline = time.monotonic() + 60
        stable_since, last = time.monotonic(), None
        while True:
            h = held(watch.cluster())
            layout = {n: v[0] for n, v in h.items()}
            if layout != last:
                stable_since, last = time.monotonic(), layout
            ready = "cluster" in h and any(is_sched(n) for n in h)
            if ready and time.monotonic() - stable_since >= 2 * renew:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"duty leases not settled after 60s: {h}")
            time.sleep(0.1)
        victim = h[min(n for n in h if is_sched(n))][0]
        before = {n: term for n, (who, term) in h.items() if who == victim}
        pid = int((state / "run" / f"{victim}.pid").read_text().strip())
        vi = int(victim.rsplit("-", 1)[1]) - 1  # controller-N listens on urls[N-1]
        order = urls[vi:] + urls[:vi]

        with Client(order, timeout=timeout) as c:
            # 2. submissions in the ~2 s before the kill
            acked: list[int] = []
            t_end = time.monotonic() + BEFORE_S
            i = 0
            while time.monotonic() < t_end:
                t = time.monotonic()
                acked.append(int(c.submit(spec(f"pre{i}"))["job_id"]))
                i += 1
                time.sleep(max(0.0, SUBMIT_EVERY - (time.monotonic() - t)))
            # 3. kill the holder of the scheduling lease
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            log(f"{setting} run {k}: SIGKILLed {victim} (pid {pid}) holding {before}")

            # 4. a new submission, then poll for it running and the leases taken over
            res: dict[str, Any] = {"victim": victim, "held": before, "acked_before": len(acked)}
            tries = 0
            while True:
                tries += 1
                try:
                    jid = int(c.submit(spec("after"))["job_id"])
                    res["submit_s"] = time.time() - t_kill
                    break
                except PhalanxError as e:
                    res.setdefault("first_error", f"{type(e).__name__}: {e.message}")
                    if time.time() - t_kill > 60:
                        raise RuntimeError(f"no submission accepted 60s after the kill: {e}") from e
                    time.sleep(POLL_S)
            res["submit_tries"] = tries
            limit = 10 * ttl + 30
            got: dict[str, tuple[str, int]] = {}
            while True:
                now = time.time()
                if "running_s" not in res:
                    job = c.job(jid)[0]
                    if job["state"] in STARTED:
                        res["running_s"] = time.time() - t_kill
                        res["start_s"] = float(job["start_time"]) - t_kill
                if "leases_s" not in res:
                    h = held(c.cluster())
                    cur = {n: h.get(n) for n in before}
                    if all(v is not None and v[0] != victim for v in cur.values()):
                        res["leases_s"] = time.time() - t_kill
                        got = {n: v for n, v in cur.items() if v is not None}
                if "running_s" in res and "leases_s" in res:
                    break
                if now - t_kill > limit:
                    raise RuntimeError(
                        f"after {limit:g}s: running={'running_s' in res} "
                        f"leases={'leases_s' in res}: {c.cluster()['leases']}"
                    )
                time.sleep(POLL_S)
            res["took"] = {n: f"{v[0]} term {v[1]}" for n, v in got.items()}
            takes = {}
            for e in events(c):
                if e["kind"] == "lease.take":
                    takes.setdefault(e["message"], float(e["ts"]))
            ts = [takes.get(f"{who} took lease {n} term {term}") for n, (who, term) in got.items()]
            if ts and all(t is not None for t in ts):
                res["take_s"] = max(t for t in ts if t is not None) - t_kill

            # 5. the jobs acknowledged before the kill
            found = {}
            for chunk in range(0, len(acked), 200):
                ids = ",".join(str(x) for x in acked[chunk : chunk + 200])
                found.update({int(j["id"]): j for j in c.jobs(job=ids, limit=100_000)})
            res["kept"] = sum(1 for j in acked if j in found)
            deadline = time.monotonic() + 120
            while True:
                states = {int(j["id"]): j["state"] for j in c.jobs(job=ids_of(acked), limit=10**5)}
                if all(states.get(j) in TERMINAL for j in acked if j in states):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"jobs from before the kill still active: {states}")
                time.sleep(0.2)
            res["completed"] = sum(1 for j in acked if states.get(j) == "COMPLETED")
            # no node is ever stopped here: every node declared DOWN was declared falsely. One the
            # failover left without heartbeats is declared DOWN only node_down_timeout later, so
            # count once that has passed since the kill (and a sweep or two after it)
            settle = t_kill + float(tm["node_down_timeout"]) + 2 * float(tm["heartbeat_interval"])
            time.sleep(max(0.0, settle + 1.0 - time.time()))
            # (only this run's nodes since it started: a reused --db holds other runs' nodes,
            # rightly declared DOWN once their cluster stopped)
            res["false_down"] = sum(
                1
                for e in events(c)
                if e["kind"] == "node.down" and e.get("node") in nodes and e["ts"] >= t_start
            )
    log(
        f"{setting} run {k}: submit {res['submit_s']:.2f}s ({tries} tries), RUNNING "
        f"{res['running_s']:.2f}s (start_time {res['start_s']:.2f}s), leases "
        f"{res['leases_s']:.2f}s (event {res.get('take_s', float('nan')):.2f}s) {res['took']}; "
        f"kept {res['kept']}/{len(acked)}, completed {res['completed']}, "
        f"false DOWN {res['false_down']}"
        + (f"; first try: {res['first_error']}" if "first_error" in res else "")
    )
    return res


def ids_of(ids: list[int]) -> str:
    return ",".join(str(x) for x in ids)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = spread(runs, [*METRICS, "db_cpu_pct", "db_cpu_s"])
    out["false_down"] = sum(r["false_down"] for r in runs)
    out["kept"] = sum(r["kept"] for r in runs)
    out["completed"] = sum(r["completed"] for r in runs)
    out["acked_before"] = sum(r["acked_before"] for r in runs)
    return out


def table(results: dict[str, dict[str, Any]], store: Store) -> str:
    head = f"{'setting':8} {'metric':38} {'median':>7} {'max':>7} {'min':>7}  {'slurm':>6}"
    lines = [
        "Phalanx controller failover: seconds after SIGKILL of the scheduling lease holder "
        f"(3 controllers; store {store.name}: {store.label})",
        head,
        "-" * len(head),
    ]
    for setting, res in results.items():
        t = res["timing"]
        lines.append(f"{setting}: {common.timing_text(t, SHOWN_TIMING)}  ({res['nruns']} runs)")
        s = res["summary"]
        for key, (label, ref) in METRICS.items():
            if key not in s:
                continue
            m = s[key]
            lines.append(
                f"{setting:8} {label:38} {m['median']:7.2f} {m['max']:7.2f} {m['min']:7.2f}  "
                f"{ref:>6}"
            )
        ok = "yes" if s["kept"] == s["acked_before"] else "NO"
        lines.append(
            f"{setting:8} {'jobs acked in the 2 s before the kill':38} kept "
            f"{s['kept']}/{s['acked_before']}, completed {s['completed']}  "
            f"(slurm: kept 1/20; bar: all) {ok}"
        )
        if "db_cpu_pct" in s:
            m = s["db_cpu_pct"]
            lines.append(
                f"{setting:8} {'database CPU over a run, % of one CPU':38} {m['median']:7.0f} "
                f"{m['max']:7.0f} {m['min']:7.0f}"
            )
        lines.append(
            f"{setting:8} {'false DOWN, all runs':38} {s['false_down']:7d}  (bar: 0) "
            + ("yes" if s["false_down"] == 0 else "NO")
        )
    lines.append(
        "slurm: a Slurm backup controller takes over after SlurmctldTimeout (120 s by default); "
        "tuned to 5 s, Slurm 22.05 took over in ~6 s but lost 19 of 20 jobs acknowledged just "
        "before the kill (state not yet saved to StateSaveLocation)"
    )
    return "\n".join(lines)


def side_by_side(results: dict[str, dict[str, dict[str, Any]]], setting: str, runs: int) -> str:
    """One setting's medians on every store, with ratios to SQLite."""
    rows = [
        *((k, label) for k, (label, _) in METRICS.items()),
        ("db_cpu_pct", "database CPU over a run, % of one CPU"),
        ("false_down", "false DOWN, all runs"),
        ("lost", "jobs acked before the kill and lost"),
    ]
    per_store = {}
    for name, by_setting in results.items():
        sm = by_setting[setting]["summary"]
        got = {k: v["median"] for k, v in sm.items() if isinstance(v, dict)}
        got["false_down"] = sm["false_down"]
        got["lost"] = sm["acked_before"] - sm["kept"]
        per_store[name] = got
    return stores.side_by_side(
        f"failover, setting {setting}: the stores side by side (seconds after the kill; "
        f"medians over {runs} run(s) each)",
        rows,
        per_store,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="runs per setting (default 5; 2 quick)")
    p.add_argument("--quick", action="store_true", help="2 runs per setting")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--db", default=None, help="one database URL, reused across runs")
    stores.add_argument(p)
    p.add_argument("--pg", action="store_true", help="the old spelling of --stores pg-nosync")
    p.add_argument(
        "--only", choices=sorted(SETTINGS), action="append", help="only this setting (repeatable)"
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep each run's state dir (logs, DB)")
    args = p.parse_args()
    if args.runs is None:
        args.runs = 2 if args.quick else 5
    if args.pg:
        if args.db or args.stores:
            p.error("--pg excludes --db and --stores")
        args.stores = "pg-nosync"
    names = stores.chosen(args.stores, args.db, p)
    settings = args.only or list(SETTINGS)
    timings = common.checked_timings(settings, SETTINGS, SHOWN_TIMING)

    load_before = busy_before()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with stores.open_stores(names, args.db) as chosen:
        for name in settings:
            runs: dict[str, list[dict[str, Any]]] = {st.name: [] for st in chosen}
            for k in range(1, args.runs + 1):
                for st in chosen:
                    runs[st.name].append(one_run(args, st, name, k))
            for st in chosen:
                results.setdefault(st.name, {})[name] = common.setting_result(
                    timings[name], SETTINGS[name], runs[st.name], summarize(runs[st.name])
                )
    load_after = os.getloadavg()[0]
    for st in chosen:
        print(table(results[st.name], st))
        print()
    for name in settings:
        print(side_by_side(results, name, args.runs))
        print()
    print(host_line(load_before, load_after))
    if args.json:
        doc = {
            "stores": {st.name: {"label": st.label, "results": results[st.name]} for st in chosen},
            "params": {"runs": args.runs, "nodes": args.nodes, "stores": names},
            "reference": {
                "slurm_22_05": "SlurmctldTimeout=5 s: takeover ~6 s, 19 of 20 jobs acknowledged "
                "just before the kill lost; default SlurmctldTimeout 120 s",
                "metrics": {k: {"label": v[0], "slurm": v[1]} for k, v in METRICS.items()},
            },
            "host": host_info(load_before, load_after),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
