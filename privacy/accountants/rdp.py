"""The rdp and rdp-filter accountants (dp_accounting's RDP, and the same curves under a Rényi filter), and the
RDP curves dp_accounting lacks: replace-one Poisson-sampled Gaussians and repeated private selection."""

from __future__ import annotations

import logging
import math
from typing import Sequence

from privacy.accountants.base import _check_delta, _check_epsilon
from privacy.accountants.dp_accounting_wrapper import _DpAccountingWrapper
from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import (
    ComposedEvent,
    DistributedDiscreteGaussianEvent,
    Event,
    GaussianEvent,
    LaplaceEvent,
    RepeatAndSelectEvent,
    SampledGaussianEvent,
    ZCDPEvent,
)
from privacy.options import Relation

#: RDP orders of the Rényi filter: fixed in advance and few, because the filter pays ln|orders| in ln(1/δ).
FILTER_RDP_ORDERS = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0,
                     48.0, 64.0, 128.0, 256.0)


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
