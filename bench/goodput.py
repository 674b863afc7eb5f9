#!/usr/bin/env python3
"""Goodput of a long job under node failures, by checkpoint policy (a benchmark, not a test).

(a) Simulation (pure Python, seeded, no processes). One job needs `--work` seconds of compute on
`--nodes` nodes; each node fails at random (exponential, `--node-mtbf`: the issue's scenario is
one failure per node-day), so the job fails at N times that rate. Event-driven: a simulated day
costs microseconds, so no time scaling is needed and every duration is in simulated seconds.

The job's life:
  * compute `interval` seconds, then write a checkpoint (`--cost` seconds, +-`--cost-jitter`,
    the job does not compute meanwhile); the checkpoint counts once it is finished;
  * a failure (at any moment: computing, checkpointing, restarting) loses everything since the
    last finished checkpoint; the job restarts after `--restart` seconds (requeue, start,
    load the checkpoint) on replacement nodes, from that checkpoint;
  * it ends when all the work is done (the result is written), or at `--cap-days`, keeping
    what its last checkpoint holds.

Goodput = work kept in the final result / wall time = the share of the allocation's node time
that went into kept work (the job holds all N nodes throughout). The rest is split into work
lost to failures, checkpoint writing and restarts.

Policies, with the same failure times for every policy in one seed (common random numbers):
  none             no checkpoints: the job must run `--work` without a failure
  fixed Xs         `--checkpoint-interval=X`, for each X in `--fixed`
  auto (cold)      `--checkpoint-interval=auto` exactly as the scheduler computes it
                   (phalanx.domain.checkpointing with the configured prior, default cost and
                   floor from phalanx.config): C = median of the job's last measured checkpoints,
                   M = node MTBF estimated from the cluster's failure history / N, recomputed
                   after every checkpoint and restart; the cluster (N nodes) has no history
                   when the job starts, so the estimator starts at the prior
  auto (warm Nd)   the same on a cluster that was watched for `--history-days` before the job
                   (a Poisson draw of failures at the true rate)
  Young/Daly true  sqrt(2 C M) with the true C and M: the first-order optimum, for reference

Results are medians over `--seeds` seeded runs (p10-p90 alongside), and the ratio of each
median to the no-checkpoint median.

(b) With `--recovery`: the measured time from a node failure to the job running again, for
requeue, elastic and spare jobs, from bench/recovery.py (`measure(mode, runs) -> seconds`,
which starts real clusters). Skipped, with a message, when that module is missing.

    .venv/bin/python bench/goodput.py
    .venv/bin/python bench/goodput.py --seeds 51 --json /tmp/goodput.json
    .venv/bin/python bench/goodput.py --work 86400 --fixed 300,900 --history-days 30
    .venv/bin/python bench/goodput.py --quick --recovery --recovery-runs 3

(c) With `--real`, instead of the simulation: a real PyTorch DDP job (CPU, gloo) on a local
cluster, `sbatch -N 2 --requeue --signal=B:USR1@30` with `srun python train.py`, periodic
checkpoints and one on the signal, faults injected at a scaled rate (node deaths, agent kills,
`drain --now`, preemptions); its effective training time ratio (time on training steps kept in
the final result / wall time from submit to end) and recovery times (a fault to the first
training step after it), beside the model's prediction for the same rates with the run's own
measured checkpoint cost and recovery time. Medians over `--runs` runs, each on a fresh cluster
(bench/goodput_real.py runs them, bench/ettr.py keeps the books and holds the model). Needs
PyTorch in .venv-tools (scripts/ensure-tools.sh).

    .venv/bin/python bench/goodput.py --real --runs 3
    .venv/bin/python bench/goodput.py --real --runs 1 --faults node,agent,drain,preempt --mtbf 75
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from phalanx.config import Timing
from phalanx.domain import checkpointing

DAY = 86400.0
RECOVERY_MODES = ("requeue", "elastic", "spare")


@dataclass(frozen=True)
class Params:
    nodes: int = 64
    node_mtbf_s: float = DAY  # the truth the estimator has to learn
    work_s: float = 2 * 3600.0
    restart_s: float = 120.0
    cost_s: float = 30.0
    cost_jitter: float = 0.1  # checkpoint durations vary uniformly by +- this share
    cap_s: float = 30 * DAY
    # the scheduler's configuration (phalanx.config defaults unless given)
    prior_s: float = Timing().node_mtbf_prior_s
    prior_weight_s: float = Timing().node_mtbf_prior_weight_s
    default_cost_s: float = Timing().default_checkpoint_cost_s
    minimum_s: float = Timing().checkpoint_interval_min_s


@dataclass
class Outcome:
    goodput: float  # kept work / wall time
    wall_s: float
    kept_s: float
    lost_s: float
    checkpoint_s: float
    restart_s: float
    failures: int
    checkpoints: int
    finished: bool
    intervals: list[float] = field(default_factory=list)  # intervals in force, in order


class Failures:
    """Failure times of the job's nodes: a Poisson process at N / node MTBF over wall time.

    Drawn from its own seeded stream, so every policy in one seed meets the same failures.
    """

    def __init__(self, seed: int, rate: float) -> None:
        self.rng = random.Random(f"failures-{seed}")
        self.rate = rate
        self.next = self.rng.expovariate(rate)

    def pop(self) -> float:
        t = self.next
        self.next = t + self.rng.expovariate(self.rate)
        return t


# A policy: (params, now, measured durations newest first, failures seen) -> interval or None.
Policy = Callable[[Params, float, list[float], int], float | None]


def no_checkpoints(_p: Params, _t: float, _d: list[float], _f: int) -> float | None:
    return None


def fixed(seconds: float) -> Policy:
    def policy(_p: Params, _t: float, _d: list[float], _f: int) -> float | None:
        return seconds

    return policy


def auto(history_s: float, history_failures: int) -> Policy:
    """`--checkpoint-interval=auto` through the scheduler's own code: the job's measured cost
    (median of its latest checkpoints) and the cluster's history (N nodes watched for
    `history_s` before the job plus the job's time so far) with the configured prior."""

    def policy(p: Params, t: float, durations: list[float], failures: int) -> float | None:
        events = [{"data": {"duration_s": d, "seq": i}} for i, d in enumerate(durations)]
        mtbf, source = checkpointing.estimate_node_mtbf(
            p.nodes * (history_s + t),
            history_failures + failures,
            prior_s=p.prior_s,
            prior_weight_s=p.prior_weight_s,
        )
        return checkpointing.interval_in_force(
            checkpointing.AUTO,
            nodes=p.nodes,
            measured_cost_s=checkpointing.median_cost(events),
            default_cost_s=p.default_cost_s,
            node_mtbf_s=mtbf,
            mtbf_source=source,
            minimum_s=p.minimum_s,
        ).seconds

    return policy


def oracle(p: Params, _t: float, _d: list[float], _f: int) -> float | None:
    return checkpointing.young_daly(p.cost_s, p.node_mtbf_s / p.nodes)


def simulate(p: Params, policy: Policy, seed: int) -> Outcome:
    """One job's life under `policy` (see the module docstring for the model)."""
    fails = Failures(seed, p.nodes / p.node_mtbf_s)
    jitter = random.Random(f"cost-{seed}")
    t = 0.0
    saved = 0.0  # work in the latest finished checkpoint
    lost = ckpt_time = restart_time = 0.0
    failures = checkpoints = 0
    durations: list[float] = []  # newest first
    intervals: list[float] = []
    restarting = False

    def fail() -> None:
        nonlocal t, failures, restarting
        t = fails.pop()
        failures += 1
        restarting = True

    while t < p.cap_s:
        if restarting:
            end = t + p.restart_s
            if fails.next < min(end, p.cap_s):
                restart_time += fails.next - t
                fail()
                continue
            if end >= p.cap_s:
                restart_time += p.cap_s - t
                t = p.cap_s
                break
            restart_time += p.restart_s
            t, restarting = end, False
        progress = saved
        while True:  # compute, checkpoint, compute, ... until a failure or the end
            interval = policy(p, t, durations, failures)
            if interval is not None and (not intervals or intervals[-1] != interval):
                intervals.append(interval)
            step = p.work_s - progress if interval is None else min(interval, p.work_s - progress)
            if fails.next < t + step or t + step > p.cap_s:
                done = min(fails.next, p.cap_s) - t
                lost += progress - saved + done
                if fails.next >= p.cap_s:
                    t = p.cap_s
                    break
                fail()
                break
            t += step
            progress += step
            if progress >= p.work_s - 1e-9:
                return _outcome(
                    p,
                    t,
                    p.work_s,
                    lost,
                    ckpt_time,
                    restart_time,
                    failures,
                    checkpoints,
                    True,
                    intervals,
                )
            d = p.cost_s * (1 + jitter.uniform(-p.cost_jitter, p.cost_jitter))
            if fails.next < t + d or t + d > p.cap_s:
                ckpt_time += min(fails.next, p.cap_s) - t
                lost += progress - saved
                if fails.next >= p.cap_s:
                    t = p.cap_s
                    break
                fail()
                break
            t += d
            ckpt_time += d
            saved = progress
            checkpoints += 1
            durations.insert(0, d)
            del durations[checkpointing.COST_SAMPLES * 4 :]
    # the cap: what the last checkpoint holds is kept, everything since is lost
    return _outcome(
        p, p.cap_s, saved, lost, ckpt_time, restart_time, failures, checkpoints, False, intervals
    )


def _outcome(
    p: Params,
    wall: float,
    kept: float,
    lost: float,
    ckpt_time: float,
    restart_time: float,
    failures: int,
    checkpoints: int,
    finished: bool,
    intervals: list[float],
) -> Outcome:
    return Outcome(
        goodput=kept / wall if wall > 0 else 0.0,
        wall_s=wall,
        kept_s=kept,
        lost_s=lost,
        checkpoint_s=ckpt_time,
        restart_s=restart_time,
        failures=failures,
        checkpoints=checkpoints,
        finished=finished,
        intervals=intervals,
    )


def policies(
    p: Params, fixed_s: list[float], history_days: float, seed: int
) -> Iterator[tuple[str, Policy]]:
    yield "none", no_checkpoints
    for x in fixed_s:
        yield f"fixed {x:g}s", fixed(x)
    yield "auto (cold)", auto(0.0, 0)
    if history_days > 0:
        h = history_days * DAY
        n = _poisson(random.Random(f"history-{seed}"), p.nodes * h / p.node_mtbf_s)
        yield f"auto (warm {history_days:g}d)", auto(h, n)
    yield "Young/Daly true M", oracle


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (count of exponential gaps that fit in `mean` units)."""
    n, t = 0, rng.expovariate(1.0)
    while t < mean:
        n += 1
        t += rng.expovariate(1.0)
    return n


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_simulation(
    p: Params, fixed_s: list[float], history_days: float, seeds: int
) -> dict[str, Any]:
    runs: dict[str, list[Outcome]] = {}
    for seed in range(seeds):
        for name, pol in policies(p, fixed_s, history_days, seed):
            runs.setdefault(name, []).append(simulate(p, pol, seed))
    rows: dict[str, Any] = {}
    for name, outs in runs.items():
        wall = [o.wall_s for o in outs]
        share = {
            k: statistics.median(getattr(o, k) / o.wall_s for o in outs)
            for k in ("lost_s", "checkpoint_s", "restart_s")
        }
        rows[name] = {
            "goodput_median": statistics.median(o.goodput for o in outs),
            "goodput_p10": _q([o.goodput for o in outs], 0.1),
            "goodput_p90": _q([o.goodput for o in outs], 0.9),
            "wall_h_median": statistics.median(wall) / 3600,
            "lost_share": share["lost_s"],
            "checkpoint_share": share["checkpoint_s"],
            "restart_share": share["restart_s"],
            "failures_median": statistics.median(o.failures for o in outs),
            "finished": sum(o.finished for o in outs) / len(outs),
            "first_interval_median": _median_or_none([o.intervals[0] for o in outs if o.intervals]),
            "last_interval_median": _median_or_none([o.intervals[-1] for o in outs if o.intervals]),
        }
    base = rows["none"]["goodput_median"]
    best = rows["Young/Daly true M"]["goodput_median"]
    for r in rows.values():
        r["vs_none"] = r["goodput_median"] / base if base > 0 else math.inf
        r["vs_young_daly"] = r["goodput_median"] / best if best > 0 else math.nan
    return {"params": asdict(p), "seeds": seeds, "history_days": history_days, "rows": rows}


def _median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def print_simulation(res: dict[str, Any]) -> None:
    p = res["params"]
    h = checkpointing.human_seconds
    print(
        f"Goodput simulation: {p['nodes']} nodes, node MTBF {h(p['node_mtbf_s'])} "
        f"(job MTBF {h(p['node_mtbf_s'] / p['nodes'])}), work {h(p['work_s'])}, "
        f"checkpoint C={h(p['cost_s'])} +-{100 * p['cost_jitter']:.0f}%, restart R={h(p['restart_s'])}, "
        f"cap {h(p['cap_s'])}; prior {h(p['prior_s'])} worth {h(p['prior_weight_s'])}, "
        f"default C {h(p['default_cost_s'])}, floor {h(p['minimum_s'])}; "
        f"medians over {res['seeds']} seeds"
    )
    head = (
        f"{'policy':<20} {'interval':>15} {'goodput':>8} {'p10-p90':>15} {'vs none':>8} {'vs YD':>6} "
        f"{'lost':>6} {'ckpt':>6} {'restart':>7} {'wall':>8} {'fails':>6} {'done':>5}"
    )
    print(head)
    print("-" * len(head))
    for name, r in res["rows"].items():
        first, last = r["first_interval_median"], r["last_interval_median"]
        if first is None:
            iv = "-"
        elif abs(first - last) < 0.5:
            iv = f"{first:.0f}s"
        else:
            iv = f"{first:.0f}->{last:.0f}s"
        ratio = "inf" if math.isinf(r["vs_none"]) else f"{r['vs_none']:.1f}x"
        print(
            f"{name:<20} {iv:>15} {_pct(r['goodput_median']):>8} "
            f"{_pct(r['goodput_p10']).strip() + '-' + _pct(r['goodput_p90']).strip():>15} "
            f"{ratio:>8} {_pct(r['vs_young_daly']):>6} "
            f"{_pct(r['lost_share']):>6} {_pct(r['checkpoint_share']):>6} "
            f"{_pct(r['restart_share']):>7} {r['wall_h_median']:7.1f}h "
            f"{r['failures_median']:6.0f} {100 * r['finished']:4.0f}%"
        )
    print(
        "interval: median first -> last interval in force; vs YD: median goodput as a share of "
        "Young/Daly with the true M and C; lost/ckpt/restart: median shares of wall time; "
        "done: runs that finished before the cap"
    )


# --- (b) recovery time -----------------------------------------------------------------------


def run_recovery(runs: int) -> dict[str, Any]:
    """Time from a node failure to the job running again, per mode, from bench/recovery.py."""
    here = Path(__file__).resolve().parent
    if not (here / "recovery.py").exists():
        print(
            f"recovery: {here / 'recovery.py'} is missing, so the failure-to-running times "
            "for requeue, elastic and spare jobs were not measured"
        )
        return {"skipped": "bench/recovery.py is missing"}
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    recovery = importlib.import_module("recovery")
    out: dict[str, Any] = {}
    print(
        f"Recovery: node failure -> job running again ({runs} run{'s' if runs != 1 else ''} "
        "per mode, real clusters; bench/recovery.py's fast failure detection)"
    )
    for mode in RECOVERY_MODES:
        t0 = time.monotonic()
        try:
            samples = [float(x) for x in recovery.measure(mode, runs)]
        except Exception as e:  # one mode failing must not hide the others' numbers
            print(f"  {mode:<8} failed: {type(e).__name__}: {e}")
            out[mode] = {"error": f"{type(e).__name__}: {e}"}
            continue
        took = time.monotonic() - t0
        if not samples:
            print(f"  {mode:<8} no samples")
            out[mode] = {"samples": []}
            continue
        out[mode] = {
            "samples": samples,
            "median_s": statistics.median(samples),
            "min_s": min(samples),
            "max_s": max(samples),
        }
        print(
            f"  {mode:<8} median {statistics.median(samples):6.2f}s "
            f"(min {min(samples):.2f}, max {max(samples):.2f}; n={len(samples)}; "
            f"bench took {took:.0f}s)"
        )
    return out


# --- command line ----------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of seconds") from None
    if any(v <= 0 or not math.isfinite(v) for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: intervals must be > 0 seconds")
    return vals


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


# --- (c) the real benchmark ------------------------------------------------------------------


def _real_module() -> Any:
    here = Path(__file__).resolve().parent
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    return importlib.import_module("goodput_real")


def run_real(a: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    real = _real_module()
    kinds = tuple(k.strip() for k in a.faults.split(",") if k.strip())
    bad = [k for k in kinds if k not in real.KINDS]
    if not kinds or bad:
        ap.error(f"--faults: use a comma list of {', '.join(real.KINDS)}")
    if a.runs < 1 or a.payload_mb < 0:
        ap.error("need --runs >= 1 and --payload-mb >= 0")
    s = real.Settings(
        train_s=a.train,
        pace_s=a.pace,
        interval_s=a.interval,
        mtbf_s=a.mtbf,
        payload_mb=a.payload_mb,
        faults=kinds,
        seed=a.seed,
    )
    why = real.check_tools()
    if why:
        print(f"real mode: {why}")
        return 1
    doc = real.measure(a.runs, s, keep=a.keep)
    real.print_report(doc["runs"], doc["summary"], s)
    if a.json:
        a.json.write_text(real.to_json({"real": doc}))
    return 0


def main(argv: list[str] | None = None) -> int:
    d = Params()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--node-mtbf", type=_positive, default=d.node_mtbf_s, help="seconds")
    ap.add_argument("--work", type=_positive, default=d.work_s, help="seconds of compute")
    ap.add_argument("--restart", type=float, default=d.restart_s, help="seconds (R)")
    ap.add_argument("--cost", type=float, default=d.cost_s, help="checkpoint seconds (C)")
    ap.add_argument("--cost-jitter", type=float, default=d.cost_jitter)
    ap.add_argument("--cap-days", type=_positive, default=d.cap_s / DAY)
    ap.add_argument("--fixed", type=_floats, default=[60.0, 300.0, 900.0, 3600.0])
    ap.add_argument("--history-days", type=float, default=7.0)
    ap.add_argument("--seeds", type=int, default=101)
    ap.add_argument("--prior", type=_positive, default=d.prior_s, help="node_mtbf_prior_s")
    ap.add_argument("--prior-weight", type=_positive, default=d.prior_weight_s)
    ap.add_argument("--default-cost", type=float, default=d.default_cost_s)
    ap.add_argument("--min-interval", type=_positive, default=d.minimum_s)
    ap.add_argument("--quick", action="store_true", help="5 seeds")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--recovery", action="store_true", help="also measure recovery times")
    ap.add_argument("--recovery-runs", type=int, default=5)
    real = ap.add_argument_group("real mode (--real): a PyTorch DDP job on a local cluster")
    r0 = _real_module().Settings()
    real.add_argument("--real", action="store_true", help="run the real benchmark instead")
    real.add_argument("--runs", type=int, default=3, help="runs, each on a fresh cluster")
    real.add_argument("--train", type=_positive, default=r0.train_s, help="seconds of steps")
    real.add_argument("--pace", type=_positive, default=r0.pace_s, help="seconds a step")
    real.add_argument(
        "--interval", type=_positive, default=r0.interval_s, help="checkpoint every T s"
    )
    real.add_argument(
        "--mtbf", type=_positive, default=r0.mtbf_s, help="mean training s between faults"
    )
    real.add_argument("--payload-mb", type=int, default=r0.payload_mb, help="checkpoint size")
    real.add_argument(
        "--faults",
        default=",".join(r0.faults),
        help="kinds that take turns: node, agent, drain, preempt",
    )
    real.add_argument("--seed", type=int, default=r0.seed)
    real.add_argument("--keep", action="store_true", help="keep each run's state dir")
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.seeds < 1 or a.restart < 0 or a.cost < 0 or not 0 <= a.cost_jitter < 1:
        ap.error("need --nodes >= 1, --seeds >= 1, --restart >= 0, --cost >= 0, 0 <= jitter < 1")
    try:
        # the scheduler's own config checks apply to the prior, default cost and floor
        Timing(
            node_mtbf_prior_s=a.prior,
            node_mtbf_prior_weight_s=a.prior_weight,
            default_checkpoint_cost_s=a.default_cost,
            checkpoint_interval_min_s=a.min_interval,
        )
    except ValueError as e:
        ap.error(f"the scheduler would refuse this configuration: {e}")
    if a.real:
        return run_real(a, ap)
    p = Params(
        nodes=a.nodes,
        node_mtbf_s=a.node_mtbf,
        work_s=a.work,
        restart_s=a.restart,
        cost_s=a.cost,
        cost_jitter=a.cost_jitter,
        cap_s=a.cap_days * DAY,
        prior_s=a.prior,
        prior_weight_s=a.prior_weight,
        default_cost_s=a.default_cost,
        minimum_s=a.min_interval,
    )
    t0 = time.monotonic()
    res = run_simulation(p, a.fixed, a.history_days, 5 if a.quick else a.seeds)
    print_simulation(res)
    print(f"(simulated in {time.monotonic() - t0:.1f}s)")
    out: dict[str, Any] = {"simulation": res}
    if a.recovery:
        print()
        out["recovery"] = run_recovery(a.recovery_runs)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
