"""The split accountant: events no one tight accountant covers, each family by its own at δ/G, added up."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from privacy.accountants.base import Accountant, _check_delta, _check_epsilon
from privacy.accountants.families import make_family_accountant
from privacy.accountants.rdp import RDPAccountant
from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import Event

#: names of split accountants: ``split:<family>+<family>...`` (:class:`SplitDeltaAccountant`)
SPLIT_PREFIX = "split:"


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
        self.parts = [make_family_accountant(name) for name in families]
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
