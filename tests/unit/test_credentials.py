"""Credentials: what the Verifier refuses (each with its reason) and accepts, key files, the
local credential socket, and the rate limiter's bound.

Every refusal is checked for its `reason` (what the API returns in details.reason and clients
act on) and for leaking no secret: no key's base64 text appears in any message.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import pwd
import socket
import threading
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.auth import keys as keyfiles
from phalanx.auth import localsock
from phalanx.auth.credentials import LocalService
from phalanx.auth.keys import Key, KeySet
from phalanx.auth.service import local_minter
from phalanx.auth.tokens import (
    Identity,
    Verifier,
    mint,
    mint_agent,
    mint_local,
    mint_token,
)
from phalanx.controller.access import TokenBuckets
from phalanx.errors import ConfigError, Unauthenticated

CLUSTER = "testcluster"
K1 = keyfiles.new_key("k1")
K2 = keyfiles.new_key("k2")
ALL_SECRETS = [K1, K2]


def secret_texts(*ks: Key) -> list[str]:
    out = []
    for k in ks:
        out.append(base64.urlsafe_b64encode(k.secret).rstrip(b"=").decode())
        out.append(base64.b64encode(k.secret).decode())
        out.append(k.secret.hex())
    return out


def assert_no_secret(text: str) -> None:
    for s in secret_texts(*ALL_SECRETS):
        assert s not in text


def refused(verifier: Verifier, token: str, reason: str, now: float | None = None) -> str:
    with pytest.raises(Unauthenticated) as e:
        verifier.verify(token, now=now)
    assert e.value.details.get("reason") == reason, (e.value.message, e.value.details)
    assert e.value.http_status == 401
    msg = e.value.message
    assert_no_secret(msg)
    assert_no_secret(json.dumps(e.value.to_body(), default=str))
    assert_no_secret(repr(e.value))
    return msg


def verifier(*ks: Key, **kw: Any) -> Verifier:
    return Verifier(KeySet(list(ks)), cluster=CLUSTER, **kw)


def user_token(ks: KeySet | None = None, **kw: Any) -> str:
    args: dict[str, Any] = {"user": "alice", "role": "user", "cluster": CLUSTER, "lifetime": 600}
    args.update(kw)
    return mint_token(ks or KeySet([K1]), **args)


def b64(obj: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


# ------------------------------------------------------------------ refusals


def test_a_good_token_verifies() -> None:
    ident = verifier(K1).verify(user_token())
    assert ident == Identity("alice", "user", "token")


def test_wrong_signature_another_clusters_key() -> None:
    other = Key("k1", os.urandom(32))  # same kid, different secret
    msg = refused(verifier(K1), user_token(KeySet([other])), "signature")
    assert "signature" in msg


def test_wrong_audience_another_cluster_name() -> None:
    msg = refused(verifier(K1), user_token(cluster="othercluster"), "audience")
    assert "othercluster" in msg and CLUSTER in msg


def test_alg_none_is_refused() -> None:
    now = int(time.time())
    claims = {
        "sub": "admin",
        "role": "admin",
        "kind": "token",
        "aud": CLUSTER,
        "iss": "phalanx",
        "exp": now + 600,
        "nbf": now,
    }
    for header in ({"alg": "none", "typ": "JWT"}, {"alg": "none", "kid": "k1"}):
        token = f"{b64(header)}.{b64(claims)}."
        msg = refused(verifier(K1), token, "algorithm")
        assert "'none'" in msg


def test_hs256_with_a_none_signature_segment_is_refused() -> None:
    """alg HS256 but the signature stripped: the signature check must not be skipped."""
    token = user_token()
    head, body, _ = token.split(".")
    with pytest.raises(Unauthenticated):
        verifier(K1).verify(f"{head}.{body}.")


def test_rs256_without_an_identity_provider_is_refused(tmp_path: Path) -> None:
    priv = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = time.time()
    token = jwt.encode({"sub": "alice", "aud": CLUSTER, "exp": now + 600}, priv, algorithm="RS256")
    msg = refused(verifier(K1), token, "algorithm")
    assert "RS256" in msg and "HS256" in msg


def test_expired() -> None:
    now = time.time()
    token = mint(
        K1,
        {"sub": "alice", "role": "user", "kind": "token", "aud": CLUSTER},
        lifetime=60,
        now=now - 3600,
    )
    msg = refused(verifier(K1, clock_skew=30), token, "expired")
    assert "expired at" in msg


def test_expired_within_the_skew_is_accepted() -> None:
    now = time.time()
    token = mint(
        K1,
        {"sub": "alice", "role": "user", "kind": "token", "aud": CLUSTER},
        lifetime=60,
        now=now - 80,
    )
    assert verifier(K1, clock_skew=30).verify(token).user == "alice"
    refused(verifier(K1, clock_skew=5), token, "expired")


def test_not_yet_valid_beyond_the_skew() -> None:
    now = time.time()
    claims = {"sub": "alice", "role": "user", "kind": "token", "aud": CLUSTER}
    future = mint(K1, claims, lifetime=600, now=now + 300)
    msg = refused(verifier(K1, clock_skew=30), future, "not_yet_valid")
    assert "clock" in msg
    near = mint(K1, claims, lifetime=600, now=now + 10)  # within the skew: fine
    assert verifier(K1, clock_skew=30).verify(near).user == "alice"


def test_missing_exp_or_sub_is_refused() -> None:
    for claims in (
        {"sub": "alice", "kind": "token", "role": "user", "aud": CLUSTER, "iss": "phalanx"},
        {"kind": "token", "role": "user", "aud": CLUSTER, "iss": "phalanx", "exp": 2e9},
    ):
        token = jwt.encode(claims, K1.secret, algorithm="HS256", headers={"kid": "k1"})
        refused(verifier(K1), token, "malformed")


def test_garbage_and_no_kid() -> None:
    refused(verifier(K1), "not-a-jwt", "malformed")
    token = jwt.encode({"sub": "a", "exp": 2e9}, K1.secret, algorithm="HS256")
    msg = refused(verifier(K1), token, "malformed")
    assert "kid" in msg


def test_unknown_kid_after_rotation_and_revocation() -> None:
    old = user_token(KeySet([K1]))
    # rotation step 1: k2 added in front (it signs), k1 still verifies
    rotating = verifier(K2, K1)
    new = user_token(KeySet([K2, K1]))
    assert jwt.get_unverified_header(new)["kid"] == "k2"
    assert rotating.verify(old).user == "alice"
    assert rotating.verify(new).user == "alice"
    # a node key derived from the old cluster key still works while it is listed
    agent_old = mint_agent(KeySet([K1]).for_scope("node", "node01"), node="node01",
                           cluster=CLUSTER, lifetime=60)  # fmt: skip
    assert rotating.verify(agent_old).node == "node01"
    # step 2: k1 removed: its tokens (and those of keys derived from it) are refused
    revoked = verifier(K2)
    msg = refused(revoked, old, "unknown_key")
    assert "'k1'" in msg
    refused(revoked, agent_old, "unknown_key")
    assert revoked.verify(new).user == "alice"


def test_a_malformed_kid_is_an_unknown_key() -> None:
    for kid in ("k1:bogus:x", "k1:node:", "k1:node:a:b", "k1:node:../etc"):
        token = jwt.encode(
            {"sub": "a", "kind": "token", "role": "admin", "aud": CLUSTER, "iss": "phalanx",
             "exp": time.time() + 60},
            K1.secret, algorithm="HS256", headers={"kid": kid},
        )  # fmt: skip
        refused(verifier(K1), token, "unknown_key")


# ------------------------------------------------------------------ key scopes


def node_keys(node: str, cluster_key: Key = K1) -> KeySet:
    return KeySet([cluster_key]).for_scope("node", node)


def test_an_agent_credential_verifies_for_its_node() -> None:
    token = mint_agent(node_keys("node01"), node="node01", cluster=CLUSTER, lifetime=60)
    assert verifier(K1).verify(token) == Identity("node:node01", "agent", "agent", node="node01")


def test_an_agent_credential_for_another_node_is_refused() -> None:
    # node01's key, claiming to be node02's agent
    token = mint_agent(node_keys("node01"), node="node02", cluster=CLUSTER, lifetime=60)
    msg = refused(verifier(K1), token, "scope")
    assert "node02" in msg and "node01" in msg


def test_an_agent_credential_signed_by_a_host_key_or_the_cluster_key_is_refused() -> None:
    host = KeySet([K1]).for_scope("host", "node01")
    refused(verifier(K1), mint_agent(host, node="node01", cluster=CLUSTER, lifetime=60), "scope")
    refused(
        verifier(K1), mint_agent(KeySet([K1]), node="node01", cluster=CLUSTER, lifetime=60), "scope"
    )


def test_a_local_credential_must_name_its_keys_host() -> None:
    login = KeySet([K1]).for_scope("host", "login1")
    ok = mint_local(login, user="alice", uid=1000, gid=1000, cluster=CLUSTER, lifetime=60)
    assert verifier(K1).verify(ok) == Identity("alice", "user", "local", uid=1000, node="login1")
    claims = {"sub": "alice", "uid": 1000, "gid": 1000, "kind": "local", "aud": CLUSTER}
    for host in ("login2", None):
        forged = {**claims, "host": host} if host else claims
        token = mint(login.signing, forged, lifetime=60)
        msg = refused(verifier(K1), token, "scope")
        assert "login1" in msg


def test_a_node_cannot_mint_tokens() -> None:
    """A 'token' (which carries its role) from a node's or host's key: a compromised node
    must not be able to make itself admin."""
    for ks in (node_keys("node01"), KeySet([K1]).for_scope("host", "login1")):
        token = mint_token(ks, user="admin", role="admin", cluster=CLUSTER, lifetime=60)
        msg = refused(verifier(K1), token, "scope")
        assert "cluster key" in msg


def test_unknown_kind_and_role_are_refused() -> None:
    token = mint(K1, {"sub": "x", "kind": "god", "aud": CLUSTER}, lifetime=60)
    refused(verifier(K1), token, "malformed")
    token = mint(K1, {"sub": "x", "kind": "token", "role": "root", "aud": CLUSTER}, lifetime=60)
    refused(verifier(K1), token, "malformed")
    token = mint(
        node_keys("n1").signing,
        {"sub": "x", "kind": "local", "uid": "0", "host": "n1", "aud": CLUSTER},
        lifetime=60,
    )
    refused(verifier(K1), token, "malformed")  # a uid as text is not a uid


# ------------------------------------------------------------------ roles


def test_local_uid_0_is_admin_and_others_by_the_lists() -> None:
    ks = node_keys("node01")
    v = verifier(K1, admins=["boss"], operators=["ops"])

    def local(user: str, uid: int) -> Identity:
        return v.verify(mint_local(ks, user=user, uid=uid, gid=uid, cluster=CLUSTER, lifetime=60))

    assert local("root", 0).role == "admin"
    assert local("toor", 0).role == "admin"  # uid 0 under another name is still root
    assert local("boss", 1001).role == "admin"
    assert local("ops", 1002).role == "operator"
    assert local("alice", 1003).role == "user"
    assert local("alice", 1003).node == "node01"
    assert local("alice", 1003).uid == 1003


def test_token_role_is_the_tokens_own() -> None:
    v = verifier(K1, admins=["alice"])
    assert v.verify(user_token(role="operator")).role == "operator"  # not promoted by the list


# ------------------------------------------------------------------ identity provider


@pytest.fixture(scope="module")
def idp_key() -> Any:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def write_jwks(path: Path, key: Any, kid: str = "idp1") -> Path:
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": kid, "use": "sig", "alg": "RS256"})
    path.write_text(json.dumps({"keys": [jwk]}))
    return path


def idp_token(key: Any, kid: str | None = "idp1", **claims: Any) -> str:
    body = {
        "preferred_username": "dana",
        "sub": "uuid-1234",
        "aud": "phalanx-api",
        "iss": "https://idp.example",
        "exp": time.time() + 600,
        **claims,
    }
    headers = {"kid": kid} if kid else None
    return jwt.encode(body, key, algorithm="RS256", headers=headers)


def idp_verifier(tmp_path: Path, key: Any, **kw: Any) -> Verifier:
    args: dict[str, Any] = {
        "idp_jwks": write_jwks(tmp_path / "idp.jwks", key),
        "idp_audience": "phalanx-api",
        "idp_issuer": "https://idp.example",
        "user_claim": "preferred_username",
        "role_claim": "groups",
    }
    args.update(kw)
    return verifier(K1, **args)


def test_idp_tokens_with_user_and_role_claims(tmp_path: Path, idp_key: Any) -> None:
    v = idp_verifier(tmp_path, idp_key, operators=["erin"])
    assert v.verify(idp_token(idp_key)) == Identity("dana", "user", "idp")
    assert v.verify(idp_token(idp_key, groups=["staff", "admin"])).role == "admin"
    assert v.verify(idp_token(idp_key, groups="operator")).role == "operator"
    assert v.verify(idp_token(idp_key, preferred_username="erin")).role == "operator"
    assert v.verify(idp_token(idp_key, kid=None)).user == "dana"  # one key: kid optional
    # cluster tokens still work beside it
    assert v.verify(user_token()).user == "alice"


def test_idp_refusals(tmp_path: Path, idp_key: Any) -> None:
    v = idp_verifier(tmp_path, idp_key)
    refused(v, idp_token(idp_key, aud="another-app"), "audience")
    msg = refused(v, idp_token(idp_key, iss="https://evil.example"), "issuer")
    assert "https://idp.example" in msg
    refused(v, idp_token(idp_key, exp=time.time() - 3600), "expired")
    refused(v, idp_token(idp_key, kid="idp-other"), "unknown_key")
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    refused(v, idp_token(other), "signature")
    refused(v, idp_token(idp_key, preferred_username=None), "malformed")
    # an HS256 token "signed" with the IdP's public key (algorithm confusion): refused
    pem = idp_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    head = b64({"alg": "HS256", "typ": "JWT", "kid": "idp1"})
    body = b64({"sub": "x", "aud": "phalanx-api", "exp": time.time() + 60})
    sig = hmac.new(pem, f"{head}.{body}".encode(), hashlib.sha256).digest()
    token = f"{head}.{body}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"
    refused(v, token, "unknown_key")


def test_bad_jwks_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        verifier(K1, idp_jwks=tmp_path / "missing.jwks", idp_audience="a")
    bad = ("not json", "{}", "[]", '{"keys": []}', '{"keys": "abc"}', '{"keys": ["abc"]}')
    for text in (*bad, '{"keys": [{"kty": "RSA"}]}', '{"keys": [{"kty": "oct", "k": "AAAA"}]}'):
        (tmp_path / "bad.jwks").write_text(text)
        with pytest.raises(ConfigError, match=r"bad\.jwks"):
            verifier(K1, idp_jwks=tmp_path / "bad.jwks", idp_audience="a")


# ------------------------------------------------------------------ key files


def test_keys_round_trip_and_repr_hides_the_secret(tmp_path: Path) -> None:
    path = tmp_path / "cluster.jwks"
    keyfiles.save(KeySet([K1, K2]), path)
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = keyfiles.load(path)
    assert [k.kid for k in loaded.keys] == ["k1", "k2"]
    assert loaded.keys[0].secret == K1.secret
    for k in (K1, K2, *loaded.keys, keyfiles.derive(K1, "node", "n1")):
        for text in (repr(k), str(k), f"{k}", repr([k]), repr(loaded.keys)):
            assert_no_secret(text)
            assert k.kid in text or "Key" in text


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666])
def test_a_key_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "cluster.jwks"
    keyfiles.save(KeySet([K1]), path)
    path.chmod(mode)
    with pytest.raises(ConfigError) as e:
        keyfiles.load(path)
    assert "readable by others" in e.value.message
    assert f"chmod 600 {path}" in e.value.message
    assert_no_secret(e.value.message)


K1_TEXT = base64.urlsafe_b64encode(K1.secret).rstrip(b"=").decode()
MALFORMED = {
    "not json": "{nope",
    "no keys": "{}",
    "keys not a list": '{"keys": 5}',
    "keys a string": '{"keys": "abc"}',
    "a key not an object": '{"keys": ["abc"]}',
    "document a list": "[1, 2]",
    "no key at all": '{"keys": []}',
    "an RSA key": json.dumps({"keys": [{"kty": "RSA", "kid": "k1", "k": K1_TEXT}]}),
    "no kid": json.dumps({"keys": [{"kty": "oct", "k": K1_TEXT}]}),
    "no secret": json.dumps({"keys": [{"kty": "oct", "kid": "k1"}]}),
    "a short secret": json.dumps({"keys": [{"kty": "oct", "kid": "k1", "k": K1_TEXT[:20]}]}),
    "bad base64": json.dumps({"keys": [{"kty": "oct", "kid": "k1", "k": K1_TEXT[:-1] + "!"}]}),
    "a malformed kid": json.dumps({"keys": [{"kty": "oct", "kid": "a:b", "k": K1_TEXT}]}),
    "secret as a number": json.dumps({"keys": [{"kty": "oct", "kid": "k1", "k": 12345}]}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_key_files_are_refused_clearly(tmp_path: Path, case: str) -> None:
    path = tmp_path / "cluster.jwks"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(MALFORMED[case])
    with pytest.raises(ConfigError) as e:
        keyfiles.load(path)
    assert str(path) in e.value.message
    assert K1_TEXT not in e.value.message
    assert K1_TEXT[:20] not in e.value.message
    assert_no_secret(e.value.message)


def test_missing_key_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        keyfiles.load(tmp_path / "none.jwks")


def test_derived_keys_differ_per_node_and_per_cluster_key() -> None:
    a = keyfiles.derive(K1, "node", "n1")
    assert a.kid == "k1:node:n1"
    assert a.secret != keyfiles.derive(K1, "node", "n2").secret
    assert a.secret != keyfiles.derive(K1, "host", "n1").secret
    assert a.secret != keyfiles.derive(K2, "node", "n1").secret
    assert a.secret == keyfiles.derive(K1, "node", "n1").secret
    with pytest.raises(ValueError):
        keyfiles.derive(K1, "node", "../n1")
    with pytest.raises(ConfigError, match="not of node n2"):
        node_keys("n1").for_scope("node", "n2")


# ------------------------------------------------------------------ the local socket


@pytest.fixture
def served(tmp_path: Path) -> Any:
    servers: list[localsock.CredentialServer] = []

    def start(path: Path, ks: KeySet | None = None) -> localsock.CredentialServer:
        keys = ks or KeySet([K1]).for_scope("host", "login1")
        server = localsock.CredentialServer(path, local_minter(keys, CLUSTER, 120.0))
        server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


def test_the_socket_hands_out_the_callers_own_credential(tmp_path: Path, served: Any) -> None:
    path = tmp_path / "auth.sock"
    served(path)
    assert path.stat().st_mode & 0o777 == 0o666
    source = LocalService(path)
    token = source.token()
    assert token is not None, source.problem
    ident = verifier(K1).verify(token)
    me = pwd.getpwuid(os.getuid()).pw_name
    assert ident.user == me
    assert ident.uid == os.getuid()
    assert ident.kind == "local" and ident.node == "login1"
    assert ident.role == ("admin" if os.getuid() == 0 else "user")
    assert source.token() == token  # cached while fresh
    source.invalidate()
    again = source.token()
    assert again is not None and verifier(K1).verify(again).user == me


def test_a_long_socket_path_works(tmp_path: Path, served: Any) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "auth.sock"
    assert len(str(path).encode()) > 108
    served(path)
    token = LocalService(path).token()
    assert token is not None
    assert verifier(K1).verify(token).uid == os.getuid()


def test_a_dead_socket_gives_a_clear_problem(tmp_path: Path) -> None:
    missing = LocalService(tmp_path / "nobody.sock", wait=0)
    assert missing.token() is None
    assert missing.problem is not None
    assert "nobody.sock" in missing.problem and "did not answer" in missing.problem
    assert "PHALANX_TOKEN" in missing.problem
    # a socket file left behind by a service that died: refused after the wait, not hung
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    source = LocalService(stale, wait=0.5)
    started = time.monotonic()
    assert source.token() is None
    assert 0.5 <= time.monotonic() - started < 5
    assert source.problem is not None and "stale.sock" in source.problem
    assert "waited 0.5s for it" in source.problem
    # a host without the service at all (no such directory): no wait
    nowhere = LocalService(tmp_path / "no-such-dir" / "auth.sock", wait=30)
    started = time.monotonic()
    assert nowhere.token() is None and time.monotonic() - started < 5


def test_a_restarting_service_is_waited_for(
    tmp_path: Path, served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agent or authd restarts: its socket is gone for a moment. A command on the host
    waits for it (bounded), says so on stderr, and gets its credential."""
    path = tmp_path / "auth.sock"
    timer = threading.Timer(1.5, served, args=(path,))
    timer.start()
    try:
        source = LocalService(path, wait=30)
        token = source.token()
    finally:
        timer.join()
    assert token is not None, source.problem
    assert verifier(K1).verify(token).uid == os.getuid()
    assert "waiting up to 30s for the local credential service" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "1e9"])
def test_a_bad_auth_wait_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("PHALANX_AUTH_WAIT", value)
    source = LocalService(tmp_path / "auth.sock")
    assert source.token() is None
    assert source.problem is not None and "$PHALANX_AUTH_WAIT must be" in source.problem


def test_a_stale_socket_file_is_replaced_and_a_live_one_kept(tmp_path: Path, served: Any) -> None:
    path = tmp_path / "auth.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    served(path)  # the dead one is replaced
    assert LocalService(path).token() is not None
    with pytest.raises(OSError, match="already served"):
        served(path)
    assert LocalService(path).token() is not None  # the first server still answers


def test_a_service_that_cannot_mint_says_so(tmp_path: Path) -> None:
    def broken(user: str, uid: int, gid: int) -> tuple[str, float]:
        raise RuntimeError("key file unreadable")

    path = tmp_path / "auth.sock"
    server = localsock.CredentialServer(path, broken)
    server.start()
    try:
        source = LocalService(path)
        assert source.token() is None
        assert source.problem is not None and "cannot mint" in source.problem
    finally:
        server.close()
    assert not path.exists()


# ------------------------------------------------------------------ rate limits


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 100),
    burst=st.integers(1, 50),
    calls=st.lists(
        st.tuples(st.floats(0, 5), st.integers(1, 60)),  # (seconds since the last, n)
        max_size=60,
    ),
)
def test_buckets_never_grant_more_than_burst_plus_rate(
    rate: float, burst: int, calls: list[tuple[float, int]]
) -> None:
    """Over any run of calls: granted <= burst + rate * elapsed, plus at most the excess of
    one request larger than the burst (it may go when the bucket is full, then owes it)."""
    b = TokenBuckets(rate, burst)
    now, granted, biggest = 1000.0, 0.0, 0
    start = now
    for gap, n in calls:
        now += gap
        wait = b.take("u", n, now=now)
        if wait == 0.0:
            granted += n
            biggest = max(biggest, n)
        else:
            assert wait > 0
            # the wait it names is enough: the same call after it is granted (when no
            # other call comes in between)
            probe = TokenBuckets(rate, burst)
            probe._state = dict(b._state)
            assert probe.take("u", n, now=now + wait + 1e-6) == 0.0
        excess = max(0, biggest - burst)
        assert granted <= burst + rate * (now - start) + excess + 1e-6


@settings(max_examples=100, deadline=None)
@given(rate=st.floats(0.1, 10), burst=st.integers(1, 20), n=st.integers(1, 100))
def test_a_request_larger_than_the_burst_then_owes_it(rate: float, burst: int, n: int) -> None:
    b = TokenBuckets(rate, burst)
    assert b.take("u", n, now=0.0) == 0.0  # a full bucket lets any one request go
    wait = b.take("u", 1, now=0.0)  # the bucket holds burst - n now (below 0: a debt)
    assert wait == pytest.approx(max(0, 1 + n - burst) / rate)
    assert b.take("other", 1, now=0.0) == 0.0  # per key
