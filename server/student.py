"""The public model and the PATE student (Fay et al., Algorithms 1-2, last line: "Train the student
model on ((x_n, y_hat_n))"), trained with the shared engine (task.training).

* :func:`train_public_model` — a U-Net trained on the public reference split (images + labels). It is
  the teachers' initialisation and, trained further for the student's epochs on the same data, the
  ``public-only`` baseline.
* :func:`train_student` — starts from the public model and trains on the decoded pseudo-labels of the
  public query scans (soft probabilities by default), together with the public reference data
  (``include_reference``): everything public the server holds. PATE helps exactly where this student
  beats the public-only model trained on the reference data alone for the same number of epochs.

Both train on ``device`` (``task.device``; None = auto) at ``precision``, and are returned there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from task.codecs import one_hot
from task.device import resolve_device
from task.networks import VOXEL_HEAD_AND_UNET, WITH_VOXEL_HEAD, build_unet, load_start_weights
from task.options import Trainable
from task.training import TrainConfig, train_segmentation


def _train(images, targets, preset, *, epochs, seed, init, progress, checkpoint, description, device=None,
           precision="32", trainable: Trainable = Trainable.ALL, learning_rate: float | None = None):
    torch.manual_seed(seed)
    model = build_unet(preset.unet, trainable=trainable)
    if epochs <= 0:
        if init is not None:
            load_start_weights(model, init)
        return model.to(resolve_device(device))
    config = TrainConfig(epochs=int(epochs), batch_size=preset.batch_size,
                         learning_rate=preset.learning_rate if learning_rate is None else float(learning_rate),
                         seed=seed, progress=progress, checkpoint=checkpoint, init_from=init,
                         description=description, device=device, precision=precision, trainable=trainable)
    return train_segmentation(model, images, targets, config).model


def train_public_model(world, preset, *, seed: int = 0, epochs: int | None = None, init=None,
                       progress: bool = False, checkpoint: str | Path | None = None, device=None,
                       precision: str = "32"):
    """U-Net on the public reference images + labels (pre-training / public-only baseline).

    Args:
        world: the public world (its ``reference_images`` and ``reference_labels``; without reference images
            nothing is trained and the model is ``init``, or its random start).
        preset: the preset (network, batch size, learning rate; ``pretrain_epochs`` when ``epochs`` is None).
        seed: the network's initialisation and the training's batch order and augmentation.
        epochs: training epochs (None = the preset's ``pretrain_epochs``; 0 = no training).
        init: a state_dict (or checkpoint path / module) to start from (None = random weights).
        progress: a progress bar.
        checkpoint: saved after every epoch and resumed from when it exists, so a comparison's cells share
            one training (None = no checkpoint).
        device / precision: where the model trains and is returned (``task.device``; None = auto) and whether
            forward passes run under bf16 autocast (``"32"`` = float32).
    """
    epochs = preset.pretrain_epochs if epochs is None else epochs
    if world.reference_images is None:
        epochs = 0
    return _train(world.reference_images, world.reference_labels, preset, epochs=epochs, seed=seed, init=init,
                  progress=progress, checkpoint=checkpoint, description="public model", device=device,
                  precision=precision)


def train_student(world, pseudo_labels: np.ndarray, query_indices, preset, *, seed: int = 0, init=None,
                  epochs: int | None = None, include_reference: bool = True, progress: bool = False,
                  checkpoint: str | Path | None = None, device=None, precision: str = "32",
                  trainable: Trainable = Trainable.ALL, learning_rate: float | None = None, finetune: bool = False):
    """Student on (query scans, decoded pseudo-labels) [+ public reference (images, one-hot labels)].

    Args:
        world: the public world (``query_images``; the reference images and labels).
        pseudo_labels: soft (m, C, *g) probabilities or hard (m, *g) labels for ``query_indices``.
        query_indices: the query scans the pseudo-labels belong to (indices into ``world.query_images``).
        preset: the preset (network, batch size, learning rate; ``student.epochs`` when ``epochs`` is None).
        seed: the network's initialisation and the training's batch order and augmentation.
        init: a state_dict to start from -- the public model's in PATE (None = random weights).
        epochs: training epochs (None = the preset's ``student.epochs``).
        include_reference: also train on the public reference images with their labels (one-hot probabilities
            when the pseudo-labels are soft).
        progress: a progress bar.
        checkpoint: saved after every epoch and resumed from when it exists (None = no checkpoint).
        device / precision: where the model trains and is returned (``task.device``; None = auto) and whether
            forward passes run under bf16 autocast (``"32"`` = float32).
        trainable: what the student trains (``task.networks.TRAINABLE_SETS``; ``voxel-head`` adds a head to the
            public model and trains only the head).
        learning_rate: Adam's learning rate (None = the preset's).
        finetune: after training ``trainable``, train every weight (a voxel head's too) from there for the same
            epochs at the preset's learning rate, on the same targets: linear probing then fine-tuning (Kumar et al.
            2022, "Fine-tuning can distort pretrained features and underperform out-of-distribution", arXiv
            2202.10054) -- the first stage fits the new head on fixed features, so the second adapts the features
            to the targets instead of being pulled by a random head. Post-processing of the student's targets:
            no privacy cost.
    """

    epochs = preset.student.epochs if epochs is None else epochs
    images = world.query_images[np.asarray(query_indices, dtype=int)]
    targets = np.asarray(pseudo_labels)
    if include_reference and world.reference_images is not None:
        reference = world.reference_labels
        if targets.ndim == images.ndim:  # soft targets: the reference labels as one-hot probabilities
            reference = one_hot(reference, targets.shape[1])
        images = np.concatenate([images, world.reference_images])
        targets = np.concatenate([targets.astype(np.float32) if targets.ndim == images.ndim else targets,
                                  reference.astype(targets.dtype)])
    if len(images) == 0:
        return _train(None, None, preset, epochs=0, seed=seed, init=init, progress=progress, checkpoint=None,
                      description="student", device=device, precision=precision)
    first_checkpoint = checkpoint if not finetune or checkpoint is None else \
        Path(checkpoint).with_name(Path(checkpoint).stem + "-probe" + Path(checkpoint).suffix)
    student = _train(images, targets, preset, epochs=epochs, seed=seed, init=init, progress=progress,
                     checkpoint=first_checkpoint, description="student", device=device, precision=precision,
                     trainable=trainable, learning_rate=learning_rate)
    if not finetune or trainable == Trainable.ALL or epochs <= 0:
        return student
    whole = VOXEL_HEAD_AND_UNET if trainable in WITH_VOXEL_HEAD else Trainable.ALL
    return _train(images, targets, preset, epochs=epochs, seed=seed, progress=progress, checkpoint=checkpoint,
                  init={k: v.detach().clone() for k, v in student.state_dict().items()},
                  description="student (fine-tuning)", device=device, precision=precision, trainable=whole)
