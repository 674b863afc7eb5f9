"""`phalanx config show|diff|apply|history|rollback`: the cluster configuration's versions in
the store (admins only; docs/configuration.md "What lives where").

`apply FILE` sends the file to a controller, which takes its cluster-wide sections, checks
them whole (every rule of loading, then against the live cluster) and answers the diff against
the current version; the command shows it and asks before applying (`--yes`: without asking).
The apply names the version the diff was shown against, so a version applied by someone else
in between is refused instead of overwritten.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from phalanx.cli import output
from phalanx.cli.output import JsonOpt, UrlOpt

app = typer.Typer(
    help="The cluster configuration in the store, versioned: show, diff, apply, history, "
    "rollback (admins).",
    no_args_is_help=True,
)

FileArg = typer.Argument(..., help="a configuration file (TOML); its cluster-wide sections")
YesOpt = typer.Option(False, "--yes", "-y", help="apply without asking")
CommentOpt = typer.Option(None, "--comment", "-m", help="why (kept with the version)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        output.fail(f"cannot read {path}: {e.strerror or e}", 2)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _print_diff(diff: str) -> None:
    for line in diff.splitlines():
        style = None
        if line.startswith("+") and not line.startswith("+++"):
            style = "green"
        elif line.startswith("-") and not line.startswith("---"):
            style = "red"
        output.console.print(line, style=style, highlight=False, soft_wrap=True)


def _confirm(question: str, yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        output.fail(f"{question} needs a confirmation: run it on a terminal or give --yes", 2)
    if not typer.confirm(question, default=False):
        output.fail("nothing changed", 1)


def _check(c: Any, text: str) -> dict[str, Any]:
    res: dict[str, Any] = output.run(lambda: c.post("/v1/config/check", {"text": text}))
    for key in res.get("ignored") or []:
        output.say("note:", "yellow", f"[{key}] is process-local: left to each process's file")
    for cid in res.get("unchecked_controllers") or []:
        output.say(
            "note:",
            "yellow",
            f"controller {cid} did not say its own settings (an older release): not checked "
            "against them; if it cannot run the version it takes no duties (phalanx cluster)",
        )
    return res


@app.command("show")
def show(
    version: int | None = typer.Argument(None, help="a version (default: the current one)"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Print the current version (or VERSION) as TOML, and the version each controller runs."""
    with output.client(url) as c:
        res = output.run(lambda: c.get(f"/v1/config/{version}" if version else "/v1/config"))
    if as_json:
        output.emit(res)
        return
    head = (
        f"# cluster configuration version {res['version']}: {res['action']} by {res['actor']} "
        f"at {_when(res['created_at'])}"
    )
    if res.get("comment"):
        head += f" ({res['comment']})"
    sys.stdout.write(head + "\n")
    for ctl in res.get("controllers") or []:
        line = f"# controller {ctl['id']} runs version {ctl['config_version']}"
        if ctl.get("config_problem"):
            line += f": {ctl['config_problem']}"
        sys.stdout.write(line + "\n")
    sys.stdout.write("\n" + res["toml"])


@app.command("diff")
def diff(file: Path = FileArg, url: str | None = UrlOpt, as_json: bool = JsonOpt) -> None:
    """Show how FILE's cluster-wide sections differ from the current version, and whether
    applying them would be accepted. Exit 0: no difference; 1: a difference; 2: refused."""
    text = _read(file)
    with output.client(url) as c:
        res = _check(c, text)
    if as_json:
        output.emit(res)
    else:
        if res["diff"]:
            _print_diff(res["diff"])
        else:
            output.console.print(
                f"no difference from version {res['current_version']}", highlight=False
            )
        for p in res["problems"]:
            output.say("refused:", "red", p)
    raise typer.Exit(2 if res["problems"] else 1 if res["diff"] else 0)


@app.command("apply")
def apply(
    file: Path = FileArg,
    yes: bool = YesOpt,
    comment: str | None = CommentOpt,
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Check FILE's cluster-wide sections whole, show the diff, and make them the next
    version (every controller moves to it within one loop). Nothing changes if any rule is
    broken."""
    text = _read(file)
    with output.client(url) as c:
        res = _check(c, text)
        if res["problems"]:
            for p in res["problems"]:
                output.say("refused:", "red", p)
            raise typer.Exit(1)
        if not res["diff"]:
            output.console.print(
                f"no difference from version {res['current_version']}: nothing to apply",
                highlight=False,
            )
            return
        if not as_json:
            _print_diff(res["diff"])
        _confirm(f"apply this as version {(res['current_version'] or 0) + 1}?", yes)
        body = {"text": text, "base_version": res["current_version"], "comment": comment}
        out = output.run(lambda: c.post("/v1/config/apply", body))
    if as_json:
        output.emit(out)
    else:
        output.console.print(
            f"cluster configuration version {out['version']} applied "
            f"(changed: {', '.join(out['changed']) or 'nothing'})",
            highlight=False,
        )


@app.command("history")
def history(url: str | None = UrlOpt, as_json: bool = JsonOpt) -> None:
    """The versions, newest first: when, by whom, how (create, apply, rollback), why."""
    with output.client(url) as c:
        res = output.run(lambda: c.get("/v1/config/history"))
    if as_json:
        output.emit(res)
        return
    t = Table(box=None, pad_edge=False)
    for col in ("VERSION", "WHEN", "BY", "ACTION", "COMMENT"):
        t.add_column(col)
    for v in res["versions"]:
        action = v["action"] + (f" to {v['source']}" if v.get("source") else "")
        t.add_row(
            str(v["version"]), _when(v["created_at"]), v["actor"], action, v.get("comment") or ""
        )
    output.console.print(t)


@app.command("rollback")
def rollback(
    version: int | None = typer.Argument(
        None, help="the version to restore (default: the one the current version replaced)"
    ),
    yes: bool = YesOpt,
    comment: str | None = CommentOpt,
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Apply an older version's document again, as the next version (checked like apply)."""
    with output.client(url) as c:
        cur = output.run(lambda: c.get("/v1/config"))
        target = version or cur.get("parent") or cur["version"] - 1
        if target < 1:
            output.fail(f"version {cur['version']} is the first: there is nothing to roll back")
        old = output.run(lambda: c.get(f"/v1/config/{target}"))
        res = _check(c, old["toml"])
        if not as_json:
            if res["diff"]:
                _print_diff(res["diff"])
            for p in res["problems"]:
                output.say("refused:", "red", p)
        if res["problems"]:
            raise typer.Exit(1)
        _confirm(f"restore version {target} as version {cur['version'] + 1}?", yes)
        body = {"version": target, "base_version": cur["version"], "comment": comment}
        out = output.run(lambda: c.post("/v1/config/rollback", body))
    if as_json:
        output.emit(out)
    else:
        output.console.print(
            f"cluster configuration version {out['version']} restores version {target} "
            f"(changed: {', '.join(out['changed']) or 'nothing'})",
            highlight=False,
        )
