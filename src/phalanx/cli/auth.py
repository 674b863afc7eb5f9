"""`phalanx token|keys|whoami|authd`: identity on the command line (docs/security.md)."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from pathlib import Path

import typer

from phalanx.cli import output
from phalanx.cli.output import JsonOpt, UrlOpt
from phalanx.domain.values import format_duration, parse_duration

token_app = typer.Typer(help="Bearer tokens for users and services off the cluster's hosts.")
keys_app = typer.Typer(help="The cluster key and the node and host keys derived from it.")


@token_app.command("create")
def token_create(
    user: str = typer.Option(..., "--user", help="whom the token speaks for"),
    role: str = typer.Option("user", "--role", help="admin, operator or user"),
    lifetime: str = typer.Option("30-00:00:00", "--lifetime", help="e.g. 12:00:00 or 7-0"),
    url: str | None = UrlOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Print a bearer token (admins only); use it as $PHALANX_TOKEN or in a token file."""
    try:
        seconds = parse_duration(lifetime)
    except ValueError as e:
        output.fail(f"--lifetime: {e}", 2)
    if seconds is None:
        output.fail("--lifetime: a token must expire: give a duration such as 30-0 (30 days)", 2)
    assert seconds is not None
    with output.client(url) as c:
        body = {"user": user, "role": role, "lifetime_s": float(seconds)}
        res = output.run(lambda: c.post("/v1/tokens", body))
    if as_json:
        output.emit(res)
    else:
        sys.stdout.write(res["token"] + "\n")
        output.say(
            "note:",
            "yellow",
            f"{role} token for {user}, valid for {format_duration(int(seconds))}; "
            "keep it secret (export PHALANX_TOKEN=... or save it to ~/.config/phalanx/token)",
        )


def whoami(url: str | None = UrlOpt, as_json: bool = JsonOpt) -> None:
    """Who the controllers take you for (user, role, and how you were identified)."""
    with output.client(url) as c:
        res = output.run(lambda: c.get("/v1/whoami"))
    if as_json:
        output.emit(res)
    else:
        output.console.print(f"{res['user']} ({res['role']}, {res['kind']} credential)")


@keys_app.command("init")
def keys_init(
    file: Path = typer.Option(Path("/etc/phalanx/cluster.jwks"), "--file", help="where to write"),
    kid: str | None = typer.Option(None, "--kid", help="key id (default: random)"),
) -> None:
    """Create the cluster key (controllers only; mode 600). Refuses to overwrite one."""
    from phalanx.auth import keys

    if file.exists():
        output.fail(f"{file} exists: add a key for a rotation with `phalanx keys add`", 2)
    keys.save(keys.KeySet([keys.new_key(kid)]), file)
    output.console.print(f"cluster key written to {file}")


@keys_app.command("add")
def keys_add(
    file: Path = typer.Option(Path("/etc/phalanx/cluster.jwks"), "--file"),
    kid: str | None = typer.Option(None, "--kid", help="key id (default: random)"),
) -> None:
    """Rotation, step 1: a new signing key; the old ones keep verifying until removed."""
    from phalanx.auth import keys
    from phalanx.errors import PhalanxError

    try:
        ks = keys.load(file)
        new = keys.new_key(kid)
        if any(k.kid == new.kid for k in ks.keys):
            output.fail(f"{file} already has a key {new.kid!r}", 2)
        keys.save(keys.KeySet([new, *ks.keys]), file)
    except (PhalanxError, ValueError) as e:
        output.fail(getattr(e, "message", str(e)), 2)
    output.console.print(
        f"added key {new.kid} to {file}; restart the controllers, derive and hand out the "
        "node and host keys again, then remove the old key"
    )


@keys_app.command("remove")
def keys_remove(
    kid: str = typer.Argument(..., help="the key id to revoke"),
    file: Path = typer.Option(Path("/etc/phalanx/cluster.jwks"), "--file"),
) -> None:
    """Rotation, step 2: revoke a key; credentials signed with it are refused from then on."""
    from phalanx.auth import keys
    from phalanx.errors import PhalanxError

    try:
        ks = keys.load(file)
    except PhalanxError as e:
        output.fail(e.message, 2)
    rest = [k for k in ks.keys if k.kid != kid]
    if len(rest) == len(ks.keys):
        output.fail(f"{file} has no key {kid!r} (it has {', '.join(k.kid for k in ks.keys)})", 2)
    if not rest:
        output.fail(f"{kid} is the only key in {file}: add a new one first", 2)
    keys.save(keys.KeySet(rest), file)
    output.console.print(f"removed key {kid} from {file}; restart the controllers")


@keys_app.command("derive")
def keys_derive(
    node: str | None = typer.Option(None, "--node", help="a compute node's name"),
    host: str | None = typer.Option(None, "--host", help="a login host's name (phalanx authd)"),
    file: Path = typer.Option(Path("/etc/phalanx/cluster.jwks"), "--file", help="cluster key"),
    out: Path = typer.Option(..., "--out", "-o", help="where to write the derived key (mode 600)"),
) -> None:
    """The key of one node or login host: it can speak for that host and its users only."""
    from phalanx.auth import keys
    from phalanx.errors import PhalanxError

    if (node is None) == (host is None):
        output.fail("give exactly one of --node NAME or --host NAME", 2)
    scope, name = ("node", node) if node else ("host", host)
    assert name is not None
    try:
        derived = keys.load(file).for_scope(scope, name)
    except (PhalanxError, ValueError) as e:
        output.fail(getattr(e, "message", str(e)), 2)
    keys.save(derived, out)
    output.console.print(f"key of {scope} {name} written to {out}")


def authd(
    name: str | None = typer.Option(None, "--name", help="this host's name (default: host name)"),
    key_file: Path | None = typer.Option(
        None,
        "--key-file",
        help="this host's key (default: $PHALANX_KEY_FILE, /etc/phalanx/host.jwks)",
    ),
    sock: Path | None = typer.Option(
        None, "--socket", help="default: $PHALANX_AUTH_SOCKET, else /run/phalanx/auth.sock"
    ),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Serve local credentials on a login host (as MUNGE does): users need no setup."""
    import os

    from phalanx.auth import localsock, service
    from phalanx.config import load_config
    from phalanx.daemon import setup_logging
    from phalanx.errors import PhalanxError

    host = name or socket.gethostname().split(".")[0]
    setup_logging(log_level, f"authd[{host}]")
    path = sock or Path(os.environ.get(localsock.ENV_SOCKET) or localsock.DEFAULT_SOCKET)
    try:
        config = load_config()
        keyset = service.host_keys(
            service.key_file(key_file, service.DEFAULT_HOST_KEY), "host", host
        )
        server = service.serve_local(keyset, config.cluster.name, config.auth.credential_ttl, path)
    except PhalanxError as e:
        output.fail(f"phalanx authd: {e.message}", 2)
    except OSError as e:
        output.fail(f"phalanx authd: cannot serve on {path}: {e.strerror or e}", 2)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logging.getLogger("phalanx.auth").info("authd for %s serving %s", host, path)
    stop.wait()
    server.close()
