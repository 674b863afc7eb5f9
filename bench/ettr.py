"""Effective training time ratio (ETTR): the books of a real training run, and the model's
prediction for it. Pure: no processes, no clock (bench/goodput_real.py runs the jobs).

A run's step log is written by its rank 0 (the training script in bench/goodput_real.py), one
line per event, times from the host's wall clock:

    proc  RUN T                  the rank's process began (before `import torch`)
    mark  RUN NAME T             a point of its set-up: `imported` (torch), `group` (the
                                 process group formed: every rank has started)
    start RUN STEP T             set up (process group, model, checkpoint loaded): STEP is the
                                 step it resumes after (0: from scratch)
    step  RUN STEP T0 T1         one training step: its batch, forward, backward, optimiser and
                                 the all-reduce that agrees on checkpoints and stops
    save  RUN STEP T0 T1 KIND    a checkpoint of STEP, from the end of that step to the end of
                                 the barrier after the write (KIND periodic or stop)
    done  RUN STEP T             the final weights written and the ranks past their barrier

RUN is the attempt (SLURM_RESTART_COUNT). Lines of an attempt killed mid-write are cut off at
the last whole line; a torn last line is ignored.

ETTR = time spent on training steps that were kept in the final result / wall time from submit
to end. The kept steps are found backwards from the attempt that finished: it resumed after
step S, which the latest earlier attempt that ran step S (from below S) had saved; that
attempt's steps up to S are kept, and so on back to step 0. Every other step's time was lost.

The model (Young 1974 / Daly 2006 with the restart cost): a job checkpoints after every T
seconds of training, each checkpoint pausing it C; while it trains, faults arrive at random
(exponential gaps, mean M of up time), a share q of them unplanned (a node or agent dies: the
work since the last finished checkpoint is lost, on average about half a cycle, (T + C) / 2)
and the others planned (drain, preemption: the job saves on the signal and loses nothing);
each costs R from the fault to the first training step after it. `predicted_ettr` is the
exact expectation of that process; to first order it is

    ETTR = T / (T + C) * (1 - (q * (T + C) / 2 + R) / (M + R))

the issue's `T/(T+C) * (1 - (T/2 + R)/M)` with M the wall time between faults and q = 1.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PLANNED = frozenset({"drain", "preempt"})  # the job is asked to save first: nothing is lost


@dataclass
class Attempt:
    run: int
    proc_t: float | None = None
    start_t: float | None = None
    start_step: int = 0
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (t0, t1)
    saves: list[tuple[int, float, float, str]] = field(default_factory=list)
    done_t: float | None = None
    done_step: int | None = None
    marks: dict[str, float] = field(default_factory=dict)

    def first_step_t0(self) -> float | None:
        return min((t0 for t0, _ in self.steps.values()), default=None)


@dataclass(frozen=True)
class Fault:
    t: float  # when it was injected (wall clock)
    kind: str  # node, agent, drain, preempt
    node: str = ""

    @property
    def planned(self) -> bool:
        return self.kind in PLANNED


def parse_log(lines: Iterable[str]) -> dict[int, Attempt]:
    """The step log's attempts by RUN (see the module doc for the format)."""
    runs: dict[int, Attempt] = {}
    for raw in lines:
        w = raw.split()
        if not w:
            continue
        try:
            kind, run = w[0], int(w[1])
            a = runs.setdefault(run, Attempt(run))
            if kind == "proc" and len(w) == 3:
                a.proc_t = float(w[2])
            elif kind == "start" and len(w) == 4:
                a.start_step, a.start_t = int(w[2]), float(w[3])
            elif kind == "step" and len(w) == 5:
                a.steps[int(w[2])] = (float(w[3]), float(w[4]))
            elif kind == "save" and len(w) == 6:
                a.saves.append((int(w[2]), float(w[3]), float(w[4]), w[5]))
            elif kind == "mark" and len(w) == 4:
                a.marks[w[2]] = float(w[3])
            elif kind == "done" and len(w) == 4:
                a.done_step, a.done_t = int(w[2]), float(w[3])
        except (ValueError, IndexError):
            continue  # a line torn by a kill
    return runs


def kept_ranges(runs: dict[int, Attempt]) -> dict[int, tuple[int, int]]:
    """{run: (lo, hi)}: the steps lo+1 .. hi of that run are in the final result.

    Raises ValueError when no attempt finished or a resumed step has no producer."""
    finished = [a for a in runs.values() if a.done_t is not None and a.done_step is not None]
    if not finished:
        raise ValueError("no attempt finished: the log has no `done` line")
    last = max(finished, key=lambda a: a.run)
    assert last.done_step is not None
    out = {last.run: (last.start_step, last.done_step)}
    step, run = last.start_step, last.run
    while step > 0:
        producers = [
            a for a in runs.values() if a.run < run and step in a.steps and a.start_step < step
        ]
        if not producers:
            raise ValueError(f"attempt {run} resumed after step {step}, which no attempt ran")
        b = max(producers, key=lambda a: a.run)
        out[b.run] = (b.start_step, step)
        step, run = b.start_step, b.run
    return out


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def account(
    runs: dict[int, Attempt], submit_t: float, end_t: float, faults: Sequence[Fault]
) -> dict[str, Any]:
    """The run's books: ETTR and where the wall time went.

    The wall time from submit to end splits exactly into: start (submit to the first step),
    for each fault its recovery (the fault to the first step of a later attempt) and the up
    time before it, the up time after the last fault, and the end (the last step to the job's
    end: the final write, the ranks leaving, the job completing). Up time holds the kept steps,
    the periodic checkpoints (each from the end of its step to the next step's start) and the
    rest (lost steps, half-written checkpoints, the loop between steps)."""
    keep = kept_ranges(runs)
    order = sorted(runs)
    kept_s = lost_steps_s = 0.0
    for r in order:
        lo, hi = keep.get(r, (0, -1))
        for s, (t0, t1) in runs[r].steps.items():
            if lo < s <= hi:
                kept_s += t1 - t0
            else:
                lost_steps_s += t1 - t0
    all_steps = [(t0, t1, r) for r in order for (t0, t1) in runs[r].steps.values()]
    if not all_steps:
        raise ValueError("the log has no step")
    first_t0 = min(t0 for t0, _, _ in all_steps)
    last_t1 = max(t1 for _, t1, r in all_steps if r == max(keep))
    wall = end_t - submit_t

    # each fault: the attempt it hit (the latest with a step begun before it) and when a
    # later attempt took its first step
    per_fault: list[dict[str, Any]] = []
    for f in sorted(faults, key=lambda f: f.t):
        before = [r for t0, _, r in all_steps if t0 <= f.t]
        hit = max(before) if before else min(order)
        later = [t0 for t0, _, r in all_steps if r > hit and t0 > f.t]
        resume = min(later) if later else None
        per_fault.append(
            {
                "t": f.t,
                "kind": f.kind,
                "node": f.node,
                "planned": f.planned,
                "run": hit,
                "resume_t": resume,
                "recovery_s": None if resume is None else resume - f.t,
                "framework_s": _framework_s(runs, hit, f.t),
                "phases": _phases(runs, hit, f.t),
            }
        )
    # up segments: [first step or the previous resume, the fault), the last one to the end
    segs: list[tuple[float, float, dict[str, Any] | None]] = []
    begin = first_t0
    for pf in per_fault:
        segs.append((begin, pf["t"], pf))
        if pf["resume_t"] is None:
            begin = math.inf
            break
        begin = pf["resume_t"]
    if begin < last_t1:
        segs.append((begin, last_t1, None))
    up_s = sum(max(0.0, b - a) for a, b, _ in segs)

    pauses: list[float] = []  # periodic checkpoints: step end to the next step's start
    for r in order:
        att = runs[r]
        for step, t0, t1, kind in att.saves:
            if kind != "periodic":
                continue
            nxt = att.steps.get(step + 1)
            pause = (nxt[0] - t0) if nxt is not None else (t1 - t0)
            if any(lo <= t0 < hi for lo, hi, _ in segs):
                pauses.append(pause)
    ends = [t1 for r in order for (_, _, t1, k) in runs[r].saves if k == "periodic"]
    for seg_t0, seg_t1, fault in segs:
        if fault is None or fault["planned"]:
            continue
        # lost: since the last finished checkpoint of this segment, else since its start
        done = [t for t in ends if seg_t0 <= t <= seg_t1]
        fault["lost_s"] = seg_t1 - (max(done) if done else seg_t0)

    recoveries = [pf["recovery_s"] for pf in per_fault if pf["recovery_s"] is not None]
    unplanned = [pf for pf in per_fault if not pf["planned"]]
    planned = [pf for pf in per_fault if pf["planned"]]
    end_s = end_t - last_t1
    start_s = first_t0 - submit_t
    return {
        "wall_s": wall,
        "ettr": kept_s / wall if wall > 0 else 0.0,
        "kept_s": kept_s,
        "lost_steps_s": lost_steps_s,
        "up_s": up_s,
        "start_s": start_s,
        "end_s": end_s,
        "recovery_total_s": sum(recoveries),
        "checkpoints": len(pauses),
        "checkpoint_s": sum(pauses),
        "cost_s": _mean(pauses),
        "cost_median_s": _median(pauses),
        "faults": len(per_fault),
        "unplanned": len(unplanned),
        "planned": len(planned),
        "recovery_s": _mean(recoveries),
        "recovery_unplanned_s": _mean(
            [pf["recovery_s"] for pf in unplanned if pf["recovery_s"] is not None]
        ),
        "recovery_planned_s": _mean(
            [pf["recovery_s"] for pf in planned if pf["recovery_s"] is not None]
        ),
        "lost_per_failure_s": _mean([pf["lost_s"] for pf in unplanned if "lost_s" in pf]),
        "attempts": len(runs),
        "kept_steps": sum(hi - lo for lo, hi in keep.values()),
        "per_fault": per_fault,
    }


def _framework_s(runs: dict[int, Attempt], hit: int, t: float) -> float | None:
    """Of a fault's recovery, the part in the next attempt's rank 0 (its process start to its
    first step: `import torch`, the process group, loading the checkpoint)."""
    nxt = [a for r, a in sorted(runs.items()) if r > hit]
    if not nxt or nxt[0].proc_t is None or nxt[0].proc_t < t:
        return None
    first = nxt[0].first_step_t0()
    return None if first is None else first - nxt[0].proc_t


def _phases(runs: dict[int, Attempt], hit: int, t: float) -> dict[str, float]:
    """Where a fault's recovery went, from the next attempt's rank 0: `launch` (the fault to
    its process: detection, requeue, scheduling, the batch script, srun), `import` (torch),
    `group` (init_process_group: waiting for the other ranks), `load` (model, optimiser,
    checkpoint), `first` (to its first step)."""
    nxt = [a for r, a in sorted(runs.items()) if r > hit]
    if not nxt or nxt[0].proc_t is None or nxt[0].proc_t < t:
        return {}
    a = nxt[0]
    points = [("launch", t), ("import", a.proc_t)]
    points += [("group", a.marks.get("imported")), ("load", a.marks.get("group"))]
    points += [("first", a.start_t), ("", a.first_step_t0())]
    out: dict[str, float] = {}
    for (name, t0), (_, t1) in itertools.pairwise(points):
        if t0 is not None and t1 is not None:
            out[name] = t1 - t0
    return out


def predicted_ettr(
    interval_s: float,
    cost_s: float,
    recovery_s: float,
    mtbf_s: float,
    unplanned_share: float = 1.0,
) -> float:
    """The model's ETTR for faults that arrive while the job trains (module doc).

    mtbf_s: the mean up time between faults (exponential gaps; math.inf: no faults);
    recovery_s: the mean time from a fault to the first training step after it;
    unplanned_share: the share q of faults that lose the work since the last checkpoint.

    Per fault the job is up X ~ Exp(M) and then recovers for R. Of X it trains in whole cycles
    (T of steps, then C of checkpoint), floor(X / c) of them (c = T + C, on average
    p / (1 - p) with p = exp(-c / M)); an unplanned fault loses the partial cycle, a planned
    one keeps its training, E[min(X mod c, T)]. ETTR = kept / (M + R). To first order this is
    T/(T+C) * (1 - (q (T+C)/2 + R) / (M + R)), Young/Daly's with the wall time between faults
    M + R."""
    if interval_s <= 0 or cost_s < 0 or recovery_s < 0 or mtbf_s <= 0:
        raise ValueError("need T > 0, C >= 0, R >= 0, M > 0")
    if not 0 <= unplanned_share <= 1:
        raise ValueError("the unplanned share is between 0 and 1")
    t, c = interval_s, interval_s + cost_s
    if math.isinf(mtbf_s):
        return t / c
    lam = 1.0 / mtbf_s
    p = math.exp(-c * lam)
    whole = t * p / (1 - p)  # training in the whole cycles before a fault
    e_t = math.exp(-t * lam)
    partial = ((1 - e_t * (1 + t * lam)) / lam + t * (e_t - p)) / (1 - p)  # E[min(X mod c, T)]
    kept = whole + (1 - unplanned_share) * partial
    return kept / (mtbf_s + recovery_s)


def young_daly_ettr(
    interval_s: float,
    cost_s: float,
    recovery_s: float,
    mtbf_wall_s: float,
    unplanned_share: float = 1.0,
) -> float:
    """The issue's first-order form, T/(T+C) * (1 - (q T/2 + R) / M), M the wall time between
    faults (q = 1: every fault unplanned), at least 0."""
    if math.isinf(mtbf_wall_s):
        return interval_s / (interval_s + cost_s)
    waste = (unplanned_share * interval_s / 2 + recovery_s) / mtbf_wall_s
    return max(0.0, interval_s / (interval_s + cost_s) * (1 - waste))


def predictions(
    books: dict[str, Any],
    interval_s: float,
    nominal_mtbf_s: float,
    nominal_unplanned_share: float,
) -> dict[str, Any]:
    """The model beside a run's books, with the run's measured C and R (self-consistent):

    realized    the rate and mix this run met: M = its up time / its faults (a few faults a
                run, drawn at random), q its unplanned share, R its mean recovery
    nominal     the rate and mix asked for: M = the injector's mean up time between faults,
                q the injected mix, R = q R_unplanned + (1 - q) R_planned (measured means)
    with_edges  `realized` over the part of the wall time the model describes: less the
                measured start (submit to the first step) and end (the last step to the job's
                end: the final write, the ranks leaving, the job completing)
    young_daly  the issue's first-order T/(T+C) * (1 - (q T/2 + R)/M) at the realized rate,
                M = up time / faults + R
    noise_sd    how far the run's ETTR may stray from `realized` by chance alone: each
                unplanned fault loses the part of its cycle it fell in, uniform over (0, T+C)
                (standard deviation (T+C)/sqrt(12)) of which the share T/(T+C) was training,
                so T sqrt(unplanned) / (sqrt(12) wall)"""
    n = books["faults"]
    cost = books["cost_s"] or 0.0
    rec = books["recovery_s"] or 0.0
    q = books["unplanned"] / n if n else 1.0
    wall = books["wall_s"]
    out: dict[str, Any] = {"interval_s": interval_s, "cost_s": cost, "recovery_s": rec}
    realized_m = books["up_s"] / n if n else math.inf
    out["realized_mtbf_s"] = realized_m
    out["realized"] = predicted_ettr(interval_s, cost, rec, realized_m, q)
    r_u = books["recovery_unplanned_s"]
    r_p = books["recovery_planned_s"]
    qn = nominal_unplanned_share
    if r_u is not None and r_p is not None:
        rec_n = qn * r_u + (1 - qn) * r_p
    else:
        rec_n = r_u if r_u is not None else (r_p if r_p is not None else rec)
    out["nominal_recovery_s"] = rec_n
    out["nominal_mtbf_s"] = nominal_mtbf_s
    out["nominal"] = predicted_ettr(interval_s, cost, rec_n, nominal_mtbf_s, qn)
    inside = (wall - books["start_s"] - books["end_s"]) / wall if wall > 0 else 0.0
    out["with_edges"] = out["realized"] * inside
    out["young_daly"] = young_daly_ettr(interval_s, cost, rec, realized_m + rec, q)
    unplanned = books["unplanned"]
    out["noise_sd"] = interval_s * math.sqrt(unplanned) / (math.sqrt(12) * wall) if wall else 0.0
    return out


def pooled(runs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
    """Several runs' (books, predictions) as one: all their kept time over all their wall time,
    and each model weighted by its run's wall time (what the model predicts for the lot)."""
    wall = sum(b["wall_s"] for b, _ in runs)
    if wall <= 0:
        raise ValueError("no wall time")
    out = {"ettr": sum(b["kept_s"] for b, _ in runs) / wall}
    for k in ("realized", "with_edges", "nominal"):
        out[k] = sum(m[k] * b["wall_s"] for b, m in runs) / wall
    return out
