"""Which generator factors make the real-scan check pass? Ablations of phantom generator v3 (docs/GENERALISATION.md).

Generates 64 phantoms at 3 mm (world ``--seed``) with some v3 factors switched off, prepares them at 32³,
and runs ``run.py`` on them (reusing the brain masks in ``--masks`` if given). Switching a factor off keeps
every random draw, so the rest of the world is unchanged. ``v2code`` generates with generator v2 itself,
read from git (commit bc6aea9), for the control.

Run: ``PYTHONPATH=/tmp/realcheck/site .venv/bin/python benchmarks/real_scan_check/ablate.py all_off --seed 1
--qtim DIR --masks runs/real-scan-check``; results in ``--out/NAME-sSEED/rc/real_scan_check.json``.
Results and their reading: docs/GENERALISATION.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

V2_COMMIT = "bc6aea9"   # last commit with generator version 2
ABLATIONS = ("v3", "v2code", "no_vessels", "fixed_enhancement", "no_healthy_contrast", "no_solid",
             "v2_tumours", "all_off")


def generator(name: str, scratch: Path):
    """The phantoms module with ``name``'s factors switched off (module constants; same random draws)."""
    if name == "v2code":
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{V2_COMMIT}:sim/data/phantoms.py"],
                                check=True, capture_output=True, text=True).stdout
        # that commit's generator imports the core modules under their old package name (sim.), now task.
        source = source.replace("from sim.", "from task.")
        path = scratch / "phantoms_v2.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("phantoms_v2", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["phantoms_v2"] = module          # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
        return module
    import task.data.phantoms as ph

    off = {"all_off": {"vessels", "enhancement", "contrast", "solid", "oedema"},
           "no_vessels": {"vessels"}, "fixed_enhancement": {"enhancement"}, "no_healthy_contrast": {"contrast"},
           "no_solid": {"solid"}, "v2_tumours": {"solid", "oedema"}, "v3": set()}[name]
    if "vessels" in off:
        original = ph._enhancing_structures
        ph._enhancing_structures = lambda *a: original(*a) * 0.0
    if "enhancement" in off:
        ph.ENHANCEMENT_RATIO = (1.79, 1.79 * (1 + 1e-7))          # v2: 1.40 / 0.78, fixed
    if "contrast" in off:
        ph.GREY_WHITE_CONTRAST = ph.CSF_CONTRAST = (1.0, 1.0 + 1e-7)
    if "solid" in off:
        ph.SOLID_ENHANCING_SHARE = 0.0
    if "oedema" in off:
        ph.LITTLE_OEDEMA_SHARE = 0.0
    return ph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=ABLATIONS)
    parser.add_argument("--seed", type=int, default=0, help="phantom world")
    parser.add_argument("--qtim", required=True, type=Path, help=".../qtim_tools/test_data/test_data_features")
    parser.add_argument("--masks", type=Path, help="folder with *_brainmask.nii.gz from an earlier run.py")
    parser.add_argument("--out", type=Path, default=Path("runs/real-scan-ablations"))
    args = parser.parse_args()

    from task.data.preprocess import PreprocessConfig, prepare_dataset

    out = args.out / f"{args.name}-s{args.seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    phantoms = generator(args.name, out)
    # workers=1: the switched-off factors are patched into this process only
    settings = dict(cases=64, institutions=4, seed=args.seed, resolution_mm=3.0)
    if hasattr(phantoms, "PhantomSpec"):   # today's generator takes its settings as one spec
        train = phantoms.generate_phantoms(out / "train", phantoms.PhantomSpec(**settings), workers=1, progress=False)
    else:                                  # v2's, read from git, takes them one by one
        train = phantoms.generate_phantoms(out / "train", **settings, workers=1, progress=False)
    prepare_dataset(train, out / "prepared", PreprocessConfig(grid=(32, 32, 32)), progress=False)
    (out / "rc").mkdir()
    for mask in (args.masks.glob("*_brainmask.nii.gz") if args.masks else []):
        shutil.copy(mask, out / "rc" / mask.name)
    with open(out / "rc.log", "w") as log:
        subprocess.run([sys.executable, str(Path(__file__).with_name("run.py")), "--qtim", str(args.qtim),
                        "--train", str(out / "prepared"), "--out", str(out / "rc")],
                       check=True, stdout=log, stderr=subprocess.STDOUT)
    print(args.name, args.seed, (out / "rc" / "real_scan_check.json").read_text())


if __name__ == "__main__":
    main()
