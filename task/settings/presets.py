"""Experiment presets shared by every role and command: one typed, immutable recipe each.

A preset fixes the simulated world (how many phantom cases, hospitals, teachers), the working grid and
the training budgets. ``tiny`` is for tests (seconds to a couple of minutes on 2 CPU cores), ``quick``
is the README demo (minutes on 2 CPU cores), ``paper`` reproduces the seed paper's BraTS setting
(Fay et al., Sec. 5: 64^3 patches, K = 8 teachers over 320 volumes, N = 80 public queries, 84 test
volumes, delta = 1e-3) on the MSD Task01 folder and is meant for a GPU.

Every default of the quick preset that a measurement fixed has a note in ``docs/decisions/`` (question,
measurement, decision). Why it uses many small teachers: the query phase can carry at most about
K^2 mu^2 / (8 ln 2) bits about the teachers' answers (docs/PRIVACY.md, "What limits PATE"), so with K = 8
PATE cannot beat its own decoder's prior; with K ~ 128 it can (docs/decisions/many-small-teachers.md).

The recipe is a :class:`Preset` composed of frozen groups -- :class:`World`, :class:`Federation`,
:class:`Teachers`, :class:`Student`, :class:`Codec`, :class:`DpSgd` and :class:`DpFedAvg` (grids of
:class:`DpSetting`), :class:`SelfTraining` -- each validated when it is built; every default lives in its field.
Presets are immutable (:data:`PRESETS` is read-only, assignment raises). A variant is
``preset.with_changes(teacher=dict(epochs=3), hospitals=2)``; it travels between processes (compare's workers,
Flower's run config, the hospitals' messages) as its :attr:`Preset.reference`, a string :func:`get_preset`
rebuilds it from: the registered name, followed by the changes as JSON when there are any
(``quick{"codec":{"anchored_intensity_bins":3}}``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
from dataclasses import dataclass
from typing import Any, Mapping

from task.data.shifts import SHIFTS
from task.errors import UserError
from task.options import Decoder, PublicStart, SplitScheme, Trainable, check_averaging_decay, look_up_option

__all__ = ["Codec", "DpFedAvg", "DpSetting", "DpSgd", "Federation", "PRESETS", "Preset", "PublicStart",
           "SelfTraining", "Student", "Teachers", "World", "get_preset", "preset_reference"]


# ------------------------------------------------------------------------------------------- validation
def _integer(value, name: str, low: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{name}: expected an integer >= {low}, got {value!r}")


def _positive(value, name: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise UserError(f"{name}: expected a positive number{' or None' if optional else ''}, got {value!r}")


def _flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise UserError(f"{name}: expected true or false, got {value!r}")


def _set(obj, name: str, value) -> None:
    """Normalise a field of a frozen dataclass while it is validated (a string to its enum, a list to a tuple)."""
    object.__setattr__(obj, name, value)


def _replace(obj, changes: Mapping[str, Any], where: str):
    """``dataclasses.replace(obj, **changes)``, refusing an unknown field in one line that names it."""
    names = [f.name for f in dataclasses.fields(obj)]
    for key in changes:
        if key not in names:
            raise UserError(f"{where}: unknown setting {key!r}; expected one of {', '.join(names)}")
    return dataclasses.replace(obj, **changes)


def _plain(value):
    """A recipe value as JSON-ready data (groups as mappings, tuples as lists, enums as their strings)."""
    if isinstance(value, DpSetting):
        return {k: _plain(v) for k, v in value.fixed().items()}
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


# ---------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class World:
    """The simulated world: its phantoms, the public centre's, the working grid and the split into sets."""
    phantom_cases: int            # labelled cases generated (imagesTr)
    phantom_test_cases: int       # unlabelled imagesTs cases (only used by `predict` demos)
    institutions: int             # scanner profiles in the phantom generator
    phantom_resolution_mm: float  # voxel size the phantoms are written at
    grid: tuple[int, int, int]    # working grid every volume is resampled to
    split_scheme: SplitScheme     # how private patients go to hospitals (task.data.partitions.make_split)
    n_reference: int              # public labelled reference segmentations (PCA / AE fitting)
    n_validation: int             # public validation set (schedules, model selection)
    n_test: int                   # held-out test set
    # The public labelled data's own source: another centre's labelled collection -- its own
    # generator seed (task.world.PUBLIC_PHANTOM_SEED), scanner profiles and lesion regime -- from which the public
    # reference and validation sets are drawn; the hospitals' population above gives the hospitals' patients,
    # the public query scans and the test set. 0 = one population (the public sets drawn from it, as with an
    # MSD folder).
    public_cases: int = 0         # other-centre labelled cases generated
    public_institutions: int = 2  # its scanner profiles
    public_shift: str = "none"    # its regime (task.data.shifts; "a+b" combines)

    def __post_init__(self):
        for name in ("phantom_cases", "phantom_test_cases", "institutions", "n_reference", "n_validation",
                     "n_test", "public_cases", "public_institutions"):
            _integer(getattr(self, name), f"world.{name}")
        _positive(self.phantom_resolution_mm, "world.phantom_resolution_mm")
        grid = tuple(self.grid) if isinstance(self.grid, (tuple, list)) else self.grid
        if not (isinstance(grid, tuple) and len(grid) == 3
                and all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid)):
            raise UserError(f"world.grid: expected three positive integers, got {self.grid!r}")
        _set(self, "grid", grid)
        _set(self, "split_scheme", look_up_option(self.split_scheme, SplitScheme, "world.split_scheme"))
        parts = str(self.public_shift).split("+")
        if not isinstance(self.public_shift, str) or any(part not in SHIFTS for part in parts):
            raise UserError(f"world.public_shift: expected one or more of {', '.join(SHIFTS)} joined by '+', "
                            f"got {self.public_shift!r}")


@dataclass(frozen=True)
class Federation:
    """Who holds the private data and how PATE asks them: hospitals, teachers each, public query scans."""
    hospitals: int
    teachers_per_hospital: int
    n_query: int                  # public unlabelled query scans (the student's inputs), N

    def __post_init__(self):
        _integer(self.hospitals, "federation.hospitals", 1)
        _integer(self.teachers_per_hospital, "federation.teachers_per_hospital", 1)
        _integer(self.n_query, "federation.n_query")

    @property
    def teachers(self) -> int:
        """K: every hospital's teachers together."""
        return self.hospitals * self.teachers_per_hospital


@dataclass(frozen=True)
class Teachers:
    """What each PATE teacher trains from the public model (docs/decisions/teachers.md)."""
    epochs: int
    trainable: Trainable = Trainable.ALL    # every weight, or a voxel head on the frozen public model
    learning_rate: float | None = None      # None = the preset's learning_rate
    augment: bool = True

    def __post_init__(self):
        _integer(self.epochs, "teacher.epochs")
        _set(self, "trainable", look_up_option(self.trainable, Trainable, "teacher.trainable"))
        _positive(self.learning_rate, "teacher.learning_rate", optional=True)
        _flag(self.augment, "teacher.augment")


@dataclass(frozen=True)
class Student:
    """What PATE's student trains on the decoded pseudo-labels (docs/decisions/student.md)."""
    epochs: int
    trainable: Trainable = Trainable.ALL
    learning_rate: float | None = None      # None = the preset's learning_rate
    finetune: bool = False                  # then every weight (server.student.train_student)
    # the released student is the exponential moving average of its iterates in each stage (None = the last
    # iterate); it trains on pseudo-labels already released, so the average is post-processing
    ema_decay: float | None = None

    def __post_init__(self):
        _integer(self.epochs, "student.epochs")
        _set(self, "trainable", look_up_option(self.trainable, Trainable, "student.trainable"))
        _positive(self.learning_rate, "student.learning_rate", optional=True)
        _flag(self.finetune, "student.finetune")
        check_averaging_decay(self.ema_decay, "student.ema_decay")


@dataclass(frozen=True)
class Codec:
    """The PATE codecs' settings: each kind's compressor (task.codecs.<kind>) defaults to its fields."""
    pca_components: int | None = None  # None = automatic (Fay et al., eq. 7: keep components with lambda_j > sigma^2)
    ae_latent_dim: int = 8
    ae_epochs: int = 20
    # the anchored residual codec (docs/decisions/anchored-shells-and-clip.md): signed-distance shells around the
    # public model's boundary, the clip as a multiple of the public median residual, T1-Gd bins per shell
    # (docs/decisions/intensity-bins.md) and its decoder (docs/decisions/head-fit-decoder.md)
    anchored_shells: tuple[int, int] = (-2, 5)
    anchored_clip_scale: float = 2.5
    anchored_intensity_bins: int = 1
    anchored_decoder: Decoder = Decoder.MASS_MATCHING

    def __post_init__(self):
        if self.pca_components is not None:
            _integer(self.pca_components, "codec.pca_components", 1)
        _integer(self.ae_latent_dim, "codec.ae_latent_dim", 1)
        _integer(self.ae_epochs, "codec.ae_epochs")
        shells = tuple(self.anchored_shells) if isinstance(self.anchored_shells, (tuple, list)) else None
        if not (shells and len(shells) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in shells)
                and shells[0] < shells[1]):
            raise UserError(f"codec.anchored_shells: expected two increasing integers, got {self.anchored_shells!r}")
        _set(self, "anchored_shells", shells)
        _positive(self.anchored_clip_scale, "codec.anchored_clip_scale")
        _integer(self.anchored_intensity_bins, "codec.anchored_intensity_bins", 1)
        _set(self, "anchored_decoder", look_up_option(self.anchored_decoder, Decoder, "codec.anchored_decoder"))


@dataclass(frozen=True)
class DpSetting:
    """One entry of a DP baseline's settings grid: what it fixes; None = the recipe's value (every entry is
    trained on the private data under one noise multiplier calibrated for all of them together, and the one with
    the best public validation Dice is kept: sim.runners.central, server.dpfedavg).

    Layer: the preset's settings (like :class:`DpSgd`, its recipe). Each entry becomes one training's validated
    record, ``task.learning.dpsgd.DPConfig``, where the run trains it (``sim.runners.central``; a DP-FedAvg hospital builds
    its own from the round request the server resolves from this entry)."""
    learning_rate: float | None = None
    max_grad_norm: float | None = None
    batch_size: int | None = None             # expected batch
    epochs: int | None = None                 # DP-SGD only
    rounds: int | None = None                 # DP-FedAvg only
    local_epochs: int | None = None           # DP-FedAvg only
    # the fine-tuning levers (task.learning.training.LEVER_KEYS)
    trainable: Trainable | None = None
    augmentation_multiplicity: int | None = None
    ema_decay: float | None = None

    def __post_init__(self):
        for name in ("learning_rate", "max_grad_norm"):
            _positive(getattr(self, name), f"settings grid entry: {name}", optional=True)
        for name, low in (("batch_size", 1), ("epochs", 0), ("rounds", 1), ("local_epochs", 1),
                          ("augmentation_multiplicity", 1)):
            if getattr(self, name) is not None:
                _integer(getattr(self, name), f"settings grid entry: {name}", low)
        if self.trainable is not None:
            _set(self, "trainable", look_up_option(self.trainable, Trainable, "settings grid entry: trainable"))
        check_averaging_decay(self.ema_decay, "settings grid entry: ema_decay")

    def fixed(self) -> dict[str, Any]:
        """The settings this entry fixes (its fields that are not None), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def _grid(owner, refused: tuple[str, ...]) -> None:
    """Entries as :class:`DpSetting` (a mapping becomes one); refuse the fields the other baseline's grid uses."""
    entries = []
    for entry in owner.grid:
        if isinstance(entry, Mapping):
            entry = _replace(DpSetting(), entry, f"{owner.label}.grid entry")
        if not isinstance(entry, DpSetting):
            raise UserError(f"{owner.label}.grid: expected DpSetting entries, got {entry!r}")
        wrong = [name for name in refused if getattr(entry, name) is not None]
        if wrong:
            raise UserError(f"{owner.label}.grid entry: {wrong[0]!r} is not a {owner.label} setting")
        entries.append(entry)
    _set(owner, "grid", tuple(entries))


@dataclass(frozen=True)
class DpSgd:
    """Pooled DP-SGD's recipe (sim.runners.central); DP-FedAvg's hospitals clip the same way.

    Layer: the preset's settings, the one place the defaults live (the clip of Fay et al. Sec. 5 and their
    σ = √6). The command line's ``sim.runners.central.DPSGDOptions`` override some of them for one run (None =
    this recipe's); the training itself runs a validated ``task.learning.dpsgd.DPConfig`` built from both, which has no
    defaults for the budget, the clip or a fixed noise."""
    batch_size: int | None = None              # expected batch (None = the preset's batch_size)
    per_layer: bool = True                     # clip each parameter tensor, else the whole gradient
    max_grad_norm: float = 4.0
    noise_multiplier: float = 6 ** 0.5         # the paper's setting (Fay et al., Sec. 5)
    grid: tuple[DpSetting, ...] = ()           # empty: one setting, the recipe's

    label = "dp_sgd"

    def __post_init__(self):
        if self.batch_size is not None:
            _integer(self.batch_size, "dp_sgd.batch_size", 1)
        _flag(self.per_layer, "dp_sgd.per_layer")
        _positive(self.max_grad_norm, "dp_sgd.max_grad_norm")
        _positive(self.noise_multiplier, "dp_sgd.noise_multiplier")
        _grid(self, ("rounds", "local_epochs"))


@dataclass(frozen=True)
class DpFedAvg:
    """DP-FedAvg's recipe (server.dpfedavg); its clipping norm and per-layer clipping are :class:`DpSgd`'s."""
    batch_size: int | None = None              # a hospital's expected local batch (None = the preset's batch_size)
    grid: tuple[DpSetting, ...] = ()           # empty: one setting, the recipe's

    label = "dp_fedavg"

    def __post_init__(self):
        if self.batch_size is not None:
            _integer(self.batch_size, "dp_fedavg.batch_size", 1)
        _grid(self, ("epochs",))


@dataclass(frozen=True)
class SelfTraining:
    """Pseudo-label self-training on the public query scans (server.selftrain, its module docstring)."""
    rounds: int = 2               # rounds of pseudo-labelling; the best on public validation is kept
    temperature: float = 0.5      # MixMatch's sharpening temperature (Berthelot et al. 2019, arXiv 1905.02249)

    def __post_init__(self):
        _integer(self.rounds, "self_training.rounds", 1)
        _positive(self.temperature, "self_training.temperature")


#: the recipe's groups: field name -> class
GROUPS: dict[str, type] = {"world": World, "federation": Federation, "teacher": Teachers, "student": Student,
                           "codec": Codec, "dp_sgd": DpSgd, "dp_fedavg": DpFedAvg, "self_training": SelfTraining}
#: the group fields a preset reads directly (``preset.hospitals`` is ``preset.federation.hospitals``) and a change
#: may name directly (``with_changes(hospitals=4)``)
SHORTCUTS: dict[str, str] = {"hospitals": "federation", "teachers_per_hospital": "federation", "grid": "world"}


@dataclass(frozen=True)
class Preset:
    """One experiment's recipe (module docstring): a name, its groups, and the settings every method shares."""
    name: str
    world: World
    federation: Federation
    teacher: Teachers
    student: Student
    codec: Codec
    # --- networks and training every method shares ---
    unet: str                     # key of task.learning.networks.UNET_PRESETS
    pretrain_epochs: int          # public pre-training of the start model (0 = none)
    central_epochs: int           # pooled training (and DP-FedAvg's rounds x local epochs)
    batch_size: int
    learning_rate: float
    # the non-private ceiling releases the exponential moving average of its iterates (None = the last iterate),
    # as the student and self-training do (docs/decisions/ceiling-averaging.md)
    central_ema_decay: float | None = None
    dp_sgd: DpSgd = DpSgd()
    dp_fedavg: DpFedAvg = DpFedAvg()
    self_training: SelfTraining = SelfTraining()
    # --- privacy ---
    epsilon: float = 8.0
    delta: float = 1e-3
    # Where every method starts: the public model pre-trained on the reference maps, or that model self-trained on
    # the public query scans (server.selftrain.train_public_models).
    public_start: PublicStart = PublicStart.REFERENCE

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name and "{" not in self.name):
            raise UserError(f"preset name: expected a non-empty name without '{{', got {self.name!r}")
        for name, group in GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                value = group(**_checked(value, group, name))
                _set(self, name, value)
            if not isinstance(value, group):
                raise UserError(f"{name}: expected a {group.__name__}, got {value!r}")
        if not (isinstance(self.unet, str) and self.unet):
            raise UserError(f"unet: expected a network preset's name, got {self.unet!r}")
        _integer(self.pretrain_epochs, "pretrain_epochs")
        _integer(self.central_epochs, "central_epochs")
        _integer(self.batch_size, "batch_size", 1)
        _positive(self.learning_rate, "learning_rate")
        check_averaging_decay(self.central_ema_decay, "central_ema_decay")
        _positive(self.epsilon, "epsilon")
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not 0 < self.delta < 1:
            raise UserError(f"delta: expected a number in (0, 1), got {self.delta!r}")
        _set(self, "public_start", look_up_option(self.public_start, PublicStart, "public_start"))

    # --- the shortcuts (SHORTCUTS) and K
    @property
    def hospitals(self) -> int:
        return self.federation.hospitals

    @property
    def teachers_per_hospital(self) -> int:
        return self.federation.teachers_per_hospital

    @property
    def teachers(self) -> int:
        """K: every hospital's teachers together."""
        return self.federation.teachers

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.world.grid

    # --- variants
    def with_changes(self, **changes) -> "Preset":
        """A variant of this preset (it stays immutable). A key names a field: a group's takes a mapping of that
        group's own changes (``teacher=dict(epochs=3)``) or a whole group; a shortcut (``hospitals``,
        ``teachers_per_hospital``, ``grid``) changes its group's field. An unknown key is refused in one line."""
        names = [f.name for f in dataclasses.fields(self)]
        top: dict[str, Any] = {}
        grouped: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if key in SHORTCUTS:
                grouped.setdefault(SHORTCUTS[key], {})[key] = value
            elif key in GROUPS and isinstance(value, Mapping):
                grouped.setdefault(key, {}).update(value)
            elif key in names:
                top[key] = value
            else:
                raise UserError(f"preset {self.name}: unknown setting {key!r}; expected one of "
                                f"{', '.join([*names, *SHORTCUTS])}")
        for group, group_changes in grouped.items():
            top[group] = _replace(top.get(group, getattr(self, group)), group_changes, group)
        return dataclasses.replace(self, **top) if top else self

    def to_dict(self) -> dict[str, Any]:
        """The whole recipe as JSON-ready data (:meth:`from_dict` rebuilds it)."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Preset":
        return cls(**_checked(data, cls, "preset"))

    @property
    def changes(self) -> dict[str, Any]:
        """How this preset differs from the registered preset of its name, as :meth:`with_changes` takes it
        (group fields nested); empty for a registered preset, and for a preset whose name is not registered."""
        base = PRESETS.get(self.name)
        if base is None or base is self:
            return {}
        return _difference(base.to_dict(), self.to_dict())

    @property
    def reference(self) -> str:
        """The string :func:`get_preset` rebuilds this preset from: its name, then its :attr:`changes` as compact
        JSON when it has any. A preset whose name is not registered is referred to by its name alone."""
        changes = self.changes
        if not changes:
            return self.name
        return self.name + json.dumps(changes, sort_keys=True, separators=(",", ":"))


def _checked(data: Mapping[str, Any], cls: type, where: str) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise UserError(f"{where}: unknown setting {key!r}; expected one of {', '.join(names)}")
    return dict(data)


def _difference(base: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``new`` that differ from ``base`` (group mappings compared field by field)."""
    out = {}
    for key, value in new.items():
        if key in GROUPS:
            inner = {k: v for k, v in value.items() if base[key].get(k) != v}
            if inner:
                out[key] = inner
        elif base.get(key) != value:
            out[key] = value
    return out


_PRESETS = {
    "tiny": Preset(
        name="tiny",
        world=World(phantom_cases=48, phantom_test_cases=2, institutions=2, phantom_resolution_mm=4.0,
                    grid=(16, 16, 16), split_scheme="institution", n_reference=8, n_validation=4, n_test=6,
                    public_cases=12, public_institutions=2, public_shift="lesions"),
        federation=Federation(hospitals=2, teachers_per_hospital=4, n_query=8),
        unet="tiny", pretrain_epochs=3, central_epochs=4, batch_size=2, learning_rate=3e-3,
        teacher=Teachers(epochs=3), student=Student(epochs=4),
        codec=Codec(pca_components=None, ae_latent_dim=8, ae_epochs=10),
        dp_sgd=DpSgd(grid=(DpSetting(learning_rate=3e-3), DpSetting(learning_rate=1e-3, epochs=2))),
        dp_fedavg=DpFedAvg(grid=(DpSetting(learning_rate=3e-3), DpSetting(learning_rate=1e-3))),
    ),
    "quick": Preset(
        name="quick",
        # the world: a public centre unlike the hospitals', so there is headroom (docs/decisions/world.md)
        world=World(phantom_cases=260, phantom_test_cases=4, institutions=4, phantom_resolution_mm=3.0,
                    grid=(32, 32, 32), split_scheme="institution", n_reference=24, n_validation=10, n_test=40,
                    public_cases=34, public_institutions=2, public_shift="scanner+lesions"),
        federation=Federation(hospitals=4, teachers_per_hospital=32, n_query=40),
        # public pre-training: 24 maps x 50 epochs = 1200 volume-epochs (docs/decisions/public-pretraining.md)
        unet="small", pretrain_epochs=50, central_epochs=10, batch_size=2, learning_rate=2e-3,
        # the non-private ceiling releases the average of its iterates, as the student does: public validation
        # preferred it at seeds 0, 1 and 2 (docs/decisions/ceiling-averaging.md)
        central_ema_decay=0.99,
        # teachers: a voxel head on the frozen public model, 60 steps at lr 1e-2 (docs/decisions/teachers.md)
        teacher=Teachers(epochs=60, trainable=Trainable.VOXEL_HEAD, learning_rate=1e-2, augment=False),
        # student: a voxel head, then every weight from there (docs/decisions/student.md, lp-ft-student.md); each
        # stage releases the average of its iterates over ~100 steps, the last 3 of 10 epochs (student.md)
        student=Student(epochs=10, trainable=Trainable.VOXEL_HEAD, learning_rate=1e-2, finetune=True,
                        ema_decay=0.99),
        # codec: 3 T1-Gd bins per shell (docs/decisions/intensity-bins.md); decoder: one fitted voxel head
        # (docs/decisions/head-fit-decoder.md)
        codec=Codec(pca_components=None, ae_latent_dim=16, ae_epochs=60, anchored_intensity_bins=3,
                    anchored_decoder=Decoder.HEAD_FIT),
        # DP-SGD: expected batch 16, flat clipping at 0.1 (docs/decisions/dp-sgd-batch-and-clip.md), the
        # non-private ceiling's settings, no grid (docs/decisions/dp-ceiling-settings.md), a voxel head at lr 1e-2
        # (docs/decisions/dp-sgd-voxel-head.md)
        dp_sgd=DpSgd(batch_size=16, per_layer=False, max_grad_norm=0.1,
                     grid=(DpSetting(trainable=Trainable.VOXEL_HEAD, learning_rate=1e-2),)),
        # DP-FedAvg: a hospital's 45 patients at expected batch 8, q ~ 1/6, full fine-tuning, no grid
        # (docs/decisions/dp-fedavg.md)
        dp_fedavg=DpFedAvg(batch_size=8),
    ),
    "paper": Preset(
        name="paper",
        world=World(phantom_cases=484, phantom_test_cases=0, institutions=8, phantom_resolution_mm=1.0,
                    grid=(64, 64, 64), split_scheme="paper", n_reference=0, n_validation=0, n_test=84),
        federation=Federation(hospitals=8, teachers_per_hospital=1, n_query=80),
        unet="paper", pretrain_epochs=0, central_epochs=100, batch_size=2, learning_rate=1e-3,
        teacher=Teachers(epochs=100), student=Student(epochs=100),
        codec=Codec(pca_components=None, ae_latent_dim=64, ae_epochs=100),
    ),
}
#: the registered presets, read-only: a variant is built with :meth:`Preset.with_changes`, never stored here
PRESETS: Mapping[str, Preset] = types.MappingProxyType(_PRESETS)


def get_preset(name: str, **overrides) -> Preset:
    """The preset ``name`` refers to (a registered name, or a :attr:`Preset.reference`) with ``overrides`` applied
    by :meth:`Preset.with_changes` (``None`` values are ignored); an unknown name or key is refused in one line.

    Resolved once per process: the same name and overrides give the same (immutable) :class:`Preset` object, its
    reference parsed once (overrides that are not hashable values, such as a whole settings group as a mapping,
    are resolved anew each time)."""
    changes = tuple(sorted((k, v) for k, v in overrides.items() if v is not None))
    try:
        return _resolved_preset(str(name), changes)
    except TypeError as exc:   # an unhashable override value: not remembered
        if "unhashable" not in str(exc):
            raise
        return _resolve_preset(str(name), dict(changes))


@functools.lru_cache(maxsize=256)
def _resolved_preset(name: str, changes: tuple[tuple[str, Any], ...]) -> Preset:
    return _resolve_preset(name, dict(changes))


def _resolve_preset(name: str, overrides: Mapping[str, Any]) -> Preset:
    """:func:`get_preset`'s work: the registered preset, the reference's changes, then ``overrides``."""
    base, brace, rest = name.partition("{")
    try:
        preset = PRESETS[base]
    except KeyError:
        raise UserError(f"--preset: unknown preset {base!r}; expected one of {', '.join(PRESETS)}") from None
    if brace:
        try:
            changes = json.loads(brace + rest)
        except json.JSONDecodeError as exc:
            raise UserError(f"--preset: the changes after {base!r} are not JSON ({exc.msg})") from None
        if not isinstance(changes, dict):
            raise UserError(f"--preset: the changes after {base!r} must be a JSON object, got {rest!r}")
        preset = preset.with_changes(**changes)
    return preset.with_changes(**overrides) if overrides else preset


def preset_reference(preset: "str | Preset") -> str:
    """The string ``preset`` travels as between processes (:attr:`Preset.reference`), checked: a name or reference
    :func:`get_preset` resolves, or a :class:`Preset` it rebuilds exactly (a variant of a registered preset)."""
    if isinstance(preset, Preset):
        reference = preset.reference
        if preset.name not in PRESETS or get_preset(reference) != preset:
            raise UserError(f"preset {preset.name!r}: not a registered preset or a variant of one "
                            f"(expected a variant of {', '.join(PRESETS)} made with with_changes)")
        return reference
    get_preset(preset)
    return str(preset)
