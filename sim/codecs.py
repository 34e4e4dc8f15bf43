"""The encode side of high-dimensional PATE: what a hospital runs locally on its teachers' outputs.

Fay, Sjölund & Oechtering, *Private Learning for High-Dimensional Targets with PATE*
(../shared/papers/004_016510ff7900a22f.txt):

* PCA-PATE (Algorithm 1): ``z = A_l (y - mu)`` with the public basis ``A_l`` (l x d, orthonormal rows).
* Autoencoded PATE (Algorithm 2): ``z = phi(f_enc(y))`` with the unit-ball activation ``phi``.
* Identity (the naive per-voxel baseline): ``z = onehot(argmax y)`` flattened, d = C x voxels.
* Anchored residual (issue 18; SPEC section 11, "PATE should only add to what public data gives"):
  ``z = clip_C(B_n (y - p_n))`` where ``p_n`` is the public model's prediction for query n (public side
  information shipped with the query as ``anchor``) and ``B_n`` sums the tumour classes' residual over the
  shells around the public prediction's tumour (:func:`anchored_encode`, :func:`anchored_decode`).

Whatever is aggregated must be bounded **by construction**, never by assumption (SPEC section 3):
``encode`` verifies its input and applies the bounding step of the codec's sensitivity mode, so the
server's sensitivity ``S`` (replace-one adjacency) holds for every row a hospital uploads:

==========  ==============================================  =======================================
mode        bounding step in ``encode``                     what the server's S assumes
==========  ==============================================  =======================================
paper       input probabilities verified in [0, 1]          ``y - y' in [-1,1]^d`` (eq. 3-4)
public      input probabilities verified in [0, 1]          same, tighter norm bound of ``A_l``
clip        rows clipped to ``||z||_2 <= C``                ``||z - z'|| <= 2C``
ae          unit-ball activation: ``||z||_2 <= 1``          ``||z - z'|| <= 2``
identity    one-hot votes                                   ``sqrt(2 * voxels)`` per replaced teacher
anchored    rows clipped to ``||z||_2 <= C``                ``||z - z'|| <= 2C``, whatever the anchor
==========  ==============================================  =======================================

A ``CodecState`` is a flat ``dict[str, np.ndarray]`` (scalars as 0-d arrays, strings as 0-d unicode
arrays) so that it travels as Flower arrays (sim/flower_wire.py) unchanged.

The hospital does not take the server's word for any of this (SPEC section 2, "it checks the codec it
is sent"): :func:`verify_codec` refuses kinds the hospital has not allowed, latents longer than its
maximum, PCA bases whose rows are not orthonormal or whose mean is not a probability map, and replaces
the state's claimed row bound by the one it computes itself; :func:`codec_sensitivity` is the replace-one
sensitivity the hospital charges to its own ledger, computed from the verified state alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from torch import nn

from privacy import sensitivity as sens
from sim.device import resolve_device
from sim.errors import UserError

CodecState = dict  # dict[str, np.ndarray]

PROBABILITY_TOLERANCE = 1e-4
_ENCODER_PREFIX = "encoder::"


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------
def scalar(state: Mapping[str, np.ndarray], key: str, default=None):
    """Read a 0-d entry of a codec state as a python scalar (str, int or float)."""
    if key not in state:
        if default is not None:
            return default
        raise UserError(f"codec state: missing entry {key!r}")
    value = np.asarray(state[key])
    item = value.reshape(-1)[0].item() if value.size else None
    if isinstance(item, bytes):
        item = item.decode("utf-8")
    return item


def clip_rows(z: np.ndarray, clip: float) -> np.ndarray:
    """Scale every row of ``z`` (n, l) down so that its L2 norm is at most ``clip`` (SPEC section 3,
    clipped mode: replace-one sensitivity of the mean of K rows is then ``2C/K``)."""
    z = np.asarray(z, dtype=np.float64)
    if clip <= 0 or not math.isfinite(clip):
        raise UserError(f"clip: expected a positive finite number, got {clip}")
    norms = np.linalg.norm(z.reshape(len(z), -1), axis=1)
    # Compare against the float32 image of clip so that the float32 result never exceeds it.
    limit = float(np.nextafter(np.float32(clip), np.float32(0)))
    scale = np.where(norms > limit, limit / np.maximum(norms, 1e-300), 1.0)
    return (z * scale.reshape((-1,) + (1,) * (z.ndim - 1))).astype(np.float32)


def unit_ball(o):
    """The unit-ball activation of Fay et al. (section "Nonlinear dimensionality reduction in PATE"):

    ``phi(o_0, ..., o_l) = sigmoid(o_0 sqrt(8/pi))^(1/l) * o_{1:l} / ||o_{1:l}||_2``.

    The radius ``sigmoid(.)^(1/l)`` is in [0, 1), so ``||phi(o)||_2 <= 1`` for every input: the
    replace-one sensitivity of the mean of K activations is 2/K (Proposition 2). For standard normal
    inputs the radius is approximately distributed as ``U^(1/l)``, the radius of a uniform point of the
    l-ball (the paper's appendix, Fig. 2). ``||o_{1:l}|| = 0`` maps to the origin (the direction is
    undefined, the radius multiplies a zero vector). Works on numpy arrays and torch tensors of shape
    (..., l+1); returns (..., l).
    """
    if isinstance(o, torch.Tensor):
        latent = o.shape[-1] - 1
        if latent < 1:
            raise UserError("unit_ball: expected at least 2 inputs (radius + direction)")
        radius = torch.sigmoid(o[..., :1] * math.sqrt(8.0 / math.pi)).pow(1.0 / latent)
        direction = o[..., 1:]
        # Scale huge inputs down before squaring (float32 overflows above ~1.8e19); phi is invariant to
        # that positive scale, so the (detached) scale carries no gradient.
        scale = direction.detach().abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
        unit = direction / scale
        # sqrt(. + eps) rather than norm(): finite gradients at a zero direction (mapped to ~0). The eps
        # only shrinks tiny vectors further inside the ball, so ||phi|| <= 1 still holds.
        out = radius * unit / torch.sqrt((unit * unit).sum(dim=-1, keepdim=True) + 1e-12)
        # Float rounding can leave the norm a hair above 1 when radius rounds to 1: pull those back.
        over = torch.sqrt((out * out).sum(dim=-1, keepdim=True) + 1e-24)
        return out / over.clamp_min(1.0)
    o = np.asarray(o, dtype=np.float64)
    latent = o.shape[-1] - 1
    if latent < 1:
        raise UserError("unit_ball: expected at least 2 inputs (radius + direction)")
    with np.errstate(over="ignore"):
        radius = (1.0 / (1.0 + np.exp(-o[..., :1] * math.sqrt(8.0 / math.pi)))) ** (1.0 / latent)
    direction = np.nan_to_num(o[..., 1:], nan=0.0)
    peak = np.maximum(np.abs(direction).max(axis=-1, keepdims=True), 1e-300)
    unit = direction / peak
    norm = np.linalg.norm(unit, axis=-1, keepdims=True)
    out = np.where(norm > 0, radius * unit / np.maximum(norm, 1e-300), 0.0)
    over = np.linalg.norm(out, axis=-1, keepdims=True)
    return np.where(over > 1.0, out / np.maximum(over, 1e-300), out)


def check_probabilities(probs: np.ndarray, what: str = "probs") -> None:
    """Raise unless ``probs`` is finite and in [0, 1] (within 1e-4): the PCA paper/public bounds
    (Fay et al. eq. 3-4) hold only for teacher outputs in [0, 1]^d."""
    probs = np.asarray(probs)
    if not np.all(np.isfinite(probs)):
        raise UserError(f"{what}: teacher outputs contain NaN or infinite values")
    low, high = float(probs.min(initial=0.0)), float(probs.max(initial=0.0))
    if low < -PROBABILITY_TOLERANCE or high > 1.0 + PROBABILITY_TOLERANCE:
        raise UserError(
            f"{what}: PCA in 'paper'/'public' sensitivity mode needs probabilities in [0, 1] "
            f"(the bound of Fay et al. eq. 3-4); got values in [{low:.4g}, {high:.4g}]"
        )


def one_hot(labels: np.ndarray, classes: int = 4) -> np.ndarray:
    """(n, *g) integer labels -> (n, C, *g) float32 one-hot maps."""
    labels = np.asarray(labels).astype(np.int64)
    eye = np.eye(classes, dtype=np.float32)
    return np.moveaxis(eye[labels], -1, 1)


def normalise_probabilities(maps: np.ndarray) -> np.ndarray:
    """Project decoded maps (n, C, *g) back onto per-voxel probability vectors: negative mass is
    clipped, each voxel renormalised; voxels with no mass left are background (class 0)."""
    maps = np.clip(np.asarray(maps, dtype=np.float32), 0.0, None)
    total = maps.sum(axis=1, keepdims=True)
    empty = total <= 1e-8
    maps = np.where(empty, 0.0, maps / np.maximum(total, 1e-8))
    maps[:, :1] = np.where(empty, 1.0, maps[:, :1])
    return maps.astype(np.float32)


# --------------------------------------------------------------------------------------------------
# the autoencoder (Algorithm 2)
# --------------------------------------------------------------------------------------------------
def _levels(grid) -> int:
    """Pooling levels: halve the smallest side down to 4 voxels (at most 4 levels)."""
    side, levels = min(grid), 0
    while side // 2 >= 4 and levels < 4:
        side //= 2
        levels += 1
    return max(levels, 1)


def _build_autoencoder_class():
    class AutoencoderNet(nn.Module):
        """3D convolutional autoencoder of Fay et al., Algorithm 2 / SPEC section 4.

        encoder: per level a 3x3x3 conv + ReLU then 2x max-pooling; bottleneck: a fully connected
        layer with ``l + 1`` outputs mapped into the unit l-ball by :func:`unit_ball`; decoder: a fully
        connected layer back to the coarsest feature map, then per level a 3x3x3 conv + ReLU and a
        2x transposed conv, a 1x1x1 conv to ``classes`` logits (softmax in :meth:`decode`). No skip
        connections: everything the decoder knows about the input passes through the l numbers.
        """

        def __init__(self, latent_dim: int, grid, classes: int = 4, channels=(8, 16, 32, 32)):
            super().__init__()
            self.latent_dim = int(latent_dim)
            self.grid = tuple(int(g) for g in grid)
            self.classes = int(classes)
            levels = _levels(self.grid)
            if any(g % (2 ** levels) for g in self.grid):
                raise UserError(f"grid {self.grid}: every side must be divisible by {2 ** levels}")
            chans = list(channels)[:levels]
            while len(chans) < levels:
                chans.append(chans[-1])
            self.channels = tuple(chans)
            encoder, previous = [], classes
            for width in chans:
                encoder += [nn.Conv3d(previous, width, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2)]
                previous = width
            self.encoder = nn.Sequential(*encoder)
            self.coarse = tuple(g // (2 ** levels) for g in self.grid)
            flat = chans[-1] * int(np.prod(self.coarse))
            self.bottleneck = nn.Linear(flat, self.latent_dim + 1)
            self.expand = nn.Linear(self.latent_dim, flat)
            decoder = []
            for index, width in enumerate(reversed(chans)):
                out = list(reversed(chans))[index + 1] if index + 1 < len(chans) else chans[0]
                decoder += [nn.Conv3d(width, width, 3, padding=1), nn.ReLU(),
                            nn.ConvTranspose3d(width, out, 2, stride=2), nn.ReLU()]
            decoder.append(nn.Conv3d(chans[0], classes, 1))
            self.decoder = nn.Sequential(*decoder)

        def encode(self, maps):
            """(n, C, *grid) maps -> (n, l) latents with ``||z|| <= 1``."""
            features = self.encoder(maps).flatten(1)
            return unit_ball(self.bottleneck(features))

        def decode_logits(self, z):
            features = torch.relu(self.expand(z)).view(len(z), self.channels[-1], *self.coarse)
            return self.decoder(features)

        def decode(self, z):
            return torch.softmax(self.decode_logits(z), dim=1)

        def forward(self, maps, noise_sigma: float = 0.0, generator=None):
            z = self.encode(maps)
            if noise_sigma > 0:  # Algorithm 2: train the decoder on the noise it will see
                # drawn on the host from the (seeded, CPU) generator and copied: the same draws on every device
                noise = torch.randn(z.shape, generator=generator, dtype=z.dtype)
                z = z + noise_sigma * noise.to(z.device)
            return self.decode_logits(z)

    return AutoencoderNet


_AE_CLASS = None


def AutoencoderNet(latent_dim: int, grid, classes: int = 4, channels=(8, 16, 32, 32)):  # noqa: N802
    """Build the autoencoder of Algorithm 2 (a ``torch.nn.Module``; class built lazily so that importing
    this module does not import torch)."""
    global _AE_CLASS
    if _AE_CLASS is None:
        _AE_CLASS = _build_autoencoder_class()
    return _AE_CLASS(latent_dim, grid, classes, channels)


def module_to_arrays(module, prefix: str = "") -> dict[str, np.ndarray]:
    """A module's state dict as named numpy arrays (for Flower ArrayRecords / codec states)."""
    return {prefix + name: tensor.detach().cpu().numpy().copy() for name, tensor in module.state_dict().items()}


def arrays_to_module(module, arrays: Mapping[str, np.ndarray], prefix: str = "", strict: bool = True):
    """Load named numpy arrays (as written by :func:`module_to_arrays`) into ``module``."""

    state = {name[len(prefix):]: torch.as_tensor(np.asarray(value))
             for name, value in arrays.items() if name.startswith(prefix)}
    module.load_state_dict(state, strict=strict)
    return module


def autoencoder_from_state(state: Mapping[str, np.ndarray], device=None):
    """Rebuild the autoencoder (encoder half populated) from a codec state of kind 'ae', on ``device``
    (``sim.device.resolve_device``; None = auto)."""
    grid = tuple(int(g) for g in np.asarray(state["grid"]).reshape(-1))
    channels = tuple(int(c) for c in np.asarray(state["channels"]).reshape(-1))
    net = AutoencoderNet(int(scalar(state, "latent_dim")), grid, int(scalar(state, "classes")), channels)
    arrays_to_module(net, state, prefix=_ENCODER_PREFIX, strict=False)
    return net.to(resolve_device(device)).eval()


def encoder_arrays(net) -> dict[str, np.ndarray]:
    """Only the encoder + bottleneck weights: what hospitals need (the decoder stays on the server)."""
    return {name: value for name, value in module_to_arrays(net, _ENCODER_PREFIX).items()
            if name[len(_ENCODER_PREFIX):].split(".")[0] in ("encoder", "bottleneck")}


# --------------------------------------------------------------------------------------------------
# the anchored residual codec (issue 18)
# --------------------------------------------------------------------------------------------------
ANCHOR_KEY = "anchor"


def anchored_shells(state: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """(innermost, outermost) shell of an anchored codec state; raises ``UserError`` unless lo <= 0 < hi."""
    shells = [int(v) for v in np.asarray(state["shells"]).reshape(-1)]
    if len(shells) != 2 or not shells[0] <= 0 < shells[1]:
        raise UserError(f"anchored codec: shells {shells} must be [lo <= 0, hi >= 1]")
    return shells[0], shells[1]


def anchored_latent_dim(classes: int, shells) -> int:
    """``(classes - 1) * (hi - lo + 1)``: one residual sum per tumour class and shell."""
    lo, hi = (int(v) for v in shells)
    return int((int(classes) - 1) * (hi - lo + 1))


def _chessboard_step(mask: np.ndarray, grow: bool) -> np.ndarray:
    """One 26-neighbour dilation (``grow``) or erosion of a boolean volume (edges count as outside)."""
    padded = np.pad(mask, 1, constant_values=False)
    out = None
    for offset in np.ndindex(*(3,) * mask.ndim):
        window = padded[tuple(slice(o, o + n) for o, n in zip(offset, mask.shape))]
        out = window.copy() if out is None else (out | window if grow else out & window)
    return out


def anchor_regions(anchor: np.ndarray, shells) -> np.ndarray:
    """Region index per voxel (n, *g): the chessboard shells around the public prediction's tumour.

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
    return out


def anchored_encode(probs: np.ndarray, anchor: np.ndarray, shells, clip: float | None) -> np.ndarray:
    """``z = clip_C(B (y - p))``: per tumour class c and region j of :func:`anchor_regions`,
    ``sum_{v in R_j} (y_vc - p_vc) / sqrt(|R_j|)`` -- the rows of B are orthonormal (disjoint indicator
    vectors over sqrt of their size), so ``||B r|| <= ||r||`` -- every row clipped to L2 norm ``clip``
    (``None``: unclipped, for measuring norms on public data only). (n, C, *g) -> (n, l)."""
    probs = np.asarray(probs, dtype=np.float64)
    anchor = np.asarray(anchor, dtype=np.float64)
    regions = anchor_regions(anchor, shells)
    count = anchored_latent_dim(2, shells)
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


def anchored_decode(z: np.ndarray, anchor: np.ndarray, shells, iterations: int = 30) -> np.ndarray:
    """Pseudo-labels from (noisy) mean latents by mass matching (post-processing of the release).

    In each region the latent says how much probability mass of each tumour class the teachers put there
    beyond the public model (``sqrt(|R_j|) z_cj``); the public model says *where* (its ranking of voxels).
    The decoder finds per-region class biases ``b_j`` in log space such that ``softmax(log p_v + b_j)``
    carries exactly the target masses (iterative proportional fitting; targets clipped to what a region
    can hold). Adding the mass uniformly instead moves almost no voxel across the argmax (measured: decoded
    noise-free ensemble 0.44 against 0.49 with mass matching, probability average 0.53; r2/shells.py).

    ``z = 0`` returns the anchor itself (regions with a zero latent are left untouched): with no information
    from the teachers the pseudo-label is the public model's prediction (SPEC section 11).
    """
    anchor = np.asarray(anchor, dtype=np.float32)
    classes = anchor.shape[1]
    count = anchored_latent_dim(2, shells)
    z = np.asarray(z, dtype=np.float64).reshape(len(anchor), classes - 1, count)
    regions = anchor_regions(anchor, shells)
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


def with_anchor(state: Mapping[str, np.ndarray], anchor: np.ndarray) -> dict:
    """The codec state shipped with one query batch: the public anchor (the public model's probabilities
    for exactly these scans, in order) added to an anchored state; other kinds are returned unchanged."""
    if str(scalar(state, "kind")) != "anchored":
        return dict(state)
    return {**dict(state), ANCHOR_KEY: np.asarray(anchor, dtype=np.float32)}


# --------------------------------------------------------------------------------------------------
# the hospital's checks (issue 15: hospitals own their patients' budget and check what they are sent)
# --------------------------------------------------------------------------------------------------
ORTHONORMAL_TOLERANCE = 1e-3


class CodecRefused(UserError):
    """A codec the hospital will not run (the message names the check that failed)."""


@dataclass(frozen=True)
class CodecPolicy:
    """What a hospital accepts (node config: ``max-latent-dim``, ``allow-identity``).

    The identity codec uploads a full-resolution one-hot map per teacher (its sensitivity is correct, but
    the trusted aggregator then sees every teacher's segmentation): only for hospitals that opt in.
    """

    max_latent_dim: int = 1024
    allow_identity: bool = False
    kinds: tuple = ("ae", "pca", "anchored")

    def allowed(self) -> tuple:
        return self.kinds + (("identity",) if self.allow_identity else ())


def verify_codec(state: Mapping[str, np.ndarray], policy: CodecPolicy | None = None) -> dict:
    """The hospital's check of a codec state; returns a copy whose ``row_bound`` is the hospital's own.

    Raises :class:`CodecRefused`. Checks (SPEC sections 3-4): the kind is allowed; ``l`` is at most the
    policy's maximum; shapes agree with ``classes x grid``; PCA: rows orthonormal (the ``sqrt(d)`` and
    public bounds need ``||A_l||_op <= 1``), the mean in [0, 1]^d (so ``y - mu`` lies in [-1, 1]^d), a
    positive finite clip in clip mode; the row bound every encoding is clipped to is recomputed from the
    basis (public mode), sqrt(d) (paper), C (clip), 1 (ae) or sqrt(voxels) (identity).
    """
    policy = policy or CodecPolicy()
    try:
        kind = str(scalar(state, "kind"))
        classes = int(scalar(state, "classes"))
        grid = tuple(int(g) for g in np.asarray(state["grid"]).reshape(-1))
        latent = int(scalar(state, "latent_dim"))
    except (KeyError, TypeError, ValueError, UserError) as exc:
        raise CodecRefused(f"codec: incomplete state ({exc})") from None
    if kind not in policy.allowed():
        raise CodecRefused(f"codec kind {kind!r} is not allowed by this hospital (allowed: "
                           f"{', '.join(policy.allowed())}; identity needs node-config allow-identity=true)")
    voxels = int(np.prod(grid)) if grid else 0
    if classes < 1 or voxels < 1 or latent < 1:
        raise CodecRefused(f"codec: classes={classes}, grid={grid}, latent_dim={latent} must be positive")
    if kind != "identity" and latent > policy.max_latent_dim:
        raise CodecRefused(f"codec latent_dim {latent} exceeds this hospital's max-latent-dim "
                           f"{policy.max_latent_dim}")
    verified = dict(state)
    if kind == "pca":
        mode = str(scalar(state, "mode"))
        components = np.asarray(state.get("components"), dtype=np.float64)
        mean = np.asarray(state.get("mean"), dtype=np.float64)
        d = classes * voxels
        if components.shape != (latent, d) or mean.shape != (d,):
            raise CodecRefused(f"codec: PCA components {components.shape} / mean {mean.shape} do not match "
                               f"latent_dim {latent} and d = {classes} x {voxels}")
        if not (np.all(np.isfinite(components)) and np.all(np.isfinite(mean))):
            raise CodecRefused("codec: PCA components or mean are not finite")
        gram = components @ components.T
        if np.abs(gram - np.eye(latent)).max() > ORTHONORMAL_TOLERANCE:
            raise CodecRefused("codec: PCA basis rows are not orthonormal (the sensitivity bound needs "
                               "||A_l||_op <= 1)")
        if mean.min() < -PROBABILITY_TOLERANCE or mean.max() > 1 + PROBABILITY_TOLERANCE:
            raise CodecRefused("codec: PCA mean is not a probability map in [0, 1]")
        if mode == "clip":
            clip = float(scalar(state, "clip"))
            if not (math.isfinite(clip) and clip > 0):
                raise CodecRefused(f"codec: PCA clip must be a positive number, got {clip}")
            bound = clip
        elif mode == "paper":
            bound = math.sqrt(d)
        elif mode == "public":
            bound = min(math.sqrt(d), float(np.sqrt(np.sum(np.abs(components).sum(axis=1) ** 2))))
        else:
            raise CodecRefused(f"codec: unknown PCA mode {mode!r}")
    elif kind == "ae":
        bound = 1.0
    elif kind == "anchored":
        try:
            shells = anchored_shells(state)
        except (KeyError, UserError) as exc:
            raise CodecRefused(f"codec: {exc}") from None
        if latent != anchored_latent_dim(classes, shells):
            raise CodecRefused(f"codec: anchored latent_dim {latent} must be (classes - 1) x shells = "
                               f"{anchored_latent_dim(classes, shells)}")
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
    else:
        if latent != classes * voxels:
            raise CodecRefused(f"codec: identity latent_dim {latent} must be classes x voxels")
        bound = math.sqrt(voxels)
    verified["row_bound"] = np.array(bound)
    return verified


def codec_sensitivity(state: Mapping[str, np.ndarray], teachers: int) -> float:
    """Replace-one L2 sensitivity of the mean of ``teachers`` encodings under a *verified* codec state.

    One patient changes one teacher's row (SPEC section 2), so the mean moves by at most
    ``max ||z - z'|| / K``: ``2R/K`` when rows are clipped to norm R (ae: R = 1, Fay et al. Prop. 2;
    pca clip: R = C); ``R/K`` for PCA of probabilities, where ``z - z' = A_l (y - y')`` with
    ``y - y' in [-1, 1]^d`` is itself bounded by R (eq. 3-4; public bound of SPEC section 3);
    ``sqrt(2 voxels)/K`` for one-hot votes (two entries change per voxel); ``2C/K`` for the anchored
    residual codec (:func:`anchored_encode` clips every row to C after everything the anchor influences,
    so ``||z - z'|| <= ||z|| + ||z'|| <= 2C`` for any teacher outputs and any anchor).
    """

    kind = str(scalar(state, "kind"))
    bound = row_bound(state)
    if kind == "ae":
        return float(sens.unit_ball_bound(teachers))
    if kind == "pca":
        mode = str(scalar(state, "mode"))
        if mode == "clip":
            return float(sens.clipped_bound(bound, teachers))
        return float(sens.pca_row_bound(bound, teachers))
    if kind == "identity":
        classes = int(scalar(state, "classes"))
        return float(sens.onehot_vote_bound(latent_dim(state) // classes, teachers))
    if kind == "anchored":   # rows clipped to C in latent space, whatever y, the anchor or its regions: 2C/K
        return float(sens.clipped_bound(bound, teachers))
    raise CodecRefused(f"codec: unknown kind {kind!r}")


def fallback_encoding(state: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """What a teacher whose output is unusable (NaN, infinite) answers: a fixed, data-independent row.

    Zeros for pca / ae (norm 0 is inside every bound); background votes for identity. A fixed answer keeps
    the teacher in K -- the sensitivity the hospital was charged for stays true -- and reveals nothing;
    the hospital reports only how many teachers fell back (issue 15), never their outputs.
    """
    latent = latent_dim(state)
    if str(scalar(state, "kind")) == "identity":
        classes = int(scalar(state, "classes"))
        votes = np.zeros((n, classes, latent // classes), np.float32)
        votes[:, 0] = 1.0
        return votes.reshape(n, latent)
    return np.zeros((n, latent), np.float32)


# --------------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------------
def latent_dim(state: Mapping[str, np.ndarray]) -> int:
    return int(scalar(state, "latent_dim"))


def row_bound(state: Mapping[str, np.ndarray]) -> float:
    """The largest L2 norm a valid encoding row can have (the server re-checks and re-clips to it).

    pca paper/public: ``y - mu`` lies in [-1, 1]^d, so ``||A_l (y - mu)|| <= R`` where R is the
    per-teacher norm bound stored with the state (sqrt(d), or the public bound of SPEC section 3);
    pca clip: C; ae: 1 (unit ball); identity: sqrt(voxels) (one 1 per voxel).
    """
    return float(scalar(state, "row_bound"))


def encode(state: Mapping[str, np.ndarray], probs: np.ndarray, device=None) -> np.ndarray:
    """Encode teacher probabilities (n, C, *grid) into (n, l) float32 rows, bounded by construction.

    See the module docstring for the bounding step of each kind/mode. Raises ``UserError`` if the input
    does not match the codec (shape) or violates what the sensitivity bound assumes. To encode many
    teachers' outputs with one state, use :func:`make_encoder` (builds the autoencoder once).
    """
    return make_encoder(state, device)(probs)


def make_encoder(state: Mapping[str, np.ndarray], device=None):
    """``encode`` bound to one codec state: the autoencoder (if any) is rebuilt from its arrays once, on
    ``device`` (None = auto). Only the autoencoder's convolutions run there; every bounding step (clipping,
    the unit ball's final check, PCA's projection) runs in float64 on the host, so the row bound the
    sensitivity relies on does not depend on the device."""
    net = autoencoder_from_state(state, device) if str(scalar(state, "kind")) == "ae" else None
    return lambda probs: _encode(state, probs, net)


def _encode(state: Mapping[str, np.ndarray], probs: np.ndarray, net) -> np.ndarray:
    kind = str(scalar(state, "kind"))
    probs = np.asarray(probs, dtype=np.float32)
    classes = int(scalar(state, "classes"))
    grid = tuple(int(g) for g in np.asarray(state["grid"]).reshape(-1))
    if probs.ndim != 2 + len(grid) or probs.shape[1] != classes or tuple(probs.shape[2:]) != grid:
        raise UserError(f"encode: expected probabilities of shape (n, {classes}, {', '.join(map(str, grid))}), "
                        f"got {probs.shape}")
    n = len(probs)
    if kind == "pca":
        mode = str(scalar(state, "mode"))
        components = np.asarray(state["components"], dtype=np.float32)
        mean = np.asarray(state["mean"], dtype=np.float32)
        if mode in ("paper", "public"):
            check_probabilities(probs)
            probs = np.clip(probs, 0.0, 1.0)
        elif not np.all(np.isfinite(probs)):
            raise UserError("encode: teacher outputs contain NaN or infinite values")
        z = (probs.reshape(n, -1) - mean) @ components.T
        if mode == "clip":
            return clip_rows(z, float(scalar(state, "clip")))
        # [-1,1]^d difference bound also bounds the row itself (y - mu in [-1,1]^d since mu in [0,1]^d);
        # clipping to it is a no-op for valid input and guards float round-off.
        return clip_rows(z, row_bound(state) * (1 + 1e-6))
    if kind == "ae":
        if not np.all(np.isfinite(probs)):
            raise UserError("encode: teacher outputs contain NaN or infinite values")
        with torch.no_grad():
            device = next(net.parameters()).device
            rows = [net.encode(torch.from_numpy(probs[i:i + 4]).to(device)).cpu().numpy() for i in range(0, n, 4)]
        z = np.concatenate(rows, axis=0).astype(np.float64) if rows else np.zeros((0, latent_dim(state)))
        return clip_rows(z, 1.0)
    if kind == "identity":
        votes = one_hot(probs.argmax(axis=1), classes)
        return votes.reshape(n, -1).astype(np.float32)
    if kind == "anchored":
        if ANCHOR_KEY not in state or len(np.asarray(state[ANCHOR_KEY])) != n:
            raise UserError(f"encode: the anchored codec needs the public anchor of these {n} scans")
        if not np.all(np.isfinite(probs)):
            raise UserError("encode: teacher outputs contain NaN or infinite values")
        return anchored_encode(probs, state[ANCHOR_KEY], anchored_shells(state), row_bound(state))
    raise UserError(f"codec state: unknown kind {kind!r}; expected pca, ae, anchored or identity")
