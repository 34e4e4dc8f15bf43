"""``fedpate central``: non-private and DP-SGD training on the pooled private data."""

from __future__ import annotations

import dataclasses

from sim.commands.common import (add_compute_options, add_real_check_option, add_run_options, at_least_one, decay_fraction, open_fraction,
                                 positive_integer, positive_number, resolved_device)
from task.settings.methods import CENTRAL_METHODS
from task.options import Init, NoiseMode, Relation, Sampling, Selection


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "central", help="centralised baselines on pooled data (non-private, DP-SGD)",
        description="Train one U-Net on all hospitals' private volumes pooled together, evaluate on the test "
                    "split and write results.json, ledger.jsonl and model/ in --out.")
    parser.add_argument("--method", required=True, choices=tuple(CENTRAL_METHODS),
                        help="nonprivate: plain training, no privacy guarantee (the ceiling); dp-sgd: DP-SGD with "
                             "per-sample clipping and Gaussian noise, charged to every hospital")
    add_run_options(parser)
    add_compute_options(parser)
    add_real_check_option(parser)
    parser.add_argument("--noise-mode", default=NoiseMode.TARGET.value, choices=tuple(m.value for m in NoiseMode),
                        help="DP-SGD noise: calibrated to the budget for the planned epochs (target), the "
                             "preset's sigma until the budget is spent (fixed), or a decaying schedule "
                             "(default: target)")
    parser.add_argument("--schedule", default=None, choices=("time", "exp", "step", "poly", "validation"),
                        help="noise schedule for --noise-mode schedule (Yu et al.; no default: required by that mode)")
    parser.add_argument("--sampling", default=Sampling.POISSON.value, choices=tuple(m.value for m in Sampling),
                        help="batching: Poisson sampling (PLD/RDP accounting; default) or shuffled disjoint batches "
                             "(zCDP)")
    parser.add_argument("--relation", default=Relation.REPLACE_ONE.value, choices=tuple(m.value for m in Relation),
                        help="neighbouring relation of the DP-SGD guarantee: replace-one (default; the only one "
                             "that holds when dataset sizes are published, and the one comparisons use), "
                             "add-remove (Poisson) or zero-out (shuffle) for standalone runs")
    parser.add_argument("--noise-multiplier", type=positive_number, default=None,
                        help="sigma for fixed mode / sigma_0 for schedules (default: the preset's, sqrt 6)")
    parser.add_argument("--max-grad-norm", type=positive_number, default=None, help="clip norm (default: preset's, 4)")
    parser.add_argument("--flat-clipping", action="store_true",
                        help="clip the whole per-sample gradient instead of each layer (paper: per layer)")
    parser.add_argument("--grad-sample-mode", default=None, choices=("hooks", "functorch"),
                        help="Opacus per-sample gradient engine (default: the benchmarked fastest)")
    parser.add_argument("--epochs", type=positive_integer, default=None, help="training epochs (default: preset's central_epochs)")
    parser.add_argument("--no-augment", action="store_true", help="train without augmentation")
    parser.add_argument("--init", default=Init.PUBLIC.value, choices=tuple(m.value for m in Init),
                        help="start from the public model (pre-trained on the public reference set, as PATE; "
                             "default) or from random weights")
    parser.add_argument("--learning-rate", type=positive_number, default=None,
                        help="learning rate (default: the preset's; DP-SGD: the preset's grid, chosen on public "
                             "validation)")
    parser.add_argument("--batch-size", type=positive_integer, default=None, help="(expected) batch size (default: preset's)")
    parser.add_argument("--trainable", default=None,
                        choices=("all", "decoder", "head", "bias", "voxel-head", "voxel-head+all"),
                        help="which parameters fine-tuning trains: all (default), decoder (the up-sampling path), "
                             "head (the two stages nearest the output), bias (biases and PReLU slopes), voxel-head "
                             "(a small new per-voxel head on the frozen public model), voxel-head+all (that head and "
                             "every U-Net weight)")
    parser.add_argument("--augmentation-multiplicity", type=positive_integer, default=None, metavar="K",
                        help="DP-SGD: K augmented views per patient, averaged before clipping (same epsilon; "
                             "default: 1)")
    parser.add_argument("--ema-decay", type=decay_fraction, default=None,
                        help="return the exponential moving average of the weights (post-processing, free; "
                             "default: none, the last weights)")
    parser.add_argument("--selection", default=Selection.PUBLIC.value, choices=tuple(m.value for m in Selection),
                        help="DP-SGD setting selection: best of the grid on the public validation set (default), "
                             "or private selection (Papernot & Steinke) on held-out private patients among the "
                             "grid and the public model unchanged, charged as one event")
    parser.add_argument("--selection-heldout", type=open_fraction, default=0.2, metavar="F",
                        help="private selection: fraction of the pooled private patients held out for scoring "
                             "(default: 0.2)")
    parser.add_argument("--selection-score-noise", type=positive_number, default=0.05, metavar="S",
                        help="private selection: std of the Gaussian noise on the mean held-out Dice (default: 0.05)")
    parser.add_argument("--selection-mean", type=at_least_one, default=None, metavar="M",
                        help="private selection: mean number of repetitions (default: number of candidates)")
    parser.add_argument("--selection-shape", default=1.0, type=_selection_shape, metavar="ETA",
                        help="private selection: truncated negative binomial shape (1 geometric, 0 logarithmic) "
                             "or 'poisson' (default: 1)")
    parser.set_defaults(func=run)


def _selection_shape(text: str) -> float | None:
    """``--selection-shape``: 'poisson' (None) or a truncated negative binomial's shape >= 0."""
    import argparse
    import math

    if str(text).strip().lower() == Sampling.POISSON:
        return None
    try:
        shape = float(text)
    except ValueError:
        shape = math.nan
    if not (math.isfinite(shape) and shape >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'poisson', got {text!r}")
    return shape


def run(args) -> int:
    from sim.commands.common import data_options, open_real_check, real_check_line, resolve_hospitals
    from task.io import ensure_folder
    from sim.runners.central import CentralConfig, DPSGDOptions, TrainingOptions, run_central
    from task.learning.compute import Compute
    from task.learning.selection import SelectionConfig

    where = data_options(args)
    # the config checks every option (naming its flag) when it is made: before the device, the data or the ledger
    config = CentralConfig(
        method=args.method, preset=args.preset, out=args.out, epsilon=args.epsilon, delta=args.delta,
        seed=args.seed, data=args.data, init=args.init,
        hospitals=resolve_hospitals(None, where["partition_file"]), **where,
        compute=Compute(device=args.device, precision=args.precision, progress=not args.no_progress),
        training=TrainingOptions(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                                 max_grad_norm=args.max_grad_norm, augment=not args.no_augment,
                                 levers={"trainable": args.trainable,
                                         "augmentation_multiplicity": args.augmentation_multiplicity,
                                         "ema_decay": args.ema_decay}),
        dpsgd=DPSGDOptions(noise_mode=args.noise_mode, schedule=args.schedule, sampling=args.sampling,
                           noise_multiplier=args.noise_multiplier, per_layer=False if args.flat_clipping else None,
                           grad_sample_mode=args.grad_sample_mode, relation=args.relation,
                           reproducible_noise=args.reproducible_noise),
        selection=args.selection,
        selection_config=SelectionConfig(
            heldout_fraction=args.selection_heldout, score_noise=args.selection_score_noise, mean=args.selection_mean,
            shape=args.selection_shape))
    real_check = open_real_check(args)   # a bad folder is refused before anything trains
    device = resolved_device(args)
    ensure_folder(args.out)
    # every model it releases is also scored on the real cases
    results = run_central(dataclasses.replace(config, compute=config.compute.replace(device=str(device)),
                                              real_check=real_check))
    dice = results["dice"]
    line = f"{results['method']}: Dice mean {_fmt(dice['mean'])} (WT {_fmt(dice['WT'])}, TC {_fmt(dice['TC'])}, " \
           f"ET {_fmt(dice['ET'])})"
    if results["epsilon"] is not None:
        line += (f"; epsilon {results['epsilon']:.3f} of {results['epsilon_budget']} at delta {results['delta']:g} "
                 f"({results['relation']}, {results['accountant']}; unit: one patient volume)")
    else:
        line += "; no privacy guarantee (non-private baseline)"
    print(line)
    took = results.get("wall_seconds")   # none after private selection: its duration would tell how many runs
    print(f"wrote {args.out}/results.json" + (f" in {took:.1f} s" if took is not None else ""))
    if results.get("real_check"):
        print(real_check_line(results["method"], results["real_check"]))
    return 0


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"

