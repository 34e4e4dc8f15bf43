"""Host time a DP-SGD step spends on its Gaussian noise, on the training thread (the critical path), for the paper
U-Net's parameters (2.45 M weights in 48 tensors), before and after the noise left the critical path.

    .venv/bin/python benchmarks/bench_dp_noise.py [--preset paper] [--steps 12] [--gap-ms 150] [--threads 2]

No network runs: each step hands ``add_noise`` a fresh zero clipped-gradient sum per parameter tensor, as Opacus
does, and the time between two steps (the forward and backward passes, on a GPU the host waiting for its kernels)
is a sleep of ``--gap-ms`` that leaves the interpreter lock free. Measured in one run, interleaved:

* ``before``: the previous wiring -- one draw per parameter tensor on the training thread, from the OS CSPRNG
  (53-bit uniforms through the float64 inverse normal CDF), then one copy per tensor;
* ``before-seeded``: the same with a seeded PCG64 stream (``--reproducible-noise``);
* ``after``: ``task.learning.dpsgd.StepNoise`` -- one flat float32 buffer per step, Box-Muller on the CSPRNG's bytes,
  drawn a step ahead on its own thread; the training thread only takes it and adds it (one fused add);
* ``after, no gap``: the same with no time between steps, so the draw itself is on the critical path (the
  floor when a step is shorter than the draw);
* ``torch.randn``: Opacus' own noise from a ``torch.Generator`` (not usable here: a seeded, predictable
  generator), the reference the secure draw is compared with.

Prints, per step on the training thread (median), its wall time (waiting for the draw included) and its own CPU\ntime -- the figure that carries to a loaded or faster host -- and the drawing thread's own time per buffer.
Timings on a shared 2-core CPU swing by +-30% between runs: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch


def _fresh_sums(params) -> None:
    for p in params:
        p.summed_grad = torch.zeros_like(p)


def _previous_add_noise(optimizer, stream) -> None:
    """The wiring before the noise left the critical path: a float64 host draw per tensor, then a copy each."""
    std = float(optimizer.noise_multiplier) * float(optimizer.max_grad_norm)
    for p in optimizer.params:
        noise = std * stream.standard_normal(tuple(p.summed_grad.shape))
        p.grad = (p.summed_grad + torch.from_numpy(noise).to(device=p.summed_grad.device,
                                                              dtype=torch.float32)).view_as(p)


def _previous_secure_normal(shape):
    """The secure sampler before Box-Muller: 53-bit uniforms from os.urandom through scipy's ndtri."""
    import secrets

    from scipy import special

    size = int(np.prod(shape, dtype=np.int64))
    raw = np.frombuffer(secrets.token_bytes(8 * size), dtype=np.uint64) >> np.uint64(11)
    return special.ndtri((raw.astype(np.float64) + 0.5) / float(2 ** 53)).reshape(shape)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--gap-ms", type=float, default=150.0, help="time between two steps' noise (the pass)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from privacy.mechanisms import NoiseSource
    from task.learning.dpsgd import StepNoise, _install_stream_noise
    from task.learning.networks import build_unet

    params = [p for p in build_unet(args.preset).parameters()]
    size = sum(p.numel() for p in params)
    gap = args.gap_ms / 1e3

    def optimizer():
        return SimpleNamespace(params=params, noise_multiplier=6 ** 0.5, max_grad_norm=4.0 * len(params) ** 0.5)

    def before(stream):
        opt = optimizer()

        def step():
            _previous_add_noise(opt, stream)
        return step, None

    def after(stream):
        opt = optimizer()
        session = SimpleNamespace(step_noise=StepNoise(stream, steps=10 ** 9, size=size, device="cpu", workers=1))
        _install_stream_noise(opt, session)
        return opt.add_noise, session.step_noise

    def randn():
        opt = optimizer()

        def step():
            std = float(opt.noise_multiplier) * float(opt.max_grad_norm)
            for p in opt.params:
                p.grad = (p.summed_grad + torch.normal(0.0, std, p.summed_grad.shape)).view_as(p)
        return step, None

    secure_before = SimpleNamespace(standard_normal=_previous_secure_normal)
    variants = {
        "before (secure, per tensor)": (lambda: before(secure_before), gap),
        "before-seeded (PCG64, per tensor)": (lambda: before(NoiseSource.reproducible(0).generator("bench")), gap),
        "after (secure, a step ahead)": (lambda: after(NoiseSource().generator("bench")), gap),
        "after, no gap (draw on the path)": (lambda: after(NoiseSource().generator("bench")), 0.0),
        "torch.randn (Opacus' generator)": (randn, gap),
    }
    critical = {name: [] for name in variants}
    busy = {name: [] for name in variants}
    for _ in range(3):   # interleaved rounds: load from other users hits every variant alike
        for name, (make, pause) in variants.items():
            step, noise = make()
            for index in range(max(2, args.steps // 3) + 1):
                _fresh_sums(params)
                time.sleep(pause)          # the forward and backward passes
                started, cpu = time.perf_counter(), time.thread_time()
                step()
                if index:                  # the first step of a fresh source warms it up
                    critical[name].append(time.perf_counter() - started)
                    busy[name].append(time.thread_time() - cpu)
            if noise is not None:
                noise.close()

    draw = StepNoise(NoiseSource().generator("bench"), steps=1, size=size, device="cpu")
    thread_started = time.thread_time()
    draw_wall = time.perf_counter()
    draw._draw()
    draw_ms = (time.perf_counter() - draw_wall) * 1e3
    draw_cpu_ms = (time.thread_time() - thread_started) * 1e3
    draw.close()

    print(f"U-Net {args.preset}: {size} noised weights in {len(params)} tensors; {args.gap_ms:g} ms between steps; "
          f"{args.threads} torch threads")
    print("per step on the training thread (median): wall ms (waiting included), its own CPU ms")
    base = statistics.median(critical["before (secure, per tensor)"])
    base_cpu = statistics.median(busy["before (secure, per tensor)"])
    for name, times in critical.items():
        ms, cpu = statistics.median(times), statistics.median(busy[name])
        print(f"  {name:36s} {ms * 1e3:8.1f} ms wall (x{ms / base:.3f})   {cpu * 1e3:8.1f} ms CPU (x{cpu / base_cpu:.3f})")
    print(f"the secure draw itself (one flat float32 buffer): {draw_ms:.1f} ms wall, {draw_cpu_ms:.1f} ms CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
