"""The pld accountant: dp_accounting's privacy-loss distributions, with each event's PLD built once."""

from __future__ import annotations

from privacy.accountants.dp_accounting_wrapper import _DpAccountingWrapper
from privacy.errors import PrivacyError
from privacy.events import Event, GaussianEvent, LaplaceEvent, SampledGaussianEvent
from privacy.options import Relation

#: PLD value discretisation (privacy-loss grid). 1e-4 keeps ε within ~1e-3 of the continuous value for
#: the compositions fedpate runs (hundreds to thousands of steps) while staying fast.
DEFAULT_PLD_DISCRETIZATION = 1e-4


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
