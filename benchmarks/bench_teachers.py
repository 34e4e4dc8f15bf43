"""A hospital's voxel-head teachers one by one against all of them stacked, in one process, on the same data.

    .venv/bin/python benchmarks/bench_teachers.py [--preset quick] [--teachers 32] [--patients 45] [--epochs E]
                                                  [--scans 8] [--device cpu] [--threads 1] [--deterministic]

1. Training: ``--teachers`` voxel-head teachers on ``--patients`` random patients split as evenly as they go (a quick
   hospital: 45 patients, 32 teachers of one or two patients each), trained as the preset's
   teachers train (its epochs unless ``--epochs``, its learning rate, no augmentation) from the same heads on the
   preset's U-Net (random public weights: the arithmetic, not the accuracy, is measured) -- one
   :func:`task.learning.training.train_segmentation` per teacher (the frozen U-Net's output remembered per batch, as a
   hospital trained them before) and all at once (:func:`task.learning.training.train_stacked_voxel_heads`: the U-Net once
   per patient, the heads stacked, one optimiser). Reports the largest difference between the two ways' heads, and
   the torch operators one epoch dispatches each way (leaf operators in ``torch.profiler``, second epoch minus
   first: on a GPU each is at least one kernel launch) -- stacked both in the chunks this device's memory budget
   gives and in one chunk per step, as on a GPU.
2. Answering: one hospital with those teachers answers a query batch of ``--scans`` random scans through the
   anchored codec (shells and intensity bins fitted on the public U-Net's own output) -- each teacher's softmax
   copied to the host and encoded there (:meth:`clients.hospital.Hospital.teacher_probs`, then the codec's
   encoder), and every teacher's answer stacked on the device and encoded there
   (:meth:`clients.hospital.Hospital.teacher_probability_groups`, ``Encoder.many``). Reports the largest
   difference of the probabilities and of the encoded rows.

Prints one JSON line: seconds of process CPU time and of wall time for each way (on CUDA every timing ends with a
synchronisation), and their ratios. On a shared CPU the wall times swing with the other processes: compare the
ratios of one run, and prefer the CPU-time ratio there.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import numpy as np
    import torch

    from task.learning.networks import build_unet
    from task.settings.presets import get_preset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--teachers", type=int, default=32)
    parser.add_argument("--patients", type=int, default=45, help="the hospital's patients, over its teachers")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: the preset's teachers')")
    parser.add_argument("--scans", type=int, default=8, help="scans in the query batch (a PATE query batch: 8)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (torch.use_deterministic_algorithms) on a GPU")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    preset = get_preset(args.preset)
    epochs = preset.teacher.epochs if args.epochs is None else args.epochs
    device = torch.device(args.device)
    torch.manual_seed(0)
    public = build_unet(preset.unet).state_dict()
    rng = np.random.default_rng(0)
    patients = args.patients
    images = rng.normal(size=(patients, 4, *preset.grid)).astype(np.float32)
    labels = rng.integers(0, 4, size=(patients, *preset.grid))
    samples = [range(int(part[0]), int(part[-1]) + 1) if len(part) else range(0)
               for part in np.array_split(np.arange(patients), args.teachers)]
    training = _training(preset, public, images, labels, samples, epochs, device)
    answering = _answering(preset, public, training.pop("heads"), args.scans, device)
    print(json.dumps({"preset": args.preset, "grid": list(preset.grid), "device": str(device),
                      "threads": torch.get_num_threads(), "teachers": args.teachers,
                      "patients": patients, "epochs": epochs, "query_scans": args.scans,
                      **training, **answering}))


class _Clock:
    """Process CPU seconds and wall seconds of a block (after a device synchronisation on CUDA)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self._sync()
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.cpu, self.wall = time.process_time() - self.cpu, time.perf_counter() - self.wall

    def _sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _ratio(slow: float, fast: float) -> float:
    return round(slow / fast, 2) if fast > 0 else float("nan")


def _training(preset, public, images, labels, samples: list, epochs: int, device) -> dict:
    """Both ways of training the same teachers from the same heads; their times and how far their heads differ."""
    import torch

    from task.learning.compute import Compute
    from task.learning.networks import VOXEL_HEAD, StackedVoxelHeads, build_unet, load_start_weights
    from task.learning.training import TrainConfig, train_segmentation, train_stacked_voxel_heads

    config = TrainConfig(epochs=epochs, batch_size=preset.batch_size,
                         learning_rate=float(preset.teacher.learning_rate or preset.learning_rate),
                         trainable=VOXEL_HEAD, augment=False, compute=Compute(device=str(device), progress=False))
    start, teachers = [], len(samples)
    for k in range(teachers):
        torch.manual_seed(100 + k)
        model = build_unet(preset.unet, trainable=VOXEL_HEAD)
        load_start_weights(model, public)
        start.append(model)
    one = copy.deepcopy(start[0])   # warm-up: the loss's import (MONAI) and first allocations are not compared
    train_segmentation(one, images[:1], labels[:1], TrainConfig(**{**config.__dict__, "epochs": 1}))
    with _Clock(device) as alone:
        trained = [train_segmentation(copy.deepcopy(start[k]), images[list(samples[k])], labels[list(samples[k])],
                                      TrainConfig(**{**config.__dict__, "seed": k})).model for k in range(teachers)]
    stacked = StackedVoxelHeads.from_heads([model.voxel_head for model in start])
    with _Clock(device) as together:
        train_stacked_voxel_heads(start[0].model, stacked, images, labels, samples, list(range(teachers)), config)
    operators = _operators_per_epoch(start, images, labels, samples, config)
    difference = max(float((stacked.head_state(k)[name].to(value.device) - value).abs().max())
                     for k, model in enumerate(trained)
                     for name, value in model.state_dict().items() if name.startswith("voxel_head."))
    moved = max(float((stacked.head_state(k)[name].cpu() - value.cpu()).abs().max())
                for k, model in enumerate(start) for name, value in model.state_dict().items()
                if name.startswith("voxel_head."))
    heads = [{**public, **{n: v.cpu() for n, v in stacked.head_state(k).items()}} for k in range(teachers)]
    return {"train_one_by_one_cpu_s": round(alone.cpu, 2), "train_stacked_cpu_s": round(together.cpu, 2),
            "train_speed_up_cpu": _ratio(alone.cpu, together.cpu),
            "train_one_by_one_wall_s": round(alone.wall, 2), "train_stacked_wall_s": round(together.wall, 2),
            "train_speed_up_wall": _ratio(alone.wall, together.wall),
            "heads_max_abs_difference": difference, "heads_max_abs_move": moved, **operators, "heads": heads}


def _operators_per_epoch(start, images, labels, samples, config) -> dict:
    """Leaf torch operators of one training epoch (two epochs minus one), one by one and stacked."""
    from torch.profiler import profile

    from task.learning.networks import StackedVoxelHeads
    from task.learning.training import TrainConfig, train_segmentation, train_stacked_voxel_heads

    def count(run, epochs: int) -> int:
        with profile() as prof:
            run(TrainConfig(**{**config.__dict__, "epochs": epochs}))
        return sum(1 for event in prof.events() if event.name.startswith("aten::") and not event.cpu_children)

    def alone(epoch_config):
        for k, own in enumerate(samples):
            train_segmentation(copy.deepcopy(start[k]), images[list(own)], labels[list(own)],
                               TrainConfig(**{**epoch_config.__dict__, "seed": k}))

    def together(budget):
        def run(epoch_config):
            heads = StackedVoxelHeads.from_heads([model.voxel_head for model in start])
            train_stacked_voxel_heads(start[0].model, heads, images, labels, samples, list(range(len(start))),
                                      epoch_config, budget_bytes=budget)
        return run

    runs = {"one_by_one": alone, "stacked": together(None), "stacked_one_chunk": together(1 << 50)}
    return {f"operators_per_epoch_{name}": count(run, 2) - count(run, 1) for name, run in runs.items()}


def _answering(preset, public, heads: list, scans: int, device) -> dict:
    """One hospital with those teachers (each in a file of its own, sharing the public U-Net) answers one batch
    both ways."""
    import numpy as np

    from clients.hospital import Hospital, HospitalSettings
    from task import codecs
    from task.codecs import AnchoredResidualCompressor
    from task.io import atomic_save_torch
    from task.learning.networks import build_unet
    from task.learning.training import predict_probs

    rng = np.random.default_rng(1)
    queries = rng.normal(size=(scans, 4, *preset.grid)).astype(np.float32)
    reference = rng.normal(size=(max(scans, 4), 4, *preset.grid)).astype(np.float32)
    unet = build_unet(preset.unet)
    unet.load_state_dict(public)
    anchor = predict_probs(unet, queries, device=device)
    reference_probs = predict_probs(unet, reference, device=device)
    compressor = AnchoredResidualCompressor(intensity_bins=3).fit(
        codecs.one_hot(reference_probs.argmax(1)).astype(np.float32), reference_probs, reference)
    codec = codecs.verify_codec(compressor.batch_state(compressor.state(), anchor, queries), scans_shape=queries.shape)
    with tempfile.TemporaryDirectory(prefix="bench_teachers_") as root:
        hospital = Hospital("h0", None, [[f"case-{k}"] for k in range(len(heads))], preset, Path(root) / "h0",
                            HospitalSettings(lifetime_epsilon=1.0, device=str(device)))
        for k, state in enumerate(heads):
            atomic_save_torch(hospital._teacher_path(k), state, private=True)
        hospital.load_teachers()
        encode = codecs.make_encoder(codec, device)
        hospital.teacher_probs(0, queries[:2])   # warm-up
        with _Clock(device) as alone:
            probs_alone = [hospital.teacher_probs(k, queries) for k in range(len(heads))]
            rows_alone = np.stack([encode(p) for p in probs_alone])
        with _Clock(device) as together:
            groups = list(hospital.teacher_probability_groups(queries))
            rows_together = np.concatenate([encode.many(probs) for _, probs in groups])
        probs_together = np.concatenate([probs.cpu().numpy() for _, probs in groups])
    return {"answer_one_by_one_cpu_s": round(alone.cpu, 2), "answer_stacked_cpu_s": round(together.cpu, 2),
            "answer_speed_up_cpu": _ratio(alone.cpu, together.cpu),
            "answer_one_by_one_wall_s": round(alone.wall, 2), "answer_stacked_wall_s": round(together.wall, 2),
            "answer_speed_up_wall": _ratio(alone.wall, together.wall),
            "probabilities_max_abs_difference": float(np.abs(probs_together - np.stack(probs_alone)).max()),
            "rows_max_abs_difference": float(np.abs(rows_together - rows_alone).max()),
            "row_bound": float(compressor.clip), "teacher_groups": len(groups)}


if __name__ == "__main__":
    main()
