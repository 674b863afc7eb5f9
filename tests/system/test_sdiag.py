"""sdiag against a real controller: its counters move with what the controller did."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from system.harness import Cluster, base_env

pytestmark = pytest.mark.system


def sdiag(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx.slurm", "sdiag", *args],
        env=base_env(
            cluster.root,
            PHALANX_URL=cluster.url,
            PHALANX_TOKEN_FILE=str(cluster.root / "admin.token"),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )


def figure(text: str, name: str) -> int:
    m = re.search(rf"^\s*{re.escape(name)}:\s+(\d+)$", text, re.M)
    assert m, (name, text)
    return int(m.group(1))


@pytest.mark.timeout(300)
def test_sdiag_counts_what_the_controller_did(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=1, cpus=2)
    before = sdiag(cluster)
    assert before.returncode == 0, before.stderr
    c = cluster.client()
    done = [cluster.submit_script(tmp_path, f"ok{i}", "#!/bin/sh\ntrue\n") for i in range(3)]
    failed = cluster.submit_script(tmp_path, "bad", "#!/bin/sh\nexit 3\n")
    held = c.submit({"script": "#!/bin/sh\ntrue\n", "hold": True})["job_id"]
    c.cancel([held])
    cluster.wait_terminal([*done, failed, held])
    after = sdiag(cluster, "-i")
    assert after.returncode == 0, after.stderr
    text = after.stdout
    assert figure(text, "Jobs submitted") - figure(before.stdout, "Jobs submitted") == 5
    assert figure(text, "Jobs started") - figure(before.stdout, "Jobs started") == 4
    assert figure(text, "Jobs completed") >= 3 and figure(text, "Jobs canceled") >= 1, text
    assert figure(text, "Jobs failed") >= 1, text
    assert figure(text, "Total cycles") >= 1, text
    # the API calls it served, by route: the submissions among them
    assert re.search(r"^\tPOST /v1/jobs\s+count:(\d+)", text, re.M), text
    refused = sdiag(cluster, "--reset")
    assert refused.returncode == 1 and "--reset is not supported" in refused.stderr
