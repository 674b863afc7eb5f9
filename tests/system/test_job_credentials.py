"""A job talks to the cluster as its own user, with no setup: its agent's credential socket and
the controllers' URLs are in its environment, so `phalanx` inside a job (the self-requeue
habit of Slurm scripts) is authenticated as the job's user by the node it runs on."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.auth import localsock
from system.harness import Cluster, base_env, phalanx_cmd, wait_for

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
    assert me == {"user": "root", "role": "admin", "kind": "local", "uid": 0, "cluster": "phalanx"}


@pytest.mark.timeout(180)
def test_commands_wait_for_a_restarting_credential_service(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The agent that serves a host's credentials is killed and comes back: a command run
    in between waits for it (and says so) instead of failing at once."""
    cluster.start(nodes=1, cpus=2)
    sock = cluster.agent_socket("node01")
    agent = cluster.agent("node01")
    agent.kill()
    wait_for(lambda: not localsock.in_use(sock), what="the credential socket to go quiet")
    env = base_env(
        cluster.root, PHALANX_URL=cluster.url, PHALANX_AUTH_SOCKET=str(sock), PHALANX_AUTH_WAIT="60"
    )
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        call = subprocess.Popen(
            phalanx_cmd("whoami", "--json"), env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        wait_for(
            lambda: "waiting up to 60s" in err_file.read_text(),
            what="the command to say it waits for the credential service",
            timeout=60,
        )
        assert call.poll() is None, err_file.read_text()
        cluster.restart(agent)
        out, _ = call.communicate(timeout=90)
    finally:
        if call.poll() is None:
            call.kill()
            call.wait()
    assert call.returncode == 0, err_file.read_text()
    assert json.loads(out)["kind"] == "local", out
