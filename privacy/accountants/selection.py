"""Choosing the accountant: by name (:func:`make_accountant`), the tightest for a set of events
(:func:`accountant_for`), and the ε of a composition read through it (:func:`epsilon_spent` and its relatives)."""

from __future__ import annotations

from typing import Iterable, Sequence

from privacy.accountants.base import FILTER_ACCOUNTANTS, Accountant
from privacy.accountants.families import make_family_accountant
from privacy.accountants.gdp import GaussianGDPAccountant
from privacy.accountants.pld import PLDAccountant
from privacy.accountants.split import SPLIT_PREFIX, SplitDeltaAccountant
from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import Event, SampledGaussianEvent, ZCDPEvent
from privacy.options import AccountantName, Relation


def make_accountant(name: str, **options) -> Accountant:
    """A fresh accountant by name (one of ``ACCOUNTANTS``, or ``split:<family>+<family>...``)."""
    if isinstance(name, str) and name.startswith(SPLIT_PREFIX):
        return SplitDeltaAccountant(name[len(SPLIT_PREFIX):].split("+"))
    return make_family_accountant(name, **options)


def accountant_for(events: Iterable[Event]) -> Accountant:
    """The tightest exact accountant that supports all ``events`` (fresh, not yet composed).

    gdp-exact if all are Gaussians; basic if all are pure ε; zcdp if any is a ZCDPEvent (shuffled epochs)
    and the rest convert; otherwise pld; then rdp; zcdp last (e.g. Gaussians mixed with pure-ε events).
    If *any* event was chosen adaptively (``adaptive=True``) the whole composition is accounted by a privacy
    filter instead (gdp-exact, basic, zcdp, then rdp-filter; package docstring): a fixed-parameter event is a
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
