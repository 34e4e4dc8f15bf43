"""The DP baselines start from the public model, choose their settings from the preset's grid on
public validation data only, and the ledger's ε over every grid run is the budget."""

import json

import numpy as np
import pytest
import torch

from privacy import calibration
from privacy.accountants import make_accountant
from privacy.events import ComposedEvent, SampledGaussianEvent
from privacy.ledger import Ledger
from task.learning.compute import Compute
from task.settings.presets import DpSetting


# ------------------------------------------------------------------------------------ composed calibration
def test_composed_calibration_of_identical_runs_is_one_longer_run():
    """G runs at one sampling rate compose like one run of G x the steps (same events, same ε)."""
    one = calibration.dpsgd_noise_multiplier(4.0, 1e-3, 0.1, 60, accountant="rdp")
    grid = calibration.composed_dpsgd_noise_multiplier(4.0, 1e-3, [(0.1, 30), (0.1, 30)], accountant="rdp")
    assert grid == pytest.approx(one, rel=1e-9)
    assert grid > calibration.dpsgd_noise_multiplier(4.0, 1e-3, 0.1, 30, accountant="rdp")   # two runs cost more


def test_composed_calibration_of_different_runs_meets_the_budget_from_the_safe_side():
    runs = [(0.1, 40), (0.25, 20)]
    z = calibration.composed_dpsgd_noise_multiplier(3.0, 1e-3, runs, relation="replace-one")
    accountant = make_accountant("pld", value_discretization_interval=1e-4)
    accountant.compose(ComposedEvent(tuple(SampledGaussianEvent(q, z, t, relation="replace-one") for q, t in runs)))
    epsilon = accountant.get_epsilon(1e-3)
    assert 3.0 * (1 - 1e-3) <= epsilon <= 3.0


# ------------------------------------------------------------------------------------ settings grid
def test_settings_grid_reads_the_preset_and_explicit_settings_fix_every_entry():
    from task.errors import UserError
    from task.settings.presets import get_preset
    from sim.runners.central import settings_grid

    # the quick preset trains DP-SGD for the non-private ceiling's epochs, one setting, no grid: a voxel head on the
    # frozen public model at its own learning rate (docs/decisions/dp-sgd-voxel-head.md); the ceiling trains every
    # weight
    quick = get_preset("quick")
    ceiling = settings_grid(quick, private=False, explicit={}, grid=True)
    only = settings_grid(quick, private=True, explicit={}, grid=True)
    assert len(only) == 1 and only[0]["trainable"] == "voxel-head" and "trainable" not in ceiling[0]
    assert only[0]["learning_rate"] == 1e-2 and ceiling[0]["learning_rate"] == quick.learning_rate
    assert only[0]["epochs"] == ceiling[0]["epochs"] == quick.central_epochs
    quick = quick.with_changes(dp_sgd=dict(grid=(DpSetting(learning_rate=2e-3, epochs=5),
                                                 DpSetting(learning_rate=5e-4, epochs=5))))
    grid = settings_grid(quick, private=True, explicit={}, grid=True)
    assert [s["learning_rate"] for s in grid] == [e.learning_rate for e in quick.dp_sgd.grid]
    assert {s["batch_size"] for s in grid} == {quick.dp_sgd.batch_size}
    fixed = settings_grid(quick, private=True, explicit={"learning_rate": 1e-4}, grid=True)
    assert fixed == [{**grid[0], "learning_rate": 1e-4}]             # duplicates collapse to one setting
    assert len(settings_grid(quick, private=False, explicit={}, grid=True)) == 1   # non-private: no grid
    with pytest.raises(UserError, match="^dp_sgd.grid entry: unknown setting 'momentum'; expected one of "):
        quick.with_changes(dp_sgd=dict(grid=({"momentum": 0.9},)))
    with pytest.raises(UserError, match="^dp_sgd.grid entry: 'rounds' is not a dp_sgd setting"):
        quick.with_changes(dp_sgd=dict(grid=(DpSetting(rounds=3),)))


def test_the_ceiling_releases_the_average_of_its_iterates_and_dp_sgd_keeps_its_recipe():
    from task.errors import UserError
    from task.settings.presets import get_preset
    from sim.runners.central import settings_grid

    quick = get_preset("quick")
    assert quick.central_ema_decay == quick.student.ema_decay == 0.99
    (ceiling,) = settings_grid(quick, private=False, explicit={}, grid=True)
    (dpsgd,) = settings_grid(quick, private=True, explicit={}, grid=True)
    assert ceiling["ema_decay"] == 0.99 and "ema_decay" not in dpsgd
    # an explicit --ema-decay still wins; a preset without the average releases the last iterate
    assert settings_grid(quick, private=False, explicit={"ema_decay": 0.9}, grid=True)[0]["ema_decay"] == 0.9
    assert "ema_decay" not in settings_grid(get_preset("tiny"), private=False, explicit={}, grid=True)[0]
    with pytest.raises(UserError, match="^central_ema_decay: expected a number in \\[0, 1\\) or None, got 1.5$"):
        quick.with_changes(central_ema_decay=1.5)


def test_the_ceiling_scores_and_releases_the_averaged_model(tmp_path, monkeypatch):
    import sim.runners.central as central
    import task.learning.training as training

    monkeypatch.setattr(central, "load_central_data", _world)
    monkeypatch.setattr(central, "public_start", lambda preset, **kw: _public_weights(preset))
    configs = []
    real_train = central.train_segmentation

    def train(model, images, labels, config, *args, **kwargs):
        configs.append(config)
        return real_train(model, images, labels, config, *args, **kwargs)

    monkeypatch.setattr(central, "train_segmentation", train)
    preset = central.get_preset("tiny").with_changes(central_ema_decay=0.5).reference
    results = central.run_central(central.CentralConfig.of(method="nonprivate", preset=preset, out=tmp_path / "run",
                                  progress=False, epochs=2, augment=False, batch_size=3))
    assert [c.ema_decay for c in configs] == [0.5]
    # the validation Dice that is reported is the released (averaged) model's, scored anew
    from task.reporting.bundle import load_bundle

    released = load_bundle(tmp_path / "run").model
    world = _world(central.get_preset("tiny"))
    again = training.evaluate_segmentation(released, *world["validation"]).get("mean")
    assert results["validation_dice_mean"] == pytest.approx(again)


# ------------------------------------------------------------------------------------ central DP-SGD
def _world(preset, seed=0, data=None, cache_root=None, progress=True):
    """Synthetic pooled world with a public validation set (public labels) and a test set."""
    from synthetic_worlds import pooled_world

    return pooled_world(preset, seed, n_train=6, n_test=2, n_validation=2)


def _public_weights(preset):
    from task.learning.networks import build_unet

    torch.manual_seed(4321)
    return {k: v.clone() for k, v in build_unet(preset.unet).state_dict().items()}


def test_dpsgd_grid_selects_on_public_validation_only_and_spends_exactly_the_budget(tmp_path, monkeypatch):
    import sim.runners.central as central

    monkeypatch.setattr(central, "load_central_data", _world)
    monkeypatch.setattr(central, "public_start", lambda preset, **kw: _public_weights(preset))
    scored, tested = [], []
    real_score, real_test = central.evaluate_segmentation, central.evaluate_release

    def score(model, images, labels, **options):   # the only evaluation that may choose: on public validation
        scored.append(images)
        return real_score(model, images, labels, **options)

    def test(model, images, labels, **options):
        tested.append((len(scored), images))
        return real_test(model, images, labels, **options)

    import task.learning.training as training

    # each grid entry's choice score is either the training's own last-epoch validation score or the runner's
    monkeypatch.setattr(central, "evaluate_segmentation", score)
    monkeypatch.setattr(training, "evaluate_segmentation", score)
    monkeypatch.setattr(central, "evaluate_release", test)
    results = central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "run", epsilon=2.0, delta=1e-3,
                                  progress=False, epochs=1, augment=False, batch_size=3))
    grid = results["settings_grid"]
    assert len(grid) == 2 and results["init"] == "public"
    assert all(images is scored[0] for images in scored) and len(scored) == len(grid)
    world = _world(central.get_preset("tiny"))
    np.testing.assert_array_equal(scored[0], world["validation"][0])
    # the test set is evaluated once, for the chosen model, after every choice was made
    assert [n for n, _ in tested] == [len(grid)]
    dice = results["settings_validation_dice"]
    assert results["setting_chosen"] == int(np.argmax(dice))
    assert results["learning_rate"] == grid[results["setting_chosen"]]["learning_rate"]
    # every grid run was a release; together they spend the budget, from the safe side
    ledger = Ledger.load(tmp_path / "run" / "ledger.jsonl")
    ids = [r["release_id"] for r in ledger.records()]
    assert any(":setting-0:" in i for i in ids) and any(":setting-1:" in i for i in ids)
    spent = ledger.spent("h0", 1e-3).epsilon
    assert results["epsilon"] == pytest.approx(spent) and 2.0 * 0.99 <= spent <= 2.0
    card = (tmp_path / "run" / "model" / "MODEL_CARD.md").read_text()
    assert "public model" in card


def test_init_public_starts_from_the_public_model_and_scratch_does_not(tmp_path, monkeypatch):
    import sim.runners.central as central
    from task.reporting.bundle import load_bundle

    monkeypatch.setattr(central, "load_central_data", _world)
    monkeypatch.setattr(central, "public_start", lambda preset, **kw: _public_weights(preset))
    public = _public_weights(central.get_preset("tiny"))
    for init in ("public", "scratch"):   # zero epochs: the released model is the start
        results = central.run_central(central.CentralConfig.of(method="nonprivate", preset="tiny", out=tmp_path / init, progress=False,
                                      epochs=0, augment=False, init=init))
        assert results["init"] == init
        weights = load_bundle(tmp_path / init).model.state_dict()
        same = all(torch.equal(weights[k], public[k]) for k in public)
        assert same == (init == "public")
    with pytest.raises(Exception, match="--init"):
        central.run_central(central.CentralConfig.of(method="nonprivate", preset="tiny", out=tmp_path / "x", progress=False, init="imagenet"))


# ------------------------------------------------------------------------------------ DP-FedAvg
def test_dpfedavg_grid_from_the_public_model_spends_exactly_the_budget(tmp_path):
    """Every grid entry is a federated run from the public start; each hospital calibrates one sigma for the
    whole plan, so its ledger's ε over all entries is the budget; the choice reads public validation only."""
    from clients.fedavg import plan_noise_multiplier
    from clients.hospital import Hospital, HospitalSettings
    from server.dpfedavg import DpFedAvgConfig, dpfedavg_settings, run_dpfedavg
    from task.settings.presets import get_preset
    from sim.runners.inprocess import InProcessTransport
    from types import SimpleNamespace

    preset = get_preset("tiny")
    rng = np.random.default_rng(0)
    data = {c: rng.normal(size=(4, *preset.grid)).astype(np.float32) for c in "abcdefgh"}
    prepared = SimpleNamespace(images=lambda ids: np.stack([data[i] for i in ids]),
                               labels=lambda ids: np.stack([(data[i][0] > 0.5).astype(np.int64) for i in ids]))
    hospitals = [Hospital(f"h{i}", prepared, [list("abcd"[2 * i:2 * i + 2]), list("efgh"[2 * i:2 * i + 2])], preset,
                          tmp_path / f"h{i}", HospitalSettings(lifetime_epsilon=100.0)) for i in range(2)]
    transport = InProcessTransport(hospitals, base_config={"ledger_dir": str(tmp_path / "ledgers"),
                                                           "lifetime_epsilon": 100.0, "delta": 1e-3})
    x = rng.normal(size=(4, 4, *preset.grid)).astype(np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64)
    world = SimpleNamespace(test_images=x[:2], test_labels=y[:2], validation_images=x[2:], validation_labels=y[2:],
                            source={"kind": "synthetic-test"}, grid=preset.grid)
    plan_noise_multiplier.cache_clear()
    start = {k: v.numpy() for k, v in _public_weights(preset).items()}
    quiet = Compute(progress=False)
    results = run_dpfedavg(transport, world, preset, DpFedAvgConfig(3.0, 1e-3, rounds=1, compute=quiet),
                           tmp_path / "run", init_weights=start)
    settings = dpfedavg_settings(preset, rounds=1)
    assert len(settings) == 2 and results["settings_grid"] == settings and results["init"] == "public"
    assert results["setting_chosen"] == int(np.argmax(results["settings_validation_dice"]))
    ledger = Ledger.load(tmp_path / "run" / "ledger.jsonl")
    for hospital in ("h0", "h1"):
        ids = [r["release_id"] for r in ledger.records() if r["owners"] == [hospital]]
        assert any("setting-0" in i for i in ids) and any("setting-1" in i for i in ids)
        assert 3.0 * 0.99 <= ledger.spent(hospital, 1e-3).epsilon <= 3.0
    assert json.loads((tmp_path / "run" / "results.json").read_text())["epsilon"] <= 3.0
