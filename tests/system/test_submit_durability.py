"""An acknowledged submission survives a SIGKILL of the controller (SQLite store).

Submissions commit to SQLite's WAL (`synchronous=NORMAL`) and the WAL is copied into the
database file later, by the store's checkpoint thread: the newest jobs are only in the WAL when
the controller is killed. A 201 must still mean the job exists after a restart, with its
`job.submit` event (docs/architecture.md, "Store").
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from system.harness import Cluster

pytestmark = pytest.mark.system

N_JOBS = 300


@pytest.mark.timeout(240)
def test_acknowledged_submissions_survive_sigkill(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=1, cpus=2)
    c = cluster.client()
    spec = {"argv": ["/bin/true"], "hold": True, "name": "durable", "submit_dir": str(tmp_path)}
    ids = [int(c.submit(spec)["job_id"]) for _ in range(N_JOBS)]  # each one answered 201

    ctl = cluster.controller
    ctl.kill(signal.SIGKILL)
    wal = cluster.state_dir / "phalanx.db-wal"
    assert wal.exists() and wal.stat().st_size > 0, "nothing was left in the WAL to recover"

    cluster.restart(ctl)
    jobs = cluster.jobs_by_id(ids)
    missing = sorted(set(ids) - set(jobs))
    assert not missing, f"acknowledged jobs lost with the controller: {missing[:10]}"
    assert {j["state"] for j in jobs.values()} == {"HELD"}
    events = c.events(limit=10_000)
    submitted = {e["job_id"] for e in events if e["kind"] == "job.submit"}
    assert set(ids) <= submitted, "a job lost its job.submit event"
