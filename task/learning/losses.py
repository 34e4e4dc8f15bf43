"""The segmentation loss every training path and the voxel head's per-sample gradients share.

Per sample, so that per-sample clipping (Opacus' DP-SGD, the secure head gradients) stays valid -- a
batch-coupled loss would break it: ``L_i = Dice_i + CE_i``, where ``Dice_i`` is MONAI's soft Dice loss over the
four classes of sample i (``DiceLoss(softmax=True, batch=False)``) and ``CE_i`` the voxel-mean cross-entropy of
sample i. This is MONAI's ``DiceCELoss`` with ``batch=False``, written out because ``DiceCELoss`` cannot return
per-sample values. ``task.learning.training`` (the training loop) and ``task.learning.headgrad`` (per-patient head gradients)
both import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Dice + CE for each sample (shape (n,)); ``targets`` int (n, *g) or probabilities (n, C, *g)."""
    # MONAI (~10 s to import) only when a loss is built
    from monai.losses import DiceLoss

    n, classes = logits.shape[:2]
    if targets.is_floating_point():
        if targets.shape != logits.shape:
            raise ValueError(f"soft targets must be shaped like the logits {tuple(logits.shape)}, got {tuple(targets.shape)}")
        probs_target = targets
        ce = -(probs_target * F.log_softmax(logits, dim=1)).sum(dim=1)
    else:
        probs_target = F.one_hot(targets.long(), classes).movedim(-1, 1).to(logits.dtype)
        ce = F.cross_entropy(logits, targets.long(), reduction="none")
    dice = DiceLoss(softmax=True, batch=False, reduction="none")(logits, probs_target)
    return dice.reshape(n, -1).mean(dim=1) + ce.reshape(n, -1).mean(dim=1)
