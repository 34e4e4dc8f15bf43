"""The typed hospital requests (task/wire/requests.py): the keys on the wire, the defaults a hospital applies, and
one-line refusals naming the key."""

import json

import pytest

from task.errors import UserError
from task.options import Relation
from task.wire.requests import (FEDAVG_LEVERS, EvaluationRequest, FedAvgRoundRequest, HospitalRequest, QueryRequest,
                                RunContext, SecureStageRequest, TeacherTrainingRequest)

#: a teachers' recipe as the server sends it whole (``server.pate.teacher_training``)
RECIPE = {"teacher_epochs": 1, "teacher_trainable": "all", "teacher_learning_rate": 1e-3, "teacher_augment": False,
          "teacher_batch_size": 2}
#: a DP-FedAvg round's recipe as the server sends it whole (``server.dpfedavg``)
ROUND_RECIPE = {"learning_rate": 1e-3, "max_grad_norm": 0.1, "batch_size": 4, "per_layer": True}


def test_each_request_sends_exactly_the_keys_a_hospital_reads():
    query = QueryRequest(method="pate-pca", seed=0, queries=[0, 1], release_ids=["q-0", "q-1"], sigma=0.5, teachers=4,
                         delta=1e-3, device="cpu", precision="32")
    assert query.to_config() == {"method": "pate-pca", "seed": 0, "queries": [0, 1], "release_ids": ["q-0", "q-1"],
                                 "sigma": 0.5, "teachers": 4, "delta": 1e-3, "device": "cpu", "precision": "32"}
    diagnostic = QueryRequest(method="pate-pca", diagnostic=True, device="auto", precision="32")
    assert diagnostic.to_config() == {"method": "pate-pca", "diagnostic": True, "device": "auto", "precision": "32"}
    train = TeacherTrainingRequest(teacher_epochs=2, seed=1, device="auto", precision="32", teacher_trainable="all",
                                   teacher_learning_rate=1e-3, teacher_augment=True, teacher_batch_size=2,
                                   init_weights={"w": [0.0]})
    assert train.to_config() == {"teacher_epochs": 2, "seed": 1, "device": "auto", "precision": "32",
                                 "teacher_trainable": "all", "teacher_learning_rate": 1e-3, "teacher_augment": True,
                                 "teacher_batch_size": 2}
    assert EvaluationRequest(seed=0, device="auto", precision="32", images=[1]).to_config() == \
        {"seed": 0, "device": "auto", "precision": "32"}   # the test arrays travel beside the config
    assert SecureStageRequest(method="dp-fedavg-secure", delta=1e-3, device="auto", precision="32").to_config() == \
        {"method": "dp-fedavg-secure", "delta": 1e-3, "device": "auto", "precision": "32"}
    assert RunContext(preset="tiny", seed=0, world="/w", preset_overrides={"hospitals": 2}).to_config() == \
        {"preset": "tiny", "seed": 0, "world": "/w", "preset_overrides": {"hospitals": 2}}


def test_a_fedavg_round_sends_every_setting_and_its_levers():
    plan = json.dumps([{"batch_size": 4, "epochs": 2}])
    request = FedAvgRoundRequest(round=1, rounds=2, local_epochs=1, epsilon=8.0, delta=1e-3, seed=0, run_tag="r-1",
                                 relation=Relation.REPLACE_ONE, setting=0, plan=plan, learning_rate=1e-3,
                                 max_grad_norm=0.1, batch_size=4, per_layer=False, device="auto", precision="32",
                                 trainable="voxel-head")
    config = request.to_config()
    assert set(config) == {"round", "rounds", "local_epochs", "epsilon", "delta", "seed", "run_tag",
                           "reproducible_noise", "relation", "setting", "plan", "learning_rate", "max_grad_norm",
                           "batch_size", "per_layer", "device", "precision", "trainable"}
    assert config["relation"] is Relation.REPLACE_ONE and config["reproducible_noise"] is False
    assert FedAvgRoundRequest.from_config(config) == request
    assert request.plan_entries() == [{"batch_size": 4, "epochs": 2}] and request.levers() == {"trainable": "voxel-head"}


def test_the_fedavg_levers_are_the_training_engines():
    from task.learning.training import LEVER_KEYS

    assert FEDAVG_LEVERS == LEVER_KEYS


def test_a_hospital_reads_what_it_was_sent_and_its_own_defaults_for_the_rest():
    received = {"round": 0, "rounds": 1, "epsilon": 4.0, "delta": 1e-3, "preset": "tiny", "world": "/w",
                "ledger_dir": "/l", "lifetime_epsilon": 8.0, "allow_identity": True, **ROUND_RECIPE}
    request = FedAvgRoundRequest.from_config(received)
    assert (request.local_epochs, request.seed, request.run_tag, request.relation) == (1, 0, "run", Relation.REPLACE_ONE)
    assert request.plan_entries() is None and request.levers() == {}
    assert (request.ledger_dir, request.lifetime_epsilon, request.delta, request.allow_identity) == ("/l", 8.0, 1e-3, True)
    with pytest.raises(UserError, match="no teacher_epochs, teacher_trainable, teacher_learning_rate, teacher_augment, "
                                        "teacher_batch_size"):
        TeacherTrainingRequest.from_config({"teacher_learning_rate": 0, "teacher_trainable": ""})   # unset: refused
    training = TeacherTrainingRequest.from_config(RECIPE)
    assert training.seed is None and training.local_dp is None   # the hospital's own seed; no local DP-SGD
    assert QueryRequest.from_config({"diagnostic": True}).release_ids is None
    assert HospitalRequest.from_config(None) == HospitalRequest()
    assert QueryRequest.from_config(request := QueryRequest(diagnostic=True)) is request


@pytest.mark.parametrize("kind, config, key", [
    (QueryRequest, {}, "release_ids"),
    (QueryRequest, {"release_ids": ["a"], "sigma": 0.0, "teachers": 2}, "sigma"),
    (QueryRequest, {"release_ids": "a", "sigma": 1.0, "teachers": 2}, "release_ids"),
    (QueryRequest, {"release_ids": ["a"], "sigma": 1.0, "teachers": True}, "teachers"),
    (FedAvgRoundRequest, {"round": 0, "epsilon": 1.0, "delta": 1e-3}, "rounds"),
    (FedAvgRoundRequest, {"round": 0, "rounds": 1, "epsilon": 1.0, "delta": 2.0}, "delta"),
    (FedAvgRoundRequest, {"round": 0, "rounds": 1, "epsilon": 1.0, "delta": 1e-3, "relation": "x"}, "relation"),
    (FedAvgRoundRequest, {"round": 0, "rounds": 1, "epsilon": 1.0, "delta": 1e-3, "plan": "[{}]", "setting": 0,
                          **ROUND_RECIPE}, "plan"),
    (FedAvgRoundRequest, {"round": 0, "rounds": 1, "epsilon": 1.0, "delta": 1e-3, **ROUND_RECIPE, "batch_size": 0},
     "batch_size"),
    (FedAvgRoundRequest, {"round": 0, "rounds": 1, "epsilon": 1.0, "delta": 1e-3, **ROUND_RECIPE, "per_layer": 1},
     "per_layer"),
    (TeacherTrainingRequest, {"teacher_trainable": "everything"}, "teacher_trainable"),
    (TeacherTrainingRequest, {**RECIPE, "local_dp": {"delta": 1e-3}}, "local_dp"),
    (HospitalRequest, {"device": "tpu"}, "device"),
    (HospitalRequest, {"secure_policy": {"colluders": -1}}, "secure_policy.colluders"),
    (RunContext, {"seed": 0}, "preset"),
])
def test_a_malformed_request_is_refused_in_one_line_naming_the_key(kind, config, key):
    with pytest.raises(UserError, match=key) as info:
        kind.from_config(config)
    assert "\n" not in str(info.value)


def test_the_run_settings_tell_simulated_hospitals_their_privacy():
    from task.settings.runconfig import RunSettings

    config = RunSettings(method="pate-pca", out="/runs/x", epsilon=2.0).hospital_privacy_config()
    assert config == {"ledger_dir": "/runs/x/hospital-ledgers", "lifetime_epsilon": 2.0, "delta": 1e-3,
                      "allow_identity": True, "secure_policy": {"colluders": 0, "dropouts": 0}}
    assert HospitalRequest.from_config(config).to_config() == config


def test_a_train_request_carries_the_teachers_whole_recipe_and_a_hospital_refuses_one_without(tmp_path):
    """The server resolves the teachers' recipe once (``server.pate.teacher_training``) and sends every field of
    it; a request missing one is refused in one line naming it, before anything trains or is charged, instead of
    being completed from the hospital's own preset."""
    from types import SimpleNamespace

    from clients.hospital import Hospital, HospitalSettings
    from server.pate import teacher_training
    from task.settings.presets import get_preset

    preset = get_preset("tiny")
    sent = teacher_training(preset).to_config()
    assert set(TeacherTrainingRequest.RECIPE) <= set(sent)
    assert sent["teacher_epochs"] == preset.teacher.epochs and sent["teacher_augment"] == preset.teacher.augment
    assert sent["teacher_learning_rate"] == float(preset.teacher.learning_rate or preset.learning_rate)
    assert sent["teacher_batch_size"] == preset.batch_size
    with pytest.raises(UserError, match=r"^train request: no teacher_trainable, teacher_augment, teacher_batch_size; "
                                        "a request carries"):
        TeacherTrainingRequest(teacher_epochs=1, teacher_learning_rate=1e-3)
    prepared = SimpleNamespace(images=lambda ids: pytest.fail("a refused request read patients"),
                               labels=lambda ids: pytest.fail("a refused request read patients"), grid=preset.grid)
    hospital = Hospital("h0", prepared, [["p0"], ["p1"]], preset, tmp_path / "h0", HospitalSettings())
    for dropped in TeacherTrainingRequest.RECIPE:
        with pytest.raises(UserError, match=f"^hospital h0: train request: no {dropped};"):
            hospital.train_teachers({k: v for k, v in sent.items() if k != dropped})
    assert not (tmp_path / "h0" / "teachers").exists() and not (tmp_path / "h0" / "ledger.jsonl").exists()


class _Trained(Exception):
    """Raised by the training-engine spy once it has seen what the hospital asked for (nothing trains)."""


def _spy_on_training(monkeypatch, module) -> list:
    """Replace ``module.train_segmentation`` with a spy that records (config, private) and stops the request."""
    seen = []

    def spy(model, images, labels, config, private=None):
        seen.append((config, private))
        raise _Trained

    monkeypatch.setattr(module, "train_segmentation", spy)
    return seen


def _zeros():
    from types import SimpleNamespace

    import numpy as np

    return SimpleNamespace(images=lambda ids: np.zeros((len(ids), 4, 16, 16, 16), np.float32),
                           labels=lambda ids: np.zeros((len(ids), 16, 16, 16), np.int64), grid=(16, 16, 16))


def test_a_hospital_trains_its_teachers_at_the_requests_batch_size_not_its_presets(tmp_path, monkeypatch):
    """The teachers' batch size is the server's (``teacher_batch_size``), even where the hospital's own preset
    says otherwise: the setting is resolved once, by the server."""
    import clients.hospital as hospital_module
    from clients.hospital import Hospital, HospitalSettings
    from server.pate import teacher_training
    from task.settings.presets import get_preset

    preset = get_preset("tiny")
    seen = _spy_on_training(monkeypatch, hospital_module)
    asked = {**teacher_training(preset).to_config(), "teacher_batch_size": preset.batch_size + 1,
             "teacher_learning_rate": 2 * preset.learning_rate, "seed": 0}
    hospital = Hospital("h0", _zeros(), [["p0", "p1", "p2"]], preset, tmp_path / "h0", HospitalSettings())
    with pytest.raises(_Trained):
        hospital.train_teachers(asked)
    (config, _), = seen
    assert (config.batch_size, config.learning_rate) == (preset.batch_size + 1, 2 * preset.learning_rate)


def test_a_dpfedavg_round_trains_by_the_requests_recipe_not_its_presets(tmp_path, monkeypatch):
    """A round's learning rate, expected batch, clipping norm and per-layer clipping are the server's, each unlike
    the hospital's own preset; a round without one of them is refused in one line naming it, before anything is
    charged or written."""
    import numpy as np

    import clients.fedavg as fedavg_module
    import privacy.calibration as calibration
    from clients.fedavg import local_dpsgd_round, plan_noise_multiplier
    from clients.hospital import Hospital, HospitalSettings
    from task.learning.networks import build_unet
    from task.settings.presets import get_preset

    preset = get_preset("tiny")
    monkeypatch.setattr(calibration, "composed_dpsgd_noise_multiplier", lambda *a, **kw: 3.0)  # skip the PLD search
    plan_noise_multiplier.cache_clear()
    seen = _spy_on_training(monkeypatch, fedavg_module)
    recipe = {"learning_rate": 2 * preset.learning_rate, "batch_size": preset.batch_size + 1,
              "max_grad_norm": 2 * preset.dp_sgd.max_grad_norm, "per_layer": not preset.dp_sgd.per_layer}
    asked = {"round": 0, "rounds": 1, "epsilon": 50.0, "delta": 1e-3, "reproducible_noise": True, **recipe}
    weights = {k: v.numpy() for k, v in build_unet(preset.unet).state_dict().items()}
    hospital = Hospital("h0", _zeros(), [["a", "b", "c", "d"]], preset, tmp_path / "h0",
                        HospitalSettings(lifetime_epsilon=100.0))
    for dropped in recipe:
        with pytest.raises(UserError, match=f"^hospital h0: dp-fedavg round request: no {dropped}; ") as info:
            local_dpsgd_round(hospital, weights, {k: v for k, v in asked.items() if k != dropped})
        assert "\n" not in str(info.value)
    assert not (tmp_path / "h0").exists() and not seen   # refused before any ledger, answer or training
    with pytest.raises(_Trained):
        local_dpsgd_round(hospital, weights, asked)
    plan_noise_multiplier.cache_clear()
    (config, private), = seen
    assert set(FedAvgRoundRequest.RECIPE) == set(recipe)
    assert (config.learning_rate, config.batch_size) == (recipe["learning_rate"], recipe["batch_size"])
    assert (private.dp.max_grad_norm, private.dp.per_layer) == (recipe["max_grad_norm"], recipe["per_layer"])


@pytest.mark.parametrize("local_dp, refusal", [
    ({"mode": "fixed", "epsilon": 2.0, "delta": 1e-3, "max_grad_norm": 1.0}, "noise_multiplier: --noise-mode fixed"),
    ({"epsilon": 2.0, "delta": 1e-3, "max_grad_norm": 1.0, "clip": 2.0}, "unexpected keyword argument 'clip'"),
    ({"epsilon": 2.0, "delta": 1e-3, "max_grad_norm": 1.0, "sampling": "shuffle", "relation": "add-remove"},
     "--relation"),
])
def test_a_hospital_refuses_local_dpsgd_it_cannot_run_before_anything_trains(tmp_path, monkeypatch, local_dp, refusal):
    """The teachers' local DP-SGD (DPConfig fields) is validated once, before the hospital forgets its earlier
    teachers or trains: a fixed noise without its σ (DPConfig has none of its own), a field DPConfig lacks, or a
    relation the batching has no analysis for is refused in one line naming the hospital."""
    import clients.hospital as hospital_module
    from clients.hospital import Hospital, HospitalSettings
    from server.pate import teacher_training
    from task.settings.presets import get_preset

    preset = get_preset("tiny")
    seen = _spy_on_training(monkeypatch, hospital_module)
    hospital = Hospital("h0", _zeros(), [["p0"], ["p1"]], preset, tmp_path / "h0", HospitalSettings())
    earlier = tmp_path / "h0" / "teachers" / "training.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("{}")
    with pytest.raises(UserError, match="^hospital h0: local_dp: ") as info:
        hospital.train_teachers({**teacher_training(preset).to_config(), "seed": 0, "local_dp": local_dp})
    assert refusal in str(info.value) and "\n" not in str(info.value)
    assert not seen and earlier.exists() and not (tmp_path / "h0" / "ledger.jsonl").exists()
