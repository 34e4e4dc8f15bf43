"""What every accountant shares: the :class:`Accountant` base class (check, then compose), the accountant names,
the (ε, δ) argument checks, and the closed-form conversions of μ-GDP and ρ-zCDP that accountants and calibration
both use."""

from __future__ import annotations

import abc
import math
from typing import Iterable

from scipy import optimize, special

from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import Event, GaussianEvent
from privacy.validation import non_negative_number, probability

ACCOUNTANTS = ("gdp-exact", "pld", "rdp", "rdp-filter", "zcdp", "basic")

#: Accountants valid under fully adaptive composition (privacy filters); see the package docstring
#: (``privacy.accountants``).
FILTER_ACCOUNTANTS = ("gdp-exact", "basic", "zcdp", "rdp-filter")


def _check_delta(delta: float) -> float:
    return probability("delta", delta)


def _check_epsilon(epsilon: float) -> float:
    return non_negative_number("epsilon", epsilon)


# ----------------------------------------------------------------------------------------------------
# Pure analysis functions: Gaussian differential privacy (Dong, Roth & Su 2019, arXiv 1905.02383)
# ----------------------------------------------------------------------------------------------------


def gdp_mu(events: Iterable[Event]) -> float:
    """μ of the exact GDP composition of un-subsampled Gaussians: ``μ = sqrt(Σ_i count_i·S_i²/σ_i²)``.

    Dong, Roth & Su 2019, Cor. 3.3 (μ_i-GDP mechanisms compose to sqrt(Σ μ_i²)-GDP). Raises
    UnsupportedEvent for anything that is not a (composition of) :class:`GaussianEvent`.
    """
    total = 0.0
    for event in events:
        for leaf in event.leaves():
            if not isinstance(leaf, GaussianEvent):
                raise UnsupportedEvent(f"gdp-exact accounts only GaussianEvent, got {type(leaf).__name__}")
            total += leaf.count * (leaf.sensitivity / leaf.sigma) ** 2
    return math.sqrt(total)


def gdp_delta(mu: float, epsilon: float) -> float:
    """Tight δ(ε) of μ-GDP: ``Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)`` (Balle & Wang 2018, Thm. 8).

    Computed in log space with ``log_ndtr`` so that large ε (where both terms underflow or cancel) stays
    accurate: ``δ = e^a (1 - e^{b-a})`` with ``a = log Φ(-ε/μ+μ/2)``, ``b = ε + log Φ(-ε/μ-μ/2)``.
    """
    epsilon = _check_epsilon(epsilon)
    if mu < 0 or math.isnan(mu):
        raise PrivacyError(f"mu must be non-negative, got {mu!r}")
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    log_a = special.log_ndtr(-epsilon / mu + mu / 2)
    log_b = epsilon + special.log_ndtr(-epsilon / mu - mu / 2)
    if log_b >= log_a:  # only by rounding; the true difference is positive
        return 0.0
    return float(math.exp(log_a) * -math.expm1(log_b - log_a))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ε with ``gdp_delta(mu, ε) ≤ delta`` (δ(ε) is decreasing; solved with brentq in log δ).

    The root is returned on the safe side: the result ε satisfies ``gdp_delta(mu, ε) ≤ delta``.
    """
    delta = _check_delta(delta)
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    log_delta = math.log(delta)

    def gap(eps: float) -> float:
        value = gdp_delta(mu, eps)
        return (math.log(value) if value > 0 else -math.inf) - log_delta

    hi = max(1.0, mu * mu / 2 + 2 * mu * math.sqrt(2 * math.log(1 / delta)) + 1)
    while gap(hi) > 0:
        hi *= 2
    eps = optimize.brentq(lambda e: max(gap(e), -1e3), 0.0, hi, xtol=1e-13, rtol=1e-15, maxiter=500)
    while gdp_delta(mu, eps) > delta:  # nudge onto the safe side of the root
        eps = eps * (1 + 1e-12) + 1e-15
    return float(eps)


def gdp_mu_for(epsilon: float, delta: float) -> float:
    """Largest μ with ``gdp_delta(μ, ε) ≤ δ`` (δ is increasing in μ); bisection, safe side."""
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    if epsilon == 0:
        raise PrivacyError("epsilon must be positive to calibrate, got 0")
    lo, hi = 0.0, 1.0
    while gdp_delta(hi, epsilon) <= delta:
        lo, hi = hi, hi * 2
        if hi > 1e8:
            raise PrivacyError(f"no finite mu found for epsilon={epsilon}, delta={delta}")
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if gdp_delta(mid, epsilon) <= delta:
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------------------------------------------
# zCDP (Yu et al.; Bun & Steinke 2016)
# ----------------------------------------------------------------------------------------------------


def zcdp_epsilon(rho: float, delta: float) -> float:
    """ρ-zCDP ⇒ (ρ + 2 sqrt(ρ ln(1/δ)), δ)-DP (Yu et al. Prop. 1; Bun & Steinke Prop. 1.3)."""
    delta = _check_delta(delta)
    if rho < 0:
        raise PrivacyError(f"rho must be non-negative, got {rho!r}")
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def zcdp_delta(rho: float, epsilon: float) -> float:
    """Inverse of :func:`zcdp_epsilon`: ``δ = exp(-(ε-ρ)²/(4ρ))`` for ε > ρ, else 1."""
    epsilon = _check_epsilon(epsilon)
    if rho == 0:
        return 0.0
    if epsilon <= rho:
        return 1.0
    return math.exp(-((epsilon - rho) ** 2) / (4.0 * rho))


def zcdp_rho_for(epsilon: float, delta: float) -> float:
    """Largest ρ whose (ε, δ) conversion is ``ε``: ``ρ = (sqrt(L+ε) - sqrt(L))²``, ``L = ln(1/δ)``."""
    epsilon = _check_epsilon(epsilon)
    log_inv = math.log(1.0 / _check_delta(delta))
    # (sqrt(L+ε) - sqrt(L))² rewritten as ε² / (sqrt(L+ε) + sqrt(L))² to avoid cancellation.
    return epsilon * epsilon / (math.sqrt(log_inv + epsilon) + math.sqrt(log_inv)) ** 2


# ----------------------------------------------------------------------------------------------------
# Stateful accountants
# ----------------------------------------------------------------------------------------------------


class Accountant(abc.ABC):
    """Accumulates events; ``compose`` checks with ``supports`` first and leaves state unchanged on refusal.

    One accountant accounts one neighbouring relation (``relation``, set by the first event). A subclass
    says which events it supports (``_supports_leaf``), how one is added to its state (``_apply``, which
    must itself leave the state unchanged when it raises) and how ε and δ are read from that state.
    """

    name = ""
    #: True when the accountant stays valid for adaptively chosen events (a privacy filter).
    filter_valid = False

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.relation: str | None = None

    def supports(self, event: Event) -> bool:
        return all(self._supports_leaf(leaf) for leaf in event.leaves())

    @abc.abstractmethod
    def _supports_leaf(self, event: Event) -> bool:
        """Whether one leaf event (not a composition) can be composed here."""

    def _why_not(self, event: Event) -> str:
        if event.adaptive and not self.filter_valid:
            return (
                f"the {self.name} accountant refuses adaptively chosen events (adaptive=True, "
                f"{type(event).__name__}): it assumes parameters fixed in advance; account them with a privacy "
                f"filter ({', '.join(FILTER_ACCOUNTANTS)})"
            )
        return f"the {self.name} accountant cannot account {type(event).__name__}"

    def _check(self, event: Event) -> None:
        """Refuse (before any state changes) an event this accountant cannot compose."""
        if not isinstance(event, Event):
            raise PrivacyError(f"compose expects a privacy event, got {event!r}")
        for leaf in event.leaves():
            if not self._supports_leaf(leaf):
                raise UnsupportedEvent(self._why_not(leaf))
        if self.relation is not None and event.relation != self.relation:
            raise PrivacyError(
                f"the {self.name} accountant holds {self.relation} events; an event under {event.relation} "
                "must not be added to them (account each neighbouring relation separately)"
            )

    def compose(self, event: Event) -> "Accountant":
        """Add one event (refused, state unchanged, if this accountant cannot account it)."""
        self._check(event)
        self._apply(event)
        self.events.append(event)
        self.relation = event.relation
        return self

    def compose_all(self, events: Iterable[Event]) -> "Accountant":
        """Add ``events`` in order (each checked before it is applied)."""
        for event in events:
            self.compose(event)
        return self

    @abc.abstractmethod
    def _apply(self, event: Event) -> None:
        """Add an already checked event to the state."""

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """ε of everything composed, at ``delta``."""

    @abc.abstractmethod
    def get_delta(self, epsilon: float) -> float:
        """δ of everything composed, at ``epsilon``."""
