"""The fast placement (node classes, failed-shape memo, per-node reservations) decides exactly
as the plain node-by-node algorithm (`place(..., fast=False)`, the oracle) on random cases."""

from __future__ import annotations

import random

import pytest

from phalanx.domain import placement_backfill, placement_fit, placement_state, values
from phalanx.domain.placement import place
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView

NOW = 1_000_000.0
EXPRS = (None, None, "ib", "avx512", "ib|avx512")


def _constraint(expr: str | None) -> tuple[object, str | None]:
    if expr is None:
        return None, None
    return (lambda f, e=expr: values.constraint_matches(e, f)), expr


def random_case(
    rng: random.Random,
) -> tuple[list[NodeView], list[Allocation], list[JobRequest]]:
    nodes = []
    for i in range(rng.randint(1, 9)):
        gpus = rng.choice((0, 0, 2, 4))
        gtype = rng.choice(("a100", "h100"))
        nodes.append(
            NodeView(
                name=f"n{i}",
                cpus=rng.choice((4, 8)),
                mem_mb=rng.choice((8192, 16384)),
                gpus=tuple((d, gtype if d % 3 else "a100") for d in range(gpus)),
                features=frozenset(rng.sample(("ib", "avx512"), rng.randint(0, 2))),
                partitions=frozenset(rng.sample(("a", "b"), rng.randint(1, 2))),
                schedulable=rng.random() > 0.1,
            )
        )
    allocs = []
    for k in range(rng.randint(0, 8)):
        n = rng.choice(nodes)
        gids = tuple(sorted(rng.sample([d for d, _ in n.gpus], min(len(n.gpus), 1))))
        allocs.append(
            Allocation(
                job_id=1000 + k,
                node=n.name,
                cpus=rng.randint(1, 4),
                mem_mb=rng.choice((512, 4096)),
                gpu_ids=gids if rng.random() < 0.5 else (),
                exclusive=rng.random() < 0.15,
                expected_end=rng.choice((None, NOW - 5, NOW + 100, NOW + 100, NOW + 500)),
            )
        )
    jobs = []
    for j in range(rng.randint(1, 12)):
        nn = rng.choice((1, 1, 1, 2, 3))
        fn, key = _constraint(rng.choice(EXPRS))
        jobs.append(
            JobRequest(
                job_id=j + 1,
                partitions=tuple(rng.sample(("a", "b"), rng.randint(1, 2))),
                nodes=nn,
                cpus_per_node=rng.randint(1, 6),
                mem_per_node_mb=rng.choice((0, 512, 2048, 8192)),
                gpus_per_node=rng.choice((0, 0, 1, 2)),
                gpu_type=rng.choice((None, "a100", "h100")),
                exclusive=rng.random() < 0.2,
                constraint=fn,  # type: ignore[arg-type]
                constraint_key=key,
                nodelist=(),
                exclude=("n1",) if rng.random() < 0.1 else (),
                time_limit_s=rng.choice((None, 50, 200, 1000)),
                nodes_max=nn + 2 if rng.random() < 0.1 else None,
                spares=1 if rng.random() < 0.1 else 0,
            )
        )
        if rng.random() < 0.3:  # an identical shape behind it (array tasks, the memo)
            jobs.append(
                JobRequest(**{**{f: getattr(jobs[-1], f) for f in _FIELDS}, "job_id": j + 100})
            )
    return nodes, allocs, jobs


_FIELDS = JobRequest.__slots__


@pytest.mark.parametrize("seed", range(400))
def test_fast_places_as_the_plain_algorithm(seed: int) -> None:
    rng = random.Random(seed)
    nodes, allocs, jobs = random_case(rng)
    backfill = rng.random() < 0.9
    fast = place(jobs, nodes, allocs, NOW, backfill=backfill)
    plain = place(jobs, nodes, allocs, NOW, backfill=backfill, fast=False)
    assert fast == plain


@pytest.mark.parametrize("seed", range(200))
def test_fast_places_as_the_plain_algorithm_with_topology(seed: int) -> None:
    """Nodes with a place in a tree: single-node jobs go by class, the others node by node
    through domain/topology.py; the decisions are the plain algorithm's."""
    rng = random.Random(20_000 + seed)
    nodes, allocs, jobs = random_case(rng)
    nodes = [
        NodeView(
            n.name,
            n.cpus,
            n.mem_mb,
            n.gpus,
            n.features,
            n.partitions,
            n.schedulable,
            (("switch", f"s{i // 2}"), ("rack", f"r{i // 4}")),
        )
        for i, n in enumerate(nodes)
    ]
    levels = ("switch", "rack")
    fast = place(jobs, nodes, allocs, NOW, levels=levels)
    plain = place(jobs, nodes, allocs, NOW, levels=levels, fast=False)
    assert fast == plain


@pytest.mark.parametrize("seed", range(300))
def test_per_node_reservation_is_the_replay(seed: int) -> None:
    """`_reserve_by_node` gives the start and shadow state the full replay gives."""
    rng = random.Random(10_000 + seed)
    nodes, allocs, jobs = random_case(rng)
    cluster = placement_state.Cluster(nodes)
    state = placement_state.State()
    holds = []
    for a in allocs:
        h = placement_state.Hold(a.node, a.cpus, a.mem_mb, a.gpu_ids, a.exclusive, a.expected_end)
        state.add(h)
        holds.append(h)
    for job in jobs:
        if placement_fit.try_partitions(job, cluster, state) is not None:
            continue  # fits now: not a head
        fast = placement_backfill.reserve(job, cluster, state, holds, NOW)
        plain = placement_backfill.reserve(job, cluster, state, holds, NOW, fast=False)
        assert (fast is None) == (plain is None)
        if fast is not None and plain is not None:
            assert fast.start == plain.start
            names = fast.shadow.usage.keys() | plain.shadow.usage.keys()
            for n in names:
                a, b = fast.shadow.get(n), plain.shadow.get(n)
                assert (a.cpus, a.mem, a.gpus, a.holders, a.exclusive) == (
                    b.cpus,
                    b.mem,
                    b.gpus,
                    b.holders,
                    b.exclusive,
                )


def test_cases_exercise_the_fast_paths() -> None:
    """The random cases are not trivial: many heads get a reservation, many jobs start."""
    starts = heads = 0
    for seed in range(100):
        nodes, allocs, jobs = random_case(random.Random(seed))
        starts += len(place(jobs, nodes, allocs, NOW))
        cluster = placement_state.Cluster(nodes)
        state = placement_state.State()
        holds = []
        for a in allocs:
            h = placement_state.Hold(
                a.node, a.cpus, a.mem_mb, a.gpu_ids, a.exclusive, a.expected_end
            )
            state.add(h)
            holds.append(h)
        heads += sum(
            1
            for j in jobs
            if placement_fit.try_partitions(j, cluster, state) is None
            and placement_backfill.reserve(j, cluster, state, holds, NOW) is not None
        )
    assert starts > 100 and heads > 60, (starts, heads)
