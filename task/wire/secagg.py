"""The cryptographic building blocks of the secure sum, all taken from libraries (no cryptography here).

Both parties of the SecAgg+ protocol (Bell, Bonawitz, Gascón, Lepoint & Raykova, CCS 2020; the protocol
of Bonawitz et al., CCS 2017, on a communication graph) need the same primitives, so they live in the sim
core: the hospital side is ``clients/secure.py``, the aggregator side ``server/secure.py``.

* key agreement: Flower's ``flwr.supercore.primitives.asymmetric`` (ECDH on SECP384R1) and
  ``flwr.common.secure_aggregation.crypto.symmetric_encryption.generate_shared_key`` (ECDH + HKDF-SHA256);
* authenticated encryption of the key shares: Flower's ``encrypt`` / ``decrypt`` (Fernet);
* Shamir secret sharing: Flower's ``create_shares`` / ``combine_shares`` (PyCryptodome);
* the share message layout: Flower's ``share_keys_plaintext_concat`` / ``share_keys_plaintext_separate``;
* signatures of each hospital's advertised keys over the sum's setup (:func:`setup_statement`), checked
  against the consortium's :class:`Roster`: Flower's ``sign_message`` / ``verify_signature`` (ECDSA with
  SHA-256) on the hospitals' SuperNode authentication keys, loaded by ``cryptography``;
* mask expansion: AES-256 in counter mode from ``cryptography`` (the library Flower's primitives use),
  keyed by the 32-byte agreed key or self-mask seed. Flower's own ``pseudo_rand_gen`` is **not** used:
  it folds the 256-bit key into a 32-bit seed of numpy's Mersenne Twister (a curious aggregator could try
  all 2^32 seeds of a pairwise mask) and draws from ``[0, 2^b - 2]`` (never the top residue, so a masked
  vector is not exactly uniform). A counter-mode keystream is the pseudo-random generator Bonawitz et al.
  assume; every residue modulo 2^b is equally likely.

The threat model's arithmetic lives here too, for both sides and the command line: :func:`smallest_threshold`
and :func:`threat_problem` (why ``2 threshold > participants + colluders`` whenever dropouts are allowed).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from task.errors import UserError

# ``dp-fedavg-secure``'s requests as both sides name them (``server.dpfedavg_secure`` and
# ``clients.secure_gradients``; the server and the clients never import each other):
#: the request before a run's secure sums -- the public start model goes out, each hospital's patient count
#: comes back; not a stage of a secure sum
JOIN_STAGE = "join"
#: the contribution kind its secure sums' noise declarations name (``noise["kind"]``)
CONTRIBUTION_KIND = "head-gradient"
#: the contribution kind of PATE's secure sums (the teachers' encodings): what a declaration without ``kind`` means
PATE_CONTRIBUTION_KIND = "pate"
#: the only neighbouring relation it runs under: it publishes the hospitals' patient counts
RELATION = "replace-one"


def generate_keys() -> tuple[bytes, bytes]:
    """(private key, public key) as PEM bytes (Flower's key pair generation)."""
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes, public_key_to_bytes

    private, public = generate_key_pairs()
    return private_key_to_bytes(private), public_key_to_bytes(public)


def agree(private_key: bytes, public_key: bytes) -> bytes:
    """The 32-byte key two parties share (Flower's ECDH + HKDF); urlsafe base64 as Flower returns it."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    return generate_shared_key(bytes_to_private_key(private_key), bytes_to_public_key(public_key))


def encrypt(key: bytes, plaintext: bytes) -> bytes:
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt as flower_encrypt

    return flower_encrypt(key, plaintext)


def decrypt(key: bytes, ciphertext: bytes) -> bytes:
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt as flower_decrypt

    return flower_decrypt(key, ciphertext)


def split(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """``count`` Shamir shares of ``secret``, any ``threshold`` of which rebuild it (Flower's)."""
    from flwr.common.secure_aggregation.crypto.shamir import create_shares

    return create_shares(secret, int(threshold), int(count))


def combine(shares: list[bytes]) -> bytes:
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares

    return combine_shares(list(shares))


def pack_shares(source: int, destination: int, seed_share: bytes, key_share: bytes) -> bytes:
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    return share_keys_plaintext_concat(int(source), int(destination), seed_share, key_share)


def unpack_shares(plaintext: bytes) -> tuple[int, int, bytes, bytes]:
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

    return share_keys_plaintext_separate(plaintext)


def mask(seed: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` pseudo-random residues modulo 2^bits (int64) expanded from ``seed`` by AES-256-CTR.

    ``seed``: a 32-byte self-mask seed, or an agreed key as :func:`agree` returns it (urlsafe base64 of 32
    bytes); anything else is hashed to 32 bytes first (SHA-256)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = bytes(seed)
    if len(key) == 44:
        try:
            key = base64.urlsafe_b64decode(key)
        except ValueError:
            key = hashlib.sha256(key).digest()
    if len(key) != 32:
        key = hashlib.sha256(key).digest()
    stream = Cipher(algorithms.AES(key), modes.CTR(b"\x00" * 16)).encryptor().update(b"\x00" * (8 * int(length)))
    words = np.frombuffer(stream, dtype=np.uint64)
    return (words & np.uint64((1 << int(bits)) - 1)).astype(np.int64)


# ------------------------------------------------------------------------------- who the hospitals are
#: what every signed setup statement starts with: it separates these signatures from any other use of the
#: same key (a SuperNode signs ASCII timestamps with it to authenticate to the SuperLink)
STATEMENT_DOMAIN = b"fedpate secure-sum setup v1\n"


def _canonical(value: Any) -> Any:
    """``value`` as plain JSON types that print identically on every machine: floats as their exact hex,
    numpy scalars and arrays as Python ones, bytes as hex, mappings with sorted string keys."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, np.ndarray):
        return [_canonical(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _canonical(value.item())
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return {"float": value.hex()}
    raise TypeError(f"secure-sum statement: cannot sign a {type(value).__name__}")


@dataclass(frozen=True)
class SumSetup:
    """One secure sum's setup as a hospital was told it: what every advertised key is signed over.

    Attributes:
        session: the sum's id.
        participants: the hospital names, in share order.
        threshold: shares needed to rebuild a secret.
        bits: the modulus' bits.
        length: the summed vector's length.
        noise: the noise declaration, with its colluders and dropouts.
    """

    session: str
    participants: tuple
    threshold: int
    bits: int
    length: int
    noise: Mapping[str, Any]


def setup_statement(setup: SumSetup, hospital: str, pk1: bytes, pk2: bytes) -> bytes:
    """What a hospital signs when it advertises its keys for one secure sum: its keys *and* the sum's setup as
    it was told it (the session, the participants in order, the threshold, modulus, length and the noise
    declaration with its colluders and dropouts). Every other hospital rebuilds the statement from its own
    setup message, so a signature verifies only if both were told the same setup: a server cannot give
    different hospitals different participants, thresholds or threat models, nor substitute keys."""
    body = {"session": str(setup.session), "hospital": str(hospital), "pk1": bytes(pk1).hex(),
            "pk2": bytes(pk2).hex(), "participants": [str(p) for p in setup.participants],
            "threshold": int(setup.threshold), "bits": int(setup.bits), "length": int(setup.length),
            "noise": _canonical(dict(setup.noise))}
    return STATEMENT_DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def load_public_key(text: bytes):
    """An EC public key in OpenSSH format (``ecdsa-sha2-nistp384 AAAA...``, what ``fedpate deploy certs`` writes
    in ``<hospital>.pub``); ValueError when it is not one on a NIST curve."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key
    from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

    key = load_ssh_public_key(bytes(text).strip())
    if not isinstance(key, ec.EllipticCurvePublicKey) or not uses_nist_ec_curve(key):
        raise ValueError("not an EC public key on a NIST curve")
    return key


def load_private_key(text: bytes):
    """An EC private key in OpenSSH format (what ``flower-supernode --auth-supernode-private-key`` reads) or
    PKCS#8 PEM; ValueError when it is neither (or not EC on a NIST curve)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_ssh_private_key
    from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

    data = bytes(text)
    key = (load_ssh_private_key(data, password=None) if b"OPENSSH PRIVATE KEY" in data
           else load_pem_private_key(data, password=None))
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not uses_nist_ec_curve(key.public_key()):
        raise ValueError("not an EC private key on a NIST curve")
    return key


def _openssh(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


@dataclass(frozen=True)
class Roster:
    """The consortium's hospitals and the public key each signs with, fixed at deployment: one line per hospital,
    ``<hospital-id> <OpenSSH public key> [comment]`` (``fedpate deploy certs`` writes it from the SuperNode
    authentication keys, ``roster.txt``). Only a hospital on it can take part in a secure sum, and only with
    keys it signed itself."""

    keys: Mapping[str, bytes]          # hospital -> its public key, OpenSSH format

    @classmethod
    def parse(cls, text: str, where: str = "roster") -> "Roster":
        from cryptography.exceptions import UnsupportedAlgorithm

        keys: dict[str, bytes] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) < 3:
                raise UserError(f"{where}, line {number}: expected '<hospital-id> <key type> <key>'")
            name = parts[0]
            if name in keys:
                raise UserError(f"{where}, line {number}: hospital {name!r} is listed twice")
            try:
                key = _openssh(load_public_key(" ".join(parts[1:3]).encode()))
            except (ValueError, TypeError, UnsupportedAlgorithm):
                raise UserError(f"{where}, line {number}: {name}'s key is not an EC public key in OpenSSH format"
                                ) from None
            if key in keys.values():
                raise UserError(f"{where}, line {number}: {name}'s key is another hospital's")
            keys[name] = key
        if len(keys) < 2:
            raise UserError(f"{where}: lists {len(keys)} hospital(s); a secure sum needs at least 2")
        return cls(keys)

    @classmethod
    def load(cls, path: str | Path) -> "Roster":
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"secure-roster {path}: cannot be read ({exc.__class__.__name__})") from None
        return cls.parse(text, f"secure-roster {path}")

    def to_text(self) -> str:
        return "".join(f"{name} {key.decode()}\n" for name, key in sorted(self.keys.items()))

    def verify(self, hospital: str, statement: bytes, signature: bytes) -> bool:
        """Whether ``hospital`` is on the roster and ``signature`` is its signature of ``statement``."""
        from flwr.supercore.primitives.asymmetric import verify_signature

        key = self.keys.get(str(hospital))
        if key is None:
            return False
        return verify_signature(load_public_key(key), bytes(statement), bytes(signature))


@dataclass(frozen=True)
class SigningIdentity:
    """A deployed hospital's identity in secure sums: its name, the private key it signs its setup statements
    with (its SuperNode authentication key) and the consortium's :class:`Roster`, whose entry for it must be
    that key's public half."""

    name: str
    private_key: bytes
    roster: Roster

    def __post_init__(self) -> None:
        from cryptography.exceptions import UnsupportedAlgorithm

        try:
            public = _openssh(load_private_key(self.private_key).public_key())
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise UserError(f"hospital {self.name}: secure-signing-key is not an EC private key (OpenSSH or "
                            "PKCS#8 PEM)") from None
        if self.name not in self.roster.keys:
            raise UserError(f"hospital {self.name}: not on the secure-roster")
        if self.roster.keys[self.name] != public:
            raise UserError(f"hospital {self.name}: secure-signing-key is not the key the secure-roster lists for it")

    @classmethod
    def load(cls, name: str, key_path: str | Path, roster_path: str | Path) -> "SigningIdentity":
        try:
            key = Path(key_path).read_bytes()
        except OSError as exc:
            raise UserError(f"secure-signing-key {key_path}: cannot be read ({exc.__class__.__name__})") from None
        return cls(str(name), key, Roster.load(roster_path))

    def sign(self, statement: bytes) -> bytes:
        from flwr.supercore.primitives.asymmetric import sign_message

        return sign_message(load_private_key(self.private_key), bytes(statement))


# ------------------------------------------------------------------------------- the threat model
def smallest_threshold(participants: int, colluders: int, dropouts: int) -> int:
    """The smallest Shamir threshold a sum over ``participants`` may use: above the colluders (else they alone
    rebuild a hospital's masks), at least 2, and -- whenever dropouts are allowed -- with ``2 threshold >
    participants + colluders`` (:func:`threat_problem` says why)."""
    floor = max(2, int(colluders) + 1)
    if int(dropouts) > 0:
        floor = max(floor, (int(participants) + int(colluders)) // 2 + 1)
    return floor


def threat_problem(participants: int, colluders: int, dropouts: int, threshold: int | None) -> str | None:
    """What makes a secure sum over ``participants`` hospitals with this threat model impossible or unsafe, in
    a phrase (None: nothing). ``threshold`` None: :func:`smallest_threshold`.

    Why ``2 threshold > participants + colluders`` when dropouts are allowed: a hospital then reveals, at the
    unmask stage, its share of another hospital's self-mask seed if the server says that hospital survived,
    or its share of that hospital's masking key if the server says it dropped. A server that tells some
    hospitals one thing and the others the other collects seed shares from one group and key shares from the
    other (colluders give both); with both secrets it removes every mask of that hospital's input. Each honest
    hospital reveals one kind only, so the two groups hold at most ``participants + colluders`` shares between
    them, and a threshold above half of that leaves one of the two secrets out of reach (the consistency
    argument of Bonawitz et al., CCS 2017, kept by SecAgg+, Bell, Bonawitz, Gascón, Lepoint & Raykova, CCS
    2020). Without dropouts every hospital reveals seed shares only, and ``threshold > colluders`` suffices."""
    participants, colluders, dropouts = int(participants), int(colluders), int(dropouts)
    if participants < 2:
        return f"{participants} hospital(s): a secure sum needs at least 2"
    if participants - colluders - dropouts < 1:
        return (f"{participants} hospitals with {colluders} colluder(s) and {dropouts} dropout(s) leave no honest "
                "noise share")
    threshold = smallest_threshold(participants, colluders, dropouts) if threshold is None else int(threshold)
    if threshold <= colluders or threshold < 2:
        return (f"threshold {threshold} must be at least 2 and above the {colluders} colluder(s) (they alone could "
                "rebuild a hospital's masks)")
    if dropouts and 2 * threshold <= participants + colluders:
        return (f"threshold {threshold} with {dropouts} allowed dropout(s) must exceed half of {participants} "
                f"participants + {colluders} colluder(s) (at least {smallest_threshold(participants, colluders, dropouts)}): "
                "a server lying about who dropped could otherwise rebuild one hospital's masks")
    if threshold > participants - dropouts:
        return (f"threshold {threshold} exceeds the {participants - dropouts} hospitals left after {dropouts} "
                "dropout(s): the masks could not be removed")
    return None


#: how the command line names the settings of a threat model
THREAT_FLAGS = "--hospitals, --secure-colluders, --secure-dropouts and --secure-threshold"


def check_secure_settings(hospitals: int, colluders: int, dropouts: int, threshold: int | None,
                          named: str = THREAT_FLAGS) -> None:
    """A run's secure threat model checked against its number of hospitals before any work: one-line UserError
    naming the settings as ``named`` says (the command line's flags, or Flower's run-config keys;
    :func:`threat_problem`)."""
    problem = threat_problem(hospitals, colluders or 0, dropouts or 0, threshold or None)
    if problem:
        raise UserError(f"secure aggregation over {hospitals} hospitals: {problem} (set by {named})")
