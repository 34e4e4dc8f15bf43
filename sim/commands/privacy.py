"""``fedpate privacy calibrate|spent`` — the privacy calculator (docs/PRIVACY.md, "Mechanisms").

``calibrate`` prints, for N PATE queries with K teachers and a compressor's replace-one sensitivity, the
per-query σ of the exact GDP calibration and of Fay et al. eq. (15), their ratio, and ε of the exact σ
under RDP (improved conversion) and PLD for comparison. ``spent`` prints ε per owner from a ledger.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SensitivityBound:
    """One ``--compressor`` of the calculator: its replace-one sensitivity and what it needs to compute it.

    ``needs``: the argument it reads besides K (None: K alone) and how ``--help`` names it; ``bound(sensitivity,
    value, teachers)``: S from :mod:`privacy.sensitivity` (passed in: the module is imported when a command runs).
    """

    needs: tuple[str, str] | None
    bound: Callable
    label: str


#: the calculator's compressors, by their ``--compressor`` name
BOUNDS = {
    "ae": SensitivityBound(None, lambda s, _, k: s.unit_ball_bound(k), "unit ball 2/K (Fay et al. Alg. 2)"),
    "pca": SensitivityBound(("dim", "--dim D (classes x voxels)"), lambda s, d, k: s.pca_paper_bound(d, k),
                            "PCA sqrt(d)/K (Fay et al. Alg. 1)"),
    "clip": SensitivityBound(("clip", "--clip C"), lambda s, c, k: s.clipped_bound(c, k), "clipped 2C/K"),
    "naive": SensitivityBound(("voxels", "--voxels V"), lambda s, v, k: s.onehot_vote_bound(v, k),
                              "one-hot votes sqrt(2V)/K"),
}
COMPRESSORS = tuple(BOUNDS)


def register(subparsers) -> None:
    parser = subparsers.add_parser("privacy", help="privacy calculator: calibrate noise, read a ledger")
    sub = parser.add_subparsers(dest="privacy_command", metavar="ACTION")
    sub.required = True

    from sim.commands.common import open_fraction, positive_integer, positive_number

    cal = sub.add_parser("calibrate", help="sigma per PATE query for a target (epsilon, delta)")
    cal.add_argument("--epsilon", type=positive_number, default=8.0, help="target epsilon (default 8)")
    cal.add_argument("--delta", type=open_fraction, default=1e-3, help="target delta (default 1e-3)")
    cal.add_argument("--queries", type=positive_integer, default=80, help="number of student queries N (default 80)")
    cal.add_argument("--teachers", type=positive_integer, default=8, help="total number of teachers K (default 8)")
    cal.add_argument("--compressor", choices=COMPRESSORS, default="ae",
                     help="ae: unit ball 2/K (default); pca: sqrt(d)/K (needs --dim); clip: 2C/K (needs --clip); "
                          "naive: one-hot votes sqrt(2*voxels)/K (needs --voxels)")
    cal.add_argument("--dim", type=positive_integer, default=None, help="d = classes x voxels (pca)")
    cal.add_argument("--clip", type=positive_number, default=None, help="clip norm C (clip)")
    cal.add_argument("--voxels", type=positive_integer, default=None, help="voxels per query volume (naive)")
    cal.add_argument("--no-pld", action="store_true", help="skip the (slower) PLD cross-check")
    cal.add_argument("--json", action="store_true", help="machine-readable output")
    cal.set_defaults(func=run_calibrate)

    spent = sub.add_parser("spent", help="epsilon spent per data owner, from a ledger.jsonl")
    spent.add_argument("ledger", help="path to ledger.jsonl")
    spent.add_argument("--delta", type=open_fraction, default=1e-3,
                       help="delta at which to report epsilon (default 1e-3)")
    spent.add_argument("--relation", choices=("replace-one", "add-remove", "zero-out"), default=None,
                       help="account only events under this neighbouring relation (default: every event; they must then "
                            "share one relation)")
    spent.add_argument("--json", action="store_true", help="machine-readable output")
    spent.set_defaults(func=run_spent)


def _sensitivity(args) -> tuple[float, str]:
    from privacy import sensitivity
    from privacy.errors import PrivacyError

    record = BOUNDS[args.compressor]
    value = None
    if record.needs is not None:
        name, flag = record.needs
        value = getattr(args, name)
        if value is None:
            raise PrivacyError(f"--compressor {args.compressor} needs {flag}")
    return record.bound(sensitivity, value, args.teachers), record.label


def run_calibrate(args: argparse.Namespace) -> int:
    from privacy.accountants import make_accountant
    from privacy.calibration import paper_sigma, pate_sigma
    from privacy.errors import PrivacyError
    from privacy.events import GaussianEvent
    from privacy.options import AccountantName, Calibration

    if args.queries is None or args.queries < 1:
        raise PrivacyError(f"--queries must be a positive integer, got {args.queries}")
    if args.teachers is None or args.teachers < 1:
        raise PrivacyError(f"--teachers must be a positive integer, got {args.teachers}")
    sens, bound = _sensitivity(args)
    exact = pate_sigma(args.epsilon, args.delta, args.queries, sens, mode=Calibration.EXACT)
    paper = paper_sigma(args.epsilon, args.delta, args.queries, sens)
    event = GaussianEvent(sens, exact, args.queries)
    rdp = make_accountant(AccountantName.RDP).compose(event).get_epsilon(args.delta)
    pld = None if args.no_pld else make_accountant(AccountantName.PLD).compose(event).get_epsilon(args.delta)
    exact_eps = make_accountant(AccountantName.GDP_EXACT).compose(event).get_epsilon(args.delta)
    result = {
        "epsilon": args.epsilon, "delta": args.delta, "queries": args.queries, "teachers": args.teachers,
        "compressor": args.compressor, "sensitivity": sens, "sensitivity_bound": bound,
        "relation": "replace-one", "sigma_exact": exact, "sigma_paper": paper, "ratio_paper_over_exact": paper / exact,
        "mu": math.sqrt(args.queries) * sens / exact, "epsilon_exact_sigma_gdp": exact_eps,
        "epsilon_exact_sigma_rdp": rdp, "epsilon_exact_sigma_pld": pld,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"PATE aggregation: N={args.queries} queries, K={args.teachers} teachers, "
          f"target (epsilon={args.epsilon:g}, delta={args.delta:g}), replace-one (one patient)")
    print(f"sensitivity      {sens:.6g}  ({bound}; replace-one)")
    print(f"sigma exact      {exact:.4f}  (exact GDP composition, mu={result['mu']:.4f}; epsilon={exact_eps:.4f})")
    print(f"sigma paper      {paper:.4f}  (Fay et al. eq. 15)")
    print(f"ratio            {paper / exact:.3f}  (paper / exact)")
    line = f"epsilon of exact sigma under RDP (improved conversion) {rdp:.4f}"
    if pld is not None:
        line += f"; under PLD {pld:.4f}"
    print(line)
    return 0


def run_spent(args: argparse.Namespace) -> int:
    import sys

    from privacy.ledger import Ledger

    ledger = Ledger.load(args.ledger, read_only=True)   # reading a ledger changes nothing in it
    torn = ledger.torn_tail_bytes
    if torn:
        print(f"fedpate privacy: warning: {args.ledger} ends with an incomplete line ({torn} bytes after the last "
              "complete record), skipped: every epsilon below is a lower bound until the file is repaired (if it "
              "was copied, copy it again whole; a record a killed run left unfinished is cut off by the next run "
              "that writes this ledger, and was never released)", file=sys.stderr)
    rows = []
    for owner in ledger.owners():
        spent = ledger.spent(owner, args.delta, relation=args.relation)
        rows.append({"owner": owner, **spent.to_dict()})
    if args.json:
        print(json.dumps({"ledger": str(args.ledger), "digest": ledger.digest(), "owners": rows,
                          "torn_tail_bytes": torn, "epsilon_is_lower_bound": bool(torn)}, indent=2))
        return 0
    if not rows:
        print(f"{args.ledger}: no releases recorded")
        return 0
    width = max(len(row["owner"]) for row in rows)
    for row in rows:
        print(f"{row['owner']:<{width}}  epsilon={row['epsilon']:.4f}  delta={row['delta']:g}  "
              f"relation={row['relation']}  accountant={row['accountant']}  releases={row['releases']}")
    return 0
