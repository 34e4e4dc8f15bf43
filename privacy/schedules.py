"""Dynamic noise schedules for DP-SGD (Yu et al., Sec. IV-A "Dynamic Privacy Budget Allocation"; arXiv 1904.02200).

The noise multiplier decreases over epochs (less noise as the model converges); each epoch's steps use
``σ_t = schedule.sigma(t)`` (t = 0, 1, ... is the epoch index). Training stops when the budget is spent:
:func:`epochs_within_budget` counts the epochs that fit, :func:`plan_decay` finds the decay parameter k
for which exactly ``target_epochs`` fit.

Accounting must match batching: ``mode="poisson"`` gives one SampledGaussianEvent per epoch
(PLD or RDP), ``mode="shuffle"`` one ZCDPEvent per epoch (Yu et al. Thm. 2: ``1/(2σ²)`` under zero-out
adjacency, ``2/σ²`` under replace-one). ``relation`` (default: add-remove for Poisson, zero-out for
shuffled epochs) is the neighbouring relation of those events; comparisons use replace-one (docs/PRIVACY.md,
"Neighbouring relations").

These pre-defined schedules fix every σ_t before training, so PLD composition is valid for them. The
validation-based schedule is different: σ_t depends on earlier (private) outputs through the validation
score, and training stops adaptively, so its epochs are charged with ``adaptive=True`` and accounted by
a privacy filter (``privacy.accountants.accountant_for``; see ``task.learning.dpsgd``). The validation set itself
is public: the scores cost no privacy, only the adaptivity must be accounted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from privacy.accountants import PLDAccountant, ZCDPAccountant, make_accountant
from privacy.calibration import calibrate
from privacy.errors import PrivacyError
from privacy.validation import positive_number
from privacy.events import ComposedEvent, Event, SampledGaussianEvent, ZCDPEvent
from privacy.options import Relation, Sampling, ScheduleFamily, look_up_option

MODES = tuple(Sampling)


def _epoch(epoch) -> int:
    if isinstance(epoch, bool) or int(epoch) != epoch or epoch < 0:
        raise PrivacyError(f"epoch must be a non-negative integer, got {epoch!r}")
    return int(epoch)


@dataclass(frozen=True)
class TimeBasedSchedule:
    """Time-based decay ``σ_t = σ0 / (1 + k·⌊t/period⌋)``, k ≥ 0 (Yu et al. Sec. IV-A-2a)."""

    sigma0: float
    k: float
    period: int = 1
    family = ScheduleFamily.TIME

    def __post_init__(self) -> None:
        positive_number("sigma0", self.sigma0)
        if not (self.k >= 0 and math.isfinite(self.k)):
            raise PrivacyError(f"TimeBasedSchedule: k must be >= 0, got {self.k!r}")
        positive_number("period", self.period)

    def sigma(self, epoch: int) -> float:
        return self.sigma0 / (1.0 + self.k * (_epoch(epoch) // self.period))


@dataclass(frozen=True)
class ExponentialSchedule:
    """Exponential decay ``σ_t = σ0 · e^{-k·⌊t/period⌋}``, k ≥ 0 (Yu et al. Sec. IV-A-2b)."""

    sigma0: float
    k: float
    period: int = 1
    family = ScheduleFamily.EXPONENTIAL

    def __post_init__(self) -> None:
        positive_number("sigma0", self.sigma0)
        if not (self.k >= 0 and math.isfinite(self.k)):
            raise PrivacyError(f"ExponentialSchedule: k must be >= 0, got {self.k!r}")
        positive_number("period", self.period)

    def sigma(self, epoch: int) -> float:
        return self.sigma0 * math.exp(-self.k * (_epoch(epoch) // self.period))


@dataclass(frozen=True)
class StepSchedule:
    """Step decay ``σ_t = σ0 · k^{⌊t/period⌋}``, 0 < k ≤ 1 (Yu et al. Sec. IV-A-2c)."""

    sigma0: float
    k: float
    period: int = 1
    family = ScheduleFamily.STEP

    def __post_init__(self) -> None:
        positive_number("sigma0", self.sigma0)
        if not (0 < self.k <= 1):
            raise PrivacyError(f"StepSchedule: k must be in (0, 1], got {self.k!r}")
        positive_number("period", self.period)

    def sigma(self, epoch: int) -> float:
        return self.sigma0 * self.k ** (_epoch(epoch) // self.period)


@dataclass(frozen=True)
class PolynomialSchedule:
    """Polynomial decay ``σ_t = (σ0 - σ_end)(1 - t/period)^k + σ_end`` for t < period, σ_end afterwards.

    k ≥ 0 is the power (k = 1 linear; k = 0 no decay until the period ends); Yu et al. Sec. IV-A-2d
    ("we make the noise scale constant after the training time exceeds period epochs").
    """

    sigma0: float
    sigma_end: float
    k: float
    period: int
    family = ScheduleFamily.POLYNOMIAL

    def __post_init__(self) -> None:
        positive_number("sigma0", self.sigma0)
        positive_number("sigma_end", self.sigma_end)
        if self.sigma_end > self.sigma0:
            raise PrivacyError(f"PolynomialSchedule: sigma_end must be <= sigma0, got {self.sigma_end} > {self.sigma0}")
        if not (self.k >= 0 and math.isfinite(self.k)):
            raise PrivacyError(f"PolynomialSchedule: k must be >= 0, got {self.k!r}")
        positive_number("period", self.period)

    def sigma(self, epoch: int) -> float:
        t = _epoch(epoch)
        if t >= self.period:
            return self.sigma_end
        return (self.sigma0 - self.sigma_end) * (1.0 - t / self.period) ** self.k + self.sigma_end


@dataclass
class ValidationSchedule:
    """Validation-based decay (Yu et al. Sec. IV-A-1, eqs. 8-10): σ ← k·σ when the moving average of the
    last ``window`` (m) validation scores improved by at most ``threshold`` since the previous check.

    Checks happen every ``period`` (≥ m) observations; the first check compares with 0 (S_0 = 0). Scores must
    come from a *public* validation set, otherwise the schedule itself leaks. ``sigma(epoch)``
    returns the current σ (the schedule is stateful, so it cannot be planned ahead by :func:`plan_decay`).

    Accounting: the score is computed from the model, i.e. from earlier private outputs, so σ_t and the
    stopping time are chosen *adaptively*. PLD (and RDP with the best order picked afterwards) assume
    parameters fixed in advance; the epochs of this schedule are therefore charged as ``adaptive=True``
    events and accounted by a privacy filter — a Rényi filter (Feldman & Zrnic 2021) for Poisson sampling
    under add/remove (``rdp-filter``), zCDP for shuffled epochs (``zcdp``), whose stopping rule is the
    budget guard's refusal. Validity needs only that the *scores* are post-processing: the validation
    set is public, so observing it costs nothing.
    """

    sigma0: float
    k: float
    threshold: float = 0.0
    window: int = 1
    period: int | None = None
    family = ScheduleFamily.VALIDATION
    scores: list = field(default_factory=list)
    current: float = field(default=0.0)
    last_average: float = field(default=0.0)

    def __post_init__(self) -> None:
        positive_number("sigma0", self.sigma0)
        if not (0 < self.k <= 1):
            raise PrivacyError(f"ValidationSchedule: k must be in (0, 1], got {self.k!r}")
        positive_number("window", self.window)
        if self.period is None:
            self.period = self.window
        if self.period < self.window:
            raise PrivacyError(f"ValidationSchedule: period must be >= window, got {self.period} < {self.window}")
        self.current = float(self.sigma0)

    def observe(self, score: float) -> float:
        """Record one validation score; returns the σ to use from now on."""
        score = float(score)
        if not math.isfinite(score):
            raise PrivacyError(f"validation score must be finite, got {score!r}")
        self.scores.append(score)
        if len(self.scores) % self.period == 0 and len(self.scores) >= self.window:
            average = sum(self.scores[-self.window :]) / self.window
            if average - self.last_average <= self.threshold:
                self.current *= self.k
            self.last_average = average
        return self.current

    def sigma(self, epoch: int) -> float:
        _epoch(epoch)
        return self.current


Schedule = TimeBasedSchedule | ExponentialSchedule | StepSchedule | PolynomialSchedule | ValidationSchedule


def _check_mode(mode: str) -> Sampling:
    return look_up_option(mode, Sampling, "mode")


def default_relation(mode: str) -> str:
    """The one-record-in-or-out relation of a batching mode: add-remove (Poisson), zero-out (shuffled)."""
    return Relation.ADD_REMOVE if _check_mode(mode) is Sampling.POISSON else Relation.ZERO_OUT


def epoch_event(
    sigma: float, sampling_rate: float, steps_per_epoch: int, mode: str = "poisson", relation: str | None = None,
    adaptive: bool = False,
) -> Event:
    """The privacy event of one epoch at noise multiplier σ (Poisson-sampled steps or one shuffled epoch).

    Args:
        sigma: the epoch's noise multiplier σ.
        sampling_rate: the Poisson sampling rate q (``poisson`` mode only).
        steps_per_epoch: the epoch's Poisson-sampled steps (``poisson`` mode only).
        mode: ``poisson`` (a SampledGaussianEvent) or ``shuffle`` (one shuffled epoch, a ZCDPEvent).
        relation: the events' neighbouring relation (None = the mode's default, :func:`default_relation`).
        adaptive: σ was chosen from earlier outputs (validation-based schedule); see the module docstring.
    """
    relation = relation or default_relation(mode)
    if _check_mode(mode) is Sampling.POISSON:
        return SampledGaussianEvent(sampling_rate, sigma, steps_per_epoch, relation=relation, adaptive=adaptive)
    return ZCDPEvent.shuffled_epochs(sigma, 1, relation=relation, adaptive=adaptive)


def schedule_events(
    schedule, epochs: int, sampling_rate: float, steps_per_epoch: int, mode: str = "poisson",
    relation: str | None = None,
) -> list[Event]:
    """One event per epoch t = 0 .. epochs-1 with σ_t = schedule.sigma(t).

    Args:
        schedule: the noise schedule (anything with ``sigma(epoch)``).
        epochs: the number of epochs (> 0).
        sampling_rate / steps_per_epoch: each epoch's Poisson sampling rate and steps (``poisson`` mode only).
        mode: ``poisson`` or ``shuffle`` (:func:`epoch_event`).
        relation: the events' neighbouring relation (None = the mode's default, :func:`default_relation`).
    """
    epochs = int(positive_number("epochs", epochs))
    return [epoch_event(schedule.sigma(t), sampling_rate, steps_per_epoch, mode, relation) for t in range(epochs)]


def _default_accountant(mode: str) -> str:
    return PLDAccountant.name if mode == Sampling.POISSON else ZCDPAccountant.name


def _planning_options(name: str, epsilon: float) -> dict:
    # PLD's pessimistic grid: coarser is still an upper bound; 1e-4·ε (within [1e-4, 1e-3]) keeps the error
    # far below the 1e-3 calibration window while composing distinct per-epoch PLDs ~7x faster than 1e-4.
    if name == PLDAccountant.name:
        return {"value_discretization_interval": min(1e-3, max(1e-4, epsilon * 1e-4))}
    return {}


@dataclass(frozen=True)
class EpochAccounting:
    """How each epoch of a schedule is batched and accounted (what :func:`epochs_within_budget`,
    :func:`schedule_epsilon` and :func:`plan_decay` compose).

    Args:
        sampling_rate / steps_per_epoch: each epoch's Poisson sampling rate and steps (``poisson`` mode only;
            defaults 1.0 and 1).
        mode: ``poisson`` or ``shuffle`` (:func:`epoch_event`).
        relation: the events' neighbouring relation (None = the mode's default, :func:`default_relation`).
        accountant: the accountant's name (None = ``pld`` for Poisson sampling, ``zcdp`` for shuffled epochs).
    """

    sampling_rate: float = 1.0
    steps_per_epoch: int = 1
    mode: Sampling = Sampling.POISSON
    relation: str | None = None
    accountant: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _check_mode(self.mode))
        if self.relation is not None:   # checked, and kept as given: the events record it
            look_up_option(self.relation, Relation, "relation")

    @property
    def accountant_name(self) -> str:
        """The accountant's name, the mode's default when none was given."""
        return self.accountant or _default_accountant(self.mode)

    def event(self, sigma: float) -> Event:
        """One epoch's event at noise multiplier σ (:func:`epoch_event`)."""
        return epoch_event(sigma, self.sampling_rate, self.steps_per_epoch, self.mode, self.relation)

    def events(self, schedule, epochs: int) -> list[Event]:
        """One event per epoch t = 0 .. epochs-1 of ``schedule`` (:func:`schedule_events`)."""
        return schedule_events(schedule, epochs, self.sampling_rate, self.steps_per_epoch, self.mode, self.relation)


def epochs_within_budget(schedule, epsilon: float, delta: float, accounting: EpochAccounting,
                         max_epochs: int = 1000) -> int:
    """How many whole epochs fit before ε would exceed the budget (training stops when it is spent).

    Args:
        schedule: the noise schedule (anything with ``sigma(epoch)``).
        epsilon / delta: the budget (ε, δ).
        accounting: each epoch's batching, relation and accountant (:class:`EpochAccounting`); PLD plans on a
            discretisation of ``1e-4·ε`` within [1e-4, 1e-3].
        max_epochs: the answer's cap: returned when that many epochs all fit.
    """
    epsilon = positive_number("epsilon", epsilon)
    name = accounting.accountant_name
    acc = make_accountant(name, **_planning_options(name, epsilon))
    for t in range(int(max_epochs)):
        acc.compose(accounting.event(schedule.sigma(t)))
        if acc.get_epsilon(delta) > epsilon:
            return t
    return int(max_epochs)


def schedule_epsilon(schedule, epochs: int, delta: float, accounting: EpochAccounting,
                     accountant_options: dict | None = None) -> float:
    """ε after ``epochs`` epochs of ``schedule``.

    Args:
        schedule: the noise schedule (anything with ``sigma(epoch)``).
        epochs: the number of epochs composed.
        delta: the δ at which ε is computed.
        accounting: each epoch's batching, relation and accountant (:class:`EpochAccounting`).
        accountant_options: keyword arguments for the accountant (None = its defaults).
    """
    acc = make_accountant(accounting.accountant_name, **(accountant_options or {}))
    for event in accounting.events(schedule, epochs):
        acc.compose(event)
    return acc.get_epsilon(delta)


def make_schedule(family: str, sigma0: float, k: float, **kwargs):
    """Build a pre-defined schedule by family name: time | exponential | step | polynomial."""
    family = look_up_option(family, ScheduleFamily, "family")
    if family is ScheduleFamily.TIME:
        return TimeBasedSchedule(sigma0, k, **kwargs)
    if family is ScheduleFamily.EXPONENTIAL:
        return ExponentialSchedule(sigma0, k, **kwargs)
    if family is ScheduleFamily.STEP:
        return StepSchedule(sigma0, k, **kwargs)
    if family is ScheduleFamily.POLYNOMIAL:
        if "sigma_end" not in kwargs or "period" not in kwargs:
            raise PrivacyError("polynomial schedule needs sigma_end= and period=")
        return PolynomialSchedule(sigma0, kwargs.pop("sigma_end"), k, kwargs.pop("period"), **kwargs)
    raise PrivacyError("validation schedules depend on observed scores and cannot be planned ahead")


def plan_decay(family: str, sigma0: float, target_epochs: int, epsilon: float, delta: float,
               accounting: EpochAccounting = EpochAccounting(), **schedule_kwargs) -> float:
    """Decay parameter k so that exactly ``target_epochs`` epochs fit in (ε, δ) (bisection, safe side).

    Solves ``ε(k) = ε(first target_epochs epochs of make_schedule(family, σ0, k))`` for
    ``target·(1-1e-3) ≤ ε(k) ≤ target`` with :func:`privacy.calibration.calibrate`: the target epochs fit,
    and (since the decayed schedule spends almost the whole budget) one more epoch does not in practice.
    Raises PrivacyError when even no decay (constant σ0) does not fit ``target_epochs``, or when the
    strongest decay still leaves budget (polynomial decay bounded below by σ_end).

    Args:
        family: the schedule family (:func:`make_schedule`: ``time``, ``exponential``, ``step``,
            ``polynomial``; validation schedules cannot be planned ahead).
        sigma0: the first epoch's noise multiplier σ0.
        target_epochs: the epochs that must fit in the budget (> 0).
        epsilon / delta: the budget (ε, δ).
        accounting: each epoch's batching, relation and accountant (:class:`EpochAccounting`; default: one
            Poisson step per epoch at sampling rate 1.0).
        **schedule_kwargs: the family's other parameters (``period``; ``sigma_end`` and ``period`` for
            ``polynomial``).
    """
    target_epochs = int(positive_number("target_epochs", target_epochs))
    epsilon = positive_number("epsilon", epsilon)
    name = accounting.accountant_name
    options = _planning_options(name, epsilon)

    def eps_of(k: float) -> float:
        schedule = make_schedule(family, sigma0, k, **dict(schedule_kwargs))
        return schedule_epsilon(schedule, target_epochs, delta, accounting, options)

    no_decay = 1.0 if family == ScheduleFamily.STEP else 0.0
    eps_constant = eps_of(no_decay)
    if eps_constant > epsilon:
        raise PrivacyError(
            f"plan_decay: even constant sigma0={sigma0} spends epsilon={eps_constant:.4g} > {epsilon} in "
            f"{target_epochs} epochs; raise sigma0 or lower target_epochs"
        )
    if family == ScheduleFamily.POLYNOMIAL:
        floor = make_schedule(family, sigma0, 1e6, **dict(schedule_kwargs))
        eps_fastest = schedule_epsilon(floor, target_epochs, delta, accounting, options)
        if eps_fastest <= epsilon:
            raise PrivacyError(
                f"plan_decay: even the fastest polynomial decay to sigma_end spends only epsilon="
                f"{eps_fastest:.4g} <= {epsilon} in {target_epochs} epochs; lower sigma_end or add epochs"
            )

    def make_event(k: float) -> Event:
        schedule = make_schedule(family, sigma0, k, **dict(schedule_kwargs))
        return ComposedEvent(tuple(accounting.events(schedule, target_epochs)))

    # ε(k) is increasing in k for time/exponential/polynomial and decreasing for step (k is a factor);
    # calibrate() finds the direction from the bracket ends.
    return calibrate(make_event, epsilon, delta, name, 1e-3, 1.0, accountant_options=options)


__all__: Sequence[str] = (
    "TimeBasedSchedule",
    "ExponentialSchedule",
    "StepSchedule",
    "PolynomialSchedule",
    "ValidationSchedule",
    "EpochAccounting",
    "default_relation",
    "epoch_event",
    "schedule_events",
    "schedule_epsilon",
    "epochs_within_budget",
    "make_schedule",
    "plan_decay",
)
