"""Per-patient gradients of a voxel head on a frozen U-Net, from cached features.

:class:`task.learning.networks.VoxelHeadUNet` computes ``logits = u(x) + head([u(x), x])``. When only the head is
trained, ``u`` is frozen, so ``[u(x), x]`` is a fixed function of the scan -- provided ``u`` is
deterministic in the mode DP-SGD trains in (``train()``): no dropout with a positive rate, and no
normalisation that keeps running statistics (a BatchNorm in training mode would normalise with the batch's
statistics and couple the patients). The quick and tiny U-Nets use instance normalisation without running
statistics and dropout 0 (``task.learning.networks.network_config``); :func:`check_frozen_deterministic` refuses any
other. Then the features can be computed once per scan (:func:`frozen_features`) and every later gradient
step runs the 213-parameter head only.

The per-sample gradients (:func:`per_sample_head_gradients`) are those of the training loop's per-sample
Dice + cross-entropy (``task.learning.training.per_sample_loss``), the loss pooled DP-SGD clips per sample;
tests/test_fedavg_secure.py checks that the cached gradients equal the ones computed by autograd through the
whole network.

A patient with several scans contributes the gradient of the mean of its scans' losses (one row per
patient: the unit of privacy, docs/PRIVACY.md "The unit of privacy"); each row is then clipped to an L2 norm ``clip`` exactly as
Opacus' flat clipping does (factor ``min(1, clip / (norm + 1e-6))``).
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import numpy as np
import torch

from task.errors import UserError
from task.learning.losses import per_sample_loss
from task.learning.networks import VoxelHeadUNet

#: Opacus' flat clipping adds this to the norm before dividing (``DPOptimizer.clip_and_accumulate``)
CLIP_EPSILON = 1e-6



def check_frozen_deterministic(model: torch.nn.Module) -> None:
    """UserError unless the frozen U-Net under a voxel head computes the same features in train and eval mode
    and per sample: no dropout with a positive rate, no normalisation with running statistics."""
    if not isinstance(model, VoxelHeadUNet):
        raise UserError("cached head gradients: the network has no voxel head (task.learning.networks.VoxelHeadUNet)")
    check_unet_deterministic(model.model)


def check_unet_deterministic(unet: torch.nn.Module) -> None:
    """:func:`check_frozen_deterministic` of the U-Net (the module tree under a voxel head) itself."""
    for name, module in unet.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            raise UserError(f"cached head gradients: {name} is a dropout with rate {module.p}; the frozen features "
                            "would differ between steps")
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and (
                module.track_running_stats or isinstance(module, torch.nn.modules.batchnorm._BatchNorm)):
            raise UserError(f"cached head gradients: {name} normalises with batch or running statistics; the frozen "
                            "features would depend on the batch")


def head_parameter_names(model: torch.nn.Module) -> list[str]:
    """The voxel head's parameter names (``voxel_head.*``), in the order every flat gradient uses."""
    names = [name for name, _ in model.named_parameters() if name.startswith("voxel_head.")]
    if not names:
        raise UserError("cached head gradients: the network has no voxel head")
    return names


def head_dimension(model: torch.nn.Module) -> int:
    """Number of trained coordinates (213 on the quick U-Net's 4 classes)."""
    parameters = dict(model.named_parameters())
    return int(sum(parameters[name].numel() for name in head_parameter_names(model)))


def head_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The head's parameters as float32 arrays (what the server sends each step)."""
    parameters = dict(model.named_parameters())
    return {name: parameters[name].detach().cpu().numpy().astype(np.float32) for name in head_parameter_names(model)}


def load_head_state(model: torch.nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Set the head's parameters from ``state`` (UserError on a missing, extra, misshapen or non-finite one)."""
    parameters = dict(model.named_parameters())
    names = head_parameter_names(model)
    if sorted(state) != sorted(names):
        raise UserError(f"head weights: expected {names}, got {sorted(state)}")
    with torch.no_grad():
        for name in names:
            value = np.asarray(state[name], dtype=np.float32)
            if value.shape != tuple(parameters[name].shape) or not np.all(np.isfinite(value)):
                raise UserError(f"head weights: {name} must be finite with shape {tuple(parameters[name].shape)}")
            parameters[name].copy_(torch.from_numpy(value))


def unflatten(model: torch.nn.Module, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """A flat vector (in :func:`head_parameter_names` order) as one tensor per head parameter."""
    parameters = dict(model.named_parameters())
    flat = np.asarray(flat, dtype=np.float64).reshape(-1)
    out, at = {}, 0
    for name in head_parameter_names(model):
        shape = tuple(parameters[name].shape)
        size = int(np.prod(shape))
        out[name] = torch.from_numpy(flat[at:at + size].reshape(shape).astype(np.float32))
        at += size
    if at != len(flat):
        raise UserError(f"head gradient: {len(flat)} coordinates for a head of {at}")
    return out


def state_digest(state: Mapping[str, np.ndarray | torch.Tensor]) -> str:
    """SHA-256 over the names, shapes and float32 bytes of a state dict (sorted by name): which start model."""
    digest = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        array = np.ascontiguousarray(array.astype(np.float32))
        digest.update(name.encode() + b"\0" + str(array.shape).encode() + b"\0" + array.tobytes())
    return digest.hexdigest()


@torch.no_grad()
def frozen_features(model: VoxelHeadUNet, images, batch_size: int = 4, device=None) -> torch.Tensor:
    """``[u(x), x]`` for every scan (n, C + channels, *grid), float32, computed in training mode as DP-SGD
    runs the network (:func:`check_frozen_deterministic` first), on ``device`` (None: where the model is)."""
    check_frozen_deterministic(model)
    device = next(model.parameters()).device if device is None else torch.device(device)
    model.to(device)
    was_training = model.training
    model.train()
    x_all = torch.as_tensor(np.asarray(images, dtype=np.float32))
    parts = []
    for start in range(0, len(x_all), int(batch_size)):
        x = x_all[start:start + int(batch_size)].to(device)
        parts.append(torch.cat([model.model(x).float(), x], dim=1))
    model.train(was_training)
    return torch.cat(parts) if parts else torch.zeros((0,), device=device)


def _head_layers(model: VoxelHeadUNet):
    """The head's three layers (1x1x1 convolution, one-slope PReLU, 1x1x1 convolution), checked."""
    head = model.voxel_head
    ok = (len(head) == 3 and isinstance(head[0], torch.nn.Conv3d) and isinstance(head[1], torch.nn.PReLU)
          and isinstance(head[2], torch.nn.Conv3d) and head[1].weight.numel() == 1
          and all(tuple(head[i].kernel_size) == (1, 1, 1) and head[i].bias is not None for i in (0, 2)))
    if not ok:
        raise UserError("cached head gradients: expected the voxel head of task.learning.networks.voxel_head "
                        "(1x1x1 convolution, PReLU with one slope, 1x1x1 convolution)")
    return head[0], head[1], head[2]


def per_sample_head_gradients(model: VoxelHeadUNet, features: torch.Tensor, targets, chunk: int = 16,
                              loss_fn=None) -> np.ndarray:
    """(n, d) float64: the gradient of each scan's loss with respect to the head's parameters (flattened in
    :func:`head_parameter_names` order) at the model's current head, from the cached ``features``.

    How: the head's 1x1x1 convolutions are per-voxel matrix products, so each scan gets its own copy of the
    head's parameters (expanded along a batch axis) and one backward pass of the summed per-sample losses
    gives every copy its own scan's gradient (the per-example-parameter construction behind Opacus' and
    functorch's per-sample gradients; batched matrix products instead of 3D convolutions, several times
    faster on a CPU). tests/test_fedavg_secure.py checks it against plain autograd through the whole network.

    ``targets``: (n, *grid) int labels; ``chunk``: scans per pass; ``loss_fn``: per-sample loss
    (default ``task.learning.losses.per_sample_loss``)."""
    loss_fn = loss_fn or per_sample_loss
    first, prelu, second = _head_layers(model)
    hidden, inputs = first.weight.shape[:2]
    classes = second.weight.shape[0]
    base = [first.weight.detach().reshape(hidden, inputs), first.bias.detach(), prelu.weight.detach().reshape(1),
            second.weight.detach().reshape(classes, hidden), second.bias.detach()]
    y_all = torch.as_tensor(np.asarray(targets)).long()
    rows = []
    for start in range(0, len(features), int(chunk)):
        f = features[start:start + int(chunk)].float()
        n, grid = len(f), f.shape[2:]
        y = y_all[start:start + int(chunk)].to(f.device)
        copies = [value.to(f.device).unsqueeze(0).repeat(n, *([1] * value.dim())).requires_grad_(True)
                  for value in base]
        w1, b1, slope, w2, b2 = copies
        flat = f.reshape(n, inputs, -1)
        pre = torch.bmm(w1, flat) + b1.unsqueeze(-1)
        act = torch.where(pre >= 0, pre, slope.unsqueeze(-1) * pre)
        logits = flat[:, :classes] + torch.bmm(w2, act) + b2.unsqueeze(-1)
        loss = loss_fn(logits.reshape(n, classes, *grid), y).sum()
        grads = torch.autograd.grad(loss, copies)
        rows.append(torch.cat([g.reshape(n, -1) for g in grads], dim=1).detach().cpu().double().numpy())
    return np.concatenate(rows) if rows else np.zeros((0, head_dimension(model)))


def per_patient_rows(per_scan: np.ndarray, patients: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """One row per patient: the mean of its scans' gradients (the gradient of its mean loss), in first-seen
    order; returns ``(rows, patient names)``."""
    order: dict[str, list[int]] = {}
    for index, patient in enumerate(patients):
        order.setdefault(str(patient), []).append(index)
    if len(patients) != len(per_scan):
        raise UserError(f"per-patient gradients: {len(per_scan)} scans but {len(patients)} patient names")
    rows = np.stack([per_scan[indices].mean(axis=0) for indices in order.values()]) if order else per_scan[:0]
    return rows, list(order)


def clip_rows(rows: np.ndarray, clip: float) -> np.ndarray:
    """Each row scaled to L2 norm at most ``clip`` (Opacus' flat clipping: ``min(1, clip / (norm + 1e-6))``)."""
    rows = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows * np.minimum(1.0, float(clip) / (norms + CLIP_EPSILON))
