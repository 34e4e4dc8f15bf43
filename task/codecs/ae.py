"""Autoencoded PATE's codec (Fay et al., Algorithm 2): ``z = phi(f_enc(y))`` with the unit-ball
activation :func:`task.codecs.core.unit_ball`; the autoencoder network both sides build, the hospital side of the
codec, and the server's :class:`AutoencoderCompressor`, which trains it on public maps (:class:`AutoencoderSettings`),
ships only the encoder's weights and decodes.

Sensitivity (replace-one): ``||phi(.)|| <= 1`` for every input (Proposition 2), so one teacher's row moves by at
most 2 and the mean of K rows by 2/K; the encoder clips rows to 1 again after float rounding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from privacy import sensitivity as sens
from task.codecs.contract import Compressor, PublicFit, answering_teachers
from task.codecs.core import (CodecKind, CodecRefused, check_finite, clip_rows, encode, latent_dim, register_codec,
                             scalar, unit_ball, zero_rows)
from task.learning.device import resolve_device
from task.errors import UserError
from task.io import atomic_save_torch
from task.settings.presets import Codec

_ENCODER_PREFIX = "encoder::"


def _levels(grid) -> int:
    """Pooling levels: halve the smallest side down to 4 voxels (at most 4 levels)."""
    side, levels = min(grid), 0
    while side // 2 >= 4 and levels < 4:
        side //= 2
        levels += 1
    return max(levels, 1)


def _build_autoencoder_class():
    class AutoencoderNet(nn.Module):
        """3D convolutional autoencoder of Fay et al., Algorithm 2.

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
    (``task.learning.device.resolve_device``; None = auto)."""
    grid = tuple(int(g) for g in np.asarray(state["grid"]).reshape(-1))
    channels = tuple(int(c) for c in np.asarray(state["channels"]).reshape(-1))
    net = AutoencoderNet(int(scalar(state, "latent_dim")), grid, int(scalar(state, "classes")), channels)
    arrays_to_module(net, state, prefix=_ENCODER_PREFIX, strict=False)
    return net.to(resolve_device(device)).eval()


def encoder_arrays(net) -> dict[str, np.ndarray]:
    """Only the encoder + bottleneck weights: what hospitals need (the decoder stays on the server)."""
    return {name: value for name, value in module_to_arrays(net, _ENCODER_PREFIX).items()
            if name[len(_ENCODER_PREFIX):].split(".")[0] in ("encoder", "bottleneck")}



def verify(state: Mapping[str, np.ndarray], classes: int, grid: tuple, latent: int, scans_shape) -> float:
    """The encoder can be rebuilt from the state's arrays (a broken state is refused before any charge)."""
    try:
        autoencoder_from_state(state, "cpu")
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CodecRefused(f"codec: the autoencoder cannot be built from the state sent ({exc})") from None
    return 1.0


def sensitivity(state: Mapping[str, np.ndarray], teachers: int) -> float:
    return float(sens.unit_ball_bound(teachers))


def encoder(state: Mapping[str, np.ndarray], device=None):
    """Only the autoencoder's convolutions run on ``device`` (None = auto); every bounding step (the unit ball's
    final clip) runs in float64 on the host, so the row bound the sensitivity relies on does not depend on it."""
    net = autoencoder_from_state(state, device)   # built once for all of a hospital's teachers

    def encode(probs: np.ndarray) -> np.ndarray:
        check_finite(probs)
        with torch.no_grad():
            rows = [net.encode(torch.from_numpy(probs[i:i + 4]).to(next(net.parameters()).device)).cpu().numpy()
                    for i in range(0, len(probs), 4)]
        z = np.concatenate(rows, axis=0).astype(np.float64) if rows else np.zeros((0, latent_dim(state)))
        return clip_rows(z, 1.0)

    return encode


def stacked_encoder(state: Mapping[str, np.ndarray], device=None):
    """:func:`encoder` of T teachers' outputs at once (T, n, C, *g) -> (T, n, l): their maps through the encoder
    four at a time where they lie, then the same float64 unit-ball clip on the host."""
    net = autoencoder_from_state(state, device)

    def encode_many(probs) -> np.ndarray:
        if not bool(torch.isfinite(probs).all()):
            raise UserError("encode: teacher outputs contain NaN or infinite values")
        where = next(net.parameters()).device
        maps = probs.reshape(-1, *probs.shape[2:])
        with torch.no_grad():
            rows = [net.encode(maps[i:i + 4].to(where)) for i in range(0, len(maps), 4)]
        z = torch.cat(rows).cpu().numpy().astype(np.float64) if rows else np.zeros((0, latent_dim(state)))
        return clip_rows(z, 1.0).reshape(probs.shape[0], probs.shape[1], -1)

    return encode_many


# --------------------------------------------------------------------------------------------------
# the server's side: train the autoencoder on public maps, ship its encoder, decode
# --------------------------------------------------------------------------------------------------
#: the preset recipe's codec group (task.settings.presets.Codec): the autoencoder's latent size and epochs default to its own
DEFAULTS = Codec()


@dataclass(frozen=True)
class AutoencoderSettings:
    """What the autoencoder of Algorithm 2 is and how it is trained (public choices only; a checkpoint is reused
    only for the same settings and public maps).

    ``latent_dim``: l; ``train_sigma``: the std of the Gaussian noise added to the unit-ball bottleneck during
    training (``fit_release`` sets it to the release's sigma); ``epochs``, ``learning_rate`` (Adam), ``batch_size``;
    ``seed``: the initialisation, the batches, the flips and the bottleneck noise; ``channels``: per pooling level.
    """

    latent_dim: int = DEFAULTS.ae_latent_dim
    train_sigma: float = 0.0
    epochs: int = DEFAULTS.ae_epochs
    learning_rate: float = 2e-3
    batch_size: int = 4
    seed: int = 0
    channels: tuple = (8, 16, 32, 32)

    def __post_init__(self) -> None:
        if int(self.latent_dim) < 1:
            raise UserError(f"latent_dim: expected a positive integer, got {self.latent_dim}")
        for name, kind in (("latent_dim", int), ("train_sigma", float), ("epochs", int), ("learning_rate", float),
                           ("batch_size", int), ("seed", int), ("channels", tuple)):
            object.__setattr__(self, name, kind(getattr(self, name)))


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

    ``device`` (``task.learning.device``, None = auto): where the autoencoder trains, encodes and decodes. It stays
    in float32 whatever the run's precision: it is small, and its unit-ball output is what the sensitivity 2/K
    rests on. The bottleneck's training noise and the flips are drawn on the host from the seeded generators,
    then copied, so the trained autoencoder does not depend on where the draws would otherwise have been made.
    """

    name = "ae"

    def __init__(self, settings: AutoencoderSettings, *, checkpoint: str | Path | None = None,
                 progress: bool = False, device=None):
        self.settings = settings
        self.latent_dim = settings.latent_dim
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.progress = progress
        self.device = resolve_device(device)
        self.net = None
        self.history: list[float] = []
        self._reference: np.ndarray | None = None

    def fit_release(self, public: PublicFit, noise_per_sensitivity: float, teachers: int) -> "AutoencoderCompressor":
        """Alg. 2: the decoder learns on the noise it will see (``train_sigma`` = the release's sigma), on the
        public label maps (:meth:`PublicFit.label_maps`)."""
        self.settings = replace(self.settings, train_sigma=noise_per_sensitivity * self.sensitivity(teachers))
        maps, self.fit_counts = public.label_maps()
        return self.fit(maps)

    def release_checks(self) -> dict:
        """The collapse check (a decoder that learnt to decode everything to background; docs/PRIVACY.md)."""
        return self.collapsed()

    def _fingerprint(self, maps: np.ndarray) -> str:
        digest = hashlib.sha256(np.ascontiguousarray(maps).tobytes())
        s = self.settings
        digest.update(json.dumps([s.latent_dim, s.train_sigma, s.epochs, s.learning_rate, s.batch_size, s.seed,
                                  list(s.channels)]).encode())
        return digest.hexdigest()[:16]

    def fit(self, public_onehot: np.ndarray) -> "AutoencoderCompressor":
        maps = self._check_fit_input(public_onehot)
        self._reference = maps
        torch.manual_seed(self.settings.seed)
        self.net = AutoencoderNet(self.latent_dim, self.grid, self.classes, self.settings.channels).to(self.device)
        fingerprint = self._fingerprint(maps)
        if self.checkpoint is not None and self.checkpoint.exists():
            saved = torch.load(self.checkpoint, map_location="cpu", weights_only=False)
            if saved.get("fingerprint") == fingerprint:
                self.net.load_state_dict(saved["state_dict"])
                self.history = list(saved.get("history", []))
                self.net.eval()
                return self
        generator = torch.Generator().manual_seed(self.settings.seed)
        rng = np.random.default_rng(self.settings.seed)
        optimiser = torch.optim.Adam(self.net.parameters(), lr=self.settings.learning_rate)
        data = torch.from_numpy(maps).to(self.device)   # the public maps on the device once
        epochs = range(self.settings.epochs)
        if self.progress:
            epochs = tqdm(epochs, desc="autoencoder", leave=False)
        self.net.train()
        for _ in epochs:
            order = rng.permutation(len(maps))
            total = 0.0
            for start in range(0, len(order), self.settings.batch_size):
                batch = data[torch.from_numpy(order[start:start + self.settings.batch_size]).to(self.device)]
                flips = [axis + 2 for axis in range(len(self.grid)) if rng.random() < 0.5]
                if flips:  # public-data augmentation: mirrored label maps are plausible label maps
                    batch = torch.flip(batch, dims=flips)
                logits = self.net(batch, noise_sigma=self.settings.train_sigma, generator=generator)
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
        return float(sens.unit_ball_bound(answering_teachers(teachers)))

    def state(self) -> dict:
        self._require_fit()
        state = self._base_state("ae")
        state.update({"channels": np.array(self.net.channels, dtype=np.int64), "clip": np.array(1.0),
                      "row_bound": np.array(1.0)})
        state.update(encoder_arrays(self.net))
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
        decoded = self.decode(encode(self.state(), maps, self.device)).argmax(axis=1)
        truth = maps.argmax(axis=1)
        true_fg = int((truth > 0).sum())
        kept = int((decoded > 0).sum())
        overlap = int(((decoded > 0) & (truth > 0)).sum())
        ratio = kept / true_fg if true_fg else float("nan")
        dice = 2 * overlap / (kept + true_fg) if (kept + true_fg) else float("nan")
        return {"collapsed": bool(true_fg > 0 and (ratio < threshold or dice < threshold)),
                "foreground_ratio": ratio, "foreground_dice": dice}

    def describe(self) -> dict:
        return {"name": self.name, "latent_dim": self.latent_dim, "train_sigma": self.settings.train_sigma,
                "epochs": self.settings.epochs, "final_loss": self.history[-1] if self.history else None}


def compressor(settings: Codec, *, seed, checkpoint, progress, device=None, **options) -> AutoencoderCompressor:
    """The autoencoder compressor of a preset's codec settings (``ae_latent_dim``, ``ae_epochs``; options:
    ``latent_dim``, ``epochs``), trained with ``seed`` and checkpointed at ``checkpoint``."""
    trained = AutoencoderSettings(options.get("latent_dim", settings.ae_latent_dim),
                                  epochs=options.get("epochs", settings.ae_epochs), seed=seed)
    return AutoencoderCompressor(trained, checkpoint=checkpoint, progress=progress, device=device)


AE = register_codec(CodecKind("ae", verify, sensitivity, encoder, zero_rows, compressor=compressor,
                                stacked_encoder=stacked_encoder))
