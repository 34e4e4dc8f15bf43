"""How much more noise the secure mode's released mean carries than trusted PATE's, at the same (ε, δ).

    PYTHONPATH=. .venv/bin/python benchmarks/secure_noise_price.py [HOSPITALS] [QUERIES] [LATENT]

Trusted: σ on the K-teacher sum = c·2C with c = ``privacy.calibration.pate_sigma(ε, δ, N, 1)`` (exact Gaussian DP,
replace-one, rows of norm C). Secure: γ·sqrt(H·v) with v = ``privacy.distributed.calibrate_local_variance`` for the
``H - t - d`` shares a hospital counts on, on ``IntegerGrid.for_rows(C, latent)``. Prints one line per (t, d, ε).
"""
import math
import sys

from privacy.calibration import pate_sigma
from privacy.distributed import IntegerGrid, calibrate_local_variance

hospitals = int(sys.argv[1]) if len(sys.argv) > 1 else 4
queries = int(sys.argv[2]) if len(sys.argv) > 2 else 40
latent = int(sys.argv[3]) if len(sys.argv) > 3 else 18
delta = 1e-3
grid = IntegerGrid.for_rows(1.0, latent)
for colluders, dropouts in ((0, 0), (1, 0), (1, 1)):
    for epsilon in (1.0, 8.0):
        trusted = pate_sigma(epsilon, delta, queries, 1.0) * 2.0
        variance = calibrate_local_variance(epsilon, delta, queries, grid, hospitals - colluders - dropouts)
        secure = grid.granularity * math.sqrt(hospitals * variance)
        print(f"t={colluders} d={dropouts} eps={epsilon:g}: sigma secure / trusted = {secure / trusted:.3f}")
