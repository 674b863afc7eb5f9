"""A job talks to the cluster as its own user, with no setup: its agent's credential socket and
the controllers' URLs are in its environment, so `phalanx` inside a job (the self-requeue
habit of Slurm scripts) is authenticated as the job's user by the node it runs on."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from system.harness import Cluster

pytestmark = pytest.mark.system


@pytest.mark.timeout(180)
def test_a_job_calls_the_api_as_its_user(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=1, cpus=2)
    out = tmp_path / "whoami.json"
    script = (
        "#!/bin/sh\n"
        'echo "socket=$PHALANX_AUTH_SOCKET url=$PHALANX_URL" >&2\n'
        f"{shlex.quote(sys.executable)} -m phalanx whoami --json > {shlex.quote(str(out))}\n"
    )
    jid = cluster.submit_script(tmp_path, "whoami", script)
    job = cluster.wait_terminal([jid])[jid]
    err = (tmp_path / f"whoami-{jid}.out").read_text()
    assert job["state"] == "COMPLETED", err
    assert f"socket={cluster.agent_socket('node01')}" in err
    assert f"url={cluster.url}" in err
    me = json.loads(out.read_text())
    # the job runs as root here (the test's user): a local credential, root is admin
    assert me == {"user": "root", "role": "admin", "kind": "local", "uid": 0}
