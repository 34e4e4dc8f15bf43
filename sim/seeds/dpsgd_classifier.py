"""DP-SGD for the small classifiers (Abadi et al. 2016 via Opacus), constant or with a Yu et al. schedule.

* Poisson sampling (Opacus ``poisson_sampling=True``), per-sample clipping to ``max_grad_norm``, Gaussian
  noise ``z·C``; the planned run (``SampledGaussianEvent(q, z, steps)``, or one such event per epoch for a
  schedule) is charged through the budget guard *before* training starts (add/remove-one, PLD — SPEC §6).
* ``schedule="exponential"`` (Yu et al., "Differentially Private Model Publishing for Deep Learning",
  Sec. IV-A-2b: σ_t = σ0·e^{−kt}): σ0 = ``sigma0_factor`` × the constant-noise multiplier for the same
  (ε, δ, epochs), and k is planned with ``privacy.schedules.plan_decay`` so that exactly ``epochs`` epochs
  spend the budget (early epochs noisier, later epochs cleaner).
* ``epsilon=None``: the non-private baseline (same net, same optimiser, no clipping, no noise).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from sim.seeds import SeedResult, accuracy, build_mlp, set_seed

CALIBRATION_MARGIN = 0.995   # calibrate slightly below the budget: the ledger's PLD grid differs from planning's


@dataclass
class DPSGDConfig:
    hidden: tuple[int, ...] = (300,)
    epochs: int = 10
    batch_size: int = 250
    lr: float = 0.05
    momentum: float = 0.9
    max_grad_norm: float = 1.0
    schedule: str | None = None        # None | "exponential"
    sigma0_factor: float = 1.5
    nonprivate_lr: float = 1e-3


def train_dpsgd(task, epsilon: float | None, delta: float, guard, owners, cfg: DPSGDConfig | None = None,
                seed: int = 0, release_prefix: str = "dp-sgd", progress: bool = False) -> SeedResult:
    cfg = cfg or DPSGDConfig()
    set_seed(seed)
    x = torch.as_tensor(np.asarray(task.x_private, np.float32))
    y = torch.as_tensor(np.asarray(task.y_private, np.int64))
    model = build_mlp(x.shape[1], cfg.hidden, task.n_classes)
    dataset = torch.utils.data.TensorDataset(x, y)
    gen = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, generator=gen)
    method = "nonprivate" if epsilon is None else ("dp-sgd-scheduled" if cfg.schedule else "dp-sgd")

    if epsilon is None:
        opt = torch.optim.Adam(model.parameters(), lr=cfg.nonprivate_lr)
        for epoch in range(cfg.epochs):
            model.train()
            for xb, yb in loader:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
        return SeedResult(method=method, accuracy=accuracy(model, task.x_test, task.y_test), epsilon_budget=None,
                          delta=delta, relation=None, details={"epochs": cfg.epochs, "hidden": list(cfg.hidden)},
                          model=model)

    from opacus import PrivacyEngine
    from privacy.calibration import dpsgd_noise_multiplier
    from privacy.events import SampledGaussianEvent

    steps_per_epoch = len(loader)
    q = 1.0 / steps_per_epoch       # Opacus' Poisson sample rate for this loader
    target = epsilon * CALIBRATION_MARGIN
    z_constant = dpsgd_noise_multiplier(target, delta, q, steps_per_epoch * cfg.epochs)
    if cfg.schedule:
        from privacy.schedules import make_schedule, plan_decay

        sigma0 = cfg.sigma0_factor * z_constant
        k = plan_decay(cfg.schedule, sigma0, cfg.epochs, target, delta, sampling_rate=q,
                       steps_per_epoch=steps_per_epoch)
        schedule = make_schedule(cfg.schedule, sigma0, k)
        sigmas = [schedule.sigma(t) for t in range(cfg.epochs)]
    else:
        k, sigmas = None, [z_constant] * cfg.epochs

    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    engine = PrivacyEngine(accountant="prv", secure_mode=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, dp_loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                                    noise_multiplier=sigmas[0], max_grad_norm=cfg.max_grad_norm,
                                                    poisson_sampling=True)
    # The whole planned run is charged once, before any noise is drawn (one guard check instead of one per
    # epoch: each check re-composes the owner's PLD). A schedule is charged as its per-epoch composition.
    if cfg.schedule:
        from privacy.events import ComposedEvent

        event = ComposedEvent(tuple(SampledGaussianEvent(q, s, steps_per_epoch) for s in sigmas))
    else:
        event = SampledGaussianEvent(q, z_constant, steps_per_epoch * cfg.epochs)
    guard.charge(owners, event, release_id=f"{release_prefix}/training",
                 note={"clip": cfg.max_grad_norm, "noise_multipliers": sigmas, "epochs": cfg.epochs})
    for epoch in range(cfg.epochs):
        opt.noise_multiplier = sigmas[epoch]
        model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for xb, yb in dp_loader:
                opt.zero_grad()
                if len(yb) == 0:   # empty Poisson batch: skip the step (releasing nothing is still covered)
                    continue
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
        if progress:
            print(f"  {method} epoch {epoch + 1}/{cfg.epochs} σ={sigmas[epoch]:.3f}: test acc "
                  f"{accuracy(model, task.x_test, task.y_test):.3f}", flush=True)
    return SeedResult(
        method=method, accuracy=accuracy(model, task.x_test, task.y_test), epsilon_budget=epsilon, delta=delta,
        relation="add-remove", sigma=float(np.mean(sigmas)),
        details={"noise_multipliers": sigmas, "decay_k": k, "sampling_rate": q, "steps": steps_per_epoch * cfg.epochs,
                 "epochs": cfg.epochs, "clip": cfg.max_grad_norm, "hidden": list(cfg.hidden),
                 "schedule": cfg.schedule},
        model=model,
    )
