"""The API over HTTPS: a controller with `[auth] tls_cert`/`tls_key` serves TLS, a client that
trusts the CA (`verify=` / $PHALANX_CA_FILE) works, one that does not is refused, and the
credential still decides who the caller is."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from phalanx.client import Client
from phalanx.errors import ControllerUnavailable, Unauthenticated
from system.harness import Cluster, Daemon, wait_for

pytestmark = pytest.mark.system


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("phalanx test CA"))
        .issuer_name(_name("phalanx test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = d / "ca.pem", d / "server.pem", d / "server.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return ca_file, cert_file, key_file


@pytest.mark.timeout(120)
def test_controller_serves_https(cluster: Cluster, tmp_path: Path) -> None:
    ca, cert, key = make_pki(tmp_path)
    config = tmp_path / "phalanx.toml"
    config.write_text(f'[auth]\ntls_cert = "{cert}"\ntls_key = "{key}"\n')
    args = ["controller", "--state-dir", str(cluster.state_dir), "--port", str(cluster.port)]
    env = cluster.env(PHALANX_CONFIG=str(config))
    d = Daemon("ctl-1", "controller", args, cluster.logs / "ctl-1.log", env).spawn()
    cluster.daemons["ctl-1"] = d
    url = f"https://127.0.0.1:{cluster.port}"

    def up() -> bool:
        d.check_running()
        return (
            httpx.get(
                url + "/healthz", verify=ssl.create_default_context(cafile=ca), timeout=5
            ).status_code
            == 200
        )

    wait_for(up, what="the controller to answer over HTTPS")
    with Client(url, token=cluster.admin_token, verify=str(ca)) as c:
        assert c.get("/v1/whoami")["user"] == "root"
    with Client(url, token=cluster.token("alice"), verify=str(ca)) as c:
        assert c.get("/v1/whoami") == {
            "user": "alice",
            "role": "user",
            "kind": "token",
            "uid": None,
            "cluster": "phalanx",
        }
    # a client that does not trust the CA never sends its request
    with (
        Client(url, token=cluster.admin_token) as c,
        pytest.raises(ControllerUnavailable, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        c.get("/v1/whoami")
    # TLS does not stand in for a credential
    with Client(url, token="not-a-token", verify=str(ca)) as c, pytest.raises(Unauthenticated):
        c.get("/v1/whoami")
    # and nothing answers plain HTTP on that port
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{cluster.port}/healthz", timeout=5).raise_for_status()
