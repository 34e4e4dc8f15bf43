"""Contact sheet of a few cases: four modalities with the label overlay, so a person can judge the data.

``fedpate data gallery DIR --out PNG [--cases 4]`` draws, per case, the axial slice through the tumour's
largest cross-section (the middle slice when a case has no label), each modality with label contours, and a
fifth panel with the filled label map over FLAIR. Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from task.data.errors import DataError
from task.data.msd import MODALITIES, load_case
from task.data.reader import read_dataset
from task.io import atomic_write_bytes

LABEL_COLOURS = {1: (0.2, 0.8, 0.2), 2: (0.95, 0.2, 0.2), 3: (1.0, 0.9, 0.1)}   # oedema, core, enhancing


def axial_slice_index(label: np.ndarray | None, depth: int) -> int:
    if label is None or not np.any(label):
        return depth // 2
    return int(np.argmax((label > 0).sum(axis=(0, 1))))


def render_gallery(root: str | os.PathLike, out: str | os.PathLike, cases: int = 4,
                   case_ids: list[str] | None = None) -> Path:
    """Draw ``cases`` training cases of the MSD folder ``root`` into the PNG ``out``; return its path."""
    # matplotlib (~1.5 s) only where the gallery is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    dataset = read_dataset(root)
    chosen = dataset.training
    if case_ids:
        known = {c.case_id for c in chosen}
        if missing := [case_id for case_id in case_ids if case_id not in known]:
            listed = ", ".join(sorted(known)[:5]) + (", ..." if len(known) > 5 else "")
            raise DataError(f"--case {', '.join(missing)}: no such labelled case in {dataset.root} "
                            f"({len(known)} cases: {listed or 'none'})")
        wanted = set(case_ids)
        chosen = [c for c in chosen if c.case_id in wanted]
    else:
        # spread the picks over the list so several institutions show up
        step = max(1, len(chosen) // max(cases, 1))
        chosen = chosen[::step][:cases]
    if not chosen:
        raise DataError(f"{dataset.root}: no labelled cases to draw")
    fig, axes = plt.subplots(len(chosen), 5, figsize=(11, 2.4 * len(chosen)), squeeze=False)
    overlay = ListedColormap([(0, 0, 0, 0)] + [(*LABEL_COLOURS[k], 0.55) for k in (1, 2, 3)])
    for row, case in zip(axes, chosen):
        image, label, _ = load_case(case)
        z = axial_slice_index(label, image.shape[2])
        for c in range(4):
            sl = np.rot90(image[:, :, z, c])
            brain = sl[sl > 0]
            vmax = float(np.percentile(brain, 99.5)) if brain.size else 1.0
            row[c].imshow(sl, cmap="gray", vmin=0, vmax=vmax, interpolation="nearest")
            if label is not None:
                lab = np.rot90(label[:, :, z])
                for k, colour in LABEL_COLOURS.items():
                    if np.any(lab == k):
                        row[c].contour(lab == k, levels=[0.5], colors=[colour], linewidths=0.6)
            row[c].set_title(f"{MODALITIES[c]}" + (f"  {case.case_id}" if c == 0 else ""), fontsize=8)
        flair = np.rot90(image[:, :, z, 0])
        row[4].imshow(flair, cmap="gray", vmin=0, vmax=float(np.percentile(flair[flair > 0], 99.5))
                      if np.any(flair > 0) else 1.0)
        if label is not None:
            row[4].imshow(np.rot90(label[:, :, z]), cmap=overlay, vmin=0, vmax=3, interpolation="nearest")
        row[4].set_title(f"labels  {case.institution or ''} z={z}", fontsize=8)
        for ax in row:
            ax.set_axis_off()
    fig.suptitle("green oedema (1), red non-enhancing/necrotic core (2), yellow enhancing (3)", fontsize=9)
    fig.tight_layout()

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(out, buffer.getvalue())
