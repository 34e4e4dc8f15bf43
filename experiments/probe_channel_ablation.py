"""Which sequence a phantom-trained model relies on in a real case: the model's WT / TC / ET on each labelled real
case with one channel set to its mean (0 after normalisation), or one channel's contrast scaled.

    .venv/bin/python -m experiments.probe_channel_ablation MODEL.pt DIR [DIR ...]

MODEL.pt is a state dict of the small U-Net (``experiments.probe_world`` trains one per run). One pass, no mirroring.
"""
import sys

import numpy as np


def main() -> None:
    import torch

    from task.data.msd import load_case
    from task.data.preprocess import PreprocessConfig, preprocess_case
    from task.learning.metrics import per_case_dice_counted, summarise
    from task.learning.networks import build_unet
    from task.reporting.realcheck import open_check
    from task.learning.training import predict_probs

    config = PreprocessConfig(grid=(32, 32, 32))
    model = build_unet("small")
    model.load_state_dict(torch.load(sys.argv[1]))
    model.eval()
    channel = np.arange(4)[:, None, None, None]
    edits = {"as is": lambda x: x, "T2 = mean": lambda x: np.where(channel == 3, 0, x),
             "T1 = mean": lambda x: np.where(channel == 1, 0, x),
             "FLAIR x 1.5": lambda x: x * np.array([1.5, 1, 1, 1])[:, None, None, None]}
    for real in open_check(sys.argv[2:], cache_dir=None).cases:
        image, label, affine = load_case(real.case)
        grid, truth, _ = preprocess_case(image, label, affine, config)
        brain = np.abs(grid).sum(0) > 0
        row = {}
        for name, edit in edits.items():
            predicted = predict_probs(model, (edit(grid) * brain).astype(np.float32)[None])[0].argmax(0)
            classes, regions = per_case_dice_counted(predicted[None], truth[None])
            scores = summarise(classes, regions)
            row[name] = [round(float(scores[k]), 2) for k in ("WT", "TC", "ET")]
        print(real.case_id, row, flush=True)


if __name__ == "__main__":
    main()
