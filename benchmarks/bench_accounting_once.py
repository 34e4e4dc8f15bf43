"""The accounting of one pooled DP-SGD run, composed at every epoch against accounted once: the ratio, in one run.

    .venv/bin/python benchmarks/bench_accounting_once.py [--owners 4] [--steps 12] [--epochs 10] [--epsilon 8]

A pooled DP-SGD run in target mode (``task.learning.dpsgd.DPSession``) calibrates σ for its plan, charges every epoch to every
hospital's ledger (one owner per hospital), and reports ε from the ledger at the end. Measured here on the product's
own functions, with a replace-one Poisson-sampled Gaussian (the default relation, whose PLD is the costly one):

* **calibration**: ``task.learning.accounting.dpsgd_noise_multiplier`` with an empty disk memo (what a first run pays), then
  again (every later run with the same ε, δ, q, steps, accountant and relation: read from disk);
* **charges**: the epochs charged through ``privacy.guard.BudgetGuard`` as before (every charge composes each owner's
  ledger), against the same charges after ``BudgetGuard.expect`` verified the plan once;
* the final ε each ledger reports, which must agree.

Prints CPU seconds of each part and the ratios. Timings on a shared 2-core CPU swing: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def _timed(function):
    started = time.process_time()
    value = function()
    return value, time.process_time() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owners", type=int, default=4, help="hospitals charged every epoch (the ledger's owners)")
    parser.add_argument("--steps", type=int, default=12, help="steps per epoch (q = 1 / steps)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-3)
    args = parser.parse_args(argv)
    os.environ["FEDPATE_ACCOUNTING_CACHE"] = tempfile.mkdtemp(prefix="fedpate-bench-accounting-")

    from privacy.accountants.pld import _event_plds
    from privacy.events import SampledGaussianEvent
    from privacy.guard import BudgetGuard
    from privacy.ledger import Ledger
    from task.learning import accounting

    owners = [f"h{i}" for i in range(args.owners)]
    q, total = 1.0 / args.steps, args.steps * args.epochs
    ask = dict(accountant="pld", relation="replace-one")
    sigma, cold = _timed(lambda: accounting.dpsgd_noise_multiplier(args.epsilon, args.delta, q, total, **ask))
    again, warm = _timed(lambda: accounting.dpsgd_noise_multiplier(args.epsilon, args.delta, q, total, **ask))
    assert again == sigma
    event = SampledGaussianEvent(q, sigma, args.steps, relation="replace-one")

    def run(with_plan: bool):
        _event_plds.clear()   # each way builds its PLDs from nothing (the process-wide cache would favour the second)
        ledger = Ledger(None)
        guard = BudgetGuard(ledger, args.epsilon, args.delta)
        if with_plan:
            guard.expect(owners, [event] * args.epochs)
        for epoch in range(args.epochs):
            guard.charge(owners, event, f"run:epoch-{epoch}")
        return [ledger.spent(owner, args.delta).epsilon for owner in owners]

    composed, per_epoch = _timed(lambda: run(False))
    planned, once = _timed(lambda: run(True))
    print(f"{args.owners} owners, {args.epochs} epochs of {args.steps} steps (q = {q:.4f}), replace-one, "
          f"target epsilon {args.epsilon} at delta {args.delta}: sigma {sigma:.4f}")
    print(f"calibration: {cold:.2f} s CPU with an empty memo, {warm:.3f} s read back (x{cold / max(warm, 1e-9):.0f})")
    print(f"charges and final epsilon: {per_epoch:.2f} s CPU composing at every charge, {once:.2f} s with the plan "
          f"verified once (x{per_epoch / max(once, 1e-9):.1f})")
    print(f"final epsilon per owner: composed {max(composed):.9f}, planned {max(planned):.9f} "
          f"(differ by {abs(max(composed) - max(planned)):.1e}: one self-composition against epoch by epoch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
