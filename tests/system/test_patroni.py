"""The production store, for real: PostgreSQL managed by Patroni with etcd; its leader's host dies.

docs/patroni.md documents the HA deployment: three controllers whose `--db` is a multi-host URL
(`postgresql://u@H1:P1,H2:P2/phalanx?target_session_attrs=read-write`) over PostgreSQL members
managed by Patroni (etcd as its DCS, `synchronous_mode` on). This test runs exactly that, with
the real programs (tests/patronicluster.py): one etcd (Debian's `etcd-server`,
scripts/ensure-etcd.sh), two Patroni 4 members (PyPI, the `test` extra) each managing a
PostgreSQL 15 server, three controllers and three agents. While a client submits a steady
stream of short jobs (each acknowledged id recorded), and one long job per node runs, the
Patroni leader's host is killed: its postmaster SIGKILLed, then its Patroni (see
`PatroniCluster.kill_host`), and its ports then stay silent, as a dead host's do (no "connection
refused": a connection attempt waits for its timeout). Then:

- Patroni promotes the synchronous standby, once the dead leader's key expires in etcd: within
  `ttl` plus a few loops (PROMOTE_WITHIN after the kill);
- while no member is writable, every controller answers at once, 503 `store_unavailable`,
  naming the read-only standby and the silent host it no longer waits for (store/engine.py's
  HostChooser: without it every request waited libpq's connect timeout for the dead host,
  outlasted the agents' request timeout, and the agents, unable to tell "the database is away"
  from "I am cut off", let their jobs self-fence);
- the controllers follow by themselves (the URL's `target_session_attrs=read-write` skips the
  dead member until the other one is writable; the pool drops connections to the dead one):
  submissions are acknowledged again within FOLLOW_WITHIN of the promotion, and every
  controller is ready again;
- nothing acknowledged is lost: every job id acknowledged before the kill or after the
  promotion is in the store, and ran exactly once (every commit waited for the synchronous
  standby, and only that standby may be promoted);
- no node is declared dead: the store is away for about `ttl` (20 s), far longer than the
  failure-detection settings (node_down_timeout 6 s, fence_timeout 4 s), yet no `node.down`
  event is written, no node is DOWN, the long jobs run on in the same processes with one
  attempt each, and every short job has one attempt. (Controllers judge no node until a full
  node_down_timeout of fresh heartbeats after an outage; agents keep their jobs while every
  controller says it cannot reach the database.)

As root (CI), PostgreSQL (so Patroni, which runs initdb and postgres) must run as the
`postgres` user (`runuser -u postgres`), and Patroni runs with this venv's interpreter, which
lives under /root (mode 700): for the test's duration every directory on the way to the
interpreter gets o+x (search only), and its mode is restored afterwards, even on failure (as
tests/system/test_multiuser.py does, with the same helper). Every process the test started is
stopped and its directories removed in `finally` blocks, even when it fails.

Skipped without PostgreSQL, etcd or Patroni, but failed under CI=true (as tests/conftest.py does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from patronicluster import PatroniCluster, PatroniNotAvailable, PostgresNotAvailable
from system.dbclusters import running
from system.harness import Cluster, read_json, wait_for
from system.test_db_failover import long_spec, running_task
from system.test_ha import TIMING, Stream, check_exactly_once, duties_held, start_ha
from system.test_multiuser import _root_searchable

pytestmark = [pytest.mark.system, pytest.mark.postgres, pytest.mark.soak]  # make soak

# Patroni's timing for the test: its minimums (ttl >= 20, loop_wait >= 1, retry_timeout >= 3)
PATRONI: dict[str, int] = {"ttl": 20, "loop_wait": 1, "retry_timeout": 3}
# From the kill to the standby's promotion: the leader key expires `ttl` after the leader last
# renewed it; the standby notices within a loop and promotes (generous: a busy 2-core CI)
PROMOTE_WITHIN = PATRONI["ttl"] + 25.0
# From the promotion to the first acknowledged submission: a controller's next store access
# reconnects (pre-ping, then libpq tries each host), the client retries every couple of tenths
FOLLOW_WITHIN = 15.0


@pytest.fixture
def patroni() -> Iterator[PatroniCluster]:
    """etcd and two Patroni members (a leader and its synchronous standby), with the
    interpreter's directories searchable by the postgres user meanwhile; every process and
    directory removed after, and the directories' modes restored."""
    with (
        _root_searchable(),
        running(
            lambda: PatroniCluster.start(
                ttl=PATRONI["ttl"],
                loop_wait=PATRONI["loop_wait"],
                retry_timeout=PATRONI["retry_timeout"],
            ),
            unavailable=(PatroniNotAvailable, PostgresNotAvailable),
            what="Patroni's cluster",
            processes="etcd, Patroni or PostgreSQL",
        ) as pc,
    ):
        yield pc


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(300)
def test_patroni_leader_host_dies(
    make_cluster: Callable[..., Cluster], patroni: PatroniCluster, tmp_path: Path
) -> None:
    # the outage must outlast Phalanx's failure detection, or "no node declared dead" is moot
    assert PATRONI["ttl"] > TIMING["node_down_timeout"] + TIMING["heartbeat_interval"]
    assert PATRONI["ttl"] > TIMING["fence_timeout"] + TIMING["fence_kill_grace"]

    leader = patroni.leader()
    assert leader is not None, patroni.roles()
    standby = patroni.wait_sync(leader)
    url = patroni.url()  # libpq's form, as an operator writes it
    assert url.startswith("postgresql://") and "target_session_attrs=read-write" in url

    t_start = time.time()
    cluster = make_cluster(db=url)
    urls = start_ha(cluster)  # three controllers on the multi-host URL, three agents
    ctl_urls = urls.split(",")
    t_ha = time.time()
    names = sorted(n["name"] for n in cluster.client().nodes())
    c = cluster.client()
    wait_for(lambda: duties_held(c.cluster()), what="the duty leases to be taken")

    out = tmp_path / "out"
    out.mkdir()
    go = tmp_path / "go"
    stream = Stream(urls, out, cluster.admin_token).start()
    try:
        wait_for(
            lambda: len(stream.acked) >= 10 and c.jobs(state="COMPLETED", limit=1) != [],
            what="10 acknowledged jobs and one completed",
        )
        t_flow = time.time()
        long_jobs = [
            int(c.submit(long_spec(stream, i, n, go))["job_id"]) for i, n in enumerate(names)
        ]
        tasks = {jid: running_task(cluster, jid) for jid in long_jobs}
        wait_for(
            lambda: all(j["state"] == "RUNNING" for j in cluster.jobs_by_id(long_jobs).values()),
            what="the long jobs to be RUNNING in the store",
        )
        pids = {jid: read_json(d / "job.json")["pid"] for jid, d in tasks.items()}  # type: ignore[index]

        # ---- the leader's host dies: its PostgreSQL, then its Patroni
        t_kill = time.time()
        patroni.kill_host(leader)
        acked_before = [jid for jid, ta in stream.acked if ta <= t_kill]

        # ---- Patroni promotes the synchronous standby once the leader key expires
        wait_for(
            standby.is_primary,
            timeout=PROMOTE_WITHIN,
            interval=0.1,
            what=f"Patroni to promote {standby.name}",
        )
        t_promoted = time.time()
        assert patroni.leader() is standby, patroni.roles()
        # measured, not assumed: the store was away longer than a node may stay silent
        assert t_promoted - t_kill > TIMING["node_down_timeout"], t_promoted - t_kill

        # ---- the controllers follow by themselves
        wait_for(
            lambda: stream.acked_after(t_promoted),
            timeout=FOLLOW_WITHIN,
            interval=0.1,
            what="a submission acknowledged after the promotion",
        )
        t_follow = min(ta for _, ta in stream.acked if ta > t_promoted) - t_promoted
        wait_for(
            lambda: all(ready(u) for u in ctl_urls),
            timeout=FOLLOW_WITHIN,
            interval=0.1,
            what="every controller to be ready after the promotion",
        )
        t_ready = time.time()
        wait_for(
            lambda: len(stream.acked_after(t_promoted)) >= 10,
            what="10 submissions acknowledged after the promotion",
        )
    finally:
        stream.stop()

    # ---- while no member was writable, submissions were refused for the database, saying so
    # (sent well inside the outage: one sent just before the promotion may be served after it)
    during = [(t, e) for t, e in stream.failed if t_kill + 1.0 <= t <= t_promoted - 1.0]
    assert during, "no submission was refused during the outage"
    assert all("database unavailable" in e for _t, e in during), during[:3]
    # ... naming what each member said: the standby is read-only, and the dead leader, silent,
    # timed out (then is left out for a while, so that requests do not wait for it each time)
    dead = f"127.0.0.1:{leader.pg_port}"
    assert any("session is read-only" in e for _t, e in during), during[:3]
    assert any(f"not tried: {dead}" in e for _t, e in during), during[:3]

    # ---- nothing acknowledged before the kill was lost
    in_store = {int(j["id"]) for j in c.jobs(limit=100_000)}
    lost = sorted(set(acked_before) - in_store)
    assert not lost, f"jobs acknowledged before the kill are gone after the failover: {lost}"

    # ---- no node declared dead: the long jobs ran through the outage untouched
    for jid in long_jobs:
        j = c.job(jid)[0]
        assert j["state"] == "RUNNING" and j["restart_count"] == 0, (
            j["state"],
            j["reason"],
            j["restart_count"],
            [(a["id"], a["state"], a.get("reason")) for a in j["attempts"]],
        )
        assert len(j["attempts"]) == 1, j["attempts"]
        assert read_json(tasks[jid] / "exit.json") is None, read_json(tasks[jid] / "exit.json")
        assert cluster.job_pid_alive(tasks[jid]), f"job {jid}'s process {pids[jid]} is gone"
    go.touch()
    t_checks = time.time()
    # every acknowledged job (before and after) is in the store and ran exactly once
    check_exactly_once(cluster, stream, extra_acked=long_jobs)
    # a verdict on stale heartbeats would come within node_down_timeout of the recovery
    # (the judging controller waits that long after an outage): watch past twice that
    while time.time() < t_ready + 2 * TIMING["node_down_timeout"]:  # a duration, not a wait
        nodes = c.nodes()
        assert not any("DOWN" in n["state"] for n in nodes), nodes
        time.sleep(0.3)
    events = c.events(limit=10_000)
    downs = [e for e in events if e["kind"] == "node.down"]
    assert not downs, downs
    assert not any("DOWN" in n["state"] for n in c.nodes()), c.nodes()
    wait_for(lambda: duties_held(c.cluster()), what="the duty leases to be held again")
    wait_for(lambda: not cluster.live_shepherds(), what="every shepherd to exit")

    print(
        f"\nPatroni cluster up in {patroni.startup_s:.1f}s; leader {leader.name} killed; {standby.name} promoted "
        f"{t_promoted - t_kill:.1f}s later (ttl {PATRONI['ttl']}s); first submission "
        f"acknowledged {t_follow:.2f}s after the promotion, every controller ready "
        f"{t_ready - t_promoted:.2f}s after it; {len(stream.acked)} acknowledged "
        f"({len(acked_before)} before the kill, {len(lost)} of them lost), "
        f"{len(downs)} nodes declared DOWN, {len(stream.failed)} refused "
        f"(e.g. {stream.failed[:1]}); Phalanx up in {t_ha - t_start:.1f}s, jobs flowing "
        f"{t_flow - t_ha:.1f}s later, long jobs running {t_kill - t_flow:.1f}s later; "
        f"checks took {time.time() - t_checks:.1f}s"
    )
