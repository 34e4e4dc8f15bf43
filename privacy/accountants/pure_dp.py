"""The basic accountant: pure ε-DP mechanisms added up."""

from __future__ import annotations

from privacy.accountants.base import Accountant, _check_epsilon
from privacy.events import Event, LaplaceEvent, PureDPEvent


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
