"""Segmentation metrics: Dice per tumour class and per BraTS region, computed with MONAI.

Classes follow MSD Task01 (0 background, 1 oedema, 2 non-enhancing tumour, 3 enhancing tumour).
Regions (BraTS): WT = {1, 2, 3} (whole tumour), TC = {2, 3} (tumour core), ET = {3} (enhancing tumour).
``"mean"`` is the mean over classes 1, 2, 3 of the per-class Dice -- the figure Fay et al.
(Sec. 5) report (0.561 for Autoencoded PATE at (8, 1e-3)).

Empty-class convention (one rule for classes and regions):

* Per case and per class, Dice = 2|P∩T| / (|P| + |T|) from ``monai.metrics.compute_dice`` on one-hot maps.
* A case where **both** the prediction and the truth are empty for that class is *excluded* from that
  class's average (it carries no information; scoring it 1 would reward predicting nothing on small
  structures). This is MONAI's ``ignore_empty`` idea, restricted to the both-empty case.
* A case where the truth is empty but the prediction is not scores **0** (false positives are punished;
  MONAI's ``ignore_empty=True`` would drop it instead).
* A class that is excluded in every case is reported as ``None`` (JSON ``null``), never NaN. ``"mean"``
  averages the classes that are not ``None``, and is ``None`` only if all three are.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

CLASSES = ("1", "2", "3")
REGIONS = {"WT": (1, 2, 3), "TC": (2, 3), "ET": (3,)}
DICE_KEYS = ("1", "2", "3", "mean", "WT", "TC", "ET")


def _as_label_tensor(x: Any) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    if t.is_floating_point():
        raise ValueError("dice: expected integer label maps (n, *grid), got floating point; take argmax first")
    return t.long()


def _case_dice(binary_pred: torch.Tensor, binary_true: torch.Tensor) -> np.ndarray:
    """Per-case, per-channel Dice (n, c) with both-empty entries set to NaN (see module docstring)."""
    # MONAI (~10 s to import) only when Dice is computed
    from monai.metrics import compute_dice

    pred_f = binary_pred.float()
    true_f = binary_true.float()
    # ignore_empty=False: MONAI gives 1.0 when both are empty and 0.0 for a false positive on empty truth.
    dice = compute_dice(pred_f, true_f, include_background=True, ignore_empty=False).double()
    dims = tuple(range(2, binary_pred.ndim))
    both_empty = (pred_f.sum(dim=dims) == 0) & (true_f.sum(dim=dims) == 0)
    dice[both_empty] = float("nan")
    return dice.cpu().numpy()


def _member_of(labels: torch.Tensor, members) -> torch.Tensor:
    """``labels`` in ``members`` (a region's classes), as ``torch.isin`` gives it, by equality tests: ``isin``
    sorts, which made it half of a teacher evaluation's Dice time on a CPU."""
    members = tuple(members)
    mask = labels == members[0]
    for member in members[1:]:
        mask |= labels == member
    return mask


def per_case_dice(pred_labels: Any, true_labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """(n, 3) class Dice for classes 1..3 and (n, 3) region Dice for WT, TC, ET; NaN = excluded."""
    pred = _as_label_tensor(pred_labels)
    true = _as_label_tensor(true_labels)
    if pred.shape != true.shape:
        raise ValueError(f"dice: prediction shape {tuple(pred.shape)} != truth shape {tuple(true.shape)}")
    if pred.ndim < 2:
        raise ValueError("dice: expected label maps shaped (n, *grid)")
    pred_cls = torch.stack([pred == c for c in (1, 2, 3)], dim=1)
    true_cls = torch.stack([true == c for c in (1, 2, 3)], dim=1)
    pred_reg = torch.stack([_member_of(pred, r) for r in REGIONS.values()], dim=1)
    true_reg = torch.stack([_member_of(true, r) for r in REGIONS.values()], dim=1)
    return _case_dice(pred_cls, true_cls), _case_dice(pred_reg, true_reg)


def class_volumes_ml(labels: np.ndarray, affine: np.ndarray) -> dict[int, float]:
    """Each tumour class's volume in ml in a label map's own voxels (``affine``: its voxel-to-world matrix)."""
    voxel_ml = abs(np.linalg.det(affine[:3, :3])) / 1000.0
    return {c: float((labels == c).sum() * voxel_ml) for c in (1, 2, 3)}


def per_case_dice_counted(pred_labels: Any, true_labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`per_case_dice` from voxel counts (numpy), for scans in their own grid: the same Dice, 2|P∩T| /
    (|P| + |T|), and the same empty-class convention (both empty: NaN; empty truth, non-empty prediction: 0).
    Why: MONAI's path costs tens of seconds on one 240 x 240 x 155 scan on a CPU (float one-hot maps);
    counting takes a fraction of a second. ``tests/test_realcheck.py`` checks that both agree."""
    pred, true = np.asarray(pred_labels), np.asarray(true_labels)
    if pred.shape != true.shape:
        raise ValueError(f"dice: prediction shape {tuple(pred.shape)} != truth shape {tuple(true.shape)}")
    if pred.ndim < 2 or not (np.issubdtype(pred.dtype, np.integer) and np.issubdtype(true.dtype, np.integer)):
        raise ValueError("dice: expected integer label maps shaped (n, *grid)")
    groups = [(c,) for c in (1, 2, 3)] + list(REGIONS.values())
    table = np.full((len(pred), len(groups)), np.nan)
    for i in range(len(pred)):
        # one pass: the confusion matrix of the two label maps gives every class's and region's counts
        low = min(int(pred[i].min()), int(true[i].min()))
        if low < 0:
            raise ValueError(f"dice: negative label {low}")
        size = max(int(pred[i].max()), int(true[i].max()), 3) + 1
        joint = pred[i].astype(np.int64 if size * size > 65535 else np.uint16) * size + true[i]
        confusion = np.bincount(joint.ravel(), minlength=size * size).reshape(size, size)
        for j, members in enumerate(groups):
            members = list(members)
            total = int(confusion[members, :].sum() + confusion[:, members].sum())
            if total:
                table[i, j] = 2.0 * confusion[np.ix_(members, members)].sum() / total
    return table[:, :3], table[:, 3:]


def truth_presence(true_labels: Any) -> np.ndarray:
    """(n, 6) booleans: whether each case's truth contains class 1, 2, 3 and region WT, TC, ET."""
    true = np.asarray(_as_label_tensor(true_labels))
    flat = true.reshape(len(true), -1)
    classes = [(flat == c).any(axis=1) for c in (1, 2, 3)]
    # a region is present where any of its classes is: read off the classes' presence, not a second pass
    regions = [np.logical_or.reduce([classes[c - 1] for c in r]) for r in REGIONS.values()]
    return np.stack(classes + regions, axis=1)


def _nanmean_or_none(column: np.ndarray) -> float | None:
    valid = column[~np.isnan(column)]
    return float(valid.mean()) if valid.size else None


def summarise(class_dice: np.ndarray, region_dice: np.ndarray) -> dict[str, float | None]:
    """Average per-case Dice into the results.json ``dice`` dict (no NaN, ``None`` = no valid case)."""
    out: dict[str, float | None] = {}
    for j, key in enumerate(CLASSES):
        out[key] = _nanmean_or_none(class_dice[:, j]) if len(class_dice) else None
    present = [out[k] for k in CLASSES if out[k] is not None]
    out["mean"] = float(np.mean(present)) if present else None
    for j, key in enumerate(REGIONS):
        out[key] = _nanmean_or_none(region_dice[:, j]) if len(region_dice) else None
    assert all(v is None or math.isfinite(v) for v in out.values())
    return {k: out[k] for k in DICE_KEYS}


def dice_scores(pred_labels: Any, true_labels: Any) -> dict[str, float | None]:
    """Dice per class (1, 2, 3), their mean, and WT/TC/ET for label maps shaped (n, *grid).

    Empty classes: see the module docstring (both-empty cases excluded; all-excluded -> ``None``).
    """
    return DiceAccumulator().add(pred_labels, true_labels).aggregate()


class DiceAccumulator:
    """Cumulative Dice over batches (MONAI ``Cumulative`` style): ``add`` batches, then ``aggregate``.

    Per-case values are kept, so the result equals ``dice_scores`` on the concatenated batches.
    """

    def __init__(self) -> None:
        # MONAI (~10 s to import) only when Dice is computed
        from monai.metrics import Cumulative

        self._classes = Cumulative()
        self._regions = Cumulative()
        self._present: list[np.ndarray] = []   # (n, 6): does the truth contain class 1, 2, 3 / WT, TC, ET
        self.cases = 0

    def add(self, pred_labels: Any, true_labels: Any) -> "DiceAccumulator":
        class_dice, region_dice = per_case_dice(pred_labels, true_labels)
        self._classes.extend(torch.from_numpy(class_dice))
        self._regions.extend(torch.from_numpy(region_dice))
        self._present.append(truth_presence(true_labels))
        self.cases += len(class_dice)
        return self

    def reset(self) -> None:
        self._classes.reset()
        self._regions.reset()
        self._present = []
        self.cases = 0

    def case_table(self) -> dict[str, list[float | None]]:
        """Per class (1, 2, 3) and region (WT, TC, ET), each case's Dice, ``None`` where the truth does not
        contain that class or region.

        What per-class paired comparisons need (``sim.report``: headroom per class): a class's Dice is only
        informative on the cases that have it -- on the others it is 0 (a false positive) or undefined, which
        says nothing about whether a method learned the class. Results store it as ``dice_per_case_class``.
        """
        if self.cases == 0:
            return {k: [] for k in CLASSES + tuple(REGIONS)}
        table = np.concatenate([np.asarray(self._classes.get_buffer(), dtype=np.float64),
                                np.asarray(self._regions.get_buffer(), dtype=np.float64)], axis=1)
        present = np.concatenate(self._present, axis=0)
        return {key: [float(table[i, j]) if present[i, j] and not np.isnan(table[i, j]) else None
                      for i in range(self.cases)]
                for j, key in enumerate(CLASSES + tuple(REGIONS))}

    def case_means(self) -> list[float | None]:
        """Per case, the mean Dice over its valid classes (None when every class was excluded).

        What paired comparisons need: two models scored on the same cases differ per case by much less
        than their averages' spread (``sim.report`` uses this).
        """
        if self.cases == 0:
            return []
        classes = np.asarray(self._classes.get_buffer(), dtype=np.float64)
        return [None if np.isnan(row).all() else float(np.nanmean(row)) for row in classes]

    def aggregate(self) -> dict[str, float | None]:
        if self.cases == 0:
            return {k: None for k in DICE_KEYS}
        classes = self._classes.get_buffer()
        regions = self._regions.get_buffer()
        return summarise(np.asarray(classes, dtype=np.float64), np.asarray(regions, dtype=np.float64))
