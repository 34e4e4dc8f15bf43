"""Test-time mirroring's 8 passes one after the other against one batch of 8, in one process, on the same scans.

    .venv/bin/python benchmarks/bench_mirroring.py [--preset quick] [--batch 2] [--repeats 5] [--device cpu]
                                                   [--threads 1]

What is timed is :func:`task.learning.inference.mirrored_probabilities` on the preset's U-Net (random weights: the arithmetic
is measured) for a batch of ``--batch`` random scans, both ways (``together=False`` / ``True``), alternating, the
median of ``--repeats`` each; on CUDA every timing ends with a synchronisation. The product picks one batch on a GPU
and one pass after the other on the CPU: this is the measurement behind that choice. Prints one JSON line: seconds
of process CPU time and wall time, their ratios, and the largest difference of the probabilities.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from task.learning.inference import mirrored_probabilities
    from task.learning.networks import build_unet
    from task.settings.presets import get_preset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--batch", type=int, default=2, help="scans per prediction (predict_probs' batch: 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = get_preset(args.preset)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_unet(preset.unet).to(device).eval()
    x = torch.randn(args.batch, 4, *preset.grid, generator=torch.Generator().manual_seed(1)).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = {False: [], True: []}
    with torch.no_grad():
        outputs = {together: mirrored_probabilities(model, x, together=together) for together in (False, True)}
        for _ in range(args.repeats):
            for together in (False, True):
                sync()
                cpu, wall = time.process_time(), time.perf_counter()
                mirrored_probabilities(model, x, together=together)
                sync()
                times[together].append((time.process_time() - cpu, time.perf_counter() - wall))
    median = {together: [statistics.median(t[i] for t in times[together]) for i in (0, 1)] for together in times}
    print(json.dumps({"preset": args.preset, "grid": list(preset.grid), "batch": args.batch, "device": str(device),
                      "threads": torch.get_num_threads(), "repeats": args.repeats,
                      "one_by_one_cpu_s": round(median[False][0], 4), "one_batch_cpu_s": round(median[True][0], 4),
                      "one_by_one_wall_s": round(median[False][1], 4), "one_batch_wall_s": round(median[True][1], 4),
                      "one_batch_speed_up_cpu": round(median[False][0] / median[True][0], 2),
                      "one_batch_speed_up_wall": round(median[False][1] / median[True][1], 2),
                      "max_abs_difference": float((outputs[True] - outputs[False]).abs().max())}))


if __name__ == "__main__":
    main()
