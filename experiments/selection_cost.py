"""What private selection costs in noise, against the public-validation grid, at one budget.

Run: python -m experiments.selection_cost [epsilon] [delta]
Quick preset numbers: 180 pooled private patients, expected batch 16, grid of 2 settings x 5 epochs;
private selection holds out 20 % (36 patients), score noise 0.05 on the mean Dice, T ~ TNB(mean, shape).
"""
import sys

from privacy import calibration
from privacy.accountants import epsilon_spent
from task.learning.dpsgd import steps_per_epoch

eps = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
delta = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-3
n, batch, epochs, grid = 180, 16, 5, 2
held = round(0.2 * n)
spe = steps_per_epoch(n, batch)
print(f"eps={eps} delta={delta}; pooled n={n}, steps/epoch={spe}")
one = calibration.dpsgd_noise_multiplier(eps, delta, 1 / spe, spe * epochs, relation="replace-one")
print(f"one setting, no selection (PLD, replace-one):             z = {one:.3f}")
pub = calibration.composed_dpsgd_noise_multiplier(eps, delta, [(1 / spe, spe * epochs)] * grid, relation="replace-one")
print(f"public-validation grid, {grid} trainings (PLD, replace-one):  z = {pub:.3f}")
pub_ar = calibration.composed_dpsgd_noise_multiplier(eps, delta, [(1 / spe, spe * epochs)] * grid, accountant="rdp",
                                                     relation="add-remove")
print(f"public-validation grid, {grid} trainings (RDP, add-remove):   z = {pub_ar:.3f}")
spe_s = steps_per_epoch(n - held, batch)
for mean, shape in ((3.0, 1.0), (3.0, 0.0), (2.0, 1.0), (3.0, None)):
    for rel in ("replace-one", "add-remove"):
        try:
            selection = calibration.PrivateSelection(1 / spe_s, spe_s * epochs, 1 / held, 0.05, mean, shape, rel)
            z = calibration.private_selection_noise_multiplier(eps, delta, selection)
            ev = calibration.selection_event(1 / spe_s, z, spe_s * epochs, 1 / held, 0.05, mean, shape, rel)
            print(f"private selection mean={mean} shape={shape} ({'RDP+triangle' if rel == 'replace-one' else 'RDP'}, "
                  f"{rel}): z = {z:.3f} (eps {epsilon_spent([ev], delta)[0]:.3f}; {n - held} train / {held} held out)")
        except Exception as exc:  # noqa: BLE001
            print(f"private selection mean={mean} shape={shape} {rel}: {exc}")
