"""Noise calibration for a target (ε, δ), always on the safe side.

One generic routine, :func:`calibrate`, modelled on dp_accounting's ``calibrate_dp_mechanism`` (bracket,
then root-find on ``ε(x) - target``), but it returns the bracket end that *satisfies* the budget and stops
only once ``target·(1 - 1e-3) ≤ ε(x) ≤ target``. The closed forms (Fay et al. eq. 15, exact GDP, zCDP)
are specialisations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from privacy.accountants import (
    DEFAULT_PLD_DISCRETIZATION,
    epsilon_spent,
    gdp_epsilon,
    gdp_mu_for,
    make_accountant,
    zcdp_epsilon,
    zcdp_rho_for,
)
from privacy.errors import PrivacyError
from privacy.options import AccountantName, Calibration, Relation, look_up_option
from privacy.validation import positive_number, probability
from privacy.events import (SAMPLED_RELATIONS, ComposedEvent, Event, GaussianEvent, RepeatAndSelectEvent,
                            SampledGaussianEvent, ZCDPEvent)

#: Relative tolerance: calibrated ε lies in [target·(1 - RELATIVE_TOLERANCE), target].
RELATIVE_TOLERANCE = 1e-3




def _delta(value: float) -> float:
    return probability("delta", value)


def _epsilon_of(make_event: Callable[[float], Event], accountant: str, delta: float, options: dict):
    def epsilon(x: float) -> float:
        acc = make_accountant(accountant, **options)
        acc.compose(make_event(x))
        return acc.get_epsilon(delta)

    return epsilon


def calibrate(
    make_event: Callable[[float], Event],
    target_epsilon: float,
    delta: float,
    accountant: str,
    lo: float,
    hi: float,
    *,
    rtol: float = RELATIVE_TOLERANCE,
    accountant_options: dict | None = None,
) -> float:
    """Parameter x with ``target·(1 - rtol) ≤ ε(make_event(x)) ≤ target`` under ``accountant`` at ``delta``.

    ``ε(x)`` must be monotone in x (either direction: σ decreases ε, a step count increases it). The
    bracket [lo, hi] is widened geometrically (×2 / ÷2, at most :data:`MAX_EXPANSIONS` times) until it
    contains the target (:func:`_bracket_target`); then the search keeps the end that satisfies the budget and stops
    as soon as that end is within ``rtol`` of the target (:func:`_search_bracket`: steps use the Illinois variant of
    false position on log ε against log x). The result is that satisfying end — never the other one.

    Raises PrivacyError if no bracket is found, or if ε(x) jumps over the tolerance window (e.g. a
    discrete parameter) — in that case the message gives the best safe value.

    Args:
        make_event: x -> the event (``privacy.events``) whose ε is calibrated; ε must be monotone in x.
        target_epsilon: the budget ε (> 0).
        delta: the δ at which ε is computed.
        accountant: the accountant's name (:class:`privacy.options.AccountantName`: e.g. ``pld``, ``rdp``,
            ``zcdp``). For ``pld`` with a wide bracket (hi/lo > 1.7) the answer is first located with RDP and PLD
            searches a narrow bracket around it (:func:`_narrowed_by_rdp`).
        lo / hi: the initial bracket (0 < lo < hi); widened when it does not contain the target.
        rtol: the tolerance window: the result's ε lies in [target·(1 - rtol), target].
        accountant_options: keyword arguments for the accountant (e.g. PLD's
            ``value_discretization_interval``; None = its defaults).
    """
    target = positive_number("target_epsilon", target_epsilon)
    delta = _delta(delta)
    lo, hi = positive_number("lo", lo), positive_number("hi", hi)
    if lo >= hi:
        raise PrivacyError(f"calibrate: lo must be smaller than hi, got lo={lo}, hi={hi}")
    if accountant == AccountantName.PLD and hi / lo > 1.7:
        lo, hi = _narrowed_by_rdp(make_event, target, delta, lo, hi)
    epsilon = _epsilon_of(make_event, accountant, delta, accountant_options or {})
    return _search_bracket(epsilon, _bracket_target(epsilon, target, delta, lo, hi), target, rtol)


#: how many times :func:`calibrate` may widen its bracket before PrivacyError
MAX_EXPANSIONS = 40
#: root-finding steps of :func:`calibrate` before PrivacyError (ε jumping over the window)
MAX_ITERATIONS = 200


def _narrowed_by_rdp(make_event: Callable[[float], Event], target: float, delta: float, lo: float,
                     hi: float) -> tuple[float, float]:
    """A narrow bracket for a PLD search: PLD at an extreme bracket end can take minutes (a sampled Gaussian with
    z = 0.05 has a huge privacy-loss support). RDP is fast and always at least as pessimistic, so the answer is
    located with RDP first and PLD gets [rough/1.3, rough·1.3] (widened again by :func:`_bracket_target` if needed);
    the given bracket when RDP finds nothing. dp_accounting's RDP has no replace-one Poisson subsampling: such events
    are located through the same mechanisms read under add/remove (a rough locator only; the PLD search is exact)."""

    def rough_event(x: float) -> Event:
        event = make_event(x)
        moved = event.with_relation(Relation.ADD_REMOVE) if event.relation == Relation.REPLACE_ONE else None
        return event if moved is None else moved

    try:
        rough = calibrate(rough_event, target, delta, AccountantName.RDP, lo, hi, rtol=1e-2)
    except PrivacyError:
        return lo, hi
    return rough / 1.3, rough * 1.3


@dataclass(frozen=True)
class _Bracket:
    """Two parameters with their ε: ``safe`` satisfies ε ≤ target, ``unsafe`` exceeds it."""

    safe: float
    eps_safe: float
    unsafe: float
    eps_unsafe: float


def _bracket_target(epsilon: Callable[[float], float], target: float, delta: float, lo: float,
                    hi: float) -> _Bracket:
    """Widen [lo, hi] until one end satisfies the budget (ε ≤ target) and the other does not."""
    eps_lo, eps_hi = epsilon(lo), epsilon(hi)
    for _ in range(MAX_EXPANSIONS):
        if eps_lo == eps_hi:  # direction unknown (e.g. both infinite): widen both ends
            lo, hi = lo / 2, hi * 2
            eps_lo, eps_hi = epsilon(lo), epsilon(hi)
            continue
        increasing = eps_hi > eps_lo
        small, large = (eps_lo, eps_hi) if increasing else (eps_hi, eps_lo)
        if small <= target < large:
            break
        move_lo = (small > target) == increasing  # which end to push outwards
        if move_lo:
            lo /= 2
            eps_lo = epsilon(lo)
        else:
            hi *= 2
            eps_hi = epsilon(hi)
    else:
        raise PrivacyError(
            f"calibrate: no parameter in [{lo:.6g}, {hi:.6g}] reaches epsilon={target} at delta={delta} "
            f"(epsilon there: {eps_lo:.6g} .. {eps_hi:.6g})"
        )
    if increasing:
        return _Bracket(lo, eps_lo, hi, eps_hi)
    return _Bracket(hi, eps_hi, lo, eps_lo)


def _search_bracket(epsilon: Callable[[float], float], bracket: _Bracket, target: float, rtol: float) -> float:
    """The safe end once it is within ``rtol`` of the target. Steps interpolate log ε in log x between the ends,
    aiming at the middle of the window (Illinois false position in log-log), which needs far fewer costly
    accountant calls than plain bisection; the invariant of :class:`_Bracket` holds throughout."""
    safe, eps_safe, unsafe, eps_unsafe = bracket.safe, bracket.eps_safe, bracket.unsafe, bracket.eps_unsafe
    floor = target * (1 - rtol)
    aim = target * (1 - rtol / 2)

    def gap(eps: float) -> float:  # log(ε/aim): ε(x) is near a power law in x, so interpolate in log-log
        return math.log(eps / aim) if 0 < eps < math.inf else (math.inf if eps > 0 else -math.inf)

    g_safe, g_unsafe = gap(eps_safe), gap(eps_unsafe)
    safe_moved_last = None   # which end the previous step moved (None before the first)
    for _ in range(MAX_ITERATIONS):
        if eps_safe >= floor:
            return safe
        if math.isfinite(g_safe) and math.isfinite(g_unsafe) and safe > 0 and unsafe > 0:
            fraction = min(max(g_safe / (g_safe - g_unsafe), 0.02), 0.98)
            middle = math.exp(math.log(safe) + fraction * (math.log(unsafe) - math.log(safe)))
        else:
            middle = (safe + unsafe) / 2
        if middle in (safe, unsafe):
            break
        eps_middle = epsilon(middle)
        if eps_middle <= target:
            safe, eps_safe, g_safe = middle, eps_middle, gap(eps_middle)
            if safe_moved_last is True:
                g_unsafe /= 2  # Illinois step: the unsafe end has gone stale, pull towards it
            safe_moved_last = True
        else:
            unsafe, eps_unsafe, g_unsafe = middle, eps_middle, gap(eps_middle)
            if safe_moved_last is False:
                g_safe /= 2
            safe_moved_last = False
    if eps_safe >= floor:
        return safe
    raise PrivacyError(
        f"calibrate: epsilon jumps over [{floor:.6g}, {target:.6g}] (discontinuous in the parameter?); "
        f"best safe parameter {safe!r} gives epsilon={eps_safe:.6g}"
    )


# ----------------------------------------------------------------------------------------------------
# PATE aggregation: N Gaussian queries of L2 sensitivity S (docs/PRIVACY.md, "Mechanisms")
# ----------------------------------------------------------------------------------------------------


def paper_sigma(epsilon: float, delta: float, queries: int, sensitivity: float) -> float:
    """Fay et al. eq. (15): ``σ = sqrt(N)·S·(sqrt(ln(1/δ) + ε) + sqrt(ln(1/δ))) / (sqrt(2)·ε)``.

    The paper writes it for ``S = sqrt(d)/K`` (PCA bound); here S is any replace-one L2 sensitivity.
    It is the zCDP conversion of N Gaussians (ρ = N S²/(2σ²), ε = ρ + 2 sqrt(ρ ln 1/δ)) solved for σ,
    hence valid but looser than :func:`pate_sigma` ``mode="exact"``. (The box of Algorithm 1 has a typo;
    eq. 15 is the correct form.)
    """
    epsilon = positive_number("epsilon", epsilon)
    delta = _delta(delta)
    queries = int(positive_number("queries", queries))
    sensitivity = positive_number("sensitivity", sensitivity)
    log_inv = math.log(1.0 / delta)
    return (
        math.sqrt(queries) * sensitivity * (math.sqrt(log_inv + epsilon) + math.sqrt(log_inv)) / (math.sqrt(2.0) * epsilon)
    )


def pate_sigma(epsilon: float, delta: float, queries: int, sensitivity: float,
               mode: str = Calibration.EXACT) -> float:
    """σ per query so that N Gaussian queries of sensitivity S are (ε, δ)-DP.

    ``mode="exact"`` (default): the composition is exactly μ-GDP, μ = sqrt(N)·S/σ (Dong, Roth & Su 2019,
    arXiv 1905.02383); the largest μ with ``Φ(-ε/μ+μ/2) - e^ε Φ(-ε/μ-μ/2) ≤ δ`` is found by bisection and
    ``σ = sqrt(N)·S/μ`` (so ε(σ) ≤ target). ``mode="paper"``: Fay et al. eq. (15), :func:`paper_sigma`.
    Reference (ε=8, δ=1e-3, N=80, S=0.25): exact 1.0733, paper 1.2826.
    """
    if look_up_option(mode, Calibration, "mode") is Calibration.PAPER:
        return paper_sigma(epsilon, delta, queries, sensitivity)
    epsilon = positive_number("epsilon", epsilon)
    delta = _delta(delta)
    queries = int(positive_number("queries", queries))
    sensitivity = positive_number("sensitivity", sensitivity)
    # Aim a hair (1e-9 relative) below the target: ε(μ) is only determined to ~1e-12 in floating point,
    # and the accountant that later reads the ledger must also see ε ≤ target.
    mu = gdp_mu_for(epsilon * (1 - 1e-9), delta)
    sigma = math.sqrt(queries) * sensitivity / mu
    while gdp_epsilon(math.sqrt(queries) * sensitivity / sigma, delta) > epsilon:
        sigma *= 1 + 1e-9
    return sigma


def pate_sigma_for_accountant(
    epsilon: float, delta: float, queries: int, sensitivity: float, accountant: str = AccountantName.RDP
) -> float:
    """σ for N Gaussian queries calibrated with another accountant (``rdp``/``pld``/``zcdp``), for comparison."""
    epsilon = positive_number("epsilon", epsilon)
    guess = pate_sigma(epsilon, delta, queries, sensitivity)
    return calibrate(
        lambda s: GaussianEvent(sensitivity, s, int(queries)), epsilon, delta, accountant, guess / 2, guess * 2
    )


# ----------------------------------------------------------------------------------------------------
# DP-SGD (Abadi et al. 2016, arXiv 1607.00133)
# ----------------------------------------------------------------------------------------------------


def dpsgd_noise_multiplier(
    epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = AccountantName.PLD,
    value_discretization_interval: float | None = None,
    relation: str = Relation.ADD_REMOVE,
) -> float:
    """Noise multiplier z for ``steps`` Poisson-sampled DP-SGD steps at rate q to be (ε, δ)-DP under ``relation``.

    Example: q = 1/9, 90 steps, δ = 1e-3, ε = 8 needs z ≈ 0.799 under add/remove and z ≈ 1.02 under
    replace-one. One routine, :func:`calibrate`, does the search (through
    :func:`composed_dpsgd_noise_multiplier` with one run).

    Args:
        epsilon / delta: the target (ε, δ).
        sampling_rate: the Poisson sampling rate q (expected batch / dataset size).
        steps: the number of DP-SGD steps T.
        accountant: ``pld`` (default; dp_accounting's PLD, pessimistic) or ``rdp`` (add/remove only).
        value_discretization_interval: PLD's discretisation (None = ``min(1e-4, ε·1e-4)``, so the grid is ten
            times finer than the 1e-3 tolerance window); ignored by RDP.
        relation: ``add-remove`` (default; Opacus' convention) or ``replace-one`` (what comparisons and
            published dataset sizes need, docs/PRIVACY.md "Neighbouring relations": PLD only,
            dp_accounting's ``REPLACE_ONE`` sampled Gaussian; its RDP has none).
    """
    return composed_dpsgd_noise_multiplier(epsilon, delta, [(sampling_rate, steps)], accountant,
                                           value_discretization_interval, relation)


def composed_dpsgd_noise_multiplier(
    epsilon: float,
    delta: float,
    runs,
    accountant: str = AccountantName.PLD,
    value_discretization_interval: float | None = None,
    relation: str = Relation.ADD_REMOVE,
) -> float:
    """One noise multiplier z for several Poisson-sampled DP-SGD runs on the same data that together are
    (ε, δ)-DP under ``relation``: ``runs`` is a sequence of (sampling rate q_i, steps T_i), composed
    adaptively (ComposedEvent of the runs' SampledGaussianEvents).

    Why: a baseline whose hyperparameters are chosen from a grid of G settings trains G models on the
    private data; picking the one with the best *public* validation score is post-processing, but all G
    trainings are releases. Calibrating z for their composition makes the ledger's ε of all G runs equal
    the budget. With one run this is :func:`dpsgd_noise_multiplier`.

    Args:
        epsilon / delta: the target (ε, δ) of all runs together.
        runs: (sampling rate q_i, steps T_i) per run, at least one; runs at one rate are composed as one
            longer run.
        accountant: ``pld`` (default) or ``rdp`` (add/remove only).
        value_discretization_interval: PLD's discretisation (None = ``min(1e-4, ε·1e-4)``); ignored by RDP.
        relation: ``add-remove`` (default; Opacus' convention) or ``replace-one`` (PLD only).
    """
    epsilon = positive_number("epsilon", epsilon)
    if relation not in SAMPLED_RELATIONS:
        raise PrivacyError(f"relation must be one of {', '.join(SAMPLED_RELATIONS)} for Poisson-sampled DP-SGD, "
                           f"got {relation!r}")
    runs = [(float(q), int(steps)) for q, steps in runs]
    if not runs:
        raise PrivacyError("runs: expected at least one (sampling_rate, steps) pair")
    for q, steps in runs:
        SampledGaussianEvent(q, 1.0, steps)  # validates q and steps with named errors
    if accountant not in (AccountantName.PLD, AccountantName.RDP):
        raise PrivacyError(f"accountant must be 'pld' or 'rdp' for Poisson-sampled DP-SGD, got {accountant!r}")
    if relation == Relation.REPLACE_ONE and accountant != AccountantName.PLD:
        raise PrivacyError("accountant must be 'pld' for replace-one Poisson-sampled DP-SGD: dp_accounting's RDP "
                           "accountant has no Poisson subsampling under REPLACE_ONE")
    options = {}
    if accountant == AccountantName.PLD:
        options["value_discretization_interval"] = value_discretization_interval or min(
            DEFAULT_PLD_DISCRETIZATION, epsilon * 1e-4
        )

    steps_at_rate: dict[float, int] = {}   # runs at one rate are one longer run: same ε, one faster event
    for q, steps in runs:
        steps_at_rate[q] = steps_at_rate.get(q, 0) + steps

    def event(z: float, under: str) -> Event:
        events = [SampledGaussianEvent(q, z, steps, relation=under) for q, steps in steps_at_rate.items()]
        return events[0] if len(events) == 1 else ComposedEvent(tuple(events))

    # Start from the add/remove RDP answer (fast) so that PLD only needs a narrow bracket: under add/remove
    # PLD's z is below RDP's; under replace-one it was within 0.97-1.66 times it in the settings we tried
    # (calibrate widens the bracket when it has to). Brackets stay below 1.7x so calibrate does not try RDP.
    add_remove = lambda z: event(z, Relation.ADD_REMOVE)  # noqa: E731
    guess = calibrate(add_remove, epsilon, delta, AccountantName.RDP, 0.5, 2.0, rtol=1e-2)
    if accountant == AccountantName.RDP:
        return calibrate(add_remove, epsilon, delta, AccountantName.RDP, guess * 0.9, guess * 1.1)
    if relation == Relation.ADD_REMOVE:
        return calibrate(add_remove, epsilon, delta, AccountantName.PLD, guess * 0.9, guess * 1.02,
                         accountant_options=options)
    replace_one = lambda z: event(z, Relation.REPLACE_ONE)  # noqa: E731
    return calibrate(replace_one, epsilon, delta, AccountantName.PLD, guess * 0.9, guess * 1.5,
                     accountant_options=options)


def shuffled_noise_multiplier(epsilon: float, delta: float, epochs: int, relation: str = Relation.ZERO_OUT) -> float:
    """Noise multiplier for ``epochs`` shuffled disjoint-batch epochs (Yu et al.; zCDP).

    Each epoch is ``c/σ²``-zCDP with ``c = 1/2`` under zero-out adjacency (sensitivity C; Yu et al. Thm. 2)
    and ``c = 2`` under replace-one (sensitivity 2C), see :meth:`ZCDPEvent.shuffled_epochs`; epochs add and
    ``ε = ρ + 2 sqrt(ρ ln 1/δ)`` (Yu et al. Prop. 1): ``ρ = (sqrt(ln(1/δ)+ε) - sqrt(ln 1/δ))²`` and
    ``σ = sqrt(epochs·c / ρ)`` (replace-one: twice the zero-out σ). Closed form, safe side.
    """
    epsilon = positive_number("epsilon", epsilon)
    delta = _delta(delta)
    epochs = int(positive_number("epochs", epochs))
    per_unit = ZCDPEvent.shuffled_epoch_rho(1.0, relation)  # ρ of one epoch at σ = 1: c
    rho = zcdp_rho_for(epsilon, delta)
    sigma = math.sqrt(epochs * per_unit / rho)
    while zcdp_epsilon(ZCDPEvent.shuffled_epochs(sigma, epochs, relation).rho, delta) > epsilon:
        sigma *= 1 + 1e-12
    return sigma


# ----------------------------------------------------------------------------------------------------
# Private selection (Papernot & Steinke 2022): DP-SGD candidates + a noisy held-out score, repeated T times
# ----------------------------------------------------------------------------------------------------


def selection_event(sampling_rate: float, noise_multiplier: float, steps: int, score_sensitivity: float,
                    score_sigma: float, mean: float, shape: float | None, relation: str = Relation.REPLACE_ONE):
    """The ledger event of private selection: ``RepeatAndSelectEvent`` of one repetition =
    (at most ``steps`` Poisson-sampled DP-SGD steps at rate q and multiplier z) then (one Gaussian score of
    L2 sensitivity ``score_sensitivity`` and std ``score_sigma``), composed sequentially.

    Args:
        sampling_rate / noise_multiplier / steps: one repetition's DP-SGD: Poisson rate q, multiplier z and the
            most steps any candidate takes.
        score_sensitivity / score_sigma: the held-out score's sensitivity under ``relation`` and its noise std.
        mean / shape: the number of repetitions' distribution -- truncated negative binomial with shape η
            (1 geometric, 0 logarithmic) or Poisson (``shape=None``) -- and its mean.
        relation: the neighbouring relation of both parts (default replace-one).
    """
    inner = ComposedEvent((SampledGaussianEvent(sampling_rate, noise_multiplier, steps, relation=relation),
                           GaussianEvent(score_sensitivity, score_sigma, relation=relation)))
    return RepeatAndSelectEvent(inner, mean, shape)


@dataclass(frozen=True)
class PrivateSelection:
    """One private selection's plan apart from its noise multiplier (:func:`selection_event`): one repetition's
    DP-SGD -- Poisson ``sampling_rate`` q and the most ``steps`` any candidate takes -- then its held-out score of
    sensitivity ``score_sensitivity`` and (fixed) noise std ``score_sigma``; the repetitions' distribution -- truncated
    negative binomial of ``shape`` η (1 geometric, 0 logarithmic) or Poisson (``shape=None``) -- and its ``mean``;
    the ``relation`` of both parts (default replace-one)."""

    sampling_rate: float
    steps: int
    score_sensitivity: float
    score_sigma: float
    mean: float
    shape: float | None
    relation: str = Relation.REPLACE_ONE

    def __post_init__(self) -> None:
        self.event(1.0)   # the events check every parameter, each with its own named one-line error

    def event(self, noise_multiplier: float) -> RepeatAndSelectEvent:
        """The ledger event of the selection at DP-SGD multiplier z (:func:`selection_event`)."""
        return selection_event(self.sampling_rate, noise_multiplier, self.steps, self.score_sensitivity,
                               self.score_sigma, self.mean, self.shape, self.relation)


def private_selection_noise_multiplier(epsilon: float, delta: float, selection: PrivateSelection) -> float:
    """DP-SGD noise multiplier z so that the selection's event (:meth:`PrivateSelection.event`) is (ε, δ)-DP (RDP
    accountant; the only one that analyses repeated selection). The score's noise is fixed by the caller;
    PrivacyError when the score alone (z → ∞) already exceeds the budget.

    Args:
        epsilon / delta: the budget the whole selection event must fit.
        selection: the repetitions' DP-SGD, held-out score and distribution (:class:`PrivateSelection`).
    """
    epsilon = positive_number("epsilon", epsilon)
    floor = epsilon_spent([selection.event(1e6)], delta, accountant=AccountantName.RDP)[0]
    if floor >= epsilon:
        raise PrivacyError(f"private selection: the noisy score alone, repeated (mean {selection.mean}), spends "
                           f"ε={floor:.3g} >= budget {epsilon}; raise the score noise or the budget")
    # RDP's ε is a minimum over a finite set of orders, piecewise smooth in z: a 1 % window (safe side) avoids
    # the kinks that a 0.1 % window can fall between
    return calibrate(selection.event, epsilon, delta, AccountantName.RDP, 0.5, 4.0, rtol=1e-2)
