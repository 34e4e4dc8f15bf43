"""A pooled method may fix its own trainable set and learning rate (``task.settings.methods.Method.trainable`` /
``learning_rate``): ``dp-sgd-central-decoder`` trains the public model's decoder where ``dp-sgd-central`` trains the
preset's voxel head. The comparison's pooled cell runner must hand exactly those settings to the DP-SGD run, and
leave every other pooled method on the preset's."""

from pathlib import Path

import pytest

from sim.runners import cells
from sim.runners.central import TrainingOptions
from task.settings.methods import Method, method
from task.options import Trainable
from task.settings.runconfig import Cell


def test_the_decoder_variant_is_its_own_private_pooled_method():
    decoder, voxel = method("dp-sgd-central-decoder"), method("dp-sgd-central")
    assert decoder.private and decoder.runner == "pooled" and decoder.per_epsilon
    assert decoder.trainable is Trainable.DECODER and decoder.learning_rate == pytest.approx(2e-3)
    # a family of its own: the report's overlay figure (the best cell per family) shows it beside the voxel head
    assert decoder.family != voxel.family
    assert voxel.trainable is None and voxel.learning_rate is None   # the preset's voxel head


@pytest.mark.parametrize("fields, message", [
    ({"federated": True, "protocol": "pate", "trainable": "decoder"}, "only a pooled method"),
    ({"runner": "pooled", "learning_rate": 0.0}, "learning_rate must be > 0"),
    ({"runner": "pooled", "trainable": "no-such-set"}, "no-such-set"),
])
def test_a_method_record_refuses_settings_it_cannot_carry(fields, message):
    with pytest.raises(ValueError, match=message):
        Method("toy", "toy", "private", **fields)


def _context(tmp_path: Path) -> cells.CompareContext:
    return cells.CompareContext(preset_name="tiny", preset=None, data=None, seed=3, delta=1e-3, hospitals=None,
                                ledger_dir=tmp_path / "ledgers", lifetime_epsilon=16.0,
                                public_checkpoint=tmp_path / "_shared" / "public-model.pt")


@pytest.mark.parametrize("name, epsilon, training", [
    ("dp-sgd-central-decoder", 8.0, TrainingOptions(learning_rate=2e-3, levers={"trainable": Trainable.DECODER})),
    ("dp-sgd-central", 8.0, TrainingOptions()),
    ("nonprivate-central", None, TrainingOptions()),
])
def test_the_pooled_runner_passes_the_methods_own_settings(tmp_path, monkeypatch, name, epsilon, training):
    seen = []
    monkeypatch.setattr(cells, "run_central", seen.append)
    cells.run_pooled(_context(tmp_path), Cell(name, epsilon, str(tmp_path / name)))
    (config,) = seen
    assert config.training == training
    assert config.method_name == name   # results.json, the model card and the noise streams carry this name
    assert config.private == (epsilon is not None)
    assert config.hospital_ledger_dir == (tmp_path / "ledgers" if epsilon is not None else None)


@pytest.mark.parametrize("method, name", [("dp-sgd", "nonprivate-central"), ("nonprivate", "dp-sgd-central-decoder"),
                                          ("dp-sgd", "pate-anchored"), ("dp-sgd", "no-such-method")])
def test_a_pooled_run_refuses_a_name_that_is_not_its_kind(method, name):
    from sim.runners.central import CentralConfig
    from task.errors import UserError

    with pytest.raises(UserError, match=f"method name '{name}': not a registered pooled"):
        CentralConfig(method=method, name=name)


def test_the_demo_runs_the_decoder_variant_only_with_real_cases_to_check():
    from sim.commands.demo import DEMO_METHODS, demo_methods

    assert demo_methods() == DEMO_METHODS and "dp-sgd-central-decoder" not in demo_methods(secure=True)
    with_real = demo_methods(real_check=True).split(",")
    assert with_real[-1] == "dp-sgd-central-decoder" and with_real[:-1] == DEMO_METHODS.split(",")
    assert "pate-anchored-secure" in demo_methods(secure=True, real_check=True)


def test_a_checkpoint_left_under_one_method_name_is_not_resumed_under_another(tmp_path):
    """The same DP-SGD settings under two names draw two noise streams: resuming one's checkpoint as the other
    would mix them, so the folder is refused, naming the difference; the same name resumes."""
    from sim.runners.central import CentralConfig, record_central_settings
    from task.errors import UserError

    def config(name):
        return CentralConfig(method="dp-sgd", preset="tiny", out=tmp_path, name=name,
                             training=TrainingOptions(learning_rate=2e-3, levers={"trainable": Trainable.DECODER}))

    record_central_settings(config("dp-sgd-central-decoder"), tmp_path, "tiny", 8.0, 1e-3)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "train.pt").write_bytes(b"a checkpoint")
    record_central_settings(config("dp-sgd-central-decoder"), tmp_path, "tiny", 8.0, 1e-3)   # same name: resumes
    with pytest.raises(UserError, match="the method name dp-sgd-central-decoder there, dp-sgd-central now"):
        record_central_settings(config(None), tmp_path, "tiny", 8.0, 1e-3)
