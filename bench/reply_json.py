"""Encoding a heartbeat reply (issue 12: placements): Starlette's JSONResponse, which uses the
standard library's encoder, beside the orjson response the controller now makes
(`controller.api_context.fast_json`).

    python bench/reply_json.py --runs 5 --loops 2000

A heartbeat reply that starts work carries one launch spec per task, each with the job's
exported environment (Slurm's default `--export=ALL` sends the whole of it: about 3 KB here).
In a profile of `bench/sim.py placements` the standard encoder held 2.4% of the controller's
GIL. Prints, for replies starting 0, 1 and 8 tasks, the median over the runs of the time to
build one response each way and the ratio, and as the last line

    reply_json: starts=8 stdlib_us=X orjson_us=Y ratio=R
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from phalanx.controller.api_context import fast_json as _fast_json

ENV = {f"VAR_{i:02d}": "x" * 60 for i in range(45)}  # about 3 KB, as an exported environment


def launch(attempt_id: int) -> dict[str, Any]:
    """A launch spec shaped as controller/launch.py's build_launch makes them."""
    return {
        "attempt_id": attempt_id,
        "token": "ab" * 16,
        "job_id": 98_765,
        "rank": 0,
        "node": "sim0001",
        "command": {"argv": ["/bin/sh", "-c", "sleep 1; exit 0"]},
        "env": ENV,
        "cwd": "/tmp",
        "stdout": "/dev/null",
        "stderr": None,
        "open_mode": "truncate",
        "time_limit_s": 600,
        "kill_grace_s": 30.0,
        "signal": None,
        "checkpoint_grace": 30.0,
        "fence": {
            "heartbeat_file": "/var/lib/phalanx/heartbeat",
            "timeout_s": 5.0,
            "kill_grace_s": 2.0,
        },
    }


def reply(starts: int) -> dict[str, Any]:
    return {
        "start": [launch(i) for i in range(starts)],
        "stop": [],
        "forget": [1, 2, 3],
        "steps": {"start": [], "stop": [], "signal": [], "forget": []},
        "controller": "controller-1",
        "terms": {"cluster": 3, "sched:batch": 3},
        "timing": {"heartbeat_interval": 1.0, "fence_timeout": 5.0, "node_down_timeout": 10.0},
    }


def per_call_us(fn: Callable[[], object], loops: int) -> float:
    t = time.perf_counter()
    for _ in range(loops):
        fn()
    return (time.perf_counter() - t) / loops * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--loops", type=int, default=2000, help="responses built per run and way")
    args = ap.parse_args()
    last = ""
    for starts in (0, 1, 8):
        body = reply(starts)
        made = _fast_json(body)
        assert json.loads(made.body) == json.loads(JSONResponse(body).body)  # the same JSON
        std, fast = [], []
        for _ in range(args.runs):  # alternated, so drift hits both alike
            std.append(per_call_us(lambda b=body: JSONResponse(b), args.loops))
            fast.append(per_call_us(lambda b=body: _fast_json(b), args.loops))
        s, f = statistics.median(std), statistics.median(fast)
        print(f"reply starting {starts} tasks: stdlib {s:.1f} us, orjson {f:.1f} us ({s / f:.1f}x)")
        last = f"reply_json: starts={starts} stdlib_us={s:.1f} orjson_us={f:.1f} ratio={s / f:.1f}"
    print(last)


if __name__ == "__main__":
    main()
