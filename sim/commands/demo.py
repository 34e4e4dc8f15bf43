"""``fedpate demo``: the README's main job -- PATE vs DP-SGD vs baselines on freshly generated phantoms.

A ``fedpate compare`` on the quick preset (its hospitals, teachers and grid: ``--preset``'s help, read from
``task.settings.presets``), sized for a 2-core CPU, followed by a prediction with the best PATE
student on a scan it has never seen, written as NIfTI in that scan's own grid.

Every private method starts from the same public model: PATE's teachers and student, DP-SGD
on the pooled patients and DP-FedAvg across the hospitals (``--init scratch`` for random weights). The
federated cells run in this process through the same protocol code as the Flower apps, with torch on
every core; ``--engine flower`` runs them as Flower ClientApps and ServerApp in Flower's simulation engine.
"""

from __future__ import annotations

#: PATE with its best codec here (pate-ae and pate-pca are one `fedpate compare --methods` away: on this world
#: their decoded ensembles carry almost nothing, docs/RESULTS.md), the DP baselines, the non-private yardstick
#: and both public floors (public-selftrain: what the public query scans give with no hospital)
DEMO_METHODS = "pate-anchored,dp-sgd-central,dp-fedavg,nonprivate-central,public-only,public-selftrain"
DEMO_EPSILONS = "1,8"
#: ``--secure``: both secure-aggregation variants beside their trusted counterparts (the aggregator then sees only
#: noisy sums); not in the default demo because they add about 10 minutes on 2 CPU cores (docs/RESULTS.md)
SECURE_METHODS = "pate-anchored-secure,dp-fedavg-secure"
#: with real cases to check on: DP-SGD adapting the public model's decoder beside its voxel head. On phantoms (and on
#: public validation) the voxel head is the better DP-SGD; the decoder may carry more to real scans. Only real cases
#: can show which, so the demo runs both when it has some, and the report's real-scan table shows where the phantom
#: and real rankings disagree (docs/decisions/dp-sgd-decoder.md)
REAL_CHECK_METHODS = "dp-sgd-central-decoder"


def register(subparsers) -> None:
    from sim.commands.common import (SEED_HELP, add_compute_options, add_real_check_option, non_negative_integer,
                                     preset_help)
    from task.options import COMPARE_ENGINES, Engine, Init

    parser = subparsers.add_parser(
        "demo", help="the end-to-end demo (compare on fresh phantoms, then predict a new scan)",
        description=f"Runs `fedpate compare --preset PRESET --methods {DEMO_METHODS} --epsilons {DEMO_EPSILONS}` "
                    "(PRESET: --preset, quick by default; federated cells in-process by default, --engine flower for "
                    "Flower's simulation engine), then `fedpate predict` with the best PATE student.")
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    parser.add_argument("--preset", default="quick", choices=("tiny", "quick"),
                        help=preset_help("quick", ("tiny", "quick")))
    parser.add_argument("--seed", type=non_negative_integer, default=0, help=SEED_HELP)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--workers", default="auto",
                        help="how many cells run at once, each group in its own process with its share of the cores "
                             "(default auto with --engine inprocess: 2 on a CPU with 2+ cores; on a GPU as many as its "
                             "free memory holds at 8 GiB each, at most 4 and one per 2 cores; else 1)")
    parser.add_argument("--engine", default=Engine.INPROCESS, choices=COMPARE_ENGINES,
                        help="federated cells in this process (default; same protocol code as the Flower apps, torch "
                             "on every core) or as Flower apps in Flower's simulation engine")
    parser.add_argument("--init", default=Init.PUBLIC, choices=tuple(Init),
                        help="where DP-SGD, DP-FedAvg and non-private training start (default: the public model)")
    parser.add_argument("--reproducible-noise", action="store_true",
                        help="SIMULATION ONLY: seeded noise streams so the demo repeats exactly (not private)")
    parser.add_argument("--secure", action="store_true",
                        help=f"also run the secure-aggregation variants ({SECURE_METHODS}): hospitals add their "
                             "own noise shares and the aggregator sees only the noisy sum (about 10 more minutes "
                             "on 2 CPU cores)")
    add_compute_options(parser)
    add_real_check_option(parser, environment=True)
    parser.epilog = (f"With real cases (--real-check or its environment variable) the demo also runs "
                     f"{REAL_CHECK_METHODS}.")
    parser.set_defaults(func=run)


def demo_methods(secure: bool = False, real_check: bool = False) -> str:
    """The demo's ``--methods``: :data:`DEMO_METHODS`, with :data:`SECURE_METHODS` under ``--secure`` and
    :data:`REAL_CHECK_METHODS` when real cases are checked."""
    chosen = [DEMO_METHODS] + ([SECURE_METHODS] if secure else []) + ([REAL_CHECK_METHODS] if real_check else [])
    return ",".join(chosen)


def choose_student(cells):
    """The PATE student to show, chosen on the PUBLIC validation set, never on the test set: the largest
    budget, then the best public validation Dice. None when no cell has a validation score."""
    from task.settings.methods import is_pate   # pure Python: the CLI start-up stays free of torch

    candidates = [c for c in cells if is_pate(c.get("method")) and c.get("validation_dice_mean") is not None]
    return max(candidates, key=lambda c: (c.get("epsilon_budget") or 0, c["validation_dice_mean"]), default=None)


def run(args) -> int:
    import json
    from pathlib import Path

    from task.reporting.predict import predict_scans
    from task.settings.presets import get_preset
    from sim.report import load_cells
    from sim.runners.compare import CompareConfig, parse_list, parse_workers, run_compare
    from task.learning.compute import Compute
    from task.io import cache_root, ensure_folder
    from task.world import PHANTOM_SEED
    from task.data.phantoms import ensure_phantoms

    from sim.commands.common import open_real_check, resolved_device

    real_check = open_real_check(args, environment=True)   # --real-check, else FEDPATE_REAL_CHECK; checked now
    device = resolved_device(args)
    methods = demo_methods(secure=args.secure, real_check=bool(real_check))
    config = CompareConfig(args.preset, parse_list(methods, str, "methods"),
                           parse_list(DEMO_EPSILONS, float, "epsilons"), Path(args.out), seed=args.seed,
                           reproducible_noise=args.reproducible_noise,
                           engine=args.engine, init=args.init, real_check=real_check.specs if real_check else (),
                           compute=Compute(device=str(device), precision=args.precision,
                                           workers=parse_workers(args.workers, args.engine, str(device)),
                                           progress=not args.no_progress))
    out = ensure_folder(args.out)   # after every setting is checked: a refused demo leaves no folder
    report = run_compare(config)
    best = choose_student(load_cells(out))
    if best is not None:
        phantoms = ensure_phantoms(get_preset(args.preset), cache_root() / "phantoms", seed=PHANTOM_SEED,
                                   progress=False)
        unseen = sorted((phantoms / "imagesTs").glob("*.nii.gz"))[:1]
        if unseen:
            model_dir = out / best["_cell"]
            predictions = predict_scans(model_dir, unseen, out / "predict-demo", progress=False, device=str(device),
                                        precision=args.precision)
            print(f"\npredicted an unseen scan with {best['method']} at epsilon {best['epsilon']:.3g} "
                  f"(delta {best['delta']:g}, {best['relation']}; chosen on public validation Dice "
                  f"{best['validation_dice_mean']:.3f}):")
            for prediction in predictions:
                print("  " + prediction.summary())
            print(f"  same command yourself: fedpate predict --model {model_dir} --image {unseen[0]} "
                  f"--out {out / 'predict-demo'}")
    for line in real_check_summary(load_cells(out)):
        print(line)
    print(f"\nreport: {report}")
    print("cells: " + json.dumps(sorted(c["_cell"] for c in load_cells(out))))
    return 0


def real_check_summary(cells) -> list[str]:
    """The demo's closing lines on the real-scan check: the cases, pooled, with their folders and references; each
    model's real WT / TC / ET Dice beside its phantom mean Dice (from the cells' results.json); Kendall's τ between
    the phantom and the real ranking of the private models. Or how to ask for the check."""
    from task.reporting.realcheck import ENVIRONMENT, REGIONS, real_dice
    from sim.report_real import case_list, checked, describe_reference, rank_agreement

    scored = checked(cells)
    if not scored:
        return [f"\nreal-scan check: none (--real-check DIR or {ENVIRONMENT}=DIR scores every model on labelled real "
                "cases too)"]
    cases = case_list(scored)
    lines = [f"\nreal-scan check on {len(cases)} labelled real case(s), pooled (each case's own grid; section Real "
             "scans of the report):"]
    lines += [f"  {case['case']} from {case['folder']} (reference: {describe_reference(case.get('reference'))})"
              for case in cases]
    for cell in sorted(scored, key=lambda c: (str(c.get("method")), c.get("epsilon_budget") or 0)):
        budget = cell.get("epsilon_budget")
        name = cell["method"] + (f" eps {budget:g}" if budget is not None else "")
        phantom = (cell.get("dice") or {}).get("mean")
        real = ", ".join(f"{k} {real_dice(cell, k):.3f}" if real_dice(cell, k) is not None else f"{k} n/a"
                         for k in REGIONS)
        lines.append(f"  {name:<28} phantom mean Dice {'n/a' if phantom is None else f'{phantom:.3f}'}; real {real}")
    found = rank_agreement(scored)
    lines.append("  Kendall tau, phantom against real ranking of the private models: "
                 + ("not defined" if found is None else f"{found['tau']:+.2f} over {found['n']} models"))
    matched = rank_agreement(scored, regions=True)
    if matched is not None:
        lines.append(f"  (phantoms scored as the real scans, mean of WT, TC and ET: tau {matched['tau']:+.2f})")
    return lines
