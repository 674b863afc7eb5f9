"""The `phalanx` command: daemons, a local cluster, and a Slurm-like user interface.

Every user command takes `--json` and `--url` (or $PHALANX_URL, a comma list of controllers
tried in turn). Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import typer

# for its effect: the rules of a version's [nodes] (config/nodes.py), in every controller
import phalanx.agent.nodecheck  # noqa: F401
from phalanx.cli import auth, explain, fairshare, maintenance, output, render, sim
from phalanx.cli import config as config_cli
from phalanx.cli.output import JsonOpt, UrlOpt, console
from phalanx.client import Client
from phalanx.domain.text import escape
from phalanx.errors import PhalanxError

app = typer.Typer(
    name="phalanx",
    help="Phalanx: a fault-tolerant cluster job scheduler with Slurm's habits.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# ---------------------------------------------------------------------- daemons
@app.command()
def controller(
    state_dir: Path = typer.Option(
        Path(".phalanx"), "--state-dir", help="where the SQLite store and logs live"
    ),
    db: str | None = typer.Option(
        None, "--db", help="database URL (default: sqlite in the state dir)"
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(6817, "--port"),
    cid: str | None = typer.Option(None, "--id", help="controller id (default: host-port-random)"),
    config: Path | None = typer.Option(None, "--config", help="TOML configuration file"),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Run a controller (HTTP API, scheduler, failure detector)."""
    from phalanx.config import load_config
    from phalanx.controller.server import run_controller

    try:
        cfg = load_config(config)
    except PhalanxError as e:
        output.fail(e.message, 2)
    raise typer.Exit(
        run_controller(
            config=cfg,
            state_dir=state_dir,
            db_url=db,
            host=host,
            port=port,
            cid=cid,
            log_level=log_level,
        )
    )


@app.command()
def agent(
    name: str | None = typer.Option(None, "--name", help="node name (default: host name)"),
    state_dir: Path = typer.Option(Path(".phalanx/agent"), "--state-dir"),
    url: str | None = UrlOpt,
    cpus: int | None = typer.Option(None, "--cpus", help="override detected CPUs"),
    mem: str | None = typer.Option(None, "--mem", help="override detected memory (e.g. 64G)"),
    gpus: str | None = typer.Option(None, "--gpus", help="override detected GPUs, e.g. h100:8"),
    features: str = typer.Option("", "--features", help="comma list of node features"),
    topology: str = typer.Option(
        "",
        "--topology",
        help="the node's place in the topology tree, e.g. switch=s1,rack=r1,pdu=a "
        "(the config's [topology] rules win over it)",
    ),
    health_config: Path | None = typer.Option(
        None,
        "--health-config",
        help="the node's TOML file: a [health] table (default: built-in checks) and the "
        "[prolog], [epilog] and [task_prolog] scripts (docs/health.md)",
    ),
    log_level: str = typer.Option("info", "--log-level"),
    key_file: Path | None = typer.Option(
        None,
        "--key-file",
        help="this node's key (phalanx keys derive), or the cluster key on a single host "
        "(default: $PHALANX_KEY_FILE, else /etc/phalanx/node.jwks)",
    ),
    auth_socket: Path | None = typer.Option(
        None,
        "--auth-socket",
        help="where local users get credentials (default: $PHALANX_AUTH_SOCKET, else "
        "/run/phalanx/auth.sock)",
    ),
) -> None:
    """Run a node agent (registers the node, runs its jobs through shepherds)."""
    from phalanx.agent.main import run_agent

    raise typer.Exit(
        run_agent(
            health_config=health_config,
            name=name,
            state_dir=state_dir,
            url=url,
            cpus=cpus,
            mem=mem,
            gpus=gpus,
            features=features,
            topology=topology,
            log_level=log_level,
            key_file=key_file,
            auth_socket=auth_socket,
        )
    )


@app.command()
def up(
    nodes: int = typer.Option(4, "--nodes", min=1, max=64, help="agents to start on this host"),
    controllers: int = typer.Option(1, "--controllers", min=1, max=9),
    state_dir: Path = typer.Option(Path(".phalanx"), "--state-dir"),
    port: int = typer.Option(6817, "--port", help="first controller port (the next ones follow)"),
    db: str | None = typer.Option(
        None, "--db", help="database URL (default: SQLite in the state dir)"
    ),
    cpus: int = typer.Option(4, "--cpus", help="CPUs each local node offers"),
    mem: str = typer.Option("8G", "--mem", help="memory each local node offers"),
    gpus: str = typer.Option(
        "", "--gpus", help="GPUs each local node offers, e.g. h100:8 (no devices behind them)"
    ),
    config: Path | None = typer.Option(None, "--config", help="TOML configuration file"),
    health_config: Path | None = typer.Option(
        None,
        "--health-config",
        help="agents' health checks (default: GPU and memory only), prolog and epilog",
    ),
    detach: bool = typer.Option(False, "--detach", help="return once the cluster is ready"),
    root_jobs: bool = typer.Option(
        True,
        "--root-jobs/--no-root-jobs",
        help="accept jobs submitted by root (the local cluster's owner); other users' jobs "
        "run as those users",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Start a local cluster: controllers and agents on this host."""
    from phalanx.local import LocalCluster

    cluster = LocalCluster(
        state_dir,
        nodes=nodes,
        controllers=controllers,
        port=port,
        db=db,
        cpus=cpus,
        mem=mem,
        gpus=gpus,
        config=config,
        health_config=health_config,
        root_jobs=root_jobs,
    )
    try:
        cluster.start()
    except PhalanxError as e:
        cluster.stop(quiet=True)
        output.fail(e.message)
    from phalanx.auth.localsock import DEFAULT_SOCKET
    from phalanx.failover import DEFAULT_URL
    from phalanx.local import COMMAND_SOCKET, publish_names, publish_socket

    # the commands find this cluster with nothing exported when it serves the default URL
    # and its socket is linked at the default path (publish_socket says when it can be)
    published = publish_socket(cluster.auth_socket)
    # and the compiled Slurm commands find its command server there (docs/slurm.md)
    commands_published = publish_socket(cluster.command_socket, COMMAND_SOCKET)
    # and the node names resolve, as a job's rendezvous recipe expects
    named = publish_names(cluster.node_names(), cluster.state_dir)
    exports = [] if cluster.url == DEFAULT_URL else [f"PHALANX_URL={cluster.url}"]
    if not published:
        exports.append(f"PHALANX_AUTH_SOCKET={cluster.auth_socket}")
    if as_json:
        output.emit(
            {
                "url": cluster.url,
                "auth_socket": str(cluster.auth_socket),
                "published_socket": DEFAULT_SOCKET if published else None,
                "command_socket": str(cluster.command_socket),
                "published_command_socket": str(COMMAND_SOCKET) if commands_published else None,
                "published_names": named,
                "pids": cluster.pids(),
                "state_dir": str(state_dir.absolute()),
            }
        )
    else:
        console.print(
            f"Phalanx cluster up: {controllers} controller(s), {nodes} node(s), state in {state_dir}"
        )
        if named:
            console.print(
                f"node names resolve here: {' '.join(named)} -> 127.0.0.1 (a line in /etc/hosts "
                "that `phalanx down` removes)",
                highlight=False,
                soft_wrap=True,
            )
        if exports:
            console.print(f"export {' '.join(exports)}", highlight=False, soft_wrap=True)
        else:
            console.print(
                f"commands find it with nothing to export ({DEFAULT_URL}, {DEFAULT_SOCKET} "
                f"-> {cluster.auth_socket})",
                highlight=False,
                soft_wrap=True,
            )
    if detach:
        return
    console.print("Running in the foreground; Ctrl-C stops the cluster.")
    try:
        cluster.wait()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        console.print("cluster stopped")


@app.command()
def down(
    state_dir: Path = typer.Option(Path(".phalanx"), "--state-dir"),
    as_json: bool = JsonOpt,
) -> None:
    """Stop the local cluster started with `phalanx up --detach` (only the processes it started)."""
    from phalanx.local import stop_from_pidfiles

    stopped = stop_from_pidfiles(state_dir)
    if as_json:
        output.emit({"stopped": stopped})
    elif stopped:
        console.print(f"stopped {len(stopped)} processes: {', '.join(stopped)}")
    else:
        console.print(f"nothing to stop in {state_dir}")


# ---------------------------------------------------------------------- jobs
@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Submit a batch script: phalanx submit [OPTIONS] SCRIPT [ARGS...]. Reads #SBATCH/#PHX "
    "lines; options on the command line override them. Run `phalanx submit --help-options` "
    "for the list of sbatch options understood.",
)
def submit(
    ctx: typer.Context,
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
    help_options: bool = typer.Option(
        False, "--help-options", help="list the sbatch options understood"
    ),
) -> None:
    from phalanx.slurm.common import (
        script_file_flags,
        split_submit_flags,
        wait_exit_code,
        wait_for_jobs,
    )
    from phalanx.submitting import build_spec, options_help

    if help_options:
        console.print(options_help(), highlight=False)
        return
    try:
        # sbatch's own flags: --parsable (only the id), --wait/-W, --test-only
        flags, argv = split_submit_flags(list(ctx.args))
        script_file_flags(argv, flags)  # #SBATCH --parsable / --wait count too
        spec, warnings, ignored = build_spec(argv)
    except PhalanxError as e:
        output.fail(e.message)
    for w in warnings:
        output.say("warning:", "yellow", w)
    ignored = [flag for flag in ignored if flag not in ("--parsable", "--wait")]  # done here
    if ignored:
        output.say("note:", "yellow", f"accepted with no effect here: {', '.join(ignored)}")
    with output.client(url) as c:
        if flags.test_only:
            output.run(lambda: c.submit(spec, test_only=True))
            if as_json:
                output.emit(
                    {"test_only": True, "valid": True, "warnings": warnings, "ignored": ignored}
                )
            else:
                output.say(
                    "note:", "yellow", "the job is valid; nothing was submitted (--test-only)"
                )
            return
        res = output.run(lambda: c.submit(spec))
        if as_json:
            output.emit({**res, "warnings": warnings, "ignored": ignored})
        elif flags.parsable:
            sys.stdout.write(f"{res['job_id']}\n")
            sys.stdout.flush()
        else:
            console.print(f"Submitted batch job {res['job_id']}", highlight=False)
        if flags.wait:
            # as sbatch --wait: 0 if it COMPLETED, else its exit code (or 1)
            raise typer.Exit(wait_exit_code(output.run(lambda: wait_for_jobs(c, res["job_id"]))))


@app.command()
def queue(
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
    all_states: bool = typer.Option(False, "--all", "-a", help="include finished jobs"),
    state: str | None = typer.Option(
        None,
        "--state",
        "-t",
        help="comma list of states: Slurm names or codes (PD, R, CG, CD, F, CA, TO, NF, OOM, "
        "CF) or Phalanx's (HELD, STARTING); all",
    ),
    user: str | None = typer.Option(None, "--user", "-u"),
    partition: str | None = typer.Option(None, "--partition", "-p"),
    name: str | None = typer.Option(None, "--name", "-n"),
) -> None:
    """List jobs (pending and running by default), like squeue."""
    states = _queue_states(state) if state else None
    if states is None and not all_states:
        states = ["PENDING", "HELD", "STARTING", "RUNNING", "COMPLETING"]
    with output.client(url) as c:
        jobs = output.run(lambda: c.jobs(state=states, user=user, partition=partition, name=name))
    if as_json:
        output.emit(jobs)
    else:
        console.print(render.jobs_table(jobs))


def _queue_states(text: str) -> list[str]:
    """`-t` values as squeue takes them (a Slurm name or code: PENDING and PD include HELD
    jobs, which Slurm shows as pending) or as Phalanx names them (HELD, STARTING); an unknown
    state is refused rather than listing nothing."""
    from phalanx.domain.states import JobState
    from phalanx.slurm.common import (
        SLURM_STATE,
        STATE_CODE,
        SlurmUsageError,
        parse_states,
        phalanx_states,
    )

    out: set[str] = set()
    for raw in text.split(","):
        word = raw.strip().upper()
        if not word:
            continue
        try:
            out.update(phalanx_states(parse_states(word)))
        except SlurmUsageError:
            if word not in JobState.__members__:
                codes = ", ".join(dict.fromkeys(STATE_CODE[x] for x in SLURM_STATE.values()))
                output.fail(
                    f"unknown job state {raw.strip()!r}: use a state name or code ({codes}), "
                    "HELD, STARTING or all"
                )
            out.add(word)
    return sorted(out)


@app.command()
def show(
    ref: str = typer.Argument(..., help="job id (123, 123_4), 'node NAME' or 'licenses'"),
    name: str | None = typer.Argument(None),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Show a job in detail (or `show node NAME`, `show licenses`), like scontrol show job."""
    with output.client(url) as c:
        if ref in ("licenses", "license", "lic"):
            lics = output.run(c.licenses)
            if as_json:
                output.emit(lics)
            else:
                console.print(render.licenses_table(lics), highlight=False)
            return
        if ref == "node":
            if not name:
                output.fail("usage: phalanx show node NAME")
            n = output.run(lambda: c.node(str(name)))
            if as_json:
                output.emit(n)
            else:
                console.print(render.node_detail(n), highlight=False)
            return
        jobs = output.run(lambda: c.job(ref))
    if as_json:
        output.emit(jobs)
    else:
        for j in jobs:
            console.print(render.job_detail(j), highlight=False)


@app.command()
def cancel(
    refs: list[str] = typer.Argument(
        ..., help="job ids (123, 123_4, or an array id for all of it)"
    ),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Cancel jobs, like scancel."""
    with output.client(url) as c:
        res = output.run(lambda: c.cancel(refs))
    _print_results(res, as_json)


@app.command()
def hold(
    refs: list[str] = typer.Argument(...), url: str | None = UrlOpt, as_json: bool = JsonOpt
) -> None:
    """Hold pending jobs (they are not scheduled until released)."""
    with output.client(url) as c:
        res = output.run(lambda: c.hold(refs))
    _print_results(res, as_json)


@app.command()
def release(
    refs: list[str] = typer.Argument(...), url: str | None = UrlOpt, as_json: bool = JsonOpt
) -> None:
    """Release held jobs."""
    with output.client(url) as c:
        res = output.run(lambda: c.release(refs))
    _print_results(res, as_json)


def _print_results(res: dict[str, str], as_json: bool) -> None:
    if as_json:
        output.emit(res)
        return
    for jid, outcome in res.items():
        console.print(escape(f"job {jid}: {outcome}"), highlight=False, markup=False)


@app.command()
def wait(
    refs: list[str] = typer.Argument(...),
    url: str | None = UrlOpt,
    timeout: float = typer.Option(
        0, "--timeout", help="give up after this many seconds (0 = never)"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Wait until jobs end; exit 0 only if every one COMPLETED.

    On a terminal it shows each state change and a live line with the states and the time
    waited; piped or redirected, it prints only the outcome, so scripts stay quiet."""
    from phalanx.domain.states import TERMINAL

    terminal = {s.value for s in TERMINAL}
    started = time.monotonic()
    deadline = started + timeout if timeout > 0 else None
    progress = render.WaitProgress() if _is_tty() and not as_json else None
    try:
        with output.client(url) as c:
            while True:
                jobs = [j for r in refs for j in output.run(lambda r=r: c.job(r))]
                if all(j["state"] in terminal for j in jobs):
                    break  # the outcome lines below say how each ended
                if progress is not None:
                    _show(progress.changes(jobs))
                    _live(progress.live_line(jobs, time.monotonic() - started))
                if deadline is not None and time.monotonic() > deadline:
                    if progress is not None:
                        _live(None)  # the error goes on a line of its own
                    output.fail(f"timed out after {timeout:g}s waiting for {', '.join(refs)}", 2)
                _pause(0.25)
    finally:
        if progress is not None:
            _live(None)
    if as_json:
        output.emit(
            [
                {"job_id": j["job_id"], "state": j["state"], "exit_code": j["exit_code"]}
                for j in jobs
            ]
        )
    else:
        for j in jobs:
            extra = f" exit code {j['exit_code']}" if j["exit_code"] is not None else ""
            why = f" ({j['reason']})" if j["reason"] and j["state"] != "COMPLETED" else ""
            line = escape(f"job {j['job_id']}: {j['state']}{extra}{why}")
            console.print(line, highlight=False, markup=False)
    if not all(j["state"] == "COMPLETED" for j in jobs):
        raise typer.Exit(1)


def _is_tty() -> bool:
    return sys.stdout.isatty()


def _pause(seconds: float) -> None:
    time.sleep(seconds)


def _show(lines: list[str]) -> None:
    for line in lines:
        sys.stdout.write(f"\r\x1b[K{line}\n")
    sys.stdout.flush()


def _live(line: str | None) -> None:
    """Redraw the live status line in place (None clears it); cut to the terminal's width,
    since a wrapped line cannot be redrawn with a carriage return."""
    width = shutil.get_terminal_size().columns - 1
    sys.stdout.write("\r\x1b[K" + (line or "")[:width])
    sys.stdout.flush()


@app.command()
def events(
    ref: str | None = typer.Argument(None, help="job id; all events when omitted"),
    url: str | None = UrlOpt,
    limit: int = typer.Option(100, "--limit", min=1, help="show the latest N events"),
    as_json: bool = JsonOpt,
) -> None:
    """Show the event history of a job, or of the cluster (the latest --limit events)."""
    with output.client(url) as c:
        evs = output.run(lambda: c.job_events(ref)[-limit:] if ref else _latest_events(c, limit))
    if as_json:
        output.emit(evs)
    else:
        console.print(render.events_text(evs), highlight=False, soft_wrap=True)


EVENTS_PAGE = 10_000  # the most /v1/events returns in one reply


def _latest_events(c: Client, limit: int) -> list[dict[str, Any]]:
    """The cluster's latest `limit` events: the API pages forward from an event id, so read
    pages until a short one, keeping only the tail."""
    tail: deque[dict[str, Any]] = deque(maxlen=limit)
    since = 0
    while True:
        page = c.events(since=since, limit=EVENTS_PAGE)
        tail.extend(page)
        if len(page) < EVENTS_PAGE:
            return list(tail)
        since = page[-1]["id"]


# ---------------------------------------------------------------------- nodes & cluster
@app.command()
def nodes(url: str | None = UrlOpt, as_json: bool = JsonOpt) -> None:
    """List nodes with their state and usage, like sinfo -N."""
    with output.client(url) as c:
        ns = output.run(c.nodes)
    if as_json:
        output.emit(ns)
    else:
        console.print(render.nodes_table(ns))


@app.command()
def drain(
    node: str = typer.Argument(...),
    reason: str = typer.Option(..., "--reason", help="why (shown in `phalanx nodes`)"),
    now: bool = typer.Option(
        False, "--now", help="also checkpoint-signal and requeue its requeue-able jobs"
    ),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Drain a node: no new work; running jobs finish (or, with --now, checkpoint and requeue)."""
    with output.client(url) as c:
        n = output.run(lambda: c.drain(node, reason, now=now))
    if as_json:
        output.emit(n)
    else:
        console.print(
            escape(f"node {node}: {n['state']} ({reason})"), highlight=False, markup=False
        )
        if n.get("requeued"):
            jobs = ", ".join(str(j) for j in n["requeued"])
            console.print(f"checkpointing and requeueing jobs: {jobs}", highlight=False)


@app.command()
def resume(
    node: str = typer.Argument(...), url: str | None = UrlOpt, as_json: bool = JsonOpt
) -> None:
    """Return a drained or down node to service."""
    with output.client(url) as c:
        n = output.run(lambda: c.resume(node))
    if as_json:
        output.emit(n)
    else:
        console.print(f"node {node}: {n['state']}", highlight=False)


@app.command()
def cluster(url: str | None = UrlOpt, as_json: bool = JsonOpt) -> None:
    """Cluster status: controllers, leases, partitions, job and node counts."""
    with output.client(url) as c:
        st = output.run(c.cluster)
    if as_json:
        output.emit(st)
    else:
        console.print(render.cluster_summary(st), highlight=False)


@app.command("slurm-commands")
def slurm_commands(
    install_dir: Path = typer.Option(
        ..., "--install", help="the directory to link sbatch, squeue, ... in (e.g. /usr/local/bin)"
    ),
) -> None:
    """Install the compiled Slurm commands (they run in the host's command server)."""
    from phalanx import native
    from phalanx.slurm import install

    try:
        done = install.install(install_dir)
    except (native.BuildError, OSError) as e:
        output.fail(f"phalanx slurm-commands: the compiled commands cannot be built: {e}", 1)
    for why in done.kept:
        print(f"phalanx slurm-commands: left alone: {why}", file=sys.stderr)
    console.print(
        f"{', '.join(done.linked) or 'nothing'} in {install_dir} -> {done.program}", highlight=False
    )


@app.command(
    "command-server",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def command_server(ctx: typer.Context) -> None:
    """Serve the compiled Slurm commands on this host (`--help` for its options)."""
    # its own interpreter image: the server's workers fork from it, so it holds only what the
    # commands import (not this CLI's)
    args = [sys.executable, "-m", "phalanx.slurm.cmdserver", *ctx.args]
    os.execv(sys.executable, args)


app.add_typer(maintenance.app, name="maint")
app.add_typer(config_cli.app, name="config")
explain.register(app)
app.add_typer(auth.token_app, name="token")
app.add_typer(auth.keys_app, name="keys")
app.command("whoami")(auth.whoami)
app.command("authd")(auth.authd)
app.command("share")(fairshare.share)
app.command("priority")(fairshare.priority)
app.command("sim")(sim.sim)


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
