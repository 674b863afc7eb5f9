"""torch's own dynamic rendezvous over the controllers (--rdzv-backend=phalanx), with real
torch and real controllers: two agents' handlers (as two torchruns would make them) form a
round, share its store (the master address, torch's worker-rank exchange, the exit barrier),
and form the next round after the controller they were talking to was SIGKILLed, failing over
to the other one listed in $PHALANX_URL. The state's compare-and-set and the store are the
controllers' (one store for both), so no node of the job hosts anything the others need.

PyTorch is in `.venv-tools` (scripts/ensure-tools.sh): skipped without it, except in CI.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from system.harness import Cluster, free_port, wait_for
from system.test_no_kill import TOOLS_PY, backend_site, tools_or_skip

pytestmark = pytest.mark.system

AGENTS = """\
import json, os, sys, threading, time
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.elastic.utils.store import barrier

out = sys.argv[1]
handlers = [
    get_rendezvous_handler(
        RendezvousParameters(backend="phalanx", endpoint="", run_id="train", min_nodes=2,
                             max_nodes=2, local_addr="127.0.0.1", last_call_timeout=60)
    )
    for _ in range(2)
]


def round_(name):
    got = [None, None]

    def one(i):
        info = handlers[i].next_rendezvous()
        store = info.store
        store.set(f"hello/{info.rank}", f"from {i}")
        peer = store.get(f"hello/{1 - info.rank}").decode()
        barrier(store, info.world_size, key_prefix="bye", barrier_timeout=60)
        got[i] = {"rank": info.rank, "world": info.world_size, "peer": peer,
                  "master": [info.bootstrap_store_info.master_addr,
                             info.bootstrap_store_info.master_port],
                  "backend": handlers[i].get_backend()}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(got, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


round_("r1.json")
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.05)
round_("r2.json")  # as torchrun's agents when their workers failed: the next round
for h in handlers:
    h.shutdown()
"""


@pytest.mark.timeout(300)
def test_the_rendezvous_survives_the_controller_it_used(cluster: Cluster, tmp_path: Path) -> None:
    tools_or_skip()
    pythonpath = backend_site(tmp_path / "site")
    cluster.start_controller("ctl-1")
    cluster.start_controller("ctl-2", port=free_port())
    urls = cluster.use_all_controllers()
    cluster.start_agent("node01", url=urls)
    jid = cluster.submit_script(tmp_path, "holder", "#!/bin/bash\nsleep 600\n")
    cluster.wait_state(jid, "RUNNING")
    script = tmp_path / "agents.py"
    script.write_text(AGENTS)
    out = tmp_path / "out"
    out.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": pythonpath,
        "SLURM_JOB_ID": str(jid),
        "PHALANX_URL": urls,  # ctl-1 first: the one killed
        "PHALANX_TOKEN": cluster.admin_token,  # root, the job's owner
    }
    proc = subprocess.Popen([TOOLS_PY, script, out], env=env)
    try:
        r1 = wait_for(
            lambda: json.loads(p.read_text()) if (p := out / "r1.json").exists() else None,
            what="the first round",
            timeout=120,
        )
        assert sorted(r["rank"] for r in r1) == [0, 1] and {r["world"] for r in r1} == {2}, r1
        assert {r["peer"] for r in r1} == {"from 0", "from 1"}, r1  # the round's store works
        assert {r["backend"] for r in r1} == {"phalanx"}
        assert len({tuple(r["master"]) for r in r1}) == 1, r1  # one master address for both

        cluster.controller.kill(signal.SIGKILL)
        (out / "go").touch()
        r2 = wait_for(
            lambda: json.loads(p.read_text()) if (p := out / "r2.json").exists() else None,
            what="the round after ctl-1's death",
            timeout=120,
        )
        assert sorted(r["rank"] for r in r2) == [0, 1] and {r["world"] for r in r2} == {2}, r2
        assert {r["peer"] for r in r2} == {"from 0", "from 1"}, r2
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
