"""Privacy events: immutable descriptions of every mechanism fedpate runs on private data.

An event says *what was released and how*, never what the data were. Each event names its neighbouring
relation (SPEC section 2):

* ``"replace-one"`` — D and D' have the same size and differ in one patient's record (PATE, as in the
  sensitivity proofs of Fay et al., Sec. 3-4);
* ``"add-remove"`` — D' is D with one patient added or removed (DP-SGD with Poisson sampling, the Opacus /
  dp_accounting convention; Yu et al. for shuffled epochs).

Sensitivities stored in events are *already* the sensitivity under the event's relation (for example
2C/K for replace-one PATE aggregation of vectors clipped to norm C). So an un-subsampled Gaussian or
Laplace event has the same privacy-loss distribution whatever the relation; the relation is recorded so
that one owner's guarantees under different relations are never silently added up (``ledger.spent``).

Every event round-trips through JSON (``to_dict`` / ``event_from_dict``) and, where dp_accounting's
``DpEvent`` algebra fits, converts with ``to_dp_accounting()``. Those DpEvents are meant for
dp_accounting accountants built with ``NeighboringRelation.ADD_OR_REMOVE_ONE``, because with that relation
dp_accounting reads a Gaussian/Laplace noise multiplier as noise / sensitivity; with ``REPLACE_ONE`` its
PLD accountant would double the sensitivity of an un-subsampled Gaussian (it reads the multiplier relative
to a norm bound), which would double-count our explicit replace-one sensitivity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

from privacy.errors import PrivacyError, UnsupportedEvent

RELATIONS = ("replace-one", "add-remove")


def _positive_finite(name: str, value: Any, owner: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PrivacyError(f"{owner}: {name} must be a positive finite number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
        raise PrivacyError(f"{owner}: {name} must be a positive finite number, got {value!r}")
    return number


def _positive_int(name: str, value: Any, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
        isinstance(value, float) and value.is_integer()
    ):
        raise PrivacyError(f"{owner}: {name} must be a positive integer, got {value!r}")
    number = int(value)
    if number < 1:
        raise PrivacyError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return number


def _relation(value: Any, owner: str) -> str:
    if value not in RELATIONS:
        raise PrivacyError(f"{owner}: relation must be one of {', '.join(RELATIONS)}, got {value!r}")
    return value


class Event:
    """Base class of all privacy events (frozen dataclasses)."""

    kind: ClassVar[str] = ""

    @property
    def relation(self) -> str:  # overridden by fields in the leaf events
        raise NotImplementedError

    def to_dict(self) -> dict:
        """JSON-ready dict with a ``"type"`` key; inverse of :func:`event_from_dict`."""
        out: dict[str, Any] = {"type": self.kind}
        for field in dataclasses.fields(self):
            out[field.name] = getattr(self, field.name)
        return out

    def to_dp_accounting(self):
        """The equivalent dp_accounting ``DpEvent`` (for an ``ADD_OR_REMOVE_ONE`` accountant)."""
        raise UnsupportedEvent(f"{type(self).__name__} has no dp_accounting DpEvent equivalent")

    def leaves(self) -> Iterator["Event"]:
        """The non-composite events this event is made of (itself for a leaf)."""
        yield self


@dataclass(frozen=True)
class GaussianEvent(Event):
    """``count`` adaptive Gaussian mechanisms ``f(D) + N(0, σ² I)`` with L2 sensitivity ``S``.

    ``S = max_{D~D'} ||f(D) - f(D')||_2`` under ``relation`` (replace-one for PATE aggregation, SPEC §3-5).
    One release is exactly μ-GDP with ``μ = S/σ`` (Dong, Roth & Su 2019, Thm. 2.7); ``count`` of them
    compose to ``μ = sqrt(count)·S/σ`` (their Cor. 3.3), which is what the ``gdp-exact`` accountant uses
    (SPEC §5; Balle & Wang 2018, Thm. 8 gives the matching δ(ε)). ``noise_multiplier = σ/S``.
    """

    sensitivity: float
    sigma: float
    count: int = 1
    relation: str = "replace-one"
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sensitivity", _positive_finite("sensitivity", self.sensitivity, "GaussianEvent"))
        object.__setattr__(self, "sigma", _positive_finite("sigma", self.sigma, "GaussianEvent"))
        object.__setattr__(self, "count", _positive_int("count", self.count, "GaussianEvent"))
        _relation(self.relation, "GaussianEvent")

    @property
    def noise_multiplier(self) -> float:
        return self.sigma / self.sensitivity

    @property
    def mu(self) -> float:
        """GDP parameter of the whole event, ``sqrt(count)·S/σ``."""
        return math.sqrt(self.count) * self.sensitivity / self.sigma

    def to_dp_accounting(self):
        from dp_accounting import dp_event

        single = dp_event.GaussianDpEvent(noise_multiplier=self.noise_multiplier)
        return single if self.count == 1 else dp_event.SelfComposedDpEvent(single, self.count)


@dataclass(frozen=True)
class SampledGaussianEvent(Event):
    """``steps`` DP-SGD steps: Poisson sampling with rate ``q``, then a Gaussian of std ``z·C`` on the sum.

    Each record joins a step's batch independently with probability ``sampling_rate`` = q; per-sample
    gradients are clipped to norm C and ``N(0, (zC)² I)`` is added, z = ``noise_multiplier``
    (Abadi et al. 2016; Opacus). Relation: add/remove-one (the only one accepted here, since it is the one
    Poisson amplification and dp_accounting's/Opacus' analyses use for DP-SGD). Accounted by the PLD of
    the subsampled Gaussian (dp_accounting) or by RDP; never by zCDP (Yu et al. Sec. IV-B show zCDP cannot
    express the amplification, and a shuffled loader is not Poisson sampling).
    """

    sampling_rate: float
    noise_multiplier: float
    steps: int = 1
    relation: str = "add-remove"
    kind: ClassVar[str] = "sampled-gaussian"

    def __post_init__(self) -> None:
        q = _positive_finite("sampling_rate", self.sampling_rate, "SampledGaussianEvent")
        if q > 1:
            raise PrivacyError(f"SampledGaussianEvent: sampling_rate must be in (0, 1], got {self.sampling_rate!r}")
        object.__setattr__(self, "sampling_rate", q)
        object.__setattr__(
            self, "noise_multiplier", _positive_finite("noise_multiplier", self.noise_multiplier, "SampledGaussianEvent")
        )
        object.__setattr__(self, "steps", _positive_int("steps", self.steps, "SampledGaussianEvent"))
        if self.relation != "add-remove":
            raise PrivacyError(
                "SampledGaussianEvent: relation must be 'add-remove' (Poisson-sampled DP-SGD), "
                f"got {self.relation!r}"
            )

    def to_dp_accounting(self):
        from dp_accounting import dp_event

        single = dp_event.PoissonSampledDpEvent(
            sampling_probability=self.sampling_rate,
            event=dp_event.GaussianDpEvent(noise_multiplier=self.noise_multiplier),
        )
        return single if self.steps == 1 else dp_event.SelfComposedDpEvent(single, self.steps)


@dataclass(frozen=True)
class ZCDPEvent(Event):
    """A ρ-zCDP mechanism (Bun & Steinke 2016): ``D_α(M(D)||M(D')) ≤ ρα`` for all α > 1.

    fedpate uses it for DP-SGD with *shuffled disjoint batches* (Yu et al., Sec. IV-B-1, Thm. 2 and
    Prop. 2): within one epoch every record is in exactly one batch, each step adds ``N(0, (σC)² I)`` to a
    sum of gradients clipped to C, so the epoch is ``1/(2σ²)``-zCDP (parallel composition over the disjoint
    batches); epochs add (Thm. 1). Relation: add/remove-one (sensitivity C of the clipped sum).
    Converted to (ε, δ) by ``ε = ρ + 2 sqrt(ρ ln(1/δ))`` (Yu et al. Prop. 1).
    """

    rho: float
    relation: str = "add-remove"
    description: str = ""
    kind: ClassVar[str] = "zcdp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", _positive_finite("rho", self.rho, "ZCDPEvent"))
        _relation(self.relation, "ZCDPEvent")
        if not isinstance(self.description, str):
            raise PrivacyError(f"ZCDPEvent: description must be a string, got {self.description!r}")

    @classmethod
    def shuffled_epochs(cls, noise_multiplier: float, epochs: int = 1, relation: str = "add-remove") -> "ZCDPEvent":
        """``epochs`` shuffled epochs at noise multiplier σ: ``ρ = epochs / (2σ²)`` (Yu et al. Sec. IV-B-1)."""
        sigma = _positive_finite("noise_multiplier", noise_multiplier, "ZCDPEvent.shuffled_epochs")
        epochs = _positive_int("epochs", epochs, "ZCDPEvent.shuffled_epochs")
        return cls(
            rho=epochs / (2.0 * sigma * sigma),
            relation=relation,
            description=f"{epochs} shuffled epoch(s), noise multiplier {sigma:.6g}",
        )

    def to_dp_accounting(self):
        from dp_accounting import dp_event

        return dp_event.ZCDpEvent(rho=self.rho)


@dataclass(frozen=True)
class LaplaceEvent(Event):
    """``count`` Laplace mechanisms ``f(D) + Lap(b)^d`` with L1 sensitivity ``S``: each is (S/b)-DP.

    Pure ε-DP (Dwork et al. 2006); basic composition gives ``ε = count·S/b``. Used by AdLM
    (Phan et al.) with replace-one sensitivities.
    """

    sensitivity: float
    scale: float
    count: int = 1
    relation: str = "replace-one"
    kind: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sensitivity", _positive_finite("sensitivity", self.sensitivity, "LaplaceEvent"))
        object.__setattr__(self, "scale", _positive_finite("scale", self.scale, "LaplaceEvent"))
        object.__setattr__(self, "count", _positive_int("count", self.count, "LaplaceEvent"))
        _relation(self.relation, "LaplaceEvent")

    @property
    def epsilon(self) -> float:
        """Basic composition: ``count · S / b``."""
        return self.count * self.sensitivity / self.scale

    def to_dp_accounting(self):
        from dp_accounting import dp_event

        single = dp_event.LaplaceDpEvent(noise_multiplier=self.scale / self.sensitivity)
        return single if self.count == 1 else dp_event.SelfComposedDpEvent(single, self.count)


@dataclass(frozen=True)
class PureDPEvent(Event):
    """Any ε-DP mechanism (for example the exponential mechanism) described only by its ε (δ = 0)."""

    epsilon: float
    relation: str = "replace-one"
    description: str = ""
    kind: ClassVar[str] = "pure-dp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", _positive_finite("epsilon", self.epsilon, "PureDPEvent"))
        _relation(self.relation, "PureDPEvent")
        if not isinstance(self.description, str):
            raise PrivacyError(f"PureDPEvent: description must be a string, got {self.description!r}")


@dataclass(frozen=True)
class ComposedEvent(Event):
    """Adaptive sequential composition of ``events`` (all under one neighbouring relation)."""

    events: tuple
    kind: ClassVar[str] = "composed"

    def __post_init__(self) -> None:
        events = tuple(self.events) if isinstance(self.events, (list, tuple)) else None
        if not events:
            raise PrivacyError("ComposedEvent: events must be a non-empty sequence of events")
        for item in events:
            if not isinstance(item, Event):
                raise PrivacyError(f"ComposedEvent: events must contain events, got {item!r}")
        relations = {leaf.relation for item in events for leaf in item.leaves()}
        if len(relations) > 1:
            raise PrivacyError(
                f"ComposedEvent: events mix neighbouring relations {sorted(relations)}; compose one relation only"
            )
        object.__setattr__(self, "events", events)

    @property
    def relation(self) -> str:
        return next(iter(self.leaves())).relation

    def leaves(self) -> Iterator[Event]:
        for item in self.events:
            yield from item.leaves()

    def to_dict(self) -> dict:
        return {"type": self.kind, "events": [item.to_dict() for item in self.events]}

    def to_dp_accounting(self):
        from dp_accounting import dp_event

        return dp_event.ComposedDpEvent([item.to_dp_accounting() for item in self.events])


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (GaussianEvent, SampledGaussianEvent, ZCDPEvent, LaplaceEvent, PureDPEvent, ComposedEvent)
}


def event_from_dict(data: Any) -> Event:
    """Rebuild an event from :meth:`Event.to_dict` output; PrivacyError names what is wrong."""
    if not isinstance(data, dict):
        raise PrivacyError(f"event must be a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise PrivacyError(f"event type must be one of {', '.join(EVENT_TYPES)}, got {kind!r}")
    fields = {k: v for k, v in data.items() if k != "type"}
    if cls is ComposedEvent:
        items = fields.get("events")
        if not isinstance(items, list):
            raise PrivacyError("composed event: 'events' must be a list")
        return ComposedEvent(tuple(event_from_dict(item) for item in items))
    names = {field.name for field in dataclasses.fields(cls)}
    unknown = set(fields) - names
    if unknown:
        raise PrivacyError(f"{kind} event: unknown field(s) {sorted(unknown)}")
    try:
        return cls(**fields)
    except TypeError as exc:  # a missing required field
        raise PrivacyError(f"{kind} event: {exc}") from None


def as_event(event: Event | dict) -> Event:
    """Accept an event or its dict form."""
    if isinstance(event, Event):
        return event
    return event_from_dict(event)
