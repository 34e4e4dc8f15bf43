"""Test-time mirroring: the inference every released model is scored and used with.

A released model's probabilities for a scan are the mean softmax over the 8 mirrorings of its three spatial axes,
each output flipped back -- nnU-Net's default prediction (Isensee et al. 2021, "nnU-Net: a self-configuring method
for deep learning-based biomedical image segmentation", arXiv 1809.10486). The networks train with random flips
on every axis (``task.data.augment``), so each mirroring is a view they know; the average removes part of one
pass's variance at 8 times its cost. A fixed rule from the literature: nothing here is chosen on any data.

Where it applies: the phantom test Dice of every released model (``task.learning.training.evaluate_release``), the
real-scan check (``task.reporting.realcheck``), ``fedpate predict`` and ``fedpate evaluate`` (``--no-mirroring`` for one
pass). Training and every choice made during a run (validation, private selection, the teachers' answers, the
pseudo-labels) use one pass: mirroring them would cost 8 times as much inside the run.

MONAI's ``TestTimeAugmentation`` draws random transforms to estimate uncertainty; the fixed set of mirrorings
averaged here is nnU-Net's, written out in a few lines.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

#: how results.json and the real-scan check name this inference
DESCRIPTION = "test-time mirroring: the mean softmax over the 8 mirrorings of the spatial axes (nnU-Net's)"
#: the spatial axes flipped by each mirroring of an (n, C, x, y, z) batch: none, each one, each pair, all three
MIRRORINGS: tuple[tuple[int, ...], ...] = tuple(axes for count in range(4)
                                                for axes in itertools.combinations((2, 3, 4), count))


def mirrored_probabilities(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                           together: bool | None = None) -> torch.Tensor:
    """The mean of ``softmax(model(mirrored x))`` flipped back, over :data:`MIRRORINGS`, float32 (n, C, *g):
    the probabilities test-time mirroring gives for the batch ``x`` (n, 4, *g).

    ``together`` (None: on a GPU): the 8 mirrorings go through the network as one batch of 8n scans -- a GPU then
    runs 8 times fewer, fuller kernels; the same arithmetic for networks that treat the scans of a batch
    independently (instance normalisation, as every U-Net here), up to float summation order. On a CPU, one
    mirroring after the other (the same work; measured no faster batched: benchmarks/bench_teachers.py)."""
    if together is None:
        together = x.device.type == "cuda"
    if together:
        views = torch.cat([torch.flip(x, axes) if axes else x for axes in MIRRORINGS])
        probs = torch.softmax(model(views).float(), dim=1).view(len(MIRRORINGS), *x.shape[:1], -1, *x.shape[2:])
        total = probs[0].clone()
        for index, axes in enumerate(MIRRORINGS[1:], start=1):
            total += torch.flip(probs[index], axes)
        return total / len(MIRRORINGS)
    total = torch.softmax(model(x).float(), dim=1)
    for axes in MIRRORINGS[1:]:
        total += torch.flip(torch.softmax(model(torch.flip(x, axes)).float(), dim=1), axes)
    return total / len(MIRRORINGS)
