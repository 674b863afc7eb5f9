"""`phalanx sim`: a simulated cluster of N virtual nodes on real controllers (docs/sim.md)."""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import typer
from pydantic import ValidationError

from phalanx.errors import PhalanxError


def sim(
    nodes: int = typer.Option(100, "--nodes", min=1, max=100_000, help="virtual nodes"),
    workload: Path = typer.Option(..., "--workload", help="workload file (TOML or JSON)"),
    controllers: int = typer.Option(1, "--controllers", min=1, max=9, help="controllers"),
    store: str = typer.Option(
        "sqlite", "--store", help="'sqlite' (a file in the state dir) or a database URL"
    ),
    state_dir: Path | None = typer.Option(
        None, "--state-dir", help="keep the cluster's files here (default: a temporary dir)"
    ),
    node_procs: int = typer.Option(
        0, "--node-procs", min=0, max=64, help="node-server processes (0: one per 2,500 nodes)"
    ),
    timeout: float = typer.Option(1800.0, "--timeout", min=1, help="seconds to finish in"),
    hold: float = typer.Option(
        0.0, "--hold", min=0, help="keep heartbeating this long after the workload ends"
    ),
    heartbeat_budget: float | None = typer.Option(
        None, "--heartbeat-budget", min=0.001, help="override [timing] heartbeat_budget"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Run a workload on N virtual nodes that speak the agent protocol to real controllers."""
    from phalanx.sim import workload as wl
    from phalanx.sim.run import Options, simulate

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    try:
        loaded = wl.load(workload)
    except wl.WorkloadError as e:
        print(f"phalanx sim: {e}", file=sys.stderr)
        raise typer.Exit(2) from None

    def _term(_sig: int, _frame: object) -> None:
        raise SystemExit(143)  # so that the cluster started here is stopped on the way out

    signal.signal(signal.SIGTERM, _term)
    timing = {} if heartbeat_budget is None else {"heartbeat_budget": heartbeat_budget}
    try:
        result = simulate(
            Options(
                nodes=nodes,
                workload=loaded,
                controllers=controllers,
                store=store,
                state_dir=state_dir,
                node_procs=node_procs,
                timeout=timeout,
                timing=timing,
                hold=hold,
                progress=progress,
            )
        )
    except (PhalanxError, ValidationError) as e:
        msg = e.message if isinstance(e, PhalanxError) else str(e).splitlines()[0]
        print(f"phalanx sim: {msg}", file=sys.stderr)
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(result.summary())
    print(result.line())
    if result.not_terminal:
        raise typer.Exit(1)
