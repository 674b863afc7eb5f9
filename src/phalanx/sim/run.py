"""`phalanx sim`: run a workload on N virtual nodes against real controllers and a real store.

The steps (docs/sim.md): write the cluster's config (the timings scaled for N nodes by the
heartbeat rule, `Timing.for_cluster`, and the workload's accounts as [fairshare]); start K real
`phalanx controller` processes on the store (SQLite in the state dir, or the URL given); start
a few node-server processes (sim/nodes.py) that register the N virtual nodes and heartbeat for
them; submit the workload through the API as its users (POST /v1/jobs/batch); wait, reading
the store, until every job is in a terminal state; then summarise from the store (jobs by
terminal state, placements per second), the controllers' /metrics (scheduling pass times),
/proc (controller CPU) and the DOWN events (false ones: nodes the simulator did not stop).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from phalanx.auth import keys as keyfiles
from phalanx.auth.tokens import mint_token
from phalanx.config import Timing
from phalanx.domain.states import TERMINAL
from phalanx.errors import PhalanxError
from phalanx.sim.workload import Workload

NODES_PER_PROCESS = 2500  # virtual nodes one node-server process serves by default
REGISTER_RATE = 200.0  # registrations a second the virtual nodes are spread over (a boot storm)
BATCH = 500  # jobs per submission request
#: [limits] of a simulated cluster: the most each setting allows (config.LimitsConfig)
SIM_LIMITS = {"api_rate": 1e6, "api_burst": 1e7, "submit_rate": 1e6, "submit_burst": 1e8}
CLUSTER = "phalanx"
_TERMINAL = sorted(s.value for s in TERMINAL)


class SimError(PhalanxError):
    """The simulation could not run or finish; the message says why."""


@dataclass
class Options:
    nodes: int
    workload: Workload
    controllers: int = 1
    store: str = "sqlite"  # "sqlite" or a database URL
    state_dir: Path | None = None
    node_procs: int = 0  # 0: one per NODES_PER_PROCESS nodes
    timeout: float = 1800.0  # seconds for the workload to finish
    timing: dict[str, float] = field(default_factory=dict)  # [timing] before the rule
    hold: float = 0.0  # with no jobs left: keep heartbeating this long (the heartbeat bench)
    progress: Callable[[str], None] | None = None


@dataclass
class Result:
    nodes: int
    jobs: int
    states: dict[str, int]
    not_terminal: int
    placements_per_s: float
    placements: int
    submit_s: float
    run_s: float
    pass_mean_s: float | None
    pass_p50_s: float | None
    pass_p99_s: float | None
    passes: int
    false_down: int
    stopped_nodes: int
    down_nodes: int
    controller_cpu_pct: float
    controller_cpu_s: float
    heartbeat_interval: float
    detect_timeout: float
    heartbeats_per_s: float
    node_stats: list[dict[str, Any]]
    store: str

    def line(self) -> str:
        return (
            f"sim: nodes={self.nodes} jobs={self.jobs} placements_per_s={self.placements_per_s:.0f} "
            f"false_down={self.false_down} controller_cpu={self.controller_cpu_pct:.0f}% "
            f"detect_timeout={self.detect_timeout:g}s"
        )

    def summary(self) -> str:
        states = ", ".join(f"{k} {v}" for k, v in sorted(self.states.items()))

        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v * 1000:.1f} ms"

        return "\n".join(
            [
                f"store: {self.store}; {self.nodes} virtual nodes; heartbeat interval "
                f"{self.heartbeat_interval:g}s (failure-detection timeout "
                f"{self.detect_timeout:g}s); {self.heartbeats_per_s:.0f} heartbeats/s",
                f"jobs: {self.jobs} ({states}); not terminal: {self.not_terminal}",
                f"submitted in {self.submit_s:.1f}s; workload done in {self.run_s:.1f}s",
                f"placements: {self.placements} attempts, {self.placements_per_s:.0f}/s",
                f"scheduling passes: {self.passes}, mean {ms(self.pass_mean_s)}, "
                f"p50 {ms(self.pass_p50_s)}, p99 {ms(self.pass_p99_s)} (bucket bounds)",
                f"nodes DOWN: {self.down_nodes} ({self.stopped_nodes} stopped on purpose, "
                f"{self.false_down} false)",
                f"controller CPU: {self.controller_cpu_s:.1f}s, {self.controller_cpu_pct:.0f}% "
                f"of this machine's {os.cpu_count()} CPUs",
            ]
        )


# ------------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (and its reaped children) from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / ticks


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def config_toml(timing: Timing, workload: Workload) -> str:
    """The cluster's config file: the scaled timings and the workload's accounts."""
    lines = ["[timing]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in timing.model_dump().items()]
    lines += ["", "[auth]", "allow_root_jobs = true", "", "[metrics]", "agent_port = 0"]
    # The simulated users are a load generator: the per-user rate limits (200 jobs/s
    # sustained by default) protect the API from a runaway client and would otherwise cap
    # the placements measured once their burst is spent.
    lines += ["", "[limits]", *(f"{k} = {v!r}" for k, v in SIM_LIMITS.items())]
    fs = workload.fairshare_config()
    lines += ["", "[fairshare]", f"open = {_toml_value(fs['open'])}"]
    for a in fs["accounts"]:
        lines += ["", "[[fairshare.accounts]]", f"name = {_toml_value(a['name'])}"]
    for u in fs["users"]:
        lines += [
            "",
            "[[fairshare.users]]",
            f"name = {_toml_value(u['name'])}",
            f"account = {_toml_value(u['account'])}",
        ]
    return "\n".join(lines) + "\n"


def histogram(text: str, name: str) -> tuple[int, float, list[tuple[float, int]]]:
    """count, sum and cumulative buckets of a Prometheus histogram in /metrics text."""
    count, total, buckets = 0, 0.0, []
    for line in text.splitlines():
        if line.startswith(f"{name}_count"):
            count += int(float(line.split()[-1]))
        elif line.startswith(f"{name}_sum"):
            total += float(line.split()[-1])
        elif line.startswith(f"{name}_bucket"):
            m = re.search(r'le="([^"]+)"', line)
            if m:
                buckets.append((float(m.group(1)), int(float(line.split()[-1]))))
    merged: dict[float, int] = {}
    for le, n in buckets:
        merged[le] = merged.get(le, 0) + n
    return count, total, sorted(merged.items())


def quantile(buckets: list[tuple[float, int]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile q (None with no observations)."""
    if not buckets or buckets[-1][1] == 0:
        return None
    want = q * buckets[-1][1]
    for le, n in buckets:
        if n >= want:
            return le
    return buckets[-1][0]


# ------------------------------------------------------------------------ the run


class Sim:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.own_dir = opts.state_dir is None
        self.dir = opts.state_dir or Path(tempfile.mkdtemp(prefix="phalanx-sim-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db = f"sqlite:///{self.dir / 'phalanx.db'}" if opts.store == "sqlite" else opts.store
        base = Timing.model_validate(opts.timing)
        self.timing = base.for_cluster(opts.nodes)
        self.controllers: list[subprocess.Popen[bytes]] = []
        self.node_procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.stopped_file = self.dir / "stopped-nodes.txt"

    def say(self, msg: str) -> None:
        if self.opts.progress:
            self.opts.progress(msg)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PHALANX_CONFIG=str(self.dir / "sim.toml"))
        env.pop("PHALANX_URL", None)
        with open(logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def _log_tail(self, name: str) -> str:
        try:
            lines = (self.dir / "logs" / f"{name}.log").read_text().strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-5:])

    def _wait(
        self, what: str, ready: Callable[[], bool], timeout: float, every: float = 0.2
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, p in enumerate(self.controllers):
                if p.poll() is not None:
                    raise SimError(
                        f"controller-{i + 1} exited ({p.returncode}) while waiting for {what}: "
                        f"{self._log_tail(f'controller-{i + 1}')}"
                    )
            for i, p in enumerate(self.node_procs):
                if p.poll() is not None:
                    raise SimError(
                        f"node server {i + 1} exited ({p.returncode}) while waiting for {what}: "
                        f"{self._log_tail(f'nodes-{i + 1}')}"
                    )
            with contextlib.suppress(httpx.HTTPError, sa.exc.SQLAlchemyError):
                if ready():
                    return
            time.sleep(every)  # polling interval of a wait on a condition
        raise SimError(f"timed out after {timeout:.0f}s waiting for {what} (logs: {self.dir})")

    # ------------------------------------------------------------- start
    def start(self) -> None:
        (self.dir / "sim.toml").write_text(config_toml(self.timing, self.opts.workload))
        for i in range(self.opts.controllers):
            port = free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            name = f"controller-{i + 1}"
            self.controllers.append(
                self._spawn(
                    name,
                    [
                        "-m",
                        "phalanx",
                        "controller",
                        "--state-dir",
                        str(self.dir),
                        "--port",
                        str(port),
                        "--db",
                        self.db,
                        "--id",
                        name,
                        "--log-level",
                        "warning",
                    ],
                )
            )
            # one at a time: the first one creates the schema and the cluster key
            url = self.urls[-1]

            def healthy(url: str = url) -> bool:
                return httpx.get(url + "/healthz", timeout=5).status_code == 200

            self._wait(f"{name} to answer", healthy, 120.0)
        self.keys = keyfiles.load(self.dir / "keys" / "cluster.jwks")
        self.admin = {"Authorization": "Bearer " + self._token("root", "admin")}
        self.engine = sa.create_engine(self.db)
        self._start_nodes()

    def _token(self, user: str, role: str = "user") -> str:
        return mint_token(self.keys, user=user, role=role, cluster=CLUSTER, lifetime=86400.0)

    def _start_nodes(self) -> None:
        n, wl = self.opts.nodes, self.opts.workload
        width = max(4, len(str(n)))
        rng = random.Random(wl.seed)
        stops = {
            f"sim{i:0{width}d}": rng.uniform(*wl.failures.node_stop_window)
            for i in rng.sample(range(n), round(wl.failures.node_stop_fraction * n))
        }
        nodes = []
        for i in range(n):
            c = wl.node_class(i, n)
            nodes.append(
                {
                    "name": f"sim{i:0{width}d}",
                    "body": {
                        "cpus": c.cpus,
                        "mem_mb": c.mem_mb,
                        "gpus": [[g, c.gpu_type] for g in range(c.gpus)],
                        "features": list(c.features),
                        "addr": "127.0.0.1",
                        "boot_id": f"sim-{os.getpid()}-{i}",
                        "version": "sim",
                    },
                }
            )
        procs = self.opts.node_procs or max(1, math.ceil(n / NODES_PER_PROCESS))
        for p in range(procs):
            mine = nodes[p::procs]
            plan = {
                "urls": self.urls[p % len(self.urls) :] + self.urls[: p % len(self.urls)],
                "cluster": CLUSTER,
                "key_file": str(self.dir / "keys" / "cluster.jwks"),
                "heartbeat_interval": self.timing.heartbeat_interval,
                "register_spread": max(1.0, n / REGISTER_RATE),
                "stop_at": {x["name"]: stops[x["name"]] for x in mine if x["name"] in stops},
                "stopped_file": str(self.stopped_file),
                "stats_file": str(self.dir / f"nodes-{p + 1}.stats.json"),
                "seed": wl.seed + p,
                "nodes": mine,
            }
            path = self.dir / f"nodes-{p + 1}.plan.json"
            path.write_text(json.dumps(plan))
            self.node_procs.append(
                self._spawn(f"nodes-{p + 1}", ["-m", "phalanx.sim.nodes", str(path)])
            )
        self.say(f"{n} virtual nodes registering through {procs} node server(s)")

        def registered() -> bool:
            with self.engine.connect() as c:
                got = c.execute(sa.text("SELECT count(*) FROM nodes WHERE boot_id LIKE 'sim-%'"))
                return int(got.scalar() or 0) >= n

        self._wait(f"{n} nodes to register", registered, 300.0 + n / 10)

    # ------------------------------------------------------------- workload
    def submit(self) -> float:
        t0 = time.monotonic()
        subs = self.opts.workload.submissions()
        by_user: dict[str, list[dict[str, Any]]] = {}
        for user, spec in subs:
            by_user.setdefault(user, []).append(spec)
        with httpx.Client(timeout=120.0) as client:
            for i, (user, specs) in enumerate(sorted(by_user.items())):
                url = self.urls[i % len(self.urls)]
                headers = {"Authorization": "Bearer " + self._token(user)}
                for j in range(0, len(specs), BATCH):
                    self._submit(client, url, headers, specs[j : j + BATCH])
        return time.monotonic() - t0

    @staticmethod
    def _submit(
        client: httpx.Client, url: str, headers: dict[str, str], specs: list[dict[str, Any]]
    ) -> None:
        """One batch; retried while the controller answers 503 or 429 (nothing was stored:
        a busy SQLite store, a rate limit), never after a 504 (the outcome is unknown)."""
        backoff = 0.5
        deadline = time.monotonic() + 300.0
        while True:
            r = client.post(url + "/v1/jobs/batch", json={"jobs": specs}, headers=headers)
            if r.status_code == 201:
                return
            if r.status_code not in (429, 503) or time.monotonic() > deadline:
                raise SimError(f"submitting a batch failed: {r.status_code} {r.text[:300]}")
            time.sleep(backoff)  # a retry's backoff
            backoff = min(2 * backoff, 5.0)

    def _counts(self) -> dict[str, int]:
        with self.engine.connect() as c:
            rows = c.execute(sa.text("SELECT state, count(*) FROM jobs GROUP BY state")).all()
        return {str(s): int(n) for s, n in rows}

    def run(self) -> Result:
        cpu0 = {p.pid: proc_cpu_s(p.pid) for p in self.controllers}
        t0 = time.monotonic()
        submit_s = self.submit()
        jobs = self.opts.workload.total_jobs
        self.say(f"{jobs} jobs submitted in {submit_s:.1f}s; running")
        last = [0.0]

        def finished() -> bool:
            counts = self._counts()
            left = sum(v for k, v in counts.items() if k not in _TERMINAL)
            if time.monotonic() - last[0] > 10:
                last[0] = time.monotonic()
                self.say(f"{left} of {sum(counts.values())} jobs not terminal yet")
            return left == 0 and sum(counts.values()) >= jobs

        with contextlib.suppress(SimError):
            self._wait("the workload to finish", finished, self.opts.timeout, every=1.0)
        run_s = time.monotonic() - t0
        if self.opts.hold > 0:
            self.say(f"holding the idle cluster for {self.opts.hold:g}s")
            self._wait(
                "the hold",
                lambda: time.monotonic() - t0 >= run_s + self.opts.hold,
                self.opts.hold + 60,
            )
        wall = time.monotonic() - t0
        cpu = sum(proc_cpu_s(p.pid) - cpu0[p.pid] for p in self.controllers)
        return self._result(submit_s, run_s, wall, cpu)

    def _result(self, submit_s: float, run_s: float, wall: float, cpu: float) -> Result:
        counts = self._counts()
        with self.engine.connect() as c:
            row = c.execute(
                sa.text("SELECT count(*), min(created_at), max(created_at) FROM attempts")
            ).one()
        placements = int(row[0] or 0)
        span = float(row[2] or 0) - float(row[1] or 0)
        rate = placements / span if span > 0 else float(placements)
        downs, stopped = self._downs(), self._stopped()
        count, total = 0, 0.0
        buckets: list[tuple[float, int]] = []
        for url in self.urls:
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(url + "/metrics", headers=self.admin, timeout=10).text
                n, s, b = histogram(text, "phalanx_scheduling_pass_seconds")
                count, total = count + n, total + s
                buckets = (
                    sorted({le: dict(buckets).get(le, 0) + v for le, v in b}.items())
                    if b
                    else buckets
                )
        stats = self.stop_nodes()
        hbs = sum(int(s.get("heartbeats", 0)) for s in stats)
        return Result(
            nodes=self.opts.nodes,
            jobs=sum(counts.values()),
            states={k: v for k, v in counts.items() if k in _TERMINAL},
            not_terminal=sum(v for k, v in counts.items() if k not in _TERMINAL),
            placements_per_s=rate,
            placements=placements,
            submit_s=submit_s,
            run_s=run_s,
            pass_mean_s=total / count if count else None,
            pass_p50_s=quantile(buckets, 0.5),
            pass_p99_s=quantile(buckets, 0.99),
            passes=count,
            false_down=len(downs - stopped),
            stopped_nodes=len(stopped),
            down_nodes=len(downs),
            controller_cpu_pct=100.0 * cpu / (wall * (os.cpu_count() or 1)),
            controller_cpu_s=cpu,
            heartbeat_interval=self.timing.heartbeat_interval,
            detect_timeout=self.timing.node_down_timeout,
            heartbeats_per_s=hbs / wall if wall > 0 else 0.0,
            node_stats=stats,
            store="sqlite" if self.opts.store == "sqlite" else self.db.split("://")[0],
        )

    # ------------------------------------------------------------- benches
    def idle(self, seconds: float) -> dict[str, Any]:
        """The nodes only heartbeat for `seconds` (no jobs): the controllers' CPU share, the
        heartbeats they took, and the nodes declared DOWN that nobody stopped."""
        cpu0 = {p.pid: proc_cpu_s(p.pid) for p in self.controllers}
        beats0 = self._heartbeats()
        t0 = time.monotonic()
        self._wait("the idle period", lambda: time.monotonic() - t0 >= seconds, seconds + 60)
        wall = time.monotonic() - t0
        cpu = sum(proc_cpu_s(p.pid) - cpu0[p.pid] for p in self.controllers)
        beats1 = self._heartbeats()
        beats = None if beats0 is None or beats1 is None else beats1 - beats0
        return {
            "heartbeats_per_s": None if beats is None else beats / wall,
            "cpu_ms_per_heartbeat": 1000.0 * cpu / beats if beats else None,
            "seconds": wall,
            "controller_cpu_s": cpu,
            "controller_cpu_pct": 100.0 * cpu / (wall * (os.cpu_count() or 1)),
            "false_down": len(self._downs() - self._stopped()),
            "heartbeat_interval": self.timing.heartbeat_interval,
            "detect_timeout": self.timing.node_down_timeout,
        }

    def sustain(
        self, seconds: float, spec: dict[str, Any], backlog: int, window: float = 60.0
    ) -> dict[str, Any]:
        """Keep at least `backlog` jobs like `spec` pending for `seconds`, and count the
        attempts started in each `window` (placements onto free capacity: the jobs are
        short, so capacity frees as fast as it is taken)."""
        user = sorted(self.opts.workload.accounts)[0]
        body = dict(spec, account=self.opts.workload.accounts[user])
        headers = {"Authorization": "Bearer " + self._token(user)}
        t0, wall0 = time.monotonic(), time.time()
        cpu0 = {p.pid: proc_cpu_s(p.pid) for p in self.controllers}
        submitted = 0
        with httpx.Client(timeout=120.0) as client:
            while time.monotonic() - t0 < seconds:
                with self.engine.connect() as c:
                    pending = int(
                        c.execute(
                            sa.text("SELECT count(*) FROM jobs WHERE state = 'PENDING'")
                        ).scalar_one()
                    )
                if pending < backlog:
                    url = self.urls[submitted // BATCH % len(self.urls)]
                    self._submit(client, url, headers, [body] * BATCH)
                    submitted += BATCH
                else:
                    time.sleep(0.2)  # the queue is full enough: look again shortly
        wall = time.monotonic() - t0
        cpu = sum(proc_cpu_s(p.pid) - cpu0[p.pid] for p in self.controllers)
        with self.engine.connect() as c:
            starts = [
                float(r[0])
                for r in c.execute(
                    sa.text("SELECT created_at FROM attempts WHERE created_at >= :t"), {"t": wall0}
                )
            ]
        bins = [0] * max(1, int(seconds // window))
        for t in starts:
            i = int((t - wall0) // window)
            if 0 <= i < len(bins):
                bins[i] += 1
        return {
            "seconds": wall,
            "submitted": submitted,
            "placements": len(starts),
            "placements_per_s": len(starts) / wall if wall else 0.0,
            "per_window": [b / window for b in bins],
            "controller_cpu_pct": 100.0 * cpu / (wall * (os.cpu_count() or 1)),
            "false_down": len(self._downs() - self._stopped()),
        }

    def _heartbeats(self) -> float | None:
        """Heartbeats the controllers took so far (their phalanx_heartbeats_total), or None
        when one controller's /metrics did not answer within 30 s (then the count is unknown,
        not zero)."""
        total = 0.0
        for url in self.urls:
            try:
                text = httpx.get(url + "/metrics", timeout=30).raise_for_status().text
            except httpx.HTTPError as e:
                self.say(f"{url}/metrics did not answer: {type(e).__name__}: {e}")
                return None
            for line in text.splitlines():
                if line.startswith("phalanx_heartbeats_total"):
                    total += float(line.split()[-1])
        return total

    def _downs(self) -> set[str]:
        with self.engine.connect() as c:
            rows = c.execute(sa.text("SELECT node FROM events WHERE kind = 'node.down'"))
            return {str(r[0]) for r in rows}

    def _stopped(self) -> set[str]:
        try:
            lines = self.stopped_file.read_text().splitlines()
        except OSError:
            return set()
        return {ln.split()[0] for ln in lines if ln}

    # ------------------------------------------------------------- stop
    def stop_nodes(self) -> list[dict[str, Any]]:
        """Stop the node servers (they write their counters) and read their counters."""
        procs, self.node_procs = self.node_procs, []
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        stats = []
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            with contextlib.suppress(OSError, ValueError):
                stats.append(json.loads((self.dir / f"nodes-{i + 1}.stats.json").read_text()))
        return stats

    def close(self) -> None:
        self.stop_nodes()
        for p in self.controllers:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in self.controllers:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.controllers = []
        if getattr(self, "engine", None) is not None:
            self.engine.dispose()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def simulate(opts: Options) -> Result:
    """Start the cluster, run the workload, stop everything; the result."""
    sim = Sim(opts)
    try:
        sim.start()
        return sim.run()
    finally:
        sim.close()
