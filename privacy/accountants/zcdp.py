"""The zcdp accountant: ρ-zCDP, matched to shuffled batching."""

from __future__ import annotations

from privacy.accountants.base import Accountant, zcdp_delta, zcdp_epsilon
from privacy.errors import UnsupportedEvent
from privacy.events import (
    DistributedDiscreteGaussianEvent,
    Event,
    GaussianEvent,
    LaplaceEvent,
    PureDPEvent,
    SampledGaussianEvent,
    ZCDPEvent,
)


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
