"""The standing queue (domain/priority.py `_Standing`, taken through `QueuePolicy.queue` with a
small ``wanted``): kept from pass to pass and merged class by class, it must give exactly the
order `breakdown` gives (`priority.order`, the plain sort of every job's breakdown), pass after
pass while jobs come, leave and change, the clock moves and fair share shifts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_priority import NOW, job, node, snap

from phalanx.domain import limits as lim
from phalanx.domain.priority import QueuePolicy, Weights, order

USERS = ("alice", "bob", "carol")


def _drain(q: Any) -> list[int]:
    out = []
    while (j := q.take()) is not None:
        out.append(int(j["id"]))
    return out


def _policy(fs: dict[str, float], max_age: float) -> QueuePolicy:
    return QueuePolicy(
        weights=Weights(max_age_s=max_age),
        fairshare=lambda account, user: fs[user],
        qos_priority={"normal": 0, "urgent": 50},
        limits=lim.Limits(),
        default_account="default",
    )


_JOB = st.tuples(
    st.sampled_from(USERS),
    st.integers(-200, 3000),  # seconds since submission (negative: eligible later)
    st.integers(1, 3),  # nodes
    st.sampled_from(["batch", "high"]),
    st.sampled_from(["normal", "urgent", None]),
    st.sampled_from([0, 0, 0, 7, -3]),  # nice
    st.sampled_from([0, 0, 0, 1]),  # --priority
    st.booleans(),  # an eligible time (a --begin) instead of the submit time
)


def _row(jid: int, spec: tuple[Any, ...]) -> dict[str, Any]:
    u, age, n, part, q, nice, p, begin = spec
    row = job(
        jid,
        user=u,
        submit_time=NOW - age - (50 if begin else 0),
        nodes=n,
        cpus_per_node=4,
        partitions=part,
        qos=q,
        nice=nice,
        priority=p,
        account=None,
    )
    row["eligible_time"] = NOW - age if begin else None
    return row


@settings(max_examples=30, deadline=None)
@given(
    first=st.lists(_JOB, min_size=0, max_size=60),
    passes=st.lists(
        st.tuples(
            st.lists(_JOB, max_size=10),  # arrivals
            st.lists(st.integers(0, 200), max_size=10),  # departures (indexes into the queue)
            st.lists(st.tuples(st.integers(0, 200), st.integers(-5, 5)), max_size=5),  # renice
            st.sampled_from([0.0, 1.0, 30.0, 599.0, 2500.0]),  # clock step
            st.sampled_from([0.1, 0.25, 0.5, 1.0]),  # bob's fair share this pass
        ),
        max_size=5,
    ),
    max_age=st.sampled_from([0.0, 600.0, 1000.0, 7 * 86400.0]),
    wanted=st.integers(0, 2),
)
def test_the_standing_queue_orders_as_the_breakdowns_pass_after_pass(
    first, passes, max_age, wanted
):
    rows = [_row(100 + i, spec) for i, spec in enumerate(first)]
    next_id = 100 + len(rows)
    now = NOW
    fs = {"alice": 0.25, "bob": 1.0, "carol": 0.5}
    nodes = [node(f"n{i}") for i in range(10)]
    for step in [None, *passes]:
        if step is not None:
            arrivals, departures, renices, dt, bob = step
            for i in sorted({d % len(rows) for d in departures} if rows else (), reverse=True):
                del rows[i]
            for i, nice in renices:
                if rows:  # a new row, as the store gives: same id, another nice
                    k = i % len(rows)
                    rows[k] = {**rows[k], "nice": nice}
            for spec in arrivals:
                rows.append(_row(next_id, spec))
                next_id += 1
            now += dt
            fs["bob"] = bob
        s = snap(nodes, list(rows))
        s.partitions = {"batch": {"priority": 10}, "high": {"priority": 20}}
        pol = _policy(fs, max_age)
        plain = [int(j["id"]) for j in order(s.pending, pol.scorer(s, now))]
        # wanted * 8 < len(pending): the standing queue; drained whole, it is the whole order
        q = pol.queue(s, now, wanted)
        if wanted * 8 < len(rows):  # the path under test, not the sort of every key
            assert type(q).__name__ == "_MergedQueue"
        got = _drain(q)
        assert got == plain
        assert q.rest() == []


def test_the_head_and_the_rest_partition_the_queue():
    rows = [job(10 + i, user=USERS[i % 3], submit_time=NOW - 7 * i) for i in range(50)]
    s = snap([node("n1")], rows)
    pol = _policy({"alice": 0.25, "bob": 1.0, "carol": 0.5}, 1000.0)
    q = pol.queue(s, NOW, 2)
    head = [int(q.take()["id"]) for _ in range(5)]
    plain = [int(j["id"]) for j in order(rows, pol.scorer(s, NOW))]
    assert head == plain[:5]
    assert sorted(int(j["id"]) for j in q.rest()) == sorted(plain[5:])
    assert sorted(q.rest_ids()) == sorted(plain[5:])
