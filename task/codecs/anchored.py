"""The public-anchored residual codec (PATE should only add to what public data gives; docs/PRIVACY.md, "What
limits PATE"): ``z = clip_C(B_n (y - p_n))`` where ``p_n`` is the public model's prediction for query n (public side
information shipped with the query batch as ``anchor``) and ``B_n`` sums the tumour classes' residual over
regions around the public prediction's tumour (:func:`anchored_encode`, :func:`anchored_decode`); the server's
:class:`AnchoredResidualCompressor` fits C on public arrays and decodes (:data:`ANCHORED_DECODERS`).

The regions are the shells around the public tumour (:func:`anchor_regions`), each split into ``intensity_bins``
quantile bins of one channel of the query scan itself (:func:`intensity_bin_map`: a codec that can say where a class
the public model misses should go; docs/decisions/intensity-bins.md). Within a region the decoder can only place a
class's mass by the public model's ranking of voxels, which for a class the public model never predicts is no ranking
at all; the scan's own intensities are public side information that can. Default channel: T1-Gd, by the labels'
definition (the enhancing tumour is the core that enhances on T1-Gd, the non-enhancing core
the part that does not; Menze et al. 2015, the BraTS benchmark).

Sensitivity (replace-one): every row is clipped to C *after* every step the anchor, the scans or the regions
influence, so ``||z - z'|| <= ||z|| + ||z'|| <= 2C`` for any teacher outputs and any anchor or bin map, a
malicious one included: the mean of K rows moves by at most 2C/K.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Callable, Mapping

import numpy as np

from privacy import sensitivity as sens
from task.codecs.contract import Compressor, PublicFit, answering_teachers
from task.codecs.core import (PROBABILITY_TOLERANCE, CodecKind, CodecRefused, check_finite, check_probabilities,
                             clip_rows, encode, register_codec, row_bound, scalar, zero_rows)
from task.codecs.headfit import fit_head_decode
from task.errors import UserError
from task.learning.phases import timed
from task.options import Decoder, look_up_option
from task.settings.presets import Codec

KIND = "anchored"
#: the preset recipe's codec group (task.settings.presets.Codec): the compressor's shells, clip scale, intensity bins and
#: decoder default to its anchored_* fields (docs/decisions/anchored-shells-and-clip.md, intensity-bins.md,
#: head-fit-decoder.md)
DEFAULTS = Codec()
ANCHOR_KEY = "anchor"
#: the per-voxel intensity bin of each query scan (:func:`intensity_bin_map`), shipped beside the anchor
BINS_KEY = "anchor_bins"
#: our channel order is (FLAIR, T1, T1-Gd, T2) in every layout (task.data.layouts)
T1GD_CHANNEL = 2
MAX_INTENSITY_BINS = 255      # the bin map travels as uint8


def intensity_bins_of(state: Mapping[str, np.ndarray]) -> int:
    """How many intensity bins split each shell (1 for states written before bins existed)."""
    return int(scalar(state, "intensity_bins")) if "intensity_bins" in state else 1


def anchored_shells(state: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """(innermost, outermost) shell of an anchored codec state; raises ``UserError`` unless lo <= 0 < hi."""
    shells = [int(v) for v in np.asarray(state["shells"]).reshape(-1)]
    if len(shells) != 2 or not shells[0] <= 0 < shells[1]:
        raise UserError(f"anchored codec: shells {shells} must be [lo <= 0, hi >= 1]")
    return shells[0], shells[1]


def anchored_latent_dim(classes: int, shells, intensity_bins: int = 1) -> int:
    """``(classes - 1) * (hi - lo + 1) * bins``: one residual sum per tumour class and region (shell x bin)."""
    lo, hi = (int(v) for v in shells)
    return int((int(classes) - 1) * (hi - lo + 1) * int(intensity_bins))


def _chessboard_step(mask: np.ndarray, grow: bool) -> np.ndarray:
    """One 26-neighbour dilation (``grow``) or erosion of a boolean volume (edges count as outside)."""
    padded = np.pad(mask, 1, constant_values=False)
    out = None
    for offset in np.ndindex(*(3,) * mask.ndim):
        window = padded[tuple(slice(o, o + n) for o, n in zip(offset, mask.shape))]
        out = window.copy() if out is None else (out | window if grow else out & window)
    return out


def intensity_bin_map(scans: np.ndarray, shell_regions: np.ndarray, channel: int, bins: int) -> np.ndarray:
    """Per voxel, which of ``bins`` quantile bins of the scan's ``channel`` intensity it falls in, the quantiles
    taken within each shell of that scan separately (n, *g), uint8; 0 outside every shell.

    Within-shell quantiles, not fixed thresholds: every region then holds about the same number of voxels
    whatever the scanner's intensity scale, and the bins are a deterministic function of public arrays (the
    query scans and the public anchor's shells), computed once by the server and shipped with the batch.
    """
    scans = np.asarray(scans, dtype=np.float64)
    shell_regions = np.asarray(shell_regions)
    if not 0 <= int(channel) < scans.shape[1]:
        raise UserError(f"anchored codec: intensity channel {channel} is not one of the scans' {scans.shape[1]}")
    out = np.zeros(shell_regions.shape, dtype=np.uint8)
    cuts = np.linspace(0.0, 1.0, int(bins) + 1)[1:-1]
    for i in range(len(scans)):
        values = scans[i, int(channel)]
        for region in np.unique(shell_regions[i]):
            if region < 0:
                continue
            inside = shell_regions[i] == region
            edges = np.quantile(values[inside], cuts)
            out[i][inside] = np.searchsorted(edges, values[inside], side="right")
    return out


def anchor_regions(anchor: np.ndarray, shells, bins: np.ndarray | None = None, intensity_bins: int = 1) -> np.ndarray:
    """Region index per voxel (n, *g): the chessboard shells around the public prediction's tumour, each split
    by ``bins`` (a :func:`intensity_bin_map`, values in ``[0, intensity_bins)``) when given: region =
    shell index x ``intensity_bins`` + bin.

    Shell 0 is the tumour's boundary layer, -1, -2, ... lie deeper inside (everything deeper than ``lo`` is
    shell ``lo``), 1, 2, ... are the layers outside it up to ``hi``; voxels farther out are -1 (no region).
    The tumour is ``{p_tumour >= 0.5}`` or, when the public model is nowhere that sure, ``{p_tumour >= max/2}``;
    a scan with no tumour probability at all has no region (its latent carries nothing). Region index =
    shell - lo. A deterministic function of the public anchor, computed identically by the server (decode)
    and the hospitals (encode); a wrong or malicious anchor changes the regions, never the sensitivity.
    """
    anchor = np.asarray(anchor, dtype=np.float64)
    lo, hi = (int(v) for v in shells)
    out = np.full((len(anchor),) + anchor.shape[2:], -1, dtype=np.int64)
    for i in range(len(anchor)):
        tumour = anchor[i, 1:].sum(axis=0)
        peak = float(tumour.max(initial=0.0))
        if peak <= 1e-6:
            continue
        mask = tumour >= min(0.5, peak / 2.0)
        shell = np.full(mask.shape, hi + 1, dtype=np.int64)
        inner, depth = mask.copy(), 0
        while inner.any() and depth > lo - 1:     # boundary layer 0, then -1, -2, ... down to lo
            eroded = _chessboard_step(inner, grow=False)
            shell[inner & ~eroded] = depth
            inner, depth = eroded, depth - 1
        shell[inner] = lo
        outer = mask.copy()
        for distance in range(1, hi + 1):
            grown = _chessboard_step(outer, grow=True)
            shell[grown & ~outer] = distance
            outer = grown
        out[i] = np.where(shell <= hi, shell - lo, -1)
    return _split_by_bins(out, bins, intensity_bins)


def _split_by_bins(shell_map: np.ndarray, bins: np.ndarray | None, intensity_bins: int) -> np.ndarray:
    """Region = shell index x ``intensity_bins`` + bin (the shells unchanged without bins)."""
    if bins is None or int(intensity_bins) <= 1:
        return shell_map
    bins = np.asarray(bins, dtype=np.int64)
    if bins.shape != shell_map.shape:
        raise UserError(f"anchored codec: intensity bins of shape {bins.shape} do not match the anchor's {shell_map.shape}")
    return np.where(shell_map >= 0, shell_map * int(intensity_bins) + np.clip(bins, 0, int(intensity_bins) - 1), -1)


def binned_regions(anchor: np.ndarray, shells, scans: np.ndarray | None, channel: int,
                   intensity_bins: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(regions, bin map) of a batch from the public anchor and scans, the shells computed once: what the server
    ships (the bin map) and decodes with (the regions). Without bins: (the shells, None)."""
    shell_map = anchor_regions(anchor, shells)
    if int(intensity_bins) <= 1:
        return shell_map, None
    if scans is None or len(scans) != len(shell_map):
        raise UserError(f"anchored codec with {intensity_bins} intensity bins: needs the {len(shell_map)} public "
                        "scans the anchor belongs to")
    bin_map = intensity_bin_map(scans, shell_map, channel, intensity_bins)
    return _split_by_bins(shell_map, bin_map, intensity_bins), bin_map


def anchored_encode(probs: np.ndarray, anchor: np.ndarray, shells, clip: float | None,
                    regions: np.ndarray | None = None, bins: np.ndarray | None = None,
                    intensity_bins: int = 1) -> np.ndarray:
    """``z = clip_C(B (y - p))``: per tumour class c and region j of :func:`anchor_regions`,
    ``sum_{v in R_j} (y_vc - p_vc) / sqrt(|R_j|)`` -- the rows of B are orthonormal (disjoint indicator
    vectors over sqrt of their size), so ``||B r|| <= ||r||`` -- every row clipped to L2 norm ``clip``
    (``None``: unclipped, for measuring norms on public data only). (n, C, *g) -> (n, l).

    ``regions``: ``anchor_regions(anchor, shells)`` when the caller already has them (a hospital encodes
    every teacher's answer against the same anchor: computing the regions once per query batch instead of
    once per teacher took 51 of a PATE cell's 320 s). They depend on the anchor and the bins only, never on
    ``probs``, and the clip comes after them, so the sensitivity argument above is unchanged.

    Args:
        probs: one teacher's softmax output on the batch's scans (n, C, *g).
        anchor: the public model's probabilities on the same scans (n, C, *g).
        shells: (lo, hi) of :func:`anchor_regions`.
        clip: the row bound C (None: unclipped, public data only).
        regions: the batch's regions when already computed (then ``bins`` is not read).
        bins: the batch's intensity bin map (:func:`intensity_bin_map`), or None for shells only.
        intensity_bins: how many bins split each shell (1: shells only).
    """
    probs = np.asarray(probs, dtype=np.float64)
    anchor = np.asarray(anchor, dtype=np.float64)
    regions = anchor_regions(anchor, shells, bins, intensity_bins) if regions is None else np.asarray(regions)
    if regions.shape != (len(anchor),) + anchor.shape[2:]:
        raise UserError(f"anchored codec: regions of shape {regions.shape} do not match the anchor {anchor.shape}")
    count = anchored_latent_dim(2, shells, intensity_bins)
    classes = probs.shape[1]
    z = np.zeros((len(probs), classes - 1, count))
    for i in range(len(probs)):
        index = regions[i].reshape(-1)
        inside = index >= 0
        size = np.sqrt(np.maximum(np.bincount(index[inside], minlength=count), 1.0))
        residual = (probs[i] - anchor[i]).reshape(classes, -1)[1:, inside]
        for c in range(classes - 1):
            z[i, c] = np.bincount(index[inside], weights=residual[c], minlength=count) / size
    z = z.reshape(len(probs), -1)
    return z if clip is None else clip_rows(z, clip)


def shrink_latents(z: np.ndarray, sigma: float) -> np.ndarray:
    """Positive-part James-Stein shrinkage of noisy mean latents towards 0, i.e. towards the public model:
    ``z (1 - l sigma^2 / ||z||^2)_+`` per row (James & Stein 1961; post-processing of the release, so free).
    Where the noise dominates (small epsilon) the pseudo-label falls back to the public prediction instead of
    decoding noise (measured, r2/shells.py, K = 64, l = 24: pseudo-label Dice at epsilon 1 0.363 -> 0.438,
    public model 0.439; at epsilon 8 0.498 -> 0.494)."""
    z = np.asarray(z, dtype=np.float64)
    if sigma <= 0:
        return z
    energy = np.maximum((z * z).sum(axis=-1, keepdims=True), 1e-300)
    return z * np.maximum(0.0, 1.0 - z.shape[-1] * float(sigma) ** 2 / energy)


def anchored_decode(z: np.ndarray, anchor: np.ndarray, shells, iterations: int = 30, bins: np.ndarray | None = None,
                    intensity_bins: int = 1, regions: np.ndarray | None = None) -> np.ndarray:
    """Pseudo-labels from (noisy) mean latents by mass matching (post-processing of the release).

    In each region the latent says how much probability mass of each tumour class the teachers put there
    beyond the public model (``sqrt(|R_j|) z_cj``); the public model says *where* (its ranking of voxels).
    The decoder finds per-region class biases ``b_j`` in log space such that ``softmax(log p_v + b_j)``
    carries exactly the target masses (iterative proportional fitting; targets clipped to what a region
    can hold). Adding the mass uniformly instead moves almost no voxel across the argmax (measured: decoded
    noise-free ensemble 0.44 against 0.49 with mass matching, probability average 0.53; r2/shells.py).

    ``z = 0`` returns the anchor itself (regions with a zero latent are left untouched): with no information
    from the teachers the pseudo-label is the public model's prediction.

    Args:
        z: (noisy) mean latents (n, l).
        anchor: the public model's probabilities on the scans (n, C, *g).
        shells: (lo, hi) of :func:`anchor_regions`.
        iterations: proportional-fitting sweeps.
        bins: the scans' intensity bin map (:func:`intensity_bin_map`), or None for shells only.
        intensity_bins: how many bins split each shell (1: shells only).
        regions: the scans' regions when already computed (:func:`binned_regions`; then ``bins`` is not read).
    """
    anchor = np.asarray(anchor, dtype=np.float32)
    classes = anchor.shape[1]
    count = anchored_latent_dim(2, shells, intensity_bins)
    z = np.asarray(z, dtype=np.float64).reshape(len(anchor), classes - 1, count)
    regions = anchor_regions(anchor, shells, bins, intensity_bins) if regions is None else np.asarray(regions)
    out = anchor.copy()
    for i in range(len(anchor)):
        active = np.any(z[i] != 0, axis=0)                     # regions the latent says anything about
        index = regions[i].reshape(-1)
        voxels = (index >= 0) & active[np.maximum(index, 0)]
        if not voxels.any():
            continue
        region = index[voxels]
        size = np.bincount(region, minlength=count).astype(np.float64)
        log_p = np.log(np.clip(anchor[i].reshape(classes, -1)[:, voxels].astype(np.float64), 1e-6, 1.0))
        public_mass = np.stack([np.bincount(region, weights=np.exp(log_p[c]), minlength=count)
                                for c in range(classes)])
        target = np.clip(public_mass[1:] + z[i] * np.sqrt(np.maximum(size, 1.0)), 1e-3, None)
        total = target.sum(axis=0)
        limit = 0.999 * size
        target = np.where(total > limit, target * limit / np.maximum(total, 1e-12), target)
        target = np.vstack([np.maximum(size - target.sum(axis=0), 1e-3), target])
        bias = np.zeros((classes, count))
        for _ in range(int(iterations)):
            q = _softmax(log_p + bias[:, region])
            mass = np.stack([np.bincount(region, weights=q[c], minlength=count) for c in range(classes)])
            bias += np.log(np.maximum(target, 1e-12) / np.maximum(mass, 1e-12))
            bias -= bias[:1]
        flat = out[i].reshape(classes, -1)
        flat[:, voxels] = _softmax(log_p + bias[:, region])
        out[i] = flat.reshape(anchor.shape[1:])
    return out


def _softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(axis=0, keepdims=True)
    weights = np.exp(logits)
    return weights / weights.sum(axis=0, keepdims=True)


def with_anchor(state: Mapping[str, np.ndarray], anchor: np.ndarray, scans: np.ndarray | None = None) -> dict:
    """The codec state shipped with one query batch: the public anchor (the public model's probabilities
    for exactly these scans, in order) added to an anchored state, and, when its shells are split into
    intensity bins, the scans' bin map (:func:`intensity_bin_map`, computed from the public ``scans``);
    other kinds are returned unchanged."""
    if str(scalar(state, "kind")) != KIND:
        return dict(state)
    anchor = np.asarray(anchor, dtype=np.float32)
    shipped = {**dict(state), ANCHOR_KEY: anchor}
    bins = intensity_bins_of(state)
    if bins > 1:
        shipped[BINS_KEY] = binned_regions(anchor, anchored_shells(state), scans,
                                           int(scalar(state, "intensity_channel")), bins)[1]
    return shipped


def shipped_bins(state: Mapping[str, np.ndarray]) -> tuple[np.ndarray | None, int]:
    """(the batch's bin map or None, the number of bins) of a shipped anchored state."""
    bins = intensity_bins_of(state)
    return (np.asarray(state[BINS_KEY]) if bins > 1 and BINS_KEY in state else None), bins



def verify(state: Mapping[str, np.ndarray], classes: int, grid: tuple, latent: int, scans_shape) -> float:
    """Shells ``lo <= 0 < hi``, ``l = (classes - 1) x shells x intensity bins``, a positive finite clip; the anchor
    and the bin map (public side information) only for their shapes and ranges -- and, for a query batch, present
    for exactly its scans."""
    try:
        shells = anchored_shells(state)
    except (KeyError, UserError) as exc:
        raise CodecRefused(f"codec: {exc}") from None
    try:
        bins = intensity_bins_of(state)
        channel = int(scalar(state, "intensity_channel")) if bins > 1 else 0
    except (TypeError, ValueError):
        raise CodecRefused("codec: anchored intensity_bins / intensity_channel must be whole numbers") from None
    if not 1 <= bins <= MAX_INTENSITY_BINS:
        raise CodecRefused(f"codec: anchored intensity_bins {bins} must be in [1, {MAX_INTENSITY_BINS}]")
    if latent != anchored_latent_dim(classes, shells, bins):
        raise CodecRefused(f"codec: anchored latent_dim {latent} must be (classes - 1) x shells x bins = "
                           f"{anchored_latent_dim(classes, shells, bins)}")
    bound = float(scalar(state, "clip"))
    if not (math.isfinite(bound) and bound > 0):
        raise CodecRefused(f"codec: anchored clip must be a positive number, got {bound}")
    if ANCHOR_KEY in state:   # public side information: only its shape and range matter to the hospital
        anchor = np.asarray(state[ANCHOR_KEY])
        if anchor.ndim != 2 + len(grid) or anchor.shape[1] != classes or tuple(anchor.shape[2:]) != grid:
            raise CodecRefused(f"codec: anchor of shape {anchor.shape} does not match {classes} x {grid}")
        if not np.all(np.isfinite(anchor)) or anchor.min(initial=0) < -PROBABILITY_TOLERANCE \
                or anchor.max(initial=0) > 1 + PROBABILITY_TOLERANCE:
            raise CodecRefused("codec: anchor is not a probability map in [0, 1]")
        if bins > 1:   # the bin map only moves voxels between regions: its shape and range are all that matter
            bin_map = np.asarray(state.get(BINS_KEY, np.zeros(0)))
            if bin_map.shape != (len(anchor),) + tuple(grid) or not np.issubdtype(bin_map.dtype, np.integer) \
                    or bin_map.min(initial=0) < 0 or bin_map.max(initial=0) >= bins:
                raise CodecRefused(f"codec: the anchored codec's {bins} intensity bins need a bin map of the "
                                   f"batch's shape {(len(anchor),) + tuple(grid)} with values in [0, {bins})")
    if bins > 1 and scans_shape is not None and not 0 <= channel < scans_shape[1]:
        raise CodecRefused(f"codec: anchored intensity channel {channel} is not one of the scans' {scans_shape[1]}")
    if scans_shape is not None and (ANCHOR_KEY not in state or len(np.asarray(state[ANCHOR_KEY])) != scans_shape[0]):
        raise CodecRefused(f"codec: the anchored codec needs the public anchor of these {scans_shape[0]} scans")
    return bound


def sensitivity(state: Mapping[str, np.ndarray], teachers: int) -> float:
    """Rows clipped to C in latent space, whatever y, the anchor or its regions: 2C/K."""
    return float(sens.clipped_bound(row_bound(state), teachers))


def encoder(state: Mapping[str, np.ndarray], device=None):
    regions = {}   # the anchor's regions, computed on the first call: every teacher is encoded against them

    def encode(probs: np.ndarray) -> np.ndarray:
        if ANCHOR_KEY not in state or len(np.asarray(state[ANCHOR_KEY])) != len(probs):
            raise UserError(f"encode: the anchored codec needs the public anchor of these {len(probs)} scans")
        check_finite(probs)
        if "of_anchor" not in regions:
            bins, count = shipped_bins(state)
            regions["of_anchor"] = anchor_regions(state[ANCHOR_KEY], anchored_shells(state), bins, count)
        return anchored_encode(probs, state[ANCHOR_KEY], anchored_shells(state), row_bound(state),
                               regions=regions["of_anchor"], intensity_bins=intensity_bins_of(state))

    return encode


def stacked_encoder(state: Mapping[str, np.ndarray], device=None):
    """:func:`anchored_encode` of T teachers' outputs at once, where they lie (T, n, C, *g) -> (T, n, l): per
    scan, every teacher's residual on the voxels of the anchor's regions times one matrix (the region sums over the
    square root of their sizes, in float64), then every row clipped to C by the same :func:`clip_rows` on the host.
    The regions, their sizes and the anchor are computed once per batch state, as the one-teacher encoder does;
    the sums are the same up to float64 summation order. A matrix product rather than a scatter: it is
    deterministic on a GPU (atomic float additions are not), so reproducible runs repeat there too."""
    import torch

    plan: dict = {}
    bound = row_bound(state)

    def regions_on(where) -> list:
        """Per scan: (its voxels in some region, (voxels, regions) float64 sum matrix, anchor there (C-1, voxels))."""
        anchor = np.asarray(state[ANCHOR_KEY])
        bins, count = shipped_bins(state)
        regions = anchor_regions(anchor, anchored_shells(state), bins, count)
        per_class = anchored_latent_dim(2, anchored_shells(state), count)
        scans = []
        for i in range(len(anchor)):
            index = regions[i].reshape(-1)
            voxels = np.flatnonzero(index >= 0)
            region = index[voxels]
            size = np.sqrt(np.maximum(np.bincount(region, minlength=per_class), 1.0))
            weights = np.zeros((len(voxels), per_class))
            weights[np.arange(len(voxels)), region] = 1.0 / size[region]
            anchor_there = anchor[i].reshape(anchor.shape[1], -1)[1:, voxels].astype(np.float64)
            scans.append((torch.as_tensor(voxels, device=where), torch.as_tensor(weights, device=where),
                          torch.as_tensor(anchor_there, device=where)))
        return scans

    def encode_many(probs):
        if ANCHOR_KEY not in state or len(np.asarray(state[ANCHOR_KEY])) != probs.shape[1]:
            raise UserError(f"encode: the anchored codec needs the public anchor of these {probs.shape[1]} scans")
        if not bool(torch.isfinite(probs).all()):
            raise UserError("encode: teacher outputs contain NaN or infinite values")
        if plan.get("device") != probs.device:
            plan["device"], plan["scans"] = probs.device, regions_on(probs.device)
        teachers, n, classes = probs.shape[:3]
        flat = probs.reshape(teachers, n, classes, -1)
        per_class = anchored_latent_dim(2, anchored_shells(state), intensity_bins_of(state))
        z = torch.zeros((teachers, n, classes - 1, per_class), dtype=torch.float64, device=probs.device)
        for i, (voxels, weights, anchor_there) in enumerate(plan["scans"]):
            if len(voxels):
                z[:, i] = (flat[:, i, 1:][..., voxels].double() - anchor_there) @ weights
        rows = z.reshape(teachers * n, -1).cpu().numpy()
        return clip_rows(rows, bound).reshape(teachers, n, -1)

    return encode_many


# --------------------------------------------------------------------------------------------------
# the server's side: fit C on public arrays, ship the anchor with every batch, decode
# --------------------------------------------------------------------------------------------------
class AnchoredResidualCompressor(Compressor):
    """Anchored residual PATE: PATE should only add to what public data gives (docs/PRIVACY.md, "What limits PATE").

    Fay et al.'s Algorithms 1-2 compress the teachers' whole answer, so a compressor fitted on a few public
    maps decodes even the noise-free ensemble to its own prior. Here the public model's prediction ``p_n``
    for query n -- public side information, free -- is the decoder's output at latent zero, and the
    teachers transmit only where they disagree with it:

    * encode (at the hospital, :func:`anchored_encode`): ``z_nk = clip_C(B_n (y_nk - p_n))``,
      ``B_n`` = per tumour class, the residual summed over each shell around ``p_n``'s tumour
      (:func:`anchor_regions`: the boundary layer, ``-lo`` layers inside, ``hi`` outside) over
      the square root of the shell's size (orthonormal rows): the queries ask where the information is;
    * with ``intensity_bins`` B > 1 (docs/decisions/intensity-bins.md), each shell is split into B within-shell
      quantile bins of the query scan's ``intensity_channel`` (T1-Gd by default;
      :func:`intensity_bin_map`), computed by the server from the public scans and shipped with the anchor:
      within a shell the decoder could only place a class by the public model's ranking of voxels, which says nothing
      for a class the public model never predicts (perfect-teacher ceiling on the quick world, class 2: 0.36 with
      shells, 0.62 with 3 T1-Gd bins; benchmarks/codec_ceiling.py);
    * aggregate: ``z_bar_n = (1/K) sum_k z_nk + N(0, sigma^2 I_l)`` (Alg. 1-2), ``l = 3 (hi - lo + 1) B``;
    * decode, by the compressor's ``decoder`` (:data:`ANCHORED_DECODERS`): ``mass-matching``
      (:func:`anchored_decode`: per region, the public model's probabilities re-weighted so that each
      class carries the mass the teachers' mean residual says) or ``head-fit`` (:func:`task.codecs.headfit.fit_head_decode`:
      one voxel head fitted to every query's latents at once, the Gaussian release's maximum-likelihood head;
      docs/decisions/head-fit-decoder.md). Both are post-processing and give ``p_n`` exactly at ``z = 0``.

    Sensitivity (replace-one), proof sketch: replacing one patient changes one teacher's output ``y_nk``
    into any ``y'_nk``; both rows are clipped to L2 norm C *after* every step the anchor or the regions
    influence, so ``||z_nk - z'_nk|| <= ||z_nk|| + ||z'_nk|| <= 2C`` and the mean of K rows moves by at
    most ``2C/K`` -- for every ``y``, ``y'`` and every anchor, including a malicious one (the anchor can only
    move the regions and the reference point, never the clip). The hospitals recompute ``2C/K`` from the
    shipped state (:func:`task.codecs.codec_sensitivity`) and clip their own rows; the server re-clips too.

    Fitting reads public arrays only: the public reference label maps and the public model's predictions
    on the public reference scans. ``clip=None`` sets C to ``clip_scale`` times the median norm of the
    public model's own residual on those maps, ``||B (onehot_ref - p_ref)||``. The public model fits its own
    references better than it fits the hospitals' patients, hence ``clip_scale`` 2.5 by default.

    The defaults ``shells`` (-2, 5) and ``clip_scale`` 2.5 were chosen by looking at *private* quantities of a
    research world outside this repository (docs/decisions/anchored-shells-and-clip.md). Nothing of that world
    enters a mechanism here, so no guarantee is affected; but they are not a public-data choice, and a user
    tuning them on their own hospitals' data would have to charge that selection.
    """

    name = "anchored"

    needs_public_model = True

    def __init__(self, shells: tuple = DEFAULTS.anchored_shells, clip: float | None = None,
                 clip_scale: float = DEFAULTS.anchored_clip_scale, intensity_bins: int = DEFAULTS.anchored_intensity_bins,
                 intensity_channel: int = T1GD_CHANNEL, decoder: Decoder = DEFAULTS.anchored_decoder, device=None):
        shells = tuple(int(v) for v in shells)
        self.decoder = look_up_option(decoder, Decoder, "anchored codec: decoder")
        self.device = device
        if isinstance(intensity_bins, bool) or int(intensity_bins) != intensity_bins \
                or not 1 <= int(intensity_bins) <= 255:
            raise UserError(f"anchored codec: intensity_bins must be a whole number in [1, 255], got {intensity_bins}")
        self.intensity_bins = int(intensity_bins)
        self.intensity_channel = int(intensity_channel)
        if len(shells) != 2 or not shells[0] <= 0 < shells[1]:
            raise UserError(f"anchored codec: shells {shells} must be (lo <= 0, hi >= 1)")
        if clip is not None and not (math.isfinite(float(clip)) and float(clip) > 0):
            raise UserError(f"anchored codec: clip must be a positive number, got {clip}")
        if not (math.isfinite(float(clip_scale)) and float(clip_scale) > 0):
            raise UserError(f"anchored codec: clip_scale must be a positive number, got {clip_scale}")
        self.shells = shells
        self.clip = None if clip is None else float(clip)
        self.clip_scale = float(clip_scale)
        self.public_residual_norm: float | None = None

    def fit(self, public_onehot: np.ndarray, public_probs: np.ndarray | None = None,
            public_scans: np.ndarray | None = None) -> "AnchoredResidualCompressor":
        """``public_onehot``: public reference label maps (n, C, *g); ``public_probs``: the public model's
        probabilities on the same public reference scans (needed when ``clip`` is None); ``public_scans``: those
        scans (needed with intensity bins and no explicit clip: the norms are measured in the binned regions)."""
        maps = self._check_fit_input(public_onehot)
        self.latent_dim = anchored_latent_dim(self.classes, self.shells, self.intensity_bins)
        if public_probs is not None:
            public_probs = np.asarray(public_probs, dtype=np.float32)
            if public_probs.shape != maps.shape:
                raise UserError(f"public model probabilities {public_probs.shape} do not match the public "
                                f"reference maps {maps.shape}")
            check_probabilities(public_probs, "public model probabilities")
            if self.intensity_bins > 1 and public_scans is None:
                raise UserError("anchored codec: with intensity bins, fit needs the public reference scans too")
            norms = np.linalg.norm(anchored_encode(maps, public_probs, self.shells, None,
                                                          regions=self._regions(public_probs, public_scans),
                                                          intensity_bins=self.intensity_bins), axis=1)
            self.public_residual_norm = float(np.median(norms))
        if self.clip is None:
            if self.public_residual_norm is None:
                raise UserError("anchored codec: without an explicit clip, fit needs the public model's "
                                "probabilities on the public reference scans")
            self.clip = max(self.clip_scale * self.public_residual_norm, 1e-3)
        return self

    def _require_fit(self):
        if not self.grid or self.clip is None:
            raise UserError("AnchoredResidualCompressor: call fit(public reference maps) first")

    def sensitivity(self, teachers: int) -> float:
        self._require_fit()
        return float(sens.clipped_bound(self.clip, answering_teachers(teachers)))

    def _regions(self, anchor: np.ndarray, scans: np.ndarray | None) -> np.ndarray:
        """The batch's regions (shells x intensity bins), the shells computed once (:func:`binned_regions`)."""
        return binned_regions(anchor, self.shells, scans, self.intensity_channel, self.intensity_bins)[0]

    def state(self) -> dict:
        self._require_fit()
        state = self._base_state(KIND)
        state.update({"shells": np.array(self.shells, dtype=np.int64), "clip": np.array(float(self.clip)),
                      "row_bound": np.array(float(self.clip))})
        if self.intensity_bins > 1:   # without bins the state has no bin entries (states written before bins existed)
            state.update({"intensity_bins": np.array(self.intensity_bins, dtype=np.int64),
                          "intensity_channel": np.array(self.intensity_channel, dtype=np.int64)})
        return state

    def encode(self, probs: np.ndarray, anchor: np.ndarray | None = None, scans: np.ndarray | None = None) -> np.ndarray:
        """Server-side convenience (tests, diagnostics): the exact function hospitals run."""
        if anchor is None:
            raise UserError("anchored codec: encode needs the public anchor of the scans")
        return encode(self.batch_state(self.state(), anchor, scans), probs)

    def decode(self, z: np.ndarray, anchor: np.ndarray | None = None, sigma: float = 0.0,
               scans: np.ndarray | None = None) -> np.ndarray:
        """Pseudo-labels by this compressor's decoder (:data:`ANCHORED_DECODERS`); ``sigma``: the release's noise."""
        self._require_fit()
        if anchor is None:
            raise UserError("anchored codec: decode needs the public anchor (the public model's prediction)")
        return ANCHORED_DECODERS[self.decoder](self, z, np.asarray(anchor), float(sigma), scans)

    def _mass_matching(self, z, anchor, sigma, scans) -> np.ndarray:
        """Per query: James-Stein shrinkage towards the anchor when ``sigma`` > 0 (:func:`shrink_latents`,
        so that noise-dominated latents decode to the public model), then mass matching in every region."""
        return anchored_decode(shrink_latents(z, sigma), anchor, self.shells,
                                      intensity_bins=self.intensity_bins, regions=self._regions(anchor, scans))

    def _head_fit(self, z, anchor, sigma, scans) -> np.ndarray:
        """One voxel head fitted to every query's latents at once (:func:`task.codecs.headfit.fit_head_decode`: the
        Gaussian release's maximum-likelihood head; it pools the noise itself, so no shrinkage first)."""
        if scans is None:
            raise UserError("anchored codec: the head-fit decoder needs the query scans the latents belong to")
        return fit_head_decode(z, anchor, scans, self._regions(anchor, scans), self.latent_dim // (self.classes - 1),
                               device=self.device)

    def fit_release(self, public: PublicFit, noise_per_sensitivity: float, teachers: int) -> "AnchoredResidualCompressor":
        """Anchored at the public model: C from its residual on the public reference scans."""
        if public.reference_probs is None:
            raise UserError("pate-anchored needs the public model and public reference scans with labels")
        return self.fit(public.reference_maps, public.reference_probs, public.reference_scans)

    def batch_state(self, state: dict, public_probs: np.ndarray | None, scans: np.ndarray | None = None) -> dict:
        """Every query batch carries its scans' anchor -- the public model's probabilities for exactly them --
        and, with intensity bins, their bin map (from the public scans)."""
        return with_anchor(state, public_probs, scans)

    @timed("decoding")
    def decode_release(self, z: np.ndarray, public_probs: np.ndarray | None, sigma: float,
                       scans: np.ndarray | None = None) -> np.ndarray:
        """Decode against the scans' anchors, shrinking noisy latents towards them (``sigma = 0``: no shrinkage)."""
        return self.decode(z, public_probs, sigma=sigma, scans=scans)

    def noise_free_decode_key(self) -> str:
        """The fitted state, the settings and the device: the decoders read nothing else but the latents, the
        anchor and the scans (the head-fit decoder's own settings are fixed; docs/decisions/head-fit-decoder.md)."""
        digest = hashlib.sha256(json.dumps({**self.describe(), "device": str(self.device)}, sort_keys=True,
                                           default=str).encode())
        state = self.state()
        for name in sorted(state):
            value = np.ascontiguousarray(np.asarray(state[name]))
            digest.update(f"{name}:{value.dtype}:{value.shape}".encode() + value.tobytes())
        return digest.hexdigest()

    def describe(self) -> dict:
        return {"name": self.name, "latent_dim": int(self.latent_dim), "shells": list(self.shells),
                "intensity_bins": self.intensity_bins, "intensity_channel": self.intensity_channel,
                "decoder": self.decoder.value,
                "clip": self.clip, "clip_scale": self.clip_scale, "public_residual_norm": self.public_residual_norm}


#: the anchored codec's decoders, by name (server side only: the hospitals encode, they never decode).
#: ``decoder(compressor, z, anchor, sigma, scans) -> pseudo-labels``
ANCHORED_DECODERS: dict[Decoder, Callable[..., np.ndarray]] = {
    Decoder.MASS_MATCHING: AnchoredResidualCompressor._mass_matching,
    Decoder.HEAD_FIT: AnchoredResidualCompressor._head_fit,
}


def compressor(settings: Codec, *, seed, checkpoint, progress, device=None, **options) -> AnchoredResidualCompressor:
    """The anchored compressor of a preset's codec settings (``anchored_shells``, ``anchored_clip_scale``,
    ``anchored_intensity_bins``, ``anchored_decoder``; options: ``shells``, ``clip``, ``clip_scale``,
    ``intensity_bins``, ``intensity_channel``, ``decoder``)."""
    return AnchoredResidualCompressor(options.get("shells", settings.anchored_shells), options.get("clip"),
                                      options.get("clip_scale", settings.anchored_clip_scale),
                                      options.get("intensity_bins", settings.anchored_intensity_bins),
                                      options.get("intensity_channel", T1GD_CHANNEL),
                                      options.get("decoder", settings.anchored_decoder), device)


ANCHORED = register_codec(CodecKind(KIND, verify, sensitivity, encoder, zero_rows, compressor=compressor,
                                      stacked_encoder=stacked_encoder))
