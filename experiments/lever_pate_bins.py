"""The anchored codec's intensity bins in a real PATE run (docs/decisions/intensity-bins.md): one comparison, in this
process.

    .venv/bin/python -m experiments.lever_pate_bins --bins 3 --seed 0 --epsilons 1,8 --out runs/lever-pate-bins
    .venv/bin/python -m experiments.lever_pate_bins --bins 3 --seed 0 --epsilons 8 --teachers-per-hospital 4 \\
        --methods pate-anchored,public-only --out runs/lever-pate-bins-k16

Runs ``fedpate compare``'s cells with the quick preset's anchored codec set to ``--bins`` T1-Gd bins per shell
(the preset's ``codec.anchored_intensity_bins``; 1 = the default codec). The report's *ensemble* column (the
teachers' encodings decoded without noise) says what the codec could carry from these teachers; compare it with
``benchmarks/codec_ceiling.py`` (what it could carry from teachers who knew the truth). Every cell spends its ε:
a measurement, not a release.
"""
import argparse
from pathlib import Path

from task.learning.compute import Compute
from task.settings.presets import get_preset
from sim.runners.compare import CompareConfig, run_compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bins", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epsilons", default="8")
    parser.add_argument("--methods", default="pate-anchored,public-only,nonprivate-central")
    parser.add_argument("--teachers-per-hospital", type=int, default=None)
    parser.add_argument("--teacher-epochs", type=int, default=None,
                        help="fine-tuning epochs per teacher (default: the preset's)")
    parser.add_argument("--teacher-trainable", default=None, help="what a teacher trains (task.learning.networks.TRAINABLE_SETS)")
    parser.add_argument("--teacher-learning-rate", type=float, default=None)
    parser.add_argument("--teacher-augment", choices=("yes", "no"), default=None)
    parser.add_argument("--decoder", default=None, help="the anchored codec's decoder (task.codecs.anchored.ANCHORED_DECODERS)")
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    teacher = {key: value for key, value in (("epochs", args.teacher_epochs), ("trainable", args.teacher_trainable),
                                             ("learning_rate", args.teacher_learning_rate),
                                             ("augment", None if args.teacher_augment is None
                                              else args.teacher_augment == "yes")) if value is not None}
    codec = {"anchored_intensity_bins": args.bins, **({"anchored_decoder": args.decoder} if args.decoder else {})}
    # a variant of the preset: every cell (and worker) rebuilds it from its reference (task.settings.presets)
    variant = get_preset(args.preset).with_changes(teacher=teacher, codec=codec)
    run_compare(CompareConfig(variant, args.methods.split(","), [float(e) for e in args.epsilons.split(",")],
                              Path(args.out), seed=args.seed, compute=Compute(workers=1, progress=False),
                              teachers_per_hospital=[args.teachers_per_hospital] if args.teachers_per_hospital else None))


if __name__ == "__main__":
    main()
