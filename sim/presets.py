"""Experiment presets shared by every role and command.

A preset fixes the simulated world (how many phantom cases, hospitals, teachers), the working grid and
the training budgets. ``tiny`` is for tests (seconds to a couple of minutes on 2 CPU cores), ``quick``
is the README demo (minutes on 2 CPU cores), ``paper`` reproduces the seed paper's BraTS setting
(Fay et al., Sec. 5: 64^3 patches, K = 8 teachers over 320 volumes, N = 80 public queries, 84 test
volumes, delta = 1e-3) on the MSD Task01 folder and is meant for a GPU.

Every default of the quick preset that a measurement fixed has a note in ``docs/decisions/`` (question,
measurement, decision). Why it uses many small teachers: the query phase can carry at most about
K^2 mu^2 / (8 ln 2) bits about the teachers' answers (docs/PRIVACY.md, "What limits PATE"), so with K = 8
PATE cannot beat its own decoder's prior; with K ~ 128 it can (docs/decisions/many-small-teachers.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum


class PublicStart(StrEnum):
    """The model every method starts from (``server.selftrain.train_public_models``)."""
    REFERENCE = "reference"        # pre-trained on the public reference maps
    SELF_TRAINED = "self-trained"  # ... then self-trained on the public query scans (no hospital, no privacy cost)


def look_up_public_start(value) -> PublicStart:
    """``value`` as a :class:`PublicStart`, or a one-line error that lists the choices (MONAI's
    ``look_up_option`` pattern)."""
    try:
        return PublicStart(value)
    except ValueError:
        choices = ", ".join(member.value for member in PublicStart)
        raise ValueError(f"public_start: unknown value {value!r}; expected one of {choices}") from None


@dataclass(frozen=True)
class Preset:
    name: str
    # --- the simulated world (phantoms) ---
    phantom_cases: int            # labelled cases generated (imagesTr)
    phantom_test_cases: int       # unlabelled imagesTs cases (only used by `predict` demos)
    institutions: int             # scanner profiles in the phantom generator
    phantom_resolution_mm: float  # voxel size the phantoms are written at
    # The public labelled data's own source: another centre's labelled collection -- its own
    # generator seed (sim.world.PUBLIC_PHANTOM_SEED), scanner profiles and lesion regime -- from which the public
    # reference and validation sets are drawn; the hospitals' population above gives the hospitals' patients,
    # the public query scans and the test set. 0 = one population (the public sets drawn from it, as with an
    # MSD folder). kw_only: these fields keep the positional order of the others.
    public_cases: int = field(default=0, kw_only=True)          # other-centre labelled cases generated
    public_institutions: int = field(default=2, kw_only=True)   # its scanner profiles
    public_shift: str = field(default="none", kw_only=True)     # its regime (sim.data.shifts; "a+b" combines)
    # --- preprocessing ---
    grid: tuple[int, int, int]    # working grid every volume is resampled to
    # --- the federation ---
    hospitals: int
    teachers_per_hospital: int
    split_scheme: str             # "institution" | "iid" | "dirichlet"
    n_query: int                  # public unlabelled query scans (the student's inputs), N
    n_reference: int              # public labelled reference segmentations (PCA / AE fitting)
    n_validation: int             # public validation set (schedules, model selection)
    n_test: int                   # held-out test set
    # --- networks and training ---
    unet: str                     # key of sim.networks.UNET_PRESETS
    teacher_epochs: int
    pretrain_epochs: int          # public pre-training of the teachers' initial model (0 = none)
    student_epochs: int
    central_epochs: int
    batch_size: int
    learning_rate: float
    # --- compressors ---
    pca_components: int | None    # None = automatic choice (Fay et al., eq. 7: keep components with lambda_j > sigma^2)
    ae_latent_dim: int
    ae_epochs: int
    # --- privacy ---
    epsilon: float = 8.0
    delta: float = 1e-3
    dpsgd_max_grad_norm: float = 4.0
    dpsgd_noise_multiplier: float = 6 ** 0.5   # the paper's setting (Fay et al., Sec. 5)
    # The DP baselines' settings grids: each entry fixes some of learning_rate, max_grad_norm,
    # batch_size (expected batch) and epochs (DP-FedAvg: rounds); the rest come from the fields above. Every
    # entry is trained on the private data under one noise multiplier calibrated for all of them together,
    # and the entry with the best public validation Dice is kept (sim.runners.central, server.dpfedavg).
    # Empty: one setting, the preset's.
    dpsgd_grid: tuple = field(default=(), kw_only=True)
    dpfedavg_grid: tuple = field(default=(), kw_only=True)
    # Where every method starts (PublicStart): the public model pre-trained on the reference maps, or that model
    # self-trained on the public query scans (server.selftrain.train_public_models).
    public_start: str = field(default=PublicStart.REFERENCE.value, kw_only=True)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        look_up_public_start(self.public_start)

    @property
    def teachers(self) -> int:
        return self.hospitals * self.teachers_per_hospital

    def replace(self, **changes) -> "Preset":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny", phantom_cases=48, phantom_test_cases=2, institutions=2, phantom_resolution_mm=4.0,
        grid=(16, 16, 16), hospitals=2, teachers_per_hospital=4, split_scheme="institution",
        n_query=8, n_reference=8, n_validation=4, n_test=6,
        public_cases=12, public_institutions=2, public_shift="lesions",
        unet="tiny", teacher_epochs=3, pretrain_epochs=3, student_epochs=4, central_epochs=4,
        batch_size=2, learning_rate=3e-3, pca_components=None, ae_latent_dim=8, ae_epochs=10,
        dpsgd_grid=({"learning_rate": 3e-3}, {"learning_rate": 1e-3, "epochs": 2}),
        dpfedavg_grid=({"learning_rate": 3e-3}, {"learning_rate": 1e-3}),
    ),
    "quick": Preset(
        name="quick", phantom_cases=260, phantom_test_cases=4, institutions=4, phantom_resolution_mm=3.0,
        grid=(32, 32, 32), hospitals=4, teachers_per_hospital=32, split_scheme="institution",
        # the world: a public centre unlike the hospitals', so there is headroom (docs/decisions/world.md)
        n_query=40, n_reference=24, n_validation=10, n_test=40,
        public_cases=34, public_institutions=2, public_shift="scanner+lesions",
        # public pre-training: 24 maps x 50 epochs = 1200 volume-epochs (docs/decisions/public-pretraining.md)
        # teachers: a voxel head on the frozen public model, 60 steps at lr 1e-2 (docs/decisions/teachers.md)
        # codec: 3 T1-Gd bins per shell (docs/decisions/intensity-bins.md); decoder: one fitted voxel head
        # (docs/decisions/head-fit-decoder.md); student: a voxel head (docs/decisions/student.md)
        unet="small", teacher_epochs=60, pretrain_epochs=50, student_epochs=10, central_epochs=10,
        batch_size=2, learning_rate=2e-3, pca_components=None, ae_latent_dim=16, ae_epochs=60,
        # DP-SGD: expected batch 16, flat clipping at 0.1 (docs/decisions/dp-sgd-batch-and-clip.md);
        # DP-FedAvg: a hospital's 45 patients at expected batch 8, q ~ 1/6 (docs/decisions/dp-fedavg.md)
        dpsgd_max_grad_norm=0.1, extra={"dpsgd_batch_size": 16, "dpsgd_per_layer": False, "dpfedavg_batch_size": 8,
                                        "teacher_trainable": "voxel-head", "teacher_learning_rate": 1e-2,
                                        "teacher_augment": False, "anchored_intensity_bins": 3,
                                        "anchored_decoder": "head-fit", "student_trainable": "voxel-head",
                                        "student_learning_rate": 1e-2},
        # DP-SGD and DP-FedAvg: the non-private ceiling's settings, no grid (docs/decisions/dp-ceiling-settings.md);
        # DP-SGD trains a voxel head at lr 1e-2 (docs/decisions/dp-sgd-voxel-head.md); DP-FedAvg keeps full
        # fine-tuning (docs/decisions/dp-fedavg.md)
        dpsgd_grid=({"trainable": "voxel-head", "learning_rate": 1e-2},),
        dpfedavg_grid=(),
    ),
    "paper": Preset(
        name="paper", phantom_cases=484, phantom_test_cases=0, institutions=8, phantom_resolution_mm=1.0,
        grid=(64, 64, 64), hospitals=8, teachers_per_hospital=1, split_scheme="paper",
        n_query=80, n_reference=0, n_validation=0, n_test=84,
        unet="paper", teacher_epochs=100, pretrain_epochs=0, student_epochs=100, central_epochs=100,
        batch_size=2, learning_rate=1e-3, pca_components=None, ae_latent_dim=64, ae_epochs=100,
    ),
}


def get_preset(name: str, **overrides) -> Preset:
    """Return the named preset with ``overrides`` applied (``None`` values are ignored)."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"--preset: unknown preset {name!r}; expected one of {', '.join(PRESETS)}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    return preset.replace(**changes) if changes else preset
