#!/usr/bin/env python3
"""A deterministic stand-in for a training job, in pure Python: checkpoint, get requeued, resume.

It fits a small linear model with minibatch SGD. Each step's minibatch comes from a PRNG seeded
with (seed, step), and the whole state (weights, step) is saved as JSON, whose floats round-trip
exactly; so a run that is stopped, requeued and resumed from a checkpoint ends with bit-for-bit
the same weights as one that never stopped. That makes it a test of the checkpoint protocol:
any step lost or repeated in the wrong way changes the final result.

It uses the job-side helper `phalanx.job` the way a real training loop would:

* resumes from `latest_checkpoint()` in `$PHX_CHECKPOINT_DIR` (the same for every attempt);
* reports progress every step (`report_progress`: hang detection, `phalanx show`);
* checkpoints every `--checkpoint-every` steps, and whenever the scheduler asks
  (`checkpoint_requested()`: a periodic `--checkpoint-interval`, a drain, a maintenance
  window, the time limit), with `save_atomic` + `report_checkpoint`;
* exits after checkpointing when the request announces a stop that requeues it (drain,
  maintenance, preemption): the next attempt resumes from that checkpoint. Before the time
  limit it checkpoints and trains on (a timed-out job is not requeued; resubmit to resume).

    phalanx submit --requeue --checkpoint-interval=5m examples/train_pure.sh
    python examples/train_pure.py --steps 200          # also runs outside Phalanx

Writes the final result (weights, loss, a digest) as JSON to `--out` (default
`$PHX_CHECKPOINT_DIR/result.json`) and prints one line per attempt start, checkpoint and end.
`--step-log FILE` appends "RESTART STEP" per finished step, so a test can count redone steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

try:
    from phalanx import job
except ImportError:  # run from a checkout without installing: the helper is stdlib only
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from phalanx import job

DIM = 6
TRUE_W = [0.5, -1.25, 2.0, 0.75, -0.3, 1.1]
TRUE_B = 0.4
BATCH = 16
LR = 0.05


def fresh_state() -> dict[str, Any]:
    return {"step": 0, "w": [0.0] * DIM, "b": 0.0}


def batch(seed: int, step: int) -> list[tuple[list[float], float]]:
    """The minibatch of `step`: depends on (seed, step) only, never on earlier draws."""
    rng = random.Random(f"{seed}:{step}")
    out = []
    for _ in range(BATCH):
        x = [rng.uniform(-1.0, 1.0) for _ in range(DIM)]
        y = sum(a * b for a, b in zip(TRUE_W, x, strict=True)) + TRUE_B + rng.gauss(0.0, 0.05)
        out.append((x, y))
    return out


def sgd_step(state: dict[str, Any], seed: int) -> float:
    """One SGD step on the mean squared error; returns the batch loss before the update."""
    w, b = state["w"], state["b"]
    gw, gb, loss = [0.0] * DIM, 0.0, 0.0
    for x, y in batch(seed, state["step"]):
        err = sum(a * c for a, c in zip(w, x, strict=True)) + b - y
        loss += err * err
        for i in range(DIM):
            gw[i] += 2.0 * err * x[i]
        gb += 2.0 * err
    state["w"] = [wi - LR * g / BATCH for wi, g in zip(w, gw, strict=True)]
    state["b"] = b - LR * gb / BATCH
    state["step"] += 1
    return loss / BATCH


def digest(state: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([state["w"], state["b"]]).encode()).hexdigest()[:16]


def save(ckdir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Atomic checkpoint `step-NNNNNNNN.json`; keep the newest `keep` of them."""
    path = job.save_atomic(ckdir / f"step-{state['step']:08d}.json", json.dumps(state))
    for old in sorted(ckdir.glob("step-*.json"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--step-time", type=float, default=0.05, help="seconds of 'compute' a step")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps (0: only on request)")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--step-log", type=Path, default=None)
    args = ap.parse_args(argv)

    ckdir = args.checkpoint_dir or job.checkpoint_dir() or Path("checkpoints")
    ckdir.mkdir(parents=True, exist_ok=True)
    out = args.out or ckdir / "result.json"
    restart = job.restart_count()
    node = os.environ.get("PHX_NODENAME", "local")
    job.install_signal_handler()

    latest = job.latest_checkpoint(ckdir, "step-*.json")
    state = json.loads(latest.read_text()) if latest else fresh_state()
    print(f"start restart={restart} node={node} step={state['step']}", flush=True)
    log = open(args.step_log, "a") if args.step_log else None  # noqa: SIM115
    try:
        while state["step"] < args.steps:
            time.sleep(args.step_time)
            loss = sgd_step(state, args.seed)
            if log is not None:
                log.write(f"{restart} {state['step']}\n")
                log.flush()
            job.report_progress(state["step"])
            request = job.checkpoint_request()
            periodic = args.checkpoint_every and state["step"] % args.checkpoint_every == 0
            if request is not None or periodic:
                path = save(ckdir, state)
                job.report_checkpoint(path)
                why = request["reason"] if request else "every"
                kind = request.get("kind") if request else "every"
                print(
                    f"checkpoint step={state['step']} reason={why} loss={loss:.6f} kind={kind}",
                    flush=True,
                )
                if request and request.get("stop") and request.get("reason") != "time limit":
                    # requeue (drain, maintenance, preemption): the next attempt resumes here.
                    # At the time limit the job is not requeued: train on until it ends.
                    print(f"stop restart={restart} step={state['step']}", flush=True)
                    return 0
    finally:
        if log is not None:
            log.close()
    path = save(ckdir, state)
    job.report_checkpoint(path)
    result = {"steps": state["step"], "w": state["w"], "b": state["b"], "digest": digest(state)}
    job.save_atomic(out, json.dumps(result))
    print(f"done restart={restart} step={state['step']} digest={result['digest']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
