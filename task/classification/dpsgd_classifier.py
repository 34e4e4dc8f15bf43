"""DP-SGD for the small classifiers (Abadi et al. 2016 via Opacus), constant or with a Yu et al. schedule.

Runs on ``task.learning.dpsgd.DPSession``, the segmentation DP-SGD's engine, so both share one implementation of what
the guarantee rests on:

* Poisson sampling of privacy units at rate q = 1 / steps per epoch, per-unit clipping to ``max_grad_norm``
  (flat), Gaussian noise ``z·C`` (add/remove-one unit, sampled Gaussian, PLD). A unit is a record,
  or on the slice task a patient: its slices sit in one row of ``task.classification.padded_units`` and ``unit_loss``
  sums their losses, so Opacus' per-sample gradient is the patient's summed gradient and is clipped as one
  (user-level DP, ``task.classification`` module note).
* Each epoch is charged through the budget guard (``SampledGaussianEvent(q, z_e, steps)``, release
  ``<prefix>:epoch-e``) *before* its stream is opened; the epoch's Poisson masks and noise both come from
  that stream of the ``NoiseSource`` (secure unless a simulation asks for reproducible noise), never from
  the training seed.
* An empty Poisson batch takes a noise-only step: the sampled-Gaussian analysis (Abadi et al. 2016,
  Theorem 1: each of the T steps is a subsampled Gaussian release) assumes every step releases noise;
  skipping it would release less than was accounted *and* reveal that the batch was empty.
* ``schedule="exp"`` (Yu et al., "Differentially Private Model Publishing for Deep Learning",
  2019, arXiv 1904.02200, Sec. IV-A-2b: σ_t = σ0·e^{−kt}): σ0 = ``sigma0_factor`` × the constant-noise
  multiplier for the same (ε, δ, epochs), and k is planned (``privacy.schedules.plan_decay``) so that exactly
  ``epochs`` epochs spend the budget (early epochs noisier, later epochs cleaner).
* ``epsilon=None``: the non-private baseline (same net, same optimiser, no clipping, no noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from privacy.calibration import dpsgd_noise_multiplier
from task.classification import (PlainTraining, SeedResult, SeedRun, accuracy, build_mlp, padded_units, set_seed,
                                 train_nonprivate)
from task.errors import UserError
from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining, steps_per_epoch
from task.options import Relation, Sampling

CALIBRATION_MARGIN = 0.995   # calibrate slightly below the budget: the ledger's PLD grid differs from planning's


#: One relation for every method of a comparison (docs/PRIVACY.md): replace-one, the only one that holds
#: once dataset sizes are published (the task summary publishes them).
RELATION = Relation.REPLACE_ONE


@dataclass(frozen=True)
class DPSGDConfig:
    """The classification benchmark's DP-SGD baseline: its network (``hidden``), its optimiser (SGD with momentum)
    and its training, with DP-SGD's clip and schedule (``sigma0_factor`` × the constant noise for the same budget).

    Layer: a benchmark's own settings, not a preset's (the segmentation presets' DP-SGD is
    ``task.settings.presets.DpSgd``); :func:`_dp_config` turns it and the seed run's budget into the validated training
    record ``task.learning.dpsgd.DPConfig``."""

    hidden: tuple[int, ...] = (300,)
    epochs: int = 10
    batch_size: int = 250              # expected Poisson batch in units (records, or patients on the slice task)
    lr: float = 0.05
    momentum: float = 0.9
    max_grad_norm: float = 1.0
    schedule: str | None = None        # None | a task.learning.dpsgd family: "exp" (Yu et al. Sec. IV-A-2b), time, step, poly
    sigma0_factor: float = 1.5
    nonprivate_lr: float = 1e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(self.hidden))
        if self.epochs < 1 or self.batch_size < 1:
            raise UserError(f"dp-sgd: expected epochs >= 1 and a positive batch size, got {self.epochs}, "
                            f"{self.batch_size}")
        if not self.max_grad_norm > 0:
            raise UserError(f"dp-sgd: max_grad_norm must be positive, got {self.max_grad_norm}")


def unit_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over each unit's records (``mask`` drops padding), averaged over the batch's units.

    Opacus (``loss_reduction="mean"``) turns row i's gradient of this into unit i's per-sample gradient: the
    gradient of the unit's *summed* loss, which it then clips to C."""
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (ce.view_as(mask) * mask).sum(dim=1).mean()


def train_dpsgd(run: SeedRun, cfg: DPSGDConfig | None = None) -> SeedResult:
    """DP-SGD (or, without a budget, plain Adam) on the pooled private records, sampled and clipped per privacy
    unit (``task.unit_records()``).

    Args:
        run: the task (its pooled private records), the budget (calibrated to ``CALIBRATION_MARGIN`` of it; None =
            the non-private baseline: plain Adam, no clipping, no noise, nothing charged), the guard and owners
            every epoch is charged to before its stream is opened, ``run.seed`` (initialises the network and,
            without a budget, the batch order; DP-SGD's batches and noise come from ``run.noise``, secure when
            None, never from the seed), the prefix of the epochs' release ids (``<prefix>:epoch-e``; default
            ``dp-sgd``) and ``run.progress`` (σ and the test accuracy after every epoch, DP-SGD only).
        cfg: the network, training and schedule settings (None = :class:`DPSGDConfig`'s defaults).
    """
    cfg = cfg or DPSGDConfig()
    task = run.task
    set_seed(run.seed)
    x = torch.as_tensor(np.asarray(task.x_private, np.float32))
    y = torch.as_tensor(np.asarray(task.y_private, np.int64))
    model = build_mlp(x.shape[1], cfg.hidden, task.n_classes)
    if not run.private:
        return _train_nonprivate_baseline(run, cfg, model, x, y)
    method = "dp-sgd-scheduled" if cfg.schedule else "dp-sgd"
    units = task.unit_records()
    xu, yu, mask = padded_units(x.numpy(), y.numpy(), units)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    private = PrivateTraining(_dp_config(run, cfg, len(units)), run.guard, run.owners, run.noise)
    session = DPSession(model, opt, private, n=len(units), batch_size=cfg.batch_size, epochs=cfg.epochs)
    empty = 0
    for epoch in range(cfg.epochs):
        if not session.begin_epoch(epoch):      # charged before the epoch's stream is opened
            break
        session.model.train()
        for idx in session.batches():
            if len(idx) == 0:
                empty += 1
                session.noise_only_step()
                continue
            session.optimizer.zero_grad(set_to_none=True)
            unit_loss(session.model(xu[idx]), yu[idx], mask[idx]).backward()
            session.optimizer.step()
        if run.progress:
            print(f"  {method} epoch {epoch + 1}/{cfg.epochs} σ={session.sigmas[-1]:.3f}: test acc "
                  f"{accuracy(session.model, task.x_test, task.y_test):.3f}", flush=True)
    sigmas = list(session.sigmas)
    return SeedResult(
        method=method, accuracy=accuracy(session.model, task.x_test, task.y_test), epsilon_budget=run.epsilon,
        delta=run.delta, relation=RELATION, sigma=float(np.mean(sigmas)),
        details={"noise_multipliers": sigmas, "decay_k": getattr(session.schedule, "k", None),
                 "sampling_rate": session.sampling_rate, "steps": session.steps * len(sigmas),
                 "empty_batches": empty, "epochs": len(sigmas), "clip": cfg.max_grad_norm,
                 "privacy_unit": task.privacy_unit, "units": len(units),
                 "hidden": list(cfg.hidden), "schedule": cfg.schedule, "stopped_reason": session.stopped_reason},
        model=session.model,
    )


def _dp_config(run: SeedRun, cfg: DPSGDConfig, units: int) -> DPConfig:
    """The DP-SGD engine's settings: calibrated to ``CALIBRATION_MARGIN`` of the budget, constant noise, or a
    schedule starting at ``sigma0_factor`` × the constant multiplier for the same (ε, δ, epochs)."""
    target = run.epsilon * CALIBRATION_MARGIN
    common = dict(epsilon=target, delta=run.delta, max_grad_norm=cfg.max_grad_norm, per_layer=False,
                  relation=RELATION, sampling=Sampling.POISSON, release_prefix=run.prefix("dp-sgd"),
                  target_epochs=cfg.epochs,
                  grad_sample_mode="hooks")   # an einsum per Linear: faster than functorch for these MLPs
    if not cfg.schedule:
        return DPConfig(mode="target", **common)
    steps = steps_per_epoch(units, cfg.batch_size)
    z_constant = dpsgd_noise_multiplier(target, run.delta, 1.0 / steps, steps * cfg.epochs, relation=RELATION)
    return DPConfig(mode="schedule", schedule=cfg.schedule, noise_multiplier=cfg.sigma0_factor * z_constant, **common)


def _train_nonprivate_baseline(run: SeedRun, cfg: DPSGDConfig, model, x: torch.Tensor, y: torch.Tensor) -> SeedResult:
    """The non-private baseline: the same net, plain Adam, no clipping, no noise, nothing charged."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=cfg.batch_size,
                                         shuffle=True, generator=torch.Generator().manual_seed(run.seed))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.nonprivate_lr)
    for epoch in range(cfg.epochs):
        model.train()
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return SeedResult(method="nonprivate", accuracy=accuracy(model, run.task.x_test, run.task.y_test),
                      epsilon_budget=None, delta=run.delta, relation=None,
                      details={"epochs": cfg.epochs, "hidden": list(cfg.hidden)}, model=model)


def train_public_only(task, cfg: DPSGDConfig, steps: int, batch_size: int, seed: int = 0) -> SeedResult:
    """The public-only floor: the non-private cell's network (``cfg.hidden``) and optimiser (Adam at
    ``cfg.nonprivate_lr``) trained on the task's public labelled reference records alone, for ``steps`` Adam
    steps of ``batch_size`` records (the caller passes the non-private cell's step count, so the two differ
    only in their data). No private record is read, nothing is charged; a private method is worth its noise
    only where it beats this row.

    Args:
        task: the :class:`task.classification.tasks.ClassificationTask` (its ``x_reference``/``y_reference``).
        cfg: the non-private cell's settings (network width, learning rate).
        steps: Adam steps (rounded up to whole passes over the reference set).
        batch_size: records per step.
        seed: initialisation and batch order.
    """
    if len(task.y_reference) == 0:
        raise UserError("public-only: the task has no public labelled reference records")
    n = len(task.y_reference)
    batch_size = max(1, min(batch_size, n))
    epochs = max(1, -(-steps // -(-n // batch_size)))     # ceil(steps / steps per pass)
    model = train_nonprivate(task.x_reference, task.y_reference, task.n_classes,
                             PlainTraining(hidden=cfg.hidden, epochs=epochs, batch_size=batch_size,
                                           lr=cfg.nonprivate_lr), seed=seed)
    return SeedResult(method="public-only", accuracy=accuracy(model, task.x_test, task.y_test), epsilon_budget=None,
                      delta=0.0, relation=None,
                      details={"epochs": epochs, "steps": epochs * -(-n // batch_size), "batch_size": batch_size,
                               "hidden": list(cfg.hidden), "reference_records": n},
                      model=model)
