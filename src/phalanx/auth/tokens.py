"""Credentials as JWTs: minting (agents, `phalanx authd`, `phalanx token create`) and the
controller's verification, which turns a credential into an `Identity` or says exactly why not.

Four kinds, told apart by the `kind` claim and by which key signed them:

* ``local``: minted by a cluster host for the Unix user at the other end of its local socket
  (SO_PEERCRED); signed with that host's derived key; short-lived (`auth.credential_ttl`).
* ``agent``: minted by an agent for itself; signed with its node's derived key; names that node.
* ``token``: a bearer token made by `phalanx token create` (admin only); signed with the
  cluster key; carries its role.
* identity-provider tokens: RS256, verified against the site's JWKS file; the user is the
  configured claim.

Why one module: every rule a credential must pass (algorithm, key, signature, audience,
issuer, time, and that the key may speak for the claims) sits in `Verifier.verify`, and each
refusal is an `Unauthenticated` whose message names the rule it broke, never the secret.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from phalanx.auth.keys import Key, KeySet, split_kid
from phalanx.errors import ConfigError, Unauthenticated

ISSUER = "phalanx"
ROLES = ("admin", "operator", "user")
_CACHE_SIZE = 4096


@dataclass(frozen=True)
class Identity:
    """Who is calling, as verified. `role` is admin, operator, user or agent."""

    user: str
    role: str
    kind: str  # local | agent | token | idp
    uid: int | None = None
    node: str | None = None  # the agent's node, or the host that minted a local credential

    @property
    def actor(self) -> str:
        """How events record this caller: 'alice', 'node:node01', 'root@login1'."""
        if self.kind == "agent":
            return f"node:{self.node}"
        return self.user

    def at_least(self, role: str) -> bool:
        order = {"user": 0, "operator": 1, "admin": 2}
        return self.role in order and order[self.role] >= order[role]


def mint(key: Key, claims: dict[str, Any], *, lifetime: float, now: float | None = None) -> str:
    now = time.time() if now is None else now
    body = {
        "iss": ISSUER,
        "iat": int(now),
        "nbf": int(now),
        "exp": int(now + lifetime),
        "jti": uuid.uuid4().hex,
        **claims,
    }
    return jwt.encode(body, key.secret, algorithm="HS256", headers={"kid": key.kid})


def mint_local(
    keys: KeySet, *, user: str, uid: int, gid: int, cluster: str, lifetime: float
) -> str:
    """A local user's credential, signed with this host's key (its kid names the host)."""
    scope = keys.scope()
    claims = {"sub": user, "uid": uid, "gid": gid, "kind": "local", "aud": cluster}
    if scope:
        claims["host"] = scope[1]
    return mint(keys.signing, claims, lifetime=lifetime)


def mint_agent(keys: KeySet, *, node: str, cluster: str, lifetime: float) -> str:
    claims = {"sub": f"node:{node}", "node": node, "kind": "agent", "aud": cluster}
    return mint(keys.signing, claims, lifetime=lifetime)


def mint_token(keys: KeySet, *, user: str, role: str, cluster: str, lifetime: float) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    claims = {"sub": user, "role": role, "kind": "token", "aud": cluster}
    return mint(keys.signing, claims, lifetime=lifetime)


def _when(t: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))
    except (TypeError, ValueError):
        return str(t)


class Verifier:
    """Checks credentials for one cluster (its keys, name and role settings)."""

    def __init__(
        self,
        keys: KeySet,
        *,
        cluster: str,
        clock_skew: float = 30.0,
        admins: list[str] | None = None,
        operators: list[str] | None = None,
        idp_jwks: Path | None = None,
        idp_audience: str | None = None,
        idp_issuer: str | None = None,
        user_claim: str = "sub",
        role_claim: str | None = None,
    ) -> None:
        self.keys = keys
        self.cluster = cluster
        self.skew = clock_skew
        self.admins = set(admins or [])
        self.operators = set(operators or [])
        self.idp_keys: dict[str, Any] = {}
        self.idp_audience = idp_audience
        self.idp_issuer = idp_issuer
        self.user_claim = user_claim
        self.role_claim = role_claim
        if idp_jwks is not None:
            self.idp_keys = load_idp_keys(idp_jwks)
        self._cache: OrderedDict[str, tuple[Identity, float]] = OrderedDict()

    # ------------------------------------------------------------------ roles
    def _configured_role(self, user: str) -> str:
        if user in self.admins:
            return "admin"
        if user in self.operators:
            return "operator"
        return "user"

    # ------------------------------------------------------------------ verify
    def verify(self, token: str, now: float | None = None) -> Identity:
        now = time.time() if now is None else now
        hit = self._cache.get(token)
        if hit is not None and now < hit[1] + self.skew:
            self._cache.move_to_end(token)
            return hit[0]
        ident, exp = self._verify(token)
        self._cache[token] = (ident, exp)
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return ident

    def _verify(self, token: str) -> tuple[Identity, float]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"malformed credential: {e}", reason="malformed") from None
        alg = header.get("alg")
        kid = header.get("kid")
        if alg == "HS256":
            return self._verify_cluster(token, kid)
        if alg == "RS256" and self.idp_keys:
            return self._verify_idp(token, kid)
        accepted = "HS256 (cluster credentials)" + (
            " and RS256 (identity provider)" if self.idp_keys else ""
        )
        raise Unauthenticated(
            f"credential uses algorithm {alg!r}; this cluster accepts only {accepted}",
            reason="algorithm",
        )

    def _decode(self, token: str, key: Any, alg: str, audience: str, issuer: str | None) -> Any:
        try:
            return jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=audience,
                issuer=issuer,
                leeway=self.skew,
                options={"require": ["exp", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            exp = jwt.decode(token, options={"verify_signature": False}).get("exp")
            raise Unauthenticated(
                f"credential expired at {_when(exp)}", reason="expired", expired_at=exp
            ) from None
        except jwt.ImmatureSignatureError:
            nbf = jwt.decode(token, options={"verify_signature": False}).get("nbf")
            raise Unauthenticated(
                f"credential is not valid before {_when(nbf)} (check this host's clock)",
                reason="not_yet_valid",
            ) from None
        except jwt.InvalidAudienceError:
            aud = jwt.decode(token, options={"verify_signature": False}).get("aud")
            raise Unauthenticated(
                f"credential is for {aud!r}, not for {audience!r}", reason="audience"
            ) from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated(
                f"credential was not issued by {issuer!r}", reason="issuer"
            ) from None
        except jwt.InvalidSignatureError:
            raise Unauthenticated(
                "credential signature is invalid (forged, or signed with another cluster's key)",
                reason="signature",
            ) from None
        except jwt.MissingRequiredClaimError as e:
            raise Unauthenticated(
                f"credential lacks the {e.claim!r} claim", reason="malformed"
            ) from None
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"malformed credential: {e}", reason="malformed") from None

    def _verify_cluster(self, token: str, kid: Any) -> tuple[Identity, float]:
        if not isinstance(kid, str):
            raise Unauthenticated("credential names no key (kid header)", reason="malformed")
        key = self.keys.lookup(kid)
        if key is None:
            raise Unauthenticated(
                f"credential is signed with key {kid!r}, which this cluster does not (or no "
                "longer) accept",
                reason="unknown_key",
            )
        claims = self._decode(token, key.secret, "HS256", self.cluster, ISSUER)
        _, scope, name = split_kid(kid)
        kind = claims.get("kind")
        user = str(claims["sub"])
        exp = float(claims["exp"])
        if kind == "agent":
            if scope != "node" or claims.get("node") != name:
                raise Unauthenticated(
                    f"an agent credential must be signed with its own node's key "
                    f"(node {claims.get('node')!r}, key {kid!r})",
                    reason="scope",
                )
            return Identity(f"node:{name}", "agent", "agent", node=name), exp
        if kind == "local":
            if scope is not None and claims.get("host") != name:
                raise Unauthenticated(
                    f"local credential names host {claims.get('host')!r} but was signed by "
                    f"{scope} {name}",
                    reason="scope",
                )
            uid = claims.get("uid")
            if not isinstance(uid, int):
                raise Unauthenticated("local credential lacks a numeric uid", reason="malformed")
            role = "admin" if uid == 0 else self._configured_role(user)
            return Identity(user, role, "local", uid=uid, node=name), exp
        if kind == "token":
            if scope is not None:
                raise Unauthenticated(
                    f"bearer tokens are signed by the cluster key, not by {scope} {name}",
                    reason="scope",
                )
            role = claims.get("role")
            if role not in ROLES:
                raise Unauthenticated(f"token has an unknown role {role!r}", reason="malformed")
            return Identity(user, str(role), "token"), exp
        raise Unauthenticated(f"credential has an unknown kind {kind!r}", reason="malformed")

    def _verify_idp(self, token: str, kid: Any) -> tuple[Identity, float]:
        key = self.idp_keys.get(kid) if isinstance(kid, str) else None
        if key is None and len(self.idp_keys) == 1 and kid is None:
            key = next(iter(self.idp_keys.values()))
        if key is None:
            raise Unauthenticated(
                f"token is signed with identity-provider key {kid!r}, which is not in the "
                "configured JWKS (revoked, or from another provider)",
                reason="unknown_key",
            )
        assert self.idp_audience is not None  # config requires it with jwks_file
        claims = self._decode(token, key, "RS256", self.idp_audience, self.idp_issuer)
        user = claims.get(self.user_claim)
        if not isinstance(user, str) or not user:
            raise Unauthenticated(
                f"token lacks the user claim {self.user_claim!r}", reason="malformed"
            )
        role = self._configured_role(user)
        if self.role_claim:
            granted = claims.get(self.role_claim) or []
            granted = [granted] if isinstance(granted, str) else list(granted)
            role = next((r for r in ("admin", "operator") if r in granted), role)
        return Identity(user, role, "idp"), float(claims["exp"])


def load_idp_keys(path: Path) -> dict[str, Any]:
    """Public keys of the identity provider, by kid (a JWKS file, as IdPs publish)."""
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
            raise ValueError('it must be a JWKS document: {"keys": [{"kty": "RSA", ...}, ...]}')
        out: dict[str, Any] = {}
        for i, item in enumerate(doc["keys"]):
            if not isinstance(item, dict):
                raise ValueError(f"entry {i} of 'keys' is not a key (a JSON object)")
            if item.get("kty") != "RSA":
                raise ValueError(f"key {item.get('kid') or i!r} is not an RSA key (kty RSA)")
            jwk = jwt.PyJWK(item, algorithm="RS256")
            out[str(item.get("kid") or f"key{i}")] = jwk.key
    except FileNotFoundError:
        raise ConfigError(f"identity-provider JWKS {path} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError, jwt.PyJWTError) as e:
        raise ConfigError(f"identity-provider JWKS {path} is not valid: {e}") from None
    if not out:
        raise ConfigError(f"identity-provider JWKS {path} holds no key")
    return out


class MintedSource:
    """An agent's own credentials (or a login host's, for root), minted locally and renewed
    before they expire; a credential source for `phalanx.client.Client`."""

    RENEW_BEFORE = 30.0

    def __init__(self, mint: Any, lifetime: float) -> None:
        self._mint = mint
        self.lifetime = lifetime
        self._token: str | None = None
        self._expires = 0.0
        self.problem: str | None = None
        self.renew_hint = "this daemon mints its own credentials: check the host's clock and key"

    def token(self) -> str | None:
        now = time.time()
        if self._token is None or now >= self._expires - min(self.RENEW_BEFORE, self.lifetime / 3):
            self._token = self._mint()
            self._expires = now + self.lifetime
        return self._token

    def invalidate(self) -> None:
        self._token = None
