"""bench/ettr.py: the books of a real training run (ETTR from its step log) and the model's
prediction, which bench/goodput.py --real prints side by side."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, as_name: str) -> Any:
    """bench/ is not a package: load a module of it by path (once per session)."""
    if as_name in sys.modules:
        return sys.modules[as_name]
    spec = importlib.util.spec_from_file_location(as_name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[as_name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


ettr = _load("ettr", "ettr_bench")


class Log:
    """A step log as train.py writes it: steps of `pace` seconds, checkpoints of `cost`."""

    def __init__(self, pace: float = 1.0, cost: float = 0.5) -> None:
        self.pace, self.cost = pace, cost
        self.lines: list[str] = []
        self.t = 0.0

    def attempt(self, run: int, start: int, proc_t: float, setup: float) -> None:
        self.t = proc_t
        self.lines.append(f"proc {run} {proc_t:.4f}")
        self.lines.append(f"mark {run} imported {proc_t + setup / 2:.4f}")
        self.lines.append(f"mark {run} group {proc_t + 3 * setup / 4:.4f}")
        self.t += setup
        self.lines.append(f"start {run} {start} {self.t:.4f}")

    def steps(self, run: int, first: int, last: int, save_every: int = 0) -> None:
        for s in range(first, last + 1):
            t0, self.t = self.t, self.t + self.pace
            self.lines.append(f"step {run} {s} {t0:.4f} {self.t:.4f}")
            if save_every and s % save_every == 0:
                self.save(run, s, "periodic")

    def save(self, run: int, step: int, kind: str) -> None:
        t0, self.t = self.t, self.t + self.cost
        self.lines.append(f"save {run} {step} {t0:.4f} {self.t:.4f} {kind}")

    def done(self, run: int, step: int, write: float) -> None:
        self.t += write
        self.lines.append(f"done {run} {step} {self.t:.4f}")


def test_the_books_of_a_run_with_a_node_death_and_a_drain() -> None:
    g = Log(pace=1.0, cost=0.5)
    # attempt 0: submit at 0, first step at 3; checkpoints after steps 10 and 20; the node
    # dies during step 25 (at 3 + 24 + 1 = 28 s; saves took 1 s): steps 21-24 are lost
    g.attempt(0, 0, proc_t=1.0, setup=2.0)
    g.steps(0, 1, 24, save_every=10)
    assert g.t == pytest.approx(28.0)
    death = g.t + 0.4
    # attempt 1 starts 6 s after the death, from step 20; a drain at its step 30: it trains
    # on to the end of the step and saves on the signal
    g.attempt(1, 20, proc_t=death + 4.0, setup=2.0)
    g.steps(1, 21, 29, save_every=10)
    drain = g.t + 0.2
    g.steps(1, 30, 30)
    g.save(1, 30, "stop")
    # attempt 2: from step 30 to the end at step 40; the final write takes 1 s
    g.attempt(2, 30, proc_t=g.t + 3.0, setup=1.5)
    resume2 = g.t
    g.steps(2, 31, 40)
    last_step_end = g.t
    g.done(2, 40, write=1.0)
    end = g.t + 0.5  # the job's end, as the controller records it

    runs = ettr.parse_log([*g.lines, "step 2 41 12"])  # a torn last line is ignored
    assert sorted(runs) == [0, 1, 2]
    assert ettr.kept_ranges(runs) == {2: (30, 40), 1: (20, 30), 0: (0, 20)}
    faults = [ettr.Fault(death, "node", "node02"), ettr.Fault(drain, "drain", "node01")]
    b = ettr.account(runs, 0.0, end, faults)
    assert b["kept_steps"] == 40
    assert b["kept_s"] == pytest.approx(40.0)  # 40 kept steps of 1 s
    assert b["lost_steps_s"] == pytest.approx(4.0)  # steps 21-24 of attempt 0
    assert b["wall_s"] == pytest.approx(end)
    assert b["ettr"] == pytest.approx(40.0 / end)
    assert b["start_s"] == pytest.approx(3.0)
    assert b["end_s"] == pytest.approx(end - last_step_end)
    assert (b["faults"], b["unplanned"], b["planned"]) == (2, 1, 1)
    # recovery: the fault to the first step of a later attempt
    rec_death = (death + 4.0 + 2.0) - death
    rec_drain = resume2 - drain
    assert [pf["recovery_s"] for pf in b["per_fault"]] == pytest.approx([rec_death, rec_drain])
    assert b["recovery_unplanned_s"] == pytest.approx(rec_death)
    assert b["recovery_planned_s"] == pytest.approx(rec_drain)
    assert b["per_fault"][0]["framework_s"] == pytest.approx(2.0)
    # where the death's recovery went: 4 s to the new process, 1 s importing, 0.5 s forming
    # the group, 0.5 s loading, then straight into the first step
    phases = b["per_fault"][0]["phases"]
    want = {"launch": 4.0, "import": 1.0, "group": 0.5, "load": 0.5, "first": 0.0}
    assert phases == pytest.approx(want)
    assert sum(phases.values()) == pytest.approx(rec_death)
    # lost to the death: from the end of the checkpoint of step 20 to the death
    assert b["lost_per_failure_s"] == pytest.approx(death - 24.0)
    # periodic checkpoints (steps 10, 20 of attempt 0; none in attempt 1 before the drain...
    # step 30's is the stop's): each pauses training for its cost
    assert b["checkpoints"] == 2
    assert b["cost_s"] == pytest.approx(0.5)
    # the wall time splits into start, up time, recoveries and end
    parts = b["start_s"] + b["up_s"] + b["recovery_total_s"] + b["end_s"]
    assert parts == pytest.approx(b["wall_s"])


def test_a_resumed_step_nobody_ran_and_a_run_that_never_finished_are_refused() -> None:
    g = Log()
    g.attempt(0, 0, 0.0, 1.0)
    g.steps(0, 1, 5)
    with pytest.raises(ValueError, match="no attempt finished"):
        ettr.kept_ranges(ettr.parse_log(g.lines))
    g.attempt(1, 9, g.t + 1, 1.0)
    g.steps(1, 10, 12)
    g.done(1, 12, 0.1)
    with pytest.raises(ValueError, match="resumed after step 9"):
        ettr.kept_ranges(ettr.parse_log(g.lines))


def test_an_attempt_left_training_after_its_fault_adds_only_lost_steps() -> None:
    """After an agent dies the old ranks train on until the node is declared DOWN; those
    steps are lost, and the recovery runs to the new attempt's first step."""
    g = Log(pace=1.0, cost=0.0)
    g.attempt(0, 0, 0.0, 1.0)
    g.steps(0, 1, 10, save_every=5)
    kill = g.t
    g.steps(0, 11, 14)  # trained on, blind
    g.attempt(1, 10, g.t + 2.0, 1.0)
    first = g.t
    g.steps(1, 11, 20)
    g.done(1, 20, 0.0)
    b = ettr.account(ettr.parse_log(g.lines), 0.0, g.t, [ettr.Fault(kill, "agent", "n")])
    assert b["kept_s"] == pytest.approx(20.0)
    assert b["lost_steps_s"] == pytest.approx(4.0)
    assert b["per_fault"][0]["recovery_s"] == pytest.approx(first - kill)
    assert b["lost_per_failure_s"] == pytest.approx(0.0)  # it died right after a checkpoint


def test_the_model() -> None:
    p = ettr.predicted_ettr
    assert p(15.0, 0.0, 0.0, math.inf) == 1.0
    assert p(15.0, 1.0, 9.0, math.inf) == pytest.approx(15 / 16)
    # planned stops only, no checkpoint cost: every second of up time is kept
    assert p(15.0, 0.0, 9.0, 60.0, unplanned_share=0.0) == pytest.approx(60 / 69)
    # close to the first-order form T/(T+C) * (1 - (q (T+C)/2 + R) / (M + R)) ...
    first = 15 / 16 * (1 - (8 + 9) / 69)
    assert p(15.0, 1.0, 9.0, 60.0) == pytest.approx(first, abs=0.01)
    # ... and to it exactly as the failures become rare next to the cycle
    big = 1e6
    assert p(15.0, 1.0, 9.0, big) == pytest.approx(15 / 16 * (1 - 17 / (big + 9)), rel=1e-9)
    # losing the partial cycle costs about half a cycle a fault
    lost = (p(15.0, 1.0, 9.0, 60.0, 0.0) - p(15.0, 1.0, 9.0, 60.0, 1.0)) * 69
    assert 6.5 < lost < 8.0
    # the first-order form (T/2)
    assert ettr.young_daly_ettr(15.0, 1.0, 9.0, 80.0) == pytest.approx(15 / 16 * (1 - 16.5 / 80))
    assert ettr.young_daly_ettr(10.0, 0.0, 100.0, 50.0) == 0.0
    for bad in ((0.0, 1.0, 1.0, 10.0), (1.0, -1.0, 1.0, 10.0), (1.0, 1.0, 1.0, 0.0)):
        with pytest.raises(ValueError):
            p(*bad)


def test_the_predictions_use_the_runs_measured_cost_recovery_and_rate() -> None:
    books = {
        "faults": 4,
        "unplanned": 2,
        "wall_s": 320.0,
        "up_s": 240.0,
        "cost_s": 0.5,
        "recovery_s": 8.0,
        "recovery_unplanned_s": 10.0,
        "recovery_planned_s": 6.0,
        "start_s": 6.0,
        "end_s": 2.0,
    }
    m = ettr.predictions(books, interval_s=15.0, nominal_mtbf_s=60.0, nominal_unplanned_share=1)
    p = ettr.predicted_ettr
    assert m["realized_mtbf_s"] == 60.0
    assert m["realized"] == pytest.approx(p(15.0, 0.5, 8.0, 60.0, 0.5))
    assert m["with_edges"] == pytest.approx(m["realized"] * (320 - 8) / 320)
    # the nominal mix: every fault unplanned here, so R is the unplanned one's
    assert m["nominal"] == pytest.approx(p(15.0, 0.5, 10.0, 60.0, 1.0))
    assert m["young_daly"] == pytest.approx(15 / 15.5 * (1 - (0.5 * 7.5 + 8) / 68))
    # two unplanned faults, each losing U(0, T+C) of which T/(T+C) training, over 320 s
    assert m["noise_sd"] == pytest.approx(15 * math.sqrt(2) / math.sqrt(12) / 320)


def test_pooled_runs_weigh_each_by_its_wall_time() -> None:
    a = ({"wall_s": 100.0, "kept_s": 90.0}, {"realized": 0.9, "with_edges": 0.85, "nominal": 0.8})
    b = ({"wall_s": 300.0, "kept_s": 210.0}, {"realized": 0.7, "with_edges": 0.65, "nominal": 0.8})
    p = ettr.pooled([a, b])
    assert p["ettr"] == pytest.approx(300 / 400)
    assert p["realized"] == pytest.approx((90 + 210) / 400)
    assert p["with_edges"] == pytest.approx((85 + 195) / 400)
    assert p["nominal"] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        ettr.pooled([])


def _up_time_process(t: float, cost: float, r: float, m: float, q: float, seed: int) -> float:
    """The real benchmark's faults, simulated: exponential up time, then a recovery."""
    import random

    rng = random.Random(seed)
    c = t + cost
    kept = wall = 0.0
    for _ in range(20000):
        x = rng.expovariate(1 / m)
        whole, part = divmod(x, c)
        kept += whole * t + (min(part, t) if rng.random() >= q else 0.0)
        wall += x + r
    return kept / wall


@pytest.mark.parametrize("q", [1.0, 0.5, 0.0])
def test_the_model_is_the_expectation_of_the_fault_process(q: float) -> None:
    sim = _up_time_process(15.0, 0.5, 8.0, 60.0, q, seed=7)
    assert ettr.predicted_ettr(15.0, 0.5, 8.0, 60.0, q) == pytest.approx(sim, abs=0.003)


def test_the_model_agrees_with_the_goodput_simulation() -> None:
    """Without a restart, faults over wall time are faults over up time: the closed form is
    bench/goodput.py's event simulation (a fixed interval, a checkpoint cost, Poisson failures
    that lose the work since the last finished checkpoint)."""
    g = _load("goodput", "goodput_bench")
    day = 86400.0
    for interval, cost, job_mtbf in ((15.0, 0.5, 60.0), (60.0, 2.0, 900.0)):
        p = g.Params(
            nodes=1,
            node_mtbf_s=job_mtbf,
            work_s=300 * job_mtbf,
            restart_s=0.0,
            cost_s=cost,
            cost_jitter=0.0,
            cap_s=1000 * day,
        )
        outs = [g.simulate(p, g.fixed(interval), seed) for seed in range(30)]
        sim = sum(o.kept_s for o in outs) / sum(o.wall_s for o in outs)
        model = ettr.predicted_ettr(interval, cost, 0.0, job_mtbf)
        assert sim == pytest.approx(model, abs=0.003), (interval, sim, model)
