"""Teachers that adapt features: the noise-free ensemble of PATE's teachers when each fine-tunes the start model's
up-sampling stages on its 1-2 patients, against the product's voxel-head teachers (docs/decisions/teachers.md).

    .venv/bin/python -m experiments.probe_decoder_teachers OUT SEED --real DIR [--real DIR]
        [--teachers voxel-head,decoder,head] [--steps 60] [--decoder-lr 1e-3]

The quick world at SEED: its start model (``public-model.pt``, trained or loaded in OUT/sSEED), its K = 128
partitions; each teacher trains full batch on its partition without augmentation for STEPS Adam steps:
``voxel-head`` as the product trains them (a head on the frozen model's class scores and the scan, lr 1e-2),
``decoder`` every up-sampling stage and the output block, ``head`` the two stages nearest the output (lr
``--decoder-lr``). The probability average of the K teachers -- what the teachers know before any codec or
noise -- is scored on the public validation scans, the phantom test set and the real cases (with test-time
mirroring). One JSON line per teacher kind, appended to OUT/teachers.jsonl. A setting is chosen on the public
validation scans; the real cases only measure.
"""
import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch


class Ensemble(torch.nn.Module):
    """The teachers' probability average as a network: log of the mean softmax (argmax-equivalent logits)."""

    def __init__(self, public, heads=None, models=None):
        super().__init__()
        self.public, self.heads, self.models = public, heads, models

    def forward(self, x):
        total = 0.0
        if self.heads is not None:
            logits = self.public(x)
            features = torch.cat([logits, x], 1)
            for head in self.heads:
                total = total + torch.softmax(logits + head(features), 1)
            count = len(self.heads)
        else:
            for model in self.models:
                total = total + torch.softmax(model(x), 1)
            count = len(self.models)
        return torch.log(total / count + 1e-8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("seed", type=int)
    parser.add_argument("--real", action="append", required=True)
    parser.add_argument("--teachers", default="voxel-head,decoder,head")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--decoder-lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import task.settings.presets as presets
    from server.selftrain import train_public_models
    from task.data.preprocess import PreprocessConfig
    from task.learning.losses import per_sample_loss
    from task.learning.metrics import dice_scores
    from task.learning.networks import VOXEL_HEAD, build_unet, trainable_parameter_names
    from task.options import Trainable
    from task.reporting.realcheck import open_check, score_model
    from task.world import build_world, load_world

    preset = presets.get_preset("quick")
    out = Path(args.out)
    (out / f"s{args.seed}").mkdir(parents=True, exist_ok=True)
    prepared, split = build_world(preset, None, args.seed, False)
    world = load_world(prepared, split)
    public = train_public_models(world, preset, seed=args.seed, checkpoint=out / f"s{args.seed}" / "public-model.pt").start
    public.eval()
    for parameter in public.parameters():
        parameter.requires_grad_(False)
    check = open_check(args.real, cache_dir=None)
    config = PreprocessConfig(grid=tuple(world.grid))
    parts = [part for hospital in sorted(split.hospitals) for part in split.hospitals[hospital]]

    def scored(ensemble):
        row = {}
        with torch.no_grad():
            for name, images, labels in (("validation", world.validation_images, world.validation_labels),
                                         ("test", world.test_images, world.test_labels)):
                x = torch.as_tensor(images)
                predictions = torch.cat([ensemble(x[i:i + 4]).argmax(1) for i in range(0, len(x), 4)])
                dice = dice_scores(predictions, torch.as_tensor(labels))
                row[name] = {k: round(float(dice[k]), 3) for k in ("mean", "WT", "TC", "ET")}
        real = score_model(ensemble, config, check)
        row["real"] = {k: round(float(real["dice"][k]), 3) for k in ("mean", "WT", "TC", "ET")}
        row["real_cases"] = {r["case"]: [round(float(r[k]), 3) for k in ("WT", "TC", "ET")] for r in real["cases"]}
        return row

    start = Ensemble(public, models=[public])
    rows = [{"teachers": "start model", **scored(start)}]
    for kind in args.teachers.split(","):
        started = time.time()
        heads, models = [], []
        for part in parts:
            x = torch.as_tensor(np.asarray(prepared.images(part), np.float32))
            y = torch.as_tensor(np.asarray(prepared.labels(part), np.int64))
            if kind == "voxel-head":
                with torch.no_grad():
                    features = torch.cat([public(x), x], 1)
                head = build_unet(preset.unet, trainable=VOXEL_HEAD).voxel_head
                optimiser = torch.optim.Adam(head.parameters(), lr=1e-2)
                for _ in range(args.steps):
                    optimiser.zero_grad()
                    per_sample_loss(features[:, :4] + head(features), y).mean().backward()
                    optimiser.step()
                head.eval()
                heads.append(head)
            else:
                model = copy.deepcopy(public)
                names = trainable_parameter_names(model, Trainable.DECODER if kind == "decoder" else Trainable.HEAD)
                trained = [p for n, p in model.named_parameters() if n in names]
                for p in trained:
                    p.requires_grad_(True)
                optimiser = torch.optim.Adam(trained, lr=args.decoder_lr)
                model.train()
                for _ in range(args.steps):
                    optimiser.zero_grad()
                    per_sample_loss(model(x), y).mean().backward()
                    optimiser.step()
                model.eval()
                for p in trained:
                    p.requires_grad_(False)
                models.append(model)
        ensemble = Ensemble(public, heads=heads) if kind == "voxel-head" else Ensemble(public, models=models)
        trained_s = time.time() - started
        rows.append({"teachers": kind, "train_s": round(trained_s), **scored(ensemble)})
    with open(out / "teachers.jsonl", "a") as handle:
        for row in rows:
            row = {"seed": args.seed, "steps": args.steps, "decoder_lr": args.decoder_lr, "K": len(parts), **row}
            print(json.dumps(row), flush=True)
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
