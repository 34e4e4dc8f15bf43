"""Voxel-head teachers on the frozen public U-Net: what running that U-Net once saves, in one process.

    .venv/bin/python benchmarks/bench_teachers.py [--preset quick] [--teachers 32] [--scans 20] [--device cpu]
                                                  [--patients 2] [--deterministic]

1. Answering: one hospital with ``--teachers`` voxel-head teachers on the preset's U-Net (random public weights,
   random heads: the arithmetic, not the accuracy, is measured) gives its teachers' softmax outputs on ``--scans``
   random scans of the preset's grid both ways -- :meth:`clients.hospital.Hospital.teacher_probs` for each
   teacher, and :meth:`clients.hospital.Hospital.each_teacher_probs` (the U-Net run once).
2. Training: one teacher's head trained as the preset's teachers train (its epochs, learning rate, no
   augmentation) on ``--patients`` random patients, with the frozen U-Net's output remembered per batch (the
   default) and run at every step.

Both pairs must give identical arrays; prints the seconds and their ratios as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import numpy as np
    import torch

    from clients.hospital import Hospital, HospitalSettings
    from task.io import atomic_save_torch
    from task.networks import build_unet, load_start_weights
    from task.options import Trainable
    from task.presets import get_preset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--teachers", type=int, default=32)
    parser.add_argument("--scans", type=int, default=20)
    parser.add_argument("--patients", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (torch.use_deterministic_algorithms): on a GPU, cuDNN's default "
                             "kernels can differ between two runs of the same computation, shared pass or not")
    args = parser.parse_args()
    if args.deterministic:
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    preset = get_preset(args.preset)
    torch.manual_seed(0)
    public = build_unet(preset.unet).state_dict()
    with tempfile.TemporaryDirectory(prefix="bench_teachers_") as root:
        hospital = Hospital("h0", None, [[f"case-{k}"] for k in range(args.teachers)], preset, Path(root) / "h0",
                            HospitalSettings(lifetime_epsilon=1.0, device=args.device))
        for k in range(args.teachers):
            teacher = build_unet(preset.unet, trainable=Trainable.VOXEL_HEAD)
            load_start_weights(teacher, public)   # the public U-Net under every head, as teachers start
            with torch.no_grad():
                for parameter in teacher.voxel_head.parameters():
                    parameter.normal_(0.0, 0.1)
            atomic_save_torch(hospital._teacher_path(k), teacher.state_dict(), private=True)
        scans = np.random.default_rng(0).normal(size=(args.scans, 4, *preset.grid)).astype(np.float32)
        hospital.load_teachers()
        hospital.teacher_probs(0, scans[:2])   # warm-up: first-call allocations are not what is compared
        start = time.perf_counter()
        one_by_one = [hospital.teacher_probs(k, scans) for k in range(args.teachers)]
        separate = time.perf_counter() - start
        start = time.perf_counter()
        shared = list(hospital.each_teacher_probs(scans))
        together = time.perf_counter() - start
        identical = all(np.array_equal(a, b) for a, b in zip(one_by_one, shared)) and len(shared) == len(one_by_one)
    remembered, every_step, same_weights = _training(preset, public, scans[:args.patients], args.device)
    print(json.dumps({"preset": args.preset, "grid": list(preset.grid), "teachers": args.teachers,
                      "scans": args.scans, "device": args.device, "threads": torch.get_num_threads(),
                      "answer_teacher_by_teacher_s": round(separate, 2), "answer_one_unet_pass_s": round(together, 2),
                      "answer_speed_up": round(separate / together, 1), "answers_identical": identical,
                      "train_patients": args.patients, "train_epochs": preset.teacher.epochs,
                      "train_unet_every_step_s": round(every_step, 2), "train_unet_remembered_s": round(remembered, 2),
                      "train_speed_up": round(every_step / remembered, 1), "weights_identical": same_weights}))
    if not identical or not same_weights:
        sys.exit("bench_teachers: the shared U-Net gave other arrays than running it each time")


def _training(preset, public, images, device):
    """(seconds with the U-Net's output remembered, seconds running it every step, identical weights?)."""
    from unittest import mock

    import numpy as np
    import torch

    import task.training
    from task.compute import Compute
    from task.networks import build_unet, load_start_weights
    from task.options import Trainable
    from task.training import TrainConfig, train_segmentation

    labels = np.random.default_rng(1).integers(0, 4, size=(len(images), *preset.grid))
    config = TrainConfig(epochs=preset.teacher.epochs, batch_size=preset.batch_size,
                         learning_rate=float(preset.teacher.learning_rate or preset.learning_rate), seed=0,
                         trainable=Trainable.VOXEL_HEAD, augment=False,
                         compute=Compute(device=device, progress=False))

    def train():
        torch.manual_seed(0)
        model = build_unet(preset.unet, trainable=Trainable.VOXEL_HEAD)
        load_start_weights(model, public)
        start = time.perf_counter()
        trained = train_segmentation(model, images, labels, config).model
        return time.perf_counter() - start, trained.state_dict()

    train()   # warm-up: the first training imports the loss (MONAI) and allocates; neither is compared
    remembered, weights = train()
    with mock.patch.object(task.training._FrozenUNetMemo, "for_training", lambda *args, **kwargs: None):
        every_step, plain_weights = train()
    same = all(torch.equal(weights[name], plain_weights[name]) for name in weights)
    return remembered, every_step, same


if __name__ == "__main__":
    main()
