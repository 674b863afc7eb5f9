"""200 jobs of mixed shapes on a 4-node local cluster: outcomes, outputs and resource invariants."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from system.harness import ACTIVE_STATES, Cluster

pytestmark = pytest.mark.system

ECHO = 'echo "$SLURM_JOB_ID ${SLURM_ARRAY_TASK_ID:--} $PHX_NODE_RANK"\n'
NODE_CPUS = 4
ARRAY_LIMIT = 4


def _spec(out: Path, name: str, body: str, **kw: Any) -> dict[str, Any]:
    return {
        "script": "#!/bin/bash\n" + ECHO + body,
        "name": name,
        "submit_dir": str(out),
        "output": str(out / "%x-%j.out"),
        "time_limit_s": 60,
        "nodes": 1,
        "cpus_per_task": 1,
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
        **kw,
    }


Span = tuple[float, float, int, Any]  # start, end, weight, label


def _max_overlap(spans: list[Span]) -> tuple[int, list[Any]]:
    """Largest total weight of half-open spans [start, end) alive at one instant, and their labels."""
    points = sorted(
        [(s, 1, i) for i, (s, _e, _w, _l) in enumerate(spans)]
        + [(e, 0, i) for i, (_s, e, _w, _l) in enumerate(spans)]
    )
    live: set[int] = set()
    best, at = 0, []
    for _t, kind, i in points:  # at equal times, ends (kind 0) come before starts
        if kind:
            live.add(i)
        else:
            live.discard(i)
        weight = sum(spans[k][2] for k in live)
        if weight > best:
            best, at = weight, [spans[k][3] for k in sorted(live)]
    return best, at


@pytest.mark.timeout(240)
def test_mixed_workload(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(nodes=4, cpus=NODE_CPUS)
    c = cluster.client()
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()

    # expected[id] = (state, exit_code, nodes, array task id or None, output file)
    expected: dict[int, tuple[str, int | None, int, int | None, Path]] = {}

    def expect(res: dict[str, Any], spec: dict[str, Any], state: str, code: int | None) -> None:
        jid = int(res["job_id"])
        expected[jid] = (state, code, spec["nodes"], None, out / f"{spec['name']}-{jid}.out")

    # a dependency chain, submitted one by one (each needs its parent's id)
    chain: list[int] = []
    for i in range(5):
        dep = {"dependency": f"afterok:{chain[-1]}"} if chain else {}
        s = _spec(out, f"chain{i}", "sleep 0.3\n", **dep)
        r = c.submit(s)
        expect(r, s, "COMPLETED", 0)
        chain.append(int(r["job_id"]))

    # the time-limit job, and an array with a concurrency limit, one by one
    s = _spec(out, "overtime", "sleep 60\n", time_limit_s=2)
    r = c.submit(s)
    expect(r, s, "TIMEOUT", None)
    timeout_id = int(r["job_id"])
    arr = _spec(
        out, "arr", "sleep 0.6\n", array=f"0-19%{ARRAY_LIMIT}", output=str(out / "arr-%A_%a.out")
    )
    r = c.submit(arr)
    array_id = int(r["job_id"])
    assert len(r["job_ids"]) == 20
    for jid in r["job_ids"]:
        expected[int(jid)] = ("COMPLETED", 0, 1, -1, out)  # file name fixed below

    # multi-node jobs, failing jobs and single-node jobs of every width, in batches and singly
    specs: list[tuple[dict[str, Any], str, int | None]] = []
    for i in range(10):
        specs.append(
            (_spec(out, f"two{i}", "sleep 0.2\n", nodes=2, cpus_per_task=1 + i % 2), "COMPLETED", 0)
        )
    for i in range(5):
        specs.append((_spec(out, f"four{i}", "", nodes=4, cpus_per_task=1 + i % 3), "COMPLETED", 0))
    for i in range(10):
        specs.append((_spec(out, f"fail{i}", "exit 3\n", cpus_per_task=1 + i % 4), "FAILED", 3))
    n_single = 200 - len(expected) - len(specs)
    for i in range(n_single):
        body = "sleep 0.2\n" if i % 10 == 0 else ""
        specs.append((_spec(out, f"one{i}", body, cpus_per_task=1 + i % NODE_CPUS), "COMPLETED", 0))
    # interleave the kinds so that big and small jobs compete
    specs = specs[::3] + specs[1::3] + specs[2::3]
    pos = 0
    for k, size in enumerate([40, 1, 1, 30, 1, 50, 1, 1, 1000]):
        chunk = specs[pos : pos + size]
        pos += size
        if not chunk:
            break
        if size == 1 or k % 4 == 1:
            results = [c.submit(s) for s, _st, _code in chunk]
        else:
            results = c.submit_batch([s for s, _st, _code in chunk])
        for res, (s, st, code) in zip(results, chunk, strict=True):
            expect(res, s, st, code)
    assert len(expected) == 200

    jobs = cluster.wait_terminal(list(expected), timeout=150)
    elapsed = time.monotonic() - t0

    # outcomes
    wrong = {
        jid: (j["state"], j["exit_code"], j["reason"])
        for jid, j in jobs.items()
        if j["state"] != expected[jid][0]
        or (expected[jid][1] is not None and j["exit_code"] != expected[jid][1])
    }
    assert not wrong, f"jobs in the wrong terminal state: {wrong}"

    # attempts (one each: nothing was requeued) and outputs
    details: dict[int, dict[str, Any]] = {}
    for jid in expected:
        if jid not in details:
            for j in c.job(jid):
                details[int(j["id"])] = j
    for j in c.job(array_id):
        details[int(j["id"])] = j
    bad_output = {}
    for jid, (state, _code, _nodes, arr_task, path) in expected.items():
        j = details[jid]
        assert len(j["attempts"]) == 1, f"job {jid} has {len(j['attempts'])} attempts"
        assert j["restart_count"] == 0
        if arr_task is not None:
            assert j["array_job_id"] == array_id
            path = out / f"arr-{array_id}_{j['array_task_id']}.out"
            want = [f"{jid} {j['array_task_id']} 0"]
        else:
            # Slurm's batch step: the script runs once, on the first node, however many
            # nodes the job holds (srun starts work on the others)
            want = [f"{jid} - 0"]
        try:
            got = sorted(path.read_text().splitlines())
        except FileNotFoundError:
            got = None
        if got != want:
            bad_output[jid] = (state, str(path), got, want)
    assert not bad_output, f"unexpected output: {dict(list(bad_output.items())[:5])}"

    timed_out = details[timeout_id]
    assert timed_out["attempts"][0]["tasks"][0]["detail"]["timed_out"] is True
    assert timed_out["end_time"] - timed_out["start_time"] < 30

    # every job that ran has times
    for jid, j in details.items():
        assert j["start_time"] is not None and j["end_time"] is not None, (jid, j["state"])
        assert j["start_time"] <= j["end_time"]

    # the array limit held (attempt start to end covers the tasks' processes), and was used
    spans: list[Span] = [
        (a["start_time"], a["end_time"], 1, j["job_id"])
        for j in details.values()
        if j["array_job_id"] == array_id
        for a in j["attempts"]
    ]
    assert len(spans) == 20
    peak, at = _max_overlap(spans)
    assert peak <= ARRAY_LIMIT, f"{peak} array tasks ran at once (limit {ARRAY_LIMIT}): {at}"
    assert peak >= 2, "the array never ran two tasks at once: the limit test proves nothing"

    # the dependency chain ran in order
    for parent, child in itertools.pairwise(chain):
        p, ch = details[parent], details[child]
        assert ch["attempts"][0]["start_time"] >= p["end_time"], (parent, child)
        assert ch["start_time"] >= p["end_time"]

    # no node ever ran more CPUs than it has (tasks' own process start/end times)
    per_node: dict[str, list[Span]] = defaultdict(list)
    for j in details.values():
        for a in j["attempts"]:
            for t in a["tasks"]:
                if t["rank"] > 0 and (t.get("detail") or {}).get("never_started"):
                    # a holder whose job's batch step was over before it was launched: it
                    # never ran (it held the node's CPUs from the allocation, which the
                    # batch step's own span covers)
                    assert t["ended_at"] is not None, (j["id"], t)
                    continue
                assert t["started_at"] is not None and t["ended_at"] is not None, (j["id"], t)
                label = (j["job_id"], t["cpus"], t["started_at"], t["ended_at"], a["end_time"])
                per_node[t["node"]].append((t["started_at"], t["ended_at"], t["cpus"], label))
    assert set(per_node) == set(cluster.node_names(4))
    for node, spans in per_node.items():
        peak, at = _max_overlap(spans)
        assert peak <= NODE_CPUS, f"{node} ran {peak} CPUs at once: (job, cpus, start, end) {at}"

    # nothing left behind on the nodes
    assert all(n["cpus_alloc"] == 0 for n in c.nodes())
    assert not c.jobs(state=list(ACTIVE_STATES))
    assert elapsed < 150, f"the workload took {elapsed:.0f}s"
