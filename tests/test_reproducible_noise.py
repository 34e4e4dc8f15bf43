"""Reproducible noise repeats across runs although every run's release ids carry a fresh nonce: streams are
named by what a release is (query index, epoch, round), not by the nonce that keeps the hospitals' lifetime
ledgers from merging two runs' releases. Secure noise stays unrepeatable."""

import numpy as np

from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from server.aggregation import QueryRelease, aggregate_query
from task.codecs import PCACompressor
from task import codecs
from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining


def _aggregate(noise, release_id: str, stream: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    maps = codecs.one_hot(rng.integers(0, 4, size=(6, 4, 4, 4)), 4)
    compressor = PCACompressor(2, "clip", clip=1.0)
    compressor.fit(maps)
    state = codecs.verify_codec(compressor.state(), codecs.CodecPolicy(allow_identity=True))
    rows = codecs.encode(state, maps[:2].astype(np.float32))
    guard = BudgetGuard(Ledger(None), 8.0, 1e-3)
    release = QueryRelease(release_id, 0.5, compressor, state=state, stream=stream)
    noisy, _ = aggregate_query({"h0": rows[:1], "h1": rows[1:]}, release, guard, noise)
    return noisy


def test_a_pate_query_draws_the_same_reproducible_noise_whatever_the_run_nonce():
    cell = NoiseSource.reproducible(7).child("pate-pca", "eps-8", "K-2")
    first = _aggregate(cell, "pate-pca:0a1b2c3d:query-0", stream="query-0")
    again = _aggregate(cell, "pate-pca:ffee0011:query-0", stream="query-0")
    other_query = _aggregate(cell, "pate-pca:ffee0011:query-1", stream="query-1")
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other_query)
    secure = [_aggregate(NoiseSource(), "pate-pca:0a1b2c3d:query-0", stream="query-0") for _ in range(2)]
    assert not np.allclose(*secure)


def test_a_dpsgd_epoch_stream_is_named_by_its_stream_prefix_not_its_release_prefix():
    import torch

    def batches(release_prefix: str, stream_prefix: str | None) -> list:
        model = torch.nn.Linear(3, 2)
        dp = DPConfig(mode="fixed", epsilon=8.0, delta=1e-3, noise_multiplier=1.0, release_prefix=release_prefix,
                      stream_prefix=stream_prefix, max_grad_norm=4.0)
        session = DPSession(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            PrivateTraining(dp, BudgetGuard(Ledger(None), 8.0, 1e-3), owners=("h0",),
                                            noise=NoiseSource.reproducible(3).child("central", "eps-8")),
                            n=40, batch_size=8, epochs=1)
        assert session.begin_epoch(0)
        assert session.ledger.records()[0]["release_id"] == f"{release_prefix}:epoch-0"   # the ledger keeps the nonce
        return [b.tolist() for b in session.batches()]

    first = batches("central-dpsgd:0a1b2c3d", "central-dpsgd")
    assert first == batches("central-dpsgd:ffee0011", "central-dpsgd")
    assert first != batches("central-dpsgd:ffee0011", None)   # named by the nonce, as before the fix
