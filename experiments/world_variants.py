"""The generator-3 variants the world probe measured (``experiments.probe_world``), as patches of
``task.data.phantoms`` at generator 3 (commit ec427cf): ``int`` (tumour classes drawn in wide ranges around their
clinical order), ``def`` (only the defining contrasts kept), ``def2`` (and T1-Gd of the non-enhancing classes drawn
apart from their T1), ``h`` suffix (healthy tissue with wide grey/white and CSF ratios), ``morph`` (thicker, nodular,
sometimes broken shells, heterogeneous cores). Generator 4 is ``def2h+morph``, written into the product."""
import math
import numpy as np
from scipy import ndimage

# tumour class means relative to this case's parenchyma mean (mean of GM and WM) per sequence, uniform ranges
TUMOUR_RANGES = {
    "flair": {"edema": (1.3, 2.4), "necrotic": (0.3, 2.4), "solid": (1.1, 2.2), "enhancing": (1.0, 2.2)},
    "t2":    {"edema": (1.3, 2.4), "necrotic": (1.3, 3.0), "solid": (1.0, 2.2), "enhancing": (0.9, 2.2)},
    "t1":    {"edema": (0.55, 1.0), "necrotic": (0.3, 1.25), "solid": (0.5, 1.05), "enhancing": (0.6, 1.25)},
}


# only what defines a class is kept (oedema and solid tumour FLAIR-hyperintense, enhancing tissue T1-Gd-bright);
# T2 and T1 of every tumour class drawn from hypo- to hyperintense
DEFINITIONAL_RANGES = {
    "flair": {"edema": (1.15, 2.4), "necrotic": (0.3, 2.4), "solid": (1.1, 2.4), "enhancing": (0.9, 2.4)},
    "t2":    {"edema": (0.8, 2.6), "necrotic": (0.8, 3.0), "solid": (0.8, 2.4), "enhancing": (0.7, 2.4)},
    "t1":    {"edema": (0.5, 1.2), "necrotic": (0.3, 1.3), "solid": (0.5, 1.2), "enhancing": (0.5, 1.3)},
}


# def2: T1 and T1-Gd of the non-enhancing classes drawn independently of each other, from hypo- to hyperintense;
# FLAIR contrast of the oedema from subtle to strong
DEFINITIONAL2_RANGES = {
    "flair": {"edema": (1.1, 2.4), "necrotic": (0.3, 2.6), "solid": (1.05, 2.4), "enhancing": (0.9, 2.4)},
    "t2":    {"edema": (1.05, 2.8), "necrotic": (0.9, 3.5), "solid": (0.9, 2.6), "enhancing": (0.8, 2.6)},
    "t1":    {"edema": (0.5, 1.3), "necrotic": (0.3, 1.5), "solid": (0.5, 1.4), "enhancing": (0.5, 1.5)},
    "t1gd":  {"edema": (0.5, 1.2), "necrotic": (0.3, 1.2), "solid": (0.6, 1.2)},
}

# healthy tissue per sequence relative to white matter: (GM/WM, CSF/WM) ranges, wide (SynthSeg-style) and covering
# real scans' long bright CSF tail on T2 and dark CSF on FLAIR
HEALTHY_RANGES = {
    "flair": ((1.0, 1.45), (0.15, 0.7)),
    "t1":    ((0.6, 0.95), (0.2, 0.55)),
    "t1gd":  ((0.6, 1.0), (0.2, 0.6)),
    "t2":    ((1.05, 1.6), (1.6, 4.0)),
}


def make_intensities(ph, ranges=TUMOUR_RANGES, healthy_ranges=None):
    MODALITIES = ph.MODALITIES
    def _intensities(rng, tissue, vessels, tumour_weights, core_kind, label, contrast_shift=False):
        shape = label.shape
        image = np.zeros((4, *shape), np.float32)
        tumour_total = sum(tumour_weights.values())
        healthy = 1.0 - tumour_total
        texture = 1.0 + 0.04 * ph.smooth_field(rng, shape, (9, 11, 9), count=1)[0]
        enhancement = ph._log_uniform(rng, *ph.ENHANCEMENT_RATIO)
        vessel_enhancement = ph._log_uniform(rng, *ph.VESSEL_RATIO)
        per_channel = {}
        names = ("flair", "t1", "t1gd", "t2")      # channel order FLAIR, T1w, t1gd, T2w
        for c in (1, 2, 0, 3):
            seq = names[c]
            jitter = 0.21 if contrast_shift else 0.07
            means = {name: ph.CONTRAST[name][c] * float(np.exp(jitter * rng.normal(0.0, 1.0))) for name in ph.CONTRAST}
            means["wm"] = means["gm"] + ph._log_uniform(rng, *ph.GREY_WHITE_CONTRAST) * (means["wm"] - means["gm"])
            means["csf"] = means["gm"] + ph._log_uniform(rng, *ph.CSF_CONTRAST) * (means["csf"] - means["gm"])
            if healthy_ranges is not None:
                (g_lo, g_hi), (c_lo, c_hi) = healthy_ranges[seq]
                wm = ph.CONTRAST["wm"][c] * float(np.exp(0.1 * rng.normal()))
                means["wm"], means["gm"], means["csf"] = wm, wm * rng.uniform(g_lo, g_hi), wm * rng.uniform(c_lo, c_hi)
            parenchyma = 0.5 * (means["gm"] + means["wm"])
            if seq == "t1gd" and "t1gd" in ranges:
                for name, (lo, hi) in ranges["t1gd"].items():
                    means[name] = parenchyma * rng.uniform(lo, hi)
                means["enhancing"] = max(means["wm"], means["gm"]) * enhancement
                means["vessel"] = max(means["wm"], means["gm"]) * vessel_enhancement
            elif seq == "t1gd":
                t1 = per_channel["t1"]
                t1_par = 0.5 * (t1["gm"] + t1["wm"])
                for name in ("edema", "necrotic", "solid"):
                    means[name] = t1[name] / t1_par * parenchyma * rng.uniform(0.95, 1.1)
                means["enhancing"] = max(means["wm"], means["gm"]) * enhancement
                means["vessel"] = max(means["wm"], means["gm"]) * vessel_enhancement
            else:
                for name, (lo, hi) in ranges[seq].items():
                    means[name] = parenchyma * rng.uniform(lo, hi)
            per_channel[seq] = means
            par = tissue["csf"] * means["csf"] + tissue["gm"] * means["gm"] + tissue["wm"] * means["wm"]
            channel = (par * (1.0 - vessels) + vessels * means["vessel"]) * healthy
            for name, weight in tumour_weights.items():
                key = core_kind if name == "core" else name
                channel += weight * means[key]
            image[c] = channel * texture
        lesion = label > 0
        if lesion.any():
            speckle = ndimage.gaussian_filter(rng.standard_normal(shape).astype(np.float32), 0.8) * 0.25
            for c in range(4):
                image[c][lesion] *= 1.0 + speckle[lesion]
        return image, enhancement
    return _intensities


def apply(name, ph):
    parts = set(name.split("+"))
    if "base" in parts:
        return
    if "int" in parts:
        ph._intensities = make_intensities(ph)
    if "def" in parts:
        ph._intensities = make_intensities(ph, DEFINITIONAL_RANGES)
    if "def2" in parts:
        ph._intensities = make_intensities(ph, DEFINITIONAL2_RANGES)
    if "def2h" in parts:
        ph._intensities = make_intensities(ph, DEFINITIONAL2_RANGES, HEALTHY_RANGES)
    if "defh" in parts:
        ph._intensities = make_intensities(ph, DEFINITIONAL_RANGES, HEALTHY_RANGES)
    if "morph" in parts:
        ph._cap_tumour_weights = _cap(ph)
        ph._tumour = make_tumour(ph)
    unknown = parts - {"int", "morph", "def", "defh", "def2", "def2h"}
    if unknown:
        raise SystemExit(f"unknown variant part {unknown}")


def make_tumour(ph, rim_mm=(3.0, 8.0), core_share=(0.5, 0.85), broken=0.4, mixed=True):
    """Tumour with thicker, nodular, sometimes broken enhancing rims and heterogeneous (necrotic + solid) cores."""
    def _tumour(rng, shape, p, r_edema, res, tissue, brain):
        rim = max(rng.uniform(*rim_mm), 1.1 * res)
        share = rng.uniform(0.8, 0.95) if rng.random() < ph.LITTLE_OEDEMA_SHARE else rng.uniform(*core_share)
        r_core = max(r_edema * share, rim + 1.6 * res)
        rim = min(rim, 0.6 * r_core)
        solid_enhancing = rng.random() < ph.SOLID_ENHANCING_SHARE
        r_edema = max(r_edema, r_core + 2.5 * res)
        half = int(math.ceil(2.8 * r_edema / res)) + 2
        lo = np.maximum(np.floor(p).astype(int) - half, 0)
        hi = np.minimum(np.floor(p).astype(int) + half + 1, shape)
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        bshape = tuple(int(b - a) for a, b in zip(lo, hi))
        rel = [(np.arange(a, b, dtype=np.float32) - pc) * res for a, b, pc in zip(lo, hi, p)]
        axes = ph._rotation(rng.uniform(0, np.pi, 3)).astype(np.float32)
        stretch = rng.uniform(0.75, 1.3, 3).astype(np.float32)
        u = [(axes[d, 0] * rel[0][:, None, None] + axes[d, 1] * rel[1][None, :, None]
              + axes[d, 2] * rel[2][None, None, :]) / stretch[d] for d in range(3)]
        dist = np.sqrt(u[0] ** 2 + u[1] ** 2 + u[2] ** 2)
        if rng.random() < 0.45:
            direction = rng.normal(size=3)
            offset = direction / max(float(np.linalg.norm(direction)), 1e-6) * rng.uniform(0.5, 0.9) * r_core
            lobe_scale = rng.uniform(0.5, 0.8)
            lobe = np.sqrt((u[0] - offset[0]) ** 2 + (u[1] - offset[1]) ** 2 + (u[2] - offset[2]) ** 2) / lobe_scale
            dist = np.minimum(dist, lobe.astype(np.float32))
        noise = np.clip(ph.smooth_field(rng, bshape, (5, 5, 5), count=4), -1.5, 1.5)
        f_core = dist / r_core + rng.uniform(0.1, 0.25) * noise[0]
        finger = np.clip(ph.smooth_field(rng, bshape, (8, 8, 8), count=1)[0], -1.5, 1.5)
        f_edema = dist / r_edema + rng.uniform(0.12, 0.25) * noise[1] + rng.uniform(0.08, 0.2) * finger
        f_edema = f_edema - rng.uniform(0.1, 0.3) * (tissue["wm"][box] - 0.5)
        if solid_enhancing:
            inner = rng.uniform(0.2, 0.4) * (1.0 + 0.3 * noise[2])
        else:
            inner = 1.0 - rim / r_core * (1.0 + 0.5 * noise[2])      # nodular: thickness varies more
        in_brain = brain[box]
        spared = tissue["csf"][box] > 0.6
        core = (f_core < 1.0) & in_brain
        necrotic = core & (f_core < inner)
        enhancing = core & ~necrotic
        if rng.random() < broken:   # broken rim: part of the shell does not enhance (non-enhancing tumour)
            gate = noise[3] < rng.uniform(-1.0, 0.0)
            necrotic |= enhancing & gate
            enhancing &= ~gate
        edema = (f_edema < 1.0) & in_brain & ~core & ~spared
        local = np.zeros(bshape, np.uint8)
        local[edema], local[necrotic], local[enhancing] = 1, 2, 3
        label = np.zeros(shape, np.uint8)
        label[box] = local
        core_kind = "necrotic" if rng.random() < 0.6 else "solid"
        weights = {}
        for name, value in (("edema", 1), ("core", 2), ("enhancing", 3)):
            w = np.zeros(shape, np.float32)
            inside = (local == value).astype(np.float32)
            w[box] = np.where(local > 0, inside, ndimage.gaussian_filter(inside, 0.6))
            weights[name] = w
        if mixed:   # heterogeneous core: fluid (necrotic) and solid parts side by side inside label 2
            part = np.zeros(shape, np.float32)
            part[box] = ph.smooth_field(rng, bshape, (6, 6, 6), count=1)[0] > rng.uniform(-0.8, 0.8)
            weights["necrotic"] = weights["core"] * part
            weights["solid"] = weights["core"] * (1.0 - part)
            del weights["core"]
        fade = np.ones(shape, np.float32)
        fade[box] = 1.0 - 0.45 * np.clip(f_edema, 0.0, 1.0) ** 2
        weights["edema"] *= fade
        ph._cap_tumour_weights(weights)
        return label, weights, core_kind, solid_enhancing
    return _tumour


def _cap(ph):
    def cap(weights):
        total = sum(weights.values())
        over = total > 1.0
        for w in weights.values():
            w[over] /= total[over]
    return cap
