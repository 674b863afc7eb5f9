"""Counted cluster resources (--licenses): parsing, the submit check, and the scheduler's pass
never handing out more of a licence than the cluster has (phalanx.domain.licenses)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_scheduling import job as scheduling_job
from test_scheduling import node as scheduling_node

from phalanx.config import ConfigError, load_config
from phalanx.domain import licenses
from phalanx.domain.directives import parse_submission
from phalanx.domain.placement import place
from phalanx.domain.placement_types import JobRequest, NodeView
from phalanx.domain.scheduling import plan
from phalanx.domain.spec import JobSpec, PartitionInfo, normalize
from phalanx.store.store import SchedSnapshot

NOW = 1_000_000.0

# --------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------


def test_request_parsing_defaults_to_one_and_canonicalises() -> None:
    assert licenses.parse_licenses("matlab, fluent:2") == {"matlab": 1, "fluent": 2}
    assert licenses.format_licenses({"matlab": 1, "fluent": 2}) == "fluent:2,matlab:1"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("fluent:two", "whole number"),
        ("fluent:0", "at least 1"),
        ("fluent|matlab", "'|'"),
        ("fluent,fluent:2", "named twice"),
        ("flu ent", "not a licence name"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        licenses.parse_licenses(text)
    assert says in str(e.value)


def test_totals_from_slurm_string_or_table() -> None:
    assert licenses.parse_totals("fluent:30,matlab:5") == {"fluent": 30, "matlab": 5}
    assert licenses.parse_totals({"fluent": 30}) == {"fluent": 30}
    assert licenses.parse_totals("") == {}
    with pytest.raises(ValueError, match="whole number"):
        licenses.parse_totals("fluent")  # a total needs its count


def test_config_key(tmp_path: Any) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[cluster]\nlicenses = "fluent:30,matlab:5"\n')
    assert load_config(cfg).cluster.license_totals() == {"fluent": 30, "matlab": 5}
    cfg.write_text("[cluster.licenses]\nfluent = 3\n")
    assert load_config(cfg).cluster.license_totals() == {"fluent": 3}
    cfg.write_text('[cluster]\nlicenses = "fluent:many"\n')
    with pytest.raises(ConfigError, match=r"cluster.*fluent"):
        load_config(cfg)


def test_refusal_names_unknown_licence_and_too_many() -> None:
    totals = {"fluent": 2}
    assert licenses.refusal({"fluent": 2}, totals) is None
    unknown = licenses.refusal({"ansys": 1}, totals)
    assert unknown is not None and "unknown licence 'ansys'" in unknown and "fluent:2" in unknown
    too_many = licenses.refusal({"fluent": 3}, totals)
    assert too_many is not None and "only 2 fluent" in too_many


def test_directive_and_spec() -> None:
    parsed = parse_submission("#!/bin/sh\n#SBATCH -L matlab,fluent:2\n", [], "job.sh")
    assert parsed.fields["licenses"] == "fluent:2,matlab:1"
    parts = {"batch": PartitionInfo("batch", True, None, None)}
    resolved = normalize(
        JobSpec(script="#!/bin/sh\n", licenses="matlab ,fluent:2"),
        parts,
        default_mem_per_cpu_mb=100,
        default_requeue=True,
    )
    assert resolved.licenses == "fluent:2,matlab:1"
    assert JobSpec(script="#!/bin/sh\n", licenses="matlab ,fluent:2").licenses == (
        "fluent:2,matlab:1"  # stored canonical, whichever way it came
    )
    with pytest.raises(ValidationError, match="count of matlab must be a whole number"):
        JobSpec(script="#!/bin/sh\n", licenses="matlab:x")


# --------------------------------------------------------------------------------------------
# the scheduler's pass
# --------------------------------------------------------------------------------------------


def _node(name: str, cpus: int = 64) -> dict[str, Any]:
    return scheduling_node(name, cpus=cpus, mem_mb=1 << 20)


def _job(jid: int, lic: str | None) -> dict[str, Any]:
    return scheduling_job(jid, mem_per_node_mb=1, licenses=lic)


def _snap(pending: list[dict[str, Any]], held: list[str] | None = None) -> SchedSnapshot:
    return SchedSnapshot(
        nodes=[_node("n1"), _node("n2")],
        partitions={"batch": {"name": "batch", "nodes": "*"}},
        allocations=[],
        pending=pending,
        dep_states={},
        dep_started={},
        active_names=set(),
        array_active={},
        licenses_held=held or [],
    )


def test_second_job_waits_with_reason_licenses_while_others_start() -> None:
    out = plan(
        _snap([_job(1, "fluent:1"), _job(2, "fluent:1"), _job(3, None)]),
        NOW,
        license_totals={"fluent": 1},
    )
    assert [p.job_id for p in out.starts] == [1, 3]
    assert out.reasons == {2: "Licenses"}


def test_licences_held_by_running_attempts_are_not_free() -> None:
    out = plan(
        _snap([_job(1, "fluent:2")], held=["fluent:1"]),
        NOW,
        license_totals={"fluent": 2},
    )
    assert out.starts == [] and out.reasons == {1: "Licenses"}
    # once the holder ended (not in licenses_held any more) the job starts
    out = plan(_snap([_job(1, "fluent:2")]), NOW, license_totals={"fluent": 2})
    assert [p.job_id for p in out.starts] == [1]


def test_a_licence_blocked_job_does_not_hold_back_jobs_behind_it() -> None:
    # job 1 would be the blocked head if it counted; it does not reserve nodes
    out = plan(
        _snap([_job(1, "matlab:1"), _job(2, None)], held=["matlab:1"]),
        NOW,
        license_totals={"matlab": 1},
    )
    assert [p.job_id for p in out.starts] == [2]
    assert out.reasons[1] == "Licenses"


def test_licence_missing_from_config_is_never_free() -> None:
    out = plan(_snap([_job(1, "ansys:1")]), NOW, license_totals={})
    assert out.starts == [] and out.reasons == {1: "Licenses"}


def _request(jid: int, lic: dict[str, int]) -> JobRequest:
    return JobRequest(
        job_id=jid,
        partitions=("batch",),
        nodes=1,
        cpus_per_node=1,
        mem_per_node_mb=1,
        gpus_per_node=0,
        gpu_type=None,
        exclusive=False,
        constraint=None,
        nodelist=(),
        exclude=(),
        time_limit_s=60,
        licenses=tuple(sorted(lic.items())),
    )


NAMES = ("fluent", "matlab", "ansys")


@settings(max_examples=200, deadline=None)
@given(
    totals=st.fixed_dictionaries({n: st.integers(0, 6) for n in NAMES}),
    held=st.lists(st.dictionaries(st.sampled_from(NAMES), st.integers(1, 3)), max_size=4),
    jobs=st.lists(st.dictionaries(st.sampled_from(NAMES), st.integers(1, 4)), max_size=12),
)
def test_never_more_held_than_the_total(
    totals: dict[str, int], held: list[dict[str, int]], jobs: list[dict[str, int]]
) -> None:
    """Whatever is already held, a pass adds only what is free: for every licence, the jobs it
    starts take at most total - held (nothing when already at or over the total)."""
    in_use = licenses.held(held)
    pool = licenses.Pool(totals, in_use)
    nodes = [
        NodeView("n1", 1000, 1 << 20, (), frozenset(), frozenset({"batch"}), True),
    ]
    reqs = [_request(i + 1, lic) for i, lic in enumerate(jobs)]
    placed = place(reqs, nodes, [], NOW, licenses=pool)
    taken = licenses.held(dict(reqs[p.job_id - 1].licenses) for p in placed)
    for name in NAMES:
        assert taken.get(name, 0) <= max(0, totals[name] - in_use.get(name, 0))
    # a job is either placed or recorded as waiting for licences (nodes are plentiful here)
    placed_ids = {p.job_id for p in placed}
    assert placed_ids | pool.blocked == {r.job_id for r in reqs}
    assert not placed_ids & pool.blocked
    # and greedy in priority order: a blocked job really did not fit when its turn came
    free = {n: totals[n] - in_use.get(n, 0) for n in NAMES}
    for r in reqs:
        fits = all(c <= free[n] for n, c in r.licenses)
        assert fits == (r.job_id in placed_ids)
        if fits:
            for n, c in r.licenses:
                free[n] -= c


def test_scontrol_show_job_prints_licenses_of_jobs_that_have_them() -> None:
    from phalanx.slurm import scontrol

    base = {"id": 7, "name": "x", "user": "root", "state": "PENDING", "reason": "Licenses"}
    lines = scontrol.job_lines({**base, "licenses": "fluent:1"}, now=NOW)
    assert "Licenses=fluent:1" in lines and "JobState=PENDING Reason=Licenses" in " ".join(lines)
    assert not any(x.startswith("Licenses=") for x in scontrol.job_lines(base, now=NOW))
