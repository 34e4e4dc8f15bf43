"""Compressors of high-dimensional PATE: fitted on PUBLIC reference segmentations only.

Fay, Sjölund & Oechtering, *Private Learning for High-Dimensional Targets with PATE*, Sec. 3-4:

* :class:`PCACompressor` — Algorithm 1 (PCA-PATE), automatic l by eq. 7, three sensitivity modes.
* :class:`AutoencoderCompressor` — Algorithm 2 (Autoencoded PATE), unit-ball bottleneck, noise of the
  deployment sigma in the bottleneck during training.
* :class:`IdentityCompressor` — the naive baseline: noisy averaging of per-voxel one-hot votes.

The contract every compressor keeps (``server.pate.plan_release`` asks the compressor, it never tests its name, so a
new kind needs no change there): ``fit_release(public: PublicFit, noise_per_sensitivity, teachers)`` fits it on the
public data it needs for a release (``needs_public_model``: the public model's predictions too); ``state()`` (a
``CodecState``) is what the hospitals are shipped (they encode locally with the codec kind's own module,
:mod:`task.codecs`); ``batch_state(state, public_probs)`` adds the public side information one query batch travels
with; ``decode_release(z, public_probs, sigma)`` turns noisy mean latents into probabilities; ``release_checks()``
(e.g. the autoencoder's collapse check) and ``fit_counts`` go on the record; ``sensitivity(teachers)``, ``relation =
"replace-one"``, ``latent_dim``, ``bytes_per_query_per_teacher``. Which compressor a PATE method uses is one registry
entry (:func:`register_compressor`). Nothing fitted here may see private data: everything in a :class:`PublicFit` is
public.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from privacy import sensitivity as sens
from task import codecs
from task.codecs.headfit import fit_head_decode
from task.device import resolve_device
from task.errors import UserError
from task.io import atomic_save_torch
from task.options import Decoder, PcaMode, Relation, look_up_option
from task.presets import Codec
from task.registry import Registry


def choose_components(eigenvalues: np.ndarray, sigma: float) -> int:
    """Eq. 7 of Fay et al.: keep the components whose variance exceeds the noise variance,
    ``l = #{j : lambda_j > sigma^2}`` (at least 1), which minimises ``sum_{j>l} lambda_j + l sigma^2``
    for a sigma that does not depend on l."""
    eigenvalues = np.asarray(eigenvalues, dtype=np.float64)
    return max(1, int(np.sum(eigenvalues > float(sigma) ** 2)))


def _teachers(teachers: int) -> int:
    teachers = int(teachers)
    if teachers < 1:
        raise UserError(f"teachers: expected at least 1 answering teacher, got {teachers}")
    return teachers


@dataclass
class PublicFit:
    """The public data a compressor may be fitted on for one release (nothing in it depends on private data).

    ``reference_maps``: one-hot public reference labels (n, C, *grid); ``reference_probs``: the public model's
    probabilities on those reference scans; ``query_probs``: the public model's probabilities on the public query
    scans (None without a public model); ``reference_is_query``: the reference set *is* the query scans (the paper
    preset); ``with_predictions``: PCA / autoencoder also fit the public model's label maps of the query scans.
    """

    reference_maps: np.ndarray
    reference_probs: np.ndarray | None = None
    query_probs: np.ndarray | None = None
    reference_is_query: bool = False
    with_predictions: bool = True
    #: the public reference scans themselves (the anchored codec's intensity bins are fitted on them)
    reference_scans: np.ndarray | None = None

    def label_maps(self) -> tuple[np.ndarray, dict[str, int]]:
        """The one-hot maps a PCA / autoencoder codec is fitted on (Fay et al. Alg. 1-2 fit on public labels),
        and how many of each kind: the public reference labels (another centre's), and -- ``with_predictions``
        -- the public model's label maps of the public query scans, which come from the hospitals' population,
        so their lesions' positions and shapes are the ones the teachers will describe. Both public
        by construction (tests/test_pate_codec_fit.py)."""
        maps = [np.asarray(self.reference_maps, np.float32)]
        counts = {"public_reference_labels": len(maps[0]), "public_model_on_query_scans": 0}
        # the paper preset's reference set *is* the query scans with their public labels: nothing to add
        if self.with_predictions and self.query_probs is not None and len(self.query_probs) and not self.reference_is_query:
            classes = maps[0].shape[1]
            maps.append(codecs.one_hot(np.asarray(self.query_probs).argmax(axis=1), classes))
            counts["public_model_on_query_scans"] = len(maps[1])
        return np.concatenate(maps, axis=0), counts


class Compressor:
    name = "compressor"
    relation = Relation.REPLACE_ONE
    latent_dim: int = 0
    grid: tuple = ()
    classes: int = 4
    #: fit_release needs the public model's predictions (PublicFit.reference_probs / query_probs), and every
    #: query batch and decode needs them as side information
    needs_public_model: bool = False
    #: how many public maps of each kind fit_release fitted on (None: the reference labels alone)
    fit_counts: dict[str, int] | None = None

    def fit_release(self, public: PublicFit, noise_per_sensitivity: float, teachers: int) -> "Compressor":
        """Fit for a release of ``teachers`` answers at ``sigma = noise_per_sensitivity x S``: by default on the
        public reference labels alone (the identity codec learns only their shape)."""
        return self.fit(public.reference_maps)

    def batch_state(self, state: dict, public_probs: np.ndarray | None, scans: np.ndarray | None = None) -> dict:
        """The codec state one query batch is shipped with (default: the state itself); ``public_probs`` and
        ``scans``: the public model's probabilities for the batch's public scans, and the scans."""
        return state

    def decode_release(self, z: np.ndarray, public_probs: np.ndarray | None, sigma: float,
                       scans: np.ndarray | None = None) -> np.ndarray:
        """Probabilities from noisy mean latents of noise ``sigma`` (default: :meth:`decode`)."""
        return self.decode(z)

    def release_checks(self) -> dict | None:
        """What the record should say about the fitted codec's health (default: nothing)."""
        return None

    @property
    def bytes_per_query_per_teacher(self) -> int:
        return int(self.latent_dim) * 4

    def fit(self, public_onehot: np.ndarray) -> "Compressor":  # pragma: no cover - interface
        raise NotImplementedError

    def state(self) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, z: np.ndarray) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def sensitivity(self, teachers: int) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def row_bound(self) -> float:
        return codecs.row_bound(self.state())

    def encode(self, probs: np.ndarray) -> np.ndarray:
        """Server-side convenience (tests, diagnostics): the exact function hospitals run."""
        return codecs.encode(self.state(), probs, getattr(self, "device", None))

    def describe(self) -> dict:
        return {"name": self.name, "latent_dim": int(self.latent_dim)}

    def _check_fit_input(self, public_onehot) -> np.ndarray:
        maps = np.asarray(public_onehot, dtype=np.float32)
        if maps.ndim < 3 or len(maps) < 2:
            raise UserError(f"public reference maps: expected (n >= 2, C, *grid), got shape {maps.shape}")
        codecs.check_probabilities(maps, "public reference maps")
        self.classes = int(maps.shape[1])
        self.grid = tuple(int(g) for g in maps.shape[2:])
        return maps

    def _base_state(self, kind: str) -> dict:
        return {"kind": np.array(kind), "classes": np.array(self.classes, dtype=np.int64),
                "grid": np.array(self.grid, dtype=np.int64),
                "latent_dim": np.array(int(self.latent_dim), dtype=np.int64)}


# --------------------------------------------------------------------------------------------------
class PCACompressor(Compressor):
    """PCA-PATE (Fay et al., Algorithm 1): ``z = A_l (y - mu)``, ``y_hat = A_l^T z_bar + mu``.

    Fitted on one-hot public reference maps with the Gram-matrix trick (n << d: eigen-decompose the
    n x n matrix ``X X^T / (n-1)`` of the centred maps; ``a_j = X^T v_j / sqrt((n-1) lambda_j)``), which
    is exact and costs O(n^2 d). At most n-1 components exist; ``eigenvalues`` are the sample covariance's.

    Sensitivity (replace-one, Fay et al. Sec. 3, via :mod:`privacy.sensitivity`):
      * ``"paper"``  — ``sqrt(d)/K`` (eq. 4),
      * ``"public"`` — ``min(sqrt(d), sqrt(sum_j ||a_j||_1^2))/K`` (tighter, depends on l),
      * ``"clip"``   — rows clipped to ``C`` at the hospital, ``2C/K``. ``clip=None`` takes C = the
        largest norm of the public reference encodings (public, so free).

    Automatic l (``n_components=None``): :meth:`resolve_components`. For "paper" and "clip" S does not
    depend on l and the choice is exactly eq. 7 at ``sigma = c S``. For "public" S(l) grows with l, so
    sigma(l) = c S(l) does too, and "keep lambda_j > sigma^2" has no fixed point in general; we instead
    minimise the quantity eq. 7 minimises, ``E(l) = sum_{j>l} lambda_j + l c^2 S(l)^2``, over l directly
    (every kept component then satisfies lambda_j >= lambda_l > sigma(l)^2 only if that is optimal; the
    returned l is reported with its sigma).
    """

    name = "pca"

    def __init__(self, n_components: int | None = None, sensitivity_mode: str = "public",
                 clip: float | None = None):
        if n_components is not None and int(n_components) < 1:
            raise UserError(f"n_components: expected a positive integer or None, got {n_components}")
        self.n_components = None if n_components is None else int(n_components)
        self.sensitivity_mode = look_up_option(sensitivity_mode, PcaMode, "sensitivity_mode")
        self.clip = None if clip is None else float(clip)
        self.eigenvalues: np.ndarray | None = None
        self.basis: np.ndarray | None = None   # all fitted components (r, d), orthonormal rows
        self.mean: np.ndarray | None = None
        self.latent_dim = 0

    # -- fitting -----------------------------------------------------------------------------------
    def fit(self, public_onehot: np.ndarray) -> "PCACompressor":
        maps = self._check_fit_input(public_onehot)
        n = len(maps)
        flat = maps.reshape(n, -1)
        self.mean = flat.mean(axis=0).astype(np.float32)
        centred = (flat - self.mean).astype(np.float32)
        if flat.shape[1] <= n:  # more maps than dimensions: the d x d covariance is the smaller problem
            covariance = (centred.T.astype(np.float64) @ centred.astype(np.float64)) / (n - 1)
            values, vectors = np.linalg.eigh(covariance)
            order = np.argsort(values)[::-1]
            values, basis = values[order], vectors[:, order].T
            keep = values > max(values[0], 0.0) * 1e-10
            values, basis = values[keep], basis[keep]
        else:  # n << d (the usual case): eigen-decompose the n x n Gram matrix instead
            gram = (centred @ centred.T).astype(np.float64) / (n - 1)
            values, vectors = np.linalg.eigh(gram)
            order = np.argsort(values)[::-1]
            values, vectors = values[order], vectors[:, order]
            keep = values > max(values[0], 0.0) * 1e-10
            values, vectors = values[keep], vectors[:, keep]
            basis = (vectors.T @ centred.astype(np.float64)) / np.sqrt((n - 1) * values)[:, None]
        # Re-orthonormalise (round-off in float32 centring) so ||A_l u|| <= ||u|| holds exactly.
        q, r = np.linalg.qr(basis.T)
        basis = (q * np.sign(np.diag(r))).T
        self.basis = basis.astype(np.float64)
        self.eigenvalues = values.astype(np.float64)
        # Only n-1 directions exist: a larger n_components is capped (reported by describe()).
        self.latent_dim = min(self.n_components or len(values), len(values))
        if self.sensitivity_mode is PcaMode.CLIP and self.clip is None:
            z = (flat - self.mean) @ self.basis[: self.latent_dim].T
            self.clip = float(np.linalg.norm(z, axis=1).max()) or 1.0
            self._clip_auto = True
        self._fit_norms = None
        return self

    @property
    def d(self) -> int:
        return int(self.classes * np.prod(self.grid))

    @property
    def components(self) -> np.ndarray:
        """A_l: the first ``latent_dim`` principal directions (l, d)."""
        self._require_fit()
        return self.basis[: self.latent_dim]

    def _require_fit(self):
        if self.basis is None:
            raise UserError("PCACompressor: call fit(public reference maps) first")

    # -- sensitivity and the choice of l -------------------------------------------------------------
    def norm_bound(self, l: int | None = None) -> float:
        """Per-teacher bound R on ``||A_l (y - y')||`` for ``y, y' in [0,1]^d`` (paper/public modes)
        or the clip C; the replace-one sensitivity of the mean is R/K (paper/public) or 2C/K (clip)."""

        self._require_fit()
        l = self.latent_dim if l is None else int(l)
        if self.sensitivity_mode is PcaMode.PAPER:
            return float(sens.pca_paper_bound(self.d, 1))
        if self.sensitivity_mode is PcaMode.PUBLIC:
            return float(sens.pca_public_bound(self.basis[:l], 1))
        return float(self.clip)

    def sensitivity(self, teachers: int) -> float:
        teachers = _teachers(teachers)
        self._require_fit()
        if self.sensitivity_mode is PcaMode.PAPER:
            return float(sens.pca_paper_bound(self.d, teachers))
        if self.sensitivity_mode is PcaMode.PUBLIC:
            return float(sens.pca_public_bound(self.components, teachers))
        return float(sens.clipped_bound(self.clip, teachers))

    def expected_error(self, l: int, sigma: float) -> float:
        """Eq. 7 (from eq. 6): expected squared reconstruction error ``sum_{j>l} lambda_j + l sigma^2``.

        The sum runs over the fitted eigenvalues only (at most n-1): variance the public sample never
        showed is not in it."""
        self._require_fit()
        l = int(l)
        return float(self.eigenvalues[l:].sum() + l * float(sigma) ** 2)

    def fit_release(self, public: PublicFit, noise_per_sensitivity: float, teachers: int) -> "PCACompressor":
        """Fit on the public label maps (:meth:`PublicFit.label_maps`), then keep the components eq. 7 says."""
        maps, self.fit_counts = public.label_maps()
        self.fit(maps)
        self.resolve_components(noise_per_sensitivity, teachers)
        return self

    def resolve_components(self, noise_per_sensitivity: float, teachers: int) -> tuple[int, float]:
        """Choose l automatically (eq. 7) when ``n_components`` is None, for a calibration in which
        ``sigma = noise_per_sensitivity * S`` (true for the exact GDP and the paper's eq. 15
        calibrations: both are linear in S). Returns ``(l, sigma at that l)`` and sets ``latent_dim``.

        For the "public" mode S depends on l; see the class docstring for why we minimise
        ``E(l) = sum_{j>l} lambda_j + l (c S(l))^2`` instead of iterating eq. 7 to a fixed point.
        """

        self._require_fit()
        c = float(noise_per_sensitivity)
        teachers = _teachers(teachers)
        if self.n_components is not None:
            self.latent_dim = min(self.n_components, len(self.eigenvalues))
        elif self.sensitivity_mode in (PcaMode.PAPER, PcaMode.CLIP):
            sigma = c * self.sensitivity(teachers)
            self.latent_dim = choose_components(self.eigenvalues, sigma)
        else:
            # S(l) for every l at once: sqrt(cumulative sum of ||a_j||_1^2), capped at sqrt(d).
            l1_squared = np.cumsum(np.abs(self.basis).sum(axis=1) ** 2)
            bound = np.minimum(math.sqrt(self.d), np.sqrt(l1_squared)) / teachers
            ls = np.arange(1, len(self.eigenvalues) + 1)
            tails = np.concatenate([np.cumsum(self.eigenvalues[::-1])[::-1][1:], [0.0]])
            errors = tails + ls * (c * bound) ** 2
            self.latent_dim = int(ls[int(np.argmin(errors))])
            assert abs(bound[self.latent_dim - 1] - sens.pca_public_bound(self.components, teachers)) < 1e-6
        return self.latent_dim, c * self.sensitivity(teachers)

    # -- codec ---------------------------------------------------------------------------------------
    def state(self) -> dict:
        self._require_fit()
        state = self._base_state("pca")
        state.update({
            "mode": np.array(self.sensitivity_mode.value),
            "components": self.components.astype(np.float32),
            "mean": self.mean.astype(np.float32),
            "clip": np.array(float(self.clip) if self.clip is not None else float("nan")),
            "row_bound": np.array(self.norm_bound()),
        })
        return state

    def decode(self, z: np.ndarray) -> np.ndarray:
        """``y_hat = A_l^T z + mu`` (Algorithm 1), projected back onto per-voxel probabilities."""
        self._require_fit()
        z = np.asarray(z, dtype=np.float64).reshape(-1, self.latent_dim)
        flat = z @ self.components + self.mean
        return codecs.normalise_probabilities(flat.reshape(len(z), self.classes, *self.grid))

    def reconstruct_raw(self, maps: np.ndarray, sigma: float = 0.0, rng=None) -> np.ndarray:
        """``A_l^T (A_l (y - mu) + gamma) + mu`` without the probability projection (eq. 6), for tests."""
        flat = np.asarray(maps, dtype=np.float64).reshape(len(maps), -1)
        z = (flat - self.mean) @ self.components.T
        if sigma > 0:
            rng = rng or np.random.default_rng(0)
            z = z + rng.normal(0.0, sigma, size=z.shape)
        return z @ self.components + self.mean

    def describe(self) -> dict:
        return {"name": self.name, "latent_dim": int(self.latent_dim), "sensitivity_mode": self.sensitivity_mode.value,
                "clip": self.clip, "fitted_components": None if self.eigenvalues is None else len(self.eigenvalues),
                "explained_variance": None if self.eigenvalues is None else
                float(self.eigenvalues[: self.latent_dim].sum() / self.eigenvalues.sum())}


# --------------------------------------------------------------------------------------------------
def _reconstruction_loss(logits, target):
    """Cross-entropy (Fay et al., Alg. 2) plus a soft Dice term over the tumour classes.

    Why the Dice term: tumour is ~2.5% of the voxels of a brain-cropped volume; with cross-entropy alone
    the autoencoder reaches its loss floor by decoding everything to background (measured on the quick
    preset's 40 reference maps: foreground Dice 0.001 after 60 epochs), i.e. the collapse of
    docs/PRIVACY.md ("What limits PATE") even without noise. The Dice term weights each tumour class by its own volume.
    """

    log_probs = torch.log_softmax(logits, dim=1)
    cross_entropy = -(target * log_probs).sum(dim=1).mean()
    probs = log_probs.exp()[:, 1:]
    truth = target[:, 1:]
    dims = tuple(range(2, probs.ndim))
    intersection = (probs * truth).sum(dim=dims)
    denominator = probs.sum(dim=dims) + truth.sum(dim=dims)
    dice = (2 * intersection + 1.0) / (denominator + 1.0)
    return cross_entropy + (1 - dice).mean()


class AutoencoderCompressor(Compressor):
    """Autoencoded PATE (Fay et al., Algorithm 2).

    Trains :func:`task.codecs.AutoencoderNet` on the public reference label maps with cross-entropy,
    Gaussian noise of std ``train_sigma`` (set it to the deployment sigma) added to the unit-ball
    bottleneck, random flips as augmentation, Adam; seeded, and checkpointed at ``checkpoint`` (a
    checkpoint written for the same data + configuration is reused instead of retraining).
    Replace-one sensitivity of the mean of K unit-ball encodings: 2/K (Proposition 2).

    ``device`` (``task.device``, None = auto): where the autoencoder trains, encodes and decodes. It stays
    in float32 whatever the run's precision: it is small, and its unit-ball output is what the sensitivity 2/K
    rests on. The bottleneck's training noise and the flips are drawn on the host from the seeded generators,
    then copied, so the trained autoencoder does not depend on where the draws would otherwise have been made.
    """

    name = "ae"

    def __init__(self, latent_dim: int, train_sigma: float = 0.0, epochs: int = 20, *, learning_rate: float = 2e-3,
                 batch_size: int = 4, seed: int = 0, channels=(8, 16, 32, 32), checkpoint: str | Path | None = None,
                 progress: bool = False, device=None):
        if int(latent_dim) < 1:
            raise UserError(f"latent_dim: expected a positive integer, got {latent_dim}")
        self.latent_dim = int(latent_dim)
        self.train_sigma = float(train_sigma)
        self.epochs = int(epochs)
        self.learning_rate = float(learning_rate)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.channels = tuple(channels)
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.progress = progress
        self.device = resolve_device(device)
        self.net = None
        self.history: list[float] = []
        self._reference: np.ndarray | None = None

    def fit_release(self, public: PublicFit, noise_per_sensitivity: float, teachers: int) -> "AutoencoderCompressor":
        """Alg. 2: the decoder learns on the noise it will see (``train_sigma`` = the release's sigma), on the
        public label maps (:meth:`PublicFit.label_maps`)."""
        self.train_sigma = noise_per_sensitivity * self.sensitivity(teachers)
        maps, self.fit_counts = public.label_maps()
        return self.fit(maps)

    def release_checks(self) -> dict:
        """The collapse check (a decoder that learnt to decode everything to background; docs/PRIVACY.md)."""
        return self.collapsed()

    def _fingerprint(self, maps: np.ndarray) -> str:
        digest = hashlib.sha256(np.ascontiguousarray(maps).tobytes())
        digest.update(json.dumps([self.latent_dim, self.train_sigma, self.epochs, self.learning_rate,
                                  self.batch_size, self.seed, list(self.channels)]).encode())
        return digest.hexdigest()[:16]

    def fit(self, public_onehot: np.ndarray) -> "AutoencoderCompressor":
        maps = self._check_fit_input(public_onehot)
        self._reference = maps
        torch.manual_seed(self.seed)
        self.net = codecs.AutoencoderNet(self.latent_dim, self.grid, self.classes, self.channels).to(self.device)
        fingerprint = self._fingerprint(maps)
        if self.checkpoint is not None and self.checkpoint.exists():
            saved = torch.load(self.checkpoint, map_location="cpu", weights_only=False)
            if saved.get("fingerprint") == fingerprint:
                self.net.load_state_dict(saved["state_dict"])
                self.history = list(saved.get("history", []))
                self.net.eval()
                return self
        generator = torch.Generator().manual_seed(self.seed)
        rng = np.random.default_rng(self.seed)
        optimiser = torch.optim.Adam(self.net.parameters(), lr=self.learning_rate)
        data = torch.from_numpy(maps).to(self.device)   # the public maps on the device once
        epochs = range(self.epochs)
        if self.progress:
            epochs = tqdm(epochs, desc="autoencoder", leave=False)
        self.net.train()
        for _ in epochs:
            order = rng.permutation(len(maps))
            total = 0.0
            for start in range(0, len(order), self.batch_size):
                batch = data[torch.from_numpy(order[start:start + self.batch_size]).to(self.device)]
                flips = [axis + 2 for axis in range(len(self.grid)) if rng.random() < 0.5]
                if flips:  # public-data augmentation: mirrored label maps are plausible label maps
                    batch = torch.flip(batch, dims=flips)
                logits = self.net(batch, noise_sigma=self.train_sigma, generator=generator)
                loss = _reconstruction_loss(logits, batch)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                total += float(loss.detach()) * len(batch)
            self.history.append(total / len(maps))
        self.net.eval()
        if self.checkpoint is not None:
            atomic_save_torch(self.checkpoint, {"fingerprint": fingerprint, "state_dict": self.net.state_dict(),
                                                "history": self.history, "config": self.describe()})
        return self

    def _require_fit(self):
        if self.net is None:
            raise UserError("AutoencoderCompressor: call fit(public reference maps) first")

    def sensitivity(self, teachers: int) -> float:
        return float(sens.unit_ball_bound(_teachers(teachers)))

    def state(self) -> dict:
        self._require_fit()
        state = self._base_state("ae")
        state.update({"channels": np.array(self.net.channels, dtype=np.int64), "clip": np.array(1.0),
                      "row_bound": np.array(1.0)})
        state.update(codecs.encoder_arrays(self.net))
        return state

    def decode(self, z: np.ndarray) -> np.ndarray:
        self._require_fit()
        z = torch.as_tensor(np.asarray(z, dtype=np.float32).reshape(-1, self.latent_dim)).to(self.device)
        with torch.no_grad():
            out = [self.net.decode(z[i:i + 8]).cpu().numpy() for i in range(0, len(z), 8)]
        return np.concatenate(out, axis=0).astype(np.float32)

    def collapsed(self, maps: np.ndarray | None = None, threshold: float = 0.1) -> dict:
        """The collapse pitfall: with a bottleneck sigma large against the unit ball, the decoder learns
        to decode everything to background. Decodes the noise-free encodings of ``maps`` (default: the
        public reference maps) and compares foreground volumes; ``collapsed`` if the decoder keeps less
        than ``threshold`` of the true foreground."""
        self._require_fit()
        maps = self._reference if maps is None else np.asarray(maps, dtype=np.float32)
        decoded = self.decode(codecs.encode(self.state(), maps, self.device)).argmax(axis=1)
        truth = maps.argmax(axis=1)
        true_fg = int((truth > 0).sum())
        kept = int((decoded > 0).sum())
        overlap = int(((decoded > 0) & (truth > 0)).sum())
        ratio = kept / true_fg if true_fg else float("nan")
        dice = 2 * overlap / (kept + true_fg) if (kept + true_fg) else float("nan")
        return {"collapsed": bool(true_fg > 0 and (ratio < threshold or dice < threshold)),
                "foreground_ratio": ratio, "foreground_dice": dice}

    def describe(self) -> dict:
        return {"name": self.name, "latent_dim": self.latent_dim, "train_sigma": self.train_sigma,
                "epochs": self.epochs, "final_loss": self.history[-1] if self.history else None}


# --------------------------------------------------------------------------------------------------
class IdentityCompressor(Compressor):
    """The naive baseline: each teacher uploads its d = C x voxels one-hot votes; the noisy mean of the
    votes is the pseudo-label. Replace-one sensitivity ``onehot_vote_bound(voxels, K)`` (one teacher's
    vote can move in every voxel). Shows what compression buys."""

    name = "identity"

    def fit(self, public_onehot: np.ndarray) -> "IdentityCompressor":
        self._check_fit_input(public_onehot)
        self.latent_dim = int(self.classes * np.prod(self.grid))
        return self

    @property
    def voxels(self) -> int:
        return int(np.prod(self.grid))

    def sensitivity(self, teachers: int) -> float:
        return float(sens.onehot_vote_bound(self.voxels, _teachers(teachers)))

    def state(self) -> dict:
        if not self.grid:
            raise UserError("IdentityCompressor: call fit(public reference maps) first")
        state = self._base_state("identity")
        state.update({"clip": np.array(float("nan")), "row_bound": np.array(math.sqrt(self.voxels))})
        return state

    def decode(self, z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, dtype=np.float32).reshape(-1, self.classes, *self.grid)
        return codecs.normalise_probabilities(z)


# --------------------------------------------------------------------------------------------------
class AnchoredResidualCompressor(Compressor):
    """Anchored residual PATE: PATE should only add to what public data gives (docs/PRIVACY.md, "What limits PATE").

    Fay et al.'s Algorithms 1-2 compress the teachers' whole answer, so a compressor fitted on a few public
    maps decodes even the noise-free ensemble to its own prior. Here the public model's prediction ``p_n``
    for query n -- public side information, free -- is the decoder's output at latent zero, and the
    teachers transmit only where they disagree with it:

    * encode (at the hospital, :func:`task.codecs.anchored_encode`): ``z_nk = clip_C(B_n (y_nk - p_n))``,
      ``B_n`` = per tumour class, the residual summed over each shell around ``p_n``'s tumour
      (:func:`task.codecs.anchor_regions`: the boundary layer, ``-lo`` layers inside, ``hi`` outside) over
      the square root of the shell's size (orthonormal rows): the queries ask where the information is;
    * with ``intensity_bins`` B > 1 (docs/decisions/intensity-bins.md), each shell is split into B within-shell
      quantile bins of the query scan's ``intensity_channel`` (T1-Gd by default;
      :func:`task.codecs.intensity_bin_map`), computed by the server from the public scans and shipped with the anchor:
      within a shell the decoder could only place a class by the public model's ranking of voxels, which says nothing
      for a class the public model never predicts (perfect-teacher ceiling on the quick world, class 2: 0.36 with
      shells, 0.62 with 3 T1-Gd bins; benchmarks/codec_ceiling.py);
    * aggregate: ``z_bar_n = (1/K) sum_k z_nk + N(0, sigma^2 I_l)`` (Alg. 1-2), ``l = 3 (hi - lo + 1) B``;
    * decode, by the compressor's ``decoder`` (:data:`ANCHORED_DECODERS`): ``mass-matching``
      (:func:`task.codecs.anchored_decode`: per region, the public model's probabilities re-weighted so that each
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

    def __init__(self, shells: tuple = (-2, 5), clip: float | None = None, clip_scale: float = 2.5,
                 intensity_bins: int = 1, intensity_channel: int = codecs.T1GD_CHANNEL,
                 decoder: Decoder = Decoder.MASS_MATCHING, device=None):
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
        self.latent_dim = codecs.anchored_latent_dim(self.classes, self.shells, self.intensity_bins)
        if public_probs is not None:
            public_probs = np.asarray(public_probs, dtype=np.float32)
            if public_probs.shape != maps.shape:
                raise UserError(f"public model probabilities {public_probs.shape} do not match the public "
                                f"reference maps {maps.shape}")
            codecs.check_probabilities(public_probs, "public model probabilities")
            if self.intensity_bins > 1 and public_scans is None:
                raise UserError("anchored codec: with intensity bins, fit needs the public reference scans too")
            norms = np.linalg.norm(codecs.anchored_encode(maps, public_probs, self.shells, None,
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
        return float(sens.clipped_bound(self.clip, _teachers(teachers)))

    def _regions(self, anchor: np.ndarray, scans: np.ndarray | None) -> np.ndarray:
        """The batch's regions (shells x intensity bins), the shells computed once (:func:`task.codecs.binned_regions`)."""
        return codecs.binned_regions(anchor, self.shells, scans, self.intensity_channel, self.intensity_bins)[0]

    def state(self) -> dict:
        self._require_fit()
        state = self._base_state("anchored")
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
        return codecs.encode(self.batch_state(self.state(), anchor, scans), probs)

    def decode(self, z: np.ndarray, anchor: np.ndarray | None = None, sigma: float = 0.0,
               scans: np.ndarray | None = None) -> np.ndarray:
        """Pseudo-labels by this compressor's decoder (:data:`ANCHORED_DECODERS`); ``sigma``: the release's noise."""
        self._require_fit()
        if anchor is None:
            raise UserError("anchored codec: decode needs the public anchor (the public model's prediction)")
        return ANCHORED_DECODERS[self.decoder](self, z, np.asarray(anchor), float(sigma), scans)

    def _mass_matching(self, z, anchor, sigma, scans) -> np.ndarray:
        """Per query: James-Stein shrinkage towards the anchor when ``sigma`` > 0 (:func:`task.codecs.shrink_latents`,
        so that noise-dominated latents decode to the public model), then mass matching in every region."""
        return codecs.anchored_decode(codecs.shrink_latents(z, sigma), anchor, self.shells,
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
        return codecs.with_anchor(state, public_probs, scans)

    def decode_release(self, z: np.ndarray, public_probs: np.ndarray | None, sigma: float,
                       scans: np.ndarray | None = None) -> np.ndarray:
        """Decode against the scans' anchors, shrinking noisy latents towards them (``sigma = 0``: no shrinkage)."""
        return self.decode(z, public_probs, sigma=sigma, scans=scans)

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

#: PATE method -> the factory of its compressor (one entry per method, so no code elsewhere tests method names)
#: ``factory(preset, seed=, checkpoint=, progress=, device=, **options) -> Compressor`` per method
_COMPRESSORS: Registry[Callable[..., Compressor]] = Registry("compressor")
register_compressor, unregister_compressor = _COMPRESSORS.register, _COMPRESSORS.unregister


def make_compressor(method: str, preset=None, *, seed: int = 0, checkpoint: str | Path | None = None,
                    progress: bool = False, device=None, **options) -> Compressor:
    """The compressor a PATE method uses (the registered factory).

    Args:
        method: a registered PATE method (``pate-pca``, ``pate-ae``, ``pate-naive``, ``pate-anchored``, ...);
            anything else is a ``UserError``.
        preset: the preset whose settings the factory defaults to (PCA components, autoencoder latent size and
            epochs, anchored shells); None = the factory's own defaults.
        seed: the autoencoder's training seed (the other codecs ignore it).
        checkpoint: where the autoencoder is checkpointed and, when written for the same data and
            configuration, reused (None = not checkpointed; the other codecs ignore it).
        progress: progress bars while the autoencoder trains.
        device: where the autoencoder runs (``task.device``; None = auto). The other codecs are numpy on the host:
            matrix products of at most a few hundred public rows, and float64 bounding steps the sensitivity
            depends on.
        **options: the factory's own settings (e.g. ``n_components``, ``pca_mode`` / ``sensitivity_mode``,
            ``clip``, ``latent_dim``, ``epochs``, ``shells``, ``clip_scale``); a factory ignores the ones it
            does not use.
    """
    if method not in _COMPRESSORS:
        raise UserError(f"method: expected one of {', '.join(_COMPRESSORS)}, got {method!r}")
    return _COMPRESSORS.get(method)(preset, seed=seed, checkpoint=checkpoint, progress=progress, device=device,
                                **options)


def _codec(preset) -> Codec:
    """The preset's codec recipe (:class:`task.presets.Codec`; its defaults without a preset)."""
    return preset.codec if preset is not None else Codec()


def _pca(preset, *, seed, checkpoint, progress, device=None, **options) -> PCACompressor:
    return PCACompressor(options.get("n_components", _codec(preset).pca_components),
                         options.get("sensitivity_mode", options.get("pca_mode", PcaMode.PUBLIC)), options.get("clip"))


def _autoencoder(preset, *, seed, checkpoint, progress, device=None, **options) -> AutoencoderCompressor:
    codec = _codec(preset)
    return AutoencoderCompressor(options.get("latent_dim", codec.ae_latent_dim),
                                 epochs=options.get("epochs", codec.ae_epochs),
                                 seed=seed, checkpoint=checkpoint, progress=progress, device=device)


def _identity(preset, *, seed, checkpoint, progress, device=None, **options) -> IdentityCompressor:
    return IdentityCompressor()


def _anchored(preset, *, seed, checkpoint, progress, device=None, **options) -> AnchoredResidualCompressor:
    codec = _codec(preset)
    return AnchoredResidualCompressor(options.get("shells", codec.anchored_shells), options.get("clip"),
                                      options.get("clip_scale", codec.anchored_clip_scale),
                                      options.get("intensity_bins", codec.anchored_intensity_bins),
                                      options.get("intensity_channel", codecs.T1GD_CHANNEL),
                                      options.get("decoder", codec.anchored_decoder), device)


for _method, _factory in (("pate-pca", _pca), ("pate-ae", _autoencoder), ("pate-naive", _identity),
                          ("pate-anchored", _anchored), ("pate-anchored-secure", _anchored)):
    register_compressor(_method, _factory)


__all__ = ["Compressor", "PublicFit", "PCACompressor", "AutoencoderCompressor", "AnchoredResidualCompressor",
           "IdentityCompressor", "choose_components", "make_compressor", "register_compressor", "unregister_compressor"]
