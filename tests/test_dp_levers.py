"""Private fine-tuning levers: which parameters are trained, augmentation multiplicity
(averaged before clipping: sensitivity unchanged), and parameter averaging (post-processing)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from task.learning.compute import Compute
from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining
from task.errors import UserError
from task.learning.networks import TRAINABLE_SETS, build_unet, freeze_all_but, trainable_parameter_names
from task.learning.training import TrainConfig, train_segmentation


def _data(n=4, grid=(16, 16, 16), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 4, *grid)).astype(np.float32),
            rng.integers(0, 4, size=(n, *grid)).astype(np.int64))


def test_trainable_sets_are_the_stated_stages_of_the_unet():
    model = build_unet("small")
    # the voxel-head sets need a network with a head (tests/test_voxel_head.py); the others choose U-Net weights
    sizes = {which: freeze_all_but(model, which) for which in TRAINABLE_SETS if not which.startswith("voxel-head")}
    total = sum(p.numel() for p in model.parameters())
    assert sizes["all"] == total and sizes["bias"] < sizes["head"] < sizes["decoder"] < total
    head = trainable_parameter_names(model, "head")
    assert all(name.startswith(("model.2.", "model.1.submodule.2.")) for name in head)
    assert any(name.startswith("model.2.") for name in head) and any("submodule.2." in name for name in head)
    assert not any(name.startswith("model.0.") for name in trainable_parameter_names(model, "decoder"))
    with pytest.raises(UserError, match="trainable"):
        trainable_parameter_names(model, "everything")


def test_dpsgd_on_the_head_leaves_every_other_weight_exactly_where_it_started():
    images, labels = _data()
    model = build_unet("tiny")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = DPConfig(mode="fixed", noise_multiplier=1.0, epsilon=1e6, delta=1e-3, max_grad_norm=1.0)
    result = train_segmentation(model, images, labels, TrainConfig(epochs=2, batch_size=2, learning_rate=1e-2,
                                                                    augment=False, trainable="head",
                                                                    compute=Compute(device="cpu", progress=False)),
                                PrivateTraining(dp))
    head = trainable_parameter_names(build_unet("tiny"), "head")
    moved = {n for n, p in result.model.named_parameters() if not torch.equal(p.detach(), start[n])}
    assert moved and moved <= head   # noise and updates only where trained
    assert all(p.requires_grad for p in result.model.parameters())   # returned as a plain module


def _session(views_model, dp, n=4, batch=2):
    optimizer = torch.optim.SGD(views_model.parameters(), lr=0.0)
    return DPSession(views_model, optimizer,
                     PrivateTraining(dp, BudgetGuard(Ledger(None), dp.epsilon, dp.delta), owners=("h0",)),
                     n=n, batch_size=batch, epochs=1)


def test_augmentation_views_are_averaged_per_patient_before_clipping():
    fake = SimpleNamespace(optimizer=SimpleNamespace(params=[SimpleNamespace(
        grad_sample=torch.arange(12.0).reshape(6, 2))]))
    DPSession.average_views(fake, 3)   # 2 patients x 3 views -> 2 rows, each the mean of its views
    np.testing.assert_allclose(fake.optimizer.params[0].grad_sample.numpy(), [[2.0, 3.0], [8.0, 9.0]])


@pytest.mark.parametrize("per_layer", [False, True])
def test_augmentation_multiplicity_keeps_the_replace_one_sensitivity(per_layer):
    """One DP step's clipped sum, for a batch of 2 patients x 3 views and the same batch with patient 0
    replaced by an adversarial one: the sums differ by at most 2 C_total (the ledger's assumption)."""
    torch.manual_seed(0)
    dp = DPConfig(mode="fixed", noise_multiplier=1.0, epsilon=1e6, delta=1e-3, max_grad_norm=0.5,
                  per_layer=per_layer)
    images, labels = _data(n=2, grid=(8, 8, 8))
    sums = []
    for scale in (1.0, 1e3):
        torch.manual_seed(1)   # the same start for both batches
        model = build_unet("tiny")
        session = _session(model, dp, n=2, batch=2)
        x = torch.from_numpy(images).repeat_interleave(3, dim=0)
        x[:3] = x[:3] * scale + torch.randn_like(x[:3])            # patient 0 replaced (all three views)
        y = torch.from_numpy(labels).repeat_interleave(3, dim=0)
        from task.learning.training import per_sample_loss

        session.optimizer.zero_grad(set_to_none=True)
        per_sample_loss(session.model(x), y).mean().backward()
        session.average_views(3)
        assert all(p.grad_sample.shape[0] == 2 for p in session.optimizer.params)
        session.optimizer.clip_and_accumulate()
        sums.append(torch.cat([p.summed_grad.reshape(-1) for p in session.optimizer.params]))
    total_clip = session.total_clip
    moved = float((sums[0] - sums[1]).norm())
    assert total_clip * 0.5 < moved <= 2 * total_clip * (1 + 1e-5)   # a real change, within the bound


def test_augmentation_multiplicity_trains_and_is_charged_exactly_like_one_view():
    images, labels = _data()
    ledgers = []
    for views in (1, 2):
        ledger = Ledger(None)
        dp = DPConfig(mode="fixed", noise_multiplier=1.5, epsilon=1e6, delta=1e-3, max_grad_norm=1.0)
        train_segmentation(build_unet("tiny"), images, labels,
                           TrainConfig(epochs=1, batch_size=2, learning_rate=1e-3,
                                       augmentation_multiplicity=views, compute=Compute(progress=False)),
                           PrivateTraining(dp, BudgetGuard(ledger, 1e6, 1e-3), owners=("h0",)))
        ledgers.append([r["event"] for r in ledger.records()])
    assert ledgers[0] == ledgers[1]   # same sampling rate, steps and sigma: the views cost nothing
    with pytest.raises(UserError, match="augmentation_multiplicity"):
        train_segmentation(build_unet("tiny"), images, labels,
                           TrainConfig(epochs=1, batch_size=2, learning_rate=1e-3,
                                       augmentation_multiplicity=2,   # not DP-SGD: refused
                                       compute=Compute(progress=False)))


def test_parameter_averaging_is_the_last_iterate_at_decay_zero_and_the_start_near_one():
    images, labels = _data()

    def run(decay):
        torch.manual_seed(0)
        model = build_unet("tiny")
        config = TrainConfig(epochs=2, batch_size=2, learning_rate=1e-2, augment=False, seed=3,
                             ema_decay=decay, compute=Compute(device="cpu", progress=False))
        return model, {n: p.detach().clone() for n, p in model.named_parameters()}, \
            train_segmentation(model, images, labels, config).model

    _, _, plain = run(None)
    _, _, last = run(0.0)
    for (name, a), (_, b) in zip(plain.named_parameters(), last.named_parameters()):
        assert torch.equal(a, b), name
    _, start, slow = run(1.0 - 1e-9)
    assert all(torch.allclose(p, start[n], atol=1e-6) for n, p in slow.named_parameters())


def test_settings_grids_carry_the_levers_to_the_training_they_choose_between():
    from types import SimpleNamespace as NS

    from server.dpfedavg import dpfedavg_settings
    from task.settings.presets import DpFedAvg, DpSetting, DpSgd
    from sim.runners.central import settings_grid

    preset = NS(name="t", learning_rate=1e-3, central_epochs=2, batch_size=2,
                dp_sgd=DpSgd(max_grad_norm=1.0, grid=(DpSetting(learning_rate=1e-3),
                                                      DpSetting(learning_rate=1e-3, trainable="head",
                                                                augmentation_multiplicity=2, ema_decay=0.9))),
                dp_fedavg=DpFedAvg(grid=(DpSetting(trainable="decoder"),)))
    plain, levered = settings_grid(preset, private=True, explicit={}, grid=True)
    assert "trainable" not in plain   # an entry without levers is recorded exactly as before
    assert levered["trainable"] == "head" and levered["augmentation_multiplicity"] == 2 and levered["ema_decay"] == 0.9
    assert dpfedavg_settings(preset)[0]["trainable"] == "decoder"
    with pytest.raises(UserError, match="^dp_sgd.grid entry: unknown setting 'trainable_set'"):
        DpSgd(grid=({"trainable_set": "head"},))
    with pytest.raises(UserError, match="^settings grid entry: trainable: unknown value 'heads'; expected one of "):
        DpSetting(trainable="heads")


@pytest.mark.parametrize("figures", [True, False])
def test_comparison_figures_are_left_off_only_when_asked(figures):
    """A DP-FedAvg hospital's local round asks for no comparison figures (each is a fresh composition of its
    ledger); the ledger's own epsilon is on the result either way, and the default keeps the figures."""
    images, labels = _data(n=4, grid=(8, 8, 8))
    dp = DPConfig(mode="fixed", noise_multiplier=1.0, epsilon=1e6, delta=1e-3, max_grad_norm=1.0, sampling="poisson")
    private = (PrivateTraining(dp) if figures else PrivateTraining(dp, comparison_figures=False))
    result = train_segmentation(build_unet("tiny"), images, labels,
                                TrainConfig(epochs=1, batch_size=2, learning_rate=1e-2, augment=False,
                                            compute=Compute(device="cpu", progress=False)), private)
    assert result.epsilon is not None and result.epsilon > 0
    assert (result.epsilon_rdp is not None) is figures
    own, other = ("epsilon_replace_one", "epsilon_add_remove") if result.relation == "replace-one" else \
        ("epsilon_add_remove", "epsilon_replace_one")
    assert getattr(result, own) == result.epsilon              # the relation's own figure is the ledger's
    assert (getattr(result, other) is not None) is figures    # the other relation's is composed afresh
