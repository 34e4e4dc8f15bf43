"""The secure sum (server/secure.py, clients/secure.py over task/wire/secagg.py's library primitives): the sum is
right, the server sees only uniform masked vectors, unmasking needs the other hospitals, and a dropout at
every stage is recovered."""

from __future__ import annotations

import numpy as np
import pytest

from clients.secure import SecurePolicy, SecureRequestRefused, SecureSumParty
from privacy.distributed import centered
from server.secure import SecureSumFailed, secure_sum
from task.wire import secagg



class RecordingExchange:
    """Routes each stage to in-process parties and records every reply the server receives; ``drop``:
    hospital -> the stage from which it no longer answers."""

    def __init__(self, parties, contributions, drop=None):
        self.parties = {p.name: p for p in parties}
        self.contributions = contributions
        self.drop = dict(drop or {})
        self.received: list[tuple[str, str, dict]] = []

    def __call__(self, stage, messages):
        replies = {}
        for name, message in messages.items():
            if name in self.drop and STAGE_ORDER.index(stage) >= STAGE_ORDER.index(self.drop[name]):
                continue
            reply = self.parties[name].handle(stage, message, lambda _m, n=name: self.contributions[n])
            self.received.append((name, stage, reply))
            replies[name] = reply
        return replies


STAGE_ORDER = ["setup", "share-keys", "collect-masked", "unmask"]


def _noise(policy, n, variance=4.0):
    """The noise declaration an honest server sends for ``policy`` (its threat model) over ``n`` hospitals."""
    shares = policy.counted_shares(n)
    return {"local_variance": variance, "shares": shares, "total_variance": variance * shares,
            "colluders": policy.colluders, "dropouts": policy.dropouts}


def _run(n=4, length=64, bits=20, drop=None, policy=None, threshold=None, seed=0, identities=None):
    rng = np.random.default_rng(seed)
    names = [f"h{i}" for i in range(n)]
    contributions = {h: rng.integers(-1000, 1000, size=length) for h in names}
    policy = policy or SecurePolicy(dropouts=1)
    parties = [SecureSumParty(h, policy, (identities or {}).get(h)) for h in names]
    exchange = RecordingExchange(parties, contributions, drop)
    threshold = threshold or secagg.smallest_threshold(n, policy.colluders, policy.dropouts)
    result = secure_sum(exchange, names, threshold, bits, length, _noise(policy, n))
    return result, contributions, exchange, parties


def test_the_sum_is_the_sum_of_contributions():
    result, contributions, _, _ = _run()
    np.testing.assert_array_equal(centered(result.total, 20), sum(contributions.values()))
    assert result.survivors == ["h0", "h1", "h2", "h3"] and not result.dropped


@pytest.mark.parametrize("stage", STAGE_ORDER)
def test_a_dropout_at_each_stage_is_recovered(stage):
    result, contributions, _, _ = _run(drop={"h2": stage})
    in_sum = [h for h in contributions if not (h == "h2" and stage != "unmask")]
    np.testing.assert_array_equal(centered(result.total, 20), sum(contributions[h] for h in in_sum))
    assert result.dropped == {"h2": stage}
    assert ("h2" in result.survivors) == (stage == "unmask")


def test_more_dropouts_than_the_policy_allows_are_not_unmasked():
    # two hospitals leave after sharing keys; each survivor's policy allows one dropout: they refuse to unmask
    with pytest.raises((SecureSumFailed, SecureRequestRefused)):
        _run(n=4, drop={"h1": "collect-masked", "h2": "collect-masked"})


def test_too_few_left_for_the_threshold_fails_without_release():
    with pytest.raises(SecureSumFailed, match="threshold"):
        _run(n=3, threshold=3, drop={"h0": "share-keys", "h1": "share-keys"}, policy=SecurePolicy())


def test_the_server_receives_only_uniform_masked_vectors():
    """Every array the server receives: keys, ciphertexts, masked vectors. The masked vectors are uniform
    modulo 2^bits whatever the contribution (here a constant 5 everywhere), and none equals a contribution."""
    bits, length = 8, 4096
    names = ["a", "b", "c"]
    contributions = {h: np.full(length, 5, np.int64) for h in names}
    parties = [SecureSumParty(h) for h in names]
    exchange = RecordingExchange(parties, contributions)
    result = secure_sum(exchange, names, 2, bits, length, _noise(SecurePolicy(), 3, 1.0))
    assert np.all(centered(result.total, bits) == 15)
    masked = [reply["masked"] for _, stage, reply in exchange.received if stage == "collect-masked"]
    assert len(masked) == 3
    for vector in masked:
        assert not np.array_equal(vector, contributions["a"])
        counts = np.bincount(vector, minlength=1 << bits)
        expected = length / (1 << bits)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # 255 degrees of freedom: mean 255, sd ~22.6; 400 is beyond the 0.99999 quantile
        assert chi2 < 400, chi2
        assert np.mean(vector == 5) < 0.02          # the contribution's value is not over-represented
    # nothing else the server received carries the contribution
    for _, stage, reply in exchange.received:
        for value in reply.values():
            if isinstance(value, np.ndarray):
                assert stage == "collect-masked"


def test_unmasking_needs_the_others():
    """A masked vector minus everything the server could compute alone is not the contribution: the self
    mask's seed needs ``threshold`` shares, and fewer shares do not rebuild it."""
    bits, length = 16, 256
    names = ["a", "b", "c", "d"]
    contributions = {h: np.arange(length, dtype=np.int64) * (i + 1) for i, h in enumerate(names)}
    parties = [SecureSumParty(h) for h in names]
    exchange = RecordingExchange(parties, contributions)
    secure_sum(exchange, names, 3, bits, length, _noise(SecurePolicy(), 4, 1.0))
    party = parties[0]
    session = next(iter(party.sessions.values()))
    held = [p.sessions[next(iter(p.sessions))].seed_shares["a"] for p in parties]
    assert secagg.combine(held[:3]) == session.seed                 # threshold shares rebuild it
    with pytest.raises(Exception):
        assert secagg.combine(held[:2]) == session.seed             # two do not
    masked_a = next(r["masked"] for h, s, r in exchange.received if h == "a" and s == "collect-masked")
    without_self_mask = (masked_a - secagg.mask(session.seed, length, bits)) & ((1 << bits) - 1)
    # even with its self mask removed, a's vector still carries the pairwise masks: not its contribution
    assert np.mean(centered(without_self_mask, bits) == contributions["a"]) < 0.01


def test_a_hospital_never_reveals_both_shares_of_one_hospital():
    result, _, exchange, parties = _run(n=3)
    party = parties[0]
    session_id = next(iter(party.sessions))
    with pytest.raises(SecureRequestRefused):
        party.handle("unmask", {"session": session_id, "survivors": ["h0", "h1"], "dropped": ["h2"]})
    with pytest.raises(SecureRequestRefused, match="both shares"):
        party.unmask(party.sessions[session_id], {"survivors": ["h0", "h1"], "dropped": ["h2"]})


def test_mask_expansion_is_uniform_and_keyed():
    a = secagg.mask(b"\x01" * 32, 1000, 62)
    b = secagg.mask(b"\x02" * 32, 1000, 62)
    assert a.min() >= 0 and a.max() < (1 << 62) and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, secagg.mask(b"\x01" * 32, 1000, 62))


# ------------------------------------------------------------------------------ an active server
def _identities(names):
    """Each hospital's signing key and the consortium's roster of their public keys (as ``fedpate deploy
    certs`` writes them, here in memory)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    keys = {h: ec.generate_private_key(ec.SECP384R1()) for h in names}
    roster = secagg.Roster.parse("".join(
        f"{h} {k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()}"
        f" fedpate-{h}\n" for h, k in keys.items()))
    pem = {h: k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()) for h, k in keys.items()}
    return {h: secagg.SigningIdentity(h, pem[h], roster) for h in names}


def _forwarded(reply):
    return (reply["pk1"], reply["pk2"], *([reply["signature"]] if "signature" in reply else []))


def _substitute_keys(victim, others, length=32, bits=20):
    """An active server with no colluder and no dropout: it sets the sum up with every hospital, then forwards
    to ``victim`` key pairs it made itself in place of the others' (each with that hospital's real signature
    attached). Returns the victim's contribution as the server rebuilds it from what the victim sent."""
    names = [victim.name] + [o.name for o in others]
    setup = {"session": "s", "participants": names, "threshold": 2, "bits": bits, "length": length,
             "noise": _noise(SecurePolicy(), len(names))}
    replies = {p.name: p.handle("setup", setup) for p in [victim] + others}
    fake = {h: (secagg.generate_keys(), secagg.generate_keys()) for h in names[1:]}   # ((sk1, pk1), (sk2, pk2))
    forwarded = {victim.name: _forwarded(replies[victim.name])}
    for h, (first, second) in fake.items():
        forwarded[h] = (first[1], second[1], *([replies[h]["signature"]] if "signature" in replies[h] else []))
    victim_pk1, victim_pk2 = replies[victim.name]["pk1"], replies[victim.name]["pk2"]
    sent = victim.handle("share-keys", {"session": "s", "public_keys": forwarded})["ciphertexts"]
    seed_shares = []
    for h, ciphertext in sent.items():   # the server reads every share the victim encrypted to a fake key
        plain = secagg.decrypt(secagg.agree(fake[h][1][0], victim_pk2), ciphertext)
        seed_shares.append(secagg.unpack_shares(plain)[2])
    seed = secagg.combine(seed_shares[:2])
    ciphertexts = {}
    for position, h in enumerate(names[1:], start=2):   # well-formed shares "from" the others
        plain = secagg.pack_shares(position, 1, b"\x00" * 48, b"\x00" * 48)
        ciphertexts[h] = secagg.encrypt(secagg.agree(fake[h][1][0], victim_pk2), plain)
    contribution = np.arange(length, dtype=np.int64) * 7 - 50
    masked = victim.handle("collect-masked", {"session": "s", "ciphertexts": ciphertexts},
                           lambda _m: contribution)["masked"]
    modulus = (1 << bits) - 1
    rebuilt = (masked - secagg.mask(seed, length, bits)) & modulus
    for h in names[1:]:   # the victim (index 1) subtracted every pairwise mask: add them back
        rebuilt = (rebuilt + secagg.mask(secagg.agree(fake[h][0][0], victim_pk1), length, bits)) & modulus
    return centered(rebuilt, bits), contribution


def test_a_server_substituting_keys_is_refused_before_any_share_is_sent():
    names = ["h0", "h1", "h2", "h3"]
    # the attack is real: a hospital that does not check signatures hands its contribution to the server
    rebuilt, contribution = _substitute_keys(SecureSumParty("h0"), [SecureSumParty(h) for h in names[1:]])
    np.testing.assert_array_equal(rebuilt, contribution)
    # a hospital with the consortium's roster refuses at share-keys: no share is encrypted, nothing contributed
    identities = _identities(names)
    victim = SecureSumParty("h0", identity=identities["h0"])
    with pytest.raises(SecureRequestRefused, match="not signed by that hospital's roster key"):
        _substitute_keys(victim, [SecureSumParty(h, identity=identities[h]) for h in names[1:]])
    assert victim.sessions["s"].seed == b"" and not victim.sessions["s"].public_keys


def test_participants_off_the_roster_and_a_setup_told_differently_are_refused():
    names = ["h0", "h1", "h2"]
    identities = _identities(names)
    parties = {h: SecureSumParty(h, identity=identities[h]) for h in names}
    setup = {"session": "s", "threshold": 2, "bits": 20, "length": 8}
    with pytest.raises(SecureRequestRefused, match="not on the consortium's secure-roster"):   # invented hospital
        parties["h0"].handle("setup", {**setup, "participants": names + ["h9"], "noise": _noise(SecurePolicy(), 4)})
    # the server tells h1 another noise declaration than h0 and h2: h1's signature does not verify at h0
    noise = _noise(SecurePolicy(), 3)
    replies = {h: parties[h].handle("setup", {**setup, "session": "t", "participants": names,
                                              "noise": {**noise, "local_variance": 8.0, "total_variance": 24.0}
                                              if h == "h1" else noise}) for h in names}
    with pytest.raises(SecureRequestRefused, match="for h1 are not signed"):
        parties["h0"].handle("share-keys", {"session": "t", "public_keys": {h: _forwarded(r) for h, r in replies.items()}})
    # ... and told the same, every signature verifies and the sum is right
    result, contributions, _, _ = _run(n=3, policy=SecurePolicy(), identities=_identities(names))
    np.testing.assert_array_equal(centered(result.total, 20), sum(contributions.values()))


def _lying_about_dropouts(threshold, bits=20, length=16):
    """An active server, four hospitals that allow one dropout: everybody sends its masked input, then the
    server tells h0 and h1 that all survived (they reveal their shares of h0's self-mask seed) and h2 and h3
    that h0 dropped (they reveal their shares of h0's masking key). Returns h0's contribution as rebuilt from
    those shares, or None when the shares do not suffice."""
    names = ["h0", "h1", "h2", "h3"]
    policy = SecurePolicy(dropouts=1)
    parties = {h: SecureSumParty(h, policy) for h in names}
    contributions = {h: np.arange(length, dtype=np.int64) * (i + 3) for i, h in enumerate(names)}
    setup = {"session": "s", "participants": names, "threshold": threshold, "bits": bits, "length": length,
             "noise": _noise(policy, 4)}
    keys = {h: parties[h].handle("setup", setup) for h in names}
    forwarded = {h: _forwarded(r) for h, r in keys.items()}
    sent = {h: parties[h].handle("share-keys", {"session": "s", "public_keys": forwarded})["ciphertexts"]
            for h in names}
    masked = {h: parties[h].handle("collect-masked", {"session": "s", "ciphertexts": {
        o: sent[o][h] for o in names if o != h}}, lambda _m, h=h: contributions[h])["masked"] for h in names}
    seed_shares = [parties[h].handle("unmask", {"session": "s", "survivors": names, "dropped": []})["shares"]["h0"]
                   for h in ("h0", "h1")]
    key_shares = [parties[h].handle("unmask", {"session": "s", "survivors": names[1:], "dropped": ["h0"]}
                                    )["shares"]["h0"] for h in ("h2", "h3")]
    if min(len(seed_shares), len(key_shares)) < threshold:
        return None, contributions["h0"]
    seed, private = secagg.combine(seed_shares), secagg.combine(key_shares)
    modulus = (1 << bits) - 1
    rebuilt = (masked["h0"] - secagg.mask(seed, length, bits)) & modulus
    for other in names[1:]:
        rebuilt = (rebuilt + secagg.mask(secagg.agree(private, keys[other]["pk1"]), length, bits)) & modulus
    return centered(rebuilt, bits), contributions["h0"]


def test_a_server_lying_about_dropouts_cannot_unmask_a_hospital():
    """Threshold 2 of 4 with one allowed dropout would let the server combine two seed shares and two key
    shares of h0; every hospital refuses that threshold at setup. At the smallest one it accepts (3: twice it
    exceeds 4 participants) the same lie yields two shares of each, too few for either secret."""
    with pytest.raises(SecureRequestRefused, match="exceed half"):
        _lying_about_dropouts(2)
    assert secagg.smallest_threshold(4, 0, 1) == 3
    rebuilt, _ = _lying_about_dropouts(3)
    assert rebuilt is None
    # the unmask stage refuses repeated names (a survivors list padded to look long enough)
    _, _, _, parties = _run(n=4, policy=SecurePolicy(dropouts=1), drop={"h3": "unmask"})
    with pytest.raises(SecureRequestRefused, match="repeats"):
        parties[3].unmask(next(iter(parties[3].sessions.values())),
                          {"survivors": ["h0", "h0", "h3"], "dropped": ["h1", "h2"]})


def test_a_doomed_unmask_is_refused_before_the_contribution():
    """Four hospitals allowing no dropout; one leaves before sharing its keys. The unmask would be refused (it
    needs all four), so each hospital refuses at collect-masked, before ``contribute`` (its charge) runs."""
    charged = []
    names = ["h0", "h1", "h2", "h3"]
    parties = [SecureSumParty(h) for h in names]

    class Charging(RecordingExchange):
        def __call__(self, stage, messages):
            if stage == "collect-masked":
                for name in messages:
                    party = self.parties[name]
                    with pytest.raises(SecureRequestRefused, match="shared their keys"):
                        party.handle(stage, messages[name],
                                     lambda _m, n=name: charged.append(n) or np.zeros(8, np.int64))
                return {}
            return super().__call__(stage, messages)

    exchange = Charging(parties, {h: np.zeros(8, np.int64) for h in names}, drop={"h3": "share-keys"})
    with pytest.raises(SecureSumFailed):
        secure_sum(exchange, names, 2, 20, 8, _noise(SecurePolicy(), 4))
    assert charged == []
