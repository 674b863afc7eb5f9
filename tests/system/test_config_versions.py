"""The cluster configuration in the store, versioned: three controllers on one store.

Version 1 is made from the first controller's file. `phalanx config apply FILE` with a new
partition layout (batch on node01-02, a new `big` partition on node03) and new priority
weights makes version 2: all three controllers report it (`/healthz`, their `controllers`
rows, `phalanx_config_version` on /metrics) within a few presence loops; jobs submitted right
after land by the new layout whichever controller holds their partition's scheduling lease,
and every controller computes priorities with the new weights. `phalanx config rollback`
makes version 3 with version 1's document: the old layout is back. A version with a broken
timing rule and one with a partition that no node matches are refused, naming the rule, and
nothing changes (no version, no partition, the same version everywhere). Each change is an
event naming its actor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from system.harness import Cluster, free_port, run_cli, wait_for

pytestmark = pytest.mark.system

CONTROLLERS = ("ctl-1", "ctl-2", "ctl-3")
NODES = ("node01", "node02", "node03")

NEW_LAYOUT = """
# a whole controller file may be given: its process-local sections are left alone
[http]
max_connections = 1000

[[cluster.partitions]]
name = "batch"
default = true
nodes = "node0[12]"

[[cluster.partitions]]
name = "big"
nodes = "node03"
priority = 5

[priority]
weight_age = 0
weight_jobsize = 0
weight_partition = 0
weight_qos = 0
weight_fairshare = 777
"""

BAD_TIMING = """
[timing]
lease_ttl = 1.0
renew_interval = 0.5
"""

NO_NODE = """
[[cluster.partitions]]
name = "batch"
default = true
nodes = "node*"

[[cluster.partitions]]
name = "ghost"
nodes = "nosuch*"
"""


def healthz(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/healthz", timeout=10)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def versions_run(urls: list[str]) -> list[int | None]:
    return [healthz(u).get("config_version") for u in urls]


def metric(url: str, name: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def all_run(cluster: Cluster, urls: list[str], version: int) -> bool:
    if versions_run(urls) != [version] * len(urls):
        return False
    rows = cluster.client().cluster()["controllers"]
    return sorted(r["config_version"] for r in rows) == [version] * len(urls) and all(
        metric(u, "phalanx_config_version") == version for u in urls
    )


def cli(cluster: Cluster, url: str, *args: str) -> Any:
    return run_cli(["config", *args], url=url, root=cluster.root)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_three_controllers_apply_and_roll_back_versions(
    make_cluster: Callable[..., Cluster],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    backend: str,
) -> None:
    db = request.getfixturevalue("pg_url") if backend == "postgres" else None
    cluster = make_cluster(db=db)
    for i, cid in enumerate(CONTROLLERS):
        cluster.start_controller(cid, port=cluster.port if i == 0 else free_port())
    url = cluster.use_all_controllers()
    urls = cluster.controller_urls()
    for n in NODES:
        cluster.start_agent(n, cpus=2, mem="2G", url=url, wait=False)
    cluster.wait_agents(NODES)
    wait_for(lambda: all_run(cluster, urls, 1), what="every controller to run version 1")

    shown = cli(cluster, url, "show")
    assert shown.returncode == 0, shown.stderr
    assert "# cluster configuration version 1: create by ctl-1" in shown.stdout
    assert '[[cluster.partitions]]\nname = "batch"' in shown.stdout
    same = tmp_path / "shown.toml"
    same.write_text(shown.stdout)  # what `show` prints reads back as the same version
    unchanged = cli(cluster, url, "diff", str(same))
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
    assert "no difference from version 1" in unchanged.stdout

    new = tmp_path / "new.toml"
    new.write_text(NEW_LAYOUT)
    diff = cli(cluster, url, "diff", str(new))
    assert diff.returncode == 1, diff.stderr  # a difference, and no refusal
    assert '+name = "big"' in diff.stdout and "+weight_fairshare = 777" in diff.stdout

    applied = cli(cluster, url, "apply", str(new), "--yes", "-m", "big partition")
    assert applied.returncode == 0, applied.stderr
    assert "cluster configuration version 2 applied" in applied.stdout
    assert "[http] is process-local" in applied.stderr
    # the controller that served the apply runs it at once, the others within a presence loop
    wait_for(lambda: all_run(cluster, urls, 2), timeout=30, what="every controller at version 2")
    st = cluster.client().cluster()
    assert {p["name"]: p["nodes"] for p in st["partitions"]} == {
        "batch": "node0[12]",
        "big": "node03",
    }

    # jobs scheduled right after follow the new layout, whoever holds their partition's lease
    spec = {"script": "#!/bin/sh\ntrue\n", "submit_dir": str(tmp_path), "time_limit_s": 60}
    c = cluster.client()
    big = [
        int(c.submit({**spec, "name": f"big{i}", "partition": "big"})["job_id"]) for i in range(2)
    ]
    batch = [int(c.submit({**spec, "name": f"b{i}"})["job_id"]) for i in range(4)]
    held = int(c.submit({**spec, "name": "held", "hold": True})["job_id"])
    done = cluster.wait_terminal([*big, *batch])
    for jid in big:
        assert done[jid]["state"] == "COMPLETED" and done[jid]["nodelist"] == "node03", done[jid]
    for jid in batch:
        assert done[jid]["state"] == "COMPLETED", done[jid]
        assert done[jid]["nodelist"] in ("node01", "node02"), done[jid]
    holders = {le["name"]: le["holder"] for le in cluster.client().cluster()["leases"]}
    assert holders.get("sched:big") in CONTROLLERS and holders.get("sched:batch") in CONTROLLERS
    # every controller computes priorities with the new weights
    for u in urls:
        r = httpx.get(f"{u}/v1/jobs/{held}/priority", headers=cluster.admin_headers, timeout=10)
        assert r.status_code == 200, r.text
        w = r.json()["jobs"][0]["weights"]
        assert (w["fairshare"], w["age"], w["jobsize"]) == (777, 0, 0), (u, w)

    # refused versions: the rule named, nothing changed
    for text, rule in (
        (BAD_TIMING, "renew_interval * 3 <= lease_ttl"),
        (NO_NODE, "partition ghost: no node of the cluster matches"),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        refused = cli(cluster, url, "apply", str(bad), "--yes")
        assert refused.returncode == 1, refused.stdout
        assert rule in refused.stderr, refused.stderr
        r = httpx.post(
            urls[1] + "/v1/config/apply",
            json={"text": text},
            headers=cluster.admin_headers,
            timeout=30,
        )
        assert r.status_code == 422 and rule in r.text, r.text
    history = cli(cluster, url, "history", "--json")
    assert [v["version"] for v in json.loads(history.stdout)["versions"]] == [2, 1]
    assert versions_run(urls) == [2, 2, 2]
    assert sorted(p["name"] for p in cluster.client().cluster()["partitions"]) == ["batch", "big"]

    # a rollback restores the old layout as version 3
    back = cli(cluster, url, "rollback", "--yes")
    assert back.returncode == 0, back.stderr
    assert "cluster configuration version 3 restores version 1" in back.stdout
    wait_for(lambda: all_run(cluster, urls, 3), timeout=30, what="every controller at version 3")
    st = cluster.client().cluster()
    assert {p["name"]: p["nodes"] for p in st["partitions"]} == {"batch": "*"}
    c.cancel([held])
    again = int(c.submit({**spec, "name": "again"})["job_id"])
    assert cluster.wait_terminal([again])[again]["state"] == "COMPLETED"
    with pytest.raises(Exception, match="big"):
        c.submit({**spec, "name": "nobig", "partition": "big"})

    kinds = [(e["kind"], e.get("actor")) for e in c.events(limit=1000)]
    assert ("config.create", "ctl-1") in kinds
    assert ("config.apply", "root") in kinds
    assert ("config.rollback", "root") in kinds
    running = [e for e in c.events(limit=1000) if e["kind"] == "config.running"]
    assert len(running) >= 2 * len(CONTROLLERS)  # each controller, each of versions 2 and 3
