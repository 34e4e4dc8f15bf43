"""Levers of the world probe (``experiments.probe_world``; docs/decisions/world-realism.md), as patches of the
product's generator joined to ``current`` with '+':

* ``template`` -- generator 4's subjects: the MNI152 template's size scaled by 0.92-1.08 (the same draws as
  generator 5's adult sizes, so ``current+template`` makes generator 4's phantoms exactly);
* ``brain`` -- subjects as large as adult brains with a free per-axis spread (the probe's version of generator 5,
  which keeps the drawn volume);
* ``rim`` -- broken enhancing shells opened by a finer field (9 control points, 25-50 % of the shell);
* ``atrophy`` -- CSF as much of the brain as in adults of glioma age: the template's ~11 % of the brain mask
  raised, per subject, to a share drawn in 11-25 %, the CSF growing into the parenchyma next to CSF already there
  (wider sulci, larger ventricles); measured on generator 5 at commit 328bfd9, where the lever held its own copy
  of the growth, which it turns into generator 6 up to the draw of each subject's share (generator 6 draws it
  from a stream of the seed and the case). Here it calls the product's ``_atrophy``, so on generator 6 (and 7) it only
  grows a subject whose drawn share is above the product's;
* ``meninges`` -- enhancing tissue at the brain's surface, as skull-stripped post-contrast scans keep it: dura,
  cortical veins and venous sinuses lie inside BraTS' brain masks and enhance on T1-Gd (on the development scans
  5-7 % of the outermost grid layer's healthy voxels are above z 1 on T1-Gd, and 74-100 % of the healthy voxels
  above z 1.5; on generator-6 phantoms none of the outermost layer, the bright voxels lying deep). A patchy layer
  3-6 mm thick covering 15-40 % of the surface takes the vessels' intensities (enhancing on T1-Gd, dark on T2 and
  FLAIR), drawn from a stream of its own so every other draw of the case is the generator's;
* ``sharp`` -- tissue maps as crisp as one subject's: the MNI152 template's grey-matter, white-matter and CSF maps
  are population averages, blurred by the spread between subjects, so a phantom's parenchyma is a continuum of
  tissue and CSF mixtures. The lever raises the three maps to the fourth power and renormalises them to the same
  total before the CSF grows (partial volume then comes from the rendering's resolution). On the development
  scans the healthy parenchyma's interquartile range is 0.48-0.62 z on T2 and 0.61-0.72 on T1-Gd; on
  generator-6 phantoms 0.89 and 0.93, and 0.78 and 0.96 with the lever (16 phantoms). Grey/white contrast is not
  the cause (equal grey and white matter leave 0.84 and 0.89), nor is the scanner (no bias field: 0.80 and 0.87);
* ``compartments`` -- CSF grown in whole voxels: generator 6's ``_atrophy`` moves a fraction of every voxel's grey
  and white matter near CSF into CSF, so a phantom's parenchyma around the sulci and ventricles is a mixture of
  tissue and CSF at every voxel; in a real brain the widened sulci and ventricles are compartments of pure CSF
  beside pure tissue, mixed only at their borders. The lever grows the same share of CSF (the same draw) by turning
  whole voxels, the nearest to existing CSF first, into CSF. The healthy tissue's width on T2 falls from 0.90 to
  0.64 z on 16 phantoms (real 0.48-0.62);
* ``robustnorm`` -- not a world lever but the preprocessing's, for real and phantom scans alike: each channel
  centred on its median inside the brain and scaled by its interquartile range / 1.349 (a Gaussian's standard
  deviation) instead of its mean and standard deviation. Why: the standard deviation is carried by the tails
  (CSF on T2, enhancing vessels and dura on T1-Gd, the lesion itself), which differ between phantoms and real
  scans, so the same tumour contrast lands at different z; the interquartile range is the parenchyma's;
* ``eccentric`` -- oedema reaching far from the core on one side: generator 7 centres the oedema on the core, so
  its reach beyond the core is the oedema's radius less the core's (3-19 mm, before the noise), and the 95th
  percentile of the oedema's distance from the core is 15-17 mm on the median phantom, where the development cases
  reach 9-28 mm (median 20.5). Real peritumoral oedema spreads unevenly, along white-matter tracts, far on one side and not at all where
  the tumour meets the cortex; a probe model misses the oedema far from the core even where its FLAIR contrast is
  the same as near it. The lever moves the oedema's centre off the core's by up to ``ECCENTRICITY`` of its radius
  (``task.data.phantoms.OEDEMA_ECCENTRICITY``, a stream of its own);
* ``mixededge`` -- the lesion's edge in the middle of its partial-volume step: generator 7 keeps labelled voxels pure
  and lets partial volume spill only into the unlabelled neighbours, so the first labelled layer is as bright as the
  lesion's inside allows; a real label's edge (a rater's, or a 1 mm label taken down to the grid) lies where the
  voxels are about half tumour, so its outermost labelled voxels are partly healthy. On the grid, the oedema's first
  layer over its second on FLAIR (less the healthy median): the development cases 0.60, 0.69, 0.60, 0.67; 59
  generator-7 phantoms of seed 5 0.65-0.81 (5th-95th percentile, median 0.75), with the lever 0.49-0.71 (median
  0.66). The lever blurs every tumour class's weight on both sides of the label's edge with the generator's own
  kernel (``task.data.phantoms.LESION_EDGE_MIXED``); it has no setting of its own;
* ``nnaug`` -- nnU-Net's spatial augmentation: rotations up to 30 degrees, scaling 0.7-1.4, low-resolution
  simulation (Isensee et al. 2021, arXiv 1809.10486).

Generator 7 is generator 6 with ``sharp`` and ``compartments`` built in (``current+compartments+sharp`` on generator
6 made generator 7's phantoms bit for bit), so the two are no longer levers of ``current``: their code, as measured
on generator 6, is this file at commit 0dbb82e. Every lever's numbers in the decision note name the generator they
were measured on.

The decision note's generator-4 rows were measured as ``current``, ``current+brain``, ``current+rim``,
``current+nnaug`` and ``current+brain+rim`` on generator 4; on generator 5 the same rows are ``current+template``,
``current+brain`` (the probe's brain), ``current+template+rim``, ``current+template+nnaug`` and ``current+brain+rim``.
"""
import numpy as np


def _brain_scales(ph):
    def scales(rng, res):
        # the product's adult volumes and template volume (generator 5), without its volume-keeping spread
        overall = (rng.uniform(*ph.BRAIN_ML) / ph._anatomy(res)["brain_ml"]) ** (1.0 / 3.0)
        return overall * rng.uniform(0.95, 1.05, 3)
    return scales


def _template_scales(ph):
    def scales(rng, res):
        return rng.uniform(0.92, 1.08) * rng.uniform(0.95, 1.05, 3)
    return scales


def _finer_gap(ph):
    def gap(rng, field, shell):
        fine = ph.smooth_field(rng, field.shape, (9, 9, 9), count=1)[0]
        share = rng.uniform(0.25, 0.5)                       # of the shell that does not enhance
        if not shell.any():
            return np.zeros(field.shape, bool)
        return fine < np.quantile(fine[shell], share)
    return gap


def _atrophy(ph):
    original = ph._tumour

    def tumour(rng, shape, p, r_edema, res, tissue, brain):
        # the tissue maps are shared with the rest of make_case: changed in place, before the lesion is drawn,
        # by the product's own growth (generator 6's ``_atrophy``) from a stream seeded from the case's without
        # advancing it, so every other draw of the case stays the generator's and the lever is paired case by
        # case with ``current``
        ph._atrophy(np.random.default_rng([rng.bit_generator.state["state"]["state"], 0xA7]), tissue, brain)
        return original(rng, shape, p, r_edema, res, tissue, brain)

    ph._tumour = tumour


def _meninges(ph):
    original = ph._enhancing_structures

    def structures(rng, res, tissue, depth, label):
        own = np.random.default_rng([rng.bit_generator.state["state"]["state"], 0x3E1])
        weight = original(rng, res, tissue, depth, label)
        shape = label.shape
        controls = tuple(max(4, int(round(n * res / 16.0))) for n in shape)
        field = ph.smooth_field(own, shape, controls, count=1)[0]
        surface = (depth > 0) & (depth <= max(own.uniform(3.0, 6.0), 1.01 * res))
        if not surface.any():
            return weight
        cover = field > np.quantile(field[surface], 1.0 - own.uniform(0.15, 0.4))
        layer = surface & cover & (label == 0)
        return np.maximum(weight, layer.astype(np.float32) * own.uniform(0.6, 1.0))

    ph._enhancing_structures = structures


def _robust_normalisation():
    import task.data.preprocess as preprocess

    def channel_centre_and_scale(values):
        # the median and the interquartile range / 1.349 (a Gaussian's standard deviation) in place of the mean
        # and the standard deviation; preprocess_case looks the helper up at call time, so real and phantom
        # scans alike take it
        q25, centre, q75 = (float(v) for v in np.percentile(values, (25, 50, 75)))
        scale = (q75 - q25) / 1.349
        return centre, (scale if scale > 1e-6 else 1.0)

    preprocess.channel_centre_and_scale = channel_centre_and_scale


def _nnunet_augmentation():
    import task.data.augment as augment
    from monai.transforms import Compose, RandSimulateLowResolution, RandZoom

    original_init = augment.TrainingAugmentation.__init__

    def init(self, seed=0, prob=0.5, max_rotation_deg=10.0, intensity=True, intensity_prob=0.3, classes=4):
        original_init(self, seed=seed, prob=prob, max_rotation_deg=30.0, intensity=intensity,
                      intensity_prob=intensity_prob, classes=classes)
        zoom = RandZoom(prob=0.2, min_zoom=0.7, max_zoom=1.4, keep_size=True, mode="trilinear",
                        padding_mode="constant")
        self._rotate = Compose([self._rotate, zoom])
        if self._intensity is not None:
            self._intensity = Compose([*self._intensity.transforms,
                                       RandSimulateLowResolution(prob=0.25, zoom_range=(0.5, 1.0))])
        self.set_random_state(seed)

    augment.TrainingAugmentation.__init__ = init


#: the ``eccentric`` lever's bound on the oedema's shift off the core, as a share of its radius: of the two bounds
#: tried, the one that brings the median phantom's oedema reach to the development cases' median (the 95th
#: percentile of the oedema's distance from the core, median over 60 phantoms of seed 5: generator 7 17.2 mm, 0.5 ->
#: 17.6 mm, 0.8 -> 19.8 mm; the four development cases 9-28 mm, median 20.5; the share of the oedema beyond 15 mm:
#: 0.11, 0.12, 0.21; real median 0.20; `experiments.oedema_reach`). Chosen on the scans' geometry, not on any Dice.
ECCENTRICITY = 0.8


def apply(name, ph):
    parts = name.split("+")
    if parts[0] != "current":
        raise SystemExit("levers patch the product's generator: VARIANT starts with 'current'")
    unknown = set(parts[1:]) - {"template", "brain", "rim", "nnaug", "atrophy", "meninges", "sharp", "robustnorm",
                                  "compartments", "eccentric", "mixededge"}
    if unknown:
        raise SystemExit(f"unknown lever {unknown}")
    if "template" in parts and "brain" in parts:
        raise SystemExit("levers 'template' and 'brain' both set the subject's size: name one")
    if "template" in parts:
        ph._subject_scales = _template_scales(ph)
    if "brain" in parts:
        ph._subject_scales = _brain_scales(ph)
    if "rim" in parts:
        ph._shell_gap = _finer_gap(ph)
    if "nnaug" in parts:
        _nnunet_augmentation()
    if "atrophy" in parts:
        _atrophy(ph)
    if "meninges" in parts:
        _meninges(ph)
    if "eccentric" in parts:
        ph.OEDEMA_ECCENTRICITY = ECCENTRICITY
    if "mixededge" in parts:
        ph.LESION_EDGE_MIXED = True
    built_in = {"compartments", "sharp"} & set(parts)
    if built_in:
        raise SystemExit(f"levers {sorted(built_in)} are generator 7 itself; as measured on generator 6 they are in "
                         "experiments/world_levers.py at commit 0dbb82e")
    if "robustnorm" in parts:
        _robust_normalisation()
