"""3D U-Nets for brain-tumour segmentation (MONAI), built so Opacus can train them with DP-SGD.

The seed paper (Fay, Sjölund & Oechtering, *Private Learning for High-Dimensional Targets with PATE*, Sec. 5) uses a
3D U-Net on 64^3 patches with four pooling levels for teachers, student and the DP-SGD baseline alike; ``paper``
reproduces that depth. ``tiny`` and ``small`` are CPU-sized versions for 16^3 and 32^3/48^3 grids.

Opacus compatibility (MONAI's UNet with instance normalisation passes Opacus' ModuleValidator as is): instance
normalisation (no BatchNorm, whose statistics couple the samples of a batch and break per-sample gradients), PReLU
activations without in-place ops, and no custom ``autograd.Function``. ``tests/test_training_networks.py`` runs
``opacus.validators.ModuleValidator`` on every preset.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from task.errors import UserError
from task.options import Trainable, look_up_option

#: name -> MONAI UNet (channels, strides). Each stride 2 is one pooling level.
UNET_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"channels": (8, 16, 32), "strides": (2, 2), "num_res_units": 1},               # 16^3
    "small": {"channels": (8, 16, 32, 64), "strides": (2, 2, 2), "num_res_units": 1},        # 32^3, 48^3
    "paper": {"channels": (16, 32, 64, 128, 256), "strides": (2, 2, 2, 2), "num_res_units": 1},  # 64^3
}


def network_config(preset: str, in_channels: int = 4, out_channels: int = 4,
                   trainable: Trainable = Trainable.ALL) -> dict[str, Any]:
    """A JSON-able description of the network, saved in model bundles (``build_unet_from_config``).
    ``trainable="voxel-head"`` describes the U-Net with a :class:`VoxelHeadUNet` head (``voxel_head_hidden``);
    every other trainable set trains parameters the U-Net already has."""
    if preset not in UNET_PRESETS:
        raise UserError(f"unet preset: unknown {preset!r}; expected one of {', '.join(UNET_PRESETS)}")
    spec = UNET_PRESETS[preset]
    head = {"voxel_head_hidden": VOXEL_HEAD_HIDDEN} if trainable in WITH_VOXEL_HEAD else {}
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
        **head,
    }


def build_unet_from_config(cfg: dict[str, Any]) -> torch.nn.Module:
    """Rebuild the network described by ``network_config`` (weights are loaded separately)."""
    # MONAI (~10 s to import) only when a network is built: reading a network config stays light
    from monai.networks.nets import UNet

    if cfg.get("architecture", "monai.networks.nets.UNet") != "monai.networks.nets.UNet":
        raise UserError(f"network_config: unsupported architecture {cfg.get('architecture')!r}")
    try:
        unet = UNet(
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
    hidden = cfg.get("voxel_head_hidden")
    return VoxelHeadUNet(unet, int(cfg["in_channels"]), int(cfg["out_channels"]), int(hidden)) if hidden else unet


def build_unet(preset: str, in_channels: int = 4, out_channels: int = 4,
               trainable: Trainable = Trainable.ALL) -> torch.nn.Module:
    """MONAI 3D UNet of the named size, instance norm, Opacus-compatible (``UNET_PRESETS``); with
    ``trainable="voxel-head"`` the U-Net carries a :class:`VoxelHeadUNet` head."""
    return build_unet_from_config(network_config(preset, in_channels, out_channels, trainable))


# ------------------------------------------------------------------------------------------- the voxel head
#: the trainable set that adds a voxel head to the network (the others choose among the U-Net's own weights)
VOXEL_HEAD = Trainable.VOXEL_HEAD
#: the trainable set that trains a voxel head together with every U-Net weight under it (fine-tuning after the
#: head was fitted: "LP-FT", Kumar et al. 2022, arXiv 2202.10054)
VOXEL_HEAD_AND_UNET = Trainable.VOXEL_HEAD_AND_UNET
#: the trainable sets whose network carries a voxel head
WITH_VOXEL_HEAD = (VOXEL_HEAD, VOXEL_HEAD_AND_UNET)
#: hidden units of the voxel head: twice its 8 inputs (4 logits + 4 sequences) -- a stated size, not tuned
VOXEL_HEAD_HIDDEN = 16


def voxel_head(in_channels: int, out_channels: int, hidden: int = VOXEL_HEAD_HIDDEN) -> torch.nn.Sequential:
    """``W2 PReLU(W1 [scores, x] + b1) + b2`` as 1x1x1 convolutions on ``out_channels`` class scores followed by
    ``in_channels`` sequences, with ``W2 = b2 = 0``: added to the scores, it starts as no change at all. Used by
    :class:`VoxelHeadUNet` and by the anchored codec's head-fit decoder (``task.codecs.headfit``)."""
    head = torch.nn.Sequential(
        torch.nn.Conv3d(in_channels + out_channels, hidden, kernel_size=1), torch.nn.PReLU(),
        torch.nn.Conv3d(hidden, out_channels, kernel_size=1))
    torch.nn.init.zeros_(head[2].weight)
    torch.nn.init.zeros_(head[2].bias)
    return head


class VoxelHeadUNet(torch.nn.Module):
    """A U-Net plus a small per-voxel head that corrects its logits from the logits and the scan itself:

        logits(x) = u(x) + W2 PReLU(W1 [u(x), x] + b1) + b2        (1x1x1 convolutions; W2, b2 start at 0)

    Why (docs/decisions/dp-sgd-voxel-head.md): under DP-SGD the noise added to the trained coordinates has a norm that
    grows with the square root of their number, so a small model on good fixed features learns more at a given epsilon
    than end-to-end fine-tuning (Tramer & Boneh 2021, "Differentially private learning needs better features", arXiv
    2011.11660; Tobaben et al. 2023, arXiv 2302.01190, for parameter-efficient private transfer). Here the fixed
    features are the public model's own class scores and the four MR sequences: a class the public model never
    predicts (non-enhancing core inside an enhancing rim) is still a per-voxel function of what it does predict there
    and of the voxel's intensities. 8*16+16 + 16*4+4 = 212 parameters + 1 PReLU slope on the quick U-Net's 4 classes,
    against its 153k.

    ``W2, b2 = 0`` at construction, so the network starts as exactly the U-Net it wraps (the public model).
    The U-Net's parameters keep their names (``model.*``, as in a bare MONAI UNet), so a U-Net state dict loads
    into ``self.model`` by :func:`load_start_weights`; the head's are ``voxel_head.*``.
    """

    def __init__(self, unet: torch.nn.Module, in_channels: int, out_channels: int, hidden: int) -> None:
        super().__init__()
        self.model = unet.model           # the MONAI UNet's own module tree: its state-dict keys unchanged
        self.voxel_head = voxel_head(in_channels, out_channels, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return corrected_logits(self.voxel_head, self.model(x), x)


def corrected_logits(head: torch.nn.Module, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A voxel head's correction added to the U-Net's ``logits`` on the scan ``x``: :class:`VoxelHeadUNet`'s output,
    for callers that computed ``logits`` once (several heads on the same U-Net: :class:`StackedVoxelHeads`)."""
    return logits + head(torch.cat([logits, x], dim=1))


#: a voxel head's parameter names (:func:`voxel_head` inside :class:`VoxelHeadUNet`), in :class:`StackedVoxelHeads`' order
VOXEL_HEAD_NAMES = ("voxel_head.0.weight", "voxel_head.0.bias", "voxel_head.1.weight", "voxel_head.2.weight",
                    "voxel_head.2.bias")


class StackedVoxelHeads(torch.nn.Module):
    """K voxel heads (:func:`voxel_head`) held as stacked parameters: teacher k's head is slice k of each.

    Why: a hospital's voxel-head teachers share the frozen public U-Net and differ only in their 213-weight heads,
    so K heads evaluated as K separate 1x1x1 convolutions are K x (a few dozen) tiny kernels per step; as batched
    matrix products over the stacked weights they are a handful (the per-example-parameter trick of
    :func:`task.learning.headgrad.per_sample_head_gradients`, here one copy per teacher). Each head's output depends on its
    own slice only, so gradients of a sum of per-teacher losses are each teacher's own, and the arithmetic is the
    convolutions' (``W2 PReLU(W1 f + b1) + b2`` per voxel) in another summation order.

    ``first_weight`` (K, hidden, inputs), ``first_bias`` (K, hidden), ``slope`` (K,), ``second_weight``
    (K, classes, hidden), ``second_bias`` (K, classes); ``inputs`` = classes + the scan's channels.
    """

    def __init__(self, count: int, in_channels: int, out_channels: int, hidden: int = VOXEL_HEAD_HIDDEN) -> None:
        super().__init__()
        inputs = int(in_channels) + int(out_channels)
        self.classes = int(out_channels)
        self.first_weight = torch.nn.Parameter(torch.zeros(count, hidden, inputs))
        self.first_bias = torch.nn.Parameter(torch.zeros(count, hidden))
        self.slope = torch.nn.Parameter(torch.zeros(count))
        self.second_weight = torch.nn.Parameter(torch.zeros(count, out_channels, hidden))
        self.second_bias = torch.nn.Parameter(torch.zeros(count, out_channels))

    def __len__(self) -> int:
        return int(self.first_weight.shape[0])

    @classmethod
    def from_heads(cls, heads: Sequence[torch.nn.Module]) -> "StackedVoxelHeads":
        """The heads (each a :func:`voxel_head`) stacked in order, with their current values."""
        if not heads:
            raise UserError("stacked voxel heads: no heads to stack")
        first, second = heads[0][0], heads[0][2]
        stacked = cls(len(heads), first.in_channels - second.out_channels, second.out_channels, first.out_channels)
        stacked.load_head_states([{name: value for name, value in zip(VOXEL_HEAD_NAMES, _head_values(h))}
                                  for h in heads])
        return stacked.to(first.weight.device)

    @torch.no_grad()
    def load_head_states(self, states: Sequence[dict]) -> None:
        """Set every head from a :class:`VoxelHeadUNet` state's ``voxel_head.*`` entries (one dict per head)."""
        if len(states) != len(self):
            raise UserError(f"stacked voxel heads: {len(states)} head states for {len(self)} heads")
        for parameter, name in zip(self.parameters(), VOXEL_HEAD_NAMES):
            parameter.copy_(torch.stack([torch.as_tensor(state[name]).reshape(parameter.shape[1:])
                                         for state in states]))

    def subset(self, indices: Sequence[int]) -> "StackedVoxelHeads":
        """The heads ``indices``, in that order, as a stack of their own (copies, on the same device)."""
        hidden, inputs = self.first_weight.shape[1:]
        part = StackedVoxelHeads(len(indices), inputs - self.classes, self.classes, hidden).to(self.first_weight.device)
        chosen = torch.as_tensor(list(indices), dtype=torch.long, device=self.first_weight.device)
        with torch.no_grad():
            for mine, theirs in zip(part.parameters(), self.parameters()):
                mine.copy_(theirs[chosen])
        return part

    def head_state(self, k: int) -> dict[str, torch.Tensor]:
        """Head ``k`` as a :class:`VoxelHeadUNet`'s ``voxel_head.*`` state entries (its convolutions' shapes)."""
        hidden, inputs = self.first_weight.shape[1:]
        shapes = ((hidden, inputs, 1, 1, 1), (hidden,), (1,), (self.classes, hidden, 1, 1, 1), (self.classes,))
        return {name: parameter[k].detach().reshape(shape).clone()
                for name, parameter, shape in zip(VOXEL_HEAD_NAMES, self.parameters(), shapes)}

    def stacked_state(self) -> dict[str, torch.Tensor]:
        """Every head's ``voxel_head.*`` entries stacked along a leading axis (what a hospital saves)."""
        states = [self.head_state(k) for k in range(len(self))]
        return {name: torch.stack([state[name] for state in states]).cpu() for name in VOXEL_HEAD_NAMES}

    def corrections(self, features: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Each sample's correction of its class scores under its own head: ``features`` (S, inputs, V), ``heads``
        (S,) the head of each sample; (S, classes, V). Gradients reach each head's slice from its own samples only
        (the per-example-parameter construction of :func:`task.learning.headgrad.per_sample_head_gradients`)."""
        hidden = torch.baddbmm(self.first_bias[heads].unsqueeze(-1), self.first_weight[heads], features)
        active = _prelu(hidden, self.slope[heads])
        return torch.baddbmm(self.second_bias[heads].unsqueeze(-1), self.second_weight[heads], active)

    def shared_corrections(self, features: torch.Tensor) -> torch.Tensor:
        """Every head's correction from the same ``features`` (m, inputs, V): (K, m, classes, V)."""
        m, inputs, voxels = features.shape
        flat = features.transpose(0, 1).reshape(inputs, m * voxels)
        count, hidden_units = self.first_weight.shape[:2]
        hidden = torch.addmm(self.first_bias.reshape(-1, 1), self.first_weight.reshape(count * hidden_units, inputs),
                             flat).view(count, hidden_units, -1)
        out = torch.baddbmm(self.second_bias.unsqueeze(-1), self.second_weight, _prelu(hidden, self.slope))
        return out.view(count, self.classes, m, voxels).transpose(1, 2)

    def forward(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """:func:`corrected_logits` of every head on the same U-Net ``logits`` (m, C, *g) and scans ``x``:
        (K, m, C, *g)."""
        features = torch.cat([logits, x], dim=1).flatten(2)
        scores = logits.flatten(2).unsqueeze(0) + self.shared_corrections(features)
        return scores.reshape(len(self), *logits.shape)


def _prelu(hidden: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """PReLU of ``hidden[i]`` (n, ...) with the slope ``slopes[i]``: ``x`` where ``x > 0``, else ``slope x``. Written
    as ``x + (1 - slope) relu(-x)``: torch's PReLU takes one slope per channel, not per head, and ``torch.where``
    was several times slower on a CPU (the gradient at exactly 0 is 1, not the slope: a set of measure zero)."""
    return hidden + (1.0 - slopes).view(-1, *(1,) * (hidden.dim() - 1)) * torch.relu(-hidden)


def _head_values(head: torch.nn.Module) -> list[torch.Tensor]:
    first, prelu, second = head[0], head[1], head[2]
    return [first.weight.detach(), first.bias.detach(), prelu.weight.detach(), second.weight.detach(),
            second.bias.detach()]


def network_config_of(model: torch.nn.Module, preset: str) -> dict[str, Any]:
    """``network_config`` of a trained ``preset`` network: with the voxel head when ``model`` has one."""
    return network_config(preset, trainable=VOXEL_HEAD if isinstance(model, VoxelHeadUNet) else Trainable.ALL)


def load_start_weights(model: torch.nn.Module, state: dict) -> None:
    """Load ``state`` into ``model`` strictly -- except that a bare U-Net's state (the public model) may start a
    :class:`VoxelHeadUNet`, whose head then keeps its construction values (the identity correction)."""
    if isinstance(model, VoxelHeadUNet) and not any(key.startswith("voxel_head.") for key in state):
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:   # shapes that differ (another U-Net size) fail even when not strict
            raise UserError(f"start weights do not fit the U-Net under the voxel head: {str(exc).splitlines()[-1].strip()}") from None
        if unexpected or any(not key.startswith("voxel_head.") for key in missing):
            raise UserError(f"start weights do not fit the U-Net under the voxel head: missing "
                            f"{[k for k in missing if not k.startswith('voxel_head.')][:3]}, unexpected {unexpected[:3]}")
        return
    model.load_state_dict(state)


def min_grid_divisor(preset: str) -> int:
    """Each grid side must be a multiple of this (2 ** pooling levels)."""
    out = 1
    for stride in UNET_PRESETS[preset]["strides"]:
        out *= stride
    return out


# ----------------------------------------------------------------------------------- trainable parameter sets
#: which of a MONAI UNet's parameters private fine-tuning trains. Fixed by a stated principle,
#: never by test Dice: DP noise is added to every trained coordinate, so its norm grows with the square root
#: of the number trained (Yu et al. 2021, arXiv 2110.06500; Tobaben et al. 2023, arXiv 2302.01190), while a
#: class the public model does not know needs weights between the features and the classes, not biases
#: alone (measured: biases and PReLU slopes alone reach 0.432 without noise on the quick world).
TRAINABLE_SETS: dict[Trainable, str] = {
    Trainable.ALL: "every parameter (full fine-tuning; the default)",
    Trainable.DECODER: "every up-sampling stage and the output block: the public encoder's features are kept, the "
               "path from the bottleneck to the classes is learnt",
    Trainable.HEAD: "the two stages nearest the output (the output block and the up-sampling stage before it): "
            "the fewest weights that can still place a new class",
    Trainable.BIAS: "biases and PReLU slopes only (DP-BiTFiT, Bu et al. 2022, arXiv 2210.00036)",
    Trainable.VOXEL_HEAD: "a new per-voxel head on the frozen public model's class scores and the scan (VoxelHeadUNet; "
                  "Tramer & Boneh 2021): 213 parameters, every U-Net weight kept",
    Trainable.VOXEL_HEAD_AND_UNET: "a voxel head and every U-Net weight under it: fine-tuning a network whose head "
                                   "was fitted first (linear probing then fine-tuning, Kumar et al. 2022, "
                                   "arXiv 2202.10054)",
}


def _up_stage_depth(name: str) -> int | None:
    """How far from the output an up-sampling stage of a MONAI UNet is (0 = the output block), or None for an
    encoder / bottleneck parameter. MONAI nests ``Sequential(down, SkipConnection(submodule), up)``: a
    parameter under index 2 of a ``model`` / ``submodule`` Sequential belongs to that level's up stage."""
    parts = name.split(".")
    depth = 0
    for index, part in enumerate(parts[:-1]):
        if part == "submodule":
            depth += 1
        if part in ("model", "submodule") and parts[index + 1] == "2":
            return depth
    return None


def trainable_parameter_names(model: torch.nn.Module, which: Trainable = Trainable.ALL) -> set[str]:
    """Names of the parameters ``which`` (a key of :data:`TRAINABLE_SETS`) trains; UserError otherwise."""
    which = look_up_option(which, Trainable, "trainable")
    names = [name for name, _ in model.named_parameters()]
    if which is VOXEL_HEAD_AND_UNET and not any(n.startswith("voxel_head.") for n in names):
        raise UserError("trainable 'voxel-head+all': the network has no voxel head (build it with "
                        "build_unet(..., trainable='voxel-head+all'))")
    if which in (Trainable.ALL, VOXEL_HEAD_AND_UNET):
        return set(names)
    if which is VOXEL_HEAD:
        chosen = {n for n in names if n.startswith("voxel_head.")}
        if not chosen:
            raise UserError("trainable 'voxel-head': the network has no voxel head (build it with "
                            "build_unet(..., trainable='voxel-head'))")
        return chosen
    if which is Trainable.BIAS:
        return {n for n in names if n.endswith(".bias") or ".adn.A." in n}
    limit = 1 if which is Trainable.HEAD else None
    chosen = set()
    for name in names:
        depth = _up_stage_depth(name)
        if depth is not None and (limit is None or depth <= limit):
            chosen.add(name)
    if not chosen:
        raise UserError(f"trainable {which!r}: the network has no such parameters (not a MONAI UNet?)")
    return chosen


def freeze_all_but(model: torch.nn.Module, which: Trainable = Trainable.ALL) -> int:
    """Set ``requires_grad`` from the trainable set ``which``; returns how many scalars are trained. Frozen
    parameters get no gradient, so DP-SGD neither clips nor noises them (Opacus only handles parameters that
    require a gradient): the noise lands on exactly what is trained."""
    keep = trainable_parameter_names(model, which)
    count = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in keep)
        count += parameter.numel() if name in keep else 0
    return count
