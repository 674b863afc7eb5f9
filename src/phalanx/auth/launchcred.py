"""Step launch credentials: a controller's word that a node may start these step tasks.

With direct step launch (docs/slurm.md, "What a step costs"), srun hands each node's share of
a step to that node's agent itself, as Slurm's srun hands tasks to the slurmds with a job
credential signed by slurmctld.  The agent must start only what a controller recorded, so the
controller signs each node's launch item with that node's derived key (auth/keys.py: only the
controllers and that node hold it): srun, which relays it, cannot alter it, and a credential
for node01 is worthless to node02.

A credential expires (``expires_at`` inside the signed item, from ``steps.launch_ttl``), and
starting a step twice is harmless anyway (the agent starts a step's tasks once: a replay
within the lifetime finds them started or forgotten).  Everything here is pure: no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

from phalanx.auth.keys import Key, KeySet

EXPIRES = "expires_at"


class LaunchRefused(Exception):
    """A launch credential that does not hold: the message says why (for the agent's log and
    srun's fallback)."""


def _canonical(item: dict[str, Any]) -> bytes:
    return json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _mac(key: Key, item: dict[str, Any]) -> str:
    digest = hmac.new(key.secret, _canonical(item), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def sign(key: Key, item: dict[str, Any], *, now: float, ttl: float) -> dict[str, Any]:
    """The credential for one node's launch `item`, signed with that node's key: what srun
    sends to the node's agent as is."""
    signed = {**item, EXPIRES: now + ttl}
    return {"item": signed, "kid": key.kid, "sig": _mac(key, signed)}


def verify(keys: KeySet, node: str, cred: Any, *, now: float) -> dict[str, Any]:
    """The launch item of a credential addressed to `node` and signed with one of its keys;
    LaunchRefused otherwise."""
    if not isinstance(cred, dict):
        raise LaunchRefused("not a launch credential")
    item, kid, sig = cred.get("item"), cred.get("kid"), cred.get("sig")
    if not isinstance(item, dict) or not isinstance(kid, str) or not isinstance(sig, str):
        raise LaunchRefused("a launch credential needs item, kid and sig")
    key = next((k for k in keys.keys if k.kid == kid), None)
    if key is None:
        raise LaunchRefused(f"signed with key {kid!r}, which this node does not hold")
    if not hmac.compare_digest(_mac(key, item), sig):
        raise LaunchRefused("bad signature")
    if item.get("node") != node:
        raise LaunchRefused(f"addressed to node {item.get('node')!r}, not {node!r}")
    expires = item.get(EXPIRES)
    if not isinstance(expires, int | float) or now > float(expires):
        raise LaunchRefused("expired")
    return item
