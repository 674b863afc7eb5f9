"""The checkpoint interval decision (`phalanx.domain.checkpointing`): Young/Daly, the MTBF
estimator with its prior, the replay of node events into node time and failures, the measured
checkpoint cost, the settings a job may give, and the line `phalanx show` prints.

Properties (hypothesis) pin the shape the scheduler relies on: the interval grows with the
checkpoint cost and with the MTBF, the prior rules when there is no history and fades when
there is a lot of it, a job's MTBF falls as 1/N with its node count, and `auto` never goes
below the configured floor.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from phalanx.config import Timing
from phalanx.domain.checkpointing import (
    AUTO,
    IntervalDecision,
    describe,
    estimate_node_mtbf,
    human_seconds,
    interval_in_force,
    median_cost,
    node_history,
    parse_setting,
    young_daly,
)

DAY = 86400.0
HOUR = 3600.0

costs = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
pos_costs = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False)
mtbfs = st.floats(min_value=1.0, max_value=1e9, allow_nan=False)
node_counts = st.integers(min_value=1, max_value=100_000)
minimums = st.floats(min_value=0.0, max_value=3600.0, allow_nan=False)
priors = st.floats(min_value=60.0, max_value=10 * 365 * DAY, allow_nan=False)
weights = st.floats(min_value=60.0, max_value=10 * 365 * DAY, allow_nan=False)


def auto(
    cost: float | None, node_mtbf: float, nodes: int = 1, minimum: float = 0.0, default: float = 30
) -> IntervalDecision:
    return interval_in_force(
        AUTO,
        nodes=nodes,
        measured_cost_s=cost,
        default_cost_s=default,
        node_mtbf_s=node_mtbf,
        mtbf_source="history",
        minimum_s=minimum,
    )


def seconds(d: IntervalDecision) -> float:
    assert d.seconds is not None
    return d.seconds


# --------------------------------------------------------------------------------------------
# Young/Daly
# --------------------------------------------------------------------------------------------


def test_young_daly_values() -> None:
    assert young_daly(30.0, 1350.0) == pytest.approx(math.sqrt(2 * 30 * 1350))  # ~284.6 s
    assert young_daly(0.0, 1000.0) == 0.0  # free checkpoints: as often as allowed
    # one failure per node-day on 64 nodes, 30 s checkpoints: a bit under 5 minutes
    assert 280 < young_daly(30.0, DAY / 64) < 290


@pytest.mark.parametrize(
    ("cost", "mtbf"),
    [(-1.0, 100.0), (1.0, 0.0), (1.0, -5.0), (math.nan, 1.0), (1.0, math.nan), (1.0, math.inf)],
)
def test_young_daly_refuses_nonsense(cost: float, mtbf: float) -> None:
    with pytest.raises(ValueError, match="checkpoint cost must be"):
        young_daly(cost, mtbf)


@given(c1=costs, c2=costs, m=mtbfs, n=node_counts, floor=minimums)
def test_interval_grows_with_cost(c1: float, c2: float, m: float, n: int, floor: float) -> None:
    lo, hi = sorted((c1, c2))
    assert seconds(auto(lo, m, n, floor)) <= seconds(auto(hi, m, n, floor))


@given(c=costs, m1=mtbfs, m2=mtbfs, n=node_counts, floor=minimums)
def test_interval_grows_with_mtbf(c: float, m1: float, m2: float, n: int, floor: float) -> None:
    lo, hi = sorted((m1, m2))
    assert seconds(auto(c, lo, n, floor)) <= seconds(auto(c, hi, n, floor))


@given(c=pos_costs, m=mtbfs, k=st.floats(min_value=1.01, max_value=100.0))
def test_interval_grows_strictly_above_the_floor(c: float, m: float, k: float) -> None:
    # quadrupling C or M doubles the interval: sqrt
    assert seconds(auto(c * k, m)) == pytest.approx(seconds(auto(c, m)) * math.sqrt(k))
    assert seconds(auto(c, m * k)) == pytest.approx(seconds(auto(c, m)) * math.sqrt(k))


@given(c=costs, m=mtbfs, n=node_counts)
def test_job_mtbf_scales_as_one_over_nodes(c: float, m: float, n: int) -> None:
    one, many = auto(c, m, 1), auto(c, m, n)
    assert many.job_mtbf_s == pytest.approx(m / n)
    assert many.node_mtbf_s == m and many.nodes == n
    assert seconds(many) == pytest.approx(seconds(one) / math.sqrt(n), abs=1e-9)


@given(c=costs, m=mtbfs, n=node_counts, floor=minimums)
def test_minimum_is_respected(c: float, m: float, n: int, floor: float) -> None:
    d = auto(c, m, n, floor)
    assert seconds(d) >= floor
    assert seconds(d) == pytest.approx(max(floor, math.sqrt(2 * c * m / n)))


def test_tiny_measured_cost_is_held_at_the_floor() -> None:
    d = auto(0.01, 30 * DAY, 64, minimum=60.0)
    assert d.seconds == 60.0 and d.cost_s == 0.01


def test_default_cost_until_one_is_measured() -> None:
    d = auto(None, DAY, 1, default=30.0)
    assert d.cost_source == "default" and d.cost_s == 30.0
    assert d.seconds == pytest.approx(math.sqrt(2 * 30 * DAY))
    m = auto(5.0, DAY, 1, default=30.0)
    assert m.cost_source == "measured" and m.cost_s == 5.0
    # a measurement that is not a number is no measurement
    assert auto(math.nan, DAY).cost_source == "default"


def test_zero_nodes_counts_as_one() -> None:
    assert auto(10.0, DAY, 0).job_mtbf_s == DAY


# --------------------------------------------------------------------------------------------
# settings: off, fixed, auto
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", [None, 0, 0.0, "0", "off", "OFF", "none", ""])
def test_off(setting: Any) -> None:
    assert parse_setting(setting) is None
    d = interval_in_force(
        setting,
        nodes=4,
        measured_cost_s=1,
        default_cost_s=1,
        node_mtbf_s=DAY,
        mtbf_source="prior",
        minimum_s=60,
    )
    assert d == IntervalDecision("off", None)
    assert d.as_dict() == {"mode": "off"}


@pytest.mark.parametrize(("setting", "want"), [(600, 600.0), ("600", 600.0), (2.5, 2.5)])
def test_fixed_is_taken_as_given(setting: Any, want: float) -> None:
    # the floor is for `auto`: a user who asks for a short fixed interval gets it
    d = interval_in_force(
        setting,
        nodes=64,
        measured_cost_s=1,
        default_cost_s=30,
        node_mtbf_s=DAY,
        mtbf_source="prior",
        minimum_s=60,
    )
    assert d.mode == "fixed" and d.seconds == want
    assert d.as_dict() == {"mode": "fixed", "seconds": want}


@pytest.mark.parametrize("setting", ["auto", "AUTO", " Auto "])
def test_auto_spellings(setting: str) -> None:
    assert parse_setting(setting) == AUTO


@pytest.mark.parametrize("setting", ["soon", "-5", -1, math.inf, "nan", True])
def test_bad_settings_say_what_is_wrong(setting: Any) -> None:
    with pytest.raises(ValueError, match="checkpoint interval"):
        parse_setting(setting)


# --------------------------------------------------------------------------------------------
# the MTBF estimator
# --------------------------------------------------------------------------------------------


@given(prior=priors, weight=weights)
def test_prior_rules_without_history(prior: float, weight: float) -> None:
    mtbf, source = estimate_node_mtbf(0.0, 0, prior_s=prior, prior_weight_s=weight)
    assert mtbf == prior and source == "prior"


@given(
    prior=priors,
    weight=weights,
    frac=st.floats(min_value=0.0, max_value=0.01),
)
def test_prior_dominates_little_history(prior: float, weight: float, frac: float) -> None:
    """Less than 1% of the prior's weight observed, no failure: within 1% of the prior."""
    mtbf, source = estimate_node_mtbf(frac * weight, 0, prior_s=prior, prior_weight_s=weight)
    assert prior * (1 - 1e-12) <= mtbf <= prior * 1.01 * (1 + 1e-12)  # float rounding at frac = 1%
    assert source in ("prior", "prior+history")


@given(
    prior=priors,
    weight=weights,
    true_mtbf=st.floats(min_value=60.0, max_value=365 * DAY),
    failures=st.integers(min_value=10_000, max_value=10_000_000),
)
def test_history_dominates_lots_of_it(
    prior: float, weight: float, true_mtbf: float, failures: int
) -> None:
    """History that outweighs the prior 100-fold (in node time and in failures) gives the
    observed MTBF within a few percent, whatever the prior said."""
    observed = failures * true_mtbf
    assume(observed >= 100 * weight and failures >= 100 * weight / prior)
    mtbf, source = estimate_node_mtbf(observed, failures, prior_s=prior, prior_weight_s=weight)
    assert source == "history"
    assert mtbf == pytest.approx(true_mtbf, rel=0.03)


@given(
    prior=priors,
    weight=weights,
    t=st.floats(min_value=0, max_value=1e12),
    k=st.integers(min_value=0, max_value=10**6),
)
def test_estimate_moves_the_right_way(prior: float, weight: float, t: float, k: int) -> None:
    """More failures in the same time: shorter MTBF; more time with the same failures: longer.
    The estimate is always positive and finite, even with no failure at all."""
    base, _ = estimate_node_mtbf(t, k, prior_s=prior, prior_weight_s=weight)
    more_failures, _ = estimate_node_mtbf(t, k + 1, prior_s=prior, prior_weight_s=weight)
    more_time, _ = estimate_node_mtbf(t + DAY, k, prior_s=prior, prior_weight_s=weight)
    assert 0 < more_failures < base < more_time < math.inf


def test_estimate_worked_example() -> None:
    """The issue's scenario: one failure per node-day. A 64-node cluster watched for one day
    (64 node-days, 64 failures) with the default prior (30 days, worth 30 node-days = one
    failure) estimates (30 + 64) / (1 + 64) = 1.45 days; after ten days, 1.04 days."""
    t = Timing()
    one, src = estimate_node_mtbf(
        64 * DAY, 64, prior_s=t.node_mtbf_prior_s, prior_weight_s=t.node_mtbf_prior_weight_s
    )
    assert one == pytest.approx(94 / 65 * DAY) and src == "history"
    ten, _ = estimate_node_mtbf(
        640 * DAY, 640, prior_s=t.node_mtbf_prior_s, prior_weight_s=t.node_mtbf_prior_weight_s
    )
    assert ten == pytest.approx(670 / 641 * DAY)
    # less node time than the prior is worth: a blend
    assert estimate_node_mtbf(DAY, 1, prior_s=30 * DAY, prior_weight_s=30 * DAY)[1] == (
        "prior+history"
    )


@pytest.mark.parametrize(("prior", "weight"), [(0, DAY), (DAY, 0), (-1, DAY), (math.inf, DAY)])
def test_estimator_refuses_a_bad_prior(prior: float, weight: float) -> None:
    with pytest.raises(ValueError, match="MTBF prior"):
        estimate_node_mtbf(0, 0, prior_s=prior, prior_weight_s=weight)


def test_estimator_ignores_negative_history() -> None:
    """A clock step can make observed time negative: it counts as none, not as less than none."""
    assert estimate_node_mtbf(-5.0, -1, prior_s=DAY, prior_weight_s=DAY) == (DAY, "prior")


# --------------------------------------------------------------------------------------------
# node_history: replaying node events
# --------------------------------------------------------------------------------------------


def ev(ts: float, node: str | None, kind: str, **data: Any) -> dict[str, Any]:
    return {"ts": ts, "node": node, "kind": kind, "data": data or None}


def test_history_replay() -> None:
    during = [
        ev(10, "a", "node.register"),
        ev(30, "a", "node.down"),
        ev(40, "a", "node.register"),  # back (a re-registration of a DOWN node)
        ev(50, "a", "node.register"),  # agent restart while up: no change
        ev(60, "b", "node.register"),
        ev(70, "b", "node.drain", failure=True, status="fail"),
        ev(75, "b", "node.drain", failure=False, status="warn"),
        ev(76, "b", "node.drain"),  # an operator's drain: no data
        ev(80, "b", "node.resume"),
        ev(90, None, "node.down"),  # no node: ignored
    ]
    # a: 10->30 and 40->100; b: 60->100
    assert node_history([], during, start=0, now=100) == (20 + 60 + 40, 2)


def test_history_order_does_not_matter() -> None:
    during = [ev(30, "a", "node.down"), ev(10, "a", "node.register"), ev(50, "a", "node.up")]
    assert node_history([], during, start=0, now=100) == (20 + 50, 1)


def test_history_carries_state_across_the_window_start() -> None:
    before = [ev(-50, "a", "node.up"), ev(-10, "b", "node.down"), ev(-70, "c", "node.resume")]
    during = [ev(20, "b", "node.up"), ev(40, "c", "node.down")]
    # a up all window (100); b from 20 (80); c until 40 (40)
    assert node_history(before, during, start=0, now=100) == (220, 1)


def test_history_ignores_the_future() -> None:
    during = [ev(10, "a", "node.register"), ev(200, "a", "node.down")]
    assert node_history([], during, start=0, now=100) == (90, 0)


# --------------------------------------------------------------------------------------------
# the measured cost
# --------------------------------------------------------------------------------------------


def ck(duration: Any, seq: int | None = None) -> dict[str, Any]:
    return {"data": {"path": "/c", "finished_at": 1.0, "duration_s": duration, "seq": seq}}


def test_median_cost() -> None:
    assert median_cost([]) is None
    assert median_cost([ck(None), ck("3"), ck(True), ck(-1.0), ck(math.nan)]) is None
    assert median_cost([ck(4.0, 9), ck(100.0, 8), ck(5.0, 7)]) == 5.0
    # newest first; only the latest `samples` checkpoints count
    assert median_cost([ck(1.0, 3), ck(2.0, 2), ck(50.0, 1), ck(60.0, 0)], samples=2) == 1.5
    # ranks of one checkpoint (same seq): the slowest; events without seq are separate
    assert median_cost([ck(2.0, 1), ck(6.0, 1), ck(3.0, 0)]) == 4.5
    assert median_cost([ck(2.0), ck(6.0)]) == 4.0
    assert median_cost([{"data": None}, {}]) is None


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=30))
def test_median_cost_is_within_the_samples(durations: list[float]) -> None:
    events = [ck(d, i) for i, d in enumerate(durations)]
    cost = median_cost(events)
    assert cost is not None
    assert min(durations[:5]) <= cost <= max(durations[:5])


# --------------------------------------------------------------------------------------------
# what `phalanx show` prints
# --------------------------------------------------------------------------------------------


def test_describe() -> None:
    d = interval_in_force(
        "auto",
        nodes=64,
        measured_cost_s=4.1,
        default_cost_s=30,
        node_mtbf_s=DAY,
        mtbf_source="history",
        minimum_s=60,
    )
    line = describe(d.as_dict())
    assert line.startswith(f"auto {round(math.sqrt(2 * 4.1 * DAY / 64))}s ")
    assert "C=4.1s measured" in line and "M=22.5m" in line
    assert "node MTBF 24.0h from history / 64 nodes" in line
    assert describe({"mode": "fixed", "seconds": 600.0}) == "600s (fixed)"
    assert describe({"mode": "off"}) == "off"
    assert describe({}) == "off"
    one = describe(auto(None, 30 * DAY, 1, 60).as_dict())
    assert "C=30s default" in one and "/ 1 node)" in one


@pytest.mark.parametrize(
    ("s", "text"),
    [
        (0.25, "0.25s"),
        (4.1, "4.1s"),
        (95, "95s"),
        (612, "10.2m"),
        (45360, "12.6h"),
        (DAY * 30, "30.0d"),
    ],
)
def test_human_seconds(s: float, text: str) -> None:
    assert human_seconds(s) == text


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


def test_config_defaults_give_a_sensible_interval() -> None:
    """With the defaults, a 64-node job with no measurement yet checkpoints about every 26
    minutes (C = 30 s, M = 30 days / 64); with a measured 4 s, about every 9.5 minutes."""
    t = Timing()
    mtbf, source = estimate_node_mtbf(
        0, 0, prior_s=t.node_mtbf_prior_s, prior_weight_s=t.node_mtbf_prior_weight_s
    )
    first = interval_in_force(
        AUTO,
        nodes=64,
        measured_cost_s=None,
        default_cost_s=t.default_checkpoint_cost_s,
        node_mtbf_s=mtbf,
        mtbf_source=source,
        minimum_s=t.checkpoint_interval_min_s,
    )
    assert 25 * 60 < seconds(first) < 27 * 60
    measured = interval_in_force(
        AUTO,
        nodes=64,
        measured_cost_s=4.0,
        default_cost_s=t.default_checkpoint_cost_s,
        node_mtbf_s=mtbf,
        mtbf_source=source,
        minimum_s=t.checkpoint_interval_min_s,
    )
    assert 9 * 60 < seconds(measured) < 10 * 60


@pytest.mark.parametrize(
    ("values", "rule"),
    [
        ({"node_mtbf_prior_s": 20.0, "checkpoint_interval_min_s": 10.0}, "default_checkpoint"),
        ({"node_mtbf_prior_s": 50.0, "default_checkpoint_cost_s": 1.0}, "checkpoint_interval"),
    ],
)
def test_config_rules(values: dict[str, float], rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        Timing(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "values",
    [
        {"node_mtbf_prior_s": 0},
        {"node_mtbf_prior_weight_s": -1},
        {"default_checkpoint_cost_s": -1},
        {"checkpoint_interval_min_s": 0},
    ],
)
def test_config_ranges(values: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Timing(**values)  # type: ignore[arg-type]


def test_time_scaled_config_is_accepted() -> None:
    """A test cluster can scale everything down (one failure per node-minute)."""
    t = Timing(
        node_mtbf_prior_s=60.0,
        node_mtbf_prior_weight_s=60.0,
        default_checkpoint_cost_s=0.5,
        checkpoint_interval_min_s=1.0,
    )
    assert t.node_mtbf_prior_s == 60.0


def test_cluster_mtbf_summary() -> None:
    from phalanx.domain.checkpointing import cluster_mtbf, describe_cluster_mtbf

    d = cluster_mtbf(0.0, 0, prior_s=30 * DAY, prior_weight_s=30 * DAY)
    assert d["node_mtbf_s"] == 30 * DAY and d["source"] == "prior"
    assert describe_cluster_mtbf(d) == (
        "Node MTBF: 30.0d from prior (0.0 node-days up, 0 failures in the last 30.0d; "
        "prior 30.0d worth 30.0d of node time)"
    )
    one = cluster_mtbf(2 * DAY, 1, prior_s=30 * DAY, prior_weight_s=30 * DAY, window_s=7 * DAY)
    assert one["source"] == "prior+history" and one["node_mtbf_s"] == 16 * DAY
    assert "1 failure in the last 7.0d" in describe_cluster_mtbf(one)


# --------------------------------------------------------------------------------------------
# bench/goodput.py: the simulation behind the recorded numbers keeps its books
# --------------------------------------------------------------------------------------------


def _goodput_module() -> Any:
    """bench/ is not a package: load bench/goodput.py by path (once per session)."""
    import importlib.util
    import sys
    from pathlib import Path

    if "goodput_bench" in sys.modules:
        return sys.modules["goodput_bench"]
    path = Path(__file__).resolve().parents[2] / "bench" / "goodput.py"
    spec = importlib.util.spec_from_file_location("goodput_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["goodput_bench"] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


def test_goodput_simulation_accounts_for_every_second() -> None:
    g = _goodput_module()
    for params in (g.Params(), g.Params(work_s=3 * DAY, cap_s=2 * DAY, restart_s=600.0)):
        for seed in range(8):
            for name, policy in g.policies(params, [60.0, 3600.0], 7.0, seed):
                o = g.simulate(params, policy, seed)
                parts = o.kept_s + o.lost_s + o.checkpoint_s + o.restart_s
                assert parts == pytest.approx(o.wall_s, rel=1e-9), (name, seed)
                assert o.wall_s <= params.cap_s + 1e-6
                assert o.finished == (o.kept_s == params.work_s)
                assert 0 <= o.goodput <= 1


def test_goodput_simulation_sanity() -> None:
    g = _goodput_module()
    # no failures in sight: no checkpoints is perfect, checkpoints cost exactly their time
    calm = g.Params(node_mtbf_s=1e15, cost_jitter=0.0)
    assert g.simulate(calm, g.no_checkpoints, 0).goodput == pytest.approx(1.0)
    every = g.simulate(calm, g.fixed(600.0), 0)
    n_ckpt = int(calm.work_s // 600.0) - (calm.work_s % 600.0 == 0)
    assert every.checkpoints == n_ckpt
    assert every.goodput == pytest.approx(calm.work_s / (calm.work_s + n_ckpt * calm.cost_s))
    # the scenario: Young/Daly beats no checkpoints by far, and auto with history
    # is close to Young/Daly with the true inputs
    res = g.run_simulation(g.Params(), [300.0], 7.0, 15)["rows"]
    assert res["Young/Daly true M"]["goodput_median"] > 10 * res["none"]["goodput_median"]
    assert res["auto (warm 7d)"]["vs_young_daly"] > 0.9


def test_interval_settings_are_documented() -> None:
    """Every parameter of the interval has its default and meaning in configuration.md."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    t = Timing()
    for name in (
        "node_mtbf_prior_s",
        "node_mtbf_prior_weight_s",
        "default_checkpoint_cost_s",
        "checkpoint_interval_min_s",
    ):
        row = next((x for x in doc.splitlines() if x.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} is not in the table of docs/configuration.md"
        assert float(row.split("|")[2].split()[0]) == getattr(t, name), row
