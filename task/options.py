"""Named options of the simulation, as string enums, and the lookup every user-facing value goes through.

A member *is* its string (``Trainable.VOXEL_HEAD == "voxel-head"``), so results, checkpoints and wire messages
keep their text while code compares against members. :func:`look_up_option` turns a user's value into a member or
fails with one line naming the option and listing the choices (MONAI's ``monai.utils.look_up_option`` pattern);
it is :func:`privacy.options.look_up_option` raising :class:`task.errors.UserError`. The privacy core's options
(neighbouring relation, sampling, schedule family) live in :mod:`privacy.options` and are re-exported here.

Kept free of torch and numpy: the CLI builds its help from these at start-up.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from privacy.options import Relation, Sampling, ScheduleFamily, choices
from privacy.options import look_up_option as _look_up_option
from task.errors import UserError

E = TypeVar("E", bound=StrEnum)


def look_up_option(value, options: type[E], name: str) -> E:
    """``value`` as a member of ``options``, or a one-line :class:`task.errors.UserError` that names ``name`` and
    lists the choices."""
    return _look_up_option(value, options, name, error=UserError)


class Trainable(StrEnum):
    """Which weights private fine-tuning trains (their meaning: ``task.networks.TRAINABLE_SETS``)."""
    ALL = "all"
    DECODER = "decoder"
    HEAD = "head"
    BIAS = "bias"
    VOXEL_HEAD = "voxel-head"
    VOXEL_HEAD_AND_UNET = "voxel-head+all"


class Decoder(StrEnum):
    """How the anchored codec turns a noisy aggregate into pseudo-labels (``server.compressors.ANCHORED_DECODERS``)."""
    MASS_MATCHING = "mass-matching"
    HEAD_FIT = "head-fit"


class PcaMode(StrEnum):
    """How the PCA codec bounds its sensitivity (Fay et al., "Private Learning for High-Dimensional Targets with
    PATE", Sec. 3; ``server.compressors.PCACompressor``)."""
    PUBLIC = "public"   # min(sqrt(d), sqrt(sum_j ||a_j||_1^2)) / K: from the public basis, tighter
    PAPER = "paper"     # sqrt(d) / K (the paper's eq. 4)
    CLIP = "clip"       # rows clipped to C at the hospital: 2C / K


class PublicStart(StrEnum):
    """The model every method starts from (``server.selftrain.train_public_models``)."""
    REFERENCE = "reference"        # pre-trained on the public reference maps
    SELF_TRAINED = "self-trained"  # ... then self-trained on the public query scans (no hospital, no privacy cost)


class SplitScheme(StrEnum):
    """How private patients go to hospitals (``task.data.partitions.make_split``)."""
    INSTITUTION = "institution"
    IID = "iid"
    DIRICHLET = "dirichlet"
    PAPER = "paper"


class AugmentLevel(StrEnum):
    """How much training augments (``task.data.augment``)."""
    GEOMETRIC = "geometric"   # flips and a small rotation
    DOMAIN = "domain"         # ... plus per-channel intensity randomisation (SynthSeg-style)


class CompareTask(StrEnum):
    """What ``fedpate compare --task`` compares: tumour segmentation, or the classification seed systems on 2D tumour
    slices or on 5,000 MNIST digits (``task.classification.tasks``)."""
    SEGMENTATION = "segmentation"
    SLICE_CLASSIFICATION = "slice-classification"
    MNIST5K = "mnist5k"


__all__ = ["AugmentLevel", "CompareTask", "Decoder", "PcaMode", "PublicStart", "Relation", "Sampling",
           "ScheduleFamily", "SplitScheme", "Trainable", "choices", "look_up_option"]
