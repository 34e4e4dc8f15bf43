"""fedpate's ``dp-sgd-central`` cell against Opacus' ``make_private`` alone on the same data, in one run.

    .venv/bin/python benchmarks/bench_vs_opacus.py [--preset quick] [--epochs N] [--epsilon 8] [--trainable T]

Both sides train the preset's DP-SGD setting -- its network and trainable set (the ``quick`` preset: a voxel head),
expected batch, learning rate, clipping (flat or per layer, at the preset's norm) -- from the same random start
(``--init scratch``) on the pooled training patients of the same world, for the same epochs at the same ε and δ,
and score the test split:

* **fedpate**: ``sim.runners.central.run_central`` as ``fedpate central --method dp-sgd --init scratch
  --no-augment`` runs it: σ calibrated for the budget under replace-one (PLD; its disk memo is emptied first, so
  the calibration is paid as on a first run), every epoch charged to every hospital's ledger, Poisson batches and
  Gaussian noise from the OS CSPRNG (one flat buffer per step drawn a step ahead, ``task.learning.dpsgd.StepNoise``),
  Opacus' per-sample clipping, the public validation Dice after every epoch, test-time mirroring on the test
  split, the model bundle and results.json; its ``phase_seconds`` say where its time went;
* **Opacus alone**: ``PrivacyEngine().make_private_with_epsilon`` on a plain ``DataLoader`` (Opacus' Poisson
  sampling, its own noise from ``torch.normal``, its own calibration under add/remove), MONAI's ``DiceCELoss``,
  the same per-sample gradient engine (functorch), one forward pass per test case and ``DiceMetric``, the weights
  saved with ``torch.save``. An empty Poisson batch is skipped (Opacus cannot step on one).

Prints each side's seconds (wall and CPU), the ratio (goal: fedpate <= 1.2x) for the training loop alone and for
the whole cell, and fedpate's phases. Timings on a shared 2-core CPU swing by +-30% between runs: only the ratios
of one run mean anything (``--repeats 2`` alternates the order).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch

import side_by_side   # benchmarks/side_by_side.py, beside this script


def dp_setting(preset, trainable: str | None) -> dict:
    """The first entry of the preset's DP-SGD settings grid, as ``sim.runners.central`` reads it (``trainable``
    replaces its trainable set)."""
    from sim.runners.central import settings_grid

    (setting, *_) = settings_grid(preset, True, {}, grid=True)
    if trainable:
        setting["trainable"] = trainable
    return setting


def opacus_alone(world: dict, preset, setting: dict, epochs: int, epsilon: float, delta: float, seed: int,
                 device: torch.device, out: Path) -> dict[str, float]:
    """Opacus' make_private on a plain loop; seconds per part (data, privacy set-up, training, evaluation, writing)."""
    from monai.losses import DiceCELoss
    from monai.metrics import DiceMetric
    from opacus import PrivacyEngine

    from task.learning.networks import build_unet, freeze_all_but
    from task.learning.training import trainable_of

    seconds = {}
    started = time.perf_counter()
    images = torch.as_tensor(world["train_images"])
    labels = torch.as_tensor(world["train_labels"]).long()[:, None]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels),
                                         batch_size=setting["batch_size"], shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    seconds["data"] = time.perf_counter() - started

    started = time.perf_counter()
    torch.manual_seed(seed)
    model = build_unet(preset.unet, trainable=trainable_of(setting)).to(device)
    freeze_all_but(model, trainable_of(setting))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=setting["learning_rate"])
    per_layer = bool(preset.dp_sgd.per_layer)
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=epsilon, target_delta=delta,
        epochs=epochs, max_grad_norm=[setting["max_grad_norm"]] * n_tensors if per_layer else setting["max_grad_norm"],
        clipping="per_layer" if per_layer else "flat", poisson_sampling=True, grad_sample_mode="functorch")
    seconds["privacy set-up"] = time.perf_counter() - started

    started = time.perf_counter()
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)
    empty = 0
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            if len(x) == 0:
                empty += 1
                continue
            optimizer.zero_grad(set_to_none=True)
            loss_function(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
    seconds["training"] = time.perf_counter() - started

    started = time.perf_counter()
    model.eval()
    metric = DiceMetric(include_background=False, reduction="mean")
    with torch.no_grad():
        for image, label in zip(world["test_images"], world["test_labels"]):
            logits = model(torch.as_tensor(image[None]).to(device))
            classes = logits.shape[1]
            predicted = torch.nn.functional.one_hot(logits.argmax(1), classes).movedim(-1, 1)
            truth = torch.nn.functional.one_hot(torch.as_tensor(label[None]).long().to(device), classes).movedim(-1, 1)
            metric(predicted, truth)
    seconds["evaluation"] = time.perf_counter() - started
    seconds["dice_mean"] = float(metric.aggregate().item())
    started = time.perf_counter()
    torch.save(model._module.state_dict(), out / "opacus-alone.pt")
    seconds["writing"] = time.perf_counter() - started
    seconds["sigma"] = float(optimizer.noise_multiplier)
    seconds["empty_batches_skipped"] = empty
    return seconds


def fedpate_cell(preset_name: str, setting: dict, epochs: int, epsilon: float, seed: int, device: str,
                 out: Path) -> dict:
    """``fedpate central --method dp-sgd --init scratch --no-augment``; its results.json."""
    from sim.runners.central import CentralConfig, TrainingOptions, run_central
    from task.learning.compute import Compute
    from task.options import Init

    # the one setting the Opacus side trains, fixed explicitly (a preset's grid of several is then one entry)
    levers = {"trainable": setting["trainable"]} if setting.get("trainable") else None
    training = TrainingOptions(epochs=epochs, batch_size=setting["batch_size"], learning_rate=setting["learning_rate"],
                               max_grad_norm=setting["max_grad_norm"], augment=False, levers=levers)
    return run_central(CentralConfig(method="dp-sgd", preset=preset_name, out=out, seed=seed, epsilon=epsilon,
                                     init=Init.SCRATCH, compute=Compute(device=device, progress=False),
                                     training=training))


def main(argv=None) -> int:
    options = side_by_side.parser(__doc__)
    options.add_argument("--epsilon", type=float, default=8.0)
    options.add_argument("--trainable", default=None, help="trainable set (default: the preset's DP-SGD setting's)")
    args = options.parse_args(argv)
    warnings.filterwarnings("ignore")
    work = side_by_side.work_folder(args, "opacus")
    from sim.runners.central import load_central_data

    preset, device, world = side_by_side.prepare(args, ("monai.data", "monai.losses", "monai.metrics",
                                                        "monai.transforms", "opacus"))
    setting = dp_setting(preset, args.trainable)
    epochs = int(args.epochs or setting["epochs"])
    setting["epochs"] = epochs
    print(f"preset {args.preset}: {len(world['train_ids'])} training patients, U-Net {preset.unet}, setting {setting}, "
          f"epsilon {args.epsilon}, delta {preset.delta}, device {device}, {torch.get_num_threads()} torch threads")
    side_by_side.report_start_up()

    def run(side: str, folder: Path) -> dict:
        if side == "opacus":
            started = time.perf_counter()
            loaded = load_central_data(preset, seed=args.seed, progress=False)
            load_seconds = time.perf_counter() - started
            record = opacus_alone(loaded, preset, setting, epochs, args.epsilon, preset.delta, args.seed, device,
                                  folder)
            record["data"] += load_seconds
            return record
        # a first run's calibration: the accounting memo starts empty (task.learning.accounting)
        os.environ["FEDPATE_ACCOUNTING_CACHE"] = str(folder / "accounting-memo")
        try:
            record = fedpate_cell(args.preset, setting, epochs, args.epsilon, args.seed, args.device, folder)
        finally:
            os.environ.pop("FEDPATE_ACCOUNTING_CACHE", None)
        record["training"] = record.get("phase_seconds", {}).get("training", float("nan"))
        return record

    runs = side_by_side.alternate(("opacus", "fedpate"), args.repeats, work, run)

    def median(side, key):
        return side_by_side.median(runs, side, key)

    last = runs["opacus"][-1]
    print(f"Opacus alone: {median('opacus', 'wall'):.1f} s wall, {median('opacus', 'cpu'):.1f} s CPU (data "
          f"{median('opacus', 'data'):.1f}, privacy set-up {median('opacus', 'privacy set-up'):.1f}, training "
          f"{median('opacus', 'training'):.1f}, evaluation {median('opacus', 'evaluation'):.1f}); sigma "
          f"{last['sigma']:.3f} (add/remove), {last['empty_batches_skipped']} empty batches skipped; test Dice "
          f"{last['dice_mean']:.3f}")
    cell = runs["fedpate"][-1]
    print(f"fedpate dp-sgd-central: {median('fedpate', 'wall'):.1f} s wall, {median('fedpate', 'cpu'):.1f} s CPU; "
          "phases " + ", ".join(f"{name} {value:.1f}" for name, value in cell["phase_seconds"].items())
          + f"; sigma {cell['sigma']:.3f} ({cell['relation']}), epsilon {cell['epsilon']:.3f}; test Dice "
          f"{cell['dice']['mean']:.3f}")
    ratios = side_by_side.ratios(runs, "fedpate", "opacus")
    print(f"ratio fedpate / Opacus alone: training loop x{ratios['training']:.2f}, whole cell x{ratios['cell_wall']:.2f} "
          f"wall, x{ratios['cell_cpu']:.2f} CPU (goal <= 1.2)")
    if args.json:
        Path(args.json).write_text(json.dumps({"opacus": runs["opacus"], "fedpate": [
            {key: record.get(key) for key in ("wall", "cpu", "training", "phase_seconds", "dice", "sigma", "epsilon")}
            for record in runs["fedpate"]], "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
