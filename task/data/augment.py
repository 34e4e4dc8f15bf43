"""Training augmentation: MONAI flips and rotations (the paper's, each with p = 0.5) plus domain randomisation.

Fay et al. (Sec. 5) augment with random flips and rotations on half the samples. On top of that, for
phantoms to transfer to real scans (docs/GENERALISATION.md), intensities are randomised per channel (bias field, gamma,
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

from task.options import AugmentLevel


class TrainingAugmentation:
    """Callable on ``(image, label)`` pairs or ``{"image": ..., "label": ...}`` dicts (numpy or torch).

    ``image`` is (4, *grid); ``label`` is (*grid) integers or (C, *grid) probabilities, or None.
    Returns the same kind of object, with the same array types and dtypes, as it was given.
    """

    def __init__(self, seed: int = 0, prob: float = 0.5, max_rotation_deg: float = 10.0,
                 intensity: bool = True, intensity_prob: float = 0.3, classes: int = 4):
        # MONAI (~10 s to import) only when augmentation is built, not whenever task.data is imported
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
        # MONAI's transforms wrap every intermediate in a MetaTensor that records the affine and the applied
        # operations; nothing here reads them (the results are made plain tensors anyway), and the bookkeeping was a
        # quarter of the augmentation's time (12.9 against 9.6 ms a sample at 32^3, bit-identical outputs)
        from monai.data import get_track_meta, set_track_meta

        tracked = get_track_meta()
        set_track_meta(False)
        try:
            return self._apply_plain(image, label)
        finally:
            set_track_meta(tracked)

    def _apply_plain(self, image: Any, label: Any):
        image_is_torch = isinstance(image, torch.Tensor)
        img = torch.as_tensor(np.asarray(image) if not image_is_torch else image.detach().cpu(),
                              dtype=torch.float32)
        if img.ndim != 4:
            raise ValueError(f"augmentation: expected an image (channels, *grid), got shape {tuple(img.shape)}")
        channels = img.shape[0]
        target, integer_labels = None, False
        if label is not None:
            lab = label.detach().cpu() if isinstance(label, torch.Tensor) else torch.as_tensor(np.asarray(label))
            if lab.ndim == 3:
                integer_labels = True
                target = torch.nn.functional.one_hot(lab.long().clamp(0, self.classes - 1), self.classes)
                target = target.movedim(-1, 0).float()
            elif lab.ndim == 4:
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
        if integer_labels:
            # the class axis moved last first: the same first-maximum argmax, several times faster on a CPU
            # than reducing over the outer axis
            out_label = probs.movedim(0, -1).contiguous().argmax(dim=-1)
        else:
            out_label = probs
        if isinstance(label, torch.Tensor):
            return out_image, out_label.to(label.dtype)
        return out_image, out_label.numpy().astype(np.asarray(label).dtype, copy=False)


def _plain(tensor):
    """MONAI returns MetaTensors; callers get plain tensors (Opacus and torch.stack expect them)."""

    return tensor.as_tensor() if hasattr(tensor, "as_tensor") else torch.as_tensor(tensor)


AUGMENTATIONS = tuple(AugmentLevel)   # flips + rotations only; plus per-channel domain randomisation


def _level(level: str) -> AugmentLevel:
    """``level`` as an :class:`task.options.AugmentLevel` (a one-line error listing the levels otherwise)."""
    if level not in AUGMENTATIONS:
        raise ValueError(f"augmentation: unknown level {level!r}; expected one of {', '.join(AUGMENTATIONS)}")
    return AugmentLevel(level)


def training_augmentation(seed: int = 0, level: str = AugmentLevel.DOMAIN, **options) -> TrainingAugmentation:
    """Flips on three axes and a small rotation (each p = 0.5), plus intensity randomisation at ``"domain"``."""
    options.setdefault("intensity", _level(level) is AugmentLevel.DOMAIN)
    return TrainingAugmentation(seed=seed, **options)


# ------------------------------------------------------------------------------------ batched, on the device
class BatchAugmentation:
    """The same augmentation, batched in torch on whatever device the batch is on.

    Why: :class:`TrainingAugmentation` runs MONAI transforms sample by sample on the host; measured here
    (2-core CPU, under load) one 64^3 sample costs 1-2.6 s, against a U-Net step that takes a fraction of that on
    a GPU, so the GPU would wait on the host however the work is overlapped. This class applies the same
    transforms, in the same order, with the same probabilities and ranges (flips per axis p=0.5; one rotation
    p=0.5 with angles uniform in +-10 degrees per axis, bilinear, zero padding, about the centre; per channel with
    ``intensity_prob``: Legendre bias field of degree 3, gamma contrast, random monotone histogram curve (half
    the probability), intensity scaling, Gaussian smoothing (half), Gaussian noise), to a whole batch at once
    with ``grid_sample``, convolutions and element-wise ops. The background (zero in every channel) stays zero and
    labels move with the image exactly as in the host version (one-hot, resampled, renormalised, argmax).

    Not the same draws as the host version: the parameters come from a ``torch.Generator`` seeded with
    ``seed`` (drawn on the host, small), the noise fields from a generator on the batch's device seeded from it.
    Deterministic for a seed on a given device. Training uses it only when asked (``TrainConfig.augment_on``;
    default: on CUDA), so CPU results are those of the host version.
    """

    def __init__(self, seed: int = 0, prob: float = 0.5, max_rotation_deg: float = 10.0, intensity: bool = True,
                 intensity_prob: float = 0.3, classes: int = 4, degree: int = 3):
        self.prob, self.classes, self.degree = float(prob), int(classes), int(degree)
        self.angle = float(np.deg2rad(max_rotation_deg))
        self.intensity, self.intensity_prob = bool(intensity), float(intensity_prob)
        self.generator = torch.Generator().manual_seed(int(seed) % (2 ** 63))
        self._legendre: dict = {}

    # -- host-side draws (small) ------------------------------------------------------------------------
    def _uniform(self, shape, low=0.0, high=1.0) -> torch.Tensor:
        return low + (high - low) * torch.rand(shape, generator=self.generator, dtype=torch.float64)

    def _chance(self, shape, p) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator) < p

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``images`` (B, channels, *grid) float; ``targets`` (B, *grid) ints or (B, C, *grid) probabilities."""
        if images.ndim != 5:
            raise ValueError(f"batch augmentation: expected images (B, channels, D, H, W), got {tuple(images.shape)}")
        device, batch, channels = images.device, images.shape[0], images.shape[1]
        img = images.float()
        soft = targets.is_floating_point()
        target = targets.float() if soft else torch.nn.functional.one_hot(
            targets.long().clamp(0, self.classes - 1), self.classes).movedim(-1, 1).float()
        brain = (img != 0).any(dim=1, keepdim=True).float()
        stacked = torch.cat([img, target, brain], dim=1)
        # flips: one coin per sample and axis
        flips = self._chance((batch, 3), self.prob)
        for b in range(batch):
            dims = [1 + axis for axis in range(3) if flips[b, axis]]
            if dims:
                stacked[b] = stacked[b].flip(dims)
        # one rotation per sample (p = prob), angles uniform in +-angle about the volume's centre
        rotate = self._chance((batch,), self.prob)
        angles = self._uniform((batch, 3), -self.angle, self.angle) * rotate[:, None]
        if bool(rotate.any()):
            stacked = self._rotate(stacked, angles)
        img, rest = stacked[:, :channels], stacked[:, channels:]
        inside = rest[:, -1:] > 0.5
        if self.intensity:
            img = self._intensity(img)
        img = torch.where(inside, img, torch.zeros((), dtype=img.dtype, device=device))
        probs = rest[:, :-1]
        total = probs.sum(dim=1, keepdim=True)
        empty = total < 1e-3
        probs = torch.where(empty, torch.zeros_like(probs), probs / total.clamp_min(1e-6))
        probs[:, 0:1] = torch.where(empty, torch.ones_like(probs[:, 0:1]), probs[:, 0:1])
        out_target = probs.to(targets.dtype) if soft else probs.argmax(dim=1).to(targets.dtype)
        return img.to(images.dtype), out_target

    # -- geometry ----------------------------------------------------------------------------------------
    def _rotate(self, stacked: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Bilinear rotation about the centre, zero padding: ``theta = S^-1 R S`` in ``affine_grid``'s
        normalised coordinates (S = half the side per axis, so non-cubic grids rotate rigidly)."""
        cx, cy, cz = torch.cos(angles).unbind(1)
        sx, sy, sz = torch.sin(angles).unbind(1)
        one, zero = torch.ones_like(cx), torch.zeros_like(cx)
        rx = torch.stack([one, zero, zero, zero, cx, -sx, zero, sx, cx], 1).view(-1, 3, 3)
        ry = torch.stack([cy, zero, sy, zero, one, zero, -sy, zero, cy], 1).view(-1, 3, 3)
        rz = torch.stack([cz, -sz, zero, sz, cz, zero, zero, zero, one], 1).view(-1, 3, 3)
        rotation = rx @ ry @ rz
        depth, height, width = stacked.shape[2:]
        scale = torch.diag(torch.tensor([width, height, depth], dtype=torch.float64) / 2)
        linear = torch.linalg.inv(scale) @ rotation @ scale
        theta = torch.cat([linear, torch.zeros(len(angles), 3, 1, dtype=torch.float64)], dim=2)
        theta = theta.to(device=stacked.device, dtype=stacked.dtype)
        grid = torch.nn.functional.affine_grid(theta, list(stacked.shape), align_corners=False)
        return torch.nn.functional.grid_sample(stacked, grid, mode="bilinear", padding_mode="zeros",
                                               align_corners=False)

    # -- intensity, per sample and channel -------------------------------------------------------------------
    def _basis(self, grid, device) -> torch.Tensor:
        """Products of Legendre polynomials P_i(x) P_j(y) P_k(z), i + j + k <= degree (MONAI RandBiasField)."""
        key = (tuple(grid), str(device))
        if key not in self._legendre:
            axes = [torch.linspace(-1.0, 1.0, n, dtype=torch.float64) for n in grid]

            def legendre(x):
                values = [torch.ones_like(x), x]
                for n in range(1, self.degree):
                    values.append(((2 * n + 1) * x * values[n] - n * values[n - 1]) / (n + 1))
                return values

            px, py, pz = (legendre(a) for a in axes)
            terms = [px[i][:, None, None] * py[j][None, :, None] * pz[k][None, None, :]
                     for i in range(self.degree + 1) for j in range(self.degree + 1 - i)
                     for k in range(self.degree + 1 - i - j)]
            self._legendre[key] = torch.stack(terms).to(device=device, dtype=torch.float32)
        return self._legendre[key]

    def _intensity(self, img: torch.Tensor) -> torch.Tensor:
        """Each transform touches only the (sample, channel) volumes its coin selected (at most B x channels small
        kernels); every draw is made for all of them, so the draws do not depend on the coins."""
        device, shape = img.device, img.shape[:2]
        p = self.intensity_prob
        img = img.clone()
        # bias field: exp(sum_n coeff_n L_n(x, y, z)), coefficients uniform in [0, 0.4]
        use = self._chance(shape, p)
        basis = self._basis(img.shape[2:], device)
        coeff = self._uniform((*shape, basis.shape[0]), 0.0, 0.4).float()
        for b, c in use.nonzero().tolist():
            img[b, c] = img[b, c] * torch.exp(torch.einsum("n,nxyz->xyz", coeff[b, c].to(device), basis))
        # gamma contrast on each channel's own range
        use, gamma = self._chance(shape, p), self._uniform(shape, 0.6, 1.6)
        for b, c in use.nonzero().tolist():
            volume = img[b, c]
            low, span = volume.min(), volume.max() - volume.min()
            img[b, c] = ((volume - low) / (span + 1e-7)).clamp_min(0) ** float(gamma[b, c]) * span + low
        # random monotone intensity curve (histogram shift), half the probability
        use = self._chance(shape, p * 0.5)
        for b, c in use.nonzero().tolist():
            img[b, c] = self._histogram_shift(img[b, c])
        # scaling by 1 + U(-0.25, 0.25)
        use, factor = self._chance(shape, p), self._uniform(shape, -0.25, 0.25)
        for b, c in use.nonzero().tolist():
            img[b, c] = img[b, c] * (1 + float(factor[b, c]))
        # Gaussian smoothing, sigma uniform in [0.25, 1] per axis, half the probability
        use = self._chance(shape, p * 0.5)
        for b, c in use.nonzero().tolist():
            img[b, c] = self._smooth(img[b, c], self._uniform((3,), 0.25, 1.0).tolist())
        # Gaussian noise with std uniform in [0, 0.1] (drawn on the batch's device from a derived seed)
        use, std = self._chance(shape, p), self._uniform(shape, 0.0, 0.1).float()
        if bool(use.any()):
            noise_gen = torch.Generator(device=device).manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.generator)))
            noise = torch.randn(img.shape, generator=noise_gen, device=device, dtype=img.dtype)
            img = img + noise * (std * use).to(device).view(*shape, 1, 1, 1)
        return img

    def _histogram_shift(self, volume: torch.Tensor) -> torch.Tensor:
        points = int(torch.randint(4, 9, (1,), generator=self.generator))
        reference = torch.linspace(0, 1, points, dtype=torch.float64)
        floating = reference.clone()
        for i in range(1, points - 1):
            floating[i] = floating[i - 1] + (floating[i + 1] - floating[i - 1]) * float(self._uniform(()))
        low, high = volume.min(), volume.max()
        if float(high - low) <= 0:
            return volume
        ref = (reference.to(volume.device, volume.dtype) * (high - low) + low)
        flo = (floating.to(volume.device, volume.dtype) * (high - low) + low)
        flat = volume.reshape(-1)
        index = torch.searchsorted(ref, flat.contiguous()).clamp(1, points - 1)
        x0, x1, y0, y1 = ref[index - 1], ref[index], flo[index - 1], flo[index]
        weight = (flat - x0) / (x1 - x0).clamp_min(1e-12)
        return (y0 + weight * (y1 - y0)).reshape(volume.shape)

    @staticmethod
    def _smooth(volume: torch.Tensor, sigmas) -> torch.Tensor:
        out = volume[None, None]
        for axis, sigma in enumerate(sigmas):
            radius = max(1, int(np.ceil(4.0 * sigma)))
            x = torch.arange(-radius, radius + 1, dtype=volume.dtype, device=volume.device)
            kernel = torch.exp(-(x ** 2) / (2 * sigma ** 2))
            kernel = kernel / kernel.sum()
            shape = [1, 1, 1, 1, 1]
            shape[2 + axis] = len(x)
            padding = [0, 0, 0]
            padding[axis] = radius
            out = torch.nn.functional.conv3d(out, kernel.view(shape), padding=tuple(padding))
        return out[0, 0]


def batch_augmentation(seed: int = 0, level: str = AugmentLevel.DOMAIN, **options) -> BatchAugmentation:
    """:class:`BatchAugmentation` at one of :data:`AUGMENTATIONS` (geometric: flips and rotations only)."""
    options.setdefault("intensity", _level(level) is AugmentLevel.DOMAIN)
    return BatchAugmentation(seed=seed, **options)
