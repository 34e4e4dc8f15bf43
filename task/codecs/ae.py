"""Autoencoded PATE's codec (Fay et al., Algorithm 2): ``z = phi(f_enc(y))`` with the unit-ball
activation :func:`task.codecs.core.unit_ball`; the autoencoder network both sides build, and the hospital side
of the codec (the server's :class:`server.compressors.AutoencoderCompressor` trains it on public maps and ships
only the encoder's weights).

Sensitivity (replace-one): ``||phi(.)|| <= 1`` for every input (Proposition 2), so one teacher's row moves by at
most 2 and the mean of K rows by 2/K; the encoder clips rows to 1 again after float rounding.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

from privacy import sensitivity as sens
from task.codecs.core import (CodecKind, CodecRefused, check_finite, clip_rows, latent_dim, register_codec, scalar,
                             unit_ball, zero_rows)
from task.device import resolve_device
from task.errors import UserError

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
    (``task.device.resolve_device``; None = auto)."""
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


AE = register_codec(CodecKind("ae", verify, sensitivity, encoder, zero_rows))
