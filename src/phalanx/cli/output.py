"""What every `phalanx` subcommand shares: its consoles, the client it talks through, and the
one-line error and the JSON it prints. A module of its own so that `main` and the subcommand
modules (auth, explain, maint, share) import it instead of each other; tests that run the
commands in process replace `client` here, once for all of them."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from phalanx.client import Client
from phalanx.errors import PhalanxError

# Piped output is not cut at 80 columns: scripts and logs read whole lines.
# markup=False: job names, reasons and paths are printed as they are ("[a]" is not a tag).
console = Console(width=None if sys.stdout.isatty() else 200, markup=False)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200, markup=False)

UrlOpt = typer.Option(
    None, "--url", help="controller URL(s), comma separated (default: $PHALANX_URL)"
)
JsonOpt = typer.Option(False, "--json", help="print JSON")


def say(label: str, style: str, message: str) -> None:
    """One line on stderr: a coloured label and the message, never wrapped (errors are one
    line, whatever the terminal's width)."""
    err_console.print(Text(label, style=style), Text(message), highlight=False, soft_wrap=True)


def client(url: str | None) -> Client:
    """The client a command talks through ($PHALANX_URL when `url` is None)."""
    return Client(url)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print the one-line error and exit with `code`."""
    say("error:", "red", message)
    raise typer.Exit(code)


def emit(data: Any) -> None:
    """`--json`: the data as indented JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def run(fn: Any) -> Any:
    """Call `fn`; a Phalanx error becomes the one-line error and exit 1."""
    try:
        return fn()
    except PhalanxError as e:
        fail(e.message)
