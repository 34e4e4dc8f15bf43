"""Deterministic multi-institution brain-tumour phantoms in the MSD Task01 layout.

Why phantoms: no download is possible here, yet the whole pipeline (reader, preprocessing, federation,
``fedpate predict``) must run on something that looks like BraTS. The generator builds each subject from
real anatomy and randomises everything a model should not rely on (SynthSeg-style domain randomisation,
Billot et al. 2023), so that a model trained on phantoms has a chance on real skull-stripped scans:

* Anatomy: the MNI152 T1 template and its grey/white-matter probability maps bundled with nilearn (no
  network); CSF = brain mask minus GM and WM. Resampled once per resolution and cached in-process.
* Subject: random affine (rotation <= 10 deg, an adult brain's size, translation <= 4 mm) plus a smooth elastic
  displacement (random control grid, interpolated separably), applied with ``scipy.ndimage.map_coordinates``;
  tissue maps sharpened from the template's population average to one subject's crispness; CSF grown in whole
  voxels to an adult's share of the brain (atrophy: wider sulci, larger ventricles).
* Tumour: centred in white matter at a random depth; irregular shapes from smooth noise perturbing an
  anisotropic distance, often with a second lobe; labels 1 oedema (finger-like: it spreads along white
  matter, retreats from cortex and spares CSF) around a core whose outer shell is enhancing (3) around a
  necrotic or solid non-enhancing centre (2); a third of cores enhance solidly around a small focus, and
  one lesion in five has little oedema; optional mass effect pushes tissue out.
* Contrasts: per-class mean intensities per sequence (FLAIR: oedema bright, CSF dark; T2: oedema and CSF
  bright; T1: WM > GM > CSF, core dark; T1-Gd: enhancing tissue bright), randomised per case and per
  channel (class means, grey/white and CSF contrast, gamma, scale) in ranges that keep these directions.
  How much brighter enhancing tissue is than white matter on T1-Gd is drawn per case over 1.12-2x, and
  healthy structures enhance too (vessels near the surface, choroid plexus), so brightness alone is not
  tumour. These came from the real-scan check (benchmarks/real_scan_check, docs/GENERALISATION.md).
* Scanner: per-institution profiles (intensity scale, gamma, bias-field strength, noise level, blur) spread
  over their ranges so sites measurably differ; Rician noise; skull-stripped (background exactly 0).

Held-out regimes (``shift``, :data:`SHIFTS`) render the *same* subjects with one factor moved outside the
training distribution -- scanner physics, tissue contrast, lesion pattern, skull-stripping quality -- so the
drop in Dice measures how far a model trained on the default regime carries (``benchmarks/bench_domain_gap.py``,
docs/GENERALISATION.md). Shift draws come from their own stream, so case ``i`` keeps its anatomy and tumour.

Case ``i`` depends only on ``(seed, i)`` (``numpy.random.default_rng([seed, i])``), so generation can be
resumed or run in parallel and gives identical bytes. Files are written atomically; ``dataset.json`` is
written last, so a folder without it is recognisably incomplete and a rerun resumes it.
"""

from __future__ import annotations

import gzip
import json
import math
import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from scipy import ndimage
from tqdm import tqdm

from task.data.errors import DataError
from task.data.msd import LABELS, MODALITIES
from task.data.shifts import SHIFTS, Shift, shift_parts

# aliased: ensure_phantoms has a parameter named cache_root
from task.io import atomic_write_bytes, atomic_write_json
from task.io import cache_root as default_cache_root

GENERATOR_VERSION = "7"   # 2: oedema follows white matter, two-lobed cores, held-out shifts
                          # 3: enhancement strength varies per case, solidly enhancing cores, little-oedema
                          #    lesions, enhancing healthy structures (vessels, choroid plexus)
                          # 4: tumour intensities keep only their defining contrasts (TUMOUR_CONTRAST); thick,
                          #    nodular, sometimes broken enhancing shells; heterogeneous cores
                          # 5: subjects' brains of adult size (BRAIN_ML), not the template's
                          # 6: CSF as large a share of the brain as in adults of glioma age (CSF_SHARE)
                          # 7: crisp tissue maps (TISSUE_CRISPNESS) and CSF grown in whole voxels

PROGRESS_FILE = ".phantoms-config.json"   # written first: identifies an incomplete folder for resuming
MARGIN_MM = 8.0                           # zero background kept around the brain, as in BraTS crops

# Healthy tissue per sequence (FLAIR, T1, T1-Gd, T2). White matter's mean (relative units before the scanner
# scale) and, drawn uniformly per case and sequence, grey matter's and CSF's means as multiples of it
# (HEALTHY_RATIOS). The ranges keep each sequence's clinical order of the healthy tissues but are wide, as
# SynthSeg draws them (Billot et al. 2023, arXiv 2107.09559): in particular CSF is 1.6-4x as bright as white
# matter on T2 and dark on FLAIR, which gives real scans' long bright tail on T2 after per-scan normalisation
# (real skull-stripped brains hold sulcal and ventricular CSF). Generator 3's CSF was at most 1.7x white matter
# on T2; the normalised tumour then stood out far more than on real scans (docs/decisions/world-realism.md).
WHITE_MATTER = (0.42, 0.80, 0.78, 0.42)   # in task.data.msd.MODALITIES order, as VESSEL
HEALTHY_RATIOS = {            # (grey / white matter, CSF / white matter), uniform
    "FLAIR": ((1.0, 1.45), (0.15, 0.7)),
    "T1w":   ((0.6, 0.95), (0.2, 0.55)),
    "t1gd":  ((0.6, 1.0), (0.2, 0.6)),
    "T2w":   ((1.05, 1.6), (1.6, 4.0)),
}
VESSEL = (0.35, 0.50, 1.30, 0.40)   # vessels, choroid plexus: enhance too (T1-Gd: VESSEL_RATIO); darker on
                                    # T2 and FLAIR (flow)
# Tumour classes: mean intensity relative to the case's parenchyma (mean of grey and white matter) in each
# sequence, drawn uniformly per case, class and sequence. A class keeps only the contrast that defines it in the
# BraTS annotation protocol (Menze et al. 2015; Bakas et al. 2017): the whole tumour is the FLAIR-hyperintense
# abnormality (oedema and solid tumour above the parenchyma on FLAIR), the enhancing tumour is T1-Gd-hyperintense
# (set apart: ENHANCEMENT_RATIO, against the brightest parenchyma), and the necrotic / non-enhancing core does
# not enhance (on T1-Gd at most about the parenchyma). Everything else varies, as between real tumours and
# scanners, so that no fixed intensity order identifies a class (SynthSeg-style domain randomisation): T1 from
# hypo- to hyperintense, T1-Gd of the non-enhancing classes drawn apart from their T1, FLAIR of necrosis from
# fluid-suppressed to proteinaceous, T2 from about iso- to strongly hyperintense, contrasts from subtle to
# strong. Generator 3 kept every class's clinical order with a 7 % jitter; a model trained on it relied on
# T1-dark tumour and missed real cases whose core is T1-iso or hyperintense (docs/decisions/world-realism.md).
TUMOUR_CONTRAST = {
    "FLAIR": {"edema": (1.1, 2.4), "necrotic": (0.3, 2.6), "solid": (1.05, 2.4), "enhancing": (0.9, 2.4)},
    "T1w":   {"edema": (0.5, 1.3), "necrotic": (0.3, 1.5), "solid": (0.5, 1.4), "enhancing": (0.5, 1.5)},
    "t1gd":  {"edema": (0.5, 1.2), "necrotic": (0.3, 1.2), "solid": (0.6, 1.2)},
    "T2w":   {"edema": (1.05, 2.8), "necrotic": (0.9, 3.5), "solid": (0.9, 2.6), "enhancing": (0.8, 2.6)},
}
# T1-Gd brightness of enhancing tissue (tumour and healthy) relative to this case's white matter, log-uniform.
# Why so wide: enhancement depends on dose, timing and lesion; 3D Slicer's MRBrainTumor1/2 lesions sit at
# z 1.6-2.1 after per-scan normalisation where generator v2 (fixed ratio 1.8) put them at z 2.1-4.2, and a
# v2-trained model missed them entirely (docs/GENERALISATION.md). The floor keeps "enhancing > white matter".
ENHANCEMENT_RATIO = (1.12, 2.0)
VESSEL_RATIO = (1.1, 1.9)
SOLID_ENHANCING_SHARE = 0.35   # cores that enhance throughout, around a small focus (rim-enhancing otherwise)
LITTLE_OEDEMA_SHARE = 0.2      # lesions whose oedema is a thin rim (core radius 0.8-0.95 of the oedema's)
# The core's radius as a share of the oedema's, and the enhancing shell's thickness (mm). Generator 3 drew
# 0.45-0.75 and 2-4.5 mm: its median lesion had 15 ml of enhancing tissue and 5 ml of necrosis, so at the working
# grid (~5 mm voxels) the shell was often under one voxel thick, where the real development cases hold 22-33 ml
# of enhancing tumour and 11-17 ml of necrosis (docs/decisions/world-realism.md).
CORE_SHARE = (0.5, 0.85)
RIM_MM = (3.0, 8.0)
BROKEN_RIM_SHARE = 0.4         # rim-enhancing lesions whose shell is broken: part of it does not enhance
# How far the oedema's centre may lie off the core's, as a share of the oedema's radius (uniform per lesion, in
# a random direction). 0 in generator 7: the oedema is centred on the core. The world probe's ``eccentric`` lever
# sets it (experiments/world_levers.py).
OEDEMA_ECCENTRICITY = 0.0
# Whether the lesion's labelled border voxels are mixed with their unlabelled neighbours as much as those are with
# them (a label's edge in the middle of the partial-volume step, where a rater or a downsampled 1 mm label puts it).
# False in generator 7: labelled voxels are pure and partial volume only spills outward. The world probe's
# ``mixededge`` lever sets it (experiments/world_levers.py).
LESION_EDGE_MIXED = False
# A subject's brain volume (ml), skull-stripped as BraTS releases it (brain and CSF), uniform: adult intracranial
# volumes. The MNI152 template's brain mask holds about 2.0 l (at 3 mm), where the development scans' brains hold
# 1.0-1.6 l; scaled around the template (generator 4: x0.8-1.26 in volume), a phantom's tumour, drawn in mm, was
# a smaller share of its brain than in real scans, and so a smaller share of the working grid, which is cropped
# to the brain (docs/decisions/world-realism.md).
BRAIN_ML = (1100.0, 1700.0)
# The share of a subject's brain (BraTS' skull-stripped mask) that is CSF, uniform. The MNI152 template averages
# young adults (ICBM 152: 18-44 years) and holds ~11 % CSF at 3 mm; brains shrink with age -- CSF is roughly a
# tenth of the intracranial volume in young adults and a quarter in the elderly -- and the median age at diagnosis
# of glioblastoma is in the sixties. A subject's CSF grows into the parenchyma next to CSF already there (wider
# sulci, larger ventricles), in whole voxels (:func:`_atrophy`). At the template's share, normalised
# phantom T2 lacked real scans' long bright CSF tail, and oedema stood further above the normalised parenchyma than
# on real scans (T2 z of oedema: phantom median 1.3; development cases 0.05-1.3) (docs/decisions/world-realism.md).
CSF_SHARE = (0.11, 0.25)
# The MNI152 grey-matter, white-matter and CSF maps are averages over subjects, blurred by the spread between them,
# so a template voxel is a mixture of tissues where one subject's voxel is mostly one tissue (partial volume then
# comes from the rendering's resolution). Raised to this power and renormalised to the same total, the maps are
# about as crisp as one subject's: with CSF also grown in whole voxels, the normalised healthy parenchyma's
# interquartile range on T2 falls from 0.90 z (generator 6) to 0.65 z, against 0.48-0.62 on real BraTS scans
# (docs/decisions/world-realism.md).
TISSUE_CRISPNESS = 4.0


@dataclass(frozen=True)
class ScannerProfile:
    """How one institution's scanner renders the same anatomy (all multiplicative/relative)."""

    name: str
    intensity_scale: float        # arbitrary scanner units per relative intensity
    channel_gain: tuple           # per-channel gain on top of the scale
    gamma: tuple                  # per-channel gamma on the relative intensities
    bias_strength: float          # std of the log bias field
    noise: float                  # Rician noise std relative to the mean brain intensity
    blur_mm: float                # Gaussian PSF std (mm)


def institution_name(k: int) -> str:
    return f"site{k}"


def institution_profiles(institutions: int, seed: int) -> list[ScannerProfile]:
    """Scanner profiles of ``institutions`` sites, spread over their ranges (Latin hypercube) so sites differ.

    Depends only on (seed, institutions); each parameter uses its own random permutation of the sites, so
    two sites never share the same rank in every parameter.
    """
    rng = np.random.default_rng([seed, 7_919, institutions])
    m = max(institutions, 1)

    def spread(lo: float, hi: float, log: bool = False) -> np.ndarray:
        u = (rng.permutation(m) + rng.uniform(0.2, 0.8, m)) / m
        if log:
            return np.exp(np.log(lo) + u * (np.log(hi) - np.log(lo)))
        return lo + u * (hi - lo)

    scale, bias, noise, blur = spread(250, 1200, log=True), spread(0.05, 0.3), spread(0.01, 0.06), spread(0.0, 1.5)
    profiles = []
    for k in range(institutions):
        profiles.append(ScannerProfile(
            name=institution_name(k), intensity_scale=float(scale[k]),
            channel_gain=tuple(float(g) for g in np.exp(rng.normal(0, 0.15, 4))),
            gamma=tuple(float(g) for g in np.exp(rng.normal(0, 0.12, 4))),
            bias_strength=float(bias[k]), noise=float(noise[k]), blur_mm=float(blur[k]),
        ))
    return profiles


# ------------------------------------------------------------------------------------------------ anatomy
_ANATOMY: dict[float, dict[str, Any]] = {}


def anatomy_shape(resolution_mm: float) -> tuple[int, ...]:
    """Shape of the phantoms' anatomy grid at ``resolution_mm`` (builds and caches the anatomy)."""
    return tuple(_anatomy(resolution_mm)["shape"])


def _anatomy(resolution_mm: float) -> dict[str, Any]:
    """MNI152 tissue maps resampled once to ``resolution_mm`` on the brain's box plus a margin (cached)."""
    key = round(float(resolution_mm), 4)
    if key in _ANATOMY:
        return _ANATOMY[key]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # nilearn (~4 s to import) only when the MNI template is loaded, once per generator process
        from nilearn import datasets

        mask_img = datasets.load_mni152_brain_mask(resolution=1)
        gm = np.asarray(datasets.load_mni152_gm_template(resolution=1).get_fdata(), np.float32)
        wm = np.asarray(datasets.load_mni152_wm_template(resolution=1).get_fdata(), np.float32)
    mask = np.asarray(mask_img.get_fdata(), np.float32)
    template_affine = np.asarray(mask_img.affine, np.float64)   # 1 mm, axis-aligned (RAS)
    gm, wm = gm * mask, wm * mask
    total = np.maximum(gm + wm, 1.0)
    gm, wm = gm / total, wm / total                             # keep gm + wm <= 1
    csf = np.clip(mask - gm - wm, 0.0, 1.0)

    nz = np.argwhere(mask > 0.5)
    lo, hi = nz.min(axis=0) - MARGIN_MM, nz.max(axis=0) + MARGIN_MM         # template voxel (= mm) box
    res = float(resolution_mm)
    shape = tuple(int(math.ceil((h - l) / res)) + 1 for l, h in zip(lo, hi))
    affine = np.diag([res, res, res, 1.0])
    affine[:3, 3] = template_affine[:3, 3] + lo
    # Template voxel coordinates of the output grid, separable because both grids are axis-aligned.
    axes = [lo[d] + res * np.arange(shape[d]) for d in range(3)]
    coords = np.meshgrid(*axes, indexing="ij")
    sigma = max(0.0, 0.42 * (res - 1.0))   # anti-aliasing before downsampling (Gaussian ~ box of width res)
    maps = {}
    for name, volume in (("gm", gm), ("wm", wm), ("csf", csf), ("mask", mask)):
        if sigma > 0:
            volume = ndimage.gaussian_filter(volume, sigma, truncate=2.5)
        maps[name] = ndimage.map_coordinates(volume, coords, order=1, mode="constant", cval=0.0).astype(np.float32)
    # distance to the brain surface in mm, on the output grid (cheaper than at 1 mm; only used for placement)
    maps["depth"] = (ndimage.distance_transform_edt(maps["mask"] > 0.5) * res).astype(np.float32)
    brain_ml = float(np.count_nonzero(maps["mask"] > 0.5)) * res ** 3 / 1000.0
    anatomy = {"shape": shape, "affine": affine, "resolution": res, "brain_ml": brain_ml, **maps}
    _ANATOMY[key] = anatomy
    return anatomy


# ------------------------------------------------------------------------------------- random smooth fields
def _basis(n: int, controls: int) -> np.ndarray:
    """(n, controls) Gaussian interpolation weights: smooth, separable upsampling of a control grid."""
    if controls <= 1:
        return np.ones((n, 1), np.float32)
    pos = np.linspace(0, controls - 1, n)[:, None]
    weights = np.exp(-0.5 * ((pos - np.arange(controls)[None, :]) / 0.7) ** 2)
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def smooth_field(rng: np.random.Generator, shape: tuple[int, ...], controls: tuple[int, ...],
                 count: int = 1) -> np.ndarray:
    """``count`` random smooth fields of ``shape`` (about unit std), from Gaussian control grids.

    Separable contraction (control grid x three 1D bases) costs O(voxels x controls), far less than
    ``ndimage.zoom`` with cubic splines, which is why the generator stays under a second per case.
    """
    grid = rng.standard_normal((count, *controls)).astype(np.float32)
    bx, by, bz = (_basis(n, c) for n, c in zip(shape, controls))
    out = np.einsum("nabc,zc->nabz", grid, bz)
    out = np.einsum("nabz,yb->nayz", out, by)
    out = np.einsum("nayz,xa->nxyz", out, bx)
    # Interpolation shrinks the variance; restore roughly unit std so amplitudes mean what they say.
    out /= max(float(out.std()), 1e-6)
    return out


def _rotation(angles: np.ndarray) -> np.ndarray:
    cx, cy, cz = np.cos(angles)
    sx, sy, sz = np.sin(angles)
    rx = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    ry = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    rz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return rz @ ry @ rx


# ------------------------------------------------------------------------------------------------- a case
@dataclass
class PhantomCase:
    image: np.ndarray      # (X, Y, Z, 4) int16 scanner units, 0 outside the brain
    label: np.ndarray      # (X, Y, Z) uint8 0..3
    affine: np.ndarray     # (4, 4)
    institution: str
    info: dict
    tissue: dict | None = None   # deformed tissue maps (gm, wm, csf, mask, vessels): for tests and studies


def make_case(seed: int, index: int, institutions: int, resolution_mm: float = 2.0,
              shift: str = Shift.NONE) -> PhantomCase:
    """Generate case ``index`` of the phantom world ``seed`` (depends only on these and the settings)."""
    parts = shift_parts(shift)
    anatomy = _anatomy(resolution_mm)
    rng = np.random.default_rng([int(seed), int(index)])
    # shifted factors draw from their own stream: the subject and its tumour stay those of the unshifted case
    shift_rng = np.random.default_rng([int(seed), int(index), 104_729])
    profile = institution_profiles(institutions, seed)[index % institutions]
    if Shift.SCANNER in parts:
        profile = _shifted_scanner(shift_rng, profile)
    res = anatomy["resolution"]
    shape = anatomy["shape"]

    coords, matrix = _subject_warp(rng, shape, res)
    p, r_edema = _tumour_centre(rng, anatomy, coords)
    mass = _mass_effect(rng, coords, matrix, p, r_edema, res)
    tissue = {name: ndimage.map_coordinates(anatomy[name], coords, order=1, mode="constant", cval=0.0,
                                            output=np.float32)
              for name in ("gm", "wm", "csf", "mask")}
    brain = tissue["mask"] > 0.5
    _crisp_tissue(tissue)
    _atrophy(np.random.default_rng([int(seed), int(index), 7_919]), tissue, brain)

    primary_radius = r_edema * (0.6 if Shift.LESIONS in parts else 1.0)
    label, tumour_weights, rim = _tumour(rng, shape, p, primary_radius, res, tissue, brain)
    solid_enhancing = rim == "solid"
    depth = ndimage.distance_transform_edt(brain) * res                  # mm inside the brain
    if Shift.LESIONS in parts:
        _add_satellites(shift_rng, label, tumour_weights, res, tissue, brain, depth)

    vessels = _enhancing_structures(rng, res, tissue, depth, label)
    fluid_share = _share(tumour_weights["necrotic"], tumour_weights["solid"])
    image, enhancement = _intensities(rng, tissue, vessels, tumour_weights, label,
                                      contrast_shift=Shift.CONTRAST in parts)

    head = brain
    if Shift.SKULL in parts:
        head = _skull_residue(shift_rng, image, brain, res)
    image = _scanner(rng, image, head, profile, res)
    label[~brain] = 0
    info = {"institution": profile.name, "brain_ml": round(float(np.count_nonzero(brain)) * res ** 3 / 1000.0, 1),
            "mass_effect": round(float(mass), 3), "core_fluid_share": fluid_share,
            "solid_enhancing": bool(solid_enhancing), "rim": rim, "enhancement_ratio": round(enhancement, 3),
            "edema_radius_mm": round(float(r_edema), 2), "shift": shift}
    return PhantomCase(image=image, label=label, affine=anatomy["affine"].copy(), institution=profile.name,
                       info=info, tissue={**tissue, "vessels": vessels})


def _subject_warp(rng: np.random.Generator, shape: tuple[int, ...], res: float) -> tuple[list[np.ndarray], np.ndarray]:
    """A random subject's shape: for every output voxel its template-grid coordinates (one array per axis) under
    a random affine (rotation <= 10 deg, the size of an adult brain: :func:`_subject_scales`, translation <= 4 mm)
    plus a smooth elastic displacement;
    and the affine's linear part (the mass effect moves tissue through it)."""
    centre = (np.asarray(shape) - 1) / 2.0
    angles = np.deg2rad(rng.uniform(-10, 10, 3))
    scales = _subject_scales(rng, res)
    matrix = (_rotation(angles) @ np.diag(1.0 / scales)).astype(np.float32)
    translation = (rng.uniform(-4, 4, 3) / res).astype(np.float32)
    elastic = smooth_field(rng, shape, (5, 6, 5), count=3) * np.float32(rng.uniform(1.0, 3.0) / res)
    grids = [np.arange(n, dtype=np.float32) - np.float32(c) for n, c in zip(shape, centre)]

    def source(points: list[np.ndarray]) -> list[np.ndarray]:
        """Template coordinates of (broadcastable) output coordinates ``points`` relative to the centre."""
        return [matrix[d, 0] * points[0] + matrix[d, 1] * points[1] + matrix[d, 2] * points[2]
                + np.float32(centre[d]) + translation[d] for d in range(3)]

    base = source([grids[0][:, None, None], grids[1][None, :, None], grids[2][None, None, :]])
    return [np.broadcast_to(base[d], shape) + elastic[d] for d in range(3)], matrix


def _subject_scales(rng: np.random.Generator, res: float) -> np.ndarray:
    """Per-axis scale of a subject against the template: an adult brain's volume (:data:`BRAIN_ML`) and a small
    per-axis spread that keeps it."""
    overall = (rng.uniform(*BRAIN_ML) / _anatomy(res)["brain_ml"]) ** (1.0 / 3.0)
    spread = rng.uniform(0.95, 1.05, 3)
    return overall * spread / float(np.prod(spread)) ** (1.0 / 3.0)


def _crisp_tissue(tissue: dict[str, np.ndarray]) -> None:
    """Sharpen the subject's grey-matter, white-matter and CSF maps, in place, to :data:`TISSUE_CRISPNESS`: each
    raised to that power, then the three rescaled so that their sum at every voxel is what it was (the brain
    mask's partial volume is kept; only the mixture within it becomes purer)."""
    maps = np.stack([tissue["gm"], tissue["wm"], tissue["csf"]])
    crisp = np.power(np.clip(maps, 0.0, None), TISSUE_CRISPNESS)
    crisp *= maps.sum(0) / np.maximum(crisp.sum(0), 1e-6)
    tissue["gm"], tissue["wm"], tissue["csf"] = crisp[0], crisp[1], crisp[2]


def _atrophy(rng: np.random.Generator, tissue: dict[str, np.ndarray], brain: np.ndarray) -> None:
    """Grow the subject's CSF, in place, to a share of its brain drawn in :data:`CSF_SHARE`, by turning whole
    voxels into CSF, those nearest to the CSF already there first (wider sulci, larger ventricles), until the
    tissue they held reaches the missing volume. Whole voxels because a real brain's widened sulci and ventricles
    are compartments of pure CSF beside pure tissue, mixed only at their borders (generator 6 moved a fraction of
    every voxel near CSF into CSF, so the parenchyma around them was a mixture everywhere). Its own random stream:
    the subject's other draws do not depend on it."""
    csf, gm, wm = tissue["csf"], tissue["gm"], tissue["wm"]
    target = rng.uniform(*CSF_SHARE) * float(np.count_nonzero(brain))
    missing = target - float(csf[brain].sum())
    if missing <= 0:
        return
    # CSF in the neighbourhood, unclipped so that it orders every voxel near CSF (a clip at 1 would tie them)
    near = ndimage.gaussian_filter(csf, 1.0) * brain
    order = np.argsort(-near, axis=None)
    gain = (gm + wm).ravel()[order]
    count = int(np.searchsorted(np.cumsum(gain), missing)) + 1
    take = np.zeros(csf.size, bool)
    take[order[:count]] = True
    take = take.reshape(csf.shape) & brain
    tissue["csf"] = np.where(take, csf + gm + wm, csf).astype(csf.dtype)
    tissue["gm"] = np.where(take, 0.0, gm).astype(gm.dtype)
    tissue["wm"] = np.where(take, 0.0, wm).astype(wm.dtype)


def _tumour_centre(rng: np.random.Generator, anatomy: dict[str, Any],
                   coords: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """The tumour's centre (output voxel) and its oedema radius (mm): in white matter, deep enough for the
    oedema, found by rejection on template lookups (anywhere in the brain when no candidate qualifies)."""
    shape = anatomy["shape"]
    nearest = lambda volume, idx: volume[tuple(np.clip(np.rint(coords[d][idx]), 0, shape[d] - 1).astype(int)
                                               for d in range(3))]
    r_edema = rng.uniform(20.0, 38.0)
    candidates = tuple(rng.integers(0, n, 4000) for n in shape)
    ok = (nearest(anatomy["wm"], candidates) > 0.5) & (nearest(anatomy["depth"], candidates) > 0.45 * r_edema + 6)
    if not ok.any():
        ok = nearest(anatomy["mask"], candidates) > 0.5
    pick = int(np.flatnonzero(ok)[0])
    return np.array([c[pick] for c in candidates], np.float32), r_edema


def _mass_effect(rng: np.random.Generator, coords: list[np.ndarray], matrix: np.ndarray, p: np.ndarray,
                 r_edema: float, res: float) -> float:
    """Mass effect (in most cases): tissue within ~R of the tumour centre ``p`` is pushed outward by a monotone
    radial warp of strength m < 1, applied to ``coords`` in place. Returns m (0 = none)."""
    mass = rng.uniform(0.0, 0.45) if rng.random() < 0.7 else 0.0
    if mass > 0:
        shape = coords[0].shape
        radius_vox = r_edema / res
        rel = [(np.arange(n, dtype=np.float32) - pc) for n, pc in zip(shape, p)]
        d2 = rel[0][:, None, None] ** 2 + rel[1][None, :, None] ** 2 + rel[2][None, None, :] ** 2
        factor = (1.0 - mass * np.exp(-d2 / (2.0 * radius_vox ** 2))).astype(np.float32) - 1.0
        # x' = p + (x - p) * (1 - m e^{...}); apply the subject transform to the displacement (linear part)
        disp = [rel[0][:, None, None] * factor, rel[1][None, :, None] * factor, rel[2][None, None, :] * factor]
        for d in range(3):
            coords[d] = coords[d] + matrix[d, 0] * disp[0] + matrix[d, 1] * disp[1] + matrix[d, 2] * disp[2]
    return mass


def _intensities(rng: np.random.Generator, tissue: dict[str, np.ndarray], vessels: np.ndarray,
                 tumour_weights: dict[str, np.ndarray], label: np.ndarray,
                 contrast_shift: bool = False) -> tuple[np.ndarray, float]:
    """The four sequences before the scanner, (4, *shape), mixed by partial volume, with a fine texture everywhere
    and a heterogeneous one inside the lesion. Returns the image and this case's T1-Gd enhancement ratio.

    Per case and sequence: healthy tissue from :data:`WHITE_MATTER` and :data:`HEALTHY_RATIOS`, tumour classes from
    :data:`TUMOUR_CONTRAST` relative to the parenchyma, enhancing tissue on T1-Gd against the brightest parenchyma
    (:data:`ENHANCEMENT_RATIO`). The ``contrast`` shift jitters every drawn mean by a further 21 % (log-std), so
    orders may flip."""
    shape = label.shape
    image = np.zeros((4, *shape), np.float32)
    tumour_total = sum(tumour_weights.values())
    healthy = 1.0 - tumour_total
    texture = 1.0 + 0.04 * smooth_field(rng, shape, (9, 11, 9), count=1)[0]
    enhancement = _log_uniform(rng, *ENHANCEMENT_RATIO)
    vessel_enhancement = _log_uniform(rng, *VESSEL_RATIO)
    jitter = 0.21 if contrast_shift else 0.0

    def draw(low: float, high: float) -> float:
        return rng.uniform(low, high) * float(np.exp(jitter * rng.normal())) if jitter else rng.uniform(low, high)

    for c, sequence in enumerate(MODALITIES):
        wm = WHITE_MATTER[c] * float(np.exp(0.1 * rng.normal()))
        (grey_low, grey_high), (csf_low, csf_high) = HEALTHY_RATIOS[sequence]
        means = {"wm": wm, "gm": wm * draw(grey_low, grey_high), "csf": wm * draw(csf_low, csf_high),
                 "vessel": VESSEL[c] * float(np.exp(0.07 * rng.normal()))}
        parenchyma = 0.5 * (means["gm"] + means["wm"])
        for name, (low, high) in TUMOUR_CONTRAST[sequence].items():
            means[name] = parenchyma * draw(low, high)
        if sequence == "t1gd":   # enhancement is set against this case's brightest parenchyma
            means["enhancing"] = max(means["wm"], means["gm"]) * enhancement
            means["vessel"] = max(means["wm"], means["gm"]) * vessel_enhancement
        tissues = tissue["csf"] * means["csf"] + tissue["gm"] * means["gm"] + tissue["wm"] * means["wm"]
        channel = (tissues * (1.0 - vessels) + vessels * means["vessel"]) * healthy
        for name, weight in tumour_weights.items():
            channel += weight * means[name]
        image[c] = channel * texture
    # tumour heterogeneity: fine-grained multiplicative texture inside the lesion only
    lesion = label > 0
    if lesion.any():
        speckle = ndimage.gaussian_filter(rng.standard_normal(shape).astype(np.float32), 0.8) * 0.25
        for c in range(4):
            image[c][lesion] *= 1.0 + speckle[lesion]
    return image, enhancement


def _tumour(rng: np.random.Generator, shape, p: np.ndarray, r_edema: float, res: float,
            tissue: dict[str, np.ndarray], brain: np.ndarray):
    """Labels (1 oedema, 2 necrotic/non-enhancing core, 3 enhancing shell) and soft class weights (``edema``,
    ``necrotic`` and ``solid`` -- the fluid and the solid parts of label 2 -- and ``enhancing``), and the kind of
    enhancing shell: ``"solid"`` (the core enhances throughout), ``"closed"`` or ``"broken"``.

    Shaped after glioblastomas as BraTS shows them (Menze et al. 2015; Bakas et al. 2017): a thick, nodular
    enhancing shell (RIM_MM, its thickness varying around the lesion by up to half), broken in a share of lesions
    (BROKEN_RIM_SHARE: part of the shell does not enhance and is non-enhancing tumour, label 2), around a core in
    which fluid-filled necrosis and solid non-enhancing tumour lie side by side (both label 2, each with its own
    appearance), inside oedema of varying extent.
    """
    rim = max(rng.uniform(*RIM_MM), 1.1 * res)                           # enhancing shell thickness (mm)
    # one lesion in five has little oedema (a thin rim): enhancing masses are not always wrapped in oedema
    core_share = rng.uniform(0.8, 0.95) if rng.random() < LITTLE_OEDEMA_SHARE else rng.uniform(*CORE_SHARE)
    r_core = max(r_edema * core_share, rim + 1.6 * res)
    rim = min(rim, 0.6 * r_core)                                         # a shell, not a solid ball
    # a third of cores enhance solidly around a small non-enhancing focus; the rest are rim-enhancing
    solid_enhancing = rng.random() < SOLID_ENHANCING_SHARE
    r_edema = max(r_edema, r_core + 2.5 * res)
    # the box holds the largest extent the clipped noise, the white-matter pull and a second lobe allow:
    # f_edema < 1 needs dist < 1.825 r_edema, so |u| < 0.675 r + 0.8 x 1.825 r < 2.14 r; x stretch 1.3 < 2.8 r
    # (an oedema moved off the core reaches up to 1.3 x its shift further)
    half = int(math.ceil((2.8 + 1.3 * OEDEMA_ECCENTRICITY) * r_edema / res)) + 2
    lo = np.maximum(np.floor(p).astype(int) - half, 0)
    hi = np.minimum(np.floor(p).astype(int) + half + 1, shape)
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    bshape = tuple(int(b - a) for a, b in zip(lo, hi))
    rel = [(np.arange(a, b, dtype=np.float32) - pc) * res for a, b, pc in zip(lo, hi, p)]   # mm
    axes = _rotation(rng.uniform(0, np.pi, 3)).astype(np.float32)
    stretch = rng.uniform(0.75, 1.3, 3).astype(np.float32)
    u = [(axes[d, 0] * rel[0][:, None, None] + axes[d, 1] * rel[1][None, :, None]
          + axes[d, 2] * rel[2][None, None, :]) / stretch[d] for d in range(3)]
    dist = np.sqrt(u[0] ** 2 + u[1] ** 2 + u[2] ** 2)                    # anisotropic distance (mm)
    if rng.random() < 0.45:
        # a second, smaller lobe off-centre: gliomas are rarely one convex blob
        direction = rng.normal(size=3)
        offset = direction / max(float(np.linalg.norm(direction)), 1e-6) * rng.uniform(0.5, 0.9) * r_core
        lobe_scale = rng.uniform(0.5, 0.8)
        lobe = np.sqrt((u[0] - offset[0]) ** 2 + (u[1] - offset[1]) ** 2 + (u[2] - offset[2]) ** 2) / lobe_scale
        dist = np.minimum(dist, lobe.astype(np.float32))
    dist_edema = _oedema_distance(rng, u, dist, r_edema)
    # additive perturbation of the normalised distance by clipped smooth noise: irregular, bounded shapes
    noise = np.clip(smooth_field(rng, bshape, (5, 5, 5), count=5), -1.5, 1.5)
    f_core = dist / r_core + rng.uniform(0.1, 0.25) * noise[0]
    finger = np.clip(smooth_field(rng, bshape, (8, 8, 8), count=1)[0], -1.5, 1.5)   # finer: finger-like oedema
    f_edema = dist_edema / r_edema + rng.uniform(0.12, 0.25) * noise[1] + rng.uniform(0.08, 0.2) * finger
    # vasogenic oedema spreads along white-matter tracts and stops at the cortex (it rarely enters grey matter)
    f_edema = f_edema - rng.uniform(0.1, 0.3) * (tissue["wm"][box] - 0.5)
    if solid_enhancing:
        inner = rng.uniform(0.2, 0.4) * (1.0 + 0.3 * noise[2])            # small necrotic/solid focus
    else:
        inner = 1.0 - rim / r_core * (1.0 + 0.5 * noise[2])             # nodular: the shell's thickness varies

    in_brain = brain[box]
    spared = tissue["csf"][box] > 0.6                                    # oedema does not fill ventricles
    core = (f_core < 1.0) & in_brain
    necrotic = core & (f_core < inner)
    enhancing = core & ~necrotic
    rim_kind = "solid" if solid_enhancing else "closed"
    if not solid_enhancing and rng.random() < BROKEN_RIM_SHARE:
        # where a smooth field is low the shell does not enhance: it is non-enhancing tumour (label 2)
        gap = _shell_gap(rng, noise[3], enhancing)
        necrotic |= enhancing & gap
        enhancing &= ~gap
        rim_kind = "broken"
    edema = (f_edema < 1.0) & in_brain & ~core & ~spared
    local = np.zeros(bshape, np.uint8)
    local[edema], local[necrotic], local[enhancing] = 1, 2, 3
    label = np.zeros(shape, np.uint8)
    label[box] = local

    weights = {}
    for name, value in (("edema", 1), ("core", 2), ("enhancing", 3)):
        w = np.zeros(shape, np.float32)
        inside = (local == value).astype(np.float32)
        # labelled voxels are pure; partial volume only spills into the healthy neighbours (label 0), unless
        # LESION_EDGE_MIXED
        blurred = ndimage.gaussian_filter(inside, 0.6)
        w[box] = blurred if LESION_EDGE_MIXED else np.where(local > 0, inside, blurred)
        weights[name] = w
    # label 2 is heterogeneous: fluid-filled necrosis and solid non-enhancing tumour in smooth patches, their
    # shares drawn per lesion (from almost all fluid to almost all solid)
    fluid = np.zeros(shape, np.float32)
    fluid[box] = (noise[4] > rng.uniform(-1.0, 1.0)).astype(np.float32)
    core_weight = weights.pop("core")
    weights["necrotic"], weights["solid"] = core_weight * fluid, core_weight * (1.0 - fluid)
    # oedema fades towards its border (water content falls off away from the tumour)
    fade = np.ones(shape, np.float32)
    fade[box] = 1.0 - 0.45 * np.clip(f_edema, 0.0, 1.0) ** 2
    weights["edema"] *= fade
    _cap_tumour_weights(weights)
    return label, weights, rim_kind


def _oedema_distance(rng: np.random.Generator, u: list[np.ndarray], dist: np.ndarray, r_edema: float) -> np.ndarray:
    """The anisotropic distance (mm) that shapes the oedema: the core's own (``dist``, with its second lobe), so
    the oedema is centred on the core, unless ``OEDEMA_ECCENTRICITY`` is above zero; then the oedema's centre is
    moved off the core's by up to that share of its radius, in a direction drawn from a stream of its own (every
    other draw of the case stays the generator's): the oedema reaches further on one side and leaves the core bare
    on the other."""
    if OEDEMA_ECCENTRICITY <= 0.0:
        return dist
    own = np.random.default_rng([rng.bit_generator.state["state"]["state"], 0xED])
    direction = own.normal(size=3)
    shift = direction / max(float(np.linalg.norm(direction)), 1e-6) * own.uniform(0.0, OEDEMA_ECCENTRICITY) * r_edema
    off = np.sqrt((u[0] - shift[0]) ** 2 + (u[1] - shift[1]) ** 2 + (u[2] - shift[2]) ** 2).astype(np.float32)
    return off


def _shell_gap(rng: np.random.Generator, field: np.ndarray, shell: np.ndarray) -> np.ndarray:
    """Where a broken shell does not enhance: where the lesion's smooth field ``field`` is low. ``shell`` (the
    enhancing shell) is not read by this rule; the world probe's rules that size the gap by the shell take it
    (``experiments.world_levers``)."""
    return field < rng.uniform(-1.0, -0.3)


def _share(part: np.ndarray, rest: np.ndarray) -> float:
    """``part``'s share of ``part + rest`` (0 when both are empty), rounded for the case's info."""
    total = float(part.sum() + rest.sum())
    return round(float(part.sum()) / total, 3) if total > 0 else 0.0


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(np.exp(rng.uniform(math.log(low), math.log(high))))


def _enhancing_structures(rng: np.random.Generator, res: float, tissue: dict[str, np.ndarray], depth: np.ndarray,
                          label: np.ndarray) -> np.ndarray:
    """Partial-volume weight (0..1, label-0 voxels only) of healthy tissue that enhances on T1-Gd.

    Why: in v2 only tumour was bright on T1-Gd, so "bright" alone meant "tumour", and on real scans a
    phantom-trained model marked enhancing non-tumour tissue. Two structures, both labelled background:
    cortical and sulcal vessels -- curves where the zero level sets of two smooth random fields cross, kept
    within 20 mm of the brain surface -- and, in most cases, choroid plexus: smooth blobs inside the ventricles.
    """
    shape = label.shape
    controls = tuple(max(4, int(round(n * res / 16.0))) for n in shape)   # ~16 mm between control points
    fields = smooth_field(rng, shape, controls, count=3)
    width = rng.uniform(0.05, 0.1) * max(1.0, res / 2.0) ** 0.5          # tube radius ~ one voxel or more
    vessels = (np.abs(fields[0]) < width) & (np.abs(fields[1]) < width) & (depth < 20.0)
    if rng.random() < 0.7:
        ventricles = (tissue["csf"] > 0.6) & (depth > 25.0)
        vessels |= ventricles & (fields[2] > rng.uniform(0.3, 0.9))
    weight = ndimage.gaussian_filter(vessels.astype(np.float32), 0.5)
    weight = np.clip(weight / max(float(weight.max()), 1e-6) * 1.5, 0.0, 1.0)
    weight[label > 0] = 0.0
    weight[depth == 0] = 0.0                                             # outside the brain
    return weight


def _cap_tumour_weights(weights: dict[str, np.ndarray]) -> None:
    """Rescale (in place) wherever the tumour classes' partial volumes sum past 1, so healthy tissue >= 0."""
    total = sum(weights.values())
    over = total > 1.0
    for w in weights.values():
        w[over] /= total[over]


def _add_satellites(rng: np.random.Generator, label: np.ndarray, weights: dict[str, np.ndarray], res: float,
                    tissue: dict[str, np.ndarray], brain: np.ndarray, depth: np.ndarray) -> None:
    """Shift "lesions": add 1-2 small satellite tumours in white matter away from the primary (in place)."""
    shape = label.shape
    for _ in range(int(rng.integers(1, 3))):
        radius = rng.uniform(7.0, 12.0)
        # far enough from every lesion so far that the satellite's oedema (< ~2.2 radii) stays separate
        clearance = ndimage.distance_transform_edt(label == 0) * res
        candidates = np.argwhere((tissue["wm"] > 0.5) & (depth > 12.0) & (clearance > 2.2 * radius + res))
        if len(candidates) == 0:
            candidates = np.argwhere((tissue["wm"] > 0.5) & (depth > 12.0) & (label == 0))
            if len(candidates) == 0:
                return
        centre = candidates[int(rng.integers(len(candidates)))].astype(np.float32)
        extra_label, extra_weights, _ = _tumour(rng, shape, centre, radius, res, tissue, brain)
        free = (label == 0) & (extra_label > 0)
        label[free] = extra_label[free]
        for name in weights:
            weights[name] += extra_weights[name]
    _cap_tumour_weights(weights)


def _skull_residue(rng: np.random.Generator, image: np.ndarray, brain: np.ndarray, res: float) -> np.ndarray:
    """Shift "skull": leave a patchy 2-5 mm rim of dura, fat and bone marrow outside the brain (in place).

    Real skull stripping is imperfect; the rim is bright on T1 (fat) and T1-Gd (dura enhances). Returns the
    new head mask (brain or rim), which the scanner keeps non-zero; labels stay inside the brain.
    """
    outside = ndimage.distance_transform_edt(~brain) * res
    shell = (outside > 0) & (outside <= max(rng.uniform(2.0, 5.0), 1.01 * res))   # at least a voxel
    shell &= smooth_field(rng, brain.shape, (6, 6, 6), count=1)[0] > rng.uniform(-0.6, 0.3)
    texture = 1.0 + 0.15 * smooth_field(rng, brain.shape, (12, 12, 12), count=1)[0]
    #                     FLAIR T1   T1Gd T2
    for c, value in enumerate((0.7, 1.0, 1.1, 0.6)):
        image[c][shell] = value * float(np.exp(rng.normal(0.0, 0.2))) * texture[shell]
    return brain | shell


def _shifted_scanner(rng: np.random.Generator, profile: ScannerProfile) -> ScannerProfile:
    """Shift "scanner": bias, noise and blur beyond every training site's range; gamma and gains wider."""
    return replace(profile,
                   bias_strength=float(rng.uniform(0.4, 0.6)),      # training sites: 0.05-0.3 (x0.8-1.2)
                   noise=float(rng.uniform(0.08, 0.12)),            # training sites: 0.01-0.06
                   blur_mm=float(rng.uniform(2.0, 3.0)),            # training sites: 0-1.5 mm
                   gamma=tuple(float(g * np.exp(rng.normal(0, 0.25))) for g in profile.gamma),
                   channel_gain=tuple(float(g * np.exp(rng.normal(0, 0.3))) for g in profile.channel_gain))


def _scanner(rng: np.random.Generator, image: np.ndarray, brain: np.ndarray, profile: ScannerProfile,
             res: float) -> np.ndarray:
    """Apply an institution's scanner (and per-case jitter): blur, bias, gamma, scale, Rician noise, mask."""
    shape = image.shape[1:]
    shared_bias = smooth_field(rng, shape, (3, 3, 3), count=1)[0]
    own_bias = smooth_field(rng, shape, (3, 3, 3), count=4)
    blur = profile.blur_mm * rng.uniform(0.8, 1.2) / res
    out = np.empty(shape + (4,), np.int16)
    scale = profile.intensity_scale * float(np.exp(rng.normal(0.0, 0.08)))
    for c in range(4):
        channel = image[c]
        if blur > 0.3:
            channel = ndimage.gaussian_filter(channel, blur)
        strength = profile.bias_strength * rng.uniform(0.8, 1.2)
        channel = channel * np.exp(strength * (0.7 * shared_bias + 0.3 * own_bias[c]))
        gamma = profile.gamma[c] * float(np.exp(rng.normal(0.0, 0.08)))
        channel = np.power(np.maximum(channel, 0.0), gamma)
        channel = channel * (scale * profile.channel_gain[c] * float(np.exp(rng.normal(0.0, 0.1))))
        sigma = profile.noise * float(channel[brain].mean()) * rng.uniform(0.8, 1.2)
        real = channel + sigma * rng.standard_normal(shape, dtype=np.float32)
        imag = sigma * rng.standard_normal(shape, dtype=np.float32)
        channel = np.sqrt(real * real + imag * imag)
        channel[~brain] = 0.0
        # keep every brain voxel non-zero so the brain mask survives the rounding to integers
        out[..., c] = np.where(brain, np.clip(np.rint(channel), 1, 32767), 0).astype(np.int16)
    return out


# ------------------------------------------------------------------------------------------------ writing
def _nifti_gz_bytes(data: np.ndarray, affine: np.ndarray) -> bytes:
    img = nib.Nifti1Image(data, affine)
    img.header.set_xyzt_units("mm", "sec")
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    # mtime=0 and a fixed level: identical inputs give identical files (determinism is tested on bytes)
    return gzip.compress(img.to_bytes(), compresslevel=1, mtime=0)


def _case_name(index: int, total: int) -> str:
    return f"BRATS_{index + 1:0{max(3, len(str(total)))}d}"


@dataclass(frozen=True)
class PhantomSpec:
    """What a phantom collection is generated from: every setting is recorded in its dataset.json
    (``"phantoms"``) and in its cache folder's name (:func:`phantom_folder_name`), so a folder is reused only for
    identical bytes. Validated when built (one-line DataError naming the option).

    Args:
        cases: labelled cases (at least 1).
        institutions: simulated institutions (scanner profiles; at least 1); case i belongs to institution
            i mod M.
        seed: the phantom world's generator seed (subjects, tumours, scanner profiles; non-negative).
        resolution_mm: the voxel size in mm (0.5 to 8).
        test_cases: unlabelled cases in ``imagesTs`` (0 or more; must be 0 in a BraTS layout).
        shift: renders the same subjects in a held-out regime (:data:`SHIFTS`, or factors joined by '+'), for
            measuring generalisation (``none`` = no shift).
    """

    cases: int
    institutions: int
    seed: int
    resolution_mm: float = 2.0
    test_cases: int = 0
    shift: str = Shift.NONE

    def __post_init__(self) -> None:
        shift_parts(self.shift)
        object.__setattr__(self, "shift", str(self.shift))   # the name as written, whichever way it was given
        if self.cases < 1:
            raise DataError(f"--cases={self.cases}: expected at least 1 labelled case")
        if self.institutions < 1:
            raise DataError(f"--institutions={self.institutions}: expected at least 1 institution")
        if self.test_cases < 0:
            raise DataError(f"--test-cases={self.test_cases}: expected 0 or more")
        if not 0.5 <= self.resolution_mm <= 8.0:
            raise DataError(f"--resolution={self.resolution_mm}: expected a voxel size between 0.5 and 8 mm")
        if self.seed < 0:
            raise DataError(f"--seed={self.seed}: expected a non-negative integer")

    def generation_config(self) -> dict:
        """The settings a folder records (and a resumed or reused folder must match)."""
        return {"generator_version": GENERATOR_VERSION, "seed": int(self.seed), "cases": int(self.cases),
                "institutions": int(self.institutions), "resolution_mm": float(self.resolution_mm),
                "test_cases": int(self.test_cases), "shift": self.shift}


def _write_case(out: Path, index: int, total: int, config: dict, labelled: bool) -> dict:
    name = _case_name(index, total)
    image_path = out / ("imagesTr" if labelled else "imagesTs") / f"{name}.nii.gz"
    label_path = out / "labelsTr" / f"{name}.nii.gz"
    institution = institution_name(index % config["institutions"])
    if image_path.exists() and (not labelled or label_path.exists()):
        return {"name": name, "institution": institution}                 # resumed: already complete
    case = make_case(config["seed"], index, config["institutions"], config["resolution_mm"], config["shift"])
    if labelled:
        atomic_write_bytes(label_path, _nifti_gz_bytes(case.label, case.affine))
    atomic_write_bytes(image_path, _nifti_gz_bytes(case.image, case.affine))   # image last = case complete
    return {"name": name, "institution": case.institution}


def _generate_one(args: tuple) -> dict:
    return _write_case(*args)


def generate_phantoms(out: str | os.PathLike, spec: PhantomSpec, progress: bool = True, workers: int = 1,
                      layout: str = "msd") -> Path:
    """Write ``spec.cases`` labelled (+ ``spec.test_cases`` unlabelled) phantoms in the MSD Task01 layout under
    ``out``.

    Resumes an incomplete folder made with the same settings; refuses a folder holding other data.

    Args:
        out: the dataset folder (empty or missing, or an incomplete one with the same settings).
        spec: what the phantoms are generated from (:class:`PhantomSpec`).
        progress: a progress bar.
        workers: ``workers > 1`` generates in that many processes (same bytes as serial generation).
        layout: ``task.data.layouts``: ``msd`` (default), or ``brats2021`` / ``brats2023``, which write the same
            phantoms as BraTS case folders (:func:`_generate_in_layout`).
    """
    from task.data.layouts import get_layout

    if get_layout(layout).per_modality:
        return _generate_in_layout(out, get_layout(layout).name, spec, progress, workers)
    out = Path(out)
    config = spec.generation_config()
    if _claim_folder(out, config):
        return out
    results = _write_cases(out, spec, config, progress, workers)
    _write_manifest(out, spec, config, results)   # last: its presence means the folder is complete
    (out / PROGRESS_FILE).unlink(missing_ok=True)
    return out


def _claim_folder(out: Path, config: dict) -> bool:
    """Make ``out`` ready for the phantoms of ``config``: True when it already holds them, complete; otherwise it
    is empty or an incomplete folder with the same settings, now marked as theirs (:data:`PROGRESS_FILE`).
    A folder holding anything else is refused (DataError)."""
    meta_path, progress_path = out / "dataset.json", out / PROGRESS_FILE
    if meta_path.exists():
        existing = _read_config(meta_path)
        if existing == config:
            return True
        raise DataError(f"{meta_path}: folder already holds a dataset "
                        f"({'other phantom settings' if existing else 'not phantoms of this generator'}); "
                        "expected an empty or missing --out folder")
    if progress_path.exists():
        try:
            previous = json.loads(progress_path.read_text())
        except (OSError, json.JSONDecodeError):
            previous = None
        if previous != config:
            raise DataError(f"{progress_path}: incomplete phantoms with other settings ({previous}); "
                            "expected the same settings to resume, or a new --out folder")
    elif out.exists() and any(p for p in out.iterdir() if not p.name.startswith(".")):
        raise DataError(f"{out}: folder is not empty; expected an empty or missing --out folder")
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    atomic_write_json(progress_path, config)
    return False


def _write_cases(out: Path, spec: PhantomSpec, config: dict, progress: bool, workers: int) -> list[dict]:
    """Write every case not written yet (labelled ones first), serially or in ``workers`` processes; returns
    each case's name and institution, in case order."""
    total = spec.cases + spec.test_cases
    jobs = [(out, i, total, config, i < spec.cases) for i in range(total)]
    bar = tqdm(total=total, desc=f"phantoms {out.name}", unit="case", disable=not progress, leave=False)
    results: list[dict] = []
    if workers > 1:
        # spawned, not forked: a caller may already have run torch's OpenMP pool, which a fork does not survive
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for result in pool.map(_generate_one, jobs, chunksize=2):
                results.append(result)
                bar.update(1)
    else:
        for job in jobs:
            results.append(_generate_one(job))
            bar.update(1)
    bar.close()
    return results


def _write_manifest(out: Path, spec: PhantomSpec, config: dict, results: list[dict]) -> None:
    """dataset.json of the MSD layout, with the generator's settings and the scanner profiles."""
    cases = spec.cases
    profiles = institution_profiles(spec.institutions, spec.seed)
    meta = {
        "name": "BrainTumourPhantoms",
        "description": "Deterministic MNI152-based brain-tumour phantoms in the MSD Task01 layout (fedpate)",
        "reference": "fedpate task.data.phantoms; anatomy: MNI152 template (nilearn)",
        "licence": "CC-BY-SA 4.0 (MNI152 ICBM 2009 template terms apply)",
        "tensorImageSize": "4D",
        "modality": {str(i): m for i, m in enumerate(MODALITIES)},
        "labels": dict(LABELS),
        "numTraining": cases,
        "numTest": spec.test_cases,
        # one subject, one scan: the patient id is the case name, which is also what patient_id() gives folders
        # written before this key existed (same generator version), so their splits and patients agree
        "training": [{"image": f"./imagesTr/{r['name']}.nii.gz", "label": f"./labelsTr/{r['name']}.nii.gz",
                      "institution": r["institution"], "patient": r["name"]} for r in results[:cases]],
        "test": [f"./imagesTs/{r['name']}.nii.gz" for r in results[cases:]],
        "phantoms": {**config, "profiles": [asdict(p) for p in profiles]},
    }
    atomic_write_json(out / "dataset.json", meta)


#: hidden staging folder inside a BraTS-layout phantom folder: the MSD phantoms it is converted from
STAGING = ".msd-phantoms"


def _generate_in_layout(out: str | os.PathLike, layout: str, spec: PhantomSpec, progress: bool,
                        workers: int) -> Path:
    """The phantoms in a BraTS layout: generated in the MSD layout in a hidden staging folder inside ``out``
    (resumable as usual), converted case by case (``task.data.brats.convert_msd_folder``), staging removed.

    Why convert rather than generate again: the same phantoms in every layout, voxel for voxel, is what lets
    the tests show the BraTS path gives the MSD path's arrays and results. A complete folder carries the
    settings in ``task.data.brats.PHANTOMS_MARKER``; asking again with the same settings returns it."""
    import shutil

    from task.data.brats import PHANTOMS_MARKER, convert_msd_folder

    if spec.test_cases:
        raise DataError(f"--test-cases={spec.test_cases}: a BraTS training folder holds labelled cases only "
                        f"(a case folder without seg is an error where labels are needed; BraTS ships unlabelled "
                        f"validation cases as a separate download); expected --test-cases 0 with --layout {layout}")
    out = Path(out)
    config = {**spec.generation_config(), "layout": layout}
    marker, staging = out / PHANTOMS_MARKER, out / STAGING
    if marker.exists():
        existing = _read_config_file(marker)
        if existing is not None and {k: existing.get(k) for k in config} == config:
            return out
        raise DataError(f"{marker}: folder already holds phantoms with other settings; expected an empty or "
                        "missing --out folder")
    if out.exists() and not staging.exists() and any(p for p in out.iterdir() if not p.name.startswith(".")):
        raise DataError(f"{out}: folder is not empty; expected an empty or missing --out folder")
    generate_phantoms(staging, spec, progress=progress, workers=workers)
    convert_msd_folder(staging, out, layout)
    shutil.rmtree(staging, ignore_errors=True)
    return out


def _read_config_file(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _read_config(meta_path: Path) -> dict | None:
    try:
        block = json.loads(meta_path.read_text()).get("phantoms")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(block, dict):
        return None
    return {k: block.get(k) for k in ("generator_version", "seed", "cases", "institutions", "resolution_mm",
                                      "test_cases", "shift")}


@dataclass(frozen=True)
class PhantomCollection:
    """Which of a preset's phantom settings a collection replaces (None, and ``none`` for ``shift``: the
    preset's): the other centre's public collection (``task.world``) has its own cases, institutions and regime.
    """

    cases: int | None = None
    institutions: int | None = None
    test_cases: int | None = None
    shift: str = Shift.NONE

    def __post_init__(self) -> None:
        shift_parts(self.shift)

    def spec(self, preset, seed: int = 0) -> PhantomSpec:
        """The collection's :class:`PhantomSpec` under ``preset`` (its phantom settings and resolution) and
        ``seed``."""
        world = preset.world
        return PhantomSpec(cases=world.phantom_cases if self.cases is None else self.cases,
                           institutions=world.institutions if self.institutions is None else self.institutions,
                           seed=seed, resolution_mm=world.phantom_resolution_mm,
                           test_cases=world.phantom_test_cases if self.test_cases is None else self.test_cases,
                           shift=self.shift)


def phantom_folder_name(preset, spec: PhantomSpec) -> str:
    """Cache folder of a phantom collection: every generation setting is in the name, so a folder is reused
    only for identical bytes (the shift is named when there is one, keeping older names for "none").

    Args:
        preset: the :class:`task.settings.presets.Preset` whose collection it is (its name).
        spec: the collection's settings (:meth:`PhantomCollection.spec`).
    """
    shift = "" if spec.shift == Shift.NONE else "-" + spec.shift
    return (f"phantoms-{preset.name}-n{spec.cases}-t{spec.test_cases}-m{spec.institutions}-{spec.resolution_mm:g}mm"
            f"-seed{spec.seed}{shift}-v{GENERATOR_VERSION}")


def ensure_phantoms(preset, cache_root: str | os.PathLike | None = None, seed: int = 0,
                    progress: bool = True, workers: int = 1, *,
                    collection: PhantomCollection | None = None) -> Path:
    """Phantoms for ``preset`` (a resolved :class:`task.settings.presets.Preset`: the data layer reads presets, it does not
    parse them), generated once and cached.

    Cached in a folder named after the preset, its phantom settings, the seed and :data:`GENERATOR_VERSION`
    (:func:`phantom_folder_name`). A file lock serialises concurrent callers (several test sessions or runs
    share the cache).

    Args:
        preset: a :class:`task.settings.presets.Preset` (``task.settings.presets.get_preset`` resolves a name).
        cache_root: the cache folder (None = ``$FEDPATE_CACHE`` or ``~/.cache/fedpate``).
        seed: the generator seed.
        progress: a progress bar while generating.
        workers: generating processes (:func:`generate_phantoms`).
        collection: the settings that replace the preset's (the other centre's public collection,
            task.world); None = the preset's own collection.
    """
    if isinstance(preset, str):
        raise TypeError(f"ensure_phantoms: expected a task.settings.presets.Preset, got the name {preset!r} "
                        "(task.settings.presets.get_preset resolves it)")
    spec = (collection or PhantomCollection()).spec(preset, seed)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / phantom_folder_name(preset, spec)
    if (out / "dataset.json").exists():
        return out
    with _file_lock(root / f".{out.name}.lock"):
        return generate_phantoms(out, spec, progress=progress, workers=workers)


def _file_lock(path: Path):
    """Exclusive advisory lock on ``path`` (``task.io.held_lock_file``: the file exists only while held)."""
    from task.io import held_lock_file

    return held_lock_file(path)
