"""The voxel head (``task.learning.networks.VoxelHeadUNet``): a small per-voxel correction of the public
model's logits from those logits and the scan, the only weights DP fine-tuning trains under ``trainable="voxel-head"``."""

import json

import numpy as np
import pytest
import torch

from task.learning.compute import Compute
from task.learning.dpsgd import DPConfig, PrivateTraining
from task.errors import UserError
from task.learning.networks import (VOXEL_HEAD, VoxelHeadUNet, build_unet, build_unet_from_config, freeze_all_but,
                                    load_start_weights, network_config, network_config_of, trainable_parameter_names)
from task.learning.training import TrainConfig, evaluate_segmentation, train_segmentation


def _data(n=4, grid=(16, 16, 16), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 4, *grid)).astype(np.float32),
            rng.integers(0, 4, size=(n, *grid)).astype(np.int64))


def _public(preset="tiny", seed=0):
    torch.manual_seed(seed)
    return build_unet(preset)


def test_a_voxel_head_started_from_the_public_model_is_the_public_model():
    public = _public()
    model = build_unet("tiny", trainable=VOXEL_HEAD)
    load_start_weights(model, public.state_dict())
    images = torch.as_tensor(_data(2)[0])
    with torch.no_grad():
        assert torch.equal(model(images), public(images))   # W2, b2 = 0: the correction starts at zero
    # the U-Net keeps its parameter names under the head, and the head is the only thing added
    assert set(model.state_dict()) - set(public.state_dict()) == {n for n in model.state_dict()
                                                                    if n.startswith("voxel_head.")}


def test_the_voxel_head_is_the_only_trainable_set_of_its_network_and_is_small():
    model = build_unet("small", trainable=VOXEL_HEAD)
    count = freeze_all_but(model, VOXEL_HEAD)
    assert count == (8 * 16 + 16) + 1 + (16 * 4 + 4)   # W1, b1, one PReLU slope, W2, b2
    assert count < 0.002 * sum(p.numel() for p in model.parameters())
    assert trainable_parameter_names(model, VOXEL_HEAD) == {n for n, _ in model.named_parameters()
                                                           if n.startswith("voxel_head.")}
    with pytest.raises(UserError, match="no voxel head"):
        trainable_parameter_names(build_unet("small"), VOXEL_HEAD)


def test_dpsgd_on_the_voxel_head_moves_only_the_head_and_is_charged():
    """Frozen U-Net weights get no per-sample gradient, hence no clipping share and no noise: after DP-SGD
    every U-Net weight is exactly the public model's, the head has moved, and every epoch is on the ledger."""
    images, labels = _data()
    public = _public()
    model = build_unet("tiny", trainable=VOXEL_HEAD)
    dp = DPConfig(mode="fixed", noise_multiplier=1.0, epsilon=1e6, delta=1e-3, max_grad_norm=0.1)
    result = train_segmentation(model, images, labels,
                                TrainConfig(epochs=2, batch_size=2, learning_rate=1e-2, augment=False,
                                            trainable=VOXEL_HEAD, init_from=public.state_dict(),
                                            compute=Compute(device="cpu", progress=False)), PrivateTraining(dp))
    trained = dict(result.model.named_parameters())
    for name, value in public.named_parameters():
        assert torch.equal(trained[name].detach(), value.detach()), name
    assert not torch.all(trained["voxel_head.2.weight"] == 0)
    assert result.epsilon is not None and result.epsilon > 0 and len(result.sigmas) == 2


def test_a_bundle_describes_and_rebuilds_the_network_with_its_head():
    model = build_unet("tiny", trainable=VOXEL_HEAD)
    torch.nn.init.normal_(model.voxel_head[2].weight)   # a trained head
    config = json.loads(json.dumps(network_config_of(model, "tiny")))   # what a bundle stores
    assert config == network_config("tiny", trainable=VOXEL_HEAD) and config["voxel_head_hidden"] == 16
    rebuilt = build_unet_from_config(config)
    assert isinstance(rebuilt, VoxelHeadUNet)
    rebuilt.load_state_dict(model.state_dict())
    images = torch.as_tensor(_data(1)[0])
    with torch.no_grad():
        assert torch.equal(rebuilt(images), model(images))
    # a network without a head is described, and rebuilt, exactly as before the head existed
    assert "voxel_head_hidden" not in network_config_of(build_unet("tiny"), "tiny")
    assert not isinstance(build_unet_from_config(network_config("tiny")), VoxelHeadUNet)


def test_start_weights_that_do_not_fit_the_unet_under_the_head_are_refused():
    model = build_unet("tiny", trainable=VOXEL_HEAD)
    with pytest.raises(UserError, match="voxel head"):
        load_start_weights(model, build_unet("small").state_dict())
    state = _public().state_dict()
    state.pop(next(iter(state)))
    with pytest.raises(UserError, match="missing"):
        load_start_weights(model, state)


def test_central_dpsgd_releases_a_voxel_head_bundle(tmp_path, monkeypatch):
    """run_central with the lever: the bundle holds the head, its card the ledger's epsilon, and the U-Net under it
    is the public start."""
    import sim.runners.central as central
    from task.reporting.bundle import load_bundle

    from synthetic_worlds import pooled_world

    monkeypatch.setattr(central, "load_central_data", lambda preset, seed=0, **kw: pooled_world(preset, seed, n_train=4, n_test=2))
    public = {k: v.clone() for k, v in _public().state_dict().items()}
    monkeypatch.setattr(central, "public_start", lambda *a, **kw: public)
    written = central.run_central(central.CentralConfig.of(
        method="dp-sgd", preset="tiny", out=tmp_path / "run", epsilon=8.0, delta=1e-3, progress=False, epochs=1,
        augment=False, levers={"trainable": VOXEL_HEAD}))
    bundle = load_bundle(tmp_path / "run")
    assert isinstance(bundle.model, VoxelHeadUNet) and bundle.network["voxel_head_hidden"] == 16
    assert bundle.card["epsilon"] == pytest.approx(written["epsilon"]) and written["epsilon"] > 0
    state = bundle.model.state_dict()
    assert all(torch.equal(state[name], value) for name, value in public.items())


def test_a_dpfedavg_round_trains_the_voxel_head_the_server_sends(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import privacy.calibration as calibration
    from clients.fedavg import local_dpsgd_round, plan_noise_multiplier
    from clients.hospital import Hospital, HospitalSettings
    from server.dpfedavg import dpfedavg_settings
    from task.settings.presets import DpSetting, get_preset

    monkeypatch.setattr(calibration, "composed_dpsgd_noise_multiplier", lambda *a, **kw: 3.0)  # skip the PLD search
    plan_noise_multiplier.cache_clear()
    images, labels = _data(4)
    prepared = SimpleNamespace(images=lambda ids: images[: len(ids)], labels=lambda ids: labels[: len(ids)])
    entry = DpSetting(trainable=VOXEL_HEAD, learning_rate=1e-2)
    preset = get_preset("tiny").with_changes(dp_fedavg=dict(grid=(entry,)))
    setting = dpfedavg_settings(preset)[0]
    model = build_unet("tiny", trainable=VOXEL_HEAD)
    load_start_weights(model, _public().state_dict())
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    hospital = Hospital("h0", prepared, [["a", "b"], ["c", "d"]], preset, tmp_path / "h0",
                        HospitalSettings(lifetime_epsilon=100.0))
    config = {"round": 0, "rounds": 1, "epsilon": 50.0, "delta": 1e-3, "reproducible_noise": True,
              "learning_rate": setting["learning_rate"], "max_grad_norm": setting["max_grad_norm"],
              "batch_size": setting["batch_size"], "per_layer": preset.dp_sgd.per_layer, "trainable": setting["trainable"]}
    new_weights, metrics = local_dpsgd_round(hospital, weights, config)
    assert metrics["epochs_trained"] == 1 and json.loads(metrics["ledger_records"])
    changed = {name for name in weights if not np.array_equal(weights[name], new_weights[name])}
    assert changed and all(name.startswith("voxel_head.") for name in changed)


def test_voxel_head_teachers_train_only_their_heads_and_are_reloaded_as_what_they_are(tmp_path):
    """A hospital asked for voxel-head teachers trains one head per partition on the public model; a fresh
    hospital object (another process, the same workdir) rebuilds each teacher from its saved weights; asking for
    full fine-tuning instead is another training, not the cached one."""
    from types import SimpleNamespace

    from clients.hospital import Hospital, HospitalSettings
    from server.pate import teacher_training
    from task.settings.presets import get_preset

    images, labels = _data(4)
    index = {case: i for i, case in enumerate("abcd")}
    prepared = SimpleNamespace(images=lambda ids: images[[index[c] for c in ids]],
                               labels=lambda ids: labels[[index[c] for c in ids]], grid=(16, 16, 16))
    preset = get_preset("tiny")
    preset = preset.with_changes(teacher=dict(trainable=VOXEL_HEAD, learning_rate=1e-2, augment=False))
    public = {k: v.numpy() for k, v in _public().state_dict().items()}
    hospital = Hospital("h0", prepared, [["a", "b"], ["c", "d"]], preset, tmp_path / "h0",
                        HospitalSettings(lifetime_epsilon=10.0))
    config = {**teacher_training(preset).to_config(), "teacher_epochs": 2, "seed": 0, "init_weights": public}
    assert config["teacher_trainable"] == VOXEL_HEAD and config["teacher_augment"] is False
    hospital.train_teachers(config)
    scans = images[:1]
    again = Hospital("h0", prepared, [["a", "b"], ["c", "d"]], preset, tmp_path / "h0",
                     HospitalSettings(lifetime_epsilon=10.0))
    for k in range(2):
        teacher = again._teacher(k)
        assert isinstance(teacher, VoxelHeadUNet)
        state = teacher.state_dict()
        assert all(np.array_equal(state[name].numpy(), value) for name, value in public.items())   # U-Net frozen
        assert not torch.all(state["voxel_head.2.weight"] == 0)
        np.testing.assert_array_equal(again.teacher_probs(k, scans), hospital.teacher_probs(k, scans))
    assert again.train_teachers(config).get("reused")
    assert not again.train_teachers({**config, "precision": "bf16"}).get("reused")   # other teachers
    assert again.train_teachers({**config, "precision": "bf16"}).get("reused")
    full = again.train_teachers({**config, "teacher_trainable": "all"})
    assert not full.get("reused") and not isinstance(again._teacher(0), VoxelHeadUNet)


def _head_hospital(tmp_path, partitions, precision="32", name="h0", augment=False, n=7):
    from types import SimpleNamespace

    from clients.hospital import Hospital, HospitalSettings
    from task.settings.presets import get_preset

    images, labels = _data(n)
    index = {case: i for i, case in enumerate("abcdefghij"[:n])}
    prepared = SimpleNamespace(images=lambda ids: images[[index[c] for c in ids]],
                               labels=lambda ids: labels[[index[c] for c in ids]], grid=(16, 16, 16))
    preset = get_preset("tiny").with_changes(teacher=dict(trainable=VOXEL_HEAD, learning_rate=1e-2, augment=augment))
    hospital = Hospital(name, prepared, partitions, preset, tmp_path / name,
                        HospitalSettings(lifetime_epsilon=10.0, device="cpu", precision=precision))
    return hospital, images, labels, preset


def _train_heads(hospital, preset, epochs=3):
    from server.pate import teacher_training

    public = {k: v.numpy() for k, v in _public().state_dict().items()}
    torch.manual_seed(5)   # teacher 0's head is drawn from the global generator, as it always was
    return hospital.train_teachers({**teacher_training(preset).to_config(), "teacher_epochs": epochs, "seed": 0,
                                    "init_weights": public})


def _heads_of(hospital):
    return [{n: v for n, v in hospital._teacher(k).state_dict().items() if n.startswith("voxel_head.")}
            for k in range(hospital.num_teachers)]


def test_voxel_head_teachers_trained_together_are_the_teachers_trained_one_by_one(tmp_path, monkeypatch):
    """A hospital trains all its voxel-head teachers at once (the frozen U-Net once per patient, the heads stacked,
    one optimiser): each head starts where the per-teacher loop drew it and ends where that loop's training takes
    it, to float tolerance -- with partitions of 1, 2 and 3 patients (a teacher with one batch per epoch sits out
    the other's second step) and one without patients (it keeps its start); one file holds every head."""
    import clients.hospital

    partitions = [["a"], ["b", "c"], ["d", "e", "f"], []]
    together, _, _, preset = _head_hospital(tmp_path, partitions, name="together")
    _train_heads(together, preset)
    assert together._heads_path().exists() and not together._teacher_path(0).exists()
    rng_after_together = torch.get_rng_state()
    monkeypatch.setattr(clients.hospital, "stacked_training_applies", lambda *a, **k: False)
    alone, _, _, _ = _head_hospital(tmp_path, partitions, name="alone")
    _train_heads(alone, preset)
    assert alone._teacher_path(3).exists() and not alone._heads_path().exists()
    assert torch.equal(torch.get_rng_state(), rng_after_together)   # the run's generator left where it was
    start = build_unet("tiny", trainable=VOXEL_HEAD).voxel_head.state_dict()
    for k, (mine, theirs) in enumerate(zip(_heads_of(together), _heads_of(alone))):
        for name, value in theirs.items():
            torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-6, msg=f"teacher {k} {name}")
        if k < 3:
            assert not torch.equal(mine["voxel_head.2.weight"], start["2.weight"])   # trained
    assert torch.all(_heads_of(together)[3]["voxel_head.2.weight"] == 0)   # no patients: the identity correction


def test_the_training_record_says_which_teachers_file_is_current(tmp_path):
    """A heads file left from an earlier stacked training does not stand in for teachers a later training kept one
    file each (a record without ``storage``: as every training wrote before stacked heads)."""
    import json

    from clients.hospital import Hospital

    hospital, images, _, preset = _head_hospital(tmp_path, [["a", "b"], ["c", "d"]])
    _train_heads(hospital, preset, epochs=1)
    record = hospital.workdir / "teachers" / "training.json"
    assert json.loads(record.read_text())["storage"] == "voxel-heads"
    later = []
    for k in range(2):   # a later training, one file per teacher: other heads
        state = hospital._teacher(k).state_dict()
        state["voxel_head.2.bias"] = state["voxel_head.2.bias"] + 1.0
        torch.save(state, hospital._teacher_path(k))
        later.append(state["voxel_head.2.bias"])
    saved = json.loads(record.read_text())
    record.write_text(json.dumps({"fingerprint": saved["fingerprint"], "metrics": saved["metrics"]}))
    again = Hospital("h0", hospital.prepared, hospital.partitions, preset, hospital.workdir, hospital.settings)
    assert again._heads_path().exists() and again.has_trained_teachers()
    for k in range(2):
        assert torch.equal(again._teacher(k).state_dict()["voxel_head.2.bias"], later[k])


def test_voxel_head_teachers_under_local_dpsgd_still_train_one_by_one_each_charged_to_its_own_owner(tmp_path):
    """Local DP-SGD keeps each teacher's own Opacus session, Poisson sampling, noise stream and ledger owner: the
    hospital does not stack those heads (each teacher in its own file, each charged as its own owner), and still
    answers with them stacked, their U-Net being the same frozen public model."""
    from privacy.ledger import Ledger
    from server.pate import teacher_training

    hospital, images, _, preset = _head_hospital(tmp_path, [["a", "b"], ["c", "d"]])
    local_dp = {"mode": "fixed", "noise_multiplier": 2.0, "epsilon": 1000.0, "delta": 1e-3, "max_grad_norm": 1.0}
    public = {k: v.numpy() for k, v in _public().state_dict().items()}
    metrics = hospital.train_teachers({**teacher_training(preset).to_config(), "teacher_epochs": 1, "seed": 0,
                                       "init_weights": public, "local_dp": local_dp})
    assert metrics["local_epsilon"] > 0
    assert hospital._teacher_path(0).exists() and hospital._teacher_path(1).exists()
    assert not hospital._heads_path().exists()
    ledger = Ledger.load(hospital.workdir / "ledger.jsonl")
    assert ledger.owners() == ["h0/teacher-0", "h0/teacher-1"] and len(ledger) == 2
    assert hospital._stacked_teachers(torch.device("cpu")) is not None   # answers: one U-Net pass for both
    np.testing.assert_allclose(next(hospital.each_teacher_probs(images[:2])), hospital.teacher_probs(0, images[:2]),
                               atol=1e-5)


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_voxel_head_teachers_answer_with_one_unet_pass_and_stacked_heads(tmp_path, precision):
    """Voxel-head teachers trained together answer with their shared U-Net run once per query scan (in
    predict_probs' batches) and every head in one batched product; each teacher's answer is what running that
    teacher alone gives, up to float summation order (bf16: up to bf16 rounding); the per-teacher Dice a simulated
    hospital reports is each teacher's own."""
    hospital, images, labels, preset = _head_hospital(tmp_path, [["a", "b"], ["c", "d"], ["e", "f"]], precision)
    _train_heads(hospital, preset, epochs=2)
    scans = images[:5]   # an odd count: the last batch holds one scan
    one_by_one = [hospital.teacher_probs(k, scans) for k in range(3)]
    assert not np.array_equal(one_by_one[0], one_by_one[1])   # the heads differ, so the answers do
    unet, _ = hospital._stacked_teachers(torch.device("cpu"))
    unet_calls = []
    unet.register_forward_hook(lambda module, inputs, output: unet_calls.append(len(inputs[0])))
    shared = list(hospital.each_teacher_probs(scans))
    assert unet_calls == [2, 2, 1] and len(shared) == 3   # one pass, not one per teacher
    tolerance = 1e-5 if precision == "32" else 3e-2
    for k in range(3):
        np.testing.assert_allclose(shared[k], one_by_one[k], atol=tolerance)
    unet_calls.clear()
    reported = hospital.evaluate({"images": scans, "labels": labels[:5]})["teacher_dice"]
    assert unet_calls == [2, 2, 1]
    own = [evaluate_segmentation(hospital._teacher(k), scans, labels[:5], precision=precision)["mean"]
           for k in range(3)]
    assert reported == pytest.approx(own, abs=1e-6 if precision == "32" else 2e-2)


def test_teachers_in_files_of_their_own_are_compared_once_and_answer_alone_when_their_unets_differ(tmp_path,
                                                                                                 monkeypatch):
    """Teachers trained one by one (augmentation: each its own file) that share the public U-Net bit for bit answer
    through the stacked heads too, the weights compared once when loaded, not at every query; a teacher whose U-Net
    differs in one weight sends the hospital back to running its teachers one by one."""
    from clients.hospital import Hospital

    hospital, images, _, preset = _head_hospital(tmp_path, [["a", "b"], ["c", "d"], ["e", "f"]], augment=True)
    _train_heads(hospital, preset, epochs=1)
    assert hospital._teacher_path(2).exists() and not hospital._heads_path().exists()
    scans = images[:3]
    compared = []
    original = Hospital._shared_unet_of_files
    monkeypatch.setattr(Hospital, "_shared_unet_of_files", lambda self: compared.append(1) or original(self))
    first = list(hospital.each_teacher_probs(scans))
    second = list(hospital.each_teacher_probs(scans))
    assert compared == [1]
    for k in range(3):
        np.testing.assert_array_equal(first[k], second[k])
        np.testing.assert_allclose(first[k], hospital.teacher_probs(k, scans), atol=1e-5)

    state = torch.load(hospital._teacher_path(2), weights_only=True)
    name = next(n for n in state if n.startswith("model."))
    state[name].view(-1)[0] += 1e-3
    torch.save(state, hospital._teacher_path(2))
    again = Hospital("h0", hospital.prepared, hospital.partitions, preset, hospital.workdir, hospital.settings)
    assert again._stacked_teachers(torch.device("cpu")) is None
    changed = list(again.each_teacher_probs(scans))
    np.testing.assert_array_equal(changed[0], again.teacher_probs(0, scans))
    np.testing.assert_array_equal(changed[2], again.teacher_probs(2, scans))
    assert not np.allclose(changed[2], first[2], atol=1e-7)


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_a_voxel_head_on_a_frozen_unet_trains_the_same_with_the_unet_output_remembered(monkeypatch, precision):
    """Training only the head without augmentation runs the frozen U-Net once per distinct batch, not once per
    step, and gives the same weights and history bit for bit as running it every step; validation inside the
    loop is computed, not served from the training batches' memo."""
    import task.learning.training

    images, labels = _data(2)
    validation = _data(2, seed=1)
    config = TrainConfig(epochs=6, batch_size=2, learning_rate=1e-2, seed=3, trainable=VOXEL_HEAD, augment=False,
                         compute=Compute(device="cpu", precision=precision, progress=False))

    def train(remember: bool):
        if not remember:
            monkeypatch.setattr(task.learning.training._FrozenUNetMemo, "for_training", classmethod(lambda *a, **k: None))
        public = _public().state_dict()
        torch.manual_seed(7)   # the head's first layer starts random: the same start both ways
        model = build_unet("tiny", trainable=VOXEL_HEAD)
        load_start_weights(model, public)
        runs = []
        model.model[0].register_forward_hook(lambda module, inputs, output: runs.append(len(inputs[0])))
        result = train_segmentation(model, images, labels, config, validation=validation)
        monkeypatch.undo()
        return result, len(runs)

    remembered, runs_remembered = train(True)
    plain, runs_plain = train(False)
    # 2 patients in one batch per epoch, then 2 validation scans in one batch: 6 epochs x 2 runs of the U-Net
    assert runs_plain == 6 * 2
    # the batch comes in one of 2 orders, each run once; validation is run every epoch
    assert 6 + 1 <= runs_remembered <= 6 + 2
    for name, value in plain.model.state_dict().items():
        assert torch.equal(remembered.model.state_dict()[name], value), name
    assert remembered.history == plain.history
    assert not hasattr(remembered.model.model, "__dict__") or "forward" not in remembered.model.model.__dict__


def test_the_central_command_offers_exactly_the_trainable_sets():
    """The CLI spells the sets itself (it must not import torch); this keeps it in step with task.learning.networks."""
    import argparse

    from sim.commands import central as command
    from task.learning.networks import TRAINABLE_SETS

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    central = parser._subparsers._group_actions[0].choices["central"]
    trainable = next(action for action in central._actions if action.dest == "trainable")
    assert tuple(trainable.choices) == tuple(TRAINABLE_SETS)


def test_a_voxel_head_student_trains_only_its_head_on_the_pseudo_labels():
    """PATE's student as the teachers' function class (the quick preset's ``student_trainable``): the public model's
    weights stay bit-identical, the head moves, and the preset's ``student`` recipe reaches ``train_student``."""
    from types import SimpleNamespace

    from server.pate import student_training
    from server.student import ModelTraining, train_student
    from task.codecs import one_hot
    from task.settings.presets import get_preset

    images, labels = _data(4)
    world = SimpleNamespace(query_images=images, reference_images=images[:2], reference_labels=labels[:2])
    preset = get_preset("tiny")
    assert student_training(preset) == {"trainable": "all", "learning_rate": None, "finetune": False,
                                        "ema_decay": None}   # the defaults
    preset = preset.with_changes(student=dict(trainable=VOXEL_HEAD, learning_rate=1e-2))
    assert student_training(preset) == {"trainable": VOXEL_HEAD, "learning_rate": 1e-2, "finetune": False,
                                        "ema_decay": None}
    public = _public().state_dict()
    student = train_student(world, one_hot(labels[2:], 4).astype(np.float32), [2, 3], preset,
                            ModelTraining(seed=0, epochs=1, **student_training(preset)),
                            init={k: v.clone() for k, v in public.items()})
    assert isinstance(student, VoxelHeadUNet)
    state = student.state_dict()
    assert all(torch.equal(state[name].cpu(), value) for name, value in public.items())
    assert not torch.all(state["voxel_head.2.weight"] == 0)
    assert network_config_of(student, "tiny")["voxel_head_hidden"] == 16


def test_a_student_fine_tuned_after_its_voxel_head_moves_every_weight_from_the_fitted_head():
    """Linear probing then fine-tuning (``student_finetune``): the second stage starts from the first stage's fitted
    head -- not from a fresh one -- and trains the U-Net under it too; the preset's recipe reaches ``train_student``."""
    from types import SimpleNamespace

    from server.pate import student_training
    from server.student import ModelTraining, train_student
    from task.codecs import one_hot
    from task.learning.networks import VOXEL_HEAD_AND_UNET
    from task.settings.presets import get_preset

    images, labels = _data(4)
    world = SimpleNamespace(query_images=images, reference_images=images[:2], reference_labels=labels[:2])
    preset = get_preset("tiny")
    preset = preset.with_changes(student=dict(trainable=VOXEL_HEAD, learning_rate=1e-2, finetune=True))
    assert student_training(preset) == {"trainable": VOXEL_HEAD, "learning_rate": 1e-2, "finetune": True,
                                        "ema_decay": None}
    public = _public().state_dict()
    targets = one_hot(labels[2:], 4).astype(np.float32)
    common = dict(seed=0, epochs=1, include_reference=True)
    probe = train_student(world, targets, [2, 3], preset, ModelTraining(trainable=VOXEL_HEAD, learning_rate=1e-2,
                                                                        **common),
                          init={k: v.clone() for k, v in public.items()})
    tuned = train_student(world, targets, [2, 3], preset, ModelTraining(**common, **student_training(preset)),
                          init={k: v.clone() for k, v in public.items()})
    assert isinstance(tuned, VoxelHeadUNet)
    state, probed = tuned.state_dict(), probe.state_dict()
    assert not all(torch.equal(state[name].cpu(), value) for name, value in public.items())   # the U-Net moved
    # the head kept what the first stage fitted (the second stage's lr is 1/5 of the head's: it cannot undo it)
    fitted = probed["voxel_head.2.weight"].cpu()
    assert not torch.all(fitted == 0)
    drift = (state["voxel_head.2.weight"].cpu() - fitted).abs().mean()
    assert drift < fitted.abs().mean()
    assert network_config_of(tuned, "tiny")["voxel_head_hidden"] == 16
    assert trainable_parameter_names(tuned, VOXEL_HEAD_AND_UNET) == {n for n, _ in tuned.named_parameters()}
    with pytest.raises(UserError, match="no voxel head"):
        trainable_parameter_names(build_unet("tiny"), VOXEL_HEAD_AND_UNET)


def test_the_student_releases_the_average_of_its_iterates_when_its_recipe_says_so():
    """``student.ema_decay`` (the quick preset's 0.99): the preset's recipe reaches ``train_student``, each stage
    returns the exponential moving average of its iterates -- decay 0 is the last iterate bit for bit, a decay in
    (0, 1) is another model -- and public self-training, the student's no-hospital control, averages alike."""
    from types import SimpleNamespace

    import server.selftrain as selftrain
    from server.pate import student_training
    from server.student import ModelTraining, train_student
    from task.codecs import one_hot
    from task.settings.presets import get_preset

    assert get_preset("quick").student.ema_decay == 0.99
    images, labels = _data(4)
    world = SimpleNamespace(query_images=images, reference_images=images[:2], reference_labels=labels[:2],
                            validation_images=None)
    preset = get_preset("tiny").with_changes(student=dict(trainable=VOXEL_HEAD, learning_rate=1e-2, finetune=True,
                                                          ema_decay=0.5))
    assert student_training(preset)["ema_decay"] == 0.5
    public = _public().state_dict()
    targets = one_hot(labels[2:], 4).astype(np.float32)

    def student(decay):
        recipe = {**student_training(preset), "ema_decay": decay}
        model = train_student(world, targets, [2, 3], preset, ModelTraining(seed=0, epochs=2, **recipe),
                              init={k: v.clone() for k, v in public.items()})
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    last, zero, averaged = student(None), student(0.0), student(0.5)
    assert all(torch.equal(last[name], zero[name]) for name in last)
    moved = [name for name in last if not torch.equal(last[name], averaged[name])]
    assert "voxel_head.2.weight" in moved and any(not name.startswith("voxel_head") for name in moved)

    seen = []
    original = selftrain.train_student
    try:
        selftrain.train_student = lambda *args, **kwargs: seen.append(args[4]) or original(*args, **kwargs)
        selftrain.self_train(world, preset, _public(), ModelTraining(seed=0, epochs=1),
                             selftrain.SelfTraining(rounds=1))
    finally:
        selftrain.train_student = original
    assert [training.ema_decay for training in seen] == [0.5]


@pytest.mark.parametrize("decay", [1.0, -0.1, "0.9", True])
def test_a_student_averaging_decay_outside_0_1_is_refused_in_one_line(decay):
    from task.settings.presets import get_preset

    with pytest.raises(UserError, match=r"^student\.ema_decay: expected a number in \[0, 1\) or None"):
        get_preset("tiny").with_changes(student=dict(ema_decay=decay))
