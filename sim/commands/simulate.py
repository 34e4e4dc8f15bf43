"""``fedpate simulate``: one federated method, every hospital simulated on this machine."""

from __future__ import annotations

from sim.commands.common import (add_compute_options, add_federation_options, add_real_check_option, add_run_options,
                                 add_threat_options, resolved_device)
from task.settings.methods import FEDERATED_METHODS
from task.options import Calibration, Engine, Init


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="run one federated method (PATE or DP-FedAvg) in Flower's simulation engine",
        description="Hospitals are Flower ClientApps, the aggregator a ServerApp; all run on this machine. "
                    "Writes results.json, ledger.jsonl, model/ (bundle + MODEL_CARD.md) and predictions/ into --out.")
    parser.add_argument("--method", default="pate-ae", choices=FEDERATED_METHODS,
                        help="pate-*: the hospitals' teachers label public scans, each label map compressed at the "
                             "hospital by an autoencoder (ae), PCA (pca) or a residual code anchored on the public "
                             "model's prediction (anchored), or sent as one-hot votes (naive); the sum is noised. "
                             "dp-fedavg: federated averaging of each hospital's local DP-SGD (default: pate-ae)")
    add_run_options(parser, default_preset="tiny")
    add_federation_options(parser)
    add_threat_options(parser)
    add_compute_options(parser)
    add_real_check_option(parser)
    parser.add_argument("--engine", default=Engine.FLOWER, choices=tuple(Engine),
                        help="flower: Flower simulation engine in this process (default); runtime: through a "
                             "--simulation SuperLink and `flwr run`; inprocess: the same protocol without Flower")
    parser.add_argument("--init", default=Init.PUBLIC, choices=tuple(Init),
                        help="dp-fedavg: start from the public model (as PATE; default) or random weights")
    parser.add_argument("--calibration", default=Calibration.EXACT, choices=tuple(Calibration),
                        help="PATE noise: exact mu-GDP (default) or the paper's eq. 15")
    parser.set_defaults(func=run)


def run(args) -> int:
    from sim.commands.common import (check_secure_plan, data_options, open_real_check, real_check_line,
                                     resolve_hospitals, threat_options)
    from task.errors import UserError
    from task.io import ensure_folder
    from task.learning.compute import Compute
    from task.settings.runconfig import RunSettings
    from sim.runners.simulation import simulate

    where = data_options(args)
    check_secure_plan(args, [args.method])   # named as this command's flags (RunSettings checks it too)
    real_check = open_real_check(args)   # a bad folder is refused before anything trains
    if real_check is not None and args.engine == Engine.RUNTIME:
        # the runtime engine's ServerApp is another process, started by Flower's SuperLink
        raise UserError("--real-check: needs --engine flower or inprocess (the ServerApp then runs in this process "
                        "and scores the model it releases); --engine runtime runs it elsewhere")
    settings = RunSettings(method=args.method, preset=args.preset, epsilon=args.epsilon, delta=args.delta,
                           seed=args.seed, out=str(args.out), data=args.data, **where,
                           hospitals=resolve_hospitals(args.hospitals, where["partition_file"]),
                           teachers_per_hospital=args.teachers_per_hospital, calibration=args.calibration,
                           reproducible_noise=args.reproducible_noise, init=args.init,
                           compute=Compute(device=args.device, precision=args.precision, progress=not args.no_progress),
                           real_check=real_check,   # the model the ServerApp releases is also scored on them
                           **threat_options(args))   # every setting checked (secure sums included) before any work
    resolved_device(args)   # refused here when asked for a GPU this machine does not have
    ensure_folder(args.out)
    results = simulate(settings, engine=args.engine)
    for result in results:
        dice = (result.get("dice") or {}).get("mean")
        eps = result.get("epsilon")
        print(f"{result['method']}: mean Dice {dice if dice is None else round(dice, 3)}, "
              f"epsilon {eps if eps is None else round(eps, 3)} (budget {result.get('epsilon_budget')}, "
              f"delta {result.get('delta')}, {result.get('relation')}, {result.get('accountant')})")
        if result.get("real_check"):
            print(real_check_line(result["method"], result["real_check"]))
    print(f"results: {args.out}/results.json  model card: {args.out}/model/MODEL_CARD.md")
    return 0
