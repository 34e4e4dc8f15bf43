"""What the server asks a hospital: one frozen, validated type per request kind.

Both parties import these. The server builds a request and sends ``request.to_config()`` -- plain keys and
values, what a Flower ``ConfigRecord`` carries (``task.wire.flower_wire``) and what the in-process engine hands a
hospital object. The hospital reads ``Request.from_config(config)`` once at the top of each handler: that
applies the defaults and refuses a malformed request with one line naming the key
(:class:`task.errors.UserError`), before anything is charged. Whether a hospital *accepts* a well-formed
request -- its lifetime budget, its codec policy, its threat model, no seeded noise when deployed -- is its
own decision, taken in ``clients/`` after parsing and before any charge.

Every request carries :class:`HospitalRequest`'s fields: the device a simulated hospital computes on and the
privacy settings a simulated hospital adopts (``task.settings.runconfig.RunSettings.hospital_privacy_config``); a
deployed hospital ignores them all for its node config's. Arrays (weights, scans, codec states, test sets)
travel beside the config as Flower ``ArrayRecord``s, never in it: the fields that hold them are marked
``ARRAYS`` and are left out of :meth:`HospitalRequest.to_config`.

Kept free of torch and numpy: the command line builds run settings at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

from task.learning.device import check_device_spec, check_precision
from task.errors import UserError
from task.options import Relation, Trainable, look_up_option

R = TypeVar("R", bound="WireRecord")

#: what a teachers' local DP-SGD request states at least (``task.learning.dpsgd.DPConfig`` has no defaults for them)
LOCAL_DP_REQUIRED = ("epsilon", "delta", "max_grad_norm")

#: field metadata of a field whose value travels as arrays beside the config (not in :meth:`to_config`)
ARRAYS = {"arrays": True}


# ---------------------------------------------------------------------------------------------- value checks
def _integer(value: Any, key: str, low: int | None = None) -> int:
    """An integer (an integral float too, as JSON may write one), at least ``low``."""
    integral = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise UserError(f"{key}: expected an integer, got {value!r}")
    if low is not None and int(value) < low:
        raise UserError(f"{key}: expected an integer >= {low}, got {value!r}")
    return int(value)


def _real(value: Any, key: str, *, positive: bool = False, below: float | None = None,
          unbounded: bool = False) -> float:
    """A finite real number (``unbounded``: +inf too); > 0 when ``positive``; < ``below`` when given."""
    finite = isinstance(value, numbers.Real) and (math.isfinite(float(value)) or unbounded and float(value) == math.inf)
    if isinstance(value, bool) or not finite:
        raise UserError(f"{key}: expected a finite number, got {value!r}")
    number = float(value)
    if positive and not number > 0:
        raise UserError(f"{key}: expected a positive number, got {value!r}")
    if below is not None and not number < below:
        raise UserError(f"{key}: expected a number below {below:g}, got {value!r}")
    return number


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{key}: expected true or false, got {value!r}")
    return value


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise UserError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _mapping(value: Any, key: str) -> dict:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise UserError(f"{key}: expected a mapping with string keys, got {type(value).__name__}")
    return dict(value)


def _items(value: Any, key: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise UserError(f"{key}: expected a list, got {value!r}")
    return list(value)


def _set(record, name: str, value: Any) -> None:
    object.__setattr__(record, name, value)


def _wire(value: Any) -> Any:
    """A field's value as the config carries it: tuples as the lists Flower would send, mappings as dicts."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


# ---------------------------------------------------------------------------------------------- the records
@dataclass(frozen=True)
class WireRecord:
    """A config on the wire as a frozen record: :meth:`to_config` sends it, :meth:`from_config` reads it.

    A field that is None is not sent (the receiver applies its default); a key the record does not name is
    ignored on reading (one message config holds the run's settings beside the request's own)."""

    def to_config(self) -> dict[str, Any]:
        """The keys and values the server sends (None fields and array fields left out)."""
        return {f.name: _wire(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None and not f.metadata.get("arrays")}

    @classmethod
    def from_config(cls: type[R], config: Mapping[str, Any] | R | None = None) -> R:
        """The record a received config holds (``config`` already one: itself); UserError naming a bad key."""
        if isinstance(config, cls):
            return config
        given = dict(config or {})
        fields = [f for f in dataclasses.fields(cls) if f.init]
        missing = [f.name for f in fields if f.name not in given
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise UserError(f"message config: expected {', '.join(missing)} (a {cls.__name__})")
        return cls(**{f.name: given[f.name] for f in fields if f.name in given})


@dataclass(frozen=True)
class RunContext(WireRecord):
    """What every Flower message of a run carries so that a node knows which hospital it plays
    (``clients.node.hospital_for``): the preset (a name or a variant's reference, with the federation's
    ``preset_overrides``), the seed a deployed hospital splits its patients by, and the simulated world's
    folder (simulated hospitals find their partitions there; deployed ones ignore it)."""

    preset: str
    seed: int = 0
    world: str | None = None
    preset_overrides: Mapping[str, Any] | None = None
    teachers_per_hospital: int | None = None   # a deployed hospital's teachers when its node config names none

    def __post_init__(self) -> None:
        _set(self, "preset", _text(self.preset, "preset"))
        _set(self, "seed", _integer(self.seed, "seed"))
        _set(self, "world", str(self.world) if self.world else None)
        if self.preset_overrides is not None:
            _set(self, "preset_overrides", _mapping(self.preset_overrides, "preset_overrides"))
        if self.teachers_per_hospital is not None:   # 0 / "" mean the preset's, as a run config writes None
            _set(self, "teachers_per_hospital",
                 _integer(self.teachers_per_hospital, "teachers_per_hospital", 0) or None)


@dataclass(frozen=True, kw_only=True)
class HospitalRequest(WireRecord):
    """The fields every request may carry. ``device`` / ``precision``: where a simulated hospital computes
    (None: its own default, auto / 32). The rest is a simulated hospital's own privacy as the simulation sets
    it: where it keeps its lifetime ledger (``ledger_dir``), its lifetime budget and the δ it accounts at, its
    codec policy (``allow_identity``, ``max_latent_dim``; unset: its own) and its secure-sum threat model
    (``secure_policy``: ``clients.secure.SecurePolicy`` fields). A deployed hospital ignores every one of
    them: its node config decides."""

    device: str | None = None
    precision: str | None = None
    ledger_dir: str | None = None
    lifetime_epsilon: float | None = None
    delta: float | None = None
    allow_identity: bool | None = None
    max_latent_dim: int | None = None
    secure_policy: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        # an empty value means "the hospital's own", as a run config writes None
        _set(self, "device", check_device_spec(self.device, "device") if self.device else None)
        _set(self, "precision", check_precision(self.precision, "precision") if self.precision else None)
        _set(self, "ledger_dir", str(self.ledger_dir) if self.ledger_dir else None)
        if self.lifetime_epsilon is not None:
            # +inf: no lifetime bound (tests of a mechanism alone)
            _set(self, "lifetime_epsilon", _real(self.lifetime_epsilon, "lifetime_epsilon", positive=True,
                                                 unbounded=True))
        if self.delta is not None:
            _set(self, "delta", _real(self.delta, "delta", positive=True, below=1.0))
        if self.allow_identity is not None:
            _set(self, "allow_identity", _flag(self.allow_identity, "allow_identity"))
        if self.max_latent_dim is not None:
            _set(self, "max_latent_dim", _integer(self.max_latent_dim, "max_latent_dim", 1))
        if self.secure_policy is not None:
            policy = _mapping(self.secure_policy, "secure_policy")
            _set(self, "secure_policy", {k: _integer(v, f"secure_policy.{k}", 0) for k, v in policy.items()})


@dataclass(frozen=True, kw_only=True)
class TeacherTrainingRequest(HospitalRequest):
    """``train``: fine-tune every teacher from ``init_weights`` (arrays; None = random weights) by the teachers'
    recipe, which the request carries whole (:data:`RECIPE`: the server resolves it once from its preset,
    ``server.pate.teacher_training``; a hospital never fills a gap from its own); a request without one of its
    fields is refused. An unset seed is the hospital's own (the run's)."""

    #: the fields of the teachers' recipe (``task.settings.presets.Teachers``, the learning rate resolved): every request
    #: carries each of them
    RECIPE: ClassVar[tuple[str, ...]] = ("teacher_epochs", "teacher_trainable", "teacher_learning_rate",
                                         "teacher_augment", "teacher_batch_size")

    init_weights: Mapping[str, Any] | None = dataclasses.field(default=None, metadata=ARRAYS)
    teacher_epochs: int | None = None
    seed: int | None = None
    teacher_trainable: str | None = None        # a task.options.Trainable value
    teacher_learning_rate: float | None = None
    teacher_augment: bool | None = None
    teacher_batch_size: int | None = None
    local_dp: Mapping[str, Any] | None = None   # the teachers train with local DP-SGD (task.learning.dpsgd.DPConfig fields)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teacher_epochs is not None:
            _set(self, "teacher_epochs", _integer(self.teacher_epochs, "teacher_epochs", 0))
        if self.seed is not None:
            _set(self, "seed", _integer(self.seed, "seed"))
        _set(self, "teacher_trainable", look_up_option(self.teacher_trainable, Trainable, "teacher_trainable").value
             if self.teacher_trainable else None)
        _set(self, "teacher_learning_rate", _real(self.teacher_learning_rate, "teacher_learning_rate", positive=True)
             if self.teacher_learning_rate else None)
        if self.teacher_augment is not None:
            _set(self, "teacher_augment", _flag(self.teacher_augment, "teacher_augment"))
        if self.teacher_batch_size is not None:
            _set(self, "teacher_batch_size", _integer(self.teacher_batch_size, "teacher_batch_size", 1))
        missing = [name for name in self.RECIPE if getattr(self, name) is None]
        if missing:
            raise UserError(f"train request: no {', '.join(missing)}; a request carries the teachers' whole recipe "
                            f"({', '.join(self.RECIPE)}), the server's, never completed from a hospital's own preset")
        if self.local_dp is not None:
            local_dp = _mapping(self.local_dp, "local_dp")
            missing = [key for key in LOCAL_DP_REQUIRED if key not in local_dp]
            if local_dp and missing:
                raise UserError(f"local_dp: expected DPConfig fields with at least {', '.join(LOCAL_DP_REQUIRED)}; "
                                f"no {', '.join(missing)}")
            _set(self, "local_dp", local_dp)


@dataclass(frozen=True, kw_only=True)
class QueryRequest(HospitalRequest):
    """``query``: every teacher's encoding of the public scans sent (the codec travels beside them). A normal batch declares what it releases -- one
    ``release_ids`` entry per scan, the server's ``sigma`` and the ``teachers`` K it averages -- and the
    hospital charges its own ledger for that before any teacher runs. ``diagnostic``: an un-noised query
    (simulation only), which declares nothing. ``method``, ``seed`` and ``queries`` (the query indices) are
    the server's bookkeeping."""

    method: str | None = None
    seed: int | None = None
    queries: tuple[int, ...] | None = None
    release_ids: tuple[str, ...] | None = None
    sigma: float | None = None
    teachers: int | None = None
    diagnostic: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed is not None:
            _set(self, "seed", _integer(self.seed, "seed"))
        if self.queries is not None:
            _set(self, "queries", tuple(_integer(q, "queries", 0) for q in _items(self.queries, "queries")))
        if self.diagnostic is not None:
            _set(self, "diagnostic", bool(self.diagnostic) or None)
        if self.diagnostic:
            return
        if self.release_ids is None or self.sigma is None or self.teachers is None:
            raise UserError("a query must declare release_ids, sigma and teachers (the hospital charges its own "
                            "ledger before answering)")
        _set(self, "release_ids", tuple(str(r) for r in _items(self.release_ids, "release_ids")))
        _set(self, "sigma", _real(self.sigma, "sigma", positive=True))
        _set(self, "teachers", _integer(self.teachers, "teachers", 1))


@dataclass(frozen=True, kw_only=True)
class EvaluationRequest(HospitalRequest):
    """``evaluate`` (simulation only): every teacher's Dice on the public test ``images`` and ``labels``
    (arrays), else on the hospital's own validation cases."""

    seed: int | None = None
    images: Any = dataclasses.field(default=None, metadata=ARRAYS)
    labels: Any = dataclasses.field(default=None, metadata=ARRAYS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed is not None:
            _set(self, "seed", _integer(self.seed, "seed"))


#: the fine-tuning levers a DP-FedAvg round may set (``task.learning.training.LEVER_KEYS``), and how each is read
FEDAVG_LEVERS = {"trainable": str, "augmentation_multiplicity": int, "ema_decay": float}


@dataclass(frozen=True, kw_only=True)
class FedAvgRoundRequest(HospitalRequest):
    """``train.fedavg``: round ``round`` of ``rounds`` of local DP-SGD from the global weights sent, at budget
    (``epsilon``, ``delta``) for the whole run under ``relation``. ``plan`` (JSON: every grid setting's
    expected batch and epochs) makes the hospital calibrate one noise multiplier for all of them together,
    ``setting`` naming the one this round belongs to; ``run_tag`` names the run's ledger at the hospital.
    The round's recipe (:data:`RECIPE`: the grid setting's learning rate, clipping norm and expected batch, and
    whether DP-SGD clips per layer) travels whole: the server resolves it once from its preset
    (``server.dpfedavg.dpfedavg_settings``); a hospital never fills a gap from its own, and a request without one
    of its fields is refused. ``trainable``, ``augmentation_multiplicity`` and ``ema_decay`` are the grid entry's
    fine-tuning levers (``task.learning.training.lever_settings``; unset: the engine's defaults).
    ``reproducible_noise``: seeded noise (simulation only; a deployed hospital refuses it)."""

    #: the round's training recipe: every round request carries each of them
    RECIPE: ClassVar[tuple[str, ...]] = ("learning_rate", "max_grad_norm", "batch_size", "per_layer")

    round: int
    rounds: int
    epsilon: float
    delta: float
    local_epochs: int = 1
    seed: int = 0
    run_tag: str = "run"
    reproducible_noise: bool = False
    relation: Relation = Relation.REPLACE_ONE
    setting: int | None = None
    plan: str | None = None
    learning_rate: float | None = None
    max_grad_norm: float | None = None
    batch_size: int | None = None
    per_layer: bool | None = None
    trainable: str | None = None
    augmentation_multiplicity: int | None = None
    ema_decay: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _set(self, "round", _integer(self.round, "round", 0))
        _set(self, "rounds", _integer(self.rounds, "rounds", 1))
        _set(self, "epsilon", _real(self.epsilon, "epsilon", positive=True))
        _set(self, "local_epochs", _integer(self.local_epochs, "local_epochs", 1))
        _set(self, "seed", _integer(self.seed, "seed"))
        # checked as a file name by the hospital whose ledger it names (clients.fedavg): here only its type
        _set(self, "run_tag", str(self.run_tag))
        _set(self, "reproducible_noise", bool(self.reproducible_noise))
        _set(self, "relation", look_up_option(self.relation, Relation, "relation"))
        for name in ("learning_rate", "max_grad_norm"):
            if getattr(self, name) is not None:
                _set(self, name, _real(getattr(self, name), name, positive=True))
        if self.batch_size is not None:
            _set(self, "batch_size", _integer(self.batch_size, "batch_size", 1))
        if self.per_layer is not None:
            _set(self, "per_layer", _flag(self.per_layer, "per_layer"))
        missing = [name for name in self.RECIPE if getattr(self, name) is None]
        if missing:
            raise UserError(f"dp-fedavg round request: no {', '.join(missing)}; a request carries the round's whole "
                            f"recipe ({', '.join(self.RECIPE)}), the server's, never completed from a hospital's own "
                            "preset")
        _set(self, "plan", self.plan or None)
        if self.setting is not None:
            _set(self, "setting", _integer(self.setting, "setting", 0))
        if self.plan is not None:
            self.plan_entries()   # refuses a plan that is not a list of settings
            if self.setting is None:
                raise UserError("setting: a round with a plan must name its setting")
        if self.trainable is not None:
            _set(self, "trainable", look_up_option(self.trainable, Trainable, "trainable").value)
        if self.augmentation_multiplicity is not None:
            _set(self, "augmentation_multiplicity",
                 _integer(self.augmentation_multiplicity, "augmentation_multiplicity", 1))
        if self.ema_decay is not None:
            _set(self, "ema_decay", _real(self.ema_decay, "ema_decay"))

    def plan_entries(self) -> list[dict[str, int]] | None:
        """Every grid setting's ``batch_size`` and ``epochs`` (None: no plan, this round's own setting only)."""
        if self.plan is None:
            return None
        try:
            entries = json.loads(self.plan)
            return [{"batch_size": _integer(entry["batch_size"], "plan batch_size", 1),
                     "epochs": _integer(entry["epochs"], "plan epochs", 0)} for entry in entries]
        except (TypeError, ValueError, KeyError):
            raise UserError("plan: expected a JSON list of {batch_size, epochs} settings") from None

    def levers(self) -> dict[str, Any]:
        """The fine-tuning levers this round sets (for ``task.learning.training.lever_settings``)."""
        return {key: getattr(self, key) for key in FEDAVG_LEVERS if getattr(self, key) is not None}


@dataclass(frozen=True, kw_only=True)
class SecureStageRequest(HospitalRequest):
    """The run's settings beside one secure-sum stage message (``clients.secure``; the stage and its
    message travel beside them). ``secure_noise_seed``: the hospitals seed their rounding and noise shares
    (simulation only; a deployed hospital refuses it)."""

    method: str | None = None
    seed: int | None = None
    secure_noise_seed: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("seed", "secure_noise_seed"):
            if getattr(self, name) is not None:
                _set(self, name, _integer(getattr(self, name), name))


def read_request_as(who: str, kind: type[R], config: Any) -> R:
    """``config`` read as a request of ``kind`` (``kind.from_config``) by hospital ``who``: a malformed one is
    refused naming that hospital and the key (one line)."""
    try:
        return kind.from_config(config)
    except UserError as exc:
        raise UserError(f"hospital {who}: {exc}") from None
