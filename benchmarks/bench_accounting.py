"""The privacy accounting of one DP-FedAvg hospital's round, as the hospital does it, over the same questions answered
with no state kept: the ratio, measured in one run.

    .venv/bin/python benchmarks/bench_accounting.py [--rounds 10] [--steps 10] [--sigma 0.9]

Each round, like ``clients.fedavg.local_dpsgd_round``: the round's DP-SGD epoch is charged through a guard chain
(the run's ledger, then the hospital's lifetime ledger, each checked before anything is recorded), the epoch's
record asks the run ledger's epsilon, and the round's reply asks it again. The event is a replace-one
Poisson-sampled Gaussian (the product's default relation), whose PLD is the costly one. Both ledgers are files
in a temporary folder, as in a comparison. The yardstick answers the same questions with no state kept between
them: each epsilon composed from nothing over the events it covers (``privacy.accountants.epsilon_spent``), as a
ledger without its incremental accountants would. The ratio is the product's time over the yardstick's, measured
in one run; also printed: the final epsilon of both ledgers and the yardstick's, which must agree.

Pair two versions of the code with farm-bench (this script from one checkout, ``PYTHONPATH`` naming each):

    farm-bench -n 3 --timeout 600 -- sh -c 'PYTHONPATH=NEW python benchmarks/bench_accounting.py' \\
        --vs "sh -c 'PYTHONPATH=OLD python benchmarks/bench_accounting.py'"
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="DP-SGD steps per round (q = 1 / steps)")
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--delta", type=float, default=1e-3)
    args = parser.parse_args(argv)

    from privacy.accountants import epsilon_spent
    from privacy.events import SampledGaussianEvent
    from privacy.guard import BudgetGuard, GuardChain
    from privacy.ledger import Ledger

    event = SampledGaussianEvent(1.0 / args.steps, args.sigma, args.steps, relation="replace-one")
    with tempfile.TemporaryDirectory() as folder:
        run_ledger = Ledger(Path(folder) / "dpfedavg-run.jsonl")
        lifetime = Ledger(Path(folder) / "hospital-00.jsonl")
        chain = GuardChain(BudgetGuard(run_ledger, 1e9, args.delta), [(BudgetGuard(lifetime, 1e9, args.delta),
                                                                        ["hospital-00"])])
        started = time.perf_counter()
        for round_index in range(args.rounds):
            chain.charge(["hospital-00"], event, release_id=f"round-{round_index}:epoch-0")
            run_ledger.spent("hospital-00", args.delta)      # the epoch's record
            run_ledger.spent("hospital-00", args.delta)      # the round's reply
        per_round = (time.perf_counter() - started) / args.rounds
        final = (run_ledger.spent("hospital-00", args.delta).epsilon, lifetime.spent("hospital-00", args.delta).epsilon)
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for _ in range(4):   # each ledger's check before the record, the epoch's record and the round's reply
            epsilon_spent([event] * (round_index + 1), args.delta)
    yardstick = (time.perf_counter() - started) / args.rounds
    fresh = epsilon_spent([event] * args.rounds, args.delta)[0]
    print(f"a round's accounting: {per_round:.3f} s; with no state kept: {yardstick:.3f} s; "
          f"ratio {per_round / yardstick:.2f}; epsilon after {args.rounds} rounds: run ledger {final[0]:.6f}, "
          f"lifetime ledger {final[1]:.6f}, from nothing {fresh:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
