"""Node health checks, end to end: real agents with a fake NVML file and site scripts.

A failing check drains the node with a reason naming the check (``drain_by`` is
``health:<check>``) and, on FAIL, gives its requeue-able jobs their checkpoint signal and
requeues them; once the check has passed `passes_to_recover` times in a row the node resumes by
itself. A node whose checks fail before it registers joins drained. An operator's drain is
never lifted by the checks.

The fake NVML (``PHX_FAKE_NVML``) is re-read on every check run; it is always rewritten
atomically (temp file + rename), as its docstring asks.
"""

from __future__ import annotations

import getpass
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from system.harness import Cluster, wait_for

pytestmark = pytest.mark.system

FAST = {
    "heartbeat_interval": 0.5,
    "node_down_timeout": 4.0,
    "fence_timeout": 2.0,
    "fence_kill_grace": 0.5,
    "fence_margin": 0.5,
    "checkpoint_grace": 10.0,
}
INTERVAL = 1  # seconds between health check runs
HEALTHY_GPUS = {"gpus": [{"temperature": 40}, {"temperature": 42}]}


# ---------------------------------------------------------------------- helpers
def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fake_nvml(path: Path, data: dict[str, Any]) -> Path:
    _write_atomic(path, json.dumps(data))
    return path


def _health_config(
    path: Path, *, gpu: bool = False, script: Path | None = None, passes: int = 2
) -> Path:
    lines = [
        "[health]",
        f"interval = {INTERVAL}",
        f"passes_to_recover = {passes}",
        f"gpu = {'true' if gpu else 'false'}",
    ]
    if script is not None:
        lines.append(f'scripts = [{{path = "{script}", timeout = 10}}]')
    path.write_text("\n".join(lines) + "\n")
    return path


def _site_script(path: Path, flag: Path) -> Path:
    """A site health script (NHC style): fails while `flag` exists."""
    path.write_text(
        "#!/bin/sh\n"
        f'if [ -e "{flag}" ]; then\n'
        '  echo "ERROR: scratch full"\n'
        '  echo "more detail on a second line"\n'
        "  exit 1\n"
        "fi\n"
        'echo "scratch ok"\n'
    )
    path.chmod(0o755)
    return path


def _node(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.client().node(name)


def _node_events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return cluster.client().get("/v1/events", node=name, limit=10_000)["events"]


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


def _wait_drained(cluster: Cluster, name: str, what: str) -> dict[str, Any]:
    return wait_for(
        lambda: (n := _node(cluster, name))["drain"] and n, what=f"{name} to be drained ({what})"
    )


def _wait_resumed(cluster: Cluster, name: str) -> dict[str, Any]:
    def resumed() -> dict[str, Any] | None:
        n = _node(cluster, name)
        return None if n["drain"] else n

    node = wait_for(resumed, what=f"{name} to resume by itself")
    assert node is not None
    return node


def _count_in_log(cluster: Cluster, node: str, text: str) -> int:
    try:
        return cluster.agent(node).log.read_text(errors="replace").count(text)
    except OSError:
        return 0


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(180)
def test_gpu_xid_drains_requeues_with_checkpoint_and_recovers(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    config = _health_config(tmp_path / "health.toml", gpu=True, passes=2)
    nvml1 = _fake_nvml(tmp_path / "nvml-node01.json", HEALTHY_GPUS)
    nvml2 = _fake_nvml(tmp_path / "nvml-node02.json", HEALTHY_GPUS)
    extra = ["--health-config", str(config)]
    cluster.start_agent(
        "node01", cpus=4, gpus="a100:2", env={"PHX_FAKE_NVML": str(nvml1)}, extra_args=extra
    )
    marker = tmp_path / "checkpointed"
    jid = cluster.submit_script(
        tmp_path,
        "train",
        "#!/bin/bash\n"
        'if [ "$SLURM_RESTART_COUNT" = 0 ]; then\n'
        f"  trap 'echo \"usr1 $SLURM_RESTART_COUNT $SLURMD_NODENAME\" > {marker}; exit 0' USR1\n"
        '  echo "run 0 on $SLURMD_NODENAME"\n'
        "  while true; do sleep 0.1; done\n"
        "fi\n"
        'echo "run $SLURM_RESTART_COUNT on $SLURMD_NODENAME"\n',
        requeue=True,
        gpus_per_node=1,
    )
    out = tmp_path / f"train-{jid}.out"
    job = cluster.wait_state(jid, "RUNNING")
    assert job["nodelist"] == "node01", job
    wait_for(lambda: "run 0 on node01" in out.read_text(), what="the job's trap to be set")
    # a second GPU node, smaller, so the requeued job fits it best even if node01 were back
    cluster.start_agent(
        "node02", cpus=2, gpus="a100:2", env={"PHX_FAKE_NVML": str(nvml2)}, extra_args=extra
    )
    assert not _node(cluster, "node01")["drain"]

    _fake_nvml(nvml1, {**HEALTHY_GPUS, "xid": [[0, 79]]})
    drained = _wait_drained(cluster, "node01", "XID 79")
    assert drained["drain_by"] == "health:gpu", drained
    reason = drained["drain_reason"]
    assert "gpu" in reason and "XID 79" in reason and "GPU 0" in reason, reason

    # the job got its checkpoint signal, exited 0, and ran again on node02
    done = cluster.wait_terminal([jid])[jid]
    job = cluster.client().job(jid)[0]
    assert done["state"] == "COMPLETED", job
    assert job["restart_count"] == 1, job
    assert [a["nodes"] for a in job["attempts"]] == [["node01"], ["node02"]], job["attempts"]
    assert job["attempts"][0]["exit_code"] == 0, job["attempts"][0]
    assert marker.read_text().split() == ["usr1", "0", "node01"]
    # (bash may also report its `sleep` killed by the signal, which went to the whole group)
    runs = [x for x in out.read_text().splitlines() if x.startswith("run ")]
    assert runs == ["run 0 on node01", "run 1 on node02"], out.read_text()
    assert "job.requeue" in _kinds(cluster.client().job_events(jid))

    # the XID was a one-off event: two passing runs later the node is back by itself
    back = _wait_resumed(cluster, "node01")
    assert back["drain_by"] is None and back["drain_reason"] is None, back
    kinds = _kinds(_node_events(cluster, "node01"))
    assert "node.resume" in kinds[kinds.index("node.drain") :], kinds
    resume = [e for e in _node_events(cluster, "node01") if e["kind"] == "node.resume"][-1]
    assert resume["actor"] == "node01", resume


@pytest.mark.timeout(180)
def test_uncorrectable_ecc_drains_until_the_counter_clears(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    nvml = _fake_nvml(tmp_path / "nvml.json", HEALTHY_GPUS)
    config = _health_config(tmp_path / "health.toml", gpu=True, passes=2)
    cluster.start_agent(
        "node01",
        gpus="a100:2",
        env={"PHX_FAKE_NVML": str(nvml)},
        extra_args=["--health-config", str(config)],
    )
    assert not _node(cluster, "node01")["drain"]

    bad = {"gpus": [{"temperature": 40}, {"temperature": 42, "ecc_uncorrectable": 1}]}
    _fake_nvml(nvml, bad)
    drained = _wait_drained(cluster, "node01", "uncorrectable ECC")
    assert drained["drain_by"] == "health:gpu", drained
    reason = drained["drain_reason"]
    assert "GPU 1" in reason and "uncorrectable ECC" in reason, reason
    assert drained["state"] == "DRAINED", drained

    # the counter persists (unlike an XID event): the node stays drained run after run
    until = time.monotonic() + (2 + 2) * INTERVAL
    while time.monotonic() < until:
        n = _node(cluster, "node01")
        assert n["drain"] and n["drain_reason"] == reason, n
        time.sleep(0.25)

    _fake_nvml(nvml, HEALTHY_GPUS)  # the GPU was reset: the counter is back at 0
    _wait_resumed(cluster, "node01")


@pytest.mark.timeout(180)
def test_failing_site_script_drains_then_resumes(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    flag = tmp_path / "scratch-full"
    script = _site_script(tmp_path / "check.sh", flag)
    passes = 3
    config = _health_config(tmp_path / "health.toml", script=script, passes=passes)
    cluster.start_agent("node01", extra_args=["--health-config", str(config)])
    assert not _node(cluster, "node01")["drain"]

    flag.touch()
    drained = _wait_drained(cluster, "node01", "site script")
    assert drained["drain_by"] == f"health:script:{script}", drained
    assert "ERROR: scratch full" in drained["drain_reason"], drained
    assert "second line" not in drained["drain_reason"], drained

    fixed_at = time.time()
    flag.unlink()
    _wait_resumed(cluster, "node01")
    resume = [e for e in _node_events(cluster, "node01") if e["kind"] == "node.resume"][-1]
    # not before `passes` passing runs, which are at least `INTERVAL` apart
    assert resume["ts"] - fixed_at >= (passes - 1) * INTERVAL - 0.5, (resume, fixed_at)
    assert "health checks pass again" in resume["message"], resume


@pytest.mark.timeout(180)
def test_preflight_failure_joins_drained(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    flag = tmp_path / "scratch-full"
    flag.touch()
    script = _site_script(tmp_path / "check.sh", flag)
    config = _health_config(tmp_path / "health.toml", script=script, passes=2)
    # a job waiting before the node exists: it must not start there while preflight fails
    jid = cluster.submit_script(tmp_path, "waiting", "#!/bin/bash\necho ran on $SLURMD_NODENAME\n")
    cluster.start_agent("node01", extra_args=["--health-config", str(config)])

    n = _node(cluster, "node01")
    assert n["drain"] and n["state"] == "DRAINED", n
    assert n["drain_by"] == f"health:script:{script}", n
    assert "ERROR: scratch full" in n["drain_reason"], n
    kinds = _kinds(_node_events(cluster, "node01"))
    assert kinds[:2] == ["node.register", "node.drain"], kinds
    job = cluster.client().job(jid)[0]
    assert job["state"] == "PENDING" and not job["attempts"], job

    flag.unlink()
    _wait_resumed(cluster, "node01")
    done = cluster.wait_terminal([jid])[jid]
    assert done["state"] == "COMPLETED", cluster.client().job(jid)[0]
    assert (tmp_path / f"waiting-{jid}.out").read_text() == "ran on node01\n"


@pytest.mark.timeout(180)
def test_operator_drain_is_not_lifted_by_passing_checks(cluster: Cluster, tmp_path: Path) -> None:
    cluster.timing.update(FAST)
    cluster.start_controller()
    flag = tmp_path / "scratch-full"
    script = _site_script(tmp_path / "check.sh", flag)
    config = _health_config(tmp_path / "health.toml", script=script, passes=2)
    cluster.start_agent("node01", extra_args=["--health-config", str(config)])
    operator = getpass.getuser()
    why = "maintenance: replace PSU"

    fails = f"health check script:{script}: fail"
    recovers = f"health check script:{script} recovered"

    def recovered(round_: int) -> None:
        """Let the script pass; wait until the agent says the check recovered, and until a
        few heartbeats have carried the "ok" summary to the controller."""
        flag.unlink()
        wait_for(
            lambda: _count_in_log(cluster, "node01", recovers) >= round_,
            what=f"the check to recover (round {round_})",
        )
        at = time.time()
        wait_for(
            lambda: (
                _node(cluster, "node01")["last_heartbeat"] > at + 3 * FAST["heartbeat_interval"]
            ),
            what="heartbeats after the recovery",
        )

    def still_operators() -> None:
        n = _node(cluster, "node01")
        assert n["drain"] and n["drain_by"] == operator and n["drain_reason"] == why, n
        assert n["state"] == "DRAINED", n

    # 1. the checks drain the node, the operator drains it too, then the checks pass
    flag.touch()
    drained = _wait_drained(cluster, "node01", "site script")
    assert drained["drain_by"].startswith("health:"), drained
    cluster.client().drain("node01", why)
    still_operators()
    recovered(1)
    still_operators()

    # 2. drained by the operator: the checks fail and pass again, and the drain stays
    flag.touch()
    wait_for(lambda: _count_in_log(cluster, "node01", fails) >= 2, what="the check to fail again")
    recovered(2)
    still_operators()
    resumes = [e for e in _node_events(cluster, "node01") if e["kind"] == "node.resume"]
    assert not resumes, resumes

    # the operator lifts it
    cluster.client().resume("node01")
    assert not _node(cluster, "node01")["drain"]
