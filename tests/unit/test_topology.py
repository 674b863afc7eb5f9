"""Topology: packing under few switches, spreading over failure domains, spares outside the
job's domains and group anti-affinity, on hand-built trees (phalanx.domain.topology and its use
by phalanx.domain.placement / scheduling)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.config import ConfigError, load_config
from phalanx.domain import topology
from phalanx.domain.placement import place
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView
from phalanx.domain.scheduling import plan, switch_wait_over
from phalanx.domain.spec import JobSpec, PartitionInfo, normalize
from phalanx.domain.topology import Layout
from phalanx.errors import InvalidSpec
from phalanx.store.store import SchedSnapshot

NOW = 1_000_000.0
LEVELS = ("switch", "rack", "pdu")


def tree(shape: dict[str, dict[str, int]], pdu_of: dict[str, str] | None = None) -> dict[str, Any]:
    """{rack: {switch: nodes}} -> places; node names n01, n02, ... in rack/switch order."""
    places: dict[str, dict[str, str]] = {}
    i = 0
    for rack, switches in shape.items():
        for sw, count in switches.items():
            for _ in range(count):
                i += 1
                places[f"n{i:02d}"] = {
                    "switch": sw,
                    "rack": rack,
                    "pdu": (pdu_of or {}).get(rack, f"p-{rack}"),
                }
    return places


# Two racks: r1 has switches a (4 nodes) and b (2), r2 has c (3) and d (3).
PLACES = tree({"r1": {"a": 4, "b": 2}, "r2": {"c": 3, "d": 3}})
NODES = sorted(PLACES)


def racks(nodes: list[str]) -> set[str]:
    return {PLACES[n]["rack"] for n in nodes}


def switches(nodes: list[str]) -> set[str]:
    return {PLACES[n]["switch"] for n in nodes}


# --------------------------------------------------------------------------------------------
# the pure choices
# --------------------------------------------------------------------------------------------


def test_compact_best_fit_single_switch() -> None:
    # 3 nodes fit under c (3 nodes) exactly: better than breaking a (4)
    got = topology.pick_compact(NODES, 3, PLACES, LEVELS)
    assert len(got) == 3 and switches(got) == {"c"}


def test_compact_fewest_racks_then_switches() -> None:
    # 6 nodes: r1 (6) or r2 (6) both fit in one rack; the first (r1) wins, and in it a + b
    got = topology.pick_compact(NODES, 6, PLACES, LEVELS)
    assert racks(got) == {"r1"} and switches(got) == {"a", "b"}
    # 5 nodes: one rack, 2 switches (a + 1 of b, or c + 2 of d)
    got = topology.pick_compact(NODES, 5, PLACES, LEVELS)
    assert len(racks(got)) == 1 and len(switches(got)) == 2
    # 8 nodes: two racks needed; the whole of one rack and the rest compactly in the other
    got = topology.pick_compact(NODES, 8, PLACES, LEVELS)
    assert len(got) == 8 and len(switches(got)) == 3


def test_spread_round_robin_over_racks() -> None:
    got = topology.pick_spread(NODES, 4, PLACES, "rack")
    assert sorted(PLACES[n]["rack"] for n in got) == ["r1", "r1", "r2", "r2"]
    got = topology.pick_spread(NODES, 4, PLACES, "switch")
    assert switches(got) == {"a", "b", "c", "d"}


def test_switch_limit_falls_back_to_leaf_packing_or_refuses() -> None:
    # 6 nodes under 2 switches: a (4) + b (2), or c + d
    chosen = topology.select(NODES, 6, 0, PLACES, LEVELS, switches=2)
    assert chosen is not None and len(switches(chosen[0])) <= 2
    # 8 nodes cannot be under 2 switches (largest two: 4 + 3)
    assert topology.select(NODES, 8, 0, PLACES, LEVELS, switches=2) is None
    assert topology.select(NODES, 7, 0, PLACES, LEVELS, switches=2) is not None


def test_spares_outside_the_jobs_domains() -> None:
    chosen = topology.select(NODES, 3, 2, PLACES, LEVELS, spare_level="rack")
    assert chosen is not None
    ranks, spares = chosen
    assert len(spares) == 2 and not racks(ranks) & racks(spares)
    # when every other domain is full, spares share a domain rather than be missing
    only_r1 = [n for n in NODES if PLACES[n]["rack"] == "r1"]
    chosen = topology.select(only_r1, 3, 2, PLACES, LEVELS, spare_level="rack")
    assert chosen is not None and len(chosen[1]) == 2


def test_nodes_without_a_place_are_their_own_domains() -> None:
    got = topology.pick_spread(["x1", "x2", "x3"], 3, {}, "rack")
    assert got == ["x1", "x2", "x3"]
    assert topology.avoided(["x1", "x2"], {}, "rack", ["x1"]) == {"x1"}


def test_layout_config_rule_beats_agent_report() -> None:
    lay = Layout(levels=LEVELS, rules=((("n0*",), (("rack", "r1"),)),))
    assert lay.place("n01", {"rack": "r9", "switch": "s1", "other": "x"}) == (
        ("switch", "s1"),
        ("rack", "r1"),
    )
    assert lay.place("m01", {"rack": "r9"}) == (("rack", "r9"),)


# --------------------------------------------------------------------------------------------
# properties on random trees
# --------------------------------------------------------------------------------------------

shapes = st.dictionaries(
    st.sampled_from(["r1", "r2", "r3", "r4"]),
    st.dictionaries(st.sampled_from(["s1", "s2", "s3"]), st.integers(1, 5), min_size=1),
    min_size=1,
).map(lambda d: {r: {f"{r}{s}": n for s, n in sw.items()} for r, sw in d.items()})


@settings(max_examples=200, deadline=None)
@given(shape=shapes, data=st.data())
def test_compact_uses_the_fewest_leaf_switches_possible_within_one_rack(
    shape: dict[str, dict[str, int]], data: st.DataObject
) -> None:
    places = tree(shape)
    nodes = sorted(places)
    need = data.draw(st.integers(1, len(nodes)))
    got = topology.pick_compact(nodes, need, places, LEVELS)
    assert len(got) == need and len(set(got)) == need and set(got) <= set(nodes)
    # fewest racks: no fewer racks could hold `need` nodes
    sizes = sorted((sum(sw.values()) for sw in shape.values()), reverse=True)
    fewest = next(k for k in range(1, len(sizes) + 1) if sum(sizes[:k]) >= need)
    assert len({places[n]["rack"] for n in got}) == fewest
    # leaf packing alone: the fewest switches there can be (largest first is optimal)
    leaf = topology.pick_compact(nodes, need, places, LEVELS[:1])
    sw_sizes = sorted((n for sw in shape.values() for n in sw.values()), reverse=True)
    fewest_sw = next(k for k in range(1, len(sw_sizes) + 1) if sum(sw_sizes[:k]) >= need)
    assert topology.count_domains(leaf, places, "switch") == fewest_sw
    # a switch limit is honoured, or refused only when no choice could meet it
    limit = data.draw(st.integers(1, 4))
    chosen = topology.select(nodes, need, 0, places, LEVELS, switches=limit)
    if fewest_sw <= limit:
        assert chosen is not None and topology.count_domains(chosen[0], places, "switch") <= limit
    else:
        assert chosen is None


@settings(max_examples=200, deadline=None)
@given(shape=shapes, data=st.data())
def test_spread_is_balanced_over_as_many_domains_as_possible(
    shape: dict[str, dict[str, int]], data: st.DataObject
) -> None:
    places = tree(shape)
    nodes = data.draw(st.permutations(sorted(places)))
    need = data.draw(st.integers(1, len(nodes)))
    got = topology.pick_spread(nodes, need, places, "rack")
    assert len(got) == need and len(set(got)) == need
    per: dict[str, int] = {}
    for n in got:
        per[places[n]["rack"]] = per.get(places[n]["rack"], 0) + 1
    avail: dict[str, int] = {}
    for n in nodes:
        avail[places[n]["rack"]] = avail.get(places[n]["rack"], 0) + 1
    assert len(per) == min(need, len(avail))
    # no rack holds more than its fair share unless a smaller rack ran out of nodes
    fair = math.ceil(need / len(avail))
    for rack, k in per.items():
        assert k <= fair or any(per.get(r, 0) == avail[r] for r in avail if r != rack)


# --------------------------------------------------------------------------------------------
# through placement and the scheduler's pass
# --------------------------------------------------------------------------------------------


def views(places: dict[str, Any], cpus: int = 4) -> list[NodeView]:
    return [
        NodeView(
            n,
            cpus,
            64000,
            (),
            frozenset(),
            frozenset({"batch"}),
            True,
            tuple((lv, places[n][lv]) for lv in LEVELS),
        )
        for n in sorted(places)
    ]


def req(jid: int, nodes: int = 1, **kw: Any) -> JobRequest:
    base: dict[str, Any] = {
        "job_id": jid,
        "partitions": ("batch",),
        "nodes": nodes,
        "cpus_per_node": 4,
        "mem_per_node_mb": 100,
        "gpus_per_node": 0,
        "gpu_type": None,
        "exclusive": False,
        "constraint": None,
        "nodelist": (),
        "exclude": (),
        "time_limit_s": 600,
    }
    base.update(kw)
    return JobRequest(**base)


def test_placement_packs_multi_node_jobs_compactly() -> None:
    # without topology a 3-node job takes n01-n03 (name order); with it, switch c exactly
    (p,) = place([req(1, 3)], views(PLACES), [], NOW, levels=LEVELS)
    assert switches(list(p.nodes)) == {"c"}
    (p,) = place([req(1, 3)], views(PLACES), [], NOW)  # no levels given: name order
    assert p.nodes == ("n01", "n02", "n03")


def test_placement_spread_and_switches() -> None:
    (p,) = place([req(1, 2, spread="rack")], views(PLACES), [], NOW, levels=LEVELS)
    assert racks(list(p.nodes)) == {"r1", "r2"}
    assert place([req(1, 8, switches=2)], views(PLACES), [], NOW, levels=LEVELS) == []
    (p,) = place([req(1, 7, switches=2)], views(PLACES), [], NOW, levels=LEVELS)
    assert len(switches(list(p.nodes))) == 2


def test_placement_spares_outside_rank_racks() -> None:
    (p,) = place([req(1, 2, spares=1)], views(PLACES), [], NOW, levels=LEVELS)
    ranks, spares = list(p.rank_nodes), list(p.nodes[len(p.rank_nodes) :])
    assert len(spares) == 1 and not racks(ranks) & racks(spares)


def test_group_anti_affinity_against_running_and_same_pass_jobs() -> None:
    running = [Allocation(9, "n01", 4, 100, (), False, None)]  # group "svc" on rack r1
    jobs = [req(1, group="svc", anti_affinity="rack"), req(2, group="svc", anti_affinity="rack")]
    placed = place(jobs, views(PLACES), running, NOW, levels=LEVELS, groups={9: "svc"})
    # job 1 goes to r2; job 2 has no rack left (r1: job 9, r2: job 1) and waits
    assert [p.job_id for p in placed] == [1] and racks(list(placed[0].nodes)) == {"r2"}
    # another group is not kept apart from them
    other = place(
        [req(3, group="db", anti_affinity="rack")],
        views(PLACES),
        running,
        NOW,
        levels=LEVELS,
        groups={9: "svc"},
    )
    assert len(other) == 1


def _node_row(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "cpus": 4,
        "mem_mb": 64000,
        "gpus": [],
        "features": [],
        "registered": True,
        "down": False,
        "drain": False,
    }


def _job_row(jid: int, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": jid,
        "name": f"j{jid}",
        "user": "alice",
        "partitions": "batch",
        "nodes": 1,
        "cpus_per_node": 4,
        "mem_per_node_mb": 100,
        "gpus_per_node": 0,
        "gpu_type": None,
        "exclusive": False,
        "constraint_expr": None,
        "nodelist": [],
        "exclude": [],
        "time_limit_s": 600,
        "dependency": [],
        "array_job_id": None,
        "array_limit": None,
        "reason": None,
        "submit_time": NOW - 10,
    }
    row.update(kw)
    return row


def test_scheduler_pass_with_config_layout_and_switch_wait() -> None:
    lay = Layout(
        levels=LEVELS,
        rules=tuple(((n,), tuple((lv, PLACES[n][lv]) for lv in LEVELS)) for n in sorted(PLACES)),
    )
    snap = SchedSnapshot(
        nodes=[_node_row(n) for n in sorted(PLACES)],
        partitions={"batch": {"name": "batch", "nodes": "*"}},
        allocations=[],
        pending=[_job_row(1, nodes=8, switches=2)],
        dep_states={},
        dep_started={},
        active_names=set(),
        array_active={},
    )
    out = plan(snap, NOW, topo=lay)
    assert out.starts == []  # 8 nodes never fit under 2 switches; waits (5 minutes)
    # after its wait the switch count is ignored (Slurm's max_switch_wait), compactly placed
    snap.pending = [_job_row(1, nodes=8, switches=2, submit_time=NOW - 301)]
    (p,) = plan(snap, NOW, topo=lay).starts
    assert len(p.nodes) == 8
    assert not switch_wait_over({"switches_wait_s": -1, "submit_time": 0.0}, NOW)
    assert switch_wait_over({"switches_wait_s": 0, "submit_time": NOW}, NOW)


# --------------------------------------------------------------------------------------------
# options and config
# --------------------------------------------------------------------------------------------


def test_options_parse_and_anti_affinity_needs_a_group() -> None:
    from phalanx.domain.directives import parse_submission

    got = parse_submission(
        "#!/bin/sh\n#SBATCH --switches=2@10:00 --spread=rack\n#SBATCH --group=svc "
        "--anti-affinity=pdu\n",
        [],
        "job.sh",
    ).fields
    assert got["switches"] == 2 and got["switches_wait_s"] == 600
    assert got["spread"] == "rack" and got["group"] == "svc" and got["anti_affinity"] == "pdu"
    parts = {"batch": PartitionInfo("batch", True, None, None)}
    with pytest.raises(InvalidSpec, match="--group"):
        normalize(
            JobSpec(script="#!/bin/sh\n", anti_affinity="rack"),
            parts,
            default_mem_per_cpu_mb=100,
            default_requeue=True,
        )


def test_topology_config(tmp_path: Any) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[topology]\nlevels = ["switch", "rack"]\n'
        '[[topology.nodes]]\nnodes = "node0*"\nswitch = "s1"\nrack = "r1"\n'
    )
    lay = load_config(cfg).topology.layout()
    assert lay.place("node01") == (("switch", "s1"), ("rack", "r1"))
    cfg.write_text('[[topology.nodes]]\nnodes = "node0*"\nrak = "r1"\n')
    with pytest.raises(ConfigError, match=r"'rak' is not one of topology\.levels"):
        load_config(cfg)


def test_agent_topology_flag_parsing() -> None:
    assert topology.parse_place("switch=s1, rack=r1") == {"switch": "s1", "rack": "r1"}
    assert topology.parse_place("") == {}
    with pytest.raises(ValueError, match="LEVEL=DOMAIN"):
        topology.parse_place("rack")
    with pytest.raises(ValueError, match="twice"):
        topology.parse_place("rack=a,rack=b")


def test_a_level_no_node_has_does_not_break_packing() -> None:
    places = {n: {"switch": p["switch"], "rack": p["rack"]} for n, p in PLACES.items()}
    got = topology.pick_compact(["n01", "n07", "n02", "n08"], 2, places, LEVELS)
    assert len({places[n]["rack"] for n in got}) == 1, got
