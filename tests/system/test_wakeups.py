"""Cross-controller wakeups on PostgreSQL: work placed by one controller reaches an agent that
long-polls another at once, through LISTEN/NOTIFY, not at the next poll.

Two controllers share one PostgreSQL store. Controller A holds the scheduling lease of the only
partition (its id is chosen so that the lease spreading prefers it); the only agent talks to
controller B alone, and long-polls it for `heartbeat_interval` (5 s here). Jobs are submitted
through A, one at a time; A's scheduler starts each one, the start bumps the node's work_gen
and NOTIFYs, B's listener wakes the agent's long-poll, and the agent launches the job. "Running"
is measured where it happens: the job's first command writes the time (the RUNNING state in the
store follows with the agent's next report, which may itself wait out a long-poll).

With the listener healthy, B's fallback poll of work_gen runs only every
max(2 s, heartbeat_interval) = 5 s, so without the notification a job would wait on average
2.5 s (up to 5 s) for the poll or the end of the long-poll. The test asserts that every
submit -> running latency stays well under that, and that A started the jobs while the agent
got them from B (the wakeup really crossed controllers).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from phalanx.client import Client
from phalanx.config import Timing
from phalanx.controller.wakeups import GEN_POLL_LISTENING
from phalanx.domain.spread import preferred
from system.harness import Cluster, free_port, wait_for

pytestmark = [pytest.mark.system, pytest.mark.postgres]

TIMING: dict[str, float] = {
    # long-polls last 5 s: only a wakeup can start a job sooner than the poll fallback
    "heartbeat_interval": 5.0,
    "fence_timeout": 16.0,  # > heartbeat_interval * 2 + max(0.5, heartbeat_interval)
    # > fence_timeout + fence_kill_grace + heartbeat_interval + max(0.5, heartbeat_interval)
    "node_down_timeout": 30.0,
}
Timing(**TIMING)  # the set must satisfy phalanx.config's timing rules

SCHED_LEASE = "sched:batch"
JOBS = 5
FALLBACK = max(GEN_POLL_LISTENING, TIMING["heartbeat_interval"])  # B's poll while listening
MAX_LATENCY = 2.0  # each job; the fallback alone would give U(0, 5 s) + the launch itself
MEDIAN_LATENCY = 1.0


def pick_ids() -> tuple[str, str]:
    """Controller ids such that the first is the preferred holder of the scheduling lease."""
    ids = ("ctl-a", "ctl-b")
    return ids if preferred(SCHED_LEASE, ids) == ids[0] else (ids[1], ids[0])


def holders(url: str, headers: dict[str, str]) -> dict[str, str]:
    view = httpx.get(url + "/v1/cluster", timeout=10, headers=headers).json()
    return {
        lease["name"]: str(lease["holder"])
        for lease in view["leases"]
        if lease["valid"] and lease["holder"]
    }


def health(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/healthz", timeout=10).json())


def started_at(path: Path) -> float | None:
    """The time the job wrote when its script began, once it has."""
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


@pytest.mark.timeout(240)
def test_job_submitted_through_a_starts_promptly_on_an_agent_polling_b(
    make_cluster: Callable[..., Cluster], pg_url: str, tmp_path: Path
) -> None:
    cluster = make_cluster(db=pg_url)
    cluster.timing.update(TIMING)
    a_id, b_id = pick_ids()
    a = cluster.start_controller(a_id, port=cluster.port)
    url_a = cluster.controller_url(a)
    wait_for(
        lambda: holders(url_a, cluster.admin_headers).get(SCHED_LEASE) == a_id,
        what=f"{a_id} to take {SCHED_LEASE}",
    )
    b = cluster.start_controller(b_id, port=free_port())
    url_b = cluster.controller_url(b)
    wait_for(lambda: health(url_b)["wakeups"] == "listen", what=f"{b_id} to LISTEN")
    cluster.start_agent("node01", cpus=8, mem="8G", url=url_b)  # the agent knows B only
    client_a = Client(url_a, token=cluster.admin_token)  # submissions go through A
    try:
        assert holders(url_a, cluster.admin_headers).get(SCHED_LEASE) == a_id, (
            "A must schedule, B must not"
        )

        latencies = []
        for i in range(JOBS):
            stamp = tmp_path / f"started-{i}"
            t0 = time.time()
            jid = int(
                client_a.submit(
                    {
                        "script": f"#!/bin/sh\ndate +%s.%N > {stamp}.tmp && mv {stamp}.tmp {stamp}\n"
                        "exec sleep 600\n",
                        "name": f"wake{i}",
                        "submit_dir": str(tmp_path),
                        "output": str(tmp_path / "wake-%j.out"),
                        "time_limit_s": 900,
                        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
                    }
                )["job_id"]
            )
            began = wait_for(
                lambda s=stamp: started_at(s), what=f"job {jid} to start running", interval=0.02
            )
            latencies.append(began - t0)
            events = client_a.job_events(jid)
            starters = {e["controller"] for e in events if e["kind"] == "job.starting"}
            assert starters == {a_id}, f"job {jid} was not started by A: {events}"

        print(f"submit -> running latencies (s): {[round(x, 3) for x in latencies]}")
        assert holders(url_a, cluster.admin_headers).get(SCHED_LEASE) == a_id, (
            "the scheduling lease moved mid-test"
        )
        assert health(url_b)["wakeups"] == "listen"
        assert max(latencies) < MAX_LATENCY < FALLBACK, latencies
        assert statistics.median(latencies) < MEDIAN_LATENCY, latencies
    finally:
        client_a.close()
