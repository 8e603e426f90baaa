"""``kaitian certs create DIR``: a graph's CA and one certificate per role, made with the openssl CLI.

Files: ``ca.pem``/``ca.key`` (the graph's own certificate authority) and ``<role>.pem``/
``<role>.key`` for each role of ``runtime/security.py`` (common name = role). Keys are ECDSA
P-256 (rustls, zenoh's TLS, takes them) and written 0600. Each role certificate is for both
TLS sides (serverAuth + clientAuth: every peer listens and connects) and names localhost,
127.0.0.1, ::1 and the ``--host`` names/addresses in its SANs, because zenoh checks the
server's certificate against the address it connects to.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kaitian_ros.runtime import security

OPENSSL = "openssl"
DEFAULT_DAYS = 365
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_SUBJECT = "/CN=kaitian graph CA"
_DNS_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"^(?=.{{1,253}}$)({_DNS_LABEL})(\.{_DNS_LABEL})*$")


class CertError(RuntimeError):
    """Certificates that cannot be made (bad argument, files in the way, openssl failed); one line."""


@dataclass(frozen=True)
class CreatedCerts:
    directory: Path
    files: tuple[str, ...]
    hosts: tuple[str, ...]


def output_files(roles: Sequence[str] = security.ROLES) -> tuple[str, ...]:
    return (security.CA_CERT, security.CA_KEY) + tuple(f"{r}.{ext}" for r in roles for ext in ("pem", "key"))


def san_entry(host: str) -> str:
    """``IP:...`` for an address, ``DNS:...`` for a host name; CertError for anything else."""
    try:
        return f"IP:{ipaddress.ip_address(host)}"
    except ValueError:
        pass
    if _DNS_NAME.match(host):
        return f"DNS:{host}"
    raise CertError(f"--host {host!r} is neither an IP address nor a DNS name")


def _openssl(args: list[str], cwd: Path) -> None:
    try:
        result = subprocess.run([OPENSSL, *args], cwd=cwd, capture_output=True, check=False, text=True, timeout=60)
    except FileNotFoundError:
        raise CertError(f"'{OPENSSL}' not found on PATH (kaitian certs create runs the openssl command)") from None
    if result.returncode != 0:
        detail = " ".join((result.stderr or result.stdout).split())[:300]
        raise CertError(f"openssl {args[0]} failed: {detail}")


def _new_key(path: Path) -> None:
    # PKCS#8 PEM ("BEGIN PRIVATE KEY"), unencrypted: the nodes read it unattended
    _openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path.name], path.parent)
    path.chmod(0o600)


def _serial() -> str:
    return "0x" + secrets.token_hex(16)  # random 128-bit serial, as CAs are expected to use


def create(directory: str | os.PathLike[str], *, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS,
           force: bool = False, roles: Sequence[str] = security.ROLES) -> CreatedCerts:
    """Write a fresh CA and one certificate per role into ``directory`` (created if needed).

    Refuses to replace existing files unless ``force``: replacing the CA locks out every
    process still holding a certificate of the old one.
    """
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= 36500:
        raise CertError(f"--days must be an integer in [1, 36500], got {days!r}")
    all_hosts = tuple(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    sans = ",".join(san_entry(h) for h in all_hosts)
    target = Path(directory).expanduser()
    names = output_files(roles)
    if target.exists() and not target.is_dir():
        raise CertError(f"{target} exists and is not a directory")
    present = [n for n in names if (target / n).exists()]
    if present and not force:
        raise CertError(f"{target} already holds {', '.join(present)} (add --force to replace them; "
                        f"certificates of the old CA then stop working)")
    target.mkdir(parents=True, exist_ok=True)
    # build everything in a private scratch directory next to the target, then move: a failure
    # half-way leaves the old files (or none) instead of a mix of two CAs
    with tempfile.TemporaryDirectory(prefix=".kaitian-certs-", dir=target) as scratch_name:
        scratch = Path(scratch_name)
        scratch.chmod(0o700)
        _new_key(scratch / security.CA_KEY)
        _openssl(["req", "-x509", "-new", "-key", security.CA_KEY, "-out", security.CA_CERT,
                  "-days", str(days), "-subj", CA_SUBJECT, "-set_serial", _serial(),
                  "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                  "-addext", "subjectKeyIdentifier=hash"], scratch)
        (scratch / "leaf.ext").write_text(
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n"
            f"subjectAltName={sans}\n")
        for role in roles:
            _new_key(scratch / f"{role}.key")
            _openssl(["req", "-new", "-key", f"{role}.key", "-subj", f"/CN={role}", "-out", f"{role}.csr"], scratch)
            _openssl(["x509", "-req", "-in", f"{role}.csr", "-CA", security.CA_CERT, "-CAkey", security.CA_KEY,
                      "-set_serial", _serial(), "-days", str(days), "-extfile", "leaf.ext",
                      "-out", f"{role}.pem"], scratch)
        for name in names:
            (scratch / name).chmod(0o600 if name.endswith(".key") else 0o644)
            os.replace(scratch / name, target / name)
    return CreatedCerts(target.resolve(), names, all_hosts)


def openssl_available() -> bool:
    return shutil.which(OPENSSL) is not None
