"""Privacy accountants: pure analysis functions plus thin stateful classes.

Style follows Opacus (pure ``analysis`` functions) and dp_accounting (``supports`` / ``compose``: an event
is checked *before* it is applied, and a rejected event leaves the accountant unchanged).

=========== ============================================================ ======================
name        what it accounts                                             source
=========== ============================================================ ======================
gdp-exact   un-subsampled Gaussians (heterogeneous S, σ): exact μ-GDP     SPEC §5; Dong, Roth &
            ``μ = sqrt(Σ count·S²/σ²)``, ``δ(ε) = Φ(-ε/μ+μ/2) -          Su 2019; Balle & Wang
            e^ε Φ(-ε/μ-μ/2)``                                             2018 Thm. 8
pld         dp_accounting privacy-loss distributions (sampled Gaussian,   dp_accounting
            Gaussian, Laplace); pessimistic discretisation
rdp         dp_accounting RDP with the improved RDP→DP conversion         Balle et al. 2020
            (sampled Gaussian, Gaussian, Laplace, zCDP)
zcdp        ρ-zCDP: shuffled epochs, Gaussians (ρ = S²/2σ²), pure ε       Yu et al. Prop. 1-2,
            (ρ = ε²/2); ``ε = ρ + 2 sqrt(ρ ln 1/δ)``                      Thm. 1-2; Bun & Steinke
basic       pure ε (Laplace, PureDP): ε = Σ ε_i, δ = 0                     Dwork et al.
=========== ============================================================ ======================
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from scipy import optimize, special

from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import (
    Event,
    GaussianEvent,
    LaplaceEvent,
    PureDPEvent,
    SampledGaussianEvent,
    ZCDPEvent,
)

ACCOUNTANTS = ("gdp-exact", "pld", "rdp", "zcdp", "basic")

#: PLD value discretisation (privacy-loss grid). 1e-4 keeps ε within ~1e-3 of the continuous value for
#: the compositions fedpate runs (hundreds to thousands of steps) while staying fast.
DEFAULT_PLD_DISCRETIZATION = 1e-4


def _check_delta(delta: float) -> float:
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise PrivacyError(f"delta must be a number in (0, 1), got {delta!r}") from None
    if not (0 < value < 1):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")
    return value


def _check_epsilon(epsilon: float) -> float:
    try:
        value = float(epsilon)
    except (TypeError, ValueError):
        raise PrivacyError(f"epsilon must be a non-negative number, got {epsilon!r}") from None
    if not (value >= 0) or math.isnan(value):
        raise PrivacyError(f"epsilon must be a non-negative number, got {epsilon!r}")
    return value


# ----------------------------------------------------------------------------------------------------
# Pure analysis functions: Gaussian differential privacy (SPEC §5)
# ----------------------------------------------------------------------------------------------------


def gdp_mu(events: Iterable[Event]) -> float:
    """μ of the exact GDP composition of un-subsampled Gaussians: ``μ = sqrt(Σ_i count_i·S_i²/σ_i²)``.

    Dong, Roth & Su 2019, Cor. 3.3 (μ_i-GDP mechanisms compose to sqrt(Σ μ_i²)-GDP); SPEC §5. Raises
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
    """Largest μ with ``gdp_delta(μ, ε) ≤ δ`` (δ is increasing in μ); bisection, safe side (SPEC §5)."""
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


class Accountant:
    """Accumulates events; ``compose`` checks with ``supports`` first and leaves state unchanged on refusal."""

    name = ""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def supports(self, event: Event) -> bool:
        return all(self._supports_leaf(leaf) for leaf in event.leaves())

    def _supports_leaf(self, event: Event) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def _why_not(self, event: Event) -> str:
        return f"the {self.name} accountant cannot account {type(event).__name__}"

    def compose(self, event: Event) -> "Accountant":
        if not isinstance(event, Event):
            raise PrivacyError(f"compose expects a privacy event, got {event!r}")
        for leaf in event.leaves():
            if not self._supports_leaf(leaf):
                raise UnsupportedEvent(self._why_not(leaf))
        self._apply(event)
        self.events.append(event)
        return self

    def _apply(self, event: Event) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_epsilon(self, delta: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_delta(self, epsilon: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


class GaussianGDPAccountant(Accountant):
    """Exact accounting of un-subsampled Gaussians through μ-GDP (SPEC §5)."""

    name = "gdp-exact"

    def __init__(self) -> None:
        super().__init__()
        self.mu_squared = 0.0

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, GaussianEvent)

    def _apply(self, event: Event) -> None:
        self.mu_squared += gdp_mu([event]) ** 2

    @property
    def mu(self) -> float:
        return math.sqrt(self.mu_squared)

    def get_epsilon(self, delta: float) -> float:
        return gdp_epsilon(self.mu, delta)

    def get_delta(self, epsilon: float) -> float:
        return gdp_delta(self.mu, epsilon)


class _DpAccountingWrapper(Accountant):
    """Shared plumbing for accountants that delegate to a dp_accounting ``PrivacyAccountant``.

    The inner accountant uses ``ADD_OR_REMOVE_ONE`` because our events carry the sensitivity under their
    own relation explicitly (see privacy/events.py); un-subsampled mechanisms then have the same PLD under
    either relation, and Poisson-sampled events are add/remove by construction.
    """

    def _make_inner(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self._inner = self._make_inner()

    def compose(self, event: Event) -> "Accountant":
        if not isinstance(event, Event):
            raise PrivacyError(f"compose expects a privacy event, got {event!r}")
        for leaf in event.leaves():
            if not self._supports_leaf(leaf):
                raise UnsupportedEvent(self._why_not(leaf))
        dp_event = event.to_dp_accounting()
        # dp_accounting's own check, also before anything is applied (its compose is all-or-nothing only
        # after this check passes).
        if not self._inner.supports(dp_event):
            raise UnsupportedEvent(self._why_not(event))
        self._inner.compose(dp_event)
        self.events.append(event)
        return self

    def get_epsilon(self, delta: float) -> float:
        delta = _check_delta(delta)
        if not self.events:
            return 0.0
        return float(self._inner.get_epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        epsilon = _check_epsilon(epsilon)
        if not self.events:
            return 0.0
        return float(self._inner.get_delta(epsilon))


class PLDAccountant(_DpAccountingWrapper):
    """dp_accounting's PLD accountant (pessimistic discretisation, so ε is an upper bound).

    Supports Poisson-sampled Gaussians (DP-SGD), Gaussians and Laplace; not zCDP or bare pure-ε events.
    """

    name = "pld"

    def __init__(self, value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION) -> None:
        self.value_discretization_interval = float(value_discretization_interval)
        super().__init__()

    def _make_inner(self):
        from dp_accounting.pld import pld_privacy_accountant

        return pld_privacy_accountant.PLDAccountant(
            value_discretization_interval=self.value_discretization_interval
        )

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, (GaussianEvent, SampledGaussianEvent, LaplaceEvent))

    def _why_not(self, event: Event) -> str:
        return f"the pld accountant cannot account {type(event).__name__} (use zcdp or basic)"


class _DropNonConvergingOrders:
    """dp_accounting logs one warning per fractional order whose series does not converge (small sigma,
    orders 1.1-1.6) and excludes that order: epsilon stays a valid upper bound, so the warning is noise
    in every DP-SGD log. Only that message is dropped."""

    def filter(self, record) -> bool:
        return "_compute_log_a_frac failed to converge" not in str(record.msg)


def _quiet_nonconverging_orders() -> None:
    import logging

    for name in ("absl", ""):  # dp_accounting logs through absl, which forwards to the "absl" logger
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNonConvergingOrders) for f in logger.filters):
            logger.addFilter(_DropNonConvergingOrders())


class RDPAccountant(_DpAccountingWrapper):
    """dp_accounting's RDP accountant; ε uses the improved conversion (Balle et al. 2020, Prop. 12)."""

    name = "rdp"

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        self.orders = orders
        super().__init__()

    def _make_inner(self):
        from dp_accounting.rdp import rdp_privacy_accountant

        _quiet_nonconverging_orders()
        return rdp_privacy_accountant.RdpAccountant(orders=self.orders)

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, (GaussianEvent, SampledGaussianEvent, LaplaceEvent, ZCDPEvent))


class ZCDPAccountant(Accountant):
    """ρ-zCDP accounting matched to *shuffled* batching (Yu et al. Sec. IV-B-1).

    Supports ``ZCDPEvent`` (e.g. :meth:`ZCDPEvent.shuffled_epochs`), ``GaussianEvent`` (ρ = count·S²/(2σ²),
    Yu et al. Prop. 2) and pure-ε events (ε-DP ⇒ ε²/2-zCDP, Bun & Steinke Prop. 1.4). It refuses
    ``SampledGaussianEvent``: a Poisson-sampled step is not a shuffled epoch, and zCDP cannot express its
    amplification (Yu et al. Sec. IV-B-2) — account those with pld or rdp.
    """

    name = "zcdp"

    def __init__(self) -> None:
        super().__init__()
        self.rho = 0.0

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, (ZCDPEvent, GaussianEvent, LaplaceEvent, PureDPEvent))

    def _why_not(self, event: Event) -> str:
        if isinstance(event, SampledGaussianEvent):
            return (
                "the zcdp accountant refuses SampledGaussianEvent: Poisson sampling is not shuffled batching "
                "(Yu et al.); account it with pld or rdp, or record shuffled epochs as ZCDPEvent"
            )
        return super()._why_not(event)

    @staticmethod
    def rho_of(event: Event) -> float:
        total = 0.0
        for leaf in event.leaves():
            if isinstance(leaf, ZCDPEvent):
                total += leaf.rho
            elif isinstance(leaf, GaussianEvent):
                total += leaf.count * (leaf.sensitivity / leaf.sigma) ** 2 / 2.0
            elif isinstance(leaf, LaplaceEvent):
                total += leaf.count * (leaf.sensitivity / leaf.scale) ** 2 / 2.0
            elif isinstance(leaf, PureDPEvent):
                total += leaf.epsilon**2 / 2.0
            else:
                raise UnsupportedEvent(f"the zcdp accountant cannot account {type(leaf).__name__}")
        return total

    def _apply(self, event: Event) -> None:
        self.rho += self.rho_of(event)

    def get_epsilon(self, delta: float) -> float:
        return zcdp_epsilon(self.rho, delta)

    def get_delta(self, epsilon: float) -> float:
        return zcdp_delta(self.rho, epsilon)


class PureDPAccountant(Accountant):
    """Basic composition of pure-ε mechanisms: ``ε = Σ ε_i``, δ = 0 (Dwork et al. 2006)."""

    name = "basic"

    def __init__(self) -> None:
        super().__init__()
        self.epsilon = 0.0

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, (LaplaceEvent, PureDPEvent))

    def _apply(self, event: Event) -> None:
        self.epsilon += sum(leaf.epsilon for leaf in event.leaves())

    def get_epsilon(self, delta: float) -> float:
        return self.epsilon

    def get_delta(self, epsilon: float) -> float:
        # Basic composition only certifies (Σε, 0); for a smaller ε it certifies nothing (δ = 1).
        return 0.0 if _check_epsilon(epsilon) >= self.epsilon else 1.0


_FACTORIES = {
    "gdp-exact": GaussianGDPAccountant,
    "pld": PLDAccountant,
    "rdp": RDPAccountant,
    "zcdp": ZCDPAccountant,
    "basic": PureDPAccountant,
}


def make_accountant(name: str, **options) -> Accountant:
    """A fresh accountant by name (one of ``ACCOUNTANTS``)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise PrivacyError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}")
    return factory(**options)


def accountant_for(events: Iterable[Event]) -> Accountant:
    """The tightest exact accountant that supports all ``events`` (fresh, not yet composed).

    gdp-exact if all are Gaussians; basic if all are pure ε; zcdp if any is a ZCDPEvent (shuffled epochs)
    and the rest convert; otherwise pld; then rdp; zcdp last (e.g. Gaussians mixed with pure-ε events).
    Raises UnsupportedEvent when no accountant fits (e.g. shuffled ZCDPEvent mixed with Poisson events).
    """
    leaves = [leaf for event in events for leaf in event.leaves()]
    if not leaves:
        return GaussianGDPAccountant()
    order = ["gdp-exact", "basic"]
    if any(isinstance(leaf, ZCDPEvent) for leaf in leaves):
        order.append("zcdp")
    order += ["pld", "rdp", "zcdp"]
    for name in order:
        candidate = make_accountant(name)
        if all(candidate._supports_leaf(leaf) for leaf in leaves):
            return candidate
    kinds = sorted({type(leaf).__name__ for leaf in leaves})
    raise UnsupportedEvent(f"no single accountant supports the combination {kinds}")


def epsilon_spent(events: Sequence[Event], delta: float, accountant: str | None = None) -> tuple[float, str]:
    """ε at ``delta`` of the composition of ``events``; returns ``(epsilon, accountant name)``."""
    events = list(events)
    acc = accountant_for(events) if accountant is None else make_accountant(accountant)
    for event in events:
        acc.compose(event)
    return acc.get_epsilon(delta), acc.name
