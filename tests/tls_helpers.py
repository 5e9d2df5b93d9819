"""Throwaway certificates for the TLS tests, made with the ``openssl`` command.

``make_pki(directory)`` writes two independent CAs: ``ca`` signs the certificates of
engines ``a`` and ``b``; ``other`` signs ``x`` (a peer the first CA does not know).  Keys
are unencrypted EC P-256, valid for two days.  Tests that need them skip when ``openssl``
is not installed (:func:`require_openssl`).
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import pytest

__all__ = ["Pki", "make_pki", "require_openssl", "tls_config"]

_LEAF_EXT = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
             "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1\n")


@dataclass(frozen=True)
class Pki:
    """Paths of the files :func:`make_pki` wrote (strings, as the options take them)."""

    dir: Path

    def cert(self, name: str) -> str:
        return str(self.dir / f"{name}.pem")

    def key(self, name: str) -> str:
        return str(self.dir / f"{name}.key")

    def ca(self, name: str = "ca") -> str:
        return str(self.dir / f"{name}.pem")


def require_openssl() -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")


def _openssl(directory: Path, *args: str) -> None:
    done = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"


def _new_key(directory: Path, name: str) -> None:
    _openssl(directory, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key")


def _ca(directory: Path, name: str) -> None:
    _new_key(directory, name)
    _openssl(directory, "req", "-x509", "-new", "-key", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN=datadist test {name}", "-sha256",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def _leaf(directory: Path, name: str, ca: str) -> None:
    _new_key(directory, name)
    _openssl(directory, "req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj",
             f"/CN=datadist engine {name}")
    (directory / "leaf.ext").write_text(_LEAF_EXT)
    _openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-sha256", "-extfile", "leaf.ext")


def make_pki(directory: Path) -> Pki:
    """CAs ``ca`` and ``other``; engines ``a`` and ``b`` signed by ``ca``, ``x`` by ``other``."""
    require_openssl()
    for ca in ("ca", "other"):
        _ca(directory, ca)
    for name, ca in (("a", "ca"), ("b", "ca"), ("x", "other")):
        _leaf(directory, name, ca)
    return Pki(directory)


def tls_config(pki: Pki, name: str, ca: str = "ca") -> Dict[str, str]:
    """``LLMConfig`` property values giving an engine certificate ``name`` and trust in ``ca``."""
    return {"tls_cert_file": pki.cert(name), "tls_key_file": pki.key(name), "tls_ca_file": pki.ca(ca)}
