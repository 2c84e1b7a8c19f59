"""Certificates and keys for a throw-away local control plane.

Called by `testenv.cluster` and `testenv.kueue`. One CA signs the apiserver's serving certificate
(SANs for 127.0.0.1 and localhost) and an admin client certificate in `system:masters`; a separate
RSA key signs ServiceAccount tokens. A webhook server the apiserver calls on loopback (Kueue's)
gets its own CA and serving certificate (`create_loopback_serving_pki`), as envtest does for
webhooks. Everything is written under the cluster's temporary folder.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _sign(
    subject: x509.Name,
    public_key: rsa.RSAPublicKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
    now: datetime.datetime,
    *,
    ca: bool = False,
    usage: ExtendedKeyUsageOID | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def create_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = _key()
    ca_name = _name("rljob-testenv-ca")
    ca = _sign(ca_name, ca_key.public_key(), ca_name, ca_key, now, ca=True)

    serving_key = _key()
    serving = _sign(
        _name("kube-apiserver"),
        serving_key.public_key(),
        ca_name,
        ca_key,
        now,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes.default.svc"),
        ],
    )
    admin_key = _key()
    admin = _sign(
        _name("rljob-admin", "system:masters"),
        admin_key.public_key(),
        ca_name,
        ca_key,
        now,
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    sa_key = _key()

    pki = Pki(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.serving_key, serving_key)
    pki.admin_cert.write_bytes(admin.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.admin_key, admin_key)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


@dataclass(frozen=True)
class ServingPki:
    """A CA (the `caBundle` of a webhook client config) and the serving pair it signed."""

    ca_cert: Path
    cert: Path
    key: Path


def create_loopback_serving_pki(directory: Path, common_name: str) -> ServingPki:
    """A fresh CA and a serving certificate for 127.0.0.1 and localhost, written as `ca.crt`,
    `tls.crt` and `tls.key` (the file names controller-runtime's webhook server reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = _key()
    ca_name = _name(f"{common_name}-ca")
    ca = _sign(ca_name, ca_key.public_key(), ca_name, ca_key, now, ca=True)
    key = _key()
    cert = _sign(
        _name(common_name),
        key.public_key(),
        ca_name,
        ca_key,
        now,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    serving = ServingPki(ca_cert=directory / "ca.crt", cert=directory / "tls.crt", key=directory / "tls.key")
    serving.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    serving.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(serving.key, key)
    return serving
