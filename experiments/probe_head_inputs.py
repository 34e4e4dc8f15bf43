"""Why the voxel heads' gains stay on the phantoms: the same DP-SGD voxel head reading the public model's class
scores *and* the scan's four intensities (the product's head), or the class scores alone, scored on the phantom
test set, on public validation (another centre's labelled phantoms: the only set a choice may read) and, as a check
never used to choose, on labelled real cases.

    .venv/bin/python -m experiments.probe_head_inputs PUBLIC_MODEL.pt SEED REAL_DIR [SIGMA EPOCHS DRAWS]
    e.g. python -m experiments.probe_head_inputs runs/demo/_shared/K-128/public-model.pt 0 /data/real-dev 0.915 10 2

The hypothesis: the head's correction reads each voxel's phantom intensities, and a per-voxel intensity rule that
separates the phantoms' classes does not separate a real scan's. If so, a head without the intensities should keep
more of its phantom gain on real scans (and gain less on phantoms).

A diagnostic, not the product path (as experiments/probe_voxel_head.py): per-sample gradients by torch.func on the
frozen public model's cached logits, Poisson batches of expected size 16, flat clipping at 0.1, Gaussian noise
SIGMA x 0.1 from torch's seeded RNG (no ledger), Adam at lr 1e-2, no augmentation. SIGMA is the multiplier the
product calibrates for 10 epochs at expected batch 16 over 180 patients (0.915 at eps 8, delta 1e-3,
replace-one); SIGMA 0 trains without noise. The public model is trained into PUBLIC_MODEL.pt when it is missing.
Released models are scored with test-time mirroring, as the product scores them.
"""
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from task.learning.networks import corrected_logits

INPUTS = ("scores+scan", "scores")


class HeadOnScores(nn.Module):
    """The frozen public U-Net plus a voxel head on [logits, mask * scan]: mask 1 is the product's head, 0 reads the
    class scores alone."""

    def __init__(self, unet: nn.Module, head: nn.Module, reads_scan: bool) -> None:
        super().__init__()
        self.unet, self.head, self.mask = unet, head, 1.0 if reads_scan else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return corrected_logits(self.head, self.unet(x), x * self.mask)


def main() -> None:
    public_path, seed, real_dir = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sigma = float(sys.argv[4]) if len(sys.argv) > 4 else 0.915
    epochs = int(sys.argv[5]) if len(sys.argv) > 5 else 10
    draws = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    import task.settings.presets as presets
    from sim.runners.central import load_central_data, public_start
    from task.reporting.bundle import preprocessing_of
    from task.learning.networks import build_unet_from_config, network_config, voxel_head
    from task.reporting.predict import preprocess_config_of
    from task.reporting.realcheck import open_check, score_model
    from task.learning.training import evaluate_release, per_sample_loss

    preset = presets.get_preset("quick")
    world = load_central_data(preset, seed=seed, progress=False)
    state = public_start(preset, seed=seed, data=None, progress=False, checkpoint=public_path)
    unet = build_unet_from_config(network_config(preset.unet))
    unet.load_state_dict(state)
    unet.eval().requires_grad_(False)
    check = open_check([real_dir], cache_dir=None)
    config = preprocess_config_of(preprocessing_of(world["prepared"]))

    def logits_of(x):
        with torch.no_grad():
            return torch.cat([unet(torch.as_tensor(x[i:i + 8])) for i in range(0, len(x), 8)])

    def phantom(model, images, labels):   # mean Dice as a released model is scored: with test-time mirroring
        return round(float(evaluate_release(model, images, labels)[0]["mean"]), 3)

    def scored(model):
        real = score_model(model, config, check)["dice"]
        return {"phantom": phantom(model, world["test_images"], world["test_labels"]),
                "validation": phantom(model, *world["validation"]),
                **{f"real_{k}": round(float(real[k]), 3) for k in ("mean", "WT", "TC", "ET")}}

    print(json.dumps({"seed": seed, "head": "none (public model)",
                      **scored(HeadOnScores(unet, voxel_head(4, 4), reads_scan=False))}), flush=True)
    xtr = torch.as_tensor(world["train_images"])
    ltr = logits_of(xtr)
    targets = torch.nn.functional.one_hot(torch.as_tensor(world["train_labels"]).long(), 4).movedim(-1, 1).float()
    for reads_scan in (True, False):
        features = torch.cat([ltr, xtr * (1.0 if reads_scan else 0.0)], 1)
        for draw in range(draws):
            torch.manual_seed(1000 * seed + draw)
            head = voxel_head(4, 4)
            params = {k: v.detach().clone().requires_grad_(True) for k, v in head.named_parameters()}

            def loss_one(prm, f, y):
                return per_sample_loss(functional_call(head, prm, (f[None],)) + f[None, :4], y[None]).mean()

            per_grad = vmap(grad(loss_one), in_dims=(None, 0, 0))
            optimiser = torch.optim.Adam(list(params.values()), lr=1e-2)
            n, batch, clip = len(features), 16, 0.1
            generator = torch.Generator().manual_seed(7 + draw)
            started = time.time()
            for _ in range(epochs * math.ceil(n / batch)):
                index = torch.nonzero(torch.rand(n, generator=generator) < batch / n).flatten()
                if len(index) == 0:
                    continue
                g = per_grad({k: v.detach() for k, v in params.items()}, features[index], targets[index])
                norms = torch.sqrt(sum((gv.reshape(len(index), -1) ** 2).sum(1) for gv in g.values()))
                factor = (clip / (norms + 1e-12)).clamp(max=1.0)
                for k in params:
                    total = (g[k] * factor.view(-1, *[1] * (g[k].dim() - 1))).sum(0)
                    params[k].grad = (total + sigma * clip * torch.randn_like(total)) / batch
                optimiser.step()
            with torch.no_grad():
                for k, v in head.named_parameters():
                    v.copy_(params[k])
            model = HeadOnScores(unet, head, reads_scan).eval()
            print(json.dumps({"seed": seed, "head": INPUTS[0] if reads_scan else INPUTS[1], "draw": draw,
                              "sigma": sigma, "epochs": epochs, "seconds": round(time.time() - started),
                              **scored(model)}), flush=True)


if __name__ == "__main__":
    main()
