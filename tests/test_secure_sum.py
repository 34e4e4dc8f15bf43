"""The secure sum (server/secure.py, clients/secure.py over task/secagg.py's library primitives): the sum is
right, the server sees only uniform masked vectors, unmasking needs the other hospitals, and a dropout at
every stage is recovered."""

from __future__ import annotations

import numpy as np
import pytest

from clients.secure import SecurePolicy, SecureRequestRefused, SecureSumParty
from privacy.distributed import centered
from server.secure import SecureSumFailed, secure_sum
from task import secagg



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


def _run(n=4, length=64, bits=20, drop=None, policy=None, threshold=2, seed=0):
    rng = np.random.default_rng(seed)
    names = [f"h{i}" for i in range(n)]
    contributions = {h: rng.integers(-1000, 1000, size=length) for h in names}
    policy = policy or SecurePolicy(dropouts=1)
    parties = [SecureSumParty(h, policy) for h in names]
    exchange = RecordingExchange(parties, contributions, drop)
    shares = policy.counted_shares(n)
    noise = {"local_variance": 4.0, "shares": shares, "total_variance": 4.0 * shares}
    result = secure_sum(exchange, names, threshold, bits, length, noise)
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
        _run(n=3, threshold=3, drop={"h0": "share-keys"}, policy=SecurePolicy(dropouts=2))


def test_the_server_receives_only_uniform_masked_vectors():
    """Every array the server receives: keys, ciphertexts, masked vectors. The masked vectors are uniform
    modulo 2^bits whatever the contribution (here a constant 5 everywhere), and none equals a contribution."""
    bits, length = 8, 4096
    names = ["a", "b", "c"]
    contributions = {h: np.full(length, 5, np.int64) for h in names}
    parties = [SecureSumParty(h) for h in names]
    exchange = RecordingExchange(parties, contributions)
    result = secure_sum(exchange, names, 2, bits, length, {"local_variance": 1.0, "shares": 3, "total_variance": 3.0})
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
    secure_sum(exchange, names, 3, bits, length, {"local_variance": 1.0, "shares": 4, "total_variance": 4.0})
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
