"""The anchored release decoded by one fitted voxel head (a decoder that can say where a class the
public model misses should go; docs/decisions/head-fit-decoder.md).

Mass matching (:func:`task.codecs.anchored_decode`) decodes each query's latents on their own: per region it
re-weights the public model's probabilities until each class carries the released mass, so *where* inside a
region the mass lands is the public model's ranking of voxels -- for a class the public model never predicts,
no ranking at all -- and every region's noise goes straight into its labels. Here one small per-voxel function
is fitted to *all* released latents at once:

    q_v(theta) = softmax(log p_v + h_theta([log p_v, x_v]))                          (h: task.learning.networks.voxel_head)
    theta*     = argmin_theta  sum_n || B_n (q_n(theta) - q_n(0)) - z_n ||^2

``p_v`` is the public anchor at voxel v, ``x_v`` the query scan's sequences there, ``B_n`` the codec's
orthonormal region sums (:func:`task.codecs.anchored_encode`; ``q_n(0)`` is the anchor as the head sees it, so
``z = 0`` leaves theta at 0 and decodes to the anchor exactly), ``z_n`` the released mean latents. The release
is ``z_n = mean_k clip_C(B_n (y_nk - p_n)) + N(0, sigma^2 I)`` with one sigma for every coordinate, so
theta* is the maximum-likelihood estimate of a head whose output the teachers' mean residual is -- least squares
in latent units (Gauss). On the quick world 40 query scans x 24 regions x 3 classes = 2,880 noisy numbers pin
down 213 parameters: the noise is averaged over every query instead of decoded region by region, and where a
class goes inside a region is decided by each voxel's own scores and intensities, learnt from how the released
masses vary with them across regions and scans. It is the same family of function the quick preset's teachers
are (voxel heads on the frozen public model), so the teachers' mean is close to one such head.

Privacy: post-processing. theta* is a function of the released latents and of public arrays only (the anchor,
the query scans, the regions, a fixed start), so the pseudo-labels and everything trained on them carry the
release's epsilon; no sensitivity claim changes and the hospitals' encoding is untouched.

Stated mismatch: the teachers' rows are clipped to C before they are averaged, the fitted ``B (q - q(0))`` is not
clipped -- where clipping bit, the fit matches the clipped mean, a shrunken version of what the teachers said.
Only voxels inside the regions are changed (the release says nothing about the others): outside them the
pseudo-label is the anchor, as with mass matching.

How the fit's settings were fixed: Adam at learning rate 1e-2 for 300 full-batch steps from the head's
zero start -- the voxel head's own rule (a zero-initialised head travels about lr per step; 300 steps let it
travel 3, which the quick preset's DP heads needed about 1 of), first values tried; the likelihood's convergence is
checked on the release itself (public), not on any Dice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from task.learning.device import resolve_device
from task.errors import UserError
from task.learning.networks import voxel_head

#: Adam steps and learning rate of the fit (module docstring: how they were fixed)
FIT_STEPS = 300
FIT_LEARNING_RATE = 1e-2
#: scans per forward pass (the gradient is accumulated over the batch: the fit is full batch whatever the chunk)
FIT_CHUNK = 40
#: the anchor's floor before its log (as in mass matching)
ANCHOR_FLOOR = 1e-6


@dataclass(frozen=True)
class HeadFitSettings:
    """How the head is fitted: Adam's full-batch ``steps`` and ``learning_rate`` (module docstring: how they were
    fixed), and ``seed``, the head's start (a fixed, public choice: the decode is deterministic)."""

    steps: int = FIT_STEPS
    learning_rate: float = FIT_LEARNING_RATE
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or int(self.steps) != self.steps or self.steps < 0:
            raise UserError(f"head-fit decoder: steps must be a whole number >= 0, got {self.steps!r}")
        if not float(self.learning_rate) > 0:
            raise UserError(f"head-fit decoder: learning_rate must be positive, got {self.learning_rate!r}")


def fit_head_decode(z: np.ndarray, anchor: np.ndarray, scans: np.ndarray, regions: np.ndarray, count: int, *,
                    settings: HeadFitSettings = HeadFitSettings(), device=None,
                    history: list | None = None) -> np.ndarray:
    """Pseudo-labels (n, C, *g) from the released mean latents by the head fit of the module docstring.

    Args:
        z: released (noisy) mean latents (n, (C - 1) * count), class-major as :func:`task.codecs.anchored_encode`.
        anchor: the public model's probabilities on the scans (n, C, *g).
        scans: the query scans themselves (n, S, *g): public, the head's other input.
        regions: the scans' regions (n, *g), -1 outside every region (:func:`task.codecs.binned_regions`).
        count: regions per class (the latent's second axis).
        settings: Adam's steps and learning rate, and the head's seed (:class:`HeadFitSettings`).
        device: where the fit runs (``task.learning.device``; None = auto).
        history: when a list, the loss (the squared latent residual, summed) at the start of every step is
            appended -- ``history[0]`` is ``|z|^2`` (theta = 0); the convergence check.
    """
    anchor = np.asarray(anchor, dtype=np.float32)
    scans = np.asarray(scans, dtype=np.float32)
    regions = np.asarray(regions, dtype=np.int64)
    n, classes = anchor.shape[:2]
    if scans.shape[0] != n or scans.shape[2:] != anchor.shape[2:]:
        raise UserError(f"head-fit decoder: scans of shape {scans.shape} do not match the anchor {anchor.shape}")
    if regions.shape != (n,) + anchor.shape[2:]:
        raise UserError(f"head-fit decoder: regions of shape {regions.shape} do not match the anchor {anchor.shape}")
    z = np.asarray(z, dtype=np.float64).reshape(n, classes - 1, int(count))
    out = anchor.copy()
    if not np.any(z):
        return out                     # nothing released beyond the public model
    device = resolve_device(device)
    # the head is initialised on the host from the host generator alone (torch.manual_seed would reseed every GPU's
    # too), inside fork_rng: the caller's streams are not moved by a decode
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(int(settings.seed))
        head = voxel_head(scans.shape[1], classes)
    head = head.to(device)
    optimiser = torch.optim.Adam(head.parameters(), lr=float(settings.learning_rate))
    chunks = [_Chunk(anchor[i:i + FIT_CHUNK], scans[i:i + FIT_CHUNK], regions[i:i + FIT_CHUNK],
                     z[i:i + FIT_CHUNK], int(count), device) for i in range(0, n, FIT_CHUNK)]
    for _ in range(int(settings.steps)):
        optimiser.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            loss = chunk.loss(head)
            loss.backward()
            total += float(loss.detach())
        optimiser.step()
        if history is not None:
            history.append(total)
    with torch.no_grad():
        flat_out = out.reshape(n, classes, -1)
        for start, chunk in zip(range(0, n, FIT_CHUNK), chunks):
            flat_out[start + chunk.scan_of, :, chunk.voxel] = chunk.probabilities(head).cpu().numpy()
    return out


class _Chunk:
    """A few scans' fixed tensors, kept for the voxels inside a region only (the loss reads no other voxel: on the
    quick world about a quarter of each scan): the head's input, the anchor as the head sees it, the region index
    (offset per scan so that one scatter sums every scan's regions)."""

    def __init__(self, anchor, scans, regions, z, count, device):
        classes = anchor.shape[1]
        flat = regions.reshape(len(regions), -1)
        scan_of, voxel = np.nonzero(flat >= 0)
        self.slots = len(regions) * count
        self.index = torch.as_tensor(scan_of * count + flat[scan_of, voxel]).to(device)
        log_p = torch.log(torch.as_tensor(anchor.reshape(len(anchor), classes, -1)[scan_of, :, voxel])
                          .clamp(ANCHOR_FLOOR, 1.0)).to(device)                                # (v, C)
        self.log_p = log_p
        self.features = torch.cat([log_p, torch.as_tensor(scans.reshape(len(scans), scans.shape[1], -1)
                                                          [scan_of, :, voxel]).to(device)], dim=1)
        self.base = torch.softmax(log_p, dim=1)
        sizes = torch.zeros(self.slots, dtype=torch.float32, device=device)
        sizes.index_add_(0, self.index, torch.ones(len(self.index), device=device))
        self.scale = sizes.clamp(min=1.0).sqrt()
        self.z = torch.as_tensor(z, dtype=torch.float32).to(device).permute(0, 2, 1).reshape(self.slots, classes - 1)
        self.scan_of, self.voxel = scan_of, voxel

    def probabilities(self, head):
        """(v, C): the head's 1x1x1 convolutions as the matrix products they are, on the gathered voxels."""
        first, act, second = head[0], head[1], head[2]
        hidden = act(torch.nn.functional.linear(self.features, first.weight.flatten(1), first.bias))
        return torch.softmax(self.log_p + torch.nn.functional.linear(hidden, second.weight.flatten(1), second.bias),
                             dim=1)

    def loss(self, head):
        residual = (self.probabilities(head) - self.base)[:, 1:]                                 # (v, C-1)
        sums = torch.zeros(self.slots, residual.shape[1], dtype=residual.dtype, device=residual.device)
        sums.index_add_(0, self.index, residual)
        return (((sums / self.scale[:, None]) - self.z) ** 2).sum()
