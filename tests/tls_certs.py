"""Test certificates made with the `openssl` CLI: a CA, and leaf certificates it signs for 127.0.0.1 / localhost
(usable as server and as client certificates). The `cryptography` package is not in the venv."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of the above


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert), cwd=directory)
    return cert, key


def _leaf(directory: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    ext = directory / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(csr), cwd=directory)
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "2", "-extfile", str(ext), "-out", str(cert), cwd=directory)
    return cert, key


def make_certs(directory: Path) -> Certs:
    """A CA, a server and a client certificate it signed, and an unrelated CA; skips without `openssl`."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    other_ca, _ = _ca(directory, "other-ca")
    server_cert, server_key = _leaf(directory, "server", ca)
    client_cert, client_key = _leaf(directory, "client", ca)
    return Certs(ca=ca[0], server_cert=server_cert, server_key=server_key, client_cert=client_cert,
                 client_key=client_key, other_ca=other_ca)
