"""Controller high availability: three controllers on one store, the lease holder fails.

Three controllers share one database (PostgreSQL, and the SIGKILL case also on one SQLite file);
three agents (each listing a different controller first) and every client are given all three
URLs. A steady stream of short jobs is submitted, through a client that talks to the victim
first, while the controller holding the scheduling lease (`sched`, or `sched:<partition>` once
leases are spread over controllers; with it, whatever else it holds, `cluster` included) is

- SIGKILLed: other controllers take every lease it held, each with a higher term (a lease.take
  event each), the client keeps submitting (through failover), and every acknowledged job runs
  exactly once;
- SIGSTOPped for longer than lease_ttl, with a job running on every node, then SIGCONTinued once
  others hold its leases: the resumed controller logs that it lost them (or took one back under
  a newer term), claims no stale term, and never schedules under one (every attempt was
  created before the next term of its scheduling lease was taken).

"Exactly once" is checked three ways per job: one attempt in the store, its output file holds
one line `JOBID ATTEMPT`, and a shared append-only log (one line per process start) has one
line for it. Jobs whose submission got no answer (the request may or may not have been applied)
must also have run at most once, and the store may hold at most one job per submission tried.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from phalanx.client import Client
from phalanx.config import Timing
from system.harness import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    Cluster,
    free_port,
    run_cli,
    wait_for,
)

pytestmark = pytest.mark.system

TIMING: dict[str, float] = {
    "lease_ttl": 3.0,
    "renew_interval": 0.5,
    "heartbeat_interval": 0.5,
    "node_down_timeout": 6.0,
    # 2.5 s would pass the config rules, but an agent whose controller freezes fails over only
    # after its heartbeat times out (heartbeat_interval + 2 s) plus the next long-poll: up to
    # 3 s without a reply, so its jobs would self-fence (and end FAILED). See the HA report.
    "fence_timeout": 4.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 1.0,
}
Timing(**TIMING)  # the set must satisfy phalanx.config's timing rules

CONTROLLERS = ("ctl-1", "ctl-2", "ctl-3")
NODES = 3
SUBMIT_EVERY = 0.2  # seconds between submissions of the stream
TAKE_RE = re.compile(r"^(\S+) took lease (\S+) term (\d+)$")


# ---------------------------------------------------------------------- helpers
def start_ha(cluster: Cluster) -> str:
    """Three controllers on the cluster's store (ctl-1 first, so it takes the leases), three
    agents given every URL; return the comma list of URLs (in CONTROLLERS order)."""
    cluster.timing.update(TIMING)
    for i, cid in enumerate(CONTROLLERS):
        cluster.start_controller(cid, port=cluster.port if i == 0 else free_port())
        if i == 0:
            url0 = cluster.controller_url(cluster.daemons[cid])
            wait_for(
                lambda u=url0: duties_held(
                    httpx.get(u + "/v1/cluster", timeout=5, headers=cluster.admin_headers).json()
                ),
                what="the first controller to take the duty leases",
            )
    urls = cluster.use_all_controllers()
    names = cluster.node_names(NODES)
    for i, n in enumerate(names):
        # each agent lists a different controller first, so every controller serves one
        cluster.start_agent(n, cpus=2, mem="4G", url=first(urls, i), wait=False)
    cluster.wait_agents(names)
    return urls


def first(urls: str, i: int) -> str:
    """The comma list `urls` rotated to start with its i-th URL (clients stick to the
    controller that answered last, starting with the first)."""
    parts = urls.split(",")
    return ",".join(parts[i:] + parts[:i])


def is_sched(lease: str) -> bool:
    """The scheduling lease: `sched`, or one per partition (`sched:<partition>`)."""
    return lease == "sched" or lease.startswith("sched:")


def held(view: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Validly held leases of a GET /v1/cluster view: name -> (holder, term)."""
    return {
        lease["name"]: (str(lease["holder"]), int(lease["term"]))
        for lease in view["leases"]
        if lease["valid"] and lease["holder"]
    }


def duties_held(view: dict[str, Any]) -> dict[str, tuple[str, int]] | None:
    """The held leases if `cluster` and a scheduling lease both have a holder, else None."""
    h = held(view)
    return h if "cluster" in h and any(is_sched(n) for n in h) else None


def victim_of(h: dict[str, tuple[str, int]]) -> tuple[str, dict[str, int]]:
    """The holder of the (first) scheduling lease, and every lease it holds with its term.

    Leases may be spread over controllers: then the victim may not hold `cluster`."""
    victim = h[min(n for n in h if is_sched(n))][0]
    return victim, {n: term for n, (who, term) in h.items() if who == victim}


def taken_over(client: Client, victim: str, before: dict[str, int]) -> Callable[[], Any]:
    """A wait condition: every lease the victim held is held by another controller (with a
    higher term: a takeover bumps it); returns {lease: (holder, term)} for those leases."""

    def check() -> dict[str, tuple[str, int]] | None:
        h = held(client.cluster())
        now = {n: h.get(n) for n in before}
        if any(v is None or v[0] == victim for v in now.values()):
            return None
        low = {n: v for n, v in now.items() if v is not None and v[1] <= before[n]}
        assert not low, f"leases held by others without a higher term: {low} vs {before}"
        return {n: v for n, v in now.items() if v is not None}

    return check


def all_events(client: Client) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    since = 0
    while True:
        batch = client.events(since=since, limit=10_000)
        out += batch
        if len(batch) < 10_000:
            return out
        since = int(batch[-1]["id"])


def lease_takes(events: list[dict[str, Any]]) -> list[tuple[str, str, int, float]]:
    """(controller, lease, term, ts) of every `lease.take` event, in order."""
    out = []
    for e in events:
        if e["kind"] != "lease.take":
            continue
        m = TAKE_RE.match(e.get("message") or "")
        assert m, f"unexpected lease.take message: {e}"
        out.append((m[1], m[2], int(m[3]), float(e["ts"])))
    return out


@dataclass
class Stream:
    """Submits one short job every `every` seconds from a thread, through one Client."""

    urls: str
    out: Path
    token: str  # the cluster's admin credential
    every: float = SUBMIT_EVERY
    read_timeout: float = 5.0
    acked: list[tuple[int, float]] = field(default_factory=list)  # (job id, time acknowledged)
    failed: list[tuple[float, str]] = field(default_factory=list)  # (time sent, error)
    tried: int = 0

    def __post_init__(self) -> None:
        self.runs = self.out / "runs.log"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="submitter", daemon=True)

    def spec(self, i: int, *, sleep: float | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "script": (
                "#!/bin/sh\n"
                'echo "$PHX_JOB_ID $PHX_ATTEMPT_ID"\n'
                f'echo "$PHX_JOB_ID $PHX_ATTEMPT_ID" >> {self.runs}\n'
                f"sleep {sleep if sleep is not None else 0.5 + (i % 5) / 10:g}\n"
            ),
            "name": f"ha{i}",
            "submit_dir": str(self.out),
            "output": str(self.out / "%j.out"),
            "time_limit_s": 120,
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
            **extra,
        }

    def start(self) -> Stream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.read_timeout + 10)
        assert not self._thread.is_alive(), "the submitter thread is stuck"

    def _run(self) -> None:
        with Client(
            self.urls, token=self.token, timeout=httpx.Timeout(self.read_timeout, connect=2.0)
        ) as c:
            while not self._stop.is_set():
                t = time.time()
                self.tried += 1
                try:
                    self.acked.append((int(c.submit(self.spec(self.tried))["job_id"]), time.time()))
                except Exception as e:
                    self.failed.append((t, f"{type(e).__name__}: {e}"))
                self._stop.wait(max(0.0, self.every - (time.time() - t)))

    def acked_after(self, t: float) -> list[int]:
        return [jid for jid, ta in self.acked if ta > t]

    def ids(self) -> list[int]:
        return [jid for jid, _ in self.acked]


def check_exactly_once(cluster: Cluster, stream: Stream, extra_acked: list[int] = ()) -> None:
    """Every acknowledged job COMPLETED once; nothing ran twice; nothing is left active."""
    c = cluster.client()
    acked = stream.ids() + list(extra_acked)
    assert len(set(acked)) == len(acked), "one job id acknowledged twice"
    everything = [int(j["id"]) for j in c.jobs(limit=100_000)]
    assert set(acked) <= set(everything), f"acknowledged jobs lost: {set(acked) - set(everything)}"
    assert len(everything) <= len(acked) + len(stream.failed), (
        f"more jobs ({len(everything)}) than submissions tried "
        f"({len(acked)} acknowledged + {len(stream.failed)} unanswered)"
    )

    not_ended: dict[int, Any] = {}

    def ended() -> dict[int, dict[str, Any]] | None:
        # not cluster.wait_terminal: that one fails as soon as any controller is down
        jobs = cluster.jobs_by_id(everything)
        not_ended.clear()
        not_ended.update(
            {
                i: {k: j.get(k) for k in ("state", "reason", "nodelist")}
                for i, j in jobs.items()
                if j["state"] not in TERMINAL_STATES
            }
        )
        not_ended.update({i: "missing from the list" for i in set(everything) - set(jobs)})
        return None if not_ended else jobs

    try:
        jobs = wait_for(ended, timeout=90, interval=0.25, what=f"{len(everything)} jobs to end")
    except AssertionError as e:
        raise AssertionError(f"{e}; not ended: {not_ended}") from None
    runs: dict[int, list[str]] = {}
    for line in stream.runs.read_text().splitlines():
        runs.setdefault(int(line.split()[0]), []).append(line)
    problems = {}
    for jid in everything:
        job = c.job(jid)[0]
        atts = job["attempts"]
        out = stream.out / f"{jid}.out"
        lines = out.read_text().splitlines() if out.exists() else None
        want = [f"{jid} {atts[0]['id']}"] if len(atts) == 1 else None
        ok = (
            job["state"] == "COMPLETED"
            and job["exit_code"] == 0
            and job["restart_count"] == 0
            and len(atts) == 1
            and lines == want
            and runs.get(jid) == want
        )
        if not ok:
            problems[jid] = {
                "acked": jid in acked,
                "state": job["state"],
                "reason": job["reason"],
                "restarts": job["restart_count"],
                "attempts": [(a["id"], a["state"], a["fence_term"]) for a in atts],
                "output": lines,
                "runs": runs.get(jid),
            }
    assert not problems, f"jobs that did not run exactly once: {problems}"
    assert not c.jobs(state=list(ACTIVE_STATES)), "jobs left active"
    assert all(n["cpus_alloc"] == 0 for n in c.nodes()), "resources left allocated"
    assert set(runs) <= set(everything), f"processes of unknown jobs: {set(runs) - set(jobs)}"


def check_fence_terms(cluster: Cluster, job_ids: list[int]) -> dict[tuple[str, int], int]:
    """No attempt was created under a scheduling term after the next term was taken.

    `start_attempts` stamps created_at before its transaction checks the fence, and the
    `lease.take` event is written after the take committed, so an attempt created under term T
    with created_at later than the take event of T+1 was committed under a stale term.
    Returns the number of attempts per (lease, term).
    """
    c = cluster.client()
    first_take: dict[str, dict[int, float]] = {}
    for _cid, lease, term, ts in lease_takes(all_events(c)):
        if is_sched(lease):
            first_take.setdefault(lease, {}).setdefault(term, ts)
    per_term: dict[tuple[str, int], int] = {}
    stale = []
    for jid in job_ids:
        for a in c.job(jid)[0]["attempts"]:
            lease = f"sched:{a['partition']}"
            lease = lease if lease in first_take else "sched"
            takes = first_take.get(lease, {})
            term = int(a["fence_term"])
            per_term[(lease, term)] = per_term.get((lease, term), 0) + 1
            assert term in takes, f"attempt {a['id']}: {lease} term {term} was never taken"
            nxt = min((t for t in takes if t > term), default=None)
            if nxt is not None and a["created_at"] >= takes[nxt]:
                stale.append((jid, a["id"], lease, term, a["created_at"], nxt, takes[nxt]))
    assert not stale, f"attempts created under a stale scheduling term: {stale}"
    return per_term


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sigkill_lease_holder(
    make_cluster: Callable[..., Cluster],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    backend: str,
) -> None:
    db = request.getfixturevalue("pg_url") if backend == "postgres" else None
    cluster = make_cluster(db=db)
    urls = start_ha(cluster)
    c = cluster.client()
    out = tmp_path / "out"
    out.mkdir()

    # the stream's client talks to the scheduling lease holder first, so it has to fail over
    old, _ = victim_of(wait_for(lambda: duties_held(c.cluster()), what="leases"))
    stream = Stream(first(urls, CONTROLLERS.index(old)), out, cluster.admin_token).start()
    try:
        # a steady state first: jobs acknowledged, some already done
        wait_for(
            lambda: len(stream.acked) >= 15 and c.jobs(state="COMPLETED", limit=1) != [],
            what="15 acknowledged jobs and one completed",
        )
        old, before = victim_of(wait_for(lambda: duties_held(c.cluster()), what="leases"))
        t_kill = time.time()
        cluster.daemons[old].kill(signal.SIGKILL)
        got = wait_for(
            taken_over(c, old, before),
            timeout=30,
            interval=0.05,
            what=f"other controllers to take the leases of {old} ({before})",
        )
        t_took = time.time() - t_kill
        wait_for(
            lambda: len(stream.acked_after(t_kill)) >= 20,
            timeout=60,
            what="20 submissions acknowledged after the kill",
        )
    finally:
        stream.stop()
    after = stream.acked_after(t_kill)
    first_ok = min(ta for _, ta in stream.acked if ta > t_kill) - t_kill
    print(
        f"\n{backend}: killed {old} holding {before}; taken over as {got} {t_took:.2f}s later; "
        f"first submit acknowledged {first_ok:.2f}s after the kill; {len(stream.acked)} "
        f"acknowledged ({len(after)} after the kill), {len(stream.failed)} unanswered: "
        f"{stream.failed[:3]}"
    )
    assert t_took < TIMING["lease_ttl"] + 10, f"takeover took {t_took:.1f}s"

    check_exactly_once(cluster, stream)
    per_term = check_fence_terms(cluster, stream.ids())
    sched = min(n for n in before if is_sched(n))
    later = {k: v for k, v in per_term.items() if k[0] == sched and k[1] > before[sched]}
    assert later, f"nothing scheduled under a {sched} term after {old}'s: {per_term}"

    takes = {(cid, lease, term) for cid, lease, term, _ in lease_takes(all_events(c))}
    missing = {n: v for n, v in got.items() if (v[0], n, v[1]) not in takes}
    assert not missing, f"no lease.take event for the takeovers {missing}: {sorted(takes)}"
    wait_for(lambda: not cluster.live_shepherds(), what="every shepherd to exit")


@pytest.mark.timeout(180)
@pytest.mark.postgres
def test_sigstop_lease_holder_steps_down(
    make_cluster: Callable[..., Cluster], pg_url: str, tmp_path: Path
) -> None:
    cluster = make_cluster(db=pg_url)
    urls = start_ha(cluster)
    c = cluster.client()
    out = tmp_path / "out"
    out.mkdir()

    old, _ = victim_of(wait_for(lambda: duties_held(c.cluster()), what="leases"))
    stream = Stream(
        first(urls, CONTROLLERS.index(old)), out, cluster.admin_token, read_timeout=3.0
    ).start()
    extra: list[int] = []
    stopped = False
    old_d = None
    try:
        wait_for(
            lambda: len(stream.acked) >= 15 and c.jobs(state="COMPLETED", limit=1) != [],
            what="15 acknowledged jobs and one completed",
        )
        # one longer job per node, running across the whole freeze: agents talking to the
        # frozen controller must fail over before their jobs' fence goes stale
        long_jobs = [
            int(c.submit(stream.spec(900 + i, sleep=12, nodelist=[n]))["job_id"])
            for i, n in enumerate(cluster.node_names(NODES))
        ]
        extra += long_jobs
        wait_for(
            lambda: all(j["state"] == "RUNNING" for j in cluster.jobs_by_id(long_jobs).values()),
            what="the long jobs to run",
        )
        old, before = victim_of(wait_for(lambda: duties_held(c.cluster()), what="leases"))
        old_d = cluster.daemons[old]
        others = ",".join(
            cluster.controller_url(d)
            for cid, d in cluster.daemons.items()
            if d.kind == "controller" and cid != old
        )
        t_stop = time.time()
        os.kill(old_d.pid, signal.SIGSTOP)
        stopped = True
        with Client(
            others, token=cluster.admin_token, timeout=httpx.Timeout(10.0, connect=2.0)
        ) as other:
            got = wait_for(
                taken_over(other, old, before),
                timeout=40,
                interval=0.1,
                what=f"other controllers to take the leases of {old} ({before})",
            )
            # pending work in the store when the old holder wakes up
            extra += [
                int(j["job_id"])
                for j in other.submit_batch([stream.spec(1000 + i) for i in range(12)])
            ]
        time.sleep(1.0)
        log_at = old_d.log.stat().st_size
        t_cont = time.time()
        os.kill(old_d.pid, signal.SIGCONT)
        stopped = False

        def stepped_down() -> str | None:
            """It says it lost its leases (or was fenced), or that it took one again under a
            term newer than the takeover's (a proper re-take: it is preferred again)."""
            text = old_d.log.read_bytes()[log_at:].decode(errors="replace")
            hits = []
            for ln in text.splitlines():
                m = re.search(r"took lease (\S+) term (\d+)", ln)
                retake = m is not None and int(m[2]) > got.get(m[1], ("", 1 << 62))[1]
                if "lost lease" in ln or "fenced" in ln or retake:
                    hits.append(ln)
            return "\n".join(hits) or None

        said = wait_for(
            stepped_down, timeout=30, what=f"{old} to log that it lost (or re-took) its leases"
        )
        time.sleep(3.0)  # let it run a few scheduler and lease ticks after waking
        own = httpx.get(
            cluster.controller_url(old_d) + "/v1/cluster",
            timeout=10,
            headers=cluster.admin_headers,
        ).json()
    finally:
        if stopped and old_d is not None:
            os.kill(old_d.pid, signal.SIGCONT)
        stream.stop()
    take_ts = {(cid, lease, term): ts for cid, lease, term, ts in lease_takes(all_events(c))}
    t_took = max(take_ts[(who, n, term)] for n, (who, term) in got.items()) - t_stop
    print(
        f"\nstopped {old} holding {before}; taken over as {got} {t_took:.2f}s later (lease.take "
        f"events); resumed after {t_cont - t_stop:.2f}s and logged:\n{said}\n"
        f"{len(stream.acked)} acknowledged, {len(stream.failed)} unanswered "
        f"(e.g. {stream.failed[:2]})"
    )
    assert t_took > TIMING["lease_ttl"] - 0.5, f"leases taken {t_took:.1f}s after SIGSTOP"
    old_d.check_running()
    # after waking up it holds nothing, or only what it took again under a newer term
    floor = {n: max(before.get(n, -1), got.get(n, ("", -1))[1]) for n in {*before, *got}}
    claims = own["this_controller"]["leases"]
    stale = {n: t for n, t in claims.items() if t <= floor.get(n, -1)}
    assert not stale, f"{old} claims leases under stale terms after waking up: {stale}"
    store_view = held(own)
    stale = {n: v for n, v in store_view.items() if v[0] == old and v[1] <= floor.get(n, -1)}
    assert not stale, f"the store shows {old} holding stale terms: {stale}"

    check_exactly_once(cluster, stream, extra_acked=extra)
    check_fence_terms(cluster, stream.ids() + extra)

    # every controller is listed, and all three are alive again (last_seen fresh)
    cli = run_cli(["cluster", "--json"], url=urls, root=cluster.root)
    assert cli.returncode == 0, cli.stderr
    view = json.loads(cli.stdout)
    ctls = {x["id"]: x for x in view["controllers"]}
    assert set(ctls) == set(CONTROLLERS), ctls
    assert all(x["last_seen"] for x in ctls.values()), ctls
    wait_for(
        lambda: all(
            time.time() - x["last_seen"] < 12 for x in cluster.client().cluster()["controllers"]
        ),
        timeout=30,
        what="every controller's last_seen to be fresh",
    )
    wait_for(lambda: not cluster.live_shepherds(), what="every shepherd to exit")
