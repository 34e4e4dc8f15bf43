"""The encode side of high-dimensional PATE, shared by every codec kind: what a hospital runs locally on its
teachers' outputs, and the registry of codec kinds.

Fay, Sjölund & Oechtering, *Private Learning for High-Dimensional Targets with PATE*. Each kind lives in its own
module of this package, with everything a hospital needs to run it -- verify a state, its replace-one sensitivity, the
encoder, the fixed fallback row -- and registers one :class:`CodecKind` (:func:`register_codec`); nothing outside a
kind's module tests a kind's name:

* ``pca`` (:mod:`task.codecs.pca`) -- PCA-PATE (Algorithm 1): ``z = A_l (y - mu)``.
* ``ae`` (:mod:`task.codecs.ae`) -- Autoencoded PATE (Algorithm 2): ``z = phi(f_enc(y))``, unit-ball activation.
* ``anchored`` (:mod:`task.codecs.anchored`) -- the public-anchored residual (docs/PRIVACY.md, "What limits PATE").
* ``identity`` (:mod:`task.codecs.identity`) -- per-voxel one-hot votes (opt-in: ``allow-identity``).

Whatever is aggregated must be bounded **by construction**, never by assumption:
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
arrays) so that it travels as Flower arrays (task/wire/flower_wire.py) unchanged.

The hospital does not take the server's word for any of this (each hospital checks the codec it is sent;
docs/PRIVACY.md, "Who is trusted"): :func:`verify_codec` refuses kinds the hospital has not allowed, latents longer
than its maximum, states its kind's own check refuses, and replaces the state's claimed row bound by the one it
computes itself; :func:`codec_sensitivity` is the replace-one sensitivity the hospital charges to its own ledger,
computed from the verified state alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from task.errors import UserError
from task.settings.registry import Registry

CodecState = dict  # dict[str, np.ndarray]

PROBABILITY_TOLERANCE = 1e-4
#: relative slack on a row's norm before the server calls it longer than the row bound (float32 rows, float64 norms)
ROW_TOLERANCE = 1e-5


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
    """Scale every row of ``z`` (n, l) down so that its L2 norm is at most ``clip`` (the
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


def latent_dim(state: Mapping[str, np.ndarray]) -> int:
    return int(scalar(state, "latent_dim"))


def row_bound(state: Mapping[str, np.ndarray]) -> float:
    """The largest L2 norm a valid encoding row can have (the server re-checks and re-clips to it): the
    bound :func:`verify_codec` computed from the state (each kind's ``verify`` says what it is)."""
    return float(scalar(state, "row_bound"))


def grid_of(state: Mapping[str, np.ndarray]) -> tuple[int, ...]:
    return tuple(int(g) for g in np.asarray(state["grid"]).reshape(-1))


def check_probability_shape(state: Mapping[str, np.ndarray], probs: np.ndarray) -> np.ndarray:
    """Teacher outputs as float32 of shape (n, classes, *grid) of the codec, else UserError."""
    probs = np.asarray(probs, dtype=np.float32)
    classes, grid = int(scalar(state, "classes")), grid_of(state)
    if probs.ndim != 2 + len(grid) or probs.shape[1] != classes or tuple(probs.shape[2:]) != grid:
        raise UserError(f"encode: expected probabilities of shape (n, {classes}, {', '.join(map(str, grid))}), "
                        f"got {probs.shape}")
    return probs


def check_finite(probs: np.ndarray) -> None:
    if not np.all(np.isfinite(probs)):
        raise UserError("encode: teacher outputs contain NaN or infinite values")


# --------------------------------------------------------------------------------------------------
# the registry of codec kinds
# --------------------------------------------------------------------------------------------------
class CodecRefused(UserError):
    """A codec the hospital will not run (the message names the check that failed)."""


@dataclass(frozen=True)
class CodecKind:
    """Everything a hospital needs to run one kind of codec (one record per kind).

    ``verify(state, classes, grid, latent, scans_shape) -> row bound``: the kind's own checks of a state whose
    common fields are already valid (raise :class:`CodecRefused`); returns the L2 bound every encoding row is
    clipped to. ``sensitivity(state, teachers)``: replace-one L2 sensitivity of the mean of ``teachers`` rows
    of a *verified* state (each kind proves it in its module). ``encoder(state, device)`` -> a function
    ``probs (n, C, *grid) -> rows (n, l) float32``, bounded by construction. ``fallback(state, n)``: the fixed,
    data-independent rows a broken teacher answers. ``opt_in``: a hospital runs it only when its policy says so
    (node config ``allow-identity``); ``unbounded_latent``: ``max-latent-dim`` does not apply (full-resolution
    votes, which the opt-in covers).

    The server's side: ``compressor(settings, *, seed, checkpoint, progress, device, **options)`` -> the kind's
    fitter (a :class:`task.codecs.contract.Compressor`), ``settings`` being the preset's
    :class:`task.settings.presets.Codec` group (None: the kind has no fitter; a method record names its kind, ``Method.codec``).
    ``implausible_rows(state, rows) -> reason | None``: why rows (T, l) that reached the server cannot be this
    kind's output, so the reply is rejected rather than re-clipped (None: any rows can be, see below);
    ``exact_rows``: rows are exact values the server aggregates as they arrive (one-hot votes); otherwise it
    re-clips every accepted row to the state's row bound, whose sensitivity holds for any rows of that norm.
    ``stacked_encoder(state, device)`` (optional) -> a function ``probs (T, n, C, *grid) torch tensor -> rows
    (T, n, l) float32``: what ``encoder`` gives each of T teachers' outputs, computed for all of them together where
    the tensor lies (a GPU: no copy per teacher), the bounding step the same function on the host.
    """

    name: str
    verify: Callable
    sensitivity: Callable
    encoder: Callable
    fallback: Callable
    opt_in: bool = False
    unbounded_latent: bool = False
    compressor: Callable | None = None
    implausible_rows: Callable | None = None
    exact_rows: bool = False
    stacked_encoder: Callable | None = None


_KINDS: Registry[CodecKind] = Registry("codec kind")


def register_codec(kind: CodecKind) -> CodecKind:
    """Add a codec kind (as Opacus' ``register_accountant``): one record per name, registered once."""
    return _KINDS.register(kind.name, kind)


unregister_codec = _KINDS.unregister


def codec_kinds() -> tuple[str, ...]:
    return tuple(_KINDS)


def codec_kind(name: str) -> CodecKind:
    """The record of a registered kind (:class:`CodecRefused` names the registered kinds otherwise)."""
    if name not in _KINDS:
        raise CodecRefused(f"codec: unknown kind {name!r}; expected one of {', '.join(_KINDS)}")
    return _KINDS.get(name)


def kind_of(state: Mapping[str, np.ndarray]) -> CodecKind:
    return codec_kind(str(scalar(state, "kind")))


@dataclass(frozen=True)
class CodecPolicy:
    """What a hospital accepts (node config: ``max-latent-dim``, ``allow-identity``).

    ``kinds``: the kinds it runs (None: every registered kind that is not opt-in). The identity codec uploads
    a full-resolution one-hot map per teacher (its sensitivity is correct, but the trusted aggregator then
    sees every teacher's segmentation): only for hospitals that opt in.
    """

    max_latent_dim: int = 1024
    allow_identity: bool = False
    kinds: tuple | None = None

    def allowed(self) -> tuple:
        base = self.kinds if self.kinds is not None else tuple(n for n, k in _KINDS.items() if not k.opt_in)
        return tuple(base) + tuple(n for n, k in _KINDS.items() if k.opt_in and self.allow_identity and n not in base)


def verify_codec(state: Mapping[str, np.ndarray], policy: CodecPolicy | None = None,
                 scans_shape: tuple | None = None) -> dict:
    """The hospital's check of a codec state; returns a copy whose ``row_bound`` is the hospital's own.

    Raises :class:`CodecRefused`. Checks: the kind is registered and allowed; ``l`` is at
    most the policy's maximum; classes, grid and l are positive; then the kind's own ``verify`` (shapes,
    orthonormality, ranges, ...), which also computes the row bound. ``scans_shape`` (the query batch's scans,
    ``(n, channels, *grid)``): the codec must fit them -- the same grid, and whatever the kind needs per batch
    (the anchored codec's anchor for exactly these n scans) -- so that a request that cannot be encoded is
    refused here, before anything is charged, not in ``encode`` after the charge.
    """
    policy = policy or CodecPolicy()
    try:
        name = str(scalar(state, "kind"))
        classes = int(scalar(state, "classes"))
        grid = grid_of(state)
        latent = int(scalar(state, "latent_dim"))
    except (KeyError, TypeError, ValueError, UserError) as exc:
        raise CodecRefused(f"codec: incomplete state ({exc})") from None
    if name not in policy.allowed():
        opt_in = [n for n, k in _KINDS.items() if k.opt_in]
        raise CodecRefused(f"codec kind {name!r} is not allowed by this hospital (allowed: "
                           f"{', '.join(policy.allowed())}; {', '.join(opt_in) or 'opt-in kinds'} need node-config "
                           "allow-identity=true)")
    kind = kind_of(state)
    voxels = int(np.prod(grid)) if grid else 0
    if classes < 1 or voxels < 1 or latent < 1:
        raise CodecRefused(f"codec: classes={classes}, grid={grid}, latent_dim={latent} must be positive")
    if not kind.unbounded_latent and latent > policy.max_latent_dim:
        raise CodecRefused(f"codec latent_dim {latent} exceeds this hospital's max-latent-dim "
                           f"{policy.max_latent_dim}")
    if scans_shape is not None:
        scans_shape = tuple(int(v) for v in scans_shape)
        if len(scans_shape) != 2 + len(grid) or scans_shape[2:] != grid:
            raise CodecRefused(f"codec: grid {grid} does not match the query scans of shape {scans_shape}")
    verified = dict(state)
    verified["row_bound"] = np.array(float(kind.verify(state, classes, grid, latent, scans_shape)))
    return verified


def codec_sensitivity(state: Mapping[str, np.ndarray], teachers: int) -> float:
    """Replace-one L2 sensitivity of the mean of ``teachers`` encodings under a *verified* codec state: the
    kind's own (one patient changes one teacher's row; each kind bounds how far that row
    can move and proves it in its module)."""
    return float(kind_of(state).sensitivity(state, int(teachers)))


def fallback_encoding(state: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """What a teacher whose output is unusable (NaN, infinite) answers: a fixed, data-independent row.

    A fixed answer keeps the teacher in K -- the sensitivity the hospital was charged for stays true -- and
    reveals nothing; the hospital reports only how many teachers fell back, never their outputs.
    """
    return np.asarray(kind_of(state).fallback(state, int(n)), np.float32)


def zero_rows(state: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """The fallback of every kind whose row bound contains the origin: zeros."""
    return np.zeros((n, latent_dim(state)), np.float32)


def encode(state: Mapping[str, np.ndarray], probs: np.ndarray, device=None) -> np.ndarray:
    """Encode teacher probabilities (n, C, *grid) into (n, l) float32 rows, bounded by construction.

    Raises ``UserError`` if the input does not match the codec (shape) or violates what the sensitivity
    bound assumes. To encode many teachers' outputs with one state, use :func:`make_encoder` (builds the
    autoencoder once).
    """
    return make_encoder(state, device)(probs)


def make_encoder(state: Mapping[str, np.ndarray], device=None) -> "Encoder":
    """``encode`` bound to one codec state (the kind's encoder is built once, e.g. the autoencoder, on ``device``;
    None = auto): an :class:`Encoder`."""
    return Encoder(state, device)


class Encoder:
    """One codec state's encoder for all of a hospital's teachers: ``encoder(probs)`` encodes one teacher's
    probabilities (n, C, *grid) into (n, l) float32 rows, ``encoder.many(probs)`` every teacher's at once."""

    def __init__(self, state: Mapping[str, np.ndarray], device=None) -> None:
        self.state, self.device = state, device
        self.kind = kind_of(state)
        self._one = self.kind.encoder(state, device)
        self._many = None   # the kind's stacked encoder, built when first asked for

    def __call__(self, probs: np.ndarray) -> np.ndarray:
        return np.asarray(self._one(check_probability_shape(self.state, probs)), np.float32)

    def many(self, probs) -> np.ndarray:
        """(T, n, l) float32: the rows of each of T teachers' probabilities (T, n, C, *grid) -- a torch tensor
        (where the teachers computed them) or an array. Kinds with a ``stacked_encoder`` encode them together where
        the tensor lies; the others teacher by teacher on the host, as :meth:`__call__` does."""
        if self.kind.stacked_encoder is None or not isinstance(probs, torch.Tensor):
            return np.stack([self(p.cpu().numpy() if isinstance(p, torch.Tensor) else p) for p in probs]) \
                if len(probs) else np.zeros((0, 0, latent_dim(self.state)), np.float32)
        classes, grid = int(scalar(self.state, "classes")), grid_of(self.state)
        if probs.dim() != 3 + len(grid) or probs.shape[2] != classes or tuple(probs.shape[3:]) != grid:
            raise UserError(f"encode: expected probabilities of shape (teachers, n, {classes}, "
                            f"{', '.join(map(str, grid))}), got {tuple(probs.shape)}")
        if self._many is None:
            self._many = self.kind.stacked_encoder(self.state, self.device)
        return np.asarray(self._many(probs.float()), np.float32)
