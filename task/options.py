"""Named options of the simulation, as string enums, and the lookup every user-facing value goes through.

A member *is* its string (``Trainable.VOXEL_HEAD == "voxel-head"``), so results, checkpoints and wire messages
keep their text while code compares against members. :func:`look_up_option` turns a user's value into a member or
fails with one line naming the option and listing the choices (MONAI's ``monai.utils.look_up_option`` pattern);
it is :func:`privacy.options.look_up_option` raising :class:`task.errors.UserError`. The privacy core's options
(neighbouring relation, sampling, schedule family, PATE calibration, noise kind) live in :mod:`privacy.options`
and are re-exported here.

Kept free of torch and numpy: the CLI builds its help from these at start-up.
"""

from __future__ import annotations

import numbers
from enum import StrEnum
from typing import TypeVar

from privacy.options import Calibration, NoiseKind, Relation, Sampling, ScheduleFamily, choices
from privacy.options import look_up_option as _look_up_option
from task.errors import UserError

E = TypeVar("E", bound=StrEnum)


#: the value of a count or device option this machine decides (``--workers``, ``--device``,
#: ``$FEDPATE_PHANTOM_WORKERS``)
AUTO = "auto"


def look_up_option(value, options: type[E], name: str) -> E:
    """``value`` as a member of ``options``, or a one-line :class:`task.errors.UserError` that names ``name`` and
    lists the choices."""
    return _look_up_option(value, options, name, error=UserError)


def check_averaging_decay(value, name: str) -> None:
    """An averaging decay (exponential moving average of the iterates): None (no average) or a number in
    [0, 1); anything else is a one-line :class:`task.errors.UserError` naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not 0 <= value < 1):
        raise UserError(f"{name}: expected a number in [0, 1) or None, got {value!r}")


class Trainable(StrEnum):
    """Which weights private fine-tuning trains (their meaning: ``task.learning.networks.TRAINABLE_SETS``)."""
    ALL = "all"
    DECODER = "decoder"
    HEAD = "head"
    BIAS = "bias"
    VOXEL_HEAD = "voxel-head"
    VOXEL_HEAD_AND_UNET = "voxel-head+all"


class Decoder(StrEnum):
    """How the anchored codec turns a noisy aggregate into pseudo-labels (``task.codecs.anchored.ANCHORED_DECODERS``)."""
    MASS_MATCHING = "mass-matching"
    HEAD_FIT = "head-fit"


class PcaMode(StrEnum):
    """How the PCA codec bounds its sensitivity (Fay et al., "Private Learning for High-Dimensional Targets with
    PATE", Sec. 3; ``task.codecs.pca.PCACompressor``)."""
    PUBLIC = "public"   # min(sqrt(d), sqrt(sum_j ||a_j||_1^2)) / K: from the public basis, tighter
    PAPER = "paper"     # sqrt(d) / K (the paper's eq. 4)
    CLIP = "clip"       # rows clipped to C at the hospital: 2C / K


class PublicStart(StrEnum):
    """The model every method starts from (``server.selftrain.train_public_models``)."""
    REFERENCE = "reference"        # pre-trained on the public reference maps
    SELF_TRAINED = "self-trained"  # ... then self-trained on the public query scans (no hospital, no privacy cost)


class NoiseMode(StrEnum):
    """How DP-SGD chooses its noise multiplier (``task.learning.dpsgd`` module docstring, "Noise modes")."""
    TARGET = "target"       # calibrated so the planned epochs spend exactly the budget
    FIXED = "fixed"         # a given sigma; training stops before the epoch that would exceed the budget
    SCHEDULE = "schedule"   # sigma_t from a Yu et al. (2019, arXiv 1904.02200) decay schedule


class CalibrationAccountant(StrEnum):
    """The accountant DP-SGD calibrates and plans Poisson-sampled epochs with (``privacy.calibration``)."""
    PLD = "pld"   # privacy loss distributions (dp_accounting): both relations
    RDP = "rdp"   # Renyi DP (dp_accounting): add/remove only


class GradSampleMode(StrEnum):
    """Opacus' per-sample gradient engine (``grad_sample_mode`` of ``PrivacyEngine.make_private``)."""
    HOOKS = "hooks"
    FUNCTORCH = "functorch"


class Precision(StrEnum):
    """Forward-pass precision (``task.learning.device.autocast``)."""
    FP32 = "32"
    BF16 = "bf16"   # torch.autocast(bfloat16) around forward passes; losses, clipping and noise stay float32


class AugmentOn(StrEnum):
    """Where training augmentation runs (``task.learning.training.TrainConfig.augment_on``)."""
    HOST = "host"       # MONAI, per sample, numpy RNG: the CPU default and the reference results
    DEVICE = "device"   # task.data.augment.BatchAugmentation: the whole batch in torch on the training device


class PublicScans(StrEnum):
    """Which of the server's public scan sets a PATE batch belongs to (``server.pate.ReleasePlan``): the query
    scans the hospitals label, or the test scans of the un-noised diagnostic."""
    QUERY = "query"
    TEST = "test"


class SplitScheme(StrEnum):
    """How private patients go to hospitals (``task.data.partitions.make_split``)."""
    INSTITUTION = "institution"
    IID = "iid"
    DIRICHLET = "dirichlet"
    PAPER = "paper"


class Init(StrEnum):
    """Where a baseline's training starts (``sim.runners.central.CentralConfig.init``)."""
    PUBLIC = "public"     # the public model (``server.selftrain.train_public_models``), as PATE's teachers and student
    SCRATCH = "scratch"   # random weights (the seed paper's DP-SGD baseline)


class Selection(StrEnum):
    """How the pooled DP-SGD baseline chooses its setting among the preset's grid (``task.learning.selection``)."""
    PUBLIC = "public"     # every grid entry trained and charged, the best on the public validation set kept
    PRIVATE = "private"   # Papernot & Steinke (2022, arXiv 2110.03620) on held-out private patients, one event


class CentralMethod(StrEnum):
    """The baselines trained on the pooled private data (``task.settings.methods.CENTRAL_METHODS`` names their results)."""
    NONPRIVATE = "nonprivate"   # plain training: the ceiling, no privacy guarantee
    DP_SGD = "dp-sgd"           # DP-SGD with per-sample clipping and Gaussian noise


class AugmentLevel(StrEnum):
    """How much training augments (``task.data.augment``)."""
    GEOMETRIC = "geometric"   # flips and a small rotation
    DOMAIN = "domain"         # ... plus per-channel intensity randomisation (SynthSeg-style)


class Engine(StrEnum):
    """What runs the federated cells of ``fedpate simulate`` / ``compare`` (``sim.runners.simulation``)."""
    FLOWER = "flower"         # flwr.simulation.run_simulation in this process (Ray, one virtual SuperNode per hospital)
    RUNTIME = "runtime"       # the simulation runtime behind `flwr run` (a --simulation SuperLink), as `flwr run .`
    INPROCESS = "inprocess"   # no Flower: the same protocol code (server.protocols), fastest


#: the engines ``fedpate compare`` and ``demo`` offer (Flower's runtime starts its own ServerApp process per run)
COMPARE_ENGINES = (Engine.INPROCESS, Engine.FLOWER)


class Reference(StrEnum):
    """Who drew the label maps of a real-scan check folder (``--real-check KIND=DIR``, ``task.reporting.realcheck``): fedpate
    cannot tell from the files, so the user says, and the report marks every case with it."""
    EXPERT = "expert"         # a radiologist's segmentation, or a challenge's expert-approved ground truth
    ALGORITHM = "algorithm"   # an algorithm's output: scores against it measure agreement with that algorithm


class CompareTask(StrEnum):
    """What ``fedpate compare --task`` compares: tumour segmentation, or the classification seed systems on 2D tumour
    slices or on 5,000 MNIST digits (``task.classification.tasks``)."""
    SEGMENTATION = "segmentation"
    SLICE_CLASSIFICATION = "slice-classification"
    MNIST5K = "mnist5k"


__all__ = ["AUTO", "AugmentLevel", "AugmentOn", "COMPARE_ENGINES", "Calibration", "CalibrationAccountant",
           "CentralMethod", "CompareTask", "Decoder", "Engine", "GradSampleMode", "Init", "NoiseKind", "NoiseMode",
           "PcaMode", "Precision", "PublicScans", "PublicStart", "Reference", "Relation", "Sampling", "ScheduleFamily",
           "Selection", "SplitScheme", "Trainable", "choices", "look_up_option"]
