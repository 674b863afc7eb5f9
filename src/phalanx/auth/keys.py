"""Key files: the cluster key, and the per-node and per-host keys derived from it.

Why derived keys: every cluster host must be able to mint credentials for its local users
(as MUNGE does), but a compromised compute node must not be able to act as another node's
agent. So only controllers hold the cluster key; a node gets `HMAC(cluster key, "node:NAME")`
and a login host `HMAC(cluster key, "host:NAME")`. A controller derives the same key from a
credential's `kid` header, so it needs no list of nodes, and a credential signed with node01's
key can only ever speak for node01.

Files are JWKS documents of symmetric (``kty: oct``) keys, written 0600::

    {"keys": [{"kty": "oct", "kid": "k2", "k": "<base64url>", "alg": "HS256"}, ...]}

The first key signs; every key listed verifies. Rotating is: add a new key first (controllers
then accept both, as Slurm's slurm.jwks allows), hand out the derived keys, then remove the old
one (credentials signed with it are refused from then on). A derived key's kid is
``<cluster kid>:node:<name>`` or ``<cluster kid>:host:<name>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import ConfigError

KID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
SCOPES = ("node", "host")
MIN_KEY_BYTES = 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Key:
    kid: str
    secret: bytes = b""

    def __repr__(self) -> str:  # a key never shows up in a log line or a traceback
        return f"Key(kid={self.kid!r})"


def derive(cluster: Key, scope: str, name: str) -> Key:
    """The key of node or host `name`, derived from one cluster key."""
    if scope not in SCOPES:
        raise ValueError(f"unknown key scope {scope!r}: use one of {', '.join(SCOPES)}")
    if not NAME_RE.match(name):
        raise ValueError(f"invalid {scope} name {name!r}")
    digest = hmac.new(cluster.secret, f"phalanx:{scope}:{name}".encode(), hashlib.sha256)
    return Key(f"{cluster.kid}:{scope}:{name}", digest.digest())


def split_kid(kid: str) -> tuple[str, str | None, str | None]:
    """'k1' -> ('k1', None, None); 'k1:node:node01' -> ('k1', 'node', 'node01')."""
    parts = kid.split(":")
    if len(parts) == 1:
        return parts[0], None, None
    if len(parts) == 3 and parts[1] in SCOPES:
        return parts[0], parts[1], parts[2]
    raise ValueError(f"malformed key id {kid!r}")


class KeySet:
    """The keys one process holds: a cluster key set (controllers) or one host's keys."""

    def __init__(self, keys: list[Key], *, path: Path | None = None) -> None:
        if not keys:
            raise ConfigError(f"key file {path} holds no key" if path else "no key given")
        self.keys = keys
        self.path = path

    @property
    def signing(self) -> Key:
        return self.keys[0]

    @property
    def is_cluster(self) -> bool:
        """Cluster keys have a plain kid; a node's or host's file holds derived keys."""
        return split_kid(self.signing.kid)[1] is None

    def scope(self) -> tuple[str, str] | None:
        """('node', 'node01') for a node's key file, None for the cluster key."""
        _, scope, name = split_kid(self.signing.kid)
        return (scope, name) if scope and name else None

    def for_scope(self, scope: str, name: str) -> KeySet:
        """The keys `name` should hold: derived here from cluster keys, or these very keys if
        they already are that host's (a node given its own key file)."""
        if self.is_cluster:
            return KeySet([derive(k, scope, name) for k in self.keys])
        if self.scope() != (scope, name):
            raise ConfigError(
                f"key file {self.path} holds the keys of {':'.join(self.scope() or ())}, "
                f"not of {scope} {name}: give this host its own (phalanx keys derive)"
            )
        return self

    def lookup(self, kid: str) -> Key | None:
        """The key that verifies a credential with this kid, or None (unknown or revoked)."""
        try:
            base, scope, name = split_kid(kid)
        except ValueError:
            return None
        for k in self.keys:
            if k.kid == kid:
                return k
        if self.is_cluster and scope and name and NAME_RE.match(name):
            for k in self.keys:
                if k.kid == base:
                    return derive(k, scope, name)
        return None

    def to_jwks(self) -> dict[str, object]:
        return {
            "keys": [
                {"kty": "oct", "kid": k.kid, "k": _b64(k.secret), "alg": "HS256"} for k in self.keys
            ]
        }


def new_key(kid: str | None = None) -> Key:
    kid = kid or f"k{secrets.token_hex(4)}"
    if not KID_RE.match(kid):
        raise ValueError(f"invalid key id {kid!r}: letters, digits, '_', '.', '-' only")
    return Key(kid, secrets.token_bytes(MIN_KEY_BYTES))


def load(path: Path) -> KeySet:
    """Read a key file; refuse one that others can read (it would let them be anyone)."""
    try:
        st = path.stat()
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"key file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read key file {path}: {e.strerror or e}") from None
    if st.st_mode & 0o077:
        raise ConfigError(
            f"key file {path} is readable by others (mode {st.st_mode & 0o777:o}): chmod 600 {path}"
        )
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
            raise ValueError('it must be a JWKS document: {"keys": [{"kty": "oct", ...}, ...]}')
        keys = []
        for i, item in enumerate(doc["keys"]):
            if not isinstance(item, dict):
                raise ValueError(f"entry {i} of 'keys' is not a key (a JSON object)")
            if item.get("kty") != "oct":
                raise ValueError(f"key {item.get('kid')!r} is not a symmetric (oct) key")
            kid = str(item["kid"])
            split_kid(kid)
            secret = _unb64(str(item["k"]))
            if len(secret) < MIN_KEY_BYTES:
                raise ValueError(f"key {kid!r} is shorter than {MIN_KEY_BYTES} bytes")
            keys.append(Key(kid, secret))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"key file {path} is not a valid key set: {e}") from None
    return KeySet(keys, path=path)


def save(keyset: KeySet, path: Path) -> None:
    """Write atomically with mode 0600 (the temporary file is never readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(keyset.to_jwks(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load_or_create(path: Path) -> KeySet:
    """The cluster key at `path`, created on first use (a local or single-host cluster).

    Created with link(2), which fails if the file exists: of two controllers starting at once
    on one state dir, one creates the key and both load that one.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        save(KeySet([new_key()]), tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return load(path)
