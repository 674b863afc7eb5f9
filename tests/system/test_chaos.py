"""A randomized fault run: rounds of random faults over a steady workload, then a history check.

Three controllers share one store (SQLite; PostgreSQL too when available), three agents list
every controller, and a client thread submits short jobs through a multi-URL client (the
PHALANX_URL way: it fails over by itself). Each round injects one fault, waits until the
cluster is whole again, and lets the workload run on:

- ctl-kill:   SIGKILL a controller (half the time the holder of a scheduling lease), restart
              it after a random pause;
- ctl-restart: SIGTERM a controller (half the time a lease holder; it hands its leases back as
              it stops) and start it again at once;
- ctl-stop:   SIGSTOP a controller (half the time a lease holder) for longer than the lease
              TTL, then SIGCONT it: it must step down, never write under its old term;
- agent-blip: SIGKILL an agent and restart it before its jobs' fence goes stale: running jobs
              are re-adopted and finish once;
- agent-down: SIGKILL an agent and restart it only after its node was marked DOWN: its jobs
              self-fence, are requeued and run again elsewhere, never at the same time;
- agent-freeze: SIGSTOP an agent until its node is DOWN, then SIGCONT it: its jobs fenced
              themselves meanwhile, and what it reports on waking must not bring them back;
- partition:  (SQLite, where network namespaces and iptables work) cut node01's network to
              the controllers with iptables DROP until its node is DOWN, then heal it;
- pg-failover: (PostgreSQL) SIGKILL the primary, promote its synchronous standby after a
              random gap, and rebuild the dead one as the new standby (controllers follow
              through their multi-host URL);
- authd-kill: SIGKILL the login host's credential service (`phalanx authd`), through which
              a second submitter gets its credentials, and restart it after a random pause
              shorter than the clients' wait for it: no submission may fail for want of one.

The workload mixes plain jobs with jobs that hold a GPU, a licence, or a hot spare node, so
that the check after the run can ask that nothing is left held.

Every job appends `start`, `tick` and `end` lines with its attempt id to a file of its own
(O_APPEND). A sampler thread reads the lease table the whole time. Afterwards
`system.history.check` must find nothing: no acknowledged job lost, no submission applied
twice, no two executions of a job overlapping, no execution the store did not record as an
attempt, exactly one terminal state per job (COMPLETED: the workload is well behaved; or
NODE_FAIL once node failures used every one of the job's retries, counted one by one), lease
terms that only grow with one holder each, no write under a stale term, no job alive on a DOWN
node, no node DOWN outside the windows in which a fault silenced it (no false DOWN, across
controller failovers too), work run to its end twice only after its node went DOWN, and no
CPU, GPU, licence or restart reservation held once every job has ended.

The seed is printed; PHX_CHAOS_SEED replays a run (exactly, outside the soak, whose paired
faults run in two threads), PHX_CHAOS_ROUNDS changes its length and
PHX_CHAOS_FAULTS (a comma list of the names above) limits the kinds of fault, to hammer one.
`make soak-chaos` runs it for a long time (PHX_CHAOS_ROUNDS, PHX_CHAOS_MINUTES): not in CI.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pgcluster import PgCluster, PostgresNotAvailable
from phalanx.auth import keys as keyfiles
from phalanx.auth.credentials import LocalService
from phalanx.client import Client
from phalanx.errors import PhalanxError, Unauthenticated
from system import history as hist
from system import netns
from system.conftest import CLUSTERS
from system.dbclusters import running
from system.harness import Cluster, Daemon, free_port, marked_processes, wait_for
from system.netns import NetnsCluster, NetnsError, NetnsLab
from system.test_ha import TIMING  # fast takeovers; fencing slower than agents' failover

pytestmark = [pytest.mark.system, pytest.mark.soak]  # make soak; make soak-chaos: an hour

CONTROLLERS = ("ctl-1", "ctl-2", "ctl-3")
NODES = ("node01", "node02", "node03")
ROUNDS = {"sqlite": 7, "postgres": 5}  # about 60-120 s each on a busy 2-core machine
SUBMIT_EVERY = 0.5  # seconds between submissions
# share of jobs that run 15-25 s: longer than node_down_timeout, so a node failure catches
# them running, and they must be fenced there before they run elsewhere
LONG_JOBS = 0.1
EXPOSED_WAIT = 20.0  # seconds a node fault waits for a long job on its node (soak: 3)
SAMPLE_EVERY = 0.3  # seconds between reads of the lease table
CLIENT_TIMEOUT = 5.0  # read timeout of the workload's client: gets past a frozen controller
RECOVER = 90.0  # deadline for the cluster to be whole again after a fault
TICK = 0.2  # seconds between a job's ticks
GPUS = "h100:2"  # each agent's (fake) GPUs
LICENSES = "fluent:2"  # the cluster's licences
CONFIG = f'[cluster]\nlicenses = "{LICENSES}"\n'
# shares of the workload's jobs that hold something beyond CPUs: a GPU, a licence, a spare
GPU_JOBS, LICENSED_JOBS, SPARE_JOBS = 0.15, 0.1, 0.05
VIA_AUTHD = 0.3  # share of submissions made with a credential from the authd socket
AUTH_WAIT = 10.0  # $PHALANX_AUTH_WAIT of that submitter: longer than any authd-kill pause
PG_GAP = 6.0  # longest wait between the primary's death and the standby's promotion
# `make soak-chaos` (PHX_CHAOS_SOAK=1): shorter waits between and within rounds, so an hour
# holds a thousand of them; the faults themselves are the same
SOAK = os.environ.get("PHX_CHAOS_SOAK", "") == "1"

JOB = """#!/bin/bash
f={runs}/$PHX_JOB_ID.log
echo "start $PHX_ATTEMPT_ID $PHX_NODENAME $EPOCHREALTIME" >> "$f"
for ((i = 0; i < {ticks}; i++)); do
    sleep {tick}
    echo "tick $PHX_ATTEMPT_ID $EPOCHREALTIME" >> "$f"
done
echo "end $PHX_ATTEMPT_ID $EPOCHREALTIME" >> "$f"
"""


def seed_and_rounds(backend: str) -> tuple[int, int]:
    """PHX_CHAOS_SEED / PHX_CHAOS_ROUNDS, else a fresh seed and the backend's default."""
    raw_seed = os.environ.get("PHX_CHAOS_SEED", "").strip()
    raw_rounds = os.environ.get("PHX_CHAOS_ROUNDS", "").strip()
    try:
        seed = int(raw_seed) if raw_seed else random.SystemRandom().randrange(1 << 32)
        rounds = int(raw_rounds) if raw_rounds else ROUNDS[backend]
    except ValueError:
        pytest.fail(
            f"PHX_CHAOS_SEED ({raw_seed!r}) and PHX_CHAOS_ROUNDS ({raw_rounds!r}) must be "
            "whole numbers",
            pytrace=False,
        )
    if rounds < 1:
        pytest.fail(f"PHX_CHAOS_ROUNDS must be at least 1, not {rounds}", pytrace=False)
    return seed, rounds


# ---------------------------------------------------------------------- the workload
@dataclass
class Workload:
    """Submits one short job every `every` seconds from a thread, through one multi-URL
    Client, and records each submission's outcome for the history."""

    urls: str
    out: Path
    rng: random.Random
    token: str  # the cluster's admin credential
    authd_socket: Path | None = None  # a login host's credential service, for some of them
    every: float = SUBMIT_EVERY
    subs: list[hist.Submission] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    credential_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.runs = self.out / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-submitter", daemon=True)
        self._ticks = [self.ticks() for _ in range(10_000)]

    def ticks(self) -> int:
        """A job's length in ticks: most run about a second; some span a fence timeout."""
        return (
            self.rng.randint(75, 125) if self.rng.random() < LONG_JOBS else self.rng.randint(3, 7)
        )

    def spec(self, i: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "script": JOB.format(
                runs=self.runs, ticks=self._ticks[i % len(self._ticks)], tick=TICK
            ),
            "name": f"chaos-{i}",
            "submit_dir": str(self.out),
            "output": str(self.out / "%j.out"),
            "time_limit_s": 300,
            "requeue": True,
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C"},
        }
        kind = random.Random(i).random()  # by the job's number: the same on a replay
        if kind < GPU_JOBS:
            spec["gpus_per_node"] = 1
        elif kind < GPU_JOBS + LICENSED_JOBS:
            spec["licenses"] = "fluent:1"
        elif kind < GPU_JOBS + LICENSED_JOBS + SPARE_JOBS:
            spec["spares"] = 1
        return spec

    def length(self, name: str) -> float:
        """The seconds the job submitted as `name` runs (its ticks)."""
        i = int(name.rsplit("-", 1)[1])
        return self._ticks[i % len(self._ticks)] * TICK

    def start(self) -> Workload:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CLIENT_TIMEOUT * 3 + 10)
        assert not self._thread.is_alive(), "the submitter thread is stuck"

    def acked(self) -> list[int]:
        return [s.job_id for s in self.subs if s.job_id is not None]

    def _run(self) -> None:
        timeout = httpx.Timeout(CLIENT_TIMEOUT, connect=2.0)
        local = LocalService(self.authd_socket, wait=AUTH_WAIT) if self.authd_socket else None
        with (
            Client(self.urls, token=self.token, timeout=timeout) as admin,
            Client(self.urls, credentials=local, timeout=timeout) as user,
        ):
            i = 0
            while not self._stop.is_set():
                t = time.monotonic()
                name = f"chaos-{i}"
                c = user if local is not None and self.rng.random() < VIA_AUTHD else admin
                try:
                    jid = int(c.submit(self.spec(i))["job_id"])
                    self.subs.append(hist.Submission(name, "acked", jid))
                except PhalanxError as e:
                    # a 4xx answer refused it; no answer, a 5xx (the store was unreachable, a
                    # commit got no answer): it may or may not have been applied
                    refused = 400 <= e.http_status < 500
                    self.subs.append(hist.Submission(name, "refused" if refused else "unknown"))
                    self.errors.append(f"{name}: {type(e).__name__}: {e}")
                    if isinstance(e, Unauthenticated):
                        self.credential_errors.append(f"{name}: {e}")
                except Exception as e:  # anything else: treat as unanswered
                    self.subs.append(hist.Submission(name, "unknown"))
                    self.errors.append(f"{name}: {type(e).__name__}: {e}")
                i += 1
                self._stop.wait(max(0.0, self.every - (time.monotonic() - t)))


@dataclass
class LeaseSampler:
    """Reads the lease table every `every` seconds (through any controller that answers)."""

    urls: str
    token: str  # the cluster's admin credential
    every: float = SAMPLE_EVERY
    samples: list[hist.LeaseSample] = field(default_factory=list)
    failures: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def start(self) -> LeaseSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CLIENT_TIMEOUT * 3 + 10)
        assert not self._thread.is_alive(), "the lease sampler thread is stuck"

    def _run(self) -> None:
        with Client(
            self.urls, token=self.token, timeout=httpx.Timeout(CLIENT_TIMEOUT, connect=2.0)
        ) as c:
            while not self._stop.is_set():
                try:
                    view = c.cluster()
                    leases = {str(x["name"]): (x["holder"], int(x["term"])) for x in view["leases"]}
                    self.samples.append(hist.LeaseSample(time.time(), leases))
                except Exception:
                    self.failures += 1
                self._stop.wait(self.every)


# ---------------------------------------------------------------------- the cluster
def held(view: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Validly held leases of a GET /v1/cluster view: name -> (holder, term)."""
    return {
        x["name"]: (str(x["holder"]), int(x["term"]))
        for x in view["leases"]
        if x["valid"] and x["holder"]
    }


def duties_held(view: dict[str, Any]) -> bool:
    h = held(view)
    return "cluster" in h and any(n == "sched" or n.startswith("sched:") for n in h)


def rotate(urls: list[str], i: int) -> str:
    """The URLs as a comma list starting with the i-th: each agent prefers another controller."""
    return ",".join(urls[i:] + urls[:i])


@dataclass
class Chaos:
    """The running cluster plus what a fault needs: which daemons exist and how to wait."""

    cluster: Cluster
    urls: list[str]
    rng: random.Random
    lab: NetnsLab | None = None
    partition_ns: str = ""  # node01's namespace, when partitions can be made
    ctl_addr: str = ""
    log: list[str] = field(default_factory=list)
    work: Workload | None = None
    windows: list[hist.Fault] = field(default_factory=list)  # when a node could not answer
    authd: Daemon | None = None
    pg: PgCluster | None = None  # the store's primary and standby, for pg-failover

    def controllers(self) -> list[Daemon]:
        return [d for d in self.cluster.daemons.values() if d.kind == "controller"]

    def say(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        self.log.append(line)
        print(line, flush=True)

    def lease_holders(self) -> list[str]:
        h = held(self.cluster.client().cluster())
        return sorted({who for n, (who, _) in h.items() if n.startswith("sched")})

    def pick_controller(self) -> Daemon:
        """Half the time a holder of a scheduling lease, else any controller."""
        ctls = self.controllers()
        if self.rng.random() < 0.5:
            with contextlib.suppress(Exception):
                holders = self.lease_holders()
                if holders:
                    name = self.rng.choice(holders)
                    return self.cluster.daemons[name]
        return self.rng.choice(ctls)

    def healthy(self) -> None:
        """Every daemon runs, answers or is registered, and both duties have a holder."""
        for d in self.controllers():
            self.cluster.wait_controller(d)
        self.cluster.wait_agents(list(NODES), timeout=RECOVER)
        wait_for(
            lambda: duties_held(self.cluster.client().cluster()),
            timeout=RECOVER,
            what="the duty leases to be held",
        )

    # -------------------------------------------------------------- faults
    def ctl_kill(self) -> None:
        d = self.pick_controller()
        pause = self.rng.uniform(0.0, 1.0 if SOAK else 3.0)
        self.say(f"SIGKILL {d.name}, restart after {pause:.1f}s")
        d.kill(signal.SIGKILL)
        time.sleep(pause)
        self.cluster.restart(d)

    def ctl_restart(self) -> None:
        d = self.pick_controller()
        self.say(f"SIGTERM {d.name} and start it again")
        d.kill(signal.SIGTERM)
        self.cluster.restart(d)

    def ctl_stop(self) -> None:
        d = self.pick_controller()
        # sometimes longer than the clients' read timeout, so some submissions go unanswered
        pause = TIMING["lease_ttl"] + self.rng.uniform(0.5, 1.5 if SOAK else 4.0)
        self.say(f"SIGSTOP {d.name} for {pause:.1f}s")
        os.kill(d.pid, signal.SIGSTOP)
        try:
            time.sleep(pause)
        finally:
            os.kill(d.pid, signal.SIGCONT)

    def agent_blip(self, node: str) -> None:
        pause = self.rng.uniform(0.0, 1.5)
        self.say(f"SIGKILL agent {node}, restart after {pause:.1f}s")
        d = self.cluster.agent(node)
        d.kill(signal.SIGKILL)
        time.sleep(pause)
        self.cluster.restart(d, wait=False)

    def agent_down(self, node: str) -> None:
        self.say(f"SIGKILL agent {node} until its node is DOWN")
        d = self.cluster.agent(node)
        start = time.time()
        d.kill(signal.SIGKILL)
        try:
            self.wait_down(node)
        finally:
            self.cluster.restart(d, wait=False)
            self.windows.append(hist.Fault(node, "agent-down", start, time.time()))

    def agent_freeze(self, node: str) -> None:
        self.say(f"SIGSTOP agent {node} until its node is DOWN, then SIGCONT")
        d = self.cluster.agent(node)
        start = time.time()
        os.kill(d.pid, signal.SIGSTOP)
        try:
            self.wait_down(node)
        finally:
            os.kill(d.pid, signal.SIGCONT)
            self.windows.append(hist.Fault(node, "agent-freeze", start, time.time()))

    def partition(self, node: str) -> None:
        assert self.lab is not None and node == "node01", "only node01 sits behind a veth pair"
        self.say("partition node01 from the controllers until its node is DOWN")
        start = time.time()
        self.lab.partition(self.partition_ns, self.ctl_addr)
        try:
            self.wait_down("node01")
        finally:
            self.lab.heal(self.partition_ns, self.ctl_addr)
            self.windows.append(hist.Fault("node01", "partition", start, time.time()))

    def pg_failover(self) -> None:
        assert self.pg is not None
        gap = self.rng.uniform(0.0, 2.0 if SOAK else PG_GAP)
        self.say(f"SIGKILL the PostgreSQL primary, promote the standby after {gap:.1f}s")
        self.pg.failover(gap=gap)

    def authd_kill(self) -> None:
        assert self.authd is not None
        pause = self.rng.uniform(0.0, 2.0 if SOAK else AUTH_WAIT / 2)
        self.say(f"SIGKILL authd, restart after {pause:.1f}s")
        self.authd.kill(signal.SIGKILL)
        time.sleep(pause)
        self.authd = self.cluster.restart(self.authd, wait=False)

    def place(self, kinds: Sequence[str]) -> list[str]:
        """A node for each node fault among `kinds` (in order; "" for the others), no two
        the same: node01 for a partition (the node behind the veth pair); for a silence
        (`SILENCES`), preferably a node running a job that will outlive a node failure
        detected now (it runs on past node_down_timeout and a requeue), so that the failure
        tests fencing. Waits a while for one (long jobs come along every few seconds);
        without one, any free node."""
        work = self.work
        assert work is not None
        need = TIMING["node_down_timeout"] + 4.0
        exposed: set[str] = set()

        def look() -> bool:
            now = time.time()
            for j in self.cluster.client().jobs(state="RUNNING", limit=1000):
                left = work.length(str(j["name"])) - (now - (j["start_time"] or now))
                if left > need:
                    exposed.add(str(j["nodelist"]))
            return bool(exposed)

        if any(k in SILENCES for k in kinds):
            with contextlib.suppress(AssertionError):
                wait_for(
                    look,
                    timeout=3.0 if SOAK else EXPOSED_WAIT,
                    interval=0.3,
                    what="a long job to run",
                )
        out = [""] * len(kinds)
        taken: set[str] = set()
        # the constrained first: a partition, then silences (on an exposed node), then blips
        order = sorted(
            (i for i, k in enumerate(kinds) if k in NODE_FAULTS),
            key=lambda i: (kinds[i] != "partition", kinds[i] not in SILENCES),
        )
        for i in order:
            if kinds[i] == "partition":
                choice = ["node01"]
            else:
                free = [n for n in NODES if n not in taken]
                hot = [n for n in free if n in exposed] if kinds[i] in SILENCES else []
                choice = hot or free
            assert choice and choice[0] not in taken, f"no node left for {kinds}"
            out[i] = self.rng.choice(choice)
            taken.add(out[i])
        return out

    def wait_down(self, node: str) -> None:
        wait_for(
            lambda: self.cluster.client().node(node)["state"] == "DOWN",
            timeout=RECOVER,
            interval=0.2,
            what=f"{node} to be marked DOWN",
        )

    def faults(self) -> dict[str, Callable[..., None]]:
        """The faults this cluster can make, by name; a node fault (`NODE_FAULTS`) takes the
        node it strikes (see `place`)."""
        out: dict[str, Callable[..., None]] = {
            "ctl-kill": self.ctl_kill,
            "ctl-restart": self.ctl_restart,
            "ctl-stop": self.ctl_stop,
            "agent-blip": self.agent_blip,
            "agent-down": self.agent_down,
            "agent-freeze": self.agent_freeze,
        }
        if self.lab is not None:
            out["partition"] = self.partition
        if self.authd is not None:
            out["authd-kill"] = self.authd_kill
        if self.pg is not None:
            out["pg-failover"] = self.pg_failover
        return out


def start_cluster(cluster: Cluster) -> list[str]:
    """Three controllers on one store (ctl-1 first, so it takes the leases), three agents each
    listing every controller, a different one first, with fake GPUs; the cluster has
    licences. Return the controllers' URLs."""
    cluster.timing.update(TIMING)
    config = cluster.root / "phalanx.toml"
    # `ip netns exec` mounts a /sys without cgroups: nodes in namespaces run jobs uncontained
    # (netns.NsDaemon gives that setting only to a cluster without a config of its own)
    netns_isolation = "[isolation]\nrequire_cgroups = false\n"
    config.write_text(CONFIG + (netns_isolation if isinstance(cluster, NetnsCluster) else ""))
    cluster.extra_env["PHALANX_CONFIG"] = str(config)
    url0 = cluster.controller_url(cluster.start_controller(CONTROLLERS[0]))

    def first_holds() -> bool:
        return duties_held(
            httpx.get(url0 + "/v1/cluster", timeout=5, headers=cluster.admin_headers).json()
        )

    wait_for(first_holds, what="the first controller to take the duty leases")
    for cid in CONTROLLERS[1:]:
        cluster.start_controller(cid, port=free_port())
    cluster.use_all_controllers(read_timeout=CLIENT_TIMEOUT)
    urls = cluster.controller_urls()
    for i, n in enumerate(NODES):
        cluster.start_agent(n, cpus=4, mem="4G", gpus=GPUS, url=rotate(urls, i), wait=False)
    cluster.wait_agents(list(NODES))
    return urls


def start_authd(cluster: Cluster) -> Daemon:
    """`phalanx authd` of a login host, login1, with its own derived key."""
    home = cluster.root / "login1"
    home.mkdir(exist_ok=True)
    key = home / "host.jwks"
    keyfiles.save(cluster.keys.for_scope("host", "login1"), key)
    args = ["authd", "--name", "login1", "--key-file", str(key), "--socket", str(home / "a.sock")]
    d = Daemon("authd", "authd", args, cluster.logs / "authd.log", cluster.env()).spawn()
    cluster.daemons["authd"] = d
    wait_for(lambda: (home / "a.sock").exists(), what="authd to serve its socket")
    return d


def authd_socket(d: Daemon) -> Path:
    return Path(d.args[d.args.index("--socket") + 1])


# ---------------------------------------------------------------------- the history
def all_events(c: Client) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    since = 0
    while True:
        batch = c.events(since=since, limit=10_000)
        out += batch
        if len(batch) < 10_000:
            return out
        since = int(batch[-1]["id"])


def collect(
    cluster: Cluster,
    work: Workload,
    sampler: LeaseSampler,
    faults: Sequence[hist.Fault],
    held: Sequence[hist.Holding],
) -> hist.History:
    """The run's history: submissions, the store's jobs (with attempts) and events, the runs
    the jobs recorded, the lease samples, the fault windows and what was left held."""
    c = cluster.client()
    jobs = []
    for j in c.jobs(limit=100_000):
        full = c.job(int(j["id"]))[0]
        attempts = tuple(
            hist.Attempt(
                id=int(a["id"]),
                seq=int(a["seq"]),
                partition=str(a["partition"]),
                fence_term=int(a["fence_term"]),
                created_at=float(a["created_at"]),
            )
            for a in full["attempts"]
        )
        jobs.append(
            hist.Job(int(full["id"]), str(full["name"]), full["state"], full["exit_code"], attempts)
        )
    events = []
    for e in all_events(c):
        data = e.get("data") or {}
        events.append(
            hist.Event(
                id=int(e["id"]),
                ts=float(e["ts"]),
                kind=str(e["kind"]),
                message=str(e.get("message") or ""),
                job_id=int(e["job_id"]) if e.get("job_id") is not None else None,
                controller=e.get("controller"),
                term=int(e["term"]) if e.get("term") is not None else None,
                from_state=data.get("from") if isinstance(data, dict) else None,
                to_state=data.get("to") if isinstance(data, dict) else None,
                node=e.get("node"),
            )
        )
    runs = []
    for p in sorted(work.runs.glob("*.log")):
        runs += hist.parse_runs(int(p.stem), p.read_text(errors="replace"))
    return hist.History(work.subs, jobs, runs, events, sampler.samples, faults, held)


LIVE = ["PENDING", "STARTING", "RUNNING", "COMPLETING"]


def drain(cluster: Cluster, acked: int) -> None:
    """Wait for every job to end. A long soak leaves a backlog (jobs needing a GPU or a licence
    queue behind each other), so the deadline runs from the last time the count of live jobs
    went down, not from the first look: a stuck job fails it, a long queue does not. On failure
    the live jobs are listed by state and reason, the first thing to read."""
    best, since = None, time.monotonic()
    live: list[dict[str, Any]] = []
    while True:
        try:
            live = cluster.client().jobs(state=LIVE, limit=100_000)
        except PhalanxError:
            live = live or [{}]  # no answer: not progress, not done
        else:
            if not live:
                return
            if best is None or len(live) < best:
                best, since = len(live), time.monotonic()
        if time.monotonic() - since > RECOVER:
            break
        time.sleep(0.5)
    why = Counter((j.get("state"), j.get("reason")) for j in live)
    lines = [f"{n} x {state}: {reason}" for (state, reason), n in why.most_common(10)]
    first = [f"job {j.get('id')} {j.get('state')} {j.get('reason')!r}" for j in live[:10]]
    pytest.fail(
        f"{len(live)} of the {acked} acknowledged jobs made no progress towards their end in "
        f"{RECOVER:g}s:\n" + "\n".join([*lines, "first:", *first])
    )


def holdings(c: Client) -> list[hist.Holding]:
    """What is still held: node CPUs and GPUs, licences, restart reservations."""
    out = []
    for n in c.nodes():
        out.append(hist.Holding("cpus", str(n["name"]), float(n.get("cpus_alloc") or 0)))
        out.append(hist.Holding("gpus", str(n["name"]), float(n.get("gpus_alloc") or 0)))
    for lic in c.licenses():
        out.append(hist.Holding(f"licence {lic['name']}", "cluster", float(lic["used"])))
    for j in c.jobs(limit=100_000):
        if j.get("reserved_nodes"):
            nodes = j["reserved_nodes"]
            out.append(hist.Holding(f"restart reservation of {nodes}", f"job {j['id']}", 1))
    return out


def released(c: Client) -> list[hist.Holding] | None:
    """The holdings once nothing is held any more (None while something is)."""
    held = holdings(c)
    return None if any(h.amount for h in held) else held


# ---------------------------------------------------------------------- the run
def chaos_faults(chaos: Chaos) -> dict[str, Callable[..., None]]:
    """The faults this run may inject: all it can make, or those PHX_CHAOS_FAULTS names."""
    faults = chaos.faults()
    raw = os.environ.get("PHX_CHAOS_FAULTS", "").strip()
    if not raw:
        return faults
    want = [w.strip() for w in raw.split(",") if w.strip()]
    unknown = [w for w in want if w not in faults]
    if unknown or not want:
        pytest.fail(
            f"PHX_CHAOS_FAULTS={raw!r}: {unknown or 'nothing'} is not among the faults this "
            f"run can make: {', '.join(sorted(faults))}",
            pytrace=False,
        )
    return {w: faults[w] for w in want}


def schedule(rng: random.Random, kinds: list[str], rounds: int) -> list[str]:
    """Every kind of fault once (in random order) while rounds last, then random ones: a
    default-length run exercises each of them."""
    first = rng.sample(kinds, len(kinds))
    return (first + [rng.choice(kinds) for _ in range(max(0, rounds - len(kinds)))])[:rounds]


# The soak strikes the cluster with up to three faults at once, a round each: a node fault
# (an agent blip, or a silence that lasts until the node is DOWN), a second one on another
# node when the next fault is one (two nodes lost together, as a rack switch or a PDU loses
# them), and the next fault after those when it strikes the control plane. More rounds an
# hour, and node failures judged across each other, controller and database failovers.
NODE_FAULTS = frozenset({"agent-down", "agent-freeze", "partition", "agent-blip"})
SILENCES = frozenset({"agent-down", "agent-freeze", "partition"})  # until the node is DOWN
ALONGSIDE = frozenset({"ctl-kill", "ctl-restart", "ctl-stop", "authd-kill", "pg-failover"})


def group(plan: Sequence[str], r: int) -> list[str]:
    """The faults of round r on that strike at once (outside the soak: plan[r] alone): see
    above. Two partitions cannot (one node sits behind the veth pair)."""
    kinds = [plan[r]]
    if not SOAK or plan[r] not in NODE_FAULTS:
        return kinds
    nxt = r + 1
    if nxt < len(plan) and plan[nxt] in NODE_FAULTS and not plan[r] == plan[nxt] == "partition":
        kinds.append(plan[nxt])
        nxt += 1
    if nxt < len(plan) and plan[nxt] in ALONGSIDE:
        kinds.append(plan[nxt])
    return kinds


def together(*faults: Callable[[], None]) -> None:
    """Run the faults at once (all but the last in threads of their own, the last here); raise
    the first one's error, if any."""
    if len(faults) == 1:
        faults[0]()
        return
    errors: list[BaseException] = []

    def run(fault: Callable[[], None]) -> None:
        try:
            fault()
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(fault,), name=f"chaos-fault-{i}")
        for i, fault in enumerate(faults[:-1])
    ]
    for thread in threads:
        thread.start()
    try:
        faults[-1]()
    finally:
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


def run_chaos(chaos: Chaos, out: Path, seed: int, rounds: int, label: str) -> None:
    cluster = chaos.cluster
    urls = ",".join(chaos.urls)
    chaos.authd = start_authd(cluster)
    sock = authd_socket(chaos.authd)
    work = chaos.work = Workload(
        urls, out, random.Random(seed + 1), cluster.admin_token, authd_socket=sock
    ).start()
    sampler = LeaseSampler(urls, cluster.admin_token).start()
    counts: dict[str, int] = {}
    minutes = os.environ.get("PHX_CHAOS_MINUTES", "").strip()
    budget = float(minutes) * 60 if minutes else None  # stop injecting faults after this
    t0 = time.monotonic()
    try:
        wait_for(
            lambda: (
                len(work.acked()) >= 5 and cluster.client().jobs(state="COMPLETED", limit=1) != []
            ),
            timeout=RECOVER,
            what="the workload to get going",
        )
        faults = chaos_faults(chaos)
        plan = schedule(chaos.rng, sorted(faults), rounds)
        r = 0
        while r < len(plan):
            kinds = group(plan, r)
            for kind in kinds:
                counts[kind] = counts.get(kind, 0) + 1
            nodes = chaos.place(kinds)
            chaos.say(
                f"round {r + 1}/{rounds}: "
                + " + ".join(f"{k} {n}" if n else k for k, n in zip(kinds, nodes, strict=True))
            )
            together(
                *(
                    functools.partial(faults[k], n) if n else faults[k]
                    for k, n in zip(kinds, nodes, strict=True)
                )
            )
            r += len(kinds)
            chaos.healthy()
            # the workload runs on a whole cluster
            time.sleep(chaos.rng.uniform(0.0, 0.3) if SOAK else chaos.rng.uniform(0.5, 2.0))
            if budget is not None and time.monotonic() - t0 > budget:
                chaos.say(f"time budget of {budget:.0f}s spent after {r} rounds")
                rounds = r
                break
    finally:
        work.stop()
        sampler.stop()
    t_faults = time.monotonic() - t0

    acked = work.acked()
    drain(cluster, len(acked))
    c = cluster.client()
    # held resources are released with the attempts that held them; a restart reservation
    # lasts at most restart_reservation after its job's node failed
    held: list[hist.Holding] = []
    with contextlib.suppress(AssertionError):
        wait_for(lambda: released(c), timeout=RECOVER, what="every node's resources to be free")
    held = holdings(c)
    h = collect(cluster, work, sampler, chaos.windows, held)
    violations = hist.check(h)
    s = hist.summarize(h)
    unknown = sum(1 for x in work.subs if x.outcome == "unknown")
    print(
        f"\n{label}: seed {seed} (PHX_CHAOS_SEED={seed} PHX_CHAOS_ROUNDS={rounds} to replay); "
        f"{rounds} rounds {counts} in {t_faults:.0f}s; {len(work.subs)} submissions "
        f"({len(acked)} acknowledged, {unknown} unanswered), {s.jobs} jobs {s.by_state}, "
        f"{s.runs} runs, {s.requeued_jobs} jobs ran more than once, {s.stopped_runs} "
        f"runs stopped before their end, {s.finished_twice} jobs' work finished twice, "
        f"{s.downs} nodes declared DOWN in {len(chaos.windows)} node faults; "
        f"{s.takes} lease takes, {s.term_writes} termed writes, "
        f"{len(h.samples)} lease samples "
        f"({sampler.failures} failed)",
        flush=True,
    )
    if work.errors:
        print(f"submission errors (first 5): {work.errors[:5]}")
    assert not violations, (
        f"seed {seed}: {len(violations)} violations:\n"
        + "\n".join(str(v) for v in violations[:40])
        + "\nfaults:\n"
        + "\n".join(chaos.log)
    )
    assert not work.credential_errors, (
        f"submissions failed for want of a credential: {work.credential_errors[:5]}"
    )
    assert len(acked) >= rounds, f"too few acknowledged submissions: {len(acked)}"
    assert h.samples, "no lease sample was taken"
    wait_for(lambda: not cluster.live_shepherds(), timeout=RECOVER, what="every shepherd to exit")
    left: list[str] = []

    def no_strays() -> bool:
        left[:] = strays(cluster)
        return not left

    with contextlib.suppress(AssertionError):
        wait_for(no_strays, timeout=30, what="no process but the daemons to be left")
    assert not left, f"processes outlived their jobs: {left}"


def strays(cluster: Cluster) -> list[str]:
    """Live processes this cluster started that are neither its daemons nor their direct
    children (an agent's shepherd launcher): a job or shepherd that outlived its attempt, as
    `PID: command line`."""
    daemons = {d.pid for d in cluster.daemons.values() if d.running()}
    out = []
    for pid in marked_processes(cluster.root):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if pid in daemons or ppid in daemons:
            continue
        out.append(f"{pid}: {cmd.strip()}")
    return out


@pytest.mark.timeout(int(os.environ.get("PHX_CHAOS_TIMEOUT", "600")))  # the soak's is longer
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_random_faults_keep_the_history_clean(
    make_cluster: Callable[..., Cluster],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    backend: str,
) -> None:
    seed, rounds = seed_and_rounds(backend)
    print(f"\nchaos ({backend}): seed {seed}, {rounds} rounds", flush=True)
    rng = random.Random(seed)
    out = tmp_path / "out"
    if backend == "sqlite":
        with partition_lab(request, tmp_path) as wired:
            if wired is not None:
                chaos = wired(rng)
            else:
                cluster = make_cluster()
                chaos = Chaos(cluster, start_cluster(cluster), rng)
            run_chaos(chaos, out, seed, rounds, backend)
    else:
        with running(
            PgCluster.start,
            unavailable=PostgresNotAvailable,
            what="PostgreSQL",
            processes="PostgreSQL",
        ) as pg:
            cluster = make_cluster(db=pg.url)
            chaos = Chaos(cluster, start_cluster(cluster), rng, pg=pg)
            run_chaos(chaos, out, seed, rounds, backend)


# ---------------------------------------------------------------------- network namespaces
@contextlib.contextmanager
def partition_lab(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[random.Random], Chaos] | None]:
    """Where namespaces work: yields a function that starts the cluster wired for partitions
    (controllers and node02/03 in one namespace, node01 behind a veth pair), with this thread
    moved into the controllers' namespace; else None (the run goes on without partitions).
    Everything is torn down after, also on failure."""
    reason = netns.missing_tools()
    if reason:
        print(f"no partition faults: {reason}")
        yield None
        return
    netns.sweep_stale_namespaces()
    lab = NetnsLab()
    try:
        ctl_ns = lab.add("ctl")
        n1_ns = lab.add("n1")
        link = lab.link(ctl_ns, n1_ns)
        lab.check_iptables(n1_ns)
    except NetnsError as e:
        left = lab.cleanup()
        print(f"no partition faults: cannot set up network namespaces: {e} {left}")
        yield None
        return
    names = list(lab.namespaces)
    problems: list[str] = []
    try:
        with lab.entered(ctl_ns):
            cluster = NetnsCluster(
                tmp_path / "cluster", host=link.addr_a, ctl_ns=ctl_ns, node_ns={"node01": n1_ns}
            )
            request.node.stash[CLUSTERS].append(cluster)

            def wire(rng: random.Random) -> Chaos:
                urls = start_cluster(cluster)
                return Chaos(cluster, urls, rng, lab=lab, partition_ns=n1_ns, ctl_addr=link.addr_a)

            try:
                yield wire
            finally:
                swept = cluster.cleanup()
                if swept:
                    problems.append(f"cluster cleanup swept up stray processes: {swept}")
    finally:
        problems += lab.cleanup()
    if problems:
        print("chaos netns cleanup: " + "; ".join(problems), file=sys.stderr)
    left = [n for n in names if (netns.NETNS_DIR / n).exists()]
    assert not left, f"could not delete the test's network namespaces {left}: {problems}"
