"""The cryptographic building blocks of the secure sum, all taken from libraries (no cryptography here).

Both parties of the SecAgg+ protocol (Bell, Bonawitz, Gascón, Lepoint & Raykova, CCS 2020; the protocol
of Bonawitz et al., CCS 2017, on a communication graph) need the same primitives, so they live in the sim
core: the hospital side is ``clients/secure.py``, the aggregator side ``server/secure.py``.

* key agreement: Flower's ``flwr.supercore.primitives.asymmetric`` (ECDH on SECP384R1) and
  ``flwr.common.secure_aggregation.crypto.symmetric_encryption.generate_shared_key`` (ECDH + HKDF-SHA256);
* authenticated encryption of the key shares: Flower's ``encrypt`` / ``decrypt`` (Fernet);
* Shamir secret sharing: Flower's ``create_shares`` / ``combine_shares`` (PyCryptodome);
* the share message layout: Flower's ``share_keys_plaintext_concat`` / ``share_keys_plaintext_separate``;
* mask expansion: AES-256 in counter mode from ``cryptography`` (the library Flower's primitives use),
  keyed by the 32-byte agreed key or self-mask seed. Flower's own ``pseudo_rand_gen`` is **not** used:
  it folds the 256-bit key into a 32-bit seed of numpy's Mersenne Twister (a curious aggregator could try
  all 2^32 seeds of a pairwise mask) and draws from ``[0, 2^b - 2]`` (never the top residue, so a masked
  vector is not exactly uniform). A counter-mode keystream is the pseudo-random generator Bonawitz et al.
  assume; every residue modulo 2^b is equally likely.
"""

from __future__ import annotations

import base64
import hashlib

import numpy as np

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
