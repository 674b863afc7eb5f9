"""Credentials for the in-process API tests: one test cluster key, tokens minted with it.

`AuthedClient` is the real TestClient with one convenience: a request that brings no
Authorization header gets the default (an admin token) or, on /v1/agents/NODE/..., that
node's agent credential, the way the real CLI and agents bring their own.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.testclient import TestClient

from phalanx.auth import keys
from phalanx.auth.tokens import mint_agent, mint_token

CLUSTER = "phalanx"
KEYS = keys.KeySet([keys.new_key("test")])
_AGENT_PATH = re.compile(r"^/v1/agents/([^/]+)/")


def token_for(user: str, role: str = "user", lifetime: float = 3600.0) -> str:
    return mint_token(KEYS, user=user, role=role, cluster=CLUSTER, lifetime=lifetime)


def as_user(user: str, role: str = "user") -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for(user, role)}"}


def as_agent(node: str) -> dict[str, str]:
    token = mint_agent(KEYS.for_scope("node", node), node=node, cluster=CLUSTER, lifetime=3600)
    return {"Authorization": f"Bearer {token}"}


ADMIN = as_user("admin", "admin")
ANONYMOUS = {"Authorization": ""}  # a request that must go without a credential


class AuthedClient(TestClient):
    def request(self, method: str, url: Any, **kw: Any) -> Any:  # type: ignore[override]
        headers = dict(kw.pop("headers", None) or {})
        if "Authorization" not in headers:
            m = _AGENT_PATH.match(str(url))
            headers.update(as_agent(m.group(1)) if m else ADMIN)
        elif not headers["Authorization"]:
            del headers["Authorization"]
        return super().request(method, url, headers=headers, **kw)


def commands_against(client: TestClient, monkeypatch: Any, user: str = "alice") -> None:
    """Point `phalanx` (cli.output.client) and the Slurm commands (slurm.common.client and the
    modules that imported it) at `client`'s app, as `user`, an operator: the commands then
    run in process over the test transport (test_cli_fuzz.py, test_terminal_output.py)."""
    import importlib
    import sys

    from phalanx.cli import output
    from phalanx.client import Client
    from phalanx.slurm.main import COMMANDS

    for command in COMMANDS:  # loaded now, so that their `client` is the one replaced
        importlib.import_module(f"phalanx.slurm.{command}")

    def make(_url: Any = None) -> Client:
        return Client(
            "http://testserver", token=token_for(user, "operator"), transport=client._transport
        )

    monkeypatch.setattr(output, "client", make)
    for name, module in list(sys.modules.items()):
        if name.startswith("phalanx.slurm.") and callable(getattr(module, "client", None)):
            monkeypatch.setattr(module, "client", make)
    monkeypatch.setenv("PHALANX_URL", "http://testserver")
