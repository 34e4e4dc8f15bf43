"""The plumbing shared by the accountants that delegate to a dp_accounting ``PrivacyAccountant`` (pld, rdp)."""

from __future__ import annotations

import abc
from typing import Iterable

from privacy.accountants.base import Accountant, _check_delta, _check_epsilon
from privacy.errors import UnsupportedEvent
from privacy.events import Event
from privacy.options import Relation


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
