"""DP-SGD step time over the plain step time, for Opacus' hooks and functorch modes, measured in one run.

    .venv/bin/python benchmarks/bench_dpsgd.py [--grid 32] [--preset small] [--batch 2] [--steps 6]

Also the cost of where the noise comes from: fedpate draws DP-SGD noise from a
``privacy.mechanisms.NoiseSource`` stream instead of Opacus' torch generator -- the OS's CSPRNG by default
(``secure``), a seeded PCG64 stream only with ``--reproducible-noise`` (``seeded``) -- compared with
Opacus' own ``torch.Generator`` noise (``torch-rng``), all functorch, in the same run.

Same network (``task.learning.networks`` preset), same per-sample Dice+CE loss (``task.learning.training.per_sample_loss``),
Adam, per-layer clipping at 4 and sigma = sqrt 6 (Fay et al. Sec. 5). Prints median seconds per step and
the ratios DP/plain; also checks that both modes give the same clipped gradient sum (max abs difference).
Timings on a shared 2-core CPU swing by +-30% between runs: only the ratios of one run mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _time_steps(step, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=32)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import warnings

    warnings.filterwarnings("ignore")
    from opacus import GradSampleModule
    from opacus.optimizers import DPPerLayerOptimizer

    from task.learning.networks import build_unet
    from task.learning.training import per_sample_loss

    g = args.grid
    x = torch.randn(args.batch, 4, g, g, g, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 4, (args.batch, g, g, g), generator=torch.Generator().manual_seed(1))

    def plain():
        torch.manual_seed(0)
        model = build_unet(args.preset)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            per_sample_loss(model(x), y).mean().backward()
            opt.step()
        return step

    def private(mode):
        torch.manual_seed(0)
        model = GradSampleModule(build_unet(args.preset), force_functorch=(mode == "functorch"))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = DPPerLayerOptimizer(torch.optim.Adam(params, lr=1e-3), noise_multiplier=6 ** 0.5,
                                  max_grad_norm=[4.0] * len(params), expected_batch_size=args.batch)

        def step():
            opt.zero_grad()
            per_sample_loss(model(x), y).mean().backward()
            opt.step()
        return step, model, opt

    def clipped_sum(mode):
        torch.manual_seed(0)
        model = GradSampleModule(build_unet(args.preset), force_functorch=(mode == "functorch"))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = DPPerLayerOptimizer(torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0,
                                  max_grad_norm=[4.0] * len(params), expected_batch_size=args.batch)
        opt.zero_grad()
        per_sample_loss(model(x), y).mean().backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in params])

    def noise_from(source):
        """functorch DP step whose noise comes from a NoiseSource stream (task.learning.dpsgd's own wiring)."""
        from types import SimpleNamespace

        from privacy.mechanisms import NoiseSource
        from task.learning.dpsgd import StepNoise, _install_stream_noise

        step, _, opt = private("functorch")
        stream = (NoiseSource() if source == "secure" else NoiseSource.reproducible(0)).generator("bench")
        size = sum(p.numel() for p in opt.params)
        # the session's wiring: one flat buffer per step, drawn a step ahead on its own thread
        _install_stream_noise(opt, SimpleNamespace(step_noise=StepNoise(stream, steps=10 ** 9, size=size,
                                                                         device="cpu")))
        return step

    diff = float((clipped_sum("hooks") - clipped_sum("functorch")).abs().max())
    # Interleave the measurements so that load from other users hits all three alike.
    results = {"plain": [], "hooks": [], "functorch": [], "secure": [], "seeded": []}
    steppers = {"plain": plain(), "hooks": private("hooks")[0], "functorch": private("functorch")[0],
                "secure": noise_from("secure"), "seeded": noise_from("seeded")}
    for _ in range(3):
        for name, step in steppers.items():
            results[name].append(_time_steps(step, max(1, args.steps // 3), warmup=1))
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"UNet {args.preset}, grid {g}^3, batch {args.batch}, {args.threads} threads, per-layer clip 4, sigma sqrt6")
    print(f"plain step      {med['plain']:.3f} s")
    for mode in ("hooks", "functorch"):
        print(f"dp-sgd {mode:9s} {med[mode]:.3f} s   ratio x{med[mode] / med['plain']:.2f}")
    parameters = sum(p.numel() for p in build_unet(args.preset).parameters())
    print(f"noise source (functorch, {parameters} noised parameters per step):")
    print(f"  torch-rng (Opacus' generator)   {med['functorch']:.3f} s")
    for name, label in (("secure", "secure (OS CSPRNG, default)"), ("seeded", "seeded PCG64 (simulation)")):
        extra = med[name] - med["functorch"]
        print(f"  {label:31s} {med[name]:.3f} s   x{med[name] / med['functorch']:.2f} of torch-rng "
              f"({extra * 1e3:+.1f} ms per step)")
    best = min(("hooks", "functorch"), key=lambda m: med[m])
    print(f"max |clipped-sum(hooks) - clipped-sum(functorch)| = {diff:.2e}")
    print(f"fastest correct mode: {best}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
