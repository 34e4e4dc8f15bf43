"""Plain and DP-SGD step throughput, and the DP/plain ratio, on the device this machine has.

    .venv/bin/python benchmarks/bench_device.py [--device auto] [--precision 32,bf16] [--preset P --grid G]
                                                [--batch B] [--steps N] [--pipeline]

One command, every ratio from one run. The device is ``task.learning.device.resolve_device(--device)``: CUDA when there
is one. Defaults follow the device: on a GPU the ``paper`` preset's network (64^3, channels 16..256, batch 2),
so that the paper preset's time on a GPU can be read off; on the CPU the ``small`` network at 32^3.

What is timed is fedpate's own step, not a stand-in: ``task.learning.networks`` U-Net, ``task.learning.training.per_sample_loss``
(Dice + CE per sample), Adam; DP-SGD through ``task.learning.dpsgd.DPSession`` (Opacus functorch per-sample gradients,
per-layer clipping at 4, sigma = sqrt 6, noise drawn on the host from the OS CSPRNG and copied to the device).
On CUDA every timed step ends with ``torch.cuda.synchronize()``. Printed per precision: median seconds per
step, samples per second, DP/plain; also the host-side augmentation of one batch (``task.data.augment``, what a
GPU would wait for without prefetching) over the plain step.

``--pipeline`` also times whole training epochs through ``task.learning.training.train_segmentation`` with augmentation:
host augmentation with batch prefetching off and on (checks both give the same weights, and that two runs without
prefetching do: on a GPU only with --deterministic), and
batched augmentation on the device (``task.data.augment.BatchAugmentation``).

Timings on a shared 2-core CPU swing by +-30% between runs: compare the ratios of one run, not seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def _timer(device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def median_seconds(step, steps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            step()
        sync()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return median_seconds


def bench_steps(device, precision: str, preset: str, grid: int, batch: int, steps: int) -> dict:
    from privacy.mechanisms import NoiseSource
    from task.learning.device import autocast
    from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining
    from task.learning.networks import build_unet
    from task.learning.training import _augment_batch, _augmenter, per_sample_loss

    median_seconds = _timer(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, grid, grid, grid, generator=gen).to(device)
    y = torch.randint(0, 4, (batch, grid, grid, grid), generator=gen).to(device)

    torch.manual_seed(0)
    model = build_unet(preset).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def plain():
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, precision):
            logits = model(x)
        per_sample_loss(logits.float(), y).mean().backward()
        optimizer.step()

    plain_s = median_seconds(plain, steps)

    torch.manual_seed(0)
    dp_model = build_unet(preset).to(device)
    dp_optimizer = torch.optim.Adam(dp_model.parameters(), lr=1e-3)
    session = DPSession(dp_model, dp_optimizer,
                        PrivateTraining(DPConfig(mode="fixed", epsilon=1e9, noise_multiplier=6 ** 0.5, sampling="shuffle",
                                                 delta=1e-3, max_grad_norm=4.0),
                                        owners=("bench",), noise=NoiseSource()),   # secure noise: the default path
                        n=batch * 10, batch_size=batch, epochs=1)
    session.begin_epoch(0)

    def private():
        session.optimizer.zero_grad(set_to_none=True)
        with autocast(device, precision):
            logits = session.model(x)
        per_sample_loss(logits.float(), y).mean().backward()
        if precision != "32":
            session.per_sample_gradients_to_float32()
        session.optimizer.step()

    dp_s = median_seconds(private, steps)

    aug = _augmenter(0, True)
    x_host, y_host = x.cpu(), y.cpu()
    augment_s = median_seconds(lambda: _augment_batch(aug, x_host, y_host), steps, warmup=1)
    batched = _augmenter(0, True, batched=True)
    device_augment_s = median_seconds(lambda: batched(x, y), steps, warmup=1)
    return {"precision": precision, "plain_s_per_step": plain_s, "dp_s_per_step": dp_s,
            "plain_samples_per_s": batch / plain_s, "dp_samples_per_s": batch / dp_s, "dp_over_plain": dp_s / plain_s,
            "host_augment_s_per_batch": augment_s, "augment_over_plain_step": augment_s / plain_s,
            "device_augment_s_per_batch": device_augment_s, "device_augment_over_plain_step": device_augment_s / plain_s}


def bench_pipeline(device, preset: str, grid: int, batch: int, cases: int, epochs: int) -> dict:
    """Seconds per epoch of train_segmentation with augmentation: host augmentation with prefetch off and on
    (same weights), and batched augmentation on the device."""
    from task.learning.networks import build_unet
    from task.learning.compute import Compute
    from task.learning.training import TrainConfig, train_segmentation

    rng = np.random.default_rng(0)
    images = rng.normal(size=(cases, 4, grid, grid, grid)).astype(np.float32)
    labels = (images[:, 0] > 0.5).astype(np.int64) + (images[:, 1] > 1.2).astype(np.int64)
    out, weights = {}, {}
    variants = {"prefetch_off": ("host", False), "prefetch_on": ("host", True), "device_augment": ("device", False)}
    for name in list(variants) * 2:   # interleaved: drift on a shared machine hits every variant alike
        augment_on, prefetch = variants[name]
        torch.manual_seed(0)
        config = TrainConfig(epochs=epochs, batch_size=batch, learning_rate=1e-3, seed=0, augment=True,
                             prefetch=prefetch, augment_on=augment_on, compute=Compute(device=device, progress=False))
        start = time.perf_counter()
        model = train_segmentation(build_unet(preset), images, labels, config).model
        out.setdefault(f"{name}_s_per_epoch", []).append((time.perf_counter() - start) / epochs)
        if augment_on == "host":
            weights.setdefault(name, []).append({k: v.detach().cpu() for k, v in model.state_dict().items()})
    result = {k: min(v) for k, v in out.items()}
    result["prefetch_speedup"] = result["prefetch_off_s_per_epoch"] / result["prefetch_on_s_per_epoch"]
    # Two runs without prefetching first: on a GPU, cuDNN's non-deterministic kernels can make them differ, and then
    # a difference between prefetching off and on says nothing about prefetching (use --deterministic).
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    result["same_weights_repeat"] = same(*weights["prefetch_off"])
    result["same_weights"] = all(same(weights["prefetch_off"][0], w) for w in weights["prefetch_on"])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (default) | cpu | cuda | cuda:N")
    parser.add_argument("--precision", default="32,bf16", help="comma-separated: 32, bf16 (default both)")
    parser.add_argument("--preset", default=None, help="task.learning.networks preset (default: paper on CUDA, small on CPU)")
    parser.add_argument("--grid", type=int, default=None, help="grid side (default: 64 on CUDA, 32 on CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--pipeline", action="store_true",
                        help="also time training epochs with augmentation, prefetch off vs on")
    parser.add_argument("--cases", type=int, default=8, help="--pipeline: training volumes")
    parser.add_argument("--epochs", type=int, default=1, help="--pipeline: epochs per timing")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (torch.use_deterministic_algorithms), for the same-weights check")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # cuBLAS' condition for determinism
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False

    import warnings

    warnings.filterwarnings("ignore")
    from task.learning.device import check_precision, device_name, resolve_device

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    preset = args.preset or ("paper" if cuda else "small")
    grid = args.grid or (64 if cuda else 32)
    report = {"device": device_name(device), "torch": torch.__version__, "preset": preset, "grid": grid,
              "batch": args.batch, "threads": torch.get_num_threads(), "steps": []}
    print(f"device {report['device']}, torch {torch.__version__}, U-Net {preset} at {grid}^3, batch {args.batch}, "
          f"{report['threads']} CPU threads")
    for precision in [check_precision(p) for p in args.precision.split(",") if p.strip()]:
        row = bench_steps(device, precision, preset, grid, args.batch, args.steps)
        report["steps"].append(row)
        print(f"precision {precision:>4}: plain {row['plain_s_per_step']:.4f} s/step ({row['plain_samples_per_s']:.2f} "
              f"samples/s), DP-SGD {row['dp_s_per_step']:.4f} s/step ({row['dp_samples_per_s']:.2f} samples/s), "
              f"DP/plain x{row['dp_over_plain']:.2f}; host augmentation {row['host_augment_s_per_batch']:.4f} s/batch "
              f"= x{row['augment_over_plain_step']:.2f} the plain step, batched on the device "
              f"{row['device_augment_s_per_batch']:.4f} s/batch = x{row['device_augment_over_plain_step']:.2f}")
    if len(report["steps"]) > 1:
        base = report["steps"][0]
        for row in report["steps"][1:]:
            print(f"{row['precision']} over {base['precision']}: plain x{row['plain_s_per_step'] / base['plain_s_per_step']:.2f}, "
                  f"DP-SGD x{row['dp_s_per_step'] / base['dp_s_per_step']:.2f} (time; < 1 is faster)")
    if args.pipeline:
        row = bench_pipeline(device, preset, grid, args.batch, args.cases, args.epochs)
        report["pipeline"] = row
        print(f"training epoch with augmentation ({args.cases} volumes): host augmentation, prefetch off "
              f"{row['prefetch_off_s_per_epoch']:.2f} s, on {row['prefetch_on_s_per_epoch']:.2f} s "
              f"(x{row['prefetch_speedup']:.2f}; same weights: {row['same_weights']}, two runs without prefetching alike: "
              f"{row['same_weights_repeat']}); batched on the device "
              f"{row['device_augment_s_per_epoch']:.2f} s (x{row['prefetch_off_s_per_epoch'] / row['device_augment_s_per_epoch']:.2f})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
