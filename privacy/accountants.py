"""Privacy accountants: pure analysis functions plus thin stateful classes.

Style follows Opacus (pure ``analysis`` functions) and dp_accounting (``supports`` / ``compose``: an event
is checked *before* it is applied, and a rejected event leaves the accountant unchanged).

=========== ============================================================ ======================
name        what it accounts                                             source
=========== ============================================================ ======================
gdp-exact   un-subsampled Gaussians (heterogeneous S, σ): exact μ-GDP     Dong, Roth & Su 2019;
            ``μ = sqrt(Σ count·S²/σ²)``, ``δ(ε) = Φ(-ε/μ+μ/2) -          Balle & Wang 2018
            e^ε Φ(-ε/μ-μ/2)``                                             Thm. 8
pld         dp_accounting privacy-loss distributions (sampled Gaussian    dp_accounting
            under add/remove or replace-one, Gaussian, Laplace);
            pessimistic discretisation
rdp         dp_accounting RDP with the improved RDP→DP conversion         Balle et al. 2020;
            (add/remove sampled Gaussian, Gaussian, Laplace, zCDP;        Papernot & Steinke
            private selection, RepeatAndSelectEvent)                     2022
rdp-filter  the same RDP curves under a Rényi filter: valid when event    Feldman & Zrnic 2021;
            parameters are chosen adaptively (see RDPFilterAccountant)    Lécuyer 2021
zcdp        ρ-zCDP: shuffled epochs, Gaussians (ρ = S²/2σ²), pure ε       Yu et al. Prop. 1-2,
            (ρ = ε²/2); ``ε = ρ + 2 sqrt(ρ ln 1/δ)``                      Thm. 1-2; Bun & Steinke
basic       pure ε (Laplace, PureDP): ε = Σ ε_i, δ = 0                     Dwork et al.
split:a+b   events no single tight accountant covers (PLD-accounted      Dwork & Roth 2014
            releases beside a secure sum's discrete Gaussians): each      Thm. 3.16
            family by its own accountant at δ/G, added up; the smaller
            of that and rdp over all (SplitDeltaAccountant)
=========== ============================================================ ======================

Neighbouring relations: an accountant accounts one relation (the first event's); composing an event
under another raises PrivacyError. Poisson-sampled Gaussians under replace-one are accounted exactly by
``pld`` (dp_accounting's ``NeighboringRelation.REPLACE_ONE``); dp_accounting's RDP accountant refuses them,
ours (``rdp``, not the filter) adds a valid but looser curve from the weak triangle inequality
(:func:`replace_one_sampled_gaussian_rdp`), so that a lifetime ledger mixing them with events PLD cannot
account (the distributed discrete Gaussian of a secure sum) still has an accountant.

Adaptively chosen events (``event.adaptive``: parameters picked from earlier outputs, e.g. the
validation-driven DP-SGD schedule) are composed only by accountants that remain valid under *fully
adaptive* composition when the budget guard stops before the budget would be exceeded (a privacy filter,
Rogers et al. 2016): ``gdp-exact`` (Gaussian-DP filter, Smith & Thakurta 2022), ``zcdp`` (ρ adds; a
Rényi filter at every order, Feldman & Zrnic 2021), ``basic`` (pure-ε filter, Rogers et al. 2016) and
``rdp-filter``. ``pld`` and ``rdp`` refuse them: the PLD of a composition, and the choice of the best
RDP order after the fact, both assume parameters fixed in advance.
"""

from __future__ import annotations

import abc
import logging
import math
from typing import Iterable, Sequence

from scipy import optimize, special

from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.options import AccountantName, Relation
from privacy.events import (
    ComposedEvent,
    DistributedDiscreteGaussianEvent,
    Event,
    GaussianEvent,
    LaplaceEvent,
    PureDPEvent,
    RepeatAndSelectEvent,
    SampledGaussianEvent,
    ZCDPEvent,
)
from privacy.validation import non_negative_number, probability

ACCOUNTANTS = ("gdp-exact", "pld", "rdp", "rdp-filter", "zcdp", "basic")

#: Accountants valid under fully adaptive composition (privacy filters); see the module docstring.
FILTER_ACCOUNTANTS = ("gdp-exact", "basic", "zcdp", "rdp-filter")

#: RDP orders of the Rényi filter: fixed in advance and few, because the filter pays ln|orders| in ln(1/δ).
FILTER_RDP_ORDERS = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0,
                     48.0, 64.0, 128.0, 256.0)

#: PLD value discretisation (privacy-loss grid). 1e-4 keeps ε within ~1e-3 of the continuous value for
#: the compositions fedpate runs (hundreds to thousands of steps) while staying fast.
DEFAULT_PLD_DISCRETIZATION = 1e-4


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


class GaussianGDPAccountant(Accountant):
    """Exact accounting of un-subsampled Gaussians through μ-GDP (Dong, Roth & Su 2019, arXiv 1905.02383).

    Filter-valid: with σ_i chosen adaptively, stopping before ``sqrt(Σ μ_i²)`` exceeds μ keeps the run μ-GDP
    (Smith & Thakurta 2022, fully adaptive composition for Gaussian DP), and ε(μ) is increasing in μ.
    """

    name = "gdp-exact"
    filter_valid = True

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

    The inner accountant runs under ``ADD_OR_REMOVE_ONE`` (``_inner_relation = "add-remove"``) while it
    only holds events whose analysis does not depend on the relation (un-subsampled mechanisms carry their
    sensitivity under their own relation explicitly, see privacy/events.py) or add/remove Poisson-sampled
    events. A replace-one Poisson-sampled event needs ``REPLACE_ONE``: then (PLD only) a new inner
    accountant is built under ``REPLACE_ONE`` and everything held is composed again, each event converted
    by ``Event.to_dp_accounting("replace-one")`` (an explicit Gaussian sensitivity S becomes the norm bound
    S/2 that REPLACE_ONE doubles). PLD composition commutes, so the order of the events does not matter.
    """

    @abc.abstractmethod
    def _make_inner(self, relation: str):
        """A fresh dp_accounting accountant under ``relation``."""

    def __init__(self, inner_relation: str = Relation.ADD_REMOVE) -> None:
        super().__init__()
        self._inner_relation = inner_relation
        self._inner = self._make_inner(inner_relation)

    def _inner_relation_for(self, event: Event) -> str:
        """The inner relation needed once ``event`` is held as well (a relation, once replace-one, stays)."""
        return self._inner_relation

    def compose_all(self, events: Iterable[Event]) -> "Accountant":
        """Add ``events``; identical ones are composed as one self-composition (``count``).

        Why: a hospital's lifetime ledger holds hundreds of identical releases (PATE's queries at one σ,
        DP-SGD's epochs at one σ); composing a PLD event by event took 25 s for 244 of them, while
        dp_accounting's ``compose(event, count)`` self-composes in one step. Composition commutes (PLD and
        RDP alike), so grouping equal events regardless of their order gives the same guarantee.
        """
        events = list(events)
        groups: dict[Event, int] = {}
        held = self.relation
        try:
            for event in events:   # every event checked, against the relation of those before it too
                self._check(event)
                self.relation = event.relation
                groups[event] = groups.get(event, 0) + 1
        finally:
            self.relation = held
        for event, count in groups.items():
            self._apply(event, count)
            self.events.extend([event] * count)
            self.relation = event.relation
        return self

    def _apply(self, event: Event, count: int = 1) -> None:
        target = self._inner_relation_for(event)
        inner, pending = self._inner, {event: count}
        if target != self._inner_relation:
            inner, pending = self._make_inner(target), {}
            for item in [*self.events, *[event] * count]:
                pending[item] = pending.get(item, 0) + 1
        try:
            dp_events = [(item.to_dp_accounting(target), n) for item, n in pending.items()]
        except UnsupportedEvent as exc:
            raise UnsupportedEvent(f"the {self.name} accountant (dp_accounting under {target}): {exc}") from None
        # dp_accounting's own check, also before anything is applied (its compose is all-or-nothing only
        # after this check passes).
        for dp_event, _ in dp_events:
            if not inner.supports(dp_event):
                raise UnsupportedEvent(self._why_not(event))
        for dp_event, n in dp_events:
            inner.compose(dp_event, n)
        self._inner, self._inner_relation = inner, target

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


def _dp_accounting_relation(relation: str):
    # dp_accounting (~2 s to import) only when an accountant delegates to it: `fedpate privacy` and the
    # gdp-exact / zcdp / basic accountants never pay for it
    from dp_accounting.privacy_accountant import NeighboringRelation

    return {Relation.ADD_REMOVE: NeighboringRelation.ADD_OR_REMOVE_ONE,
            Relation.REPLACE_ONE: NeighboringRelation.REPLACE_ONE}[relation]


_EVENT_PLD_CACHE_SIZE = 32   # a replace-one DP-SGD epoch's PLD is ~2 MB at the default discretisation
_event_plds: "dict[tuple, object]" = {}
_caching_class = None


def _event_pld_caching_accountant_class():
    """dp_accounting's PLDAccountant, remembering the PLD of each (event, count) it has built.

    Why: a budget guard charges the same event over and over — every DP-SGD epoch or DP-FedAvg round at
    one σ, to the cell's ledger and to each hospital's lifetime ledger, once to check and once to record.
    dp_accounting rebuilds the event's PLD every time (0.7-1.1 s for a replace-one sampled Gaussian at
    σ≈0.9), which made the ε=8 cells of a comparison 2-3 minutes slower than the ε=1 ones. The cached PLD
    is the one dp_accounting itself built for that event (a fresh accountant's identity PLD composed with
    it), so the guarantee is dp_accounting's; only the composition with what is held is redone.
    Only subclasses ``_maybe_compose``, dp_accounting's extension point, and reads its ``_pld``.
    """
    global _caching_class
    if _caching_class is not None:
        return _caching_class
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    cacheable = (dp_event.GaussianDpEvent, dp_event.PoissonSampledDpEvent, dp_event.LaplaceDpEvent)

    class EventPLDCachingAccountant(pld_privacy_accountant.PLDAccountant):
        def _maybe_compose(self, event, count, do_compose):
            if not do_compose or not isinstance(event, cacheable):
                return super()._maybe_compose(event, count, do_compose)
            key = (event, count, self.neighboring_relation, self._value_discretization_interval)
            built = _event_plds.get(key)
            if built is None:
                alone = pld_privacy_accountant.PLDAccountant(self.neighboring_relation,
                                                             self._value_discretization_interval)
                error = alone._maybe_compose(event, count, do_compose=True)
                if error is not None:
                    return error
                built = (alone._contains_non_dp_event, alone._pld)
                if len(_event_plds) >= _EVENT_PLD_CACHE_SIZE:
                    _event_plds.pop(next(iter(_event_plds)))   # oldest first
                _event_plds[key] = built
            non_dp, pld = built
            if non_dp:
                self._contains_non_dp_event = True
            else:
                self._pld = self._pld.compose(pld)
            return None

    _caching_class = EventPLDCachingAccountant
    return _caching_class


class PLDAccountant(_DpAccountingWrapper):
    """dp_accounting's PLD accountant (pessimistic discretisation, so ε is an upper bound).

    Supports Poisson-sampled Gaussians (DP-SGD) under add/remove (``ADD_OR_REMOVE_ONE``) or replace-one
    (``REPLACE_ONE``: the sampled mixture ``q·N(-C)+(1-q)·N(0)`` against ``q·N(C)+(1-q)·N(0)``), Gaussians
    and Laplace; not zCDP, bare pure-ε events, or adaptively chosen events. Laplace has no dp_accounting PLD
    under REPLACE_ONE, so it cannot share an accountant with replace-one Poisson-sampled events.
    ``neighboring_relation`` pins the inner dp_accounting relation from the start (for cross-checks);
    by default it follows the events (see :class:`_DpAccountingWrapper`).
    """

    name = "pld"

    def __init__(
        self, value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION, neighboring_relation: str | None = None
    ) -> None:
        self.value_discretization_interval = float(value_discretization_interval)
        if neighboring_relation not in (None, Relation.ADD_REMOVE, Relation.REPLACE_ONE):
            raise PrivacyError(f"neighboring_relation must be add-remove or replace-one, got {neighboring_relation!r}")
        super().__init__(neighboring_relation or Relation.ADD_REMOVE)

    def _make_inner(self, relation: str):
        # dp_accounting only when this accountant is built (see _dp_accounting_relation)
        return _event_pld_caching_accountant_class()(
            neighboring_relation=_dp_accounting_relation(relation),
            value_discretization_interval=self.value_discretization_interval,
        )

    def _inner_relation_for(self, event: Event) -> str:
        if any(isinstance(leaf, SampledGaussianEvent) and leaf.relation == Relation.REPLACE_ONE
               for leaf in event.leaves()):
            return Relation.REPLACE_ONE
        return self._inner_relation

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, (GaussianEvent, SampledGaussianEvent, LaplaceEvent)) and not event.adaptive

    def _why_not(self, event: Event) -> str:
        if event.adaptive:
            return super()._why_not(event)
        return f"the pld accountant cannot account {type(event).__name__} (use zcdp or basic)"


class _DropNonConvergingOrders:
    """dp_accounting logs one warning per fractional order whose series does not converge (small sigma,
    orders 1.1-1.6) and excludes that order: epsilon stays a valid upper bound, so the warning is noise
    in every DP-SGD log. Only that message is dropped."""

    def filter(self, record) -> bool:
        return "_compute_log_a_frac failed to converge" not in str(record.msg)


def _quiet_nonconverging_orders() -> None:
    for name in ("absl", ""):  # dp_accounting logs through absl, which forwards to the "absl" logger
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNonConvergingOrders) for f in logger.filters):
            logger.addFilter(_DropNonConvergingOrders())


class RDPAccountant(_DpAccountingWrapper):
    """dp_accounting's RDP accountant; ε uses the improved conversion (Balle et al. 2020, Prop. 12).

    The inner accountant stays ``ADD_OR_REMOVE_ONE``: dp_accounting's RDP reads an un-subsampled Gaussian's
    multiplier as σ/S under any relation, and it has no Poisson-sampled Gaussian under REPLACE_ONE
    (``rdp_privacy_accountant.RdpAccountant`` refuses it) — so replace-one Poisson-sampled events are refused
    here too (account them with pld).
    """

    name = "rdp"

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        self.orders = orders
        super().__init__()

    def _make_inner(self, relation: str):
        # dp_accounting only when this accountant is built (see _dp_accounting_relation)
        from dp_accounting.rdp import rdp_privacy_accountant

        _quiet_nonconverging_orders()
        return rdp_privacy_accountant.RdpAccountant(orders=self.orders)

    def _supports_leaf(self, event: Event) -> bool:
        if event.adaptive and not self.filter_valid:
            return False
        if isinstance(event, RepeatAndSelectEvent):
            # its own base curve (base_rdp_curve): replace-one Poisson sampling through the weak triangle
            return all(isinstance(leaf, (GaussianEvent, SampledGaussianEvent, LaplaceEvent, ZCDPEvent))
                       for leaf in event.inner.leaves())
        if isinstance(event, SampledGaussianEvent):
            # replace-one: the weak-triangle curve (replace_one_sampled_gaussian_rdp), only where the best order
            # is chosen after the fact for a fixed sequence (not in the filter, whose orders are few and fixed)
            return event.relation == Relation.ADD_REMOVE or not self.filter_valid
        return isinstance(event, (GaussianEvent, LaplaceEvent, ZCDPEvent, DistributedDiscreteGaussianEvent))

    def _apply(self, event: Event, count: int = 1) -> None:
        if (not self.filter_valid and not isinstance(event, RepeatAndSelectEvent)
                and any(isinstance(leaf, SampledGaussianEvent) and leaf.relation == Relation.REPLACE_ONE
                        for leaf in event.leaves())):
            # dp_accounting's RDP has no replace-one Poisson subsampling: add the weak-triangle curve of each
            # such leaf to its composed curve (as for the repeated selection below), the rest through it
            curve = 0.0
            rest = []
            for leaf in event.leaves():
                if isinstance(leaf, SampledGaussianEvent) and leaf.relation == Relation.REPLACE_ONE:
                    curve = curve + replace_one_sampled_gaussian_rdp(leaf.sampling_rate, leaf.noise_multiplier,
                                                                     leaf.steps, self._inner.orders)
                else:
                    rest.append(leaf)
            if rest:
                super()._apply(ComposedEvent(tuple(rest)), count)
            self._inner._rdp = self._inner._rdp + count * curve
            return
        if not isinstance(event, RepeatAndSelectEvent):
            return super()._apply(event, count)
        # dp_accounting's RdpAccountant keeps the composed curve in _rdp (it has a read-only ``rdp`` property
        # and no way to compose a curve): the repeated selection's curve is added there, at its own orders.
        curve = repeat_and_select_rdp(event, self._inner.orders)
        self._inner._rdp = self._inner._rdp + count * curve

    def _why_not(self, event: Event) -> str:
        if isinstance(event, SampledGaussianEvent) and event.relation != Relation.ADD_REMOVE:
            return (
                f"the {self.name} accountant refuses Poisson-sampled Gaussians under {event.relation}: "
                "dp_accounting's RDP accountant supports Poisson subsampling only under ADD_OR_REMOVE_ONE "
                "(account replace-one DP-SGD with pld)"
            )
        return super()._why_not(event)


class RDPFilterAccountant(RDPAccountant):
    """RDP under a Rényi *filter*: valid when event parameters are chosen adaptively from earlier outputs.

    Feldman & Zrnic 2021 (Sec. 3, the Rényi filter): if the privacy parameters ρ_t(α) are chosen adaptively
    and the run stops before ``Σ_t ρ_t(α)`` would exceed a budget B_α fixed in advance, the whole run is
    (α, B_α)-RDP — for *one* order α. Choosing the best order after the fact (what ``rdp`` does) is not
    covered, so this accountant pays for its fixed set of orders Λ (:data:`FILTER_RDP_ORDERS`) with a union
    bound, as Lécuyer 2021 does for filters over several orders: with the privacy loss L_T of the stopped
    run and ``M_t = exp((α-1)(L_t - Σ_{s≤t} ρ_s(α)))`` a non-negative supermartingale (one per α),

    ``E[(1 - e^{ε-L_T})_+] ≤ Σ_{α∈Λ} E[(1 - e^{ε-L_T})_+ · 1{α is the first order within B_α}]
    ≤ Σ_α (1/α)(1-1/α)^{α-1} e^{(α-1)(B_α-ε)}``

    (the pointwise bound behind Balle et al. 2020, Prop. 12, and ``E[M_T] ≤ 1``). Taking each term ≤ δ/|Λ|:
    the run is (ε, δ)-DP if, when it stops, *some* α ∈ Λ has

    ``Σ ρ_t(α) + ln(1 - 1/α) - ln(α·δ/|Λ|)/(α - 1) ≤ ε``,

    which is the ε reported here (the minimum over Λ of the left side). The budget guard refuses the event
    that would take it past the budget, which makes the guard this filter. Note for results: the (ε, δ)
    guarantee of an adaptively stopped run is the *budget* the filter enforced; the ε of the realised
    sequence reported here is at most that.
    """

    name = "rdp-filter"
    filter_valid = True

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        super().__init__(orders=tuple(orders) if orders is not None else FILTER_RDP_ORDERS)
        if min(self.orders) <= 1.0:
            raise PrivacyError(f"rdp-filter: orders must be > 1, got {min(self.orders)}")

    def _curve(self):
        # dp_accounting keeps the composed RDP curve in _rdp over _orders (RdpAccountant has no public getter)
        return self._inner._orders, self._inner._rdp

    def get_epsilon(self, delta: float) -> float:
        delta = _check_delta(delta)
        if not self.events:
            return 0.0
        orders, rdp = self._curve()
        share = math.log(delta / len(orders))
        values = [r + math.log1p(-1.0 / a) - (share + math.log(a)) / (a - 1) for a, r in zip(orders, rdp)]
        return float(max(0.0, min(values)))

    def get_delta(self, epsilon: float) -> float:
        epsilon = _check_epsilon(epsilon)
        if not self.events:
            return 0.0
        orders, rdp = self._curve()
        logs = [(a - 1) * (r - epsilon + math.log1p(-1.0 / a)) - math.log(a) for a, r in zip(orders, rdp)]
        return float(min(1.0, len(orders) * math.exp(min(logs))))


def replace_one_sampled_gaussian_rdp(sampling_rate: float, noise_multiplier: float, steps: int, orders):
    """RDP curve (at ``orders`` > 1) of ``steps`` Poisson-sampled Gaussian steps under **replace-one**.

    dp_accounting's RDP accountant has Poisson subsampling only under ADD_OR_REMOVE_ONE. Replace-one is two
    add/remove moves: D' = (D − x) + x'. Mironov 2017 ("Rényi differential privacy", Prop. 11, the weak
    triangle inequality) gives, for any distributions P, Q, R and α > 1,

        D_α(P‖R) ≤ (α − 1/2)/(α − 1) · D_{2α}(P‖Q) + D_{2α−1}(Q‖R).

    With P = M(D), Q = M(D − x), R = M(D'), both terms are add/remove divergences of the whole composed
    mechanism (``steps`` steps compose: ``steps·ε_AR(order)``): D_{2α}(P‖Q) removes a record, D_{2α−1}(Q‖R)
    adds one. dp_accounting's add/remove curve bounds *both* directions: it computes
    D_α((1−q)N(0,z²) + qN(1,z²) ‖ N(0,z²)), and Mironov, Talwar & Zhang 2019 ("Rényi differential privacy of
    the sampled Gaussian mechanism", Sec. 3.3) show the reverse direction is never larger
    (tests/test_private_selection.py checks both numerically). Hence

        ε_R1(α) ≤ steps · [(α − 1/2)/(α − 1) · ε_AR(2α) + ε_AR(2α − 1)],

    a valid (not tight) replace-one RDP curve; for the un-sampled Gaussian (q = 1) it is within
    ``(2α−1)²/(4α(α−1))`` of the exact ``4α/(2z²)``. Swapping D and D' gives the same bound, so the curve
    covers both orders of the pair, as Papernot & Steinke's theorem needs.
    """
    import numpy as np
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = np.asarray(orders, dtype=np.float64)
    if np.any(orders <= 1):
        raise PrivacyError("replace-one RDP through the weak triangle needs orders > 1")
    _quiet_nonconverging_orders()
    event = dp_event.PoissonSampledDpEvent(float(sampling_rate), dp_event.GaussianDpEvent(float(noise_multiplier)))
    acc = rdp_privacy_accountant.RdpAccountant(orders=list(2 * orders) + list(2 * orders - 1))
    acc.compose(event, int(steps))
    at_2a, at_2a_minus_1 = acc.rdp[:len(orders)], acc.rdp[len(orders):]
    return (orders - 0.5) / (orders - 1) * at_2a + at_2a_minus_1


def base_rdp_curve(event: Event, orders):
    """RDP curve at ``orders`` of a fixed (non-adaptive) composition: the sum of its leaves' curves.

    Every leaf but a replace-one Poisson-sampled Gaussian is dp_accounting's own curve of the leaf's
    ``to_dp_accounting("add-remove")`` (explicit sensitivities are relation-free, privacy/events.py); a
    replace-one Poisson-sampled Gaussian uses :func:`replace_one_sampled_gaussian_rdp`.
    """
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = np.asarray(orders, dtype=np.float64)
    total = np.zeros_like(orders)
    _quiet_nonconverging_orders()
    for leaf in event.leaves():
        if leaf.adaptive:
            raise UnsupportedEvent("base_rdp_curve: an adaptively chosen event has no fixed RDP curve")
        if isinstance(leaf, SampledGaussianEvent) and leaf.relation == Relation.REPLACE_ONE:
            total = total + replace_one_sampled_gaussian_rdp(leaf.sampling_rate, leaf.noise_multiplier, leaf.steps,
                                                             orders)
            continue
        acc = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
        dp = leaf.to_dp_accounting(Relation.ADD_REMOVE)
        if not acc.supports(dp):
            raise UnsupportedEvent(f"base_rdp_curve: dp_accounting's RDP cannot account {type(leaf).__name__}")
        acc.compose(dp)
        total = total + acc.rdp
    return total


def repeat_and_select_rdp(event: "RepeatAndSelectEvent", orders):
    """RDP curve of a :class:`RepeatAndSelectEvent`: Papernot & Steinke 2022 Thm. 2 (truncated negative
    binomial T) / Thm. 6 (Poisson T) applied to :func:`base_rdp_curve` of its inner event, by dp_accounting's
    own routine (``rdp_privacy_accountant._compute_rdp_repeat_and_select``, the one its RdpAccountant uses
    for ``RepeatAndSelectDpEvent``; tests check the two agree where dp_accounting can take the event)."""
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = np.asarray(orders, dtype=np.float64)
    base = base_rdp_curve(event.inner, orders)
    return np.asarray(rdp_privacy_accountant._compute_rdp_repeat_and_select(
        orders, base, event.mean, event.dp_accounting_shape), dtype=np.float64)


class ZCDPAccountant(Accountant):
    """ρ-zCDP accounting matched to *shuffled* batching (Yu et al. Sec. IV-B-1).

    Supports ``ZCDPEvent`` (e.g. :meth:`ZCDPEvent.shuffled_epochs`), ``GaussianEvent`` (ρ = count·S²/(2σ²),
    Yu et al. Prop. 2) and pure-ε events (ε-DP ⇒ ε²/2-zCDP, Bun & Steinke Prop. 1.4). It refuses
    ``SampledGaussianEvent``: a Poisson-sampled step is not a shuffled epoch, and zCDP cannot express its
    amplification (Yu et al. Sec. IV-B-2) — account those with pld or rdp.

    Filter-valid: ρ-zCDP is (α, ρα)-RDP at every order, so stopping before ``Σ ρ_i`` exceeds ρ_budget is a
    Rényi filter at every α at once (Feldman & Zrnic 2021, Sec. 3) and the run is ρ_budget-zCDP; ε(ρ) is
    increasing in ρ, so the guard's ε check is that filter.
    """

    name = "zcdp"
    filter_valid = True

    def __init__(self) -> None:
        super().__init__()
        self.rho = 0.0

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, (ZCDPEvent, GaussianEvent, LaplaceEvent, PureDPEvent,
                                  DistributedDiscreteGaussianEvent))

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
            if isinstance(leaf, (ZCDPEvent, DistributedDiscreteGaussianEvent)):
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
    """Basic composition of pure-ε mechanisms: ``ε = Σ ε_i``, δ = 0 (Dwork et al. 2006).

    Filter-valid: basic composition holds with adaptively chosen ε_i as long as Σ ε_i stays within the
    budget (Rogers, Roth, Ullman & Vadhan 2016, privacy filters).
    """

    name = "basic"
    filter_valid = True

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


class SplitDeltaAccountant(Accountant):
    """Events that no one tight accountant covers, each family by its own, composed by basic composition.

    A hospital's lifetime ledger can hold releases that PLD accounts exactly (Gaussians, replace-one
    Poisson-sampled Gaussians) beside releases only RDP/zCDP can account (the distributed discrete Gaussian of
    a secure sum, Kairouz, Liu & Steinke 2021, arXiv 2102.06387). One accountant for all of them is ``rdp``,
    whose replace-one sampled-Gaussian curve (weak triangle inequality) reads a PLD-calibrated cell at ε = 8 as
    about 20. Here each family (``families``, in routing order: a leaf goes to the first that supports it) is
    composed by its own accountant and the families are added by the basic composition theorem (Dwork & Roth
    2014, "The Algorithmic Foundations of Differential Privacy", Thm. 3.16): with G non-empty families, each read
    at δ/G, the total is (Σ ε_g(δ/G), δ)-DP. ``rdp`` over every event is composed beside them where it can be, and
    the smaller of the two readings is reported (both are valid bounds for the same composition).

    Non-adaptive events only: :func:`accountant_for` never splits a composition holding an adaptively chosen
    event (those need one privacy filter over the whole sequence).
    """

    filter_valid = False

    def __init__(self, families: Sequence[str]) -> None:
        super().__init__()
        families = tuple(families)
        if len(families) < 2 or len(set(families)) != len(families) or "split" in ",".join(families):
            raise PrivacyError(f"a split accountant needs two or more distinct accountant families, got {families}")
        self.families = families
        self.parts = [make_accountant(name) for name in families]
        self.name = SPLIT_PREFIX + "+".join(families)
        self._union: Accountant | None = RDPAccountant()

    def _part_for(self, leaf: Event) -> Accountant | None:
        return next((part for part in self.parts if part._supports_leaf(leaf)), None)

    def _supports_leaf(self, event: Event) -> bool:
        return not event.adaptive and self._part_for(event) is not None

    def _apply(self, event: Event) -> None:
        self.compose_all([event])

    def compose(self, event: Event) -> "Accountant":
        return self.compose_all([event])

    def compose_all(self, events: Iterable[Event]) -> "Accountant":
        """Route every leaf to its family (each family composes its own share in one call, keeping PLD's
        grouping of identical events); everything is checked before anything is applied."""
        events = list(events)
        held = self.relation
        try:
            for event in events:
                self._check(event)
                self.relation = event.relation
        finally:
            self.relation = held
        routed: dict[int, list[Event]] = {}
        for event in events:
            for leaf in event.leaves():
                routed.setdefault(self.parts.index(self._part_for(leaf)), []).append(leaf)
        for index, leaves in routed.items():
            self.parts[index].compose_all(leaves)
        if self._union is not None:
            try:
                self._union.compose_all(events)
            except (UnsupportedEvent, PrivacyError):
                self._union = None   # rdp cannot read every event: the split reading alone
        self.events.extend(events)
        if events:
            self.relation = events[-1].relation
        return self

    def _split_epsilon(self, delta: float) -> float:
        used = [part for part in self.parts if part.events]
        return sum(part.get_epsilon(delta / len(used)) for part in used) if used else 0.0

    def get_epsilon(self, delta: float) -> float:
        delta = _check_delta(delta)
        split = self._split_epsilon(delta)
        return min(split, self._union.get_epsilon(delta)) if self._union is not None and self.events else split

    def get_delta(self, epsilon: float) -> float:
        """The smallest δ (to a relative 1e-6, rounded up) at which :meth:`get_epsilon` is at most ``epsilon``."""
        epsilon = _check_epsilon(epsilon)
        if not self.events or self.get_epsilon(1.0 - 1e-12) > epsilon:
            return 0.0 if not self.events else 1.0
        lo, hi = math.log(1e-300), math.log(1.0 - 1e-12)   # get_epsilon falls as δ grows: bisect on log δ
        if self.get_epsilon(math.exp(lo)) <= epsilon:
            return math.exp(lo)
        for _ in range(100):
            mid = (lo + hi) / 2
            if self.get_epsilon(math.exp(mid)) <= epsilon:
                hi = mid
            else:
                lo = mid
            if hi - lo < 1e-6:
                break
        return math.exp(hi)


#: names of split accountants: ``split:<family>+<family>...`` (:class:`SplitDeltaAccountant`)
SPLIT_PREFIX = "split:"


_FACTORIES = {
    "gdp-exact": GaussianGDPAccountant,
    "pld": PLDAccountant,
    "rdp": RDPAccountant,
    "rdp-filter": RDPFilterAccountant,
    "zcdp": ZCDPAccountant,
    "basic": PureDPAccountant,
}


def make_accountant(name: str, **options) -> Accountant:
    """A fresh accountant by name (one of ``ACCOUNTANTS``)."""
    if isinstance(name, str) and name.startswith(SPLIT_PREFIX):
        return SplitDeltaAccountant(name[len(SPLIT_PREFIX):].split("+"))
    factory = _FACTORIES.get(name)
    if factory is None:
        raise PrivacyError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}")
    return factory(**options)


def accountant_for(events: Iterable[Event]) -> Accountant:
    """The tightest exact accountant that supports all ``events`` (fresh, not yet composed).

    gdp-exact if all are Gaussians; basic if all are pure ε; zcdp if any is a ZCDPEvent (shuffled epochs)
    and the rest convert; otherwise pld; then rdp; zcdp last (e.g. Gaussians mixed with pure-ε events).
    If *any* event was chosen adaptively (``adaptive=True``) the whole composition is accounted by a privacy
    filter instead (gdp-exact, basic, zcdp, then rdp-filter; module docstring): a fixed-parameter event is a
    special case of an adaptive one, so one filter covers the whole sequence.
    Raises UnsupportedEvent when no accountant fits (e.g. shuffled ZCDPEvent mixed with Poisson events, or
    adaptively chosen replace-one Poisson-sampled events, which only PLD could account).
    """
    leaves = [leaf for event in events for leaf in event.leaves()]
    if not leaves:
        return GaussianGDPAccountant()
    adaptive = any(leaf.adaptive for leaf in leaves)
    if adaptive:
        order = list(FILTER_ACCOUNTANTS)
    else:
        order = ["gdp-exact", "basic"]
        if any(isinstance(leaf, ZCDPEvent) for leaf in leaves):
            order.append("zcdp")
        order += ["pld", "rdp", "zcdp"]
    single = next((make_accountant(name) for name in order
                   if all(make_accountant(name)._supports_leaf(leaf) for leaf in leaves)), None)
    if not adaptive and (single is None or single.name == AccountantName.RDP):   # rdp: only the loose union reading
        split = _split_for(leaves)
        if split is not None:
            return split
    if single is not None:
        return single
    kinds = sorted({type(leaf).__name__ + (f"({leaf.relation})" if isinstance(leaf, SampledGaussianEvent) else "")
                    for leaf in leaves})
    if adaptive:
        raise UnsupportedEvent(
            f"no privacy filter supports the adaptively chosen combination {kinds} (PLD is not valid under "
            "adaptive composition, and dp_accounting's RDP has no replace-one Poisson subsampling)"
        )
    raise UnsupportedEvent(f"no single accountant supports the combination {kinds}")


def _split_for(leaves: Sequence[Event]) -> Accountant | None:
    """A :class:`SplitDeltaAccountant` for non-adaptive ``leaves`` that PLD accounts only in part: the share PLD
    supports under its own tightest accountant, the rest under theirs; None when there is nothing to split."""
    pld = PLDAccountant()
    covered = [leaf for leaf in leaves if pld._supports_leaf(leaf)]
    rest = [leaf for leaf in leaves if not pld._supports_leaf(leaf)]
    if not covered or not rest or any(isinstance(leaf, ZCDPEvent) for leaf in leaves):
        return None
    try:
        first, second = accountant_for(covered).name, accountant_for(rest).name
    except UnsupportedEvent:
        return None
    return SplitDeltaAccountant((first, second)) if first != second else None


def epsilon_spent(events: Sequence[Event], delta: float, accountant: str | None = None) -> tuple[float, str]:
    """ε at ``delta`` of the composition of ``events``; returns ``(epsilon, accountant name)``."""
    events = list(events)
    acc = accountant_for(events) if accountant is None else make_accountant(accountant)
    acc.compose_all(events)
    return acc.get_epsilon(delta), acc.name


def epsilon_under(events: Sequence[Event], delta: float, relation: str) -> tuple[float, str] | None:
    """ε at ``delta`` of the *same mechanisms* analysed under ``relation``, or None when that is undefined.

    Only mechanisms described without a relation-specific parameter can be re-read (Poisson-sampled
    Gaussians: q, z, steps; see :meth:`Event.with_relation`); None if any event has an explicit sensitivity
    or ρ under another relation. Lets a report print, e.g., the add/remove ε of a replace-one DP-SGD run.
    """
    moved = [event.with_relation(relation) for event in events]
    if not moved or any(event is None for event in moved):
        return None
    return epsilon_spent(moved, delta)


def epsilon_per_relation(events: Sequence[Event], delta: float, relation: str | None,
                         epsilon: float | None) -> dict[str, float | None]:
    """``{"epsilon_add_remove": ..., "epsilon_replace_one": ...}`` for results that state both relations.

    ``events`` were accounted under ``relation`` to ``epsilon`` (the ledger's figure, reused as is); the
    other relation's value is :func:`epsilon_under`, or None where it is undefined (explicit sensitivities,
    shuffled epochs) or has no valid accountant (adaptive events under replace-one).
    """
    out: dict[str, float | None] = {}
    for name in (Relation.ADD_REMOVE, Relation.REPLACE_ONE):
        value = epsilon if name == relation else None
        if name != relation and events:
            try:
                moved = epsilon_under(events, delta, name)
            except PrivacyError:
                moved = None
            value = None if moved is None else float(moved[0])
        out[f"epsilon_{name.replace('-', '_')}"] = None if value is None else float(value)
    return out
