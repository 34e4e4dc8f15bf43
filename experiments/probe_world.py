"""What a world teaches: phantoms of one generator variant, a non-private U-Net trained from scratch on them, scored
on phantoms of the same variant and on labelled real cases (WT / TC / ET per case, with test-time mirroring).

    .venv/bin/python -m experiments.probe_world VARIANT --real DIR [--real DIR] --out FOLDER \\
        [--cases 120] [--test 20] [--epochs 20] [--seed 0] [--unet small|wide] [--save-model]

VARIANT is ``current`` (the product's generator); ``current+LEVER...``, the levers of ``experiments.world_levers``,
which patch it (``current+template`` is generator 4); or parts of ``experiments.world_variants`` joined by '+', which patch generator 3 (run
each at a commit whose ``GENERATOR_VERSION`` is the one it patches; the decision note names them). One JSON line
per run is printed and appended to FOLDER/probe.jsonl. The real cases only measure the world: no setting of a
method is chosen on them.
"""
import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--real", action="append", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", type=int, default=120)
    parser.add_argument("--test", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unet", default="small")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--save-model", action="store_true", help="also write the trained U-Net (torch.save)")
    args = parser.parse_args()

    import torch

    import task.data.phantoms as phantoms
    import task.learning.networks as networks
    from experiments.world_variants import apply
    from task.data.phantoms import PhantomSpec, generate_phantoms
    from task.data.preprocess import PreprocessConfig, prepare_dataset
    from task.reporting.realcheck import open_check, score_model
    from task.learning.training import TrainConfig, evaluate_release, train_segmentation

    torch.set_num_threads(1)
    if args.variant.startswith("current+"):
        from experiments.world_levers import apply as apply_levers
        apply_levers(args.variant, phantoms)
    elif args.variant != "current":
        apply(args.variant, phantoms)
    # a wider U-Net at the same depth, for the capacity lever
    networks.UNET_PRESETS.setdefault("wide", {"channels": (16, 32, 64, 128), "strides": (2, 2, 2), "num_res_units": 2})
    root = Path(args.out) / f"{args.variant}-v{phantoms.GENERATOR_VERSION}-s{args.seed}-n{args.cases + args.test}"
    started = time.time()
    spec = PhantomSpec(cases=args.cases + args.test, institutions=4, seed=args.seed, resolution_mm=3.0)
    generate_phantoms(root / "msd", spec, progress=False)
    config = PreprocessConfig(grid=(32, 32, 32))
    prepared = prepare_dataset(root / "msd", root / "prepared", config, progress=False)
    images, labels = prepared.images(), prepared.labels()
    generated = time.time()
    torch.manual_seed(args.seed)
    model = networks.build_unet(args.unet)
    train_segmentation(model, images[: args.cases], labels[: args.cases],
                       TrainConfig(epochs=args.epochs, batch_size=2, learning_rate=args.lr, seed=args.seed))
    trained = time.time()
    if args.save_model:
        torch.save(model, root / "model.pt")
    phantom = evaluate_release(model, images[args.cases:], labels[args.cases:])[0]
    real = score_model(model, config, open_check(args.real, cache_dir=None))
    row = {"variant": args.variant, "generator": phantoms.GENERATOR_VERSION, "seed": args.seed, "cases": args.cases,
           "epochs": args.epochs, "unet": args.unet, "generate_s": round(generated - started),
           "train_s": round(trained - generated),
           "phantom": {k: round(float(phantom[k]), 3) for k in ("mean", "WT", "TC", "ET")},
           "real": {k: round(float(real["dice"][k]), 3) for k in ("mean", "WT", "TC", "ET")},
           "real_cases": {r["case"]: [round(float(r[k]), 3) for k in ("WT", "TC", "ET")] for r in real["cases"]}}
    print(json.dumps(row), flush=True)
    with open(Path(args.out) / "probe.jsonl", "a") as handle:
        handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
