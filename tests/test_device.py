"""The device and precision reach every component, on the CPU of a machine without a GPU.

How a test here can fail when a component ignores ``device``: the *CUDA trap* makes ``torch.cuda.is_available()``
say True on this CPU-only torch. Any component that drops the explicit ``device="cpu"`` and falls back to ``auto``
then resolves CUDA and crashes on its first ``.to("cuda")`` ("Torch not compiled with CUDA"), so a run with the
trap set completes only if the explicit device reached every model, batch and encoder. Beside the trap, spies
record every U-Net / autoencoder forward pass (the devices of its parameters and inputs), every ``Module.to``
call, and every batch the training loss sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from sim.cli import main
from task.learning.compute import Compute
from task.errors import UserError

COMMANDS_THAT_COMPUTE = {
    "central": ["central", "--method", "dp-sgd", "--out", "{out}"],
    "simulate": ["simulate", "--out", "{out}"],
    "compare": ["compare", "--out", "{out}"],
    "demo": ["demo", "--out", "{out}"],
    "predict": ["predict", "--model", "{out}", "--image", "{out}/scan.nii.gz", "--out", "{out}"],
    "evaluate": ["evaluate", "--model", "{out}", "--data", "{out}"],
}


# ------------------------------------------------------------------------------------------------ resolver
def test_resolve_device_specs(monkeypatch):
    from task.learning.device import check_device_spec, check_precision, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert check_device_spec(None) == check_device_spec("") == "auto"
    assert check_device_spec(" CUDA:1 ") == "cuda:1"
    assert check_precision(32) == "32" and check_precision("bfloat16") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)       # auto: CUDA when there is one
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UserError, match=r"--device cuda:2: this machine has 2 CUDA device"):
        resolve_device("cuda:2")
    for bad in ("gpu", "cuda:x", "mps", "cuda:-1"):
        with pytest.raises(UserError, match=r"^--device: expected auto\|cpu\|cuda\|cuda:N"):
            resolve_device(bad)
    with pytest.raises(UserError, match="--precision"):
        check_precision("fp16")


def test_cuda_without_a_gpu_is_refused_in_one_line(monkeypatch):
    from task.learning.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spec in ("cuda", "cuda:0", torch.device("cuda", 0)):
        with pytest.raises(UserError) as caught:
            resolve_device(spec)
        message = str(caught.value)
        assert "\n" not in message and message.startswith("--device cuda") and "no CUDA device" in message


@pytest.mark.parametrize("command", sorted(COMMANDS_THAT_COMPUTE))
def test_cli_refuses_cuda_without_a_gpu_exit_2_one_line(command, tmp_path, capsys, monkeypatch):
    """``--device cuda`` on a machine without a GPU: exit 2, one line naming --device, nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [a.format(out=tmp_path / "run") for a in COMMANDS_THAT_COMPUTE[command]]
    assert main(argv + ["--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"fedpate {command}: error: --device cuda") and "no CUDA device" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", sorted(COMMANDS_THAT_COMPUTE))
def test_help_shows_device_and_precision(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "--device" in text and "auto|cpu|cuda|cuda:N" in text and "--precision" in text and "bf16" in text


def test_deploy_commands_put_the_device_in_each_hospitals_node_config(tmp_path, capsys):
    from sim.deployment.tls import make_certificates

    make_certificates(tmp_path, None, ["h0", "h1"])   # two or more: with the roster their secure sums check
    assert main(["deploy", "commands", "--certs", str(tmp_path), "--superlink", "agg:9092", "--hospital",
                 "h0=/data/h0", "--device", "cuda:1", "--precision", "bf16"]) == 0
    text = capsys.readouterr().out
    assert 'device="cuda:1"' in text and 'precision="bf16"' in text


def test_run_settings_carry_device_through_the_flower_run_config():
    import tomllib
    from pathlib import Path

    from task.settings.runconfig import RunSettings

    app_config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app_config["device"] == "auto" and app_config["precision"] == "32"
    settings = RunSettings.from_run_config({**app_config, "device": "cuda:1", "precision": "bf16"})
    assert (settings.compute.device, settings.compute.precision) == ("cuda:1", "bf16")
    assert set(settings.to_run_config()) <= set(app_config)                 # `flwr run -c` can override them
    assert RunSettings.from_run_config(settings.to_run_config()) == settings
    with pytest.raises(UserError, match="device"):
        RunSettings(compute=Compute(device="gpu"))


def test_every_run_configuration_refuses_a_compute_that_is_not_one_in_one_line():
    """The configs that compose :class:`task.learning.compute.Compute` share one check (a dict of settings is not one)."""
    from server.dpfedavg import DpFedAvgConfig
    from server.student import ModelTraining
    from task.reporting.predict import EvaluationOptions
    from task.settings.runconfig import RunSettings

    for build in (lambda c: RunSettings(compute=c), lambda c: ModelTraining(compute=c),
                  lambda c: EvaluationOptions(compute=c), lambda c: DpFedAvgConfig(8.0, 1e-3, compute=c)):
        with pytest.raises(UserError, match=r"^compute: expected a task\.learning\.compute\.Compute, got dict$"):
            build({"device": "cpu"})


# ------------------------------------------------------------------------------------------ the device spy
@dataclass
class Spy:
    forwards: list = field(default_factory=list)     # (class, parameter devices, input devices, autocast on)
    moves: list = field(default_factory=list)        # (class, device argument)
    batches: list = field(default_factory=list)      # (logits device, targets device, logits dtype)

    def devices(self) -> set:
        seen = set()
        for _, params, inputs, _ in self.forwards:
            seen |= params | inputs
        for logits, targets, _ in self.batches:
            seen |= {logits, targets}
        return seen


@pytest.fixture
def spy(monkeypatch):
    """The CUDA trap plus spies on forwards, ``Module.to`` and the training loss."""
    import monai.networks.nets

    import task.learning.training as training
    from task import codecs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # the trap: "auto" would now mean CUDA
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    record = Spy()
    watched = (monai.networks.nets.UNet, type(codecs.AutoencoderNet(2, (8, 8, 8))))

    def pre_hook(module, args):
        if isinstance(module, watched):
            params = {p.device.type for p in module.parameters()}
            inputs = {a.device.type for a in args if isinstance(a, torch.Tensor)}
            record.forwards.append((type(module).__name__, params, inputs, torch.is_autocast_enabled("cpu")))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    original_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        if isinstance(self, watched):
            record.moves.append((type(self).__name__, args[0] if args else kwargs.get("device")))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    original_loss = training.per_sample_loss

    def loss(logits, targets):
        record.batches.append((logits.device.type, targets.device.type, logits.dtype))
        return original_loss(logits, targets)

    monkeypatch.setattr(training, "per_sample_loss", loss)
    yield record
    handle.remove()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA trap needs a torch without a GPU: on a GPU the "
                    "default device works, and the spies' device checks are what catch a dropped device")
def test_the_trap_catches_a_component_that_ignores_the_device(spy):
    """The premise of the tests below: with the trap set, the default device is CUDA and cannot be used here."""
    from task.learning.networks import build_unet
    from task.learning.training import TrainConfig, train_segmentation

    x, y = np.zeros((2, 4, 16, 16, 16), np.float32), np.zeros((2, 16, 16, 16), np.int64)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda"):
        train_segmentation(build_unet("tiny"), x, y, TrainConfig(epochs=1, batch_size=2, learning_rate=1e-3,
                                                                 augment=False,   # device left out
                                                                 compute=Compute(progress=False)))
    spy.forwards.clear()
    train_segmentation(build_unet("tiny"), x, y, TrainConfig(epochs=1, batch_size=2, learning_rate=1e-3,
                                                             augment=False,
                                                             compute=Compute(device="cpu", progress=False)))
    assert spy.devices() == {"cpu"} and spy.forwards


@dataclass
class _Split:
    hospitals: dict
    public_query: list
    public_reference: list
    public_validation: list = field(default_factory=list)
    test: list = field(default_factory=list)


@pytest.fixture(scope="module")
def small_world():
    from task.data.synthetic import SyntheticPrepared
    from task.settings.presets import get_preset

    prepared = SyntheticPrepared(16)
    ids = prepared.case_ids
    split = _Split(hospitals={"h0": [[ids[0]], [ids[1]]], "h1": [[ids[2]], [ids[3]]]}, public_query=ids[4:8],
                   public_reference=ids[8:12], public_validation=ids[12:14], test=ids[14:16])
    preset = get_preset("tiny").with_changes(teacher=dict(epochs=1), pretrain_epochs=1, student=dict(epochs=1),
                                             codec=dict(ae_epochs=1), hospitals=2, teachers_per_hospital=2,
                                             central_epochs=1)
    return prepared, split, preset


def test_explicit_cpu_reaches_pate_hospitals_autoencoder_student_and_prediction(spy, small_world, tmp_path):
    """pate-ae in process: the public model, the hospitals' teachers (training, answering, evaluating), the
    autoencoder (fit, the hospitals' encode, decode), the student, the diagnostics and the written predictions
    all run on the explicit device; results.json and the model card say which."""
    import nibabel as nib

    from task.reporting.predict import predict_scans
    from sim.runners.inprocess import InProcessPateRun, run_pate_inprocess

    prepared, split, preset = small_world
    results = run_pate_inprocess(InProcessPateRun(preset, "pate-ae", tmp_path / "pate", 8.0, 1e-3, prepared=prepared,
                                                  split=split,
                                                  compute=Compute(device="cpu", precision="32", progress=False)))
    assert results["device"] == "cpu" and results["precision"] == "32"
    assert set(results["hospital_devices"].values()) == {"cpu"}
    card = (tmp_path / "pate" / "model" / "MODEL_CARD.md").read_text()
    assert "| trained on device | cpu |" in card and "| forward-pass precision | 32 |" in card
    moved = {(name, str(device)) for name, device in spy.moves}
    assert ("UNet", "cpu") in moved and ("AutoencoderNet", "cpu") in moved
    classes = {name for name, *_ in spy.forwards}
    assert classes == {"UNet", "AutoencoderNet"}
    assert spy.devices() == {"cpu"} and spy.batches
    # fedpate predict with the student, on the explicit device
    image = np.zeros((20, 20, 20, 4), np.float32)
    image[4:16, 4:16, 4:16] = np.random.default_rng(0).normal(1, 0.3, (12, 12, 12, 4))
    nib.save(nib.Nifti1Image(image, np.eye(4)), tmp_path / "scan.nii.gz")
    spy.forwards.clear()
    predict_scans(tmp_path / "pate", [tmp_path / "scan.nii.gz"], tmp_path / "pred", progress=False, device="cpu")
    assert spy.forwards and spy.devices() == {"cpu"} and not any(autocast for *_, autocast in spy.forwards)
    spy.forwards.clear()
    bf16 = predict_scans(tmp_path / "pate", [tmp_path / "scan.nii.gz"], tmp_path / "pred16", progress=False,
                         device="cpu", precision="bf16")
    assert spy.forwards and all(autocast for *_, autocast in spy.forwards) and bf16[0].output.exists()


def test_explicit_cpu_reaches_dpfedavg_local_dpsgd(spy, small_world, tmp_path, monkeypatch):
    from server.dpfedavg import DpFedAvgConfig, run_dpfedavg
    from sim.runners.inprocess import InProcessTransport, simulated_hospitals
    from task.world import load_world

    import privacy.calibration as calibration
    from clients.fedavg import plan_noise_multiplier

    monkeypatch.setattr(calibration, "composed_dpsgd_noise_multiplier", lambda *a, **k: 1.0)   # skip the PLD search
    plan_noise_multiplier.cache_clear()
    prepared, split, preset = small_world
    hospitals = simulated_hospitals(prepared, split, preset, tmp_path / "nodes")
    transport = InProcessTransport(hospitals, base_config={"ledger_dir": str(tmp_path / "ledgers"),
                                                           "lifetime_epsilon": 50.0, "delta": 1e-3})
    results = run_dpfedavg(transport, load_world(prepared, split), preset.with_changes(dp_fedavg=dict(grid=())),
                           DpFedAvgConfig(50.0, 1e-3, rounds=1, reproducible_noise=True,
                                          compute=Compute(device="cpu", progress=False)),
                           tmp_path / "fedavg")
    assert results["device"] == "cpu" and set(results["hospital_devices"].values()) == {"cpu"}
    assert spy.batches and spy.devices() == {"cpu"}


def test_explicit_cpu_reaches_central_dpsgd(spy, small_world, tmp_path, monkeypatch):
    """Pooled DP-SGD (Opacus' per-sample gradients, our host-drawn noise) and the public start."""
    import sim.runners.central as central
    from synthetic_worlds import pooled_world

    monkeypatch.setattr(central, "load_central_data",
                        lambda preset, seed=0, data=None, progress=True: pooled_world(preset, seed, n_train=4, n_test=2))
    import privacy.calibration as calibration

    monkeypatch.setattr(calibration, "dpsgd_noise_multiplier", lambda *a, **k: 2.0)   # skip the PLD search
    monkeypatch.setattr(central, "public_start", lambda preset, **kwargs: None)
    results = central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "central", epsilon=50.0, delta=1e-3,
                                  progress=False, epochs=1, learning_rate=3e-3, augment=False, init="scratch",
                                  reproducible_noise=True, device="cpu"))
    assert results["device"] == "cpu" and results["precision"] == "32"
    assert spy.batches and spy.devices() == {"cpu"}


# --------------------------------------------------------------------------------------------- precision
def _toy(n=4, grid=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4, grid, grid, grid)).astype(np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64) + (x[:, 1] > 1.2).astype(np.int64)
    return x, y


def test_bf16_on_the_cpu_trains(spy):
    from task.learning.networks import build_unet
    from task.learning.training import TrainConfig, train_segmentation

    x, y = _toy()
    torch.manual_seed(0)
    model = build_unet("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bf16 = Compute(device="cpu", precision="bf16", progress=False)
    result = train_segmentation(model, x, y, TrainConfig(epochs=2, batch_size=2, learning_rate=3e-3, augment=False,
                                                         compute=bf16))
    assert all(np.isfinite(r["loss"]) for r in result.history)
    assert any(not torch.equal(before[k], v) for k, v in result.model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in result.model.parameters())        # weights stay float32
    assert spy.forwards and all(autocast for *_, autocast in spy.forwards)         # forwards under autocast
    assert {dtype for *_, dtype in spy.batches} == {torch.float32}                  # the loss on float32 logits


def test_bf16_dpsgd_trains_with_float32_noise(spy):
    from task.learning.dpsgd import DPConfig, PrivateTraining
    from task.learning.networks import build_unet
    from task.learning.training import TrainConfig, train_segmentation
    from privacy.mechanisms import NoiseSource

    x, y = _toy()
    torch.manual_seed(0)
    model = build_unet("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bf16 = Compute(device="cpu", precision="bf16", progress=False)
    result = train_segmentation(model, x, y, TrainConfig(epochs=1, batch_size=2, learning_rate=3e-3, augment=False,
                                                         compute=bf16),
                                PrivateTraining(DPConfig(mode="fixed", epsilon=50.0, noise_multiplier=1.0,
                                                         sampling="shuffle", grad_sample_mode="hooks", delta=1e-3,
                                                         max_grad_norm=4.0),
                                                owners=("h0",), noise=NoiseSource.reproducible(0)))
    # a DP run records no training loss (its sensitivity is unbounded): sigma and the ledger's epsilon only
    assert result.epochs_completed == 1 and "loss" not in result.history[0] and result.history[0]["epsilon"] > 0
    assert all(p.dtype == torch.float32 for p in result.model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in result.model.state_dict().items())


#: Tolerances of bf16 autocast against float32 for the per-sample gradient norms DP-SGD clips (tiny U-Net, 16^3,
#: Dice+CE, 4 samples). Measured on this CPU (torch 2.13, Opacus 1.6): total norm relative error 0.44% (both
#: engines); per-layer norm error at most 0.35% of the sample's total norm (a layer's own relative error reaches
#: 7% on small layers, and bias gradients that are exactly 0 in float32 -- biases before instance norm -- are
#: ~1e-6 in bf16). Asserted with a 4-5x margin:
TOTAL_NORM_RTOL = 0.02       # | ||g_bf16|| - ||g_32|| | / ||g_32||, per sample
LAYER_NORM_ATOL = 0.015      # | ||g_l,bf16|| - ||g_l,32|| | / ||g_32||, per sample and parameter tensor


@pytest.mark.parametrize("engine", ["functorch", "hooks"])
def test_bf16_per_sample_gradient_norms_match_float32(engine):
    """What clipping sees: per-sample gradient norms (total for flat clipping, per layer for per-layer clipping)
    under bf16 autocast, against float32 on the same weights and batch; per-sample gradients are float32 by the
    time they are clipped (``DPSession.per_sample_gradients_to_float32``)."""
    from opacus import GradSampleModule

    from task.learning.device import autocast
    from task.learning.networks import build_unet
    from task.learning.training import per_sample_loss

    x, y = (torch.from_numpy(a) for a in _toy())
    norms = {}
    for precision in ("32", "bf16"):
        torch.manual_seed(0)
        module = GradSampleModule(build_unet("tiny"), batch_first=True, loss_reduction="mean", strict=False,
                                  force_functorch=engine == "functorch")
        with autocast(torch.device("cpu"), precision):
            logits = module(x)
        per_sample_loss(logits.float(), y).mean().backward()
        samples = [p.grad_sample.float() for p in module.parameters() if p.requires_grad]
        norms[precision] = torch.stack([g.reshape(len(x), -1).norm(dim=1) for g in samples], dim=1).double()
    full, half = norms["32"], norms["bf16"]
    total_full, total_half = full.norm(dim=1), half.norm(dim=1)
    assert ((total_half - total_full).abs() / total_full).max() <= TOTAL_NORM_RTOL
    assert ((half - full).abs() / total_full[:, None]).max() <= LAYER_NORM_ATOL
    # the tolerance is not vacuous: bf16 does change the norms
    assert (half - full).abs().max() > 0


# ----------------------------------------------------------------------------------- host-side pipeline
def test_prefetching_augmented_batches_does_not_change_the_result():
    """The background thread calls the augmenter in the same order: the same weights, bit for bit."""
    from task.learning.networks import build_unet
    from task.learning.training import TrainConfig, train_segmentation

    x, y = _toy(n=5)
    weights = []
    for prefetch in (False, True):
        torch.manual_seed(0)
        config = TrainConfig(epochs=2, batch_size=2, learning_rate=3e-3, augment="geometric",
                             prefetch=prefetch, seed=3, compute=Compute(device="cpu", progress=False))
        weights.append(train_segmentation(build_unet("tiny"), x, y, config).model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_results_record_has_device_and_precision_null_when_not_applicable():
    from task.reporting.results import CSV_COLUMNS, RunResults

    record = RunResults(method="x").to_dict()
    assert record["device"] is None and record["precision"] is None
    assert {"device", "precision"} <= set(CSV_COLUMNS)
    assert json.loads(json.dumps(RunResults(method="x", device="cpu", precision="bf16").to_dict()))["device"] == "cpu"


def test_batch_augmentation_moves_labels_with_the_image_and_keeps_the_background():
    from task.data.augment import BatchAugmentation, batch_augmentation

    g = 24
    labels = torch.zeros(4, g, g, g, dtype=torch.long)
    labels[:, 6:14, 8:18, 5:12] = 2
    images = torch.zeros(4, 4, g, g, g)
    images[:, 0] = (labels == 2).float()
    images[:, 1, 2:-2, 2:-2, 2:-2] = 1.0                      # the "brain": a zero border around it
    moved_image, moved_label = BatchAugmentation(seed=3, intensity=False)(images, labels)
    agree = ((moved_image[:, 0] > 0.5) == (moved_label == 2)).float().mean()
    assert agree > 0.99                                        # flipped and rotated together
    assert not torch.equal(moved_label, labels)                # something did move
    image, label = batch_augmentation(4, "domain")(images, labels)
    assert image.shape == images.shape and label.dtype == labels.dtype and torch.isfinite(image).all()
    # the background stays exactly zero: a rotation about the centre keeps the brain inside its circumscribed sphere
    small = torch.zeros_like(images)
    small[:, :, 8:16, 8:16, 8:16] = images[:, :, 8:16, 8:16, 8:16] + 0.5
    image_small, _ = batch_augmentation(4, "domain")(small, labels)
    axes = torch.arange(g, dtype=torch.float32) - (g - 1) / 2
    radius = (axes[:, None, None] ** 2 + axes[None, :, None] ** 2 + axes[None, None, :] ** 2).sqrt()
    assert (image_small[:, :, radius > 4 * 3 ** 0.5 + 1.5] == 0).all()
    assert (image_small[:, :, radius < 3] != 0).all()
    again = batch_augmentation(4, "domain")(images, labels)
    assert torch.equal(again[0], image) and torch.equal(again[1], label)    # deterministic for a seed
    soft = torch.softmax(torch.randn(2, 4, g, g, g), dim=1)
    _, soft_out = batch_augmentation(5)(images[:2], soft)
    assert torch.allclose(soft_out.sum(dim=1), torch.ones(()), atol=1e-5)


def test_device_augmentation_trains_and_the_cpu_default_is_the_host_version():
    from task.learning.networks import build_unet
    from task.learning.training import TrainConfig, train_segmentation

    x, y = _toy(n=4)
    results = {}
    for augment_on in (None, "host", "device"):
        torch.manual_seed(0)
        config = TrainConfig(epochs=1, batch_size=2, learning_rate=3e-3, augment=True,
                             augment_on=augment_on, compute=Compute(device="cpu", progress=False))
        result = train_segmentation(build_unet("tiny"), x, y, config)
        assert np.isfinite(result.history[0]["loss"])
        results[augment_on] = result.model.state_dict()
    assert all(torch.equal(results[None][k], results["host"][k]) for k in results[None])
    assert any(not torch.equal(results["device"][k], results["host"][k]) for k in results[None])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA trap needs a torch without a GPU: on a GPU the "
                    "default device works, and the spies' device checks are what catch a dropped device")
def test_explicit_cpu_reaches_the_head_fit_decoder(spy):
    """The anchored codec's head-fit decoder fits on the run's device: explicit cpu works under the trap,
    a decoder built without a device would have gone to the (trapped) GPU."""
    from task.codecs import AnchoredResidualCompressor
    from task import codecs
    from tests.test_codec_intensity_bins import _public_without_class_2, _rim_lesions

    scans, labels = _rim_lesions(3)
    onehot, anchor = codecs.one_hot(labels).astype(np.float32), _public_without_class_2(labels)
    fitted = {device: AnchoredResidualCompressor((-2, 3), intensity_bins=3, decoder="head-fit", device=device)
              .fit(onehot, anchor, scans) for device in ("cpu", None)}
    z = fitted["cpu"].encode(onehot, anchor, scans)
    assert fitted["cpu"].decode(z, anchor, scans=scans).shape == anchor.shape
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda"):
        fitted[None].decode(z, anchor, scans=scans)
