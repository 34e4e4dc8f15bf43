"""DP-SGD for the segmentation networks: Opacus per-sample clipping and noise, accounting via privacy/.

What is private (docs/PRIVACY.md): one patient volume, under the neighbouring relation
``DPConfig.relation``: **replace-one** by default -- the only relation that holds when dataset sizes are
published (FedAvg weights, ``train_cases`` in results) and the one comparisons with PATE use -- or
add/remove-one for standalone runs whose dataset sizes stay private (zero-out for shuffled batches, see
below). Every epoch is charged to the data owners' ledger through ``privacy.guard.BudgetGuard.charge``
*before* the epoch's batches are drawn, so a refused budget stops training before any data is touched.
Every epsilon this module reports comes from ``ledger.spent(owner, delta)``; ``DPSession.spent`` also
gives the same mechanism's epsilon under the other relation where it is defined (Poisson sampling), so
reports can print both.

Mechanism (Abadi et al. 2016, arXiv 1607.00133, as used by Fay et al. Sec. 5 "Baseline": "we
clip gradients for each layer at 4 and apply noise with variance sigma^2 = 6"):

* per-sample gradients from Opacus (``GradSampleModule``), clipped either per layer (``per_layer=True``:
  every parameter tensor i to norm C_i = ``max_grad_norm``) or flat (the whole gradient to C);
* Gaussian noise with std ``noise_multiplier * C_total`` on the sum of clipped gradients, where
  ``C_total = sqrt(sum_i C_i^2)`` is the L2 sensitivity of the concatenated gradient (Opacus
  ``DPPerLayerOptimizer`` convention; with flat clipping ``C_total = C``); the sum is then divided by
  the *expected* batch size (``loss_reduction="mean"``), so the noise std on the applied gradient is
  ``noise_multiplier * C_total / expected_batch_size`` (checked by
  ``tests/test_dpsgd_mechanism.py::test_zero_gradient_noise_std``).

Batching and accounting must match (Yu et al. 2019, arXiv 1904.02200, Sec. 4):

* ``sampling="poisson"``: each record joins each step's batch independently with probability q; an epoch
  of T steps is ``SampledGaussianEvent(q, sigma, steps=T, relation=...)``: PLD by default
  (dp_accounting, ``REPLACE_ONE`` or ``ADD_OR_REMOVE_ONE``), RDP also reported under add/remove (dp_accounting
  has no replace-one RDP for Poisson sampling). An
  *empty* Poisson batch still takes a noise-only step (clipped sum = 0, plus noise): that is what the
  sampled-Gaussian analysis assumes, and skipping forward/backward avoids the crash Opacus hits on
  empty inputs.
* Randomness: the Poisson masks (or the shuffle) and the Gaussian noise of epoch e come from the stream
  of a :class:`privacy.mechanisms.NoiseSource` named after the epoch (``<stream prefix>:epoch-e``) and
  opened only after the epoch is charged: the masks from the stream, the noise from a stream spawned from
  it (``NoiseGenerator.spawn``, independent, drawn in its own order). By default both are the
  OS's CSPRNG (Opacus' ``secure_mode`` needs torchcsprng, whose last release predates our torch, so the
  optimizer's ``add_noise`` draws from our stream instead of a ``torch.Generator``); amplification by
  subsampling also needs the batches to be secret, hence the masks come from the same source, never from
  the training seed. Seeded streams only with an explicit reproducible source (simulations). The noise of
  a step is one flat buffer drawn a step ahead on a thread of its own (:class:`StepNoise`), so the host's
  draw overlaps the step before; its stream is its own, so its draws keep their order whatever the
  batches do.
* ``sampling="shuffle"``: a random permutation cut into disjoint batches each epoch; each record is used
  once per epoch, so an epoch is ``Delta^2/(2 sigma^2 C^2)``-zCDP (Yu et al., Theorem 3 + parallel
  composition) with Delta = 2C under replace-one (``2/sigma^2``) and Delta = C under zero-out adjacency
  (``1/(2 sigma^2)``, Yu et al.'s figure); add/remove has no analysis here (removing a record shifts the
  batches). Charged only as ``ZCDPEvent.shuffled_epochs(sigma, 1, relation)`` -- never as a Poisson event.

Noise modes:

* ``"target"``: sigma calibrated so the planned epochs spend exactly the target epsilon
  (``privacy.calibration.dpsgd_noise_multiplier`` / ``shuffled_noise_multiplier``);
* ``"fixed"``: the given sigma (the caller's: the preset's ``dp_sgd.noise_multiplier``, the paper's sqrt 6,
  unless the run sets one); training stops before the first epoch that would exceed the budget;
* ``"schedule"``: sigma_t from a Yu et al. dynamic schedule (``privacy.schedules``: time, exp, step, poly,
  validation; Sec. 5 eq. 9-13), changed per epoch on the optimizer; training stops exactly when the
  next epoch would exceed the budget. The validation-based schedule needs a *public* validation set.

The validation-based schedule chooses sigma_t from earlier outputs (the validation score of the model
trained so far) and stops adaptively, so its epochs are not a composition of mechanisms fixed in advance:
they are charged with ``adaptive=True``, and the ledger then accounts the owner with a *privacy filter*
(``privacy.accountants.accountant_for``): a Renyi filter (``rdp-filter``; Feldman & Zrnic 2021) for Poisson
sampling under add/remove, zCDP (``zcdp``, a Renyi filter at every order) for shuffled epochs. The budget
guard's check uses the same accountant, so its refusal is the filter's stopping rule and the run is
(budget, delta)-DP. PLD is not valid here; dp_accounting has no replace-one RDP for Poisson sampling, so
``schedule="validation"`` with Poisson sampling under replace-one is refused (use shuffled batches, or
add/remove). The validation set is public: its scores are post-processing and cost no privacy.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from privacy import calibration, schedules
from privacy.errors import BudgetExceeded
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from privacy.options import Relation, Sampling, ScheduleFamily
from privacy.schedules import epoch_event
from task.learning import accounting
from task.learning.accounting import memoised_epsilon_spent, memoised_per_relation
from task.errors import UserError
from task.learning.phases import phase, timed
from task.options import CalibrationAccountant, GradSampleMode, NoiseMode, look_up_option

#: Default Opacus per-sample gradient engine, chosen with ``benchmarks/bench_dpsgd.py`` (small UNet, 32^3,
#: batch 2): DP/plain step time hooks x2.76 vs functorch x2.49 (quiet machine), x6.2 vs x3.6 (loaded);
#: their clipped gradient sums agree to 7e-9.
DEFAULT_GRAD_SAMPLE_MODE = GradSampleMode.FUNCTORCH

#: the schedule families by the short names the CLI offers (``--schedule``); the full names are accepted too
SCHEDULE_FAMILIES = ("time", "exp", "step", "poly", "validation")
SCHEDULE_ALIASES = {"exp": ScheduleFamily.EXPONENTIAL, "poly": ScheduleFamily.POLYNOMIAL}

#: Neighbouring relations each batching method is accounted under (privacy.events module docstring).
RELATIONS_FOR_SAMPLING = {Sampling.POISSON: (Relation.REPLACE_ONE, Relation.ADD_REMOVE),
                          Sampling.SHUFFLE: (Relation.REPLACE_ONE, Relation.ZERO_OUT)}


def schedule_family(name) -> ScheduleFamily:
    """The :class:`privacy.options.ScheduleFamily` a ``--schedule`` value names (a short name of
    :data:`SCHEDULE_FAMILIES` or a full one), or a one-line error listing the families."""
    return look_up_option(SCHEDULE_ALIASES.get(name, name), ScheduleFamily, "--schedule")

# Known, harmless Opacus/torch messages that would otherwise print on every run: Opacus' secure_mode is off
# because the noise comes from privacy.mechanisms.NoiseSource (secure by default), and the full-backward-hook note
# fires because the network's *inputs* (scans) never require gradients.
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


@dataclass(frozen=True)
class DPConfig:
    """The training's validated DP-SGD record: what one DP-SGD session runs (docs/ARCHITECTURE.md, "sim training
    engine"). Frozen, and validated and normalised when built (``__post_init__``: the options as their enums, a
    combination the accounting cannot cover refused in one line), so every DPConfig that exists is one a session
    can run; ``dataclasses.replace`` builds a changed one, validated again. The budget, its delta and the clipping
    norm are always the caller's (the run's budget, the preset's delta and clip): this record has no defaults for
    them.

    The other DP-SGD records sit above it: :class:`task.settings.presets.DpSgd` and :class:`task.settings.presets.DpSetting` are the
    preset's recipe and its grid entries, ``sim.runners.central.DPSGDOptions`` the command line's options of one
    pooled run, ``task.classification.dpsgd_classifier.DPSGDConfig`` the classification benchmark's settings; each
    is turned into a DPConfig where training starts."""

    mode: NoiseMode = NoiseMode.TARGET   # "target" | "fixed" | "schedule"
    epsilon: float = field(kw_only=True)   # budget per owner
    delta: float = field(kw_only=True)
    noise_multiplier: float | None = None  # fixed mode sigma; schedule mode sigma_0 (the caller's: no default)
    max_grad_norm: float = field(kw_only=True)   # per parameter tensor when per_layer, else of the whole gradient
    per_layer: bool = True
    sampling: Sampling = Sampling.POISSON  # "poisson" | "shuffle"
    #: calibration accountant for Poisson events ("pld" | "rdp"; rdp: add-remove only)
    accountant: CalibrationAccountant = CalibrationAccountant.PLD
    relation: Relation = Relation.REPLACE_ONE  # "replace-one" | "add-remove" (Poisson) | "zero-out" (shuffle)
    schedule: str | None = None          # family for mode="schedule"
    schedule_options: dict = field(default_factory=dict)  # extra kwargs for the schedule / plan_decay
    grad_sample_mode: GradSampleMode = DEFAULT_GRAD_SAMPLE_MODE   # "hooks" | "functorch"
    release_prefix: str = "dpsgd"        # ledger release ids: f"{release_prefix}:epoch-{e}" (unique per model!)
    #: noise stream names f"{stream_prefix}:epoch-{e}" under the session's NoiseSource (default: the release
    #: prefix). Without the per-run nonce release ids carry, so that reproducible noise repeats across runs.
    stream_prefix: str | None = None
    target_epochs: int | None = None     # planning horizon for target/schedule (default: the training epochs)

    def __post_init__(self) -> None:
        _normalise = functools.partial(object.__setattr__, self)
        _normalise("mode", look_up_option(self.mode, NoiseMode, "--noise-mode"))
        _normalise("sampling", look_up_option(self.sampling, Sampling, "--sampling"))
        _normalise("relation", look_up_option(self.relation, Relation, "--relation"))
        _normalise("schedule_options", dict(self.schedule_options or {}))
        if not (self.epsilon and self.epsilon > 0):
            raise UserError(f"--epsilon: expected a positive number, got {self.epsilon!r}")
        if not (0 < self.delta < 1):
            raise UserError(f"--delta: expected 0 < delta < 1, got {self.delta!r}")
        if self.max_grad_norm <= 0:
            raise UserError(f"max_grad_norm: expected > 0, got {self.max_grad_norm!r}")
        if self.noise_multiplier is not None and self.noise_multiplier <= 0:
            raise UserError(f"noise_multiplier: expected > 0, got {self.noise_multiplier!r}")
        if self.mode is NoiseMode.SCHEDULE:
            schedule_family(self.schedule)
        _normalise("grad_sample_mode", look_up_option(self.grad_sample_mode, GradSampleMode, "grad_sample_mode"))
        relations = RELATIONS_FOR_SAMPLING[self.sampling]
        if self.relation not in relations:
            why = (" (shuffled batches have no add/remove analysis: removing a record shifts the batches; Yu et al.'s "
                   "1/(2 sigma^2) per epoch is for zero-out adjacency)" if self.sampling is Sampling.SHUFFLE else "")
            raise UserError(f"--relation: expected one of {', '.join(relations)} with --sampling {self.sampling}, "
                            f"got {self.relation!r}{why}")
        _normalise("accountant", look_up_option(self.accountant, CalibrationAccountant, "accountant"))
        if (self.sampling is Sampling.POISSON and self.relation is Relation.REPLACE_ONE
                and self.accountant is not CalibrationAccountant.PLD):
            raise UserError("accountant: replace-one Poisson-sampled DP-SGD is accounted with pld only "
                            "(dp_accounting has no replace-one RDP for Poisson sampling)")
        if self.adaptive and self.sampling is Sampling.POISSON and self.relation is Relation.REPLACE_ONE:
            raise UserError("--schedule validation chooses sigma from earlier outputs, so it needs a privacy filter "
                            "(Feldman & Zrnic 2021); PLD is not valid under adaptive choices and dp_accounting has no "
                            "replace-one RDP for Poisson sampling: use --sampling shuffle (zCDP filter) or "
                            "--relation add-remove (Renyi filter)")
        if self.mode is not NoiseMode.TARGET and self.noise_multiplier is None:
            raise UserError(f"noise_multiplier: --noise-mode {self.mode} needs one (the preset's "
                            "dp_sgd.noise_multiplier or --noise-multiplier); only target mode calibrates its own")

    @property
    def adaptive(self) -> bool:
        """True when sigma_t is chosen from earlier outputs (the validation-based schedule)."""
        family = SCHEDULE_ALIASES.get(self.schedule, self.schedule)
        return self.mode == NoiseMode.SCHEDULE and family == ScheduleFamily.VALIDATION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PrivateTraining:
    """Everything DP-SGD training needs beyond the training settings: what the mechanism is (``dp``), whose
    budget each epoch is charged to (``guard``, ``owners``) and where its batches and noise come from
    (``noise``). ``task.learning.training.train_segmentation`` trains privately when given one, plainly otherwise."""

    dp: DPConfig
    #: the ``privacy.guard.BudgetGuard`` every epoch is charged through (None = an in-memory one with
    #: ``dp.epsilon``)
    guard: Any = None
    owners: tuple[str, ...] = ("central",)   # the ledger owners every epoch is charged to
    #: the ``privacy.mechanisms.NoiseSource`` of the batches and noise (None = a secure one)
    noise: Any = None
    #: also put the comparison figures on the result (RDP's epsilon, the same mechanism's epsilon under the other
    #: relation). Each is composed from the whole ledger afresh (about 1 s a call); a DP-FedAvg hospital's local
    #: round reports only its ledger's epsilon, so it asks for none
    comparison_figures: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.dp, DPConfig):
            raise UserError(f"private training: expected a DPConfig, got {type(self.dp).__name__}")
        object.__setattr__(self, "owners", tuple(self.owners))
        if not self.owners:
            raise UserError("private training: no ledger owner to charge")


def private_training(dp: DPConfig | None, guard: Any = None, owners=("central",),
                     noise: Any = None) -> PrivateTraining | None:
    """:class:`PrivateTraining` for ``dp``, or None (plain training) when there is no ``dp``: what callers whose
    run may or may not be private pass to ``train_segmentation``."""
    return None if dp is None else PrivateTraining(dp, guard, owners, noise)


# ----------------------------------------------------------------------------------------------- batching
def steps_per_epoch(n: int, batch_size: int) -> int:
    """Steps in one epoch; the Poisson rate is q = 1 / steps (Opacus' ``1 / len(data_loader)``)."""
    return max(1, math.ceil(n / batch_size))


def check_first_epoch(dp: "DPConfig", n: int, batch_size: int) -> None:
    """Refuse a fixed or scheduled noise under which not even the first epoch fits the budget (target mode
    calibrates its noise to fit): training would stop before its first step, and the start model would be
    released as DP-SGD's without a single charge -- a card saying it was trained without privacy. The same check
    the budget guard makes when the epoch is charged (:meth:`DPSession.begin_epoch`), made before anything trains.
    """
    if dp.mode is NoiseMode.TARGET:
        return
    steps = steps_per_epoch(int(n), int(batch_size))
    sigma = float(dp.noise_multiplier)   # every schedule starts at sigma_0
    event = _epoch_event(dp, 1.0 / steps, sigma, steps)
    epoch, slack = _epoch_epsilon_estimate(event, dp.delta, steps)
    if epoch <= dp.epsilon:   # an upper bound within the budget: the guard will let the epoch through
        return
    try:
        if epoch - slack <= dp.epsilon:   # near the budget: the guard decides, exactly as it will at the charge
            BudgetGuard(Ledger(None), dp.epsilon, dp.delta).check(["pooled"], event)
            return
        raise BudgetExceeded(f"one epoch costs epsilon {epoch:.3g}")
    except BudgetExceeded:
        raise UserError(f"--noise-multiplier {sigma:g}: one epoch of DP-SGD at this noise costs epsilon {epoch:.3g} "
                        f"(delta {dp.delta:g}, {steps} steps of {int(n)} patients), more than --epsilon "
                        f"{dp.epsilon:g}: no epoch could be trained; raise --noise-multiplier or --epsilon, or use "
                        "--noise-mode target (noise calibrated to the budget)") from None


#: the coarse grid of :func:`_epoch_epsilon_estimate` (the guard's PLD at a small noise and a small budget takes
#: a minute on its fine grid; this one, a second)
COARSE_PLD_GRID = 0.02


def _epoch_epsilon_estimate(event, delta: float, steps: int) -> tuple[float, float]:
    """``(epsilon, slack)`` of one epoch, fast: under PLD (the guard's accountant for Poisson-sampled epochs) on a
    coarse pessimistic grid, an upper bound on the guard's own figure that exceeds it by at most ``slack`` (each
    of the ``steps`` compositions rounds the privacy loss up by less than one grid step); other events through
    the guard's own accountant, exactly (``slack`` 0)."""
    from privacy.accountants import accountant_for, epsilon_spent, make_accountant

    if accountant_for([event]).name != "pld":
        return epsilon_spent([event], delta)[0], 0.0
    coarse = make_accountant("pld", value_discretization_interval=COARSE_PLD_GRID)
    return float(coarse.compose(event).get_epsilon(delta)), (int(steps) + 1) * COARSE_PLD_GRID


def poisson_batches(n: int, sampling_rate: float, steps: int, stream) -> Iterator[torch.Tensor]:
    """``steps`` Poisson-sampled batches: each index joins each batch with prob. q (may be empty).

    ``stream``: a ``privacy.mechanisms.NoiseGenerator`` (secure by default): which records are in a batch
    must stay secret for the amplification by subsampling to hold."""
    for _ in range(steps):
        mask = stream.uniform((n,)) < sampling_rate
        yield torch.from_numpy(np.flatnonzero(mask))


def shuffled_batches(n: int, batch_size: int, stream) -> Iterator[torch.Tensor]:
    """One epoch of disjoint batches from a random permutation (Yu et al.'s "random reshuffling")."""
    order = torch.from_numpy(np.argsort(stream.uniform((n,)), kind="stable"))
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


class StepNoise:
    """One epoch's DP-SGD noise, off the training step's critical path: for every step, one flat float32 buffer of
    standard normals (every noised parameter, in the optimiser's order), drawn one step ahead on a thread of its
    own from the epoch's gradient-noise stream, pinned on a GPU and sent with one non-blocking copy.

    The draws stay in a fixed order -- step 0's buffer, then step 1's, ... on the one drawing thread, each
    started only when the one before was taken -- so a reproducible stream repeats bit for bit. A secure
    stream (the default) may split one buffer between ``workers`` threads: its draws are independent and
    ``os.urandom`` releases the interpreter lock. The stream is opened by ``DPSession.begin_epoch`` after the
    epoch is charged, so nothing is drawn before the ledger holds the epoch; at most ``steps`` buffers are drawn.
    """

    def __init__(self, stream, *, steps: int, size: int, device: torch.device, workers: int = 1) -> None:
        self.stream, self.steps, self.size, self.device = stream, int(steps), int(size), torch.device(device)
        self.workers = max(1, int(workers)) if getattr(stream, "secure", False) else 1
        self.pinned = self.device.type == "cuda"
        self.taken = 0
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="fedpate-dp-noise")
        self._next = self._pool.submit(self._draw) if self.steps > 0 else None

    def _draw(self) -> torch.Tensor:
        host = torch.empty(self.size, dtype=torch.float32, pin_memory=self.pinned)
        flat = host.numpy()
        if self.workers == 1:
            self.stream.fill_standard_normal(flat)
            return host
        # a secure stream only: slices filled concurrently (this thread fills the first), each from the OS CSPRNG
        bounds = np.linspace(0, self.size, self.workers + 1).astype(np.int64)
        others = [self._pool.submit(self.stream.fill_standard_normal, flat[lo:hi])
                  for lo, hi in zip(bounds[1:-1], bounds[2:])]
        self.stream.fill_standard_normal(flat[:bounds[1]])
        for part in others:
            part.result()
        return host

    def take(self) -> torch.Tensor:
        """The next step's standard normals on the training device (the copy is queued, not waited for)."""
        if self._next is None:
            raise RuntimeError(f"DP-SGD: more noisy steps than the epoch's {self.steps}")
        host = self._next.result()
        self.taken += 1
        self._next = self._pool.submit(self._draw) if self.taken < self.steps else None
        # the caching host allocator keeps the pinned block until the copy is done
        return host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host

    def close(self) -> None:
        """Stop drawing (an epoch left early): a draw under way finishes, none starts."""
        if self._next is not None:
            self._next.cancel()
            self._next = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def noise_workers(device: torch.device) -> int:
    """Threads that draw one step's secure noise: one beside CPU training (the cores train), up to four beside a
    GPU (its host's cores are otherwise idle while the kernels run)."""
    if torch.device(device).type != "cuda":
        return 1
    return max(1, min(4, (os.cpu_count() or 2) // 4))


def _install_stream_noise(optimizer, session: "DPSession") -> None:
    """Make the Opacus optimizer take its Gaussian noise from the session's :class:`StepNoise` of the charged epoch.

    Same maths as ``opacus.optimizers.optimizer.DPOptimizer.add_noise`` (std = noise multiplier x the total
    clipping norm, added to the summed clipped gradient of each parameter), only the source differs: one flat
    buffer of standard normals per step from the epoch's stream -- the OS CSPRNG, or the seeded stream of an
    explicitly reproducible simulation -- drawn on the host, exactly as on the CPU, then copied to the
    gradient's device in float32 and scaled there by the std the optimizer holds at the step. Never a device
    RNG: a CUDA generator would need a seed, and a seed is what lets anyone regenerate the noise. The same
    draws on every device keep ``--reproducible-noise`` runs comparable across devices.
    """
    def add_noise() -> None:
        noise = session.step_noise
        if noise is None:
            raise RuntimeError("DP-SGD noise requested before begin_epoch charged the epoch to the ledger")
        summed = [p.summed_grad for p in optimizer.params]
        for grad in summed:
            # Opacus builds a fresh summed_grad every step (zero_grad clears it): one marked as noised already
            # would get a second draw (Opacus guards the same way with private helpers we do not import)
            if getattr(grad, "_fedpate_noised", False):
                raise RuntimeError("DP-SGD: noise added twice to one step's clipped gradient (zero_grad missing)")
        if sum(grad.numel() for grad in summed) != noise.size:
            raise RuntimeError("DP-SGD: the noise buffer does not match the noised parameters")
        std = float(optimizer.noise_multiplier) * float(optimizer.max_grad_norm)
        flat = noise.take()
        views = [view.view_as(grad) for view, grad in zip(flat.split([g.numel() for g in summed]), summed)]
        # float32 (the buffer's dtype; never a bf16 noise sample), one fused add per parameter list
        noisy = torch._foreach_add([grad.float() for grad in summed], views, alpha=std)
        for p, grad, value in zip(optimizer.params, summed, noisy):
            p.grad = value.view_as(p)
            grad._fedpate_noised = True

    optimizer.add_noise = add_noise


# --------------------------------------------------------------------------------------------- the engine
def _epoch_event(dp: DPConfig, sampling_rate: float, sigma: float, steps: int):
    """The epoch's privacy event (``privacy.schedules.epoch_event``) under the run's relation and adaptivity."""

    return epoch_event(sigma, sampling_rate, steps, mode=dp.sampling, relation=dp.relation, adaptive=dp.adaptive)


def epoch_plan(dp: DPConfig, n: int, batch_size: int, epochs: int, sigma: float) -> tuple:
    """The events of ``epochs`` epochs at noise multiplier ``sigma`` over ``n`` records in (expected) batches of
    ``batch_size``: what such a training charges, in order, when it runs to its end."""
    steps = steps_per_epoch(n, batch_size)
    return (_epoch_event(dp, 1.0 / steps, float(sigma), steps),) * int(epochs)


class DPSession:
    """Opacus-wrapped model and optimizer plus the epoch-by-epoch privacy bookkeeping.

    ``begin_epoch(e)`` decides sigma for epoch e, charges the guard (or returns False when the budget
    does not allow another epoch in fixed/schedule mode), and sets the optimizer's noise multiplier.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, private: PrivateTraining, *,
                 n: int, batch_size: int, epochs: int, has_validation: bool = False) -> None:
        """Wrap ``model`` and ``optimizer`` (Opacus ``make_private``) for ``private``'s DP-SGD over ``n`` records
        in batches of ``batch_size`` (expected size under Poisson sampling) for ``epochs`` epochs (the planning
        horizon unless ``dp.target_epochs`` sets one); ``has_validation``: a public validation set is scored
        every epoch (the validation-based schedule needs one)."""
        # Opacus (~9 s to import) only for DP-SGD sessions: non-private training never pays for it
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        dp, guard, noise = private.dp, private.guard, private.noise
        self.dp = dp
        if n <= 0:
            raise UserError("DP-SGD: the private training set is empty")
        errors = ModuleValidator.validate(model, strict=False)
        if errors:
            raise UserError(f"DP-SGD: the network is not Opacus-compatible: {errors[0]}")
        self.owners = private.owners
        self.comparison_figures = bool(private.comparison_figures)
        self.n = int(n)
        self.batch_size = int(batch_size)
        self.planned_epochs = int(dp.target_epochs or epochs)
        self.steps = steps_per_epoch(self.n, self.batch_size)
        self.sampling_rate = 1.0 / self.steps
        if guard is None:
            guard = BudgetGuard(Ledger(None), dp.epsilon, dp.delta)
        self.guard = guard
        self.ledger = guard.ledger

        self.noise = noise if noise is not None else NoiseSource()
        self.stream = None                  # the charged epoch's batch stream; None = not charged
        self.step_noise: StepNoise | None = None   # the charged epoch's gradient noise (its own stream)
        self.sigmas: list[float] = []       # sigma of every charged epoch, in order
        self.stopped_reason: str | None = None
        self._schedule = None
        self.base_sigma = self._initial_sigma(has_validation)
        # a run calibrated to its budget has a plan: its epochs at that sigma. The guard composes it once and then
        # lets the epochs that follow it through without composing (privacy.guard.BudgetGuard.expect)
        expect = getattr(guard, "expect", None)
        if dp.mode is NoiseMode.TARGET and expect is not None:
            with phase("accounting"):
                expect(self.owners, epoch_plan(dp, self.n, self.batch_size, self.planned_epochs, self.base_sigma))

        # Opacus wiring. The data loader only tells make_private the dataset size and batch size (it derives
        # q = 1/len(loader) and the expected batch size from it); batches themselves come from
        # poisson_batches / shuffled_batches, drawn from the epoch's batch stream.
        index_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(self.n)),
                                                   batch_size=self.batch_size)
        if dp.per_layer:
            n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
            max_grad_norm: float | list[float] = [float(dp.max_grad_norm)] * n_tensors
            clipping = "per_layer"
        else:
            max_grad_norm = float(dp.max_grad_norm)
            clipping = "flat"
        self.engine = PrivacyEngine(accountant="rdp")  # Opacus' own accountant is ignored: the ledger rules
        self.model, self.optimizer, _ = self.engine.make_private(
            module=model, optimizer=optimizer, data_loader=index_loader, noise_multiplier=self.base_sigma,
            max_grad_norm=max_grad_norm, poisson_sampling=False, clipping=clipping,
            grad_sample_mode=dp.grad_sample_mode, loss_reduction="mean")
        _install_stream_noise(self.optimizer, self)
        self.expected_batch_size = self.optimizer.expected_batch_size
        #: L2 sensitivity of one sample's clipped gradient (sqrt(sum C_i^2) for per-layer clipping)
        self.total_clip = float(self.optimizer.max_grad_norm)

    # -- sigma planning --------------------------------------------------------------------------------
    def _initial_sigma(self, has_validation: bool) -> float:
        dp = self.dp
        if dp.mode is NoiseMode.FIXED:
            return float(dp.noise_multiplier)
        if dp.mode is NoiseMode.TARGET:
            if dp.sampling == Sampling.POISSON:   # memoised on disk: the guard verifies the plan anyway
                return float(accounting.dpsgd_noise_multiplier(
                    dp.epsilon, dp.delta, self.sampling_rate, self.steps * self.planned_epochs,
                    accountant=dp.accountant, relation=dp.relation))
            return float(calibration.shuffled_noise_multiplier(dp.epsilon, dp.delta, self.planned_epochs,
                                                               relation=dp.relation))
        # schedule
        if schedule_family(dp.schedule) is ScheduleFamily.VALIDATION and not has_validation:
            raise UserError("--schedule validation: needs a public validation set (none was given)")
        sigma0 = float(dp.noise_multiplier)
        self._schedule = make_schedule(dp, sigma0, target_epochs=self.planned_epochs,
                                       sampling_rate=self.sampling_rate, steps_per_epoch=self.steps)
        return float(self._schedule.sigma(0))

    @property
    def schedule(self):
        """The Yu et al. schedule of ``mode="schedule"`` (None otherwise)."""
        return self._schedule

    def sigma_for_epoch(self, epoch: int) -> float:
        if self._schedule is not None:
            return float(self._schedule.sigma(epoch))
        return self.base_sigma

    def observe_validation(self, score: float) -> None:
        """Feed a public-validation score to the validation-based schedule (no-op otherwise)."""
        if self._schedule is not None and hasattr(self._schedule, "observe"):
            self._schedule.observe(float(score))

    # -- accounting ------------------------------------------------------------------------------------
    def release_id(self, epoch: int) -> str:
        return f"{self.dp.release_prefix}:epoch-{epoch}"

    def begin_epoch(self, epoch: int) -> bool:
        """Charge epoch ``epoch`` (0-based) before touching data. False = stop (budget spent)."""
        self.end_epoch()

        sigma = self.sigma_for_epoch(epoch)
        event = _epoch_event(self.dp, self.sampling_rate, sigma, self.steps)
        note = {"epoch": epoch, "sigma": sigma, "sampling": self.dp.sampling, "sampling_rate": self.sampling_rate,
                "steps": self.steps, "max_grad_norm": self.dp.max_grad_norm, "per_layer": self.dp.per_layer,
                "relation": self.dp.relation}
        try:
            # charge = check, then a durable ledger record; a refusal records nothing
            with phase("accounting"):
                self.guard.charge(self.owners, event, release_id=self.release_id(epoch), note=note)
        except BudgetExceeded:
            if self.dp.mode is NoiseMode.TARGET:
                raise  # the plan was calibrated to fit: a refusal is a real error (e.g. an already used ledger)
            self.stopped_reason = "budget spent: the next epoch would exceed it"
            return False
        self.sigmas.append(sigma)
        self.optimizer.noise_multiplier = sigma
        # opened only after the charge: the epoch's stream gives the batches, and a stream spawned from it the
        # gradient noise (drawn ahead on a thread, so the two never share one: each repeats in its own fixed order
        # under reproducible noise)
        self.stream = self.noise.generator(f"{self.dp.stream_prefix or self.dp.release_prefix}:epoch-{epoch}")
        params = self.optimizer.params
        self.step_noise = StepNoise(self.stream.spawn(), steps=self.steps,
                                    size=sum(p.numel() for p in params), device=params[0].device,
                                    workers=noise_workers(params[0].device))
        return True

    def end_epoch(self) -> None:
        """Stop the epoch's noise thread (called by the next ``begin_epoch`` and by ``finish``)."""
        if self.step_noise is not None:
            self.step_noise.close()
            self.step_noise = None

    def epoch_epsilon(self) -> float | None:
        """The ledger's epsilon after the epochs charged so far, or None while the run follows its verified plan
        short of its end: the guard then composes nothing per epoch, and the ledger's figure comes at the end,
        from the plan's one composition (``spent``)."""
        owner = self.owners[0]
        plan_of = getattr(self.guard, "plan_of", None)
        plan = plan_of(owner) if plan_of is not None else None
        if plan is not None and tuple(self.ledger.events(owner)) != plan:
            return None
        return self.spent(with_rdp=False)["epsilon"]

    @timed("accounting")
    def spent(self, owner: str | None = None, with_rdp: bool = True) -> dict[str, Any]:
        """epsilon from the ledger (the reporting accountant and relation), plus comparison figures.

        ``with_rdp``: also RDP (where it applies) and the same mechanism's epsilon under the other relation
        (``epsilon_add_remove`` / ``epsilon_replace_one``; defined for Poisson sampling only, None otherwise):
        the relation's own key always equals ``epsilon``.
        """

        owner = owner or self.owners[0]
        spent = self.ledger.spent(owner, self.dp.delta)
        out = {"epsilon": float(spent.epsilon), "delta": self.dp.delta, "accountant": spent.accountant,
               "relation": spent.relation, "releases": spent.releases, "adaptive": self.dp.adaptive,
               "epsilon_rdp": None, "epsilon_add_remove": None, "epsilon_replace_one": None}
        events = self.ledger.events(owner) if with_rdp else []
        # comparison figures: pure functions of the events, memoised on disk (task.learning.accounting)
        out.update(memoised_per_relation(events, self.dp.delta, spent.relation, spent.epsilon))
        if with_rdp and self.dp.sampling == Sampling.POISSON:
            try:
                out["epsilon_rdp"] = memoised_epsilon_spent(events, self.dp.delta, accountant="rdp")
            except Exception:  # RDP is informative only (refuses replace-one/adaptive); never break a run
                out["epsilon_rdp"] = None
        return out

    # -- steps -----------------------------------------------------------------------------------------
    def batches(self) -> Iterator[torch.Tensor]:
        """The charged epoch's batches (Poisson or shuffled), from the epoch's batch stream."""
        if self.stream is None:
            raise RuntimeError("DPSession.batches: begin_epoch must charge the epoch first")
        if self.dp.sampling == Sampling.POISSON:
            return poisson_batches(self.n, self.sampling_rate, self.steps, self.stream)
        return shuffled_batches(self.n, self.batch_size, self.stream)

    def per_sample_gradients_to_float32(self) -> None:
        """Cast per-sample gradients to float32 before clipping (``--precision bf16``).

        Under autocast Opacus' ``hooks`` engine can leave bf16 per-sample gradients (its ``functorch`` engine
        returns float32); clipping factors, the clipped sum and the noise must then still be computed in
        float32, so that the clip bound -- the sensitivity the ledger is charged for -- holds to float32
        rounding, as at precision 32."""
        for p in self.optimizer.params:
            grad_sample = getattr(p, "grad_sample", None)
            if isinstance(grad_sample, torch.Tensor) and grad_sample.dtype != torch.float32:
                p.grad_sample = grad_sample.float()

    def average_views(self, views: int) -> None:
        """Augmentation multiplicity (De et al. 2022, arXiv 2204.13650, Sec. 3.2): the batch holds ``views``
        augmented copies of each sampled patient side by side; replace their ``views`` per-sample gradients by
        their mean, so each patient enters clipping as *one* gradient.

        Sensitivity is unchanged (replace-one, per-layer or flat clipping alike): whatever ``views`` is, one
        patient contributes the single vector ``clip_C(mean_j g(aug_j(x)))``, of norm at most C (C_total for
        per-layer clipping), to the clipped sum; replacing the patient moves that sum by at most 2 C_total,
        the same bound the ledger's Poisson-sampled Gaussian event assumes. The views add no patient and are
        drawn from public augmentation randomness; the Poisson sample is still over patients (the batch's
        indices, repeated). Averaging *before* clipping, not after, is what lets the views reduce the
        gradient's variance without shrinking the signal (tests/test_dp_levers.py checks both facts).
        """
        for p in self.optimizer.params:
            grad_sample = p.grad_sample
            if grad_sample is None:
                continue
            rows = grad_sample.shape[0]
            if rows % views:
                raise RuntimeError(f"DP-SGD: {rows} per-sample gradients are not {views} views per patient")
            p.grad_sample = grad_sample.reshape(rows // views, views, *grad_sample.shape[1:]).mean(dim=1)

    def noise_only_step(self) -> None:
        """An empty Poisson batch: clipped sum 0, plus noise, then the optimizer step.

        Forward/backward on an empty batch crashes Opacus and poisons the next step, so we
        hand the optimizer empty per-sample gradients directly.
        """
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- checkpoint ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # No noise state: every epoch opens its own stream (secure, or derived from the epoch's name).
        state = {"sigmas": list(self.sigmas), "stopped_reason": self.stopped_reason, "schedule": None}
        if self._schedule is not None:
            state["schedule"] = {k: v for k, v in vars(self._schedule).items()
                                 if isinstance(v, (int, float, str, list, tuple, type(None)))}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sigmas = list(state["sigmas"])
        self.stopped_reason = state.get("stopped_reason")
        if self._schedule is not None and state.get("schedule"):
            for key, value in state["schedule"].items():
                setattr(self._schedule, key, value)
        # "ledger position": a fresh (in-memory) ledger is re-filled with the epochs already charged; a
        # persistent ledger already has them (re-recording an identical release id is a no-op).
        for epoch, sigma in enumerate(self.sigmas):
            release = self.release_id(epoch)
            if not self.ledger.has_release(release):
                event = _epoch_event(self.dp, self.sampling_rate, sigma, self.steps)
                self.ledger.record(self.owners, event, release, note={"epoch": epoch, "sigma": sigma, "resumed": True})
        if self.sigmas:
            self.optimizer.noise_multiplier = self.sigmas[-1]


def make_schedule(dp: DPConfig, sigma0: float, *, target_epochs: int, sampling_rate: float, steps_per_epoch: int):
    """A Yu et al. schedule (``privacy.schedules``) whose decay k is planned so the budget lasts
    ``target_epochs`` (``plan_decay``, Yu et al. Sec. IV-A-2).

    The validation-based schedule is stateful and cannot be planned ahead: it simply runs until the budget
    is spent (checked by a privacy filter, see the module docstring).

    Args:
        dp: the DP-SGD settings; read here: ``schedule`` (the family: ``time``, ``exp`` / ``exponential``,
            ``step``, ``poly`` / ``polynomial`` or ``validation``), ``epsilon`` / ``delta`` (the budget the decay
            is planned for), ``sampling`` (Poisson-sampled steps, or shuffled epochs under zCDP), ``accountant``
            (the planning accountant under Poisson sampling; shuffled epochs always use zCDP), ``relation`` (of
            the planned events) and ``schedule_options``: ``k`` (skip planning), ``period``
            (step/time/exp/poly), ``sigma_end`` (poly; default sigma0/4); validation: ``k`` (default 0.9),
            ``threshold`` (0.0), ``window`` (m, default 1), ``period``.
        sigma0: the first epoch's noise multiplier σ0.
        target_epochs: the epochs the budget must last (also the polynomial schedule's default ``period``).
        sampling_rate / steps_per_epoch: each epoch's Poisson sampling rate and steps.
    """

    options = dict(dp.schedule_options or {})
    name = schedule_family(dp.schedule)
    if name is ScheduleFamily.VALIDATION:
        return schedules.ValidationSchedule(sigma0, float(options.pop("k", 0.9)), **options)
    if name is ScheduleFamily.POLYNOMIAL:
        options.setdefault("sigma_end", sigma0 / 4)
        options.setdefault("period", target_epochs)
    k = options.pop("k", None)
    if k is None:
        poisson = dp.sampling == Sampling.POISSON
        k = schedules.plan_decay(name, sigma0, target_epochs, dp.epsilon, dp.delta, schedules.EpochAccounting(
            sampling_rate=sampling_rate, steps_per_epoch=steps_per_epoch,
            mode=Sampling.POISSON if poisson else Sampling.SHUFFLE,
            accountant=dp.accountant if poisson else None, relation=dp.relation), **options)
    return schedules.make_schedule(name, sigma0, float(k), **options)
