"""Test certificates made with the `cryptography` package (in the test extra: they never skip): a CA, leaf
certificates it signs for 127.0.0.1 / localhost (usable as server and as client certificates), and a second CA
with a leaf of its own, which the first CA's peers must refuse."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=2)


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of the above
    other_client_cert: Path  # a leaf `other_ca` signed (for 127.0.0.1 too): right name, wrong CA
    other_client_key: Path


@dataclass(frozen=True)
class _Issuer:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR))


def _ca(directory: Path, name: str) -> tuple[Path, _Issuer]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_key(directory / f"{name}.key", key)
    return _write_cert(directory / f"{name}.pem", cert), _Issuer(subject, key)


def _leaf(directory: Path, name: str, issuer: _Issuer) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, issuer.name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
                           critical=False)
            .sign(issuer.key, hashes.SHA256()))
    return _write_cert(directory / f"{name}.pem", cert), _write_key(directory / f"{name}.key", key)


def make_certs(directory: Path) -> Certs:
    """A CA, a server and a client certificate it signed, and an unrelated CA with a client certificate of its
    own, as PEM files under `directory` (EC P-256 keys, valid for two days)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, issuer = _ca(directory, "ca")
    other_ca, other_issuer = _ca(directory, "other-ca")
    server_cert, server_key = _leaf(directory, "server", issuer)
    client_cert, client_key = _leaf(directory, "client", issuer)
    other_client_cert, other_client_key = _leaf(directory, "other-client", other_issuer)
    return Certs(ca=ca, server_cert=server_cert, server_key=server_key, client_cert=client_cert,
                 client_key=client_key, other_ca=other_ca, other_client_cert=other_client_cert,
                 other_client_key=other_client_key)
