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
from privacy.options import Relation, Sampling
from task.learning.compute import Compute
from task.learning.dpsgd import DPConfig, private_training
from task.errors import UserError
from task.options import NoiseMode
from task.learning.networks import build_unet
from task.learning.training import TrainConfig, train_segmentation


def _data(n=4, g=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4, g, g, g)).astype(np.float32)
    return x, (x[:, 0] > 0.5).astype(np.int64)


def _train(dp, epochs, tmp_path=None, guard=None, checkpoint=None, validation=None, seed=0, noise=None):
    torch.manual_seed(seed)
    x, y = _data()
    model = build_unet("tiny")
    cfg = TrainConfig(epochs=epochs, batch_size=2, learning_rate=1e-2, augment=False,
                      checkpoint=checkpoint, seed=seed, compute=Compute(progress=False))
    return model, train_segmentation(model, x, y, cfg, private_training(dp, guard, noise=noise), validation=validation)


def _pld_epsilon(q, sigma, steps, delta, relation="ADD_OR_REMOVE_ONE"):
    from dp_accounting.privacy_accountant import NeighboringRelation

    acc = dp_accounting.pld.PLDAccountant(getattr(NeighboringRelation, relation))
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.slow  # PLD accounting of q = 0.5 takes seconds per epoch
def test_epsilon_equals_dp_accounting_pld(tmp_path):
    guard = BudgetGuard(Ledger(tmp_path / "ledger.jsonl"), 50.0, 1e-3)
    dp = DPConfig(mode="fixed", epsilon=50.0, delta=1e-3, noise_multiplier=1.5, relation="add-remove",
                  max_grad_norm=4.0)
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
    assert result.epsilon_add_remove == result.epsilon
    assert result.epsilon_replace_one == pytest.approx(_pld_epsilon(q, 1.5, steps, 1e-3, "REPLACE_ONE"), rel=1e-3)


def test_default_relation_is_replace_one_and_both_epsilons_are_reported(tmp_path):
    """DP-SGD's default is replace-one (docs/PRIVACY.md): epochs are charged as replace-one Poisson events, ε is
    dp_accounting's REPLACE_ONE PLD, and the add/remove ε of the same mechanism is reported beside it."""
    assert DPConfig(epsilon=8.0, delta=1e-3, max_grad_norm=4.0).relation == "replace-one"
    guard = BudgetGuard(Ledger(tmp_path / "ledger.jsonl"), 50.0, 1e-3)
    dp = DPConfig(mode="fixed", epsilon=50.0, delta=1e-3, noise_multiplier=3.0, max_grad_norm=4.0)
    _, result = _train(dp, epochs=2, guard=guard)
    q, steps = result.sampling_rate, result.steps_per_epoch * 2
    events = Ledger.load(tmp_path / "ledger.jsonl").events("central")
    assert {(e.relation, e.adaptive) for e in events} == {("replace-one", False)}
    assert result.accountant == "pld" and result.relation == "replace-one"
    assert result.epsilon == pytest.approx(_pld_epsilon(q, 3.0, steps, 1e-3, "REPLACE_ONE"), rel=1e-3)
    assert result.epsilon_replace_one == result.epsilon
    assert result.epsilon_add_remove == pytest.approx(_pld_epsilon(q, 3.0, steps, 1e-3), rel=1e-3)
    assert result.epsilon_add_remove < result.epsilon
    # dp_accounting has no replace-one RDP for Poisson sampling; ours reads it through the weak triangle
    # inequality: a valid bound, looser than the exact PLD
    assert result.epsilon_rdp is not None and result.epsilon_rdp > result.epsilon


@pytest.mark.parametrize("config, message", [
    ({"sampling": "shuffle", "relation": "add-remove"}, "zero-out"),
    ({"sampling": "poisson", "relation": "zero-out"}, "relation"),
    ({"accountant": "rdp"}, "pld"),
    ({"mode": "schedule", "schedule": "validation"}, "filter"),
])
def test_dp_config_refuses_relations_without_an_analysis(config, message):
    """Refused when built: no DPConfig exists that a session could not account."""
    with pytest.raises(UserError, match=message):
        DPConfig(**config, epsilon=8.0, delta=1e-3, max_grad_norm=4.0)
    DPConfig(accountant="rdp", relation="add-remove", epsilon=8.0, delta=1e-3, max_grad_norm=4.0)
    DPConfig(mode="schedule", schedule="validation", relation="add-remove", epsilon=8.0, delta=1e-3,
             noise_multiplier=2.0, max_grad_norm=4.0)
    DPConfig(mode="schedule", schedule="validation", sampling="shuffle", epsilon=8.0, delta=1e-3,
             noise_multiplier=2.0, max_grad_norm=4.0)


def test_dp_config_is_frozen_normalised_when_built_and_validated_again_when_replaced():
    """DPConfig is one frozen record: built from plain values it holds the options' enums; a changed copy
    (``dataclasses.replace``) is validated again; nothing changes one in place."""
    import dataclasses

    dp = DPConfig(mode="fixed", epsilon=8.0, delta=1e-3, noise_multiplier=2.0, max_grad_norm=4.0, sampling="shuffle",
                  relation="zero-out", accountant="pld", grad_sample_mode="hooks")
    assert (dp.mode, dp.sampling, dp.relation) == (NoiseMode.FIXED, Sampling.SHUFFLE, Relation.ZERO_OUT)
    assert type(dp.mode) is NoiseMode and type(dp.sampling) is Sampling and type(dp.relation) is Relation
    with pytest.raises(dataclasses.FrozenInstanceError):
        dp.noise_multiplier = 3.0
    assert dataclasses.replace(dp, noise_multiplier=3.0).noise_multiplier == 3.0 and dp.noise_multiplier == 2.0
    with pytest.raises(UserError, match="^--relation: expected one of"):
        dataclasses.replace(dp, relation="add-remove")   # shuffled batches have no add/remove analysis
    with pytest.raises(UserError, match="^--delta"):
        DPConfig(epsilon=8.0, delta=2.0, max_grad_norm=4.0)
    # no noise of its own: a fixed or scheduled noise is the caller's (the preset's), only target mode calibrates
    for mode in ("fixed", "schedule"):
        with pytest.raises(UserError, match=f"^noise_multiplier: --noise-mode {mode} needs one"):
            DPConfig(mode=mode, schedule="exp", epsilon=8.0, delta=1e-3, max_grad_norm=4.0)
    with pytest.raises(UserError, match="^noise_multiplier: --noise-mode fixed needs one"):
        dataclasses.replace(DPConfig(epsilon=8.0, delta=1e-3, max_grad_norm=4.0), mode="fixed")


def test_target_mode_spends_the_budget_for_the_planned_epochs():
    dp = DPConfig(mode="target", epsilon=4.0, delta=1e-3, sampling="shuffle", max_grad_norm=4.0)
    _, result = _train(dp, epochs=3)
    assert result.epochs_completed == 3
    assert result.epsilon <= 4.0 and result.epsilon == pytest.approx(4.0, rel=1e-2)


@pytest.mark.parametrize("relation, rho_per_epoch", [("zero-out", 1 / (2 * 2.0 ** 2)), ("replace-one", 2 / 2.0 ** 2)])
def test_shuffled_batches_are_accounted_with_zcdp_only(tmp_path, relation, rho_per_epoch):
    """Yu et al.'s 1/(2σ²) per shuffled epoch is zero-out adjacency (sensitivity C); replace-one is 2C."""
    ledger = Ledger(tmp_path / "ledger.jsonl")
    dp = DPConfig(mode="fixed", epsilon=30.0, delta=1e-3, noise_multiplier=2.0, sampling="shuffle", relation=relation,
                  max_grad_norm=4.0)
    _, result = _train(dp, epochs=2, guard=BudgetGuard(ledger, 30.0, 1e-3))
    events = ledger.events("central")
    assert len(events) == 2
    assert all(isinstance(e, ZCDPEvent) and not isinstance(e, SampledGaussianEvent) for e in events)
    assert all(e.rho == pytest.approx(rho_per_epoch) and e.relation == relation for e in events)
    rho = 2 * rho_per_epoch
    assert result.accountant == "zcdp" and result.relation == relation
    assert result.epsilon == pytest.approx(rho + 2 * np.sqrt(rho * np.log(1 / 1e-3)), rel=1e-6)
    assert result.epsilon_rdp is None


def _next_epoch_exceeds(result, guard, sampling="poisson", relation="replace-one", adaptive=False,
                        next_sigma_factor=1.0):
    """The epoch training refused would indeed have passed the budget. ``next_sigma_factor``: the smallest
    factor the schedule could apply to the last sigma for that epoch (the validation schedule multiplies by k
    after a stall, which depends on the noisy run): a smaller sigma spends more, so if the refused epoch
    exceeded, this one does too."""
    from privacy.errors import BudgetExceeded

    assert "budget" in (result.stopped_reason or "")
    sigma = result.sigmas[-1] * next_sigma_factor
    event = (SampledGaussianEvent(result.sampling_rate, sigma, steps=result.steps_per_epoch, relation=relation,
                                  adaptive=adaptive)
             if sampling == "poisson" else ZCDPEvent.shuffled_epochs(sigma, 1, relation, adaptive=adaptive))
    with pytest.raises(BudgetExceeded):
        guard.check(["central"], event)


@pytest.mark.parametrize("sampling", ["shuffle", pytest.param("poisson", marks=pytest.mark.slow)])
def test_fixed_sigma_stops_when_the_next_epoch_would_exceed(sampling):
    guard = BudgetGuard(Ledger(None), 2.0, 1e-3)
    # replace-one (the default) doubles a shuffled batch's sensitivity: 2·sqrt(6) here is sqrt(6) under zero-out
    dp = DPConfig(mode="fixed", epsilon=2.0, delta=1e-3, noise_multiplier=2 * 6 ** 0.5, sampling=sampling,
                  max_grad_norm=4.0)
    _, result = _train(dp, epochs=100, guard=guard)
    assert 0 < result.epochs_completed < 100
    assert result.stopped_reason and "budget" in result.stopped_reason
    assert result.epsilon <= 2.0
    _next_epoch_exceeds(result, guard, sampling=sampling)


@pytest.mark.parametrize("family", ["exp", "time", "step", "poly"])
def test_schedule_stops_exactly_when_the_budget_is_spent(family):
    guard = BudgetGuard(Ledger(None), 3.0, 1e-3)
    options = {"period": 2} if family == "step" else {}
    # σ0 = 8 under replace-one (sensitivity 2C) is σ0 = 4 under zero-out
    dp = DPConfig(mode="schedule", schedule=family, epsilon=3.0, delta=1e-3, noise_multiplier=8.0,
                  sampling="shuffle", target_epochs=4, schedule_options=options, max_grad_norm=4.0)
    _, result = _train(dp, epochs=50, guard=guard)
    sigmas = result.sigmas
    assert result.epochs_completed == len(sigmas) < 50
    assert sigmas[-1] < sigmas[0]                       # the noise decayed
    assert result.epsilon <= 3.0
    _next_epoch_exceeds(result, guard, sampling="shuffle")


def test_validation_schedule_needs_a_public_validation_set():
    dp = DPConfig(mode="schedule", schedule="validation", epsilon=3.0, delta=1e-3, sampling="shuffle",
                  noise_multiplier=5.0, max_grad_norm=4.0)
    with pytest.raises(UserError, match="validation"):
        _train(dp, epochs=2)
    x, y = _data(n=2)
    guard = BudgetGuard(Ledger(None), 3.0, 1e-3)
    _, result = _train(dp, epochs=40, guard=guard, validation=(x, y))
    assert "validation_dice_mean" in result.history[0]
    # σ_t chosen from earlier outputs: adaptive events, accounted by a filter-valid accountant (zCDP)
    assert all(e.adaptive for e in guard.ledger.events("central"))
    assert result.adaptive and result.accountant == "zcdp" and result.epsilon <= 3.0
    _next_epoch_exceeds(result, guard, sampling="shuffle", adaptive=True, next_sigma_factor=0.9)  # default k


def test_validation_schedule_with_poisson_sampling_uses_the_renyi_filter():
    """Poisson sampling under add/remove: the adaptive epochs are accounted by rdp-filter (not PLD), and the
    guard stops training when the filter's ε would pass the budget."""
    dp = DPConfig(mode="schedule", schedule="validation", epsilon=4.0, delta=1e-3, noise_multiplier=2.0,
                  relation="add-remove", schedule_options={"k": 0.8}, max_grad_norm=4.0)
    x, y = _data(n=2)
    guard = BudgetGuard(Ledger(None), 4.0, 1e-3)
    _, result = _train(dp, epochs=40, guard=guard, validation=(x, y))
    events = guard.ledger.events("central")
    assert events and all(e.adaptive and e.relation == "add-remove" for e in events)
    assert result.accountant == "rdp-filter" and 0 < result.epochs_completed < 40
    from privacy.accountants import RDPFilterAccountant

    filt = RDPFilterAccountant()
    for event in events:
        filt.compose(event)
    assert result.epsilon == pytest.approx(filt.get_epsilon(1e-3)) and result.epsilon <= 4.0
    assert result.epsilon_replace_one is None  # no filter for adaptive replace-one Poisson events
    _next_epoch_exceeds(result, guard, relation="add-remove", adaptive=True, next_sigma_factor=0.8)


@pytest.mark.parametrize("sampling", ["shuffle", pytest.param("poisson", marks=pytest.mark.slow)])
def test_dp_resume_continues_identically(tmp_path, sampling):
    dp = DPConfig(mode="fixed", epsilon=100.0, delta=1e-3, noise_multiplier=1.0, sampling=sampling, max_grad_norm=4.0)
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


def test_dp_config_takes_its_budget_delta_and_clip_from_the_caller():
    """DPConfig has no budget, delta or clipping norm of its own (they are the run's and the preset's, resolved
    once by whoever builds it), and a teachers' local DP-SGD request that leaves one out is refused."""
    from task.wire.requests import TeacherTrainingRequest

    with pytest.raises(TypeError, match="'epsilon', 'delta', and 'max_grad_norm'"):
        DPConfig(mode="fixed", noise_multiplier=1.0)
    recipe = {"teacher_epochs": 1, "teacher_trainable": "all", "teacher_learning_rate": 1e-3, "teacher_augment": False,
              "teacher_batch_size": 2}
    with pytest.raises(UserError, match="^local_dp: expected DPConfig fields with at least epsilon, delta, "
                                        "max_grad_norm; no delta, max_grad_norm$"):
        TeacherTrainingRequest.from_config({**recipe, "local_dp": {"epsilon": 2.0}})
