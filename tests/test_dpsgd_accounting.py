"""DP-SGD accounting: epsilon from the ledger equals dp_accounting's; shuffled batches are zCDP; fixed and
scheduled runs stop exactly when the next epoch would exceed the budget; DP resume is exact."""

import dp_accounting
import numpy as np
import pytest
import torch

from privacy.events import SampledGaussianEvent, ZCDPEvent
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from sim.dpsgd import DPConfig
from sim.errors import UserError
from sim.networks import build_unet
from sim.training import TrainConfig, train_segmentation


def _data(n=4, g=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4, g, g, g)).astype(np.float32)
    return x, (x[:, 0] > 0.5).astype(np.int64)


def _train(dp, epochs, tmp_path=None, guard=None, checkpoint=None, validation=None, seed=0, noise=None):
    torch.manual_seed(seed)
    x, y = _data()
    model = build_unet("tiny")
    cfg = TrainConfig(epochs=epochs, batch_size=2, learning_rate=1e-2, progress=False, augment=False,
                      checkpoint=checkpoint, seed=seed)
    return model, train_segmentation(model, x, y, cfg, dp=dp, guard=guard, validation=validation, noise=noise)


def _pld_epsilon(q, sigma, steps, delta):
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.slow  # PLD accounting of q = 0.5 takes seconds per epoch
def test_epsilon_equals_dp_accounting_pld(tmp_path):
    guard = BudgetGuard(Ledger(tmp_path / "ledger.jsonl"), 50.0, 1e-3)
    dp = DPConfig(mode="fixed", epsilon=50.0, delta=1e-3, noise_multiplier=1.5)
    _, result = _train(dp, epochs=3, guard=guard)
    q, steps = result.sampling_rate, result.steps_per_epoch * 3
    assert q == 0.5 and steps == 6
    expected = _pld_epsilon(q, 1.5, steps, 1e-3)
    assert result.accountant == "pld" and result.relation == "add-remove"
    assert result.epsilon == pytest.approx(expected, rel=1e-3)
    reread = Ledger.load(tmp_path / "ledger.jsonl")
    assert reread.spent("central", 1e-3).epsilon == pytest.approx(result.epsilon)
    assert all(isinstance(e, SampledGaussianEvent) for e in reread.events("central"))
    assert result.epsilon_rdp is not None and result.epsilon_rdp >= result.epsilon * 0.99


def test_target_mode_spends_the_budget_for_the_planned_epochs():
    dp = DPConfig(mode="target", epsilon=4.0, delta=1e-3, sampling="shuffle")
    _, result = _train(dp, epochs=3)
    assert result.epochs_completed == 3
    assert result.epsilon <= 4.0 and result.epsilon == pytest.approx(4.0, rel=1e-2)


def test_shuffled_batches_are_accounted_with_zcdp_only(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    dp = DPConfig(mode="fixed", epsilon=30.0, delta=1e-3, noise_multiplier=2.0, sampling="shuffle")
    _, result = _train(dp, epochs=2, guard=BudgetGuard(ledger, 30.0, 1e-3))
    events = ledger.events("central")
    assert len(events) == 2
    assert all(isinstance(e, ZCDPEvent) and not isinstance(e, SampledGaussianEvent) for e in events)
    assert all(e.rho == pytest.approx(1 / (2 * 2.0 ** 2)) for e in events)
    rho = 2 / (2 * 2.0 ** 2)
    assert result.accountant == "zcdp"
    assert result.epsilon == pytest.approx(rho + 2 * np.sqrt(rho * np.log(1 / 1e-3)), rel=1e-6)
    assert result.epsilon_rdp is None


def _next_epoch_exceeds(result, guard, sampling="poisson"):
    from privacy.errors import BudgetExceeded

    sigma = result.sigmas[-1]
    event = (SampledGaussianEvent(result.sampling_rate, sigma, steps=result.steps_per_epoch)
             if sampling == "poisson" else ZCDPEvent.shuffled_epochs(sigma, 1))
    with pytest.raises(BudgetExceeded):
        guard.check(["central"], event)


@pytest.mark.parametrize("sampling", ["shuffle", pytest.param("poisson", marks=pytest.mark.slow)])
def test_fixed_sigma_stops_when_the_next_epoch_would_exceed(sampling):
    guard = BudgetGuard(Ledger(None), 2.0, 1e-3)
    dp = DPConfig(mode="fixed", epsilon=2.0, delta=1e-3, noise_multiplier=6 ** 0.5, sampling=sampling)
    _, result = _train(dp, epochs=100, guard=guard)
    assert 0 < result.epochs_completed < 100
    assert result.stopped_reason and "budget" in result.stopped_reason
    assert result.epsilon <= 2.0
    _next_epoch_exceeds(result, guard, sampling=sampling)


@pytest.mark.parametrize("family", ["exp", "time", "step", "poly"])
def test_schedule_stops_exactly_when_the_budget_is_spent(family):
    guard = BudgetGuard(Ledger(None), 3.0, 1e-3)
    options = {"period": 2} if family == "step" else {}
    dp = DPConfig(mode="schedule", schedule=family, epsilon=3.0, delta=1e-3, noise_multiplier=4.0,
                  sampling="shuffle", target_epochs=4, schedule_options=options)
    _, result = _train(dp, epochs=50, guard=guard)
    sigmas = result.sigmas
    assert result.epochs_completed == len(sigmas) < 50
    assert sigmas[-1] < sigmas[0]                       # the noise decayed
    assert result.epsilon <= 3.0
    _next_epoch_exceeds(result, guard, sampling="shuffle")


def test_validation_schedule_needs_a_public_validation_set():
    dp = DPConfig(mode="schedule", schedule="validation", epsilon=3.0, delta=1e-3, sampling="shuffle")
    with pytest.raises(UserError, match="validation"):
        _train(dp, epochs=2)
    x, y = _data(n=2)
    guard = BudgetGuard(Ledger(None), 3.0, 1e-3)
    _, result = _train(dp, epochs=40, guard=guard, validation=(x, y))
    assert "validation_dice_mean" in result.history[0]
    _next_epoch_exceeds(result, guard, sampling="shuffle")


@pytest.mark.parametrize("sampling", ["shuffle", pytest.param("poisson", marks=pytest.mark.slow)])
def test_dp_resume_continues_identically(tmp_path, sampling):
    dp = DPConfig(mode="fixed", epsilon=100.0, delta=1e-3, noise_multiplier=1.0, sampling=sampling)
    # Identical continuation needs reproducible noise (a simulation-only choice): each epoch's stream is
    # derived from its release name, so the resumed epoch 3 draws what the straight run drew.
    noise = NoiseSource.reproducible(7)
    straight, r1 = _train(dp, epochs=3, checkpoint=tmp_path / "a.pt", noise=noise)
    _train(dp, epochs=2, checkpoint=tmp_path / "b.pt", noise=noise)
    resumed, r2 = _train(dp, epochs=3, checkpoint=tmp_path / "b.pt", seed=0, noise=noise)
    assert r2.resumed_from_epoch == 2
    assert r2.epsilon == pytest.approx(r1.epsilon)     # the in-memory ledger was re-filled
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
