"""PATE aggregation: validation of replies, one ledger event per query charged before noise, budget."""

import math

import numpy as np
import pytest

from privacy.errors import BudgetExceeded
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import GaussianMechanism, make_generator
from server.aggregation import QueryRelease, aggregate_query
from task.codecs import AutoencoderCompressor, AutoencoderSettings, IdentityCompressor, PCACompressor
from task import codecs

GRID = (4, 4, 4)


def onehot(n, seed=0):
    return codecs.one_hot(np.random.default_rng(seed).integers(0, 4, size=(n, *GRID)), 4)


class LedgerCheckingMechanism(GaussianMechanism):
    """Asserts, at the moment noise is drawn, that the release is already in the ledger."""

    def __init__(self, sigma, ledger, release_id):
        super().__init__(sigma, make_generator(0))
        self.ledger, self.release_id, self.calls = ledger, release_id, 0

    def __call__(self, x):
        assert self.ledger.has_release(self.release_id), "noise drawn before the ledger recorded the release"
        self.calls += 1
        return super().__call__(x)


@pytest.fixture
def pca():
    return PCACompressor(n_components=5, sensitivity_mode="public").fit(onehot(20))


def replies(pca, teachers_per_hospital=(3, 2), seed=1):
    state = pca.state()
    return {f"h{i}": codecs.encode(state, onehot(t, seed + i)) for i, t in enumerate(teachers_per_hospital)}


def test_one_event_per_query_charged_to_answering_hospitals_before_noise(pca):
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, 1000.0, 1e-3)
    mechanism = LedgerCheckingMechanism(0.5, ledger, "query-0")
    noisy, teachers = aggregate_query(replies(pca), QueryRelease("query-0", 0.5, pca), guard, mechanism=mechanism)
    assert mechanism.calls == 1 and teachers == 5 and noisy.shape == (5,)
    assert ledger.owners() == ["h0", "h1"]
    (event,) = ledger.events("h0")
    assert event.sensitivity == pytest.approx(pca.sensitivity(5)) and event.sigma == 0.5
    assert len(ledger.events("h1")) == 1


def test_dropout_records_the_larger_sensitivity(pca):
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, 1000.0, 1e-3)
    full = replies(pca)
    aggregate_query(full, QueryRelease("query-0", 0.5, pca), guard, mechanism=GaussianMechanism(0.5, make_generator(0)))
    _, teachers = aggregate_query({"h0": full["h0"]}, QueryRelease("query-1", 0.5, pca), guard,
                                  mechanism=GaussianMechanism(0.5, make_generator(1)))
    assert teachers == 3
    first, second = ledger.events("h0")
    assert second.sensitivity == pytest.approx(first.sensitivity * 5 / 3)
    assert len(ledger.events("h1")) == 1  # the absent hospital is not charged for query-1


def test_refuses_over_budget_before_noise(pca):
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, 0.5, 1e-3)

    class Forbidden:
        sigma = 1e-3

        def __call__(self, x):
            raise AssertionError("noise must not be drawn for a refused release")

    with pytest.raises(BudgetExceeded):
        aggregate_query(replies(pca), QueryRelease("query-0", 1e-3, pca), guard, mechanism=Forbidden())
    assert ledger.owners() == []


def test_malformed_replies_are_rejected_or_clipped(pca):
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, 1000.0, 1e-3)
    good = replies(pca)["h0"]
    nan = good.copy()
    nan[0, 0] = np.nan
    too_long = good * 100  # PCA public mode: cannot come from probabilities -> rejected
    rejected = {}
    _, teachers = aggregate_query({"h0": good, "h1": nan, "h2": good[:, :3], "h3": too_long},
                                  QueryRelease("query-0", 0.5, pca), guard,
                                  mechanism=GaussianMechanism(0.5, make_generator(0)), rejected=rejected)
    assert teachers == 3 and sorted(rejected) == ["h1", "h2", "h3"]
    assert ledger.events("h0") and "h1" not in ledger.owners()

    # clip mode and the autoencoder: long rows are clipped on the server, the hospital still counts
    clip = PCACompressor(n_components=5, sensitivity_mode="clip", clip=0.5).fit(onehot(20))
    z = np.full((2, 5), 3.0)
    captured = {}

    def capture(x):
        captured["mean"] = x
        return x + 0.0

    capture.sigma = 0.5
    _, teachers = aggregate_query({"h0": z}, QueryRelease("query-1", 0.5, clip), guard, mechanism=capture)
    assert teachers == 2 and np.linalg.norm(captured["mean"]) <= 0.5 + 1e-6

    ae = AutoencoderCompressor(AutoencoderSettings(latent_dim=3, epochs=1)).fit(onehot(6))
    aggregate_query({"h0": np.full((2, 3), 5.0)}, QueryRelease("query-2", 0.5, ae), guard, mechanism=capture)
    assert np.linalg.norm(captured["mean"]) <= 1 + 1e-6


def test_identity_replies_must_be_one_hot_and_no_answer_releases_nothing():
    identity = IdentityCompressor().fit(onehot(4))
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, 1000.0, 1e-3)
    votes = codecs.encode(identity.state(), onehot(3))
    forged = votes * 0.5
    sigma = 2.0
    noisy, teachers = aggregate_query({"h0": votes, "h1": forged}, QueryRelease("query-0", sigma, identity), guard,
                                      mechanism=GaussianMechanism(sigma, make_generator(0)))
    assert teachers == 3 and ledger.owners() == ["h0"]
    assert ledger.events("h0")[0].sensitivity == pytest.approx(math.sqrt(2 * 64) / 3)
    assert aggregate_query({}, QueryRelease("query-1", sigma, identity), guard,
                           mechanism=GaussianMechanism(sigma, make_generator(0))) == (None, 0)
    assert len(ledger.events("h0")) == 1
