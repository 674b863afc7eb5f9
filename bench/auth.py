#!/usr/bin/env python3
"""What authentication costs: submission rate with credentials, and the CLI's credential path.

Each run starts a fresh local cluster (`phalanx up --detach`, as bench/submit.py does, stopped
with `phalanx down` in a `finally`) and measures:

  single      submissions/s, one held job per POST /v1/jobs over 8 keep-alive connections
              that authenticate through the local credential service (one socket fetch,
              then the cached credential on every request, as the CLI and SDK do): the same
              measure as submit.py's `single` (common.KeepAliveSubmitter); the bar is 600/s.
  verify      the controller's credential check, in this process with the cluster's keys:
              Verifier.verify of a fresh credential (signature, claims: a cache miss, as for
              the first request of each new credential) and of a cached one (every later
              request), and the API's whole check per request (access.authenticate, decide,
              throttle, as the `authorize` dependency runs them). `single_noverify_per_s` is
              the submission rate with that whole check's cost taken out of each request:
              what the same server path would do without authentication (an estimate: the
              check is timed, not disabled).
  fetch       localsock.fetch from the credential socket (connect, SO_PEERCRED, sign, reply).
  call        what a CLI call does once its modules are loaded, in this process: a fresh
              Client (a fresh credential source, nothing cached) and GET /v1/whoami, through
              the socket or with the token given; median of paired differences (steady).
  cli         wall time of `python -m phalanx whoami` (a fresh process, as a user runs it),
              alternately through the local socket and with $PHALANX_TOKEN set to a credential
              fetched from that socket (the same request otherwise); the median of the
              paired differences is what the local-credential path adds to a CLI call
              (bar: 5 ms). A CLI call is a few hundred ms of start-up, so this needs many
              pairs (`--cli`) to be steady; `fetch` is the same cost measured directly.

Results are medians (min, max) over `--runs` runs.

    .venv/bin/python bench/auth.py --runs 3
    .venv/bin/python bench/auth.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
import submit
from common import busy_before, host_line, log, spread

from phalanx.auth import keys as keyfiles
from phalanx.auth import localsock
from phalanx.auth.credentials import LocalService
from phalanx.auth.service import host_keys
from phalanx.auth.tokens import Verifier, mint_local
from phalanx.client import Client
from phalanx.controller import access

CLUSTER = "phalanx"  # the default cluster name: the audience of local credentials

# name: (label, unit, bar, higher is better); bar None: shown for comparison only
METRICS: dict[str, tuple[str, str, float | None, bool]] = {
    "single_per_s": ("submit, 1 job/request, authenticated", "jobs/s", 600.0, True),
    "single_noverify_per_s": ("  same, the check's cost taken out", "jobs/s", None, True),
    "verify_fresh_us": ("verify a fresh credential", "us", None, False),
    "verify_cached_us": ("verify a cached credential", "us", None, False),
    "authorize_us": ("whole check per request (cached)", "us", None, False),
    "fetch_ms": ("localsock.fetch (raw socket)", "ms", None, False),
    "call_socket_ms": ("CLI call in-process, local socket", "ms", None, False),
    "call_token_ms": ("CLI call in-process, token given", "ms", None, False),
    "call_added_ms": ("  added by the socket path (paired)", "ms", 5.0, False),
    "cli_socket_ms": ("`phalanx whoami` process, local socket", "ms", None, False),
    "cli_token_ms": ("`phalanx whoami` process, $PHALANX_TOKEN", "ms", None, False),
    "cli_added_ms": ("  added by the socket path (paired)", "ms", 5.0, False),
}


def bench_verify(state: Path, n: int) -> tuple[float, float, float]:
    """Microseconds per Verifier.verify of fresh credentials (cache misses) and of a cached
    one, and per request of the API's whole check (access.authenticate, decide, throttle:
    what the `authorize` dependency does for POST /v1/jobs), with a cached credential."""
    cluster_keys = keyfiles.load(state / "keys" / "cluster.jwks")
    node = host_keys(state / "keys" / "cluster.jwks", "node", "node01")
    verifier = Verifier(cluster_keys, cluster=CLUSTER)
    tokens = [
        mint_local(node, user="bench", uid=1000, gid=1000, cluster=CLUSTER, lifetime=600)
        for _ in range(n)
    ]
    t0 = time.perf_counter()
    for t in tokens:
        verifier.verify(t)
    fresh = (time.perf_counter() - t0) / n
    one = tokens[0]
    t0 = time.perf_counter()
    for _ in range(n):
        verifier.verify(one)
    cached = (time.perf_counter() - t0) / n
    rule = access.RULES[("POST", "/v1/jobs")]
    buckets = access.TokenBuckets(rate=1e9, burst=1e9)
    header = f"Bearer {one}"
    t0 = time.perf_counter()
    for _ in range(n):
        ident = access.authenticate(verifier, header)
        access.decide(rule, ident, {})
        assert ident is not None
        access.throttle(buckets, ident, [], 1, "API call")
    whole = (time.perf_counter() - t0) / n
    return fresh * 1e6, cached * 1e6, whole * 1e6


def bench_fetch(sock: Path, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        reply = localsock.fetch(sock)
        times.append(time.perf_counter() - t0)
        assert "token" in reply, reply
    return statistics.median(times) * 1e3


def bench_cli(url: str, sock: Path, n: int) -> tuple[float, float, float]:
    """Median wall ms of `phalanx whoami` through the socket and with $PHALANX_TOKEN, and the
    median of the paired differences (each pair ran back to back: steadier than the
    difference of the medians when a CLI call takes hundreds of ms)."""
    token = str(localsock.fetch(sock)["token"])
    base = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    base["PHALANX_URL"] = url
    envs = {
        "socket": {**base, "PHALANX_AUTH_SOCKET": str(sock)},
        "token": {**base, "PHALANX_TOKEN": token},
    }
    cmd = [sys.executable, "-m", "phalanx", "whoami", "--json"]
    times: dict[str, list[float]] = {"socket": [], "token": []}
    for i in range(n + 1):  # alternate, so drifts in load hit both alike; the first is warm-up
        for how in ("socket", "token") if i % 2 else ("token", "socket"):
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=envs[how], capture_output=True, text=True, check=False)
            dt = time.perf_counter() - t0
            if p.returncode != 0:
                raise RuntimeError(f"phalanx whoami ({how}): {p.stderr.strip()}")
            if json.loads(p.stdout)["kind"] != "local":
                raise RuntimeError(f"phalanx whoami ({how}) is not a local credential: {p.stdout}")
            if i:
                times[how].append(dt)
    added = [a - b for a, b in zip(times["socket"], times["token"], strict=True)]
    return (
        statistics.median(times["socket"]) * 1e3,
        statistics.median(times["token"]) * 1e3,
        statistics.median(added) * 1e3,
    )


def bench_call(url: str, sock: Path, n: int) -> tuple[float, float, float]:
    """What a CLI call does after its imports, in this process: a fresh Client (so a fresh
    credential source with nothing cached) and GET /v1/whoami, through the socket or with
    the token given; median wall ms of each and of the paired differences."""
    token = str(localsock.fetch(sock)["token"])
    times: dict[str, list[float]] = {"socket": [], "token": []}

    def call(how: str) -> float:
        t0 = time.perf_counter()
        creds = LocalService(sock) if how == "socket" else None
        with Client(url, token=None if creds else token, credentials=creds) as c:
            me = c.get("/v1/whoami")
        dt = time.perf_counter() - t0
        if me["kind"] != "local":
            raise RuntimeError(f"whoami ({how}) is not a local credential: {me}")
        return dt

    for i in range(n + 5):  # the first five pairs are warm-up
        for how in ("socket", "token") if i % 2 else ("token", "socket"):
            dt = call(how)
            if i >= 5:
                times[how].append(dt)
    added = [a - b for a, b in zip(times["socket"], times["token"], strict=True)]
    return (
        statistics.median(times["socket"]) * 1e3,
        statistics.median(times["token"]) * 1e3,
        statistics.median(added) * 1e3,
    )


def one_run(args: argparse.Namespace, k: int) -> dict[str, float]:
    res: dict[str, float] = {}
    state = common.state_dir("phalanx-bench-auth-")
    port = common.free_port()
    url = f"http://127.0.0.1:{port}"
    up_args = ["--port", str(port), *common.node_args(args.nodes)]
    with common.phalanx_up(state, up_args, f"port {port}", keep=args.keep):
        sock = state.absolute() / "auth.sock"
        api = submit.Api(url)
        try:
            t = time.monotonic()
            res["single_per_s"], _ = submit.bench_single(api, args.single, state)
            log(f"run {k}: single {res['single_per_s']:.0f}/s ({time.monotonic() - t:.1f}s)")
        finally:
            api.http.close()
        res["verify_fresh_us"], res["verify_cached_us"], res["authorize_us"] = bench_verify(
            state, args.verify
        )
        per_request = 1.0 / res["single_per_s"] - res["authorize_us"] / 1e6
        res["single_noverify_per_s"] = 1.0 / per_request
        res["fetch_ms"] = bench_fetch(sock, args.fetch)
        res["call_socket_ms"], res["call_token_ms"], res["call_added_ms"] = bench_call(
            url, sock, args.calls
        )
        res["cli_socket_ms"], res["cli_token_ms"], res["cli_added_ms"] = bench_cli(
            url, sock, args.cli
        )
        log(
            f"run {k}: verify fresh {res['verify_fresh_us']:.0f} us, cached "
            f"{res['verify_cached_us']:.1f} us, whole check {res['authorize_us']:.1f} us; "
            f"fetch {res['fetch_ms']:.2f} ms; call +{res['call_added_ms']:.2f} ms; whoami "
            f"{res['cli_socket_ms']:.0f} ms (socket) vs {res['cli_token_ms']:.0f} ms (token)"
        )
    return res


def fmt(v: float, unit: str) -> str:
    if unit == "jobs/s":
        return f"{v:,.0f}"
    return f"{v:.2f}" if abs(v) < 100 else f"{v:,.0f}"


def table(summary: dict[str, dict[str, float]], nruns: int) -> str:
    head = f"{'metric':40} {'median':>9} {'min':>9} {'max':>9}  {'unit':6} {'bar':>7}  ok"
    lines = [f"Phalanx authentication benchmark: medians over {nruns} run(s)", head]
    lines.append("-" * len(head))
    for key, (label, unit, bar, higher) in METRICS.items():
        if key not in summary:
            continue
        m = summary[key]
        verdict = ""
        if bar is not None:
            good = m["median"] >= bar if higher else m["median"] <= bar
            verdict = "yes" if good else "NO"
        shown = f"{'>=' if higher else '<='}{fmt(bar, unit)}" if bar is not None else ""
        lines.append(
            f"{label:40} {fmt(m['median'], unit):>9} {fmt(m['min'], unit):>9} "
            f"{fmt(m['max'], unit):>9}  {unit:6} {shown:>7}  {verdict}"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="runs (default 5; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer and smaller runs")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--single", type=int, default=None, help="jobs submitted one per request")
    p.add_argument("--verify", type=int, default=2000, help="credentials verified per run")
    p.add_argument("--fetch", type=int, default=200, help="socket fetches per run")
    p.add_argument("--cli", type=int, default=None, help="CLI processes per path per run")
    p.add_argument("--calls", type=int, default=200, help="in-process calls per path per run")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep each run's state dir")
    args = p.parse_args()
    defaults = dict(runs=2, single=200, cli=10) if args.quick else dict(runs=5, single=500, cli=30)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    load_before = busy_before(
        "other processes compete with the cluster and the numbers will be low"
    )
    runs = [one_run(args, k) for k in range(1, args.runs + 1)]
    load_after = os.getloadavg()[0]
    summary: dict[str, Any] = spread(runs, METRICS)
    print(table(summary, len(runs)))
    print(host_line(load_before, load_after))
    if args.json:
        doc = {"summary": summary, "runs": runs, "params": vars(args)}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
