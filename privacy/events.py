"""Privacy events: immutable descriptions of every mechanism fedpate runs on private data.

An event says *what was released and how*, never what the data were. Each event names its neighbouring
relation (docs/PRIVACY.md, "Neighbouring relations"):

* ``"replace-one"`` — D and D' have the same size and differ in one patient's record. PATE (as in the
  sensitivity proofs of Fay et al., Sec. 3-4), and the relation every comparison uses: it is the only one
  that holds when dataset sizes are published (FedAvg weights, ``train_cases``), so DP-SGD and DP-FedAvg
  run under it by default (``task.learning.dpsgd.DPConfig.relation``);
* ``"add-remove"`` — D' is D with one patient added or removed (the Opacus / dp_accounting convention for
  Poisson-sampled DP-SGD; kept for standalone runs whose dataset sizes stay private);
* ``"zero-out"`` — D' is D with one patient's record replaced by a null record that contributes nothing
  (same size, so shuffled batches keep their boundaries; dp_accounting's ``REPLACE_SPECIAL``). Yu et al.'s
  ``1/(2σ²)``-zCDP per shuffled epoch holds for this relation (sensitivity C of the clipped sum), not for
  add/remove, where removing a record shifts every later batch.

Sensitivities stored in un-subsampled events (Gaussian, Laplace, zCDP's ρ) are *already* the sensitivity
under the event's relation (for example 2C/K for replace-one PATE aggregation of vectors clipped to norm C),
so their privacy-loss distribution is that of ``N(0, σ²)`` against ``N(S, σ²)`` whatever the relation. A
Poisson-sampled event (:class:`SampledGaussianEvent`) instead describes the mechanism only (q, z, steps);
its relation decides the analysis (dp_accounting's PLD under ``ADD_OR_REMOVE_ONE`` or ``REPLACE_ONE``).
The relation is recorded so that one owner's guarantees under different relations are never silently
added up (``ledger.spent``).

Every event round-trips through JSON (``to_dict`` / ``event_from_dict``) and, where dp_accounting's
``DpEvent`` algebra fits, converts with ``to_dp_accounting(inner)`` for a dp_accounting accountant built
with the neighbouring relation ``inner``:

* ``inner="add-remove"`` (``ADD_OR_REMOVE_ONE``): dp_accounting reads an un-subsampled Gaussian/Laplace
  noise multiplier as noise / sensitivity, so ``σ/S`` is passed as is;
* ``inner="replace-one"`` (``REPLACE_ONE``): dp_accounting's PLD reads an un-subsampled Gaussian's
  multiplier relative to a *norm bound* and doubles it (replacing a record moves the mean by twice the
  bound; ``privacy_loss_mechanism.GaussianPrivacyLoss``, REPLACE adjacency), so our explicit replace-one
  sensitivity S is passed as the norm bound S/2, i.e. multiplier ``2σ/S``. It has no Laplace PLD under
  ``REPLACE_ONE`` (such events are refused). Poisson-sampled Gaussians are passed as (q, z) under the
  accountant's relation, which must be the event's.

Events whose parameters were *chosen adaptively* from earlier outputs (``adaptive=True``; e.g. the
validation-driven DP-SGD noise schedule) are only composed by accountants that stay valid under fully
adaptive composition — privacy filters (see ``privacy.accountants.accountant_for``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.options import Relation, look_up_option
from privacy.validation import positive_integer, positive_number

RELATIONS = tuple(Relation)

#: Relations under which dp_accounting analyses Poisson-sampled Gaussians (``REPLACE_ONE`` / ``ADD_OR_REMOVE_ONE``).
SAMPLED_RELATIONS = (Relation.REPLACE_ONE, Relation.ADD_REMOVE)

#: Inner relations of dp_accounting accountants that :meth:`Event.to_dp_accounting` converts for.
INNER_RELATIONS = (Relation.ADD_REMOVE, Relation.REPLACE_ONE)

#: L2 sensitivity of one shuffled batch's clipped gradient sum, in units of the clip norm C, per relation.
SHUFFLED_SENSITIVITY = {Relation.ZERO_OUT: 1.0, Relation.REPLACE_ONE: 2.0}


def _relation(value: Any, owner: str) -> Relation:
    return look_up_option(value, Relation, f"{owner}: relation")


def _flag(name: str, value: Any, owner: str) -> bool:
    if not isinstance(value, bool):
        raise PrivacyError(f"{owner}: {name} must be true or false, got {value!r}")
    return value


def _inner(inner: Any) -> str:
    if inner not in INNER_RELATIONS:
        raise PrivacyError(f"inner relation must be one of {', '.join(INNER_RELATIONS)}, got {inner!r}")
    return inner


def _gaussian_dp_event(sigma_over_sensitivity: float, count: int, inner: str):
    """dp_accounting Gaussian for an un-subsampled Gaussian of explicit sensitivity (module docstring)."""
    # dp_accounting (~2 s) only when an event is handed to it, never to build or read a ledger
    from dp_accounting import dp_event

    multiplier = sigma_over_sensitivity * (2.0 if _inner(inner) == Relation.REPLACE_ONE else 1.0)
    single = dp_event.GaussianDpEvent(noise_multiplier=multiplier)
    return single if count == 1 else dp_event.SelfComposedDpEvent(single, count)


#: Fields left out of ``to_dict`` while they hold their default, so ledgers written before the field
#: existed keep their bytes (a repeated release id compares the canonical event).
_OMIT_WHEN_DEFAULT = {"adaptive": False}


class Event:
    """Base class of all privacy events (frozen dataclasses)."""

    kind: ClassVar[str] = ""

    @property
    def relation(self) -> str:  # overridden by fields in the leaf events
        raise NotImplementedError

    @property
    def adaptive(self) -> bool:  # overridden by a field in the events that may be chosen adaptively
        return False

    def to_dict(self) -> dict:
        """JSON-ready dict with a ``"type"`` key; inverse of :func:`event_from_dict`."""
        out: dict[str, Any] = {"type": self.kind}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _OMIT_WHEN_DEFAULT and value == _OMIT_WHEN_DEFAULT[field.name]:
                continue
            out[field.name] = value
        return out

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        """The equivalent dp_accounting ``DpEvent`` for an accountant under relation ``inner``.

        ``inner`` is ``"add-remove"`` (``ADD_OR_REMOVE_ONE``) or ``"replace-one"`` (``REPLACE_ONE``); see the
        module docstring for how each reads a noise multiplier. UnsupportedEvent when there is none.
        """
        raise UnsupportedEvent(f"{type(self).__name__} has no dp_accounting DpEvent equivalent")

    def with_relation(self, relation: str) -> "Event | None":
        """The same mechanism analysed under ``relation``, or None when its parameters depend on the relation.

        Only a Poisson-sampled Gaussian is described by its mechanism alone (q, z, steps); an explicit
        sensitivity or ρ was derived for one relation and cannot be re-read under another.
        """
        return self if self.relation == relation else None

    def leaves(self) -> Iterator["Event"]:
        """The non-composite events this event is made of (itself for a leaf)."""
        yield self


@dataclass(frozen=True)
class GaussianEvent(Event):
    """``count`` adaptive Gaussian mechanisms ``f(D) + N(0, σ² I)`` with L2 sensitivity ``S``.

    ``S = max_{D~D'} ||f(D) - f(D')||_2`` under ``relation`` (replace-one for PATE aggregation).
    One release is exactly μ-GDP with ``μ = S/σ`` (Dong, Roth & Su 2019, Thm. 2.7); ``count`` of them
    compose to ``μ = sqrt(count)·S/σ`` (their Cor. 3.3), which is what the ``gdp-exact`` accountant uses
    (Balle & Wang 2018, arXiv 1805.06530, Thm. 8 gives the matching δ(ε)). ``noise_multiplier = σ/S``.

    ``adaptive=True``: σ was chosen from earlier outputs. Gaussian DP composes under such fully adaptive
    choices as long as ``Σ μ_i² ≤ μ²`` is enforced by a filter (Smith & Thakurta 2022, "Fully adaptive
    composition for Gaussian differential privacy"), which is what the budget guard does with ``gdp-exact``.
    """

    sensitivity: float
    sigma: float
    count: int = 1
    relation: str = Relation.REPLACE_ONE
    adaptive: bool = False
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sensitivity", positive_number("sensitivity", self.sensitivity, "GaussianEvent"))
        object.__setattr__(self, "sigma", positive_number("sigma", self.sigma, "GaussianEvent"))
        object.__setattr__(self, "count", positive_integer("count", self.count, "GaussianEvent"))
        _relation(self.relation, "GaussianEvent")
        _flag("adaptive", self.adaptive, "GaussianEvent")

    @property
    def noise_multiplier(self) -> float:
        return self.sigma / self.sensitivity

    @property
    def mu(self) -> float:
        """GDP parameter of the whole event, ``sqrt(count)·S/σ``."""
        return math.sqrt(self.count) * self.sensitivity / self.sigma

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        return _gaussian_dp_event(self.noise_multiplier, self.count, inner)


@dataclass(frozen=True)
class SampledGaussianEvent(Event):
    """``steps`` DP-SGD steps: Poisson sampling with rate ``q``, then a Gaussian of std ``z·C`` on the sum.

    Each record joins a step's batch independently with probability ``sampling_rate`` = q; per-sample
    gradients are clipped to norm C and ``N(0, (zC)² I)`` is added, z = ``noise_multiplier``
    (Abadi et al. 2016; Opacus). Never accounted by zCDP (Yu et al. Sec. IV-B show zCDP cannot express the
    amplification, and a shuffled loader is not Poisson sampling).

    ``relation``:

    * ``"add-remove"`` (default; Opacus, Abadi et al.): the step's output is ``q·N(C, z²C²) + (1-q)·N(0,
      z²C²)`` against ``N(0, z²C²)``; PLD (dp_accounting, ``ADD_OR_REMOVE_ONE``) or RDP (Mironov, Talwar &
      Zhang 2019);
    * ``"replace-one"``: ``q·N(-C, ·) + (1-q)·N(0, ·)`` against ``q·N(C, ·) + (1-q)·N(0, ·)`` (the replaced
      record's clipped gradient may point the other way), which dp_accounting's PLD accounts exactly with
      ``NeighboringRelation.REPLACE_ONE`` (``privacy_loss_mechanism.GaussianPrivacyLoss``, REPLACE
      adjacency with sampling). dp_accounting's RDP accountant refuses Poisson sampling under REPLACE_ONE,
      so this event is PLD-only. Example (pinned in tests/test_privacy_accountants.py): q = 1/9, 90 steps,
      δ = 1e-3 at the z that makes add/remove ε = 8 (z ≈ 0.7987) spends ε ≈ 11.74 under replace-one.

    ``adaptive=True``: z was chosen from earlier outputs (validation-driven schedule); then only a filter
    (``rdp-filter``, add/remove only) may compose it — PLD composition needs parameters fixed in advance.
    """

    sampling_rate: float
    noise_multiplier: float
    steps: int = 1
    relation: str = Relation.ADD_REMOVE
    adaptive: bool = False
    kind: ClassVar[str] = "sampled-gaussian"

    def __post_init__(self) -> None:
        q = positive_number("sampling_rate", self.sampling_rate, "SampledGaussianEvent")
        if q > 1:
            raise PrivacyError(f"SampledGaussianEvent: sampling_rate must be in (0, 1], got {self.sampling_rate!r}")
        object.__setattr__(self, "sampling_rate", q)
        object.__setattr__(
            self, "noise_multiplier", positive_number("noise_multiplier", self.noise_multiplier, "SampledGaussianEvent")
        )
        object.__setattr__(self, "steps", positive_integer("steps", self.steps, "SampledGaussianEvent"))
        if self.relation not in SAMPLED_RELATIONS:
            raise PrivacyError(
                f"SampledGaussianEvent: relation must be one of {', '.join(SAMPLED_RELATIONS)} "
                f"(Poisson-sampled DP-SGD), got {self.relation!r}"
            )
        _flag("adaptive", self.adaptive, "SampledGaussianEvent")

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        # dp_accounting (~2 s) only when an event is handed to it, never to build or read a ledger
        from dp_accounting import dp_event

        if _inner(inner) != self.relation:
            raise UnsupportedEvent(
                f"SampledGaussianEvent under {self.relation} cannot be accounted by a dp_accounting accountant "
                f"under {inner}: Poisson subsampling is analysed under the event's own relation"
            )
        single = dp_event.PoissonSampledDpEvent(
            sampling_probability=self.sampling_rate,
            event=dp_event.GaussianDpEvent(noise_multiplier=self.noise_multiplier),
        )
        return single if self.steps == 1 else dp_event.SelfComposedDpEvent(single, self.steps)

    def with_relation(self, relation: str) -> "SampledGaussianEvent":
        if relation not in SAMPLED_RELATIONS:
            raise PrivacyError(
                f"SampledGaussianEvent: relation must be one of {', '.join(SAMPLED_RELATIONS)}, got {relation!r}"
            )
        return dataclasses.replace(self, relation=relation)


@dataclass(frozen=True)
class ZCDPEvent(Event):
    """A ρ-zCDP mechanism (Bun & Steinke 2016): ``D_α(M(D)||M(D')) ≤ ρα`` for all α > 1.

    fedpate uses it for DP-SGD with *shuffled disjoint batches* (Yu et al., Sec. IV-B-1, Thm. 2 and
    Prop. 2): within one epoch every record is in exactly one batch, each step adds ``N(0, (σC)² I)`` to a
    sum of gradients clipped to C; a Gaussian of L2 sensitivity Δ and std σC is ``Δ²/(2σ²C²)``-zCDP
    (Bun & Steinke 2016, Prop. 1.6), the disjoint batches compose in parallel and epochs add (Yu et al.
    Thm. 1). Δ depends on the relation (:data:`SHUFFLED_SENSITIVITY`): C under zero-out adjacency (the
    record's gradient becomes zero; Yu et al.'s ``1/(2σ²)`` per epoch), 2C under replace-one (``2/σ²`` per
    epoch). There is no add/remove analysis: removing a record shifts every later batch boundary.
    Converted to (ε, δ) by ``ε = ρ + 2 sqrt(ρ ln(1/δ))`` (Yu et al. Prop. 1).

    ``adaptive=True``: ρ was chosen from earlier outputs. zCDP is RDP of order α with ``ρα`` for every α,
    so the filter ``Σ ρ_i ≤ ρ_budget`` is one Rényi filter at every order at once (Feldman & Zrnic 2021,
    Sec. 3, the Rényi filter) and the whole run is ``ρ_budget``-zCDP: the ``zcdp`` accountant stays valid.
    """

    rho: float
    relation: str = Relation.ADD_REMOVE
    description: str = ""
    adaptive: bool = False
    kind: ClassVar[str] = "zcdp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", positive_number("rho", self.rho, "ZCDPEvent"))
        _relation(self.relation, "ZCDPEvent")
        if not isinstance(self.description, str):
            raise PrivacyError(f"ZCDPEvent: description must be a string, got {self.description!r}")
        _flag("adaptive", self.adaptive, "ZCDPEvent")

    @staticmethod
    def shuffled_epoch_rho(noise_multiplier: float, relation: str = Relation.ZERO_OUT) -> float:
        """ρ of one shuffled epoch at noise multiplier σ: ``(Δ/C)² / (2σ²)`` with Δ from the relation."""
        sigma = positive_number("noise_multiplier", noise_multiplier, "ZCDPEvent.shuffled_epochs")
        if relation not in SHUFFLED_SENSITIVITY:
            raise PrivacyError(
                f"shuffled epochs: relation must be one of {', '.join(SHUFFLED_SENSITIVITY)}, got {relation!r} "
                "(a shuffled epoch has no add/remove analysis: removing a record shifts every later batch; "
                "Yu et al.'s 1/(2 sigma^2) per epoch is for zero-out adjacency)"
            )
        return SHUFFLED_SENSITIVITY[relation] ** 2 / (2.0 * sigma * sigma)

    @classmethod
    def shuffled_epochs(
        cls, noise_multiplier: float, epochs: int = 1, relation: str = Relation.ZERO_OUT, adaptive: bool = False
    ) -> "ZCDPEvent":
        """``epochs`` shuffled epochs at noise multiplier σ (Yu et al. Sec. IV-B-1).

        ``ρ = epochs/(2σ²)`` under ``"zero-out"`` (default: the relation Yu et al.'s analysis holds for),
        ``ρ = 2·epochs/σ²`` under ``"replace-one"`` (sensitivity 2C); ``"add-remove"`` is refused.
        """
        epochs = positive_integer("epochs", epochs, "ZCDPEvent.shuffled_epochs")
        rho = epochs * cls.shuffled_epoch_rho(noise_multiplier, relation)
        return cls(
            rho=rho,
            relation=relation,
            description=f"{epochs} shuffled epoch(s), noise multiplier {float(noise_multiplier):.6g}",
            adaptive=adaptive,
        )

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        # dp_accounting (~2 s) only when an event is handed to it, never to build or read a ledger
        from dp_accounting import dp_event

        _inner(inner)
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
    relation: str = Relation.REPLACE_ONE
    kind: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sensitivity", positive_number("sensitivity", self.sensitivity, "LaplaceEvent"))
        object.__setattr__(self, "scale", positive_number("scale", self.scale, "LaplaceEvent"))
        object.__setattr__(self, "count", positive_integer("count", self.count, "LaplaceEvent"))
        _relation(self.relation, "LaplaceEvent")

    @property
    def epsilon(self) -> float:
        """Basic composition: ``count · S / b``."""
        return self.count * self.sensitivity / self.scale

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        # dp_accounting (~2 s) only when an event is handed to it, never to build or read a ledger
        from dp_accounting import dp_event

        if _inner(inner) == Relation.REPLACE_ONE:
            raise UnsupportedEvent(
                "LaplaceEvent: dp_accounting has no Laplace PLD under REPLACE_ONE (its accountants read the "
                "scale relative to a norm bound); it composes only in an add/remove-convention accountant"
            )
        single = dp_event.LaplaceDpEvent(noise_multiplier=self.scale / self.sensitivity)
        return single if self.count == 1 else dp_event.SelfComposedDpEvent(single, self.count)


@dataclass(frozen=True)
class PureDPEvent(Event):
    """Any ε-DP mechanism (for example the exponential mechanism) described only by its ε (δ = 0)."""

    epsilon: float
    relation: str = Relation.REPLACE_ONE
    description: str = ""
    kind: ClassVar[str] = "pure-dp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", positive_number("epsilon", self.epsilon, "PureDPEvent"))
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

    @property
    def adaptive(self) -> bool:
        return any(leaf.adaptive for leaf in self.leaves())

    def leaves(self) -> Iterator[Event]:
        for item in self.events:
            yield from item.leaves()

    def to_dict(self) -> dict:
        return {"type": self.kind, "events": [item.to_dict() for item in self.events]}

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        # dp_accounting (~2 s) only when an event is handed to it, never to build or read a ledger
        from dp_accounting import dp_event

        return dp_event.ComposedDpEvent([item.to_dp_accounting(inner) for item in self.events])

    def with_relation(self, relation: str) -> "ComposedEvent | None":
        items = [item.with_relation(relation) for item in self.events]
        return None if any(item is None for item in items) else ComposedEvent(tuple(items))


@dataclass(frozen=True)
class DistributedDiscreteGaussianEvent(Event):
    """``count`` releases of an integer vector sum plus the sum of ``shares`` independent discrete Gaussian
    shares ``N_Z(0, local_variance)`` per coordinate: the distributed discrete Gaussian of Kairouz, Liu &
    Steinke 2021 ("The distributed discrete Gaussian mechanism for federated learning with secure
    aggregation", arXiv 2102.06387), released through a secure sum.

    ``shares`` counts only the shares the data owner can rely on (its own and the honest survivors'; the
    colluders' shares are known to the adversary and dropped parties add nothing). ``l2_sensitivity`` /
    ``l1_sensitivity`` bound the integer shift between neighbouring sums under ``relation``, *after* scaling
    and conditional randomized rounding (the rounding error is inside them, ``privacy.distributed``);
    ``dimension`` is the vector length d of one release.

    Analysis: their Proposition 14 (the concentrated-DP branches; Theorem 1's second branch): with
    ``τ = 10 Σ_{k=1}^{n-1} exp(-2π² v k/(k+1))`` (v the local variance, n the shares), ``a2 = Δ2/sqrt(n v)``
    and ``a1 = Δ1/sqrt(n v)``, the sum is ρ-zCDP with ``ρ = ½ min{(a2 + τ sqrt(d))², a2² + 2 a1 τ + τ² d}``
    per release. For one share (τ = 0) this is ``Δ2²/(2v)``, the multivariate discrete Gaussian's own
    bound (Canonne, Kamath & Steinke 2020, arXiv 2004.00010). zCDP is RDP of order α with ``ρα``, so the
    event goes to dp_accounting as a ``ZCDpEvent`` and the ``rdp`` accountant converts with the improved
    conversion (Balle et al. 2020); the ``zcdp`` accountant adds ρ. There is no PLD of this sum (it is not a
    discrete Gaussian, and a vector discrete Gaussian's loss is not one-dimensional), so ``pld`` refuses it.
    Not adaptive: its parameters are fixed before the release.
    """

    l2_sensitivity: float
    l1_sensitivity: float
    local_variance: float
    shares: int
    dimension: int
    count: int = 1
    relation: str = Relation.REPLACE_ONE
    kind: ClassVar[str] = "distributed-discrete-gaussian"

    def __post_init__(self) -> None:
        owner = "DistributedDiscreteGaussianEvent"
        object.__setattr__(self, "l2_sensitivity", positive_number("l2_sensitivity", self.l2_sensitivity, owner))
        object.__setattr__(self, "l1_sensitivity", positive_number("l1_sensitivity", self.l1_sensitivity, owner))
        object.__setattr__(self, "local_variance", positive_number("local_variance", self.local_variance, owner))
        object.__setattr__(self, "shares", positive_integer("shares", self.shares, owner))
        object.__setattr__(self, "dimension", positive_integer("dimension", self.dimension, owner))
        object.__setattr__(self, "count", positive_integer("count", self.count, owner))
        if self.l1_sensitivity < self.l2_sensitivity * (1 - 1e-12):
            raise PrivacyError(f"{owner}: l1_sensitivity {self.l1_sensitivity} is below l2_sensitivity "
                               f"{self.l2_sensitivity} (an L1 norm is never smaller than the L2 norm)")
        _relation(self.relation, owner)

    @property
    def tau(self) -> float:
        """Kairouz, Liu & Steinke's τ: how far the sum of ``shares`` discrete Gaussians is from one."""
        v = self.local_variance
        return 10.0 * sum(math.exp(-2.0 * math.pi ** 2 * v * k / (k + 1)) for k in range(1, self.shares))

    @property
    def rho_per_release(self) -> float:
        """ρ of one release (zCDP), their Prop. 14's concentrated branches."""
        scale = math.sqrt(self.shares * self.local_variance)
        a2, a1 = self.l2_sensitivity / scale, self.l1_sensitivity / scale
        tau, d = self.tau, self.dimension
        return 0.5 * min((a2 + tau * math.sqrt(d)) ** 2, a2 * a2 + 2.0 * a1 * tau + tau * tau * d)

    @property
    def rho(self) -> float:
        return self.count * self.rho_per_release

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        # dp_accounting (~2 s) only when an event is handed to it, never to build or read a ledger
        from dp_accounting import dp_event

        _inner(inner)
        return dp_event.ZCDpEvent(rho=self.rho)


@dataclass(frozen=True)
class RepeatAndSelectEvent(Event):
    """Private selection: run a base mechanism a *random* number of times T and release only the best run.

    Papernot & Steinke 2022, "Hyperparameter tuning with Renyi differential privacy" (ICLR; arXiv
    2110.03620): T is drawn, independently of the data, from a truncated negative binomial with shape η
    (``shape``; η = 0 the logarithmic, η = 1 the geometric distribution; Definition 1) or a Poisson
    (``shape=None``; then T = 0 releases nothing); each run of the base mechanism ``inner`` returns a
    (candidate, noisy score) pair and only the pair with the best score is released (with what the
    candidate produced). If ``inner`` is (λ, ε(λ))-RDP at every order, the whole is (λ, ε'(λ))-RDP with
    ε' from their Theorem 2 (TNB) / Theorem 6 (Poisson), which is what dp_accounting's
    ``RepeatAndSelectDpEvent`` / ``RdpAccountant`` compute (``_compute_rdp_repeat_and_select``). Only the RDP
    accountant can analyse it (a leaf for every other accountant, which refuses it).

    What must *not* be released for the theorem to hold: the realised T, and every run but the best one
    (their candidates and scores). Releasing T would give the adversary "best of T = k" for a known k, whose
    cost grows with k (the randomness of T is exactly what the theorem pays with).

    Neighbouring relation: the theorem is stated for one pair of neighbouring datasets and only uses the
    base mechanism's Rényi divergences on that pair (both orders of the pair), so it holds for any
    symmetric relation for which ``inner``'s RDP curve holds; the event's relation is ``inner``'s. How the
    curve of a replace-one Poisson-sampled Gaussian is obtained (dp_accounting's RDP has none) is in
    ``privacy.accountants.replace_one_sampled_gaussian_rdp``.

    ``inner`` must be fixed in advance (not adaptive): one repetition's parameters never depend on
    another's outcome. Charged *once, before* the first repetition (T is unknown in advance, so the event
    covers every T); the repetitions' own steps are then covered, not charged again
    (``privacy.guard.CoveredGuard``).
    """

    inner: Event
    mean: float
    shape: float | None = 1.0
    kind: ClassVar[str] = "repeat-and-select"

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Event):
            raise PrivacyError(f"RepeatAndSelectEvent: inner must be a privacy event, got {self.inner!r}")
        if isinstance(self.inner, RepeatAndSelectEvent) or any(
                isinstance(leaf, RepeatAndSelectEvent) for leaf in self.inner.leaves()):
            raise PrivacyError("RepeatAndSelectEvent: a repeated selection inside another is not supported")
        if self.inner.adaptive:
            raise PrivacyError("RepeatAndSelectEvent: the repeated mechanism must be fixed in advance (adaptive=False)")
        mean = positive_number("mean", self.mean, "RepeatAndSelectEvent")
        if mean < 1:
            raise PrivacyError(f"RepeatAndSelectEvent: mean must be at least 1, got {self.mean!r}")
        if self.shape is not None and mean <= 1:
            # a truncated negative binomial's mean exceeds 1 for every γ in (0, 1): mean 1 describes no such
            # distribution (it would be "T = 1 always"), and sampling T from it fails
            raise PrivacyError(f"RepeatAndSelectEvent: a truncated negative binomial needs mean > 1, got {self.mean!r}")
        object.__setattr__(self, "mean", mean)
        if self.shape is not None:
            if isinstance(self.shape, bool) or not isinstance(self.shape, (int, float)) or not math.isfinite(self.shape) \
                    or self.shape < 0:
                raise PrivacyError(f"RepeatAndSelectEvent: shape must be a finite number >= 0 (truncated negative "
                                   f"binomial) or None (Poisson), got {self.shape!r}")
            object.__setattr__(self, "shape", float(self.shape))

    @property
    def relation(self) -> str:
        return self.inner.relation

    @property
    def dp_accounting_shape(self) -> float:
        """dp_accounting's shape: ``inf`` stands for the Poisson distribution."""
        return math.inf if self.shape is None else self.shape

    def to_dict(self) -> dict:
        return {"type": self.kind, "inner": self.inner.to_dict(), "mean": self.mean, "shape": self.shape}

    def to_dp_accounting(self, inner: str = Relation.ADD_REMOVE):
        # dp_accounting (~2 s) only when an event is handed to it, never to build or read a ledger
        from dp_accounting import dp_event

        return dp_event.RepeatAndSelectDpEvent(self.inner.to_dp_accounting(inner), self.mean, self.dp_accounting_shape)

    def with_relation(self, relation: str) -> "Event | None":
        if relation == self.relation:
            return self
        moved = self.inner.with_relation(relation)
        return None if moved is None else RepeatAndSelectEvent(moved, self.mean, self.shape)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (GaussianEvent, SampledGaussianEvent, ZCDPEvent, LaplaceEvent, PureDPEvent, ComposedEvent,
                RepeatAndSelectEvent, DistributedDiscreteGaussianEvent)
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
    if cls is RepeatAndSelectEvent:
        unknown = set(fields) - {"inner", "mean", "shape"}
        if unknown or "inner" not in fields or "mean" not in fields:
            raise PrivacyError(f"repeat-and-select event: needs inner and mean (and shape), got {sorted(fields)}")
        return RepeatAndSelectEvent(event_from_dict(fields["inner"]), fields["mean"], fields.get("shape", 1.0))
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
