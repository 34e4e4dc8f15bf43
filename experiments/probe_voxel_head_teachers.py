"""The probe behind the voxel-head teachers (docs/decisions/teachers.md): one voxel head per PATE partition (K = 128
on the quick world), each trained on its 1-2 patients on the frozen public model's cached logits, full batch, no
augmentation; the probability average of all heads on the test set is scored (a noise-free ensemble: what teachers
know, before any codec or noise).

    .venv/bin/python -m experiments.probe_voxel_head_teachers PUBLIC_MODEL.pt SEED STEPS LR
    e.g. python -m experiments.probe_voxel_head_teachers runs/s0/_shared/K-128/public-model.pt 0 60 1e-2
"""
import sys, json, time
import numpy as np, torch, torch.nn as nn
torch.set_num_threads(1)

def main():
    public_path = sys.argv.pop(1)
    seed, steps, lr = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    import task.settings.presets as presets
    from sim.runners.central import load_central_data
    from task.learning.networks import build_unet, VOXEL_HEAD, load_start_weights
    from task.learning.training import per_sample_loss
    from task.learning.metrics import dice_scores
    p = presets.get_preset("quick")
    world = load_central_data(p, seed=seed, progress=False)
    prepared, split = world["prepared"], world["split"]
    public = build_unet(p.unet)
    ck = torch.load(public_path, weights_only=False)
    public.load_state_dict(ck.get("model", ck)); public.eval()
    def logits(x):
        with torch.no_grad():
            return torch.cat([public(torch.as_tensor(x[i:i+4])) for i in range(0, len(x), 4)])
    xte = torch.as_tensor(world["test_images"]); yte = torch.as_tensor(world["test_labels"])
    lte = logits(xte); fte = torch.cat([lte, xte], 1)
    print("public", {k: round(v, 3) for k, v in dice_scores(lte.argmax(1), yte).items() if v is not None}, flush=True)
    parts = [part for h in sorted(split.hospitals) for part in split.hospitals[h]]
    prob_sum = torch.zeros_like(lte); t0 = time.time()
    for part in parts:
        x = torch.as_tensor(np.asarray(prepared.images(part), np.float32)); y = torch.as_tensor(np.asarray(prepared.labels(part), np.int64))
        f = torch.cat([logits(x), x], 1)
        model = build_unet(p.unet, trainable=VOXEL_HEAD); head = model.voxel_head
        opt = torch.optim.Adam(head.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad(); out = f[:, :4] + head(f); per_sample_loss(out, y).mean().backward(); opt.step()
        with torch.no_grad():
            prob_sum += torch.softmax(lte + head(fte), 1)
    d = dice_scores(prob_sum.argmax(1), yte)
    print(json.dumps({"seed": seed, "steps": steps, "lr": lr, "teachers": len(parts), "sec": round(time.time() - t0),
                      **{k: round(v, 3) for k, v in d.items() if v is not None}}), flush=True)

if __name__ == "__main__":
    main()
