"""3D U-Nets for brain-tumour segmentation (MONAI), built so Opacus can train them with DP-SGD.

The seed paper (Fay et al., ``../shared/papers/004_*``, Sec. 5) uses a 3D U-Net on 64^3 patches with four
pooling levels for teachers, student and the DP-SGD baseline alike; ``paper`` reproduces that depth.
``tiny`` and ``small`` are CPU-sized versions for 16^3 and 32^3/48^3 grids.

Opacus compatibility (../shared/FIELD_NOTES.md, "Opacus with MONAI networks"): instance normalisation
(no BatchNorm, whose statistics couple the samples of a batch and break per-sample gradients), PReLU
activations without in-place ops, and no custom ``autograd.Function``. ``tests/test_training_networks.py``
runs ``opacus.validators.ModuleValidator`` on every preset.
"""

from __future__ import annotations

from typing import Any

import torch

from sim.errors import UserError

#: name -> MONAI UNet (channels, strides). Each stride 2 is one pooling level.
UNET_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"channels": (8, 16, 32), "strides": (2, 2), "num_res_units": 1},               # 16^3
    "small": {"channels": (8, 16, 32, 64), "strides": (2, 2, 2), "num_res_units": 1},        # 32^3, 48^3
    "paper": {"channels": (16, 32, 64, 128, 256), "strides": (2, 2, 2, 2), "num_res_units": 1},  # 64^3
}


def network_config(preset: str, in_channels: int = 4, out_channels: int = 4) -> dict[str, Any]:
    """A JSON-able description of the network, saved in model bundles (``build_unet_from_config``)."""
    if preset not in UNET_PRESETS:
        raise UserError(f"unet preset: unknown {preset!r}; expected one of {', '.join(UNET_PRESETS)}")
    spec = UNET_PRESETS[preset]
    return {
        "architecture": "monai.networks.nets.UNet",
        "preset": preset,
        "spatial_dims": 3,
        "in_channels": int(in_channels),
        "out_channels": int(out_channels),
        "channels": list(spec["channels"]),
        "strides": list(spec["strides"]),
        "num_res_units": int(spec["num_res_units"]),
        "norm": "instance",
        "act": "PRELU",
        "dropout": 0.0,
    }


def build_unet_from_config(cfg: dict[str, Any]) -> torch.nn.Module:
    """Rebuild the network described by ``network_config`` (weights are loaded separately)."""
    # MONAI (~10 s to import) only when a network is built: reading a network config stays light
    from monai.networks.nets import UNet

    if cfg.get("architecture", "monai.networks.nets.UNet") != "monai.networks.nets.UNet":
        raise UserError(f"network_config: unsupported architecture {cfg.get('architecture')!r}")
    try:
        return UNet(
            spatial_dims=int(cfg.get("spatial_dims", 3)),
            in_channels=int(cfg["in_channels"]),
            out_channels=int(cfg["out_channels"]),
            channels=tuple(int(c) for c in cfg["channels"]),
            strides=tuple(int(s) for s in cfg["strides"]),
            num_res_units=int(cfg.get("num_res_units", 1)),
            norm=cfg.get("norm", "instance"),
            act=cfg.get("act", "PRELU"),
            dropout=float(cfg.get("dropout", 0.0)),
        )
    except KeyError as exc:
        raise UserError(f"network_config: missing key {exc.args[0]!r}") from None


def build_unet(preset: str, in_channels: int = 4, out_channels: int = 4) -> torch.nn.Module:
    """MONAI 3D UNet of the named size, instance norm, Opacus-compatible (``UNET_PRESETS``)."""
    return build_unet_from_config(network_config(preset, in_channels, out_channels))


def min_grid_divisor(preset: str) -> int:
    """Each grid side must be a multiple of this (2 ** pooling levels)."""
    out = 1
    for stride in UNET_PRESETS[preset]["strides"]:
        out *= stride
    return out
