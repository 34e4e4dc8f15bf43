"""The aggregator's side of the secure sum (SecAgg+; Bell et al., CCS 2020), framework-free.

:func:`secure_sum` drives the four stages of ``clients/secure.py`` through one callable,
``exchange(stage, {hospital: message}) -> {hospital: reply}`` (a hospital absent from the reply dropped out
at that stage and is not asked again): the in-process transport calls the hospitals' objects, the Flower
transport sends messages, so both engines run the same stages. It forwards public keys (each with its
owner's signature, which every deployed hospital checks against the consortium's roster) and encrypted
shares, adds the masked vectors modulo 2^bits, and removes the masks with the shares the survivors send: each
survivor's self mask (its seed rebuilt from ``threshold`` shares) and every pairwise mask between a
survivor and a hospital that dropped after sharing its keys (that hospital's masking key rebuilt).

What the server learns: the public keys, ciphertexts it cannot read, masked vectors (uniform modulo
2^bits while one pairwise or self mask is unknown to it: tests/test_secure_sum.py checks that), the sum
modulo 2^bits, and who dropped when. Nothing else.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from task.wire import secagg
from task.errors import UserError

log = logging.getLogger("fedpate.secure")

Exchange = Callable[[str, Mapping[str, Mapping[str, Any]]], Mapping[str, Mapping[str, Any]]]


class SecureSumFailed(UserError):
    """Too few hospitals stayed to rebuild the masks (or they refused to): nothing was released."""


@dataclass
class SecureSumResult:
    """The unmasked sum (residues modulo 2^bits, int64) and who took part when."""

    total: np.ndarray
    survivors: list[str]                                   # whose masked inputs are in the sum
    dropped: dict[str, str] = field(default_factory=dict)  # hospital -> the stage it left at
    bytes_up: dict[str, int] = field(default_factory=dict)  # hospital -> bytes it sent over all stages
    bytes_down: dict[str, int] = field(default_factory=dict)


def _size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, Mapping):
        return sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    if isinstance(value, str):
        return len(value.encode())
    return 8


def secure_sum(exchange: Exchange, hospitals: list[str], threshold: int, bits: int, length: int,
               noise: Mapping[str, Any], inputs: Mapping[str, Mapping[str, Any]] | None = None,
               session: str | None = None) -> SecureSumResult:
    """Run one secure sum over ``hospitals`` and return the sum of their contributions modulo 2^bits.

    Args:
        exchange: sends each named hospital its message for a stage, returns the replies received.
        hospitals: the participants (their order fixes the Shamir share positions).
        threshold: shares needed to rebuild a seed or key (each hospital checks it against its policy).
        bits: the modulus 2^bits of the sum.
        length: the contribution's length.
        noise: the noise declaration every hospital checks before it charges (``local_variance``, ``shares``
            counted, ``total_variance``, and what the hospitals need to build their contribution).
        inputs: per hospital, what it is asked to contribute (sent with the collect-masked stage).
        session: a fresh id (None: a random one).

    Raises :class:`SecureSumFailed` when fewer than ``threshold`` hospitals are left at any stage.
    """
    session = session or secrets.token_hex(8)
    participants = [str(h) for h in hospitals]
    result = SecureSumResult(np.zeros(int(length), np.int64), [], {}, {h: 0 for h in participants},
                             {h: 0 for h in participants})

    def call(stage: str, messages: dict[str, dict]) -> dict[str, dict]:
        for h, m in messages.items():
            result.bytes_down[h] += _size(m)
        replies = dict(exchange(stage, messages))
        for h in messages:
            if h not in replies:
                result.dropped.setdefault(h, stage)
            else:
                result.bytes_up[h] += _size(replies[h])
        alive = {h: r for h, r in replies.items() if h in messages}
        if len(alive) < threshold:
            raise SecureSumFailed(f"secure sum {session}: {len(alive)} hospital(s) left after {stage}, fewer than "
                                  f"the threshold {threshold}; nothing was released")
        return alive

    base = {"session": session}
    setup = {"participants": participants, "threshold": int(threshold), "bits": int(bits), "length": int(length),
             "noise": dict(noise)}
    advertised = call("setup", {h: {**base, **setup} for h in participants})
    public_keys = {h: (bytes(r["pk1"]), bytes(r["pk2"])) for h, r in advertised.items()}
    # each key pair travels with its owner's signature (deployed hospitals sign it with their roster key)
    forwarded = {h: (*public_keys[h], *([bytes(r["signature"])] if "signature" in r else []))
                 for h, r in advertised.items()}
    shared = call("share-keys", {h: {**base, "public_keys": forwarded} for h in advertised})
    mailbox: dict[str, dict[str, bytes]] = {h: {} for h in shared}
    for source, reply in shared.items():
        for destination, ciphertext in dict(reply["ciphertexts"]).items():
            if destination in mailbox:
                mailbox[destination][source] = bytes(ciphertext)
    masked = call("collect-masked", {h: {**base, "ciphertexts": mailbox[h], **dict((inputs or {}).get(h, {}))}
                                      for h in shared})
    modulus = (1 << int(bits)) - 1
    total = np.zeros(int(length), np.int64)
    for h, reply in masked.items():
        vector = np.asarray(reply["masked"], dtype=np.int64).reshape(-1)
        if len(vector) != int(length) or np.any(vector < 0) or np.any(vector > modulus):
            raise SecureSumFailed(f"secure sum {session}: hospital {h} sent a malformed masked vector")
        total = (total + vector) & modulus
    survivors = sorted(masked, key=participants.index)
    gone = sorted((h for h in shared if h not in masked), key=participants.index)
    unmasking = call("unmask", {h: {**base, "survivors": survivors, "dropped": gone} for h in survivors})
    collected: dict[str, list[bytes]] = {h: [] for h in survivors + gone}
    for reply in unmasking.values():
        for owner, share in dict(reply["shares"]).items():
            if owner in collected:
                collected[owner].append(bytes(share))
    for owner, shares in collected.items():
        if len(shares) < threshold:
            raise SecureSumFailed(f"secure sum {session}: {len(shares)} share(s) of {owner}, fewer than the threshold "
                                  f"{threshold}; nothing was released")
        secret = secagg.combine(shares[:threshold])
        if owner in masked:     # a survivor: remove its self mask
            total = (total - secagg.mask(secret, length, bits)) & modulus
            continue
        # dropped after sharing keys: remove its pairwise masks from every survivor's vector
        position = participants.index(owner)
        for survivor in survivors:
            pairwise = secagg.mask(secagg.agree(secret, public_keys[survivor][0]), length, bits)
            if participants.index(survivor) > position:   # the survivor added it
                total = (total - pairwise) & modulus
            else:
                total = (total + pairwise) & modulus
    result.total, result.survivors = total, survivors
    log.info("secure sum %s: %d of %d hospitals in the sum (dropped: %s)", session, len(survivors), len(participants),
             result.dropped or "none")
    return result
