"""Topology end to end: agents report their place (`phalanx agent --topology`), the controller
places a `--spread=rack` job on both racks, keeps two jobs of one `--group` with
`--anti-affinity=rack` on different racks, and packs a 2-node job under one switch
(docs/topology.md)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from phalanx.domain.hostlist import expand_hostlist
from phalanx.errors import PhalanxError
from system.harness import Cluster

pytestmark = pytest.mark.system

RACK = {"node01": "r1", "node02": "r1", "node03": "r2", "node04": "r2"}

# holds its nodes until the test lets it go
JOB = "#!/bin/bash\nwhile [ ! -e {go} ]; do sleep 0.1; done\n"


@pytest.mark.timeout(300)
def test_spread_anti_affinity_and_packing_from_agent_places(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_controller()
    for node, rack in RACK.items():
        where = f"switch=s-{rack},rack={rack}"
        cluster.start_agent(node, cpus=4, wait=False, extra_args=["--topology", where])
    cluster.wait_agents(list(RACK))
    r = httpx.get(f"{cluster.url}/v1/nodes/node03", headers=cluster.admin_headers, timeout=10)
    assert r.json()["topology"] == {"switch": "s-r2", "rack": "r2"}, r.text

    go = tmp_path / "go"
    script = JOB.format(go=go)

    def submit(name: str, **extra: object) -> int:
        return cluster.submit_script(tmp_path, name, script, cpus_per_task=1, **extra)

    spread = submit("spread", nodes=2, spread="rack")
    svc1 = submit("svc1", group="svc", anti_affinity="rack")
    svc2 = submit("svc2", group="svc", anti_affinity="rack")
    running = {j: cluster.wait_state(j, "RUNNING") for j in (spread, svc1, svc2)}

    def nodes_of(job: int) -> list[str]:
        return expand_hostlist(cluster.client().job(job)[0]["nodelist"] or "")

    assert sorted(RACK[n] for n in nodes_of(spread)) == ["r1", "r2"], running[spread]
    (a,), (b,) = nodes_of(svc1), nodes_of(svc2)
    assert RACK[a] != RACK[b], (a, b)

    # a 2-node job with room on every node: packed under one switch (one rack)
    packed = submit("packed", nodes=2)
    cluster.wait_state(packed, "RUNNING")
    assert len({RACK[n] for n in nodes_of(packed)}) == 1, nodes_of(packed)

    # a level the cluster does not have is refused at submit, naming the levels it has
    with pytest.raises(PhalanxError, match=r"--spread=rak: unknown topology level .*rack"):
        submit("typo", nodes=2, spread="rak")

    go.touch()
    done = cluster.wait_terminal([spread, svc1, svc2, packed])
    assert all(j["state"] == "COMPLETED" for j in done.values()), done
