"""Is AdLM's noise-free row a stable upper reference? One command, one line per seed:

    noise-free   -- AdLM with the mechanism switched off (``train_adlm`` without a budget: the clean records,
                    the polynomial loss of Phan, Wu, Hu & Dou 2017, arXiv 1709.05750, Eq. 25), as the
                    comparison's ``adlm-noise-free`` row trains it;
    plain        -- the same network (AdLM's layers, initialisation, batches, Adam learning rate and epochs)
                    trained plainly: softmax cross-entropy on the clean labels (``train_plain_reference``);
    gap          -- noise-free minus plain (goal: within a few points at every seed);
    nonprivate   -- the comparison's ``nonprivate`` cell (its own network: one hidden layer of 300, Adam 1e-3).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adlm_noise_free.py --seeds 0-9

Each seed is its own mnist5k split and initialisation, at the comparison's ``quick`` sizes. Neither row is
private; nothing is charged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def seeds_of(text: str) -> list[int]:
    """``0-4`` or ``0,3,7``."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0-4", help="seeds, as 0-4 or 0,3,7 (default: 0-4)")
    parser.add_argument("--preset", default="quick", help="the comparison's training sizes (default: quick)")
    args = parser.parse_args()

    import numpy as np
    import torch

    from privacy.guard import BudgetGuard
    from privacy.ledger import Ledger
    from sim.runners.classification_compare import PRESET_SETTINGS, _batch_size
    from task.classification import SeedRun, accuracy
    from task.classification.adlm import AdLMConfig, train_adlm, train_plain_reference
    from task.classification.dpsgd_classifier import DPSGDConfig, train_dpsgd
    from task.classification.tasks import load_task

    torch.set_num_threads(1)
    print("| seed | noise-free | plain | gap | nonprivate |\n|---|---|---|---|---|", flush=True)
    gaps = []
    for seed in seeds_of(args.seeds):
        task = load_task("mnist5k", args.preset, seed=seed)
        cfg = AdLMConfig(epochs=PRESET_SETTINGS[args.preset]["adlm_epochs"],
                         batch_size=_batch_size(len(task.y_private), 128))
        ledger = Ledger(None)
        noise_free = train_adlm(SeedRun(task, None, 1e-5, BudgetGuard(ledger, 1.0, 1e-5), task.hospitals,
                                        seed=seed), cfg).accuracy
        assert ledger.records() == []
        plain = accuracy(train_plain_reference(task, cfg, seed), np.clip(task.x_test, 0, 1), task.y_test)
        gaps.append(noise_free - plain)
        nonprivate = train_dpsgd(SeedRun(task, None, 1e-5, BudgetGuard(ledger, 1.0, 1e-5), task.hospitals, seed=seed),
                                 DPSGDConfig(epochs=PRESET_SETTINGS[args.preset]["epochs"],
                                             batch_size=_batch_size(len(task.unit_records()), 250))).accuracy
        print(f"| {seed} | {noise_free:.3f} | {plain:.3f} | {noise_free - plain:+.3f} | {nonprivate:.3f} |", flush=True)
    print(f"gap: min {min(gaps):+.3f}, mean {np.mean(gaps):+.3f}, max {max(gaps):+.3f}")


if __name__ == "__main__":
    main()
