#!/usr/bin/env python3
"""Train a small PyTorch model on the CPU under Phalanx: checkpoint, get requeued, resume.

Needs torch (`pip install -e '.[examples]'`); the scheduler itself does not. The model is a
two-layer MLP learning a fixed random function. Each step's minibatch comes from a generator
seeded with (seed, step), and a checkpoint holds the model, the optimizer and the step, so a
run that is stopped and resumed from a checkpoint ends with exactly the weights of one that
never stopped (on the same machine: one thread, deterministic algorithms).

The checkpoint handling is the same few lines any training loop needs (`phalanx.job`):

    job.install_signal_handler()                       # the checkpoint signal sets a flag
    latest = job.latest_checkpoint(pattern="step-*.pt")
    if latest: load it                                 # same directory for every attempt
    ...
    job.report_progress(step)                          # every step: hang detection, show
    if step % every == 0 or job.checkpoint_requested():
        path = job.save_atomic(ckdir / f"step-{step:08d}.pt", lambda f: torch.save(state, f))
        job.report_checkpoint(path)                    # recorded with its duration
        if the request is a stop that requeues: exit   # resume from here on another node

    phalanx submit --requeue --checkpoint-interval=auto --wrap \
        "python examples/train_torch.py --steps 2000"
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

try:
    import torch
    from torch import nn
except ImportError:
    sys.exit("this example needs PyTorch: pip install -e '.[examples]' (or pip install torch)")

try:
    from phalanx import job
except ImportError:  # run from a checkout without installing: the helper is stdlib only
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from phalanx import job

IN, HIDDEN, OUT, BATCH = 8, 32, 1, 64


def model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def target(seed: int) -> nn.Module:
    """The function to learn: a fixed random network, the same for every attempt."""
    torch.manual_seed(seed + 1)
    t = nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), nn.Linear(16, OUT))
    for p in t.parameters():
        p.requires_grad_(False)
    return t


def batch(seed: int, step: int, teacher: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The minibatch of `step`: depends on (seed, step) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, teacher(x)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def save(ckdir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    path = job.save_atomic(ckdir / f"step-{state['step']:08d}.pt", lambda f: torch.save(state, f))
    for old in sorted(ckdir.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--checkpoint-every", type=int, default=100, help="steps (0: on request only)")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ckdir = args.checkpoint_dir or job.checkpoint_dir() or Path("checkpoints")
    ckdir.mkdir(parents=True, exist_ok=True)
    restart = job.restart_count()
    node = os.environ.get("PHX_NODENAME", "local")
    job.install_signal_handler()

    model, opt = model_and_optimizer(args.seed)
    teacher = target(args.seed)
    step = 0
    latest = job.latest_checkpoint(ckdir, "step-*.pt")
    if latest is not None:
        state = torch.load(latest, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
    print(f"start restart={restart} node={node} step={step}", flush=True)
    loss_fn = nn.MSELoss()
    loss = torch.tensor(0.0)
    while step < args.steps:
        if args.step_time:
            time.sleep(args.step_time)
        x, y = batch(args.seed, step, teacher)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        job.report_progress(step)
        request = job.checkpoint_request()
        if request is not None or (args.checkpoint_every and step % args.checkpoint_every == 0):
            state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
            path = save(ckdir, state)
            job.report_checkpoint(path)
            why = request["reason"] if request else "every"
            print(f"checkpoint step={step} reason={why} loss={loss.item():.6f}", flush=True)
            if request and request.get("stop") and request.get("reason") != "time limit":
                print(f"stop restart={restart} step={step}", flush=True)
                return 0
    state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
    job.report_checkpoint(save(ckdir, state))
    print(
        f"done restart={restart} step={step} loss={loss.item():.6f} digest={digest(model)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
