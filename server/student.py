"""The public model and the PATE student (Fay et al., Algorithms 1-2, last line: "Train the student
model on ((x_n, y_hat_n))"), trained with the shared engine (task.learning.training).

* :func:`train_public_model` — a U-Net trained on the public reference split (images + labels). It is
  the teachers' initialisation and, trained further for the student's epochs on the same data, the
  ``public-only`` baseline.
* :func:`train_student` — starts from the public model and trains on the decoded pseudo-labels of the
  public query scans (soft probabilities by default), together with the public reference data
  (``include_reference``): everything public the server holds. PATE helps exactly where this student
  beats the public-only model trained on the reference data alone for the same number of epochs.

Both train as a :class:`ModelTraining` says -- on its ``compute.device`` (``task.learning.device``; auto = CUDA when there is
one) at its ``compute.precision``, and are returned there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from task.learning.compute import Compute, check_compute
from task.codecs import one_hot
from task.learning.device import resolve_device
from task.errors import UserError
from task.learning.networks import VOXEL_HEAD_AND_UNET, WITH_VOXEL_HEAD, build_unet, load_start_weights
from task.options import Trainable, check_averaging_decay, look_up_option
from task.learning.phases import timed
from task.learning.training import TrainConfig, train_segmentation


@dataclass(frozen=True)
class ModelTraining:
    """How the server trains one of its models (the public model, the student, a self-training round),
    validated when built.

    Args:
        seed: the network's initialisation and the training's batch order and augmentation.
        epochs: training epochs (None = the preset's: ``pretrain_epochs`` for the public model,
            ``student.epochs`` for the student; 0 = no training).
        checkpoint: saved after every epoch and resumed from when it exists, so a comparison's cells share one
            training (None = no checkpoint).
        compute: where the model trains and is returned (``device``: ``task.learning.device``; None or auto = CUDA when
            there is one), whether forward passes run under bf16 autocast (``precision``; ``"32"`` = float32) and
            a progress bar (``progress``; off by default) -- :class:`task.learning.compute.Compute`.
        trainable: what is trained (``task.learning.networks.TRAINABLE_SETS``; ``voxel-head`` adds a head to the start
            model and trains only the head).
        learning_rate: Adam's learning rate (None = the preset's).
        finetune: the student only -- after training ``trainable``, train every weight (a voxel head's too) from
            there for the same epochs at the preset's learning rate, on the same targets: linear probing then
            fine-tuning (Kumar et al. 2022, "Fine-tuning can distort pretrained features and underperform
            out-of-distribution", arXiv 2202.10054) -- the first stage fits the new head on fixed features, so the
            second adapts the features to the targets instead of being pulled by a random head. Post-processing of
            the student's targets: no privacy cost.
        include_reference: the student only -- also train on the public reference images with their labels
            (one-hot probabilities when the pseudo-labels are soft).
        ema_decay: the model returned by each stage is the exponential moving average of its iterates at this
            decay (Polyak averaging; None = the last iterate). On the student's fixed targets the last iterate
            depends on the training's own draws (batch order, augmentation): on one release, three draws of the
            quick preset's student differed by up to 0.11 in real TC Dice; the average of the iterates cut that
            spread 2-5 times (docs/decisions/student.md). Post-processing of the targets: no privacy cost.
    """

    seed: int = 0
    epochs: int | None = None
    checkpoint: str | Path | None = None
    compute: Compute = Compute(progress=False)
    trainable: Trainable | str = Trainable.ALL
    learning_rate: float | None = None
    finetune: bool = False
    include_reference: bool = True
    ema_decay: float | None = None

    def __post_init__(self) -> None:
        if self.epochs is not None and int(self.epochs) < 0:
            raise UserError(f"epochs: expected an integer >= 0, got {self.epochs!r}")
        if self.learning_rate is not None and not float(self.learning_rate) > 0:
            raise UserError(f"learning_rate: expected a positive number, got {self.learning_rate!r}")
        look_up_option(self.trainable, Trainable, "trainable")
        check_averaging_decay(self.ema_decay, "ema_decay")
        check_compute(self.compute)


def _train(images, targets, preset, init, training: ModelTraining, description: str):
    """A U-Net of ``preset`` trained per ``training`` (its ``epochs`` resolved) from ``init``."""
    torch.manual_seed(training.seed)
    model = build_unet(preset.unet, trainable=training.trainable)
    if training.epochs <= 0:
        if init is not None:
            load_start_weights(model, init)
        return model.to(resolve_device(training.compute.device))
    config = TrainConfig(epochs=int(training.epochs), batch_size=preset.batch_size,
                         learning_rate=(preset.learning_rate if training.learning_rate is None
                                        else float(training.learning_rate)),
                         seed=training.seed, checkpoint=training.checkpoint, init_from=init, description=description,
                         trainable=training.trainable, compute=training.compute, ema_decay=training.ema_decay)
    return train_segmentation(model, images, targets, config).model


@timed("public model")
def train_public_model(world, preset, training: ModelTraining = ModelTraining(), init=None):
    """U-Net on the public reference images + labels (pre-training / public-only baseline).

    Args:
        world: the public world (its ``reference_images`` and ``reference_labels``; without reference images
            nothing is trained and the model is ``init``, or its random start).
        preset: the preset (network, batch size, learning rate; ``pretrain_epochs`` when ``training.epochs`` is
            None).
        training: how (:class:`ModelTraining`: seed, epochs, checkpoint, compute, ...).
        init: a state_dict (or checkpoint path / module) to start from (None = random weights).
    """
    epochs = preset.pretrain_epochs if training.epochs is None else training.epochs
    if world.reference_images is None:
        epochs = 0
    return _train(world.reference_images, world.reference_labels, preset, init, replace(training, epochs=epochs),
                  "public model")


def _student_data(world, pseudo_labels: np.ndarray, query_indices, include_reference: bool):
    """(images, targets) the student trains on: the query scans with their pseudo-labels [+ the public
    reference images with their labels, one-hot when the pseudo-labels are soft]."""
    images = world.query_images[np.asarray(query_indices, dtype=int)]
    targets = np.asarray(pseudo_labels)
    if include_reference and world.reference_images is not None:
        reference = world.reference_labels
        if targets.ndim == images.ndim:  # soft targets: the reference labels as one-hot probabilities
            reference = one_hot(reference, targets.shape[1])
        images = np.concatenate([images, world.reference_images])
        targets = np.concatenate([targets.astype(np.float32) if targets.ndim == images.ndim else targets,
                                  reference.astype(targets.dtype)])
    return images, targets


@timed("student")
def train_student(world, pseudo_labels: np.ndarray, query_indices, preset,
                  training: ModelTraining = ModelTraining(), init=None):
    """Student on (query scans, decoded pseudo-labels) [+ public reference (images, one-hot labels)].

    Args:
        world: the public world (``query_images``; the reference images and labels).
        pseudo_labels: soft (m, C, *g) probabilities or hard (m, *g) labels for ``query_indices``.
        query_indices: the query scans the pseudo-labels belong to (indices into ``world.query_images``).
        preset: the preset (network, batch size, learning rate; ``student.epochs`` when ``training.epochs`` is
            None).
        training: how (:class:`ModelTraining`, with the student's ``trainable``, ``learning_rate``,
            ``finetune`` and ``include_reference``).
        init: a state_dict to start from -- the public model's in PATE (None = random weights).
    """

    epochs = preset.student.epochs if training.epochs is None else training.epochs
    images, targets = _student_data(world, pseudo_labels, query_indices, training.include_reference)
    if len(images) == 0:   # nothing to train on: the start model (every weight, as it was given)
        return _train(None, None, preset, init, replace(training, epochs=0, checkpoint=None, trainable=Trainable.ALL,
                                                        learning_rate=None), "student")
    checkpoint = training.checkpoint
    first_checkpoint = checkpoint if not training.finetune or checkpoint is None else \
        Path(checkpoint).with_name(Path(checkpoint).stem + "-probe" + Path(checkpoint).suffix)
    student = _train(images, targets, preset, init, replace(training, epochs=epochs, checkpoint=first_checkpoint),
                     "student")
    trainable = training.trainable
    if not training.finetune or trainable == Trainable.ALL or epochs <= 0:
        return student
    whole = VOXEL_HEAD_AND_UNET if trainable in WITH_VOXEL_HEAD else Trainable.ALL
    return _train(images, targets, preset, {k: v.detach().clone() for k, v in student.state_dict().items()},
                  replace(training, epochs=epochs, trainable=whole, learning_rate=None), "student (fine-tuning)")
