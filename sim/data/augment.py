"""Training augmentation: MONAI flips and rotations (the paper's, each with p = 0.5) plus domain randomisation.

Fay et al. (Sec. 5) augment with random flips and rotations on half the samples. On top of that, for
phantoms to transfer to real scans (issue 10), intensities are randomised per channel (bias field, gamma,
a random monotone intensity curve, scaling, blur, Gaussian noise; SynthSeg-style, Billot et al. 2023) with a
smaller probability. The background (zero in every channel after preprocessing) stays zero. Level
``"geometric"`` keeps only flips and rotations; ``benchmarks/bench_domain_gap.py`` compares the two.

Labels move with the image: integer label maps are one-hot encoded, rotated together with the image
(bilinear) and turned back with argmax (smoother than nearest neighbour); soft targets (C, *grid) are
rotated bilinearly and renormalised. The callable has its own RNG, seeded at construction and by
:meth:`TrainingAugmentation.set_random_state`, so training runs are reproducible.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class TrainingAugmentation:
    """Callable on ``(image, label)`` pairs or ``{"image": ..., "label": ...}`` dicts (numpy or torch).

    ``image`` is (4, *grid); ``label`` is (*grid) integers or (C, *grid) probabilities, or None.
    Returns the same kind of object, with the same array types and dtypes, as it was given.
    """

    def __init__(self, seed: int = 0, prob: float = 0.5, max_rotation_deg: float = 10.0,
                 intensity: bool = True, intensity_prob: float = 0.3, classes: int = 4):
        # MONAI (~10 s to import) only when augmentation is built, not whenever sim.data is imported
        from monai.transforms import (
            Compose,
            RandAdjustContrast,
            RandBiasField,
            RandFlip,
            RandGaussianNoise,
            RandGaussianSmooth,
            RandHistogramShift,
            RandRotate,
            RandScaleIntensity,
        )

        self.prob = float(prob)
        self.classes = int(classes)
        angle = float(np.deg2rad(max_rotation_deg))
        self._flips = [RandFlip(prob=prob, spatial_axis=axis) for axis in range(3)]
        self._rotate = RandRotate(range_x=angle, range_y=angle, range_z=angle, prob=prob, keep_size=True,
                                  mode="bilinear", padding_mode="zeros")
        self._intensity = None
        if intensity:
            # Ranges reach past the phantom sites' own (bias <= 0.36, noise <= 7%, blur <= 1.8 mm): the model
            # should not learn any one scanner's look. Histogram shift = a random monotone intensity curve.
            self._intensity = Compose([
                RandBiasField(prob=intensity_prob, coeff_range=(0.0, 0.4), degree=3),
                RandAdjustContrast(prob=intensity_prob, gamma=(0.6, 1.6)),
                RandHistogramShift(prob=intensity_prob * 0.5, num_control_points=(4, 8)),
                RandScaleIntensity(prob=intensity_prob, factors=0.25),
                RandGaussianSmooth(prob=intensity_prob * 0.5, sigma_x=(0.25, 1.0), sigma_y=(0.25, 1.0),
                                   sigma_z=(0.25, 1.0)),
                RandGaussianNoise(prob=intensity_prob, mean=0.0, std=0.1),
            ])
        self.set_random_state(seed)

    def set_random_state(self, seed: int) -> "TrainingAugmentation":
        """Reseed every random transform (derived seeds, so transforms do not share draws)."""
        self._rng = np.random.RandomState(int(seed) % (2 ** 32))
        for transform in self._flips + [self._rotate]:
            transform.set_random_state(seed=int(self._rng.randint(2 ** 31)))
        if self._intensity is not None:
            self._intensity.set_random_state(seed=int(self._rng.randint(2 ** 31)))
        return self

    # ------------------------------------------------------------------------------------------- call
    def __call__(self, image: Any, label: Any = None):
        if isinstance(image, dict):
            out = dict(image)
            new_image, new_label = self._apply(image["image"], image.get("label"))
            out["image"] = new_image
            if image.get("label") is not None:
                out["label"] = new_label
            return out
        return self._apply(image, label)

    def _apply(self, image: Any, label: Any):
        image_is_torch = isinstance(image, torch.Tensor)
        img = torch.as_tensor(np.asarray(image) if not image_is_torch else image.detach().cpu(),
                              dtype=torch.float32)
        if img.ndim != 4:
            raise ValueError(f"augmentation: expected an image (channels, *grid), got shape {tuple(img.shape)}")
        channels = img.shape[0]
        target, kind = None, None
        if label is not None:
            lab = label.detach().cpu() if isinstance(label, torch.Tensor) else torch.as_tensor(np.asarray(label))
            if lab.ndim == 3:
                kind = "int"
                target = torch.nn.functional.one_hot(lab.long().clamp(0, self.classes - 1), self.classes)
                target = target.movedim(-1, 0).float()
            elif lab.ndim == 4:
                kind = "soft"
                target = lab.float()
            else:
                raise ValueError(f"augmentation: expected a label (*grid) or probabilities (C, *grid), "
                                 f"got shape {tuple(lab.shape)}")
        stacked = img if target is None else torch.cat([img, target], dim=0)
        brain = (img != 0).any(dim=0, keepdim=True).float()
        stacked = torch.cat([stacked, brain], dim=0)               # the brain mask moves with the image
        for flip in self._flips:
            stacked = flip(stacked)
        stacked = self._rotate(stacked)
        stacked = _plain(stacked).float()
        img, rest = stacked[:channels], stacked[channels:]
        brain = rest[-1:] > 0.5
        if self._intensity is not None:
            parts = [_plain(self._intensity(img[c:c + 1])).float() for c in range(channels)]
            img = torch.cat(parts, dim=0)
        img = torch.where(brain, img, torch.zeros((), dtype=img.dtype))   # background stays exactly zero
        out_image = img if image_is_torch else img.numpy()
        if isinstance(image, torch.Tensor):
            out_image = out_image.to(image.dtype)
        else:
            out_image = out_image.astype(np.asarray(image).dtype, copy=False)
        if target is None:
            return out_image, None
        probs = rest[:-1]
        total = probs.sum(dim=0, keepdim=True)
        empty = total < 1e-3                                       # corners rotated in from outside: background
        probs = torch.where(empty, torch.zeros_like(probs), probs / total.clamp_min(1e-6))
        probs[0:1] = torch.where(empty, torch.ones_like(probs[0:1]), probs[0:1])
        if kind == "int":
            out_label = probs.argmax(dim=0)
        else:
            out_label = probs
        if isinstance(label, torch.Tensor):
            return out_image, out_label.to(label.dtype)
        return out_image, out_label.numpy().astype(np.asarray(label).dtype, copy=False)


def _plain(tensor):
    """MONAI returns MetaTensors; callers get plain tensors (Opacus and torch.stack expect them)."""

    return tensor.as_tensor() if hasattr(tensor, "as_tensor") else torch.as_tensor(tensor)


AUGMENTATIONS = ("geometric", "domain")   # flips + rotations only; plus per-channel domain randomisation


def training_augmentation(seed: int = 0, level: str = "domain", **options) -> TrainingAugmentation:
    """Flips on three axes and a small rotation (each p = 0.5), plus intensity randomisation at ``"domain"``."""
    if level not in AUGMENTATIONS:
        raise ValueError(f"augmentation: unknown level {level!r}; expected one of {', '.join(AUGMENTATIONS)}")
    options.setdefault("intensity", level == "domain")
    return TrainingAugmentation(seed=seed, **options)
