"""``fedpate compare``: which private method gives the best tumour segmentation for my budget?"""

from __future__ import annotations

from sim.commands.common import (add_compute_options, add_real_check_option, add_run_options, add_threat_options,
                                 positive_integer, positive_number, resolved_device, threat_options)
from task.settings.methods import CLASSIFICATION_METHODS, SEGMENTATION_METHODS
from task.options import COMPARE_ENGINES, CompareTask, Engine, Init


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare", help="run a grid of methods x epsilons (x teachers) and write a report",
        description="Segmentation: PATE (ae, pca, anchored, naive) and DP-FedAvg (in-process or as Flower apps), "
                    "DP-SGD and non-private training on pooled data, and the public-only baseline; writes "
                    "report.md, cells.csv, plots and one results.json + ledger.jsonl + model bundle per cell. "
                    "Resumable: finished cells are skipped. --task slice-classification|mnist5k compares the "
                    f"classification seed systems ({', '.join(CLASSIFICATION_METHODS)}).")
    add_run_options(parser, default_preset="quick", one_epsilon=False)   # budgets: --epsilons
    add_compute_options(parser)
    add_real_check_option(parser)
    add_threat_options(parser)
    parser.add_argument("--task", default=CompareTask.SEGMENTATION, choices=tuple(CompareTask),
                        help="what is compared: tumour segmentation (default), or the classification seed systems "
                             "on 2D tumour slices (slice-classification) or on 5,000 MNIST digits (mnist5k)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated (default for segmentation: {','.join(SEGMENTATION_METHODS)}; for the "
                             f"classification tasks: {','.join(CLASSIFICATION_METHODS)})")
    parser.add_argument("--epsilons", default="1,2,4,8", help="comma-separated budgets (default 1,2,4,8)")
    parser.add_argument("--hospitals", type=positive_integer, default=None,
                        help="number of hospitals (default: preset's)")
    parser.add_argument("--teachers-per-hospital", default=None,
                        help="one value or a comma-separated sweep, e.g. 1,4,16 (K = hospitals x this; default: "
                             "preset's)")
    parser.add_argument("--lifetime-epsilon", type=positive_number, default=None,
                        help="each hospital's lifetime budget over every cell of this comparison (default: the "
                             "sum of the private cells' budgets); a cell that would exceed it is refused")
    parser.add_argument("--workers", default="auto",
                        help="how many cells run at once, each group in its own process with its share of the cores "
                             "(default auto with --engine inprocess: 2 on a CPU with 2+ cores; on a GPU as many as its "
                             "free memory holds at 8 GiB each, at most 4 and one per 2 cores; else 1)")
    parser.add_argument("--engine", default=Engine.INPROCESS, choices=COMPARE_ENGINES,
                        help="federated cells in this process through the same protocol code as the Flower apps, "
                             "torch on every core (default), or as Flower ClientApps/ServerApp in Flower's "
                             "simulation engine (flower; Ray gives each hospital one core)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds, e.g. 0,1,2: the grid once per seed (its own split, public model "
                             "and training) in OUT/seed-<S>/, one report over all seeds at OUT, every seed charging "
                             "the same hospital ledgers (default: --seed alone, in OUT itself)")
    parser.add_argument("--init", default=Init.PUBLIC, choices=tuple(Init),
                        help="where DP-SGD, DP-FedAvg and non-private training start: the public model that PATE's "
                             "teachers and student start from (default), or random weights")
    parser.set_defaults(func=run)


def run(args) -> int:
    from sim.commands.common import check_secure_plan, data_options, open_real_check, resolve_hospitals
    from task.errors import UserError
    from task.io import ensure_folder
    from task.settings.runconfig import check_epsilon
    from sim.runners.compare import CompareConfig, parse_list, parse_workers, run_compare_seeds
    from task.learning.compute import Compute

    if args.epsilon is not None:   # the common run options include --epsilon; a grid has budgets, not one
        raise UserError(f"--epsilon: compare takes its budgets from --epsilons (comma-separated), "
                        f"e.g. --epsilons {args.epsilon:g}")
    where = data_options(args)
    # every list is read and checked before anything runs; an empty one ("") is refused, never read as the default
    epsilons = [check_epsilon(e, "--epsilons") for e in parse_list(args.epsilons, float, "--epsilons")]
    sweep = (parse_list(args.teachers_per_hospital, _positive("--teachers-per-hospital"), "--teachers-per-hospital")
             if args.teachers_per_hospital is not None else None)
    # --seed S is --seeds S: one seed keeps the single-seed folder layout (run_compare on OUT itself)
    seeds = parse_list(args.seeds, _seed, "--seeds") if args.seeds is not None else [args.seed]
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds: expected distinct seeds, got {args.seeds}")
    segmentation = args.task == CompareTask.SEGMENTATION
    offered = SEGMENTATION_METHODS if segmentation else CLASSIFICATION_METHODS
    methods = parse_list(args.methods, str, "--methods") if args.methods is not None else list(offered)
    if segmentation:
        from task.settings import methods as registry

        unknown = [m for m in methods if m not in registry.names()]
        if unknown:
            raise UserError(f"--methods: unknown {', '.join(unknown)}; expected some of {', '.join(registry.names())}")
        check_secure_plan(args, methods)
    real_check = open_real_check(args)   # a bad folder is refused before anything runs

    device = resolved_device(args)
    if not segmentation:
        from sim.runners.classification_compare import ClassificationCompareConfig, run_classification_compare

        if len(seeds) > 1:
            raise UserError(f"--seeds: --task {args.task} takes one seed (--seed), got {args.seeds}")
        if real_check is not None:
            raise UserError(f"--real-check: --task {args.task} has no tumour segmentations to score on real scans; "
                            "it applies to --task segmentation")
        if where["partition_file"] or where["layout"]:
            raise UserError(f"--partition-file / --layout: --task {args.task} reads no tumour data folder's "
                            "partitions; they apply to --task segmentation")
        if sweep and len(sweep) > 1:
            raise UserError(f"--teachers-per-hospital: --task {args.task} takes one value, "
                            f"got {args.teachers_per_hospital}")
        ensure_folder(args.out)
        run_classification_compare(ClassificationCompareConfig(
            args.task, methods, epsilons, args.out, seed=seeds[0], compute=Compute(progress=not args.no_progress),
            preset=args.preset, data=args.data, hospitals=args.hospitals,
            teachers_per_hospital=sweep[0] if sweep else None, reproducible_noise=args.reproducible_noise,
            **({"delta": args.delta} if args.delta else {})))
        print(f"report: {args.out}/report.md")
        return 0
    config = CompareConfig(args.preset, methods, epsilons, args.out, data=args.data, delta=args.delta,
                           hospitals=resolve_hospitals(args.hospitals, where["partition_file"]),
                           teachers_per_hospital=sweep, engine=args.engine,
                           reproducible_noise=args.reproducible_noise, lifetime_epsilon=args.lifetime_epsilon,
                           init=args.init, real_check=real_check.specs if real_check else (),
                           threat=threat_options(args), **where,
                           compute=Compute(device=str(device), precision=args.precision, progress=not args.no_progress,
                                           workers=parse_workers(args.workers, args.engine, str(device))))
    ensure_folder(args.out)
    report = run_compare_seeds(config, seeds)
    print(f"report: {report}")
    return 0


def _positive(option: str):
    """A list item that must be a whole number >= 1 (``parse_list`` names ``option`` when it is not)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < 1:
            raise ValueError(f"{option}: expected whole numbers >= 1, got {text.strip()}")
        return value
    return parse


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"--seeds: expected whole numbers >= 0, got {text.strip()}")
    return value
