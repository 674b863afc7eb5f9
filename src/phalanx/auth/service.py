"""What a cluster host runs to give its users and its agent credentials (agent, `authd`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from phalanx.auth import keys as keyfiles
from phalanx.auth import localsock
from phalanx.auth.tokens import MintedSource, mint_agent, mint_local

ENV_KEY_FILE = "PHALANX_KEY_FILE"
DEFAULT_NODE_KEY = "/etc/phalanx/node.jwks"
DEFAULT_HOST_KEY = "/etc/phalanx/host.jwks"


def key_file(given: Path | None, default: str) -> Path:
    return given or Path(os.environ.get(ENV_KEY_FILE) or default)


def host_keys(path: Path, scope: str, name: str) -> keyfiles.KeySet:
    """This host's keys: its own derived key file, or derived here from the cluster key (a
    single-host cluster, where the agents run beside the controllers)."""
    return keyfiles.load(path).for_scope(scope, name)


def local_minter(keys: keyfiles.KeySet, cluster: str, ttl: float) -> localsock.Minter:
    def mint(user: str, uid: int, gid: int) -> tuple[str, float]:
        token = mint_local(keys, user=user, uid=uid, gid=gid, cluster=cluster, lifetime=ttl)
        return token, time.time() + ttl

    return mint


def serve_local(
    keys: keyfiles.KeySet, cluster: str, ttl: float, path: Path
) -> localsock.CredentialServer:
    server = localsock.CredentialServer(path, local_minter(keys, cluster, ttl))
    server.start()
    return server


def agent_source(keys: keyfiles.KeySet, node: str, cluster: str, ttl: float) -> MintedSource:
    return MintedSource(lambda: mint_agent(keys, node=node, cluster=cluster, lifetime=ttl), ttl)
