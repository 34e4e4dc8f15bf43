"""The probe behind the voxel head (docs/decisions/dp-sgd-voxel-head.md): a 1x1x1 head on the frozen public model's
logits and the scan, trained on the pooled private patients, scored on the test set -- noise-free or with DP-SGD
noise.

    .venv/bin/python -m experiments.probe_voxel_head PUBLIC_MODEL.pt SEED KERNEL SIGMA EPOCHS [LR HIDDEN BATCH]
    e.g. python -m experiments.probe_voxel_head runs/s0/_shared/K-128/public-model.pt 0 1 0.915 10 1e-2

A diagnostic, not the product path: per-sample gradients by torch.func, Poisson batches of expected size BATCH,
flat clipping at 0.1 and Gaussian noise SIGMA x 0.1 drawn from torch's seeded RNG (not secure, no ledger); SIGMA is
the multiplier the product calibrates for the same schedule (0.915 at eps 8, 4.696 at eps 1 for 10 epochs at
expected batch 16 over 180 patients, delta 1e-3, replace-one). No augmentation. The product path is
``fedpate central --method dp-sgd --trainable voxel-head`` (experiments/lever_dpsgd.py voxel-head).
"""
import os, sys, json, math, time
import numpy as np, torch, torch.nn as nn
from torch.func import functional_call, vmap, grad

def main():
    public_path = sys.argv.pop(1)
    seed = int(sys.argv[1]); kernel = int(sys.argv[2]); sigma = float(sys.argv[3]); epochs = int(sys.argv[4])
    lr = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-2
    hidden = int(sys.argv[6]) if len(sys.argv) > 6 else 16
    batch = int(sys.argv[7]) if len(sys.argv) > 7 else 16
    torch.manual_seed(1234)
    import task.settings.presets as presets
    from sim.runners.central import load_central_data
    from task.learning.networks import network_config, build_unet_from_config
    from task.learning.training import predict_probs, per_sample_loss
    from task.learning.metrics import dice_scores
    p = presets.get_preset("quick")
    world = load_central_data(p, seed=seed, progress=False)
    model = build_unet_from_config(network_config(p.unet))
    ck = torch.load(public_path, weights_only=False)
    sd = ck.get("model", ck) if isinstance(ck, dict) else ck
    model.load_state_dict(sd); model.eval()
    def logits_of(x):
        with torch.no_grad():
            return torch.cat([model(torch.as_tensor(x[i:i+8])) for i in range(0, len(x), 8)])
    xtr, ytr = torch.as_tensor(world["train_images"]), torch.as_tensor(world["train_labels"])
    xte, yte = torch.as_tensor(world["test_images"]), torch.as_tensor(world["test_labels"])
    ltr, lte = logits_of(xtr), logits_of(xte)
    print("public", {k: round(v, 3) for k, v in dice_scores(lte.argmax(1), yte).items() if v is not None}, len(xtr), flush=True)
    ftr, fte = torch.cat([ltr, xtr], 1), torch.cat([lte, xte], 1)
    ytr1 = torch.nn.functional.one_hot(ytr.long(), 4).movedim(-1, 1).float()
    head = nn.Sequential(nn.Conv3d(8, hidden, kernel, padding=kernel // 2), nn.PReLU(), nn.Conv3d(hidden, 4, 1))
    nn.init.zeros_(head[2].weight); nn.init.zeros_(head[2].bias)
    params = {k: v.detach() for k, v in head.named_parameters()}
    def loss_one(prm, f, y):
        out = functional_call(head, prm, (f[None],)) + f[None, :4]
        return per_sample_loss(out, y[None]).mean()
    per_grad = vmap(grad(loss_one), in_dims=(None, 0, 0))
    opt = torch.optim.Adam(list(params.values()), lr=lr)
    for v in params.values(): v.requires_grad_(True)
    n = len(ftr); q = batch / n; steps = epochs * math.ceil(n / batch); C = 0.1
    gen = torch.Generator().manual_seed(7)
    t0 = time.time()
    for step in range(steps):
        idx = torch.nonzero(torch.rand(n, generator=gen) < q).flatten()
        if len(idx) == 0: continue
        g = per_grad({k: v.detach() for k, v in params.items()}, ftr[idx], ytr1[idx])
        if sigma > 0:
            norms = torch.sqrt(sum((gv.reshape(len(idx), -1) ** 2).sum(1) for gv in g.values()))
            factor = (C / (norms + 1e-12)).clamp(max=1.0)
            for k in params:
                s = (g[k] * factor.view(-1, *[1] * (g[k].dim() - 1))).sum(0)
                params[k].grad = (s + sigma * C * torch.randn_like(s)) / batch
        else:
            for k in params: params[k].grad = g[k].mean(0)
        opt.step()
    with torch.no_grad():
        out = functional_call(head, params, (fte,)) + lte
    d = dice_scores(out.argmax(1), yte)
    print(json.dumps({"seed": seed, "k": kernel, "sigma": sigma, "epochs": epochs, "lr": lr, "hidden": hidden, "batch": batch,
                      "params": sum(v.numel() for v in params.values()), "sec": round(time.time() - t0),
                      **{k: round(v, 3) for k, v in d.items() if v is not None}}), flush=True)

if __name__ == "__main__":
    main()
