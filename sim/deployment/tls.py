"""TLS certificates and SuperNode authentication keys for a Flower deployment, made with ``cryptography``.

What Flower 1.41 expects (read from the installed sources, ``flwr/superlink/cli/flower_superlink.py``,
``flwr/supernode/cli/flower_supernode.py``, ``flwr/cli/supernode/register.py``):

- SuperLink: ``--ssl-ca-certfile ca.crt --ssl-certfile superlink.crt --ssl-keyfile superlink.key`` (PEM).
  The same certificate serves the Fleet, Control and Runtime APIs, so its SANs must cover every name or
  IP the SuperNodes, the ``flwr`` CLI and the SuperLink's own SuperExec use to reach it.
- SuperNode / ``flwr`` CLI: ``--root-certificates ca.crt`` / ``root-certificates = ".../ca.crt"``.
- SuperNode authentication: an EC key pair on a NIST curve. The SuperNode reads its PRIVATE key with
  ``load_ssh_private_key`` -- i.e. the OpenSSH private-key format (``-----BEGIN OPENSSH PRIVATE KEY-----``),
  not PKCS#8 -- and ``flwr supernode register`` reads the PUBLIC key in OpenSSH format
  (``ecdsa-sha2-nistp384 AAAA...``). We also write a PKCS#8 PEM copy of the private key for other tools.

Private keys are written with mode 0600 (created with that mode, never world-readable in between).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from task.errors import UserError

DEFAULT_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
CERT_DAYS = 365
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _write(path: Path, data: bytes, private: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = 0o600 if private else 0o644
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)  # umask may have narrowed it; make it exact
    os.replace(tmp, path)
    return path


def _san_entries(hosts: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in hosts:
        host = host.strip().strip("[]")
        if not host:
            continue
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return entries


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpate"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def make_ca(days: int = CERT_DAYS) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    now = _dt.datetime.now(_dt.timezone.utc)
    name = _name("fedpate federation CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    return key, cert


def make_server_certificate(ca_key, ca_cert: x509.Certificate, hosts: Sequence[str],
                            days: int = CERT_DAYS) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    sans = _san_entries(hosts)
    if not sans:
        raise UserError("--host: at least one host name or IP address is needed for the SuperLink certificate")
    key = ec.generate_private_key(ec.SECP384R1())
    now = _dt.datetime.now(_dt.timezone.utc)
    first = hosts[0].strip().strip("[]")
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(first)).issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    return key, cert


def make_supernode_keys(out_dir: str | Path, name: str) -> dict[str, Path]:
    """One SuperNode's authentication key pair (EC P-384). Returns {"private", "private_pem", "public"}."""
    if not _NODE_NAME.match(name):
        raise UserError(f"SuperNode name {name!r}: expected letters, digits, '.', '_' or '-' (max 64)")
    out = Path(out_dir)
    key = ec.generate_private_key(ec.SECP384R1())
    private_ssh = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption())
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_ssh = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                               serialization.PublicFormat.OpenSSH)
    return {
        "private": _write(out / f"{name}.key", private_ssh, private=True),      # what flower-supernode reads
        "private_pem": _write(out / f"{name}.pem", private_pem, private=True),  # PKCS#8 copy
        "public": _write(out / f"{name}.pub", public_ssh + f" fedpate-{name}\n".encode(), private=False),
    }


def make_certificates(out_dir: str | Path, hosts: Sequence[str] | None = None,
                      supernodes: Sequence[str] = (), days: int = CERT_DAYS) -> dict:
    """Write a CA, a SuperLink certificate for ``hosts`` and one auth key pair per SuperNode.

    Layout (``out_dir``)::

        ca.crt  ca.key                      # keep ca.key offline / on the aggregator only
        superlink.crt  superlink.key        # the SuperLink machine
        supernodes/<name>.key|.pem|.pub     # .key (OpenSSH private) to that hospital; .pub to the SuperLink admin
        roster.txt                          # every hospital's public key: to every hospital (secure sums)

    Returns ``{"ca_cert", "ca_key", "server_cert", "server_key", "supernodes": {name: {"private",
    "private_pem", "public"}}, "roster"}`` (all Paths; ``roster`` only with two SuperNodes or more).
    """
    hosts = list(hosts) if hosts else list(DEFAULT_HOSTS)
    names = list(supernodes)
    if len(set(names)) != len(names):
        raise UserError(f"SuperNode names must be unique, got {names}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(days)
    server_key, server_cert = make_server_certificate(ca_key, ca_cert, hosts, days)
    pem_key = lambda k: k.private_bytes(serialization.Encoding.PEM,  # noqa: E731
                                        serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    paths: dict = {
        "ca_cert": _write(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), private=False),
        "ca_key": _write(out / "ca.key", pem_key(ca_key), private=True),
        "server_cert": _write(out / "superlink.crt", server_cert.public_bytes(serialization.Encoding.PEM),
                              private=False),
        "server_key": _write(out / "superlink.key", pem_key(server_key), private=True),
        "supernodes": {},
    }
    for name in names:
        paths["supernodes"][name] = make_supernode_keys(out / "supernodes", name)
    if len(names) >= 2:
        paths["roster"] = write_roster(out / ROSTER_FILE, {n: k["public"] for n, k in paths["supernodes"].items()})
    return paths


#: the consortium's roster of hospital keys, beside the certificates (every hospital gets a copy)
ROSTER_FILE = "roster.txt"


def write_roster(path: str | Path, public_keys: dict) -> Path:
    """The roster every hospital checks a secure sum's participants and keys against
    (``task.wire.secagg.Roster``): one line per hospital, ``<hospital-id> <its SuperNode public key>``, from the
    ``.pub`` files ``public_keys`` names (hospital -> path). Public: it holds no secret, but it must reach each
    hospital from this trusted machine, never through the aggregator (whoever controls it controls who the
    hospitals trust)."""
    from task.wire.secagg import Roster

    lines = []
    for name, pub in sorted(public_keys.items()):
        fields = Path(pub).read_text().split()
        if len(fields) < 2:
            raise UserError(f"{pub}: not an OpenSSH public key")
        lines.append(f"{name} {fields[0]} {fields[1]}")
    text = "".join(line + "\n" for line in lines)
    Roster.parse(text, str(path))   # what every hospital will parse: checked before it is written
    return _write(Path(path), text.encode(), private=False)


def verify_chain(ca_cert_path: str | Path, cert_path: str | Path) -> None:
    """Raise if ``cert_path`` was not signed by the CA in ``ca_cert_path`` (or is outside its validity)."""
    ca = x509.load_pem_x509_certificate(Path(ca_cert_path).read_bytes())
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    cert.verify_directly_issued_by(ca)
    now = _dt.datetime.now(_dt.timezone.utc)
    if not (cert.not_valid_before_utc <= now <= cert.not_valid_after_utc):
        raise ValueError(f"{cert_path}: certificate not valid now")


def certificate_sans(cert_path: str | Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in ext.get_values_for_type(x509.DNSName)] + \
           [str(v) for v in ext.get_values_for_type(x509.IPAddress)]
