"""Comparisons over seeds and headroom per class.

* the interval across seeds is Student's t (checked against hand-computed numbers), verdicts across seeds are
  a paired t-test on the per-seed differences;
* every seed of ``run_compare_seeds`` charges the same per-hospital ledger files under one lifetime budget
  planned over all seeds, and a seed that would exceed it is refused;
* a patient who sits at different hospitals in different seeds is covered by the combined ε;
* headroom per class is the one paired ratio estimator, over the cases that contain the class.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
from task.learning.compute import Compute

T_975 = {1: 12.706204736174698, 2: 4.302652729749464, 3: 3.182446305284263}


# ------------------------------------------------------------------------------ intervals across seeds
def test_t_interval_and_paired_verdicts_across_seeds_on_synthetic_numbers():
    from sim.report_seeds import paired_seed_verdict, t_interval

    mean, half, n = t_interval([0.1, 0.2, 0.3])
    assert (mean, n) == (pytest.approx(0.2), 3)
    assert half == pytest.approx(T_975[2] * 0.1 / math.sqrt(3))          # SD 0.1, t_{0.975, 2}
    mean, half, n = t_interval([0.40, None, 0.46, float("nan")])          # missing seeds are skipped
    assert n == 2 and mean == pytest.approx(0.43) and half == pytest.approx(T_975[1] * np.std([0.4, 0.46], ddof=1)
                                                                             / math.sqrt(2))
    assert t_interval([0.5]) == (0.5, None, 1) and t_interval([None]) is None
    assert paired_seed_verdict([0.05, 0.06, 0.07])[0] == "beats"            # 0.06 ± 0.025: above 0
    assert paired_seed_verdict([-0.05, -0.06, -0.07])[0] == "does NOT beat"
    assert paired_seed_verdict([0.10, -0.05, 0.02])[0] == "is level with"   # the interval holds 0
    assert paired_seed_verdict([0.3])[0] == "is level with"                 # one seed: no test


def _write_cell(folder, method, per_case, per_class=None, budget=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ledger.jsonl").write_text("")
    result = {"method": method, "dice": {"mean": float(np.mean([v for v in per_case if v is not None]))},
              "dice_per_case": per_case, "epsilon": None, "epsilon_budget": budget, "delta": None}
    if per_class is not None:
        result["dice_per_case_class"] = per_class
    (folder / "results.json").write_text(json.dumps(result))


def test_seeds_report_aggregates_per_seed_headroom_with_t_intervals(tmp_path):
    from sim.report_seeds import write_seeds_report

    public = [0.4, 0.5, 0.6, 0.5]
    nonprivate = [0.6, 0.7, 0.8, 0.7]                       # headroom 0.2 on every case
    gains = {0: 0.05, 1: 0.07, 2: 0.06}                     # the private method: +gain on every case
    for seed, gain in gains.items():
        root = tmp_path / f"seed-{seed}"
        _write_cell(root / "public-only", "public-only", public)
        _write_cell(root / "public-selftrain", "public-selftrain", [v + 0.01 for v in public])
        _write_cell(root / "nonprivate-central", "nonprivate-central", nonprivate)
        _write_cell(root / "dp-sgd-central" / "eps-8", "dp-sgd-central", [v + gain for v in public], budget=8.0)
    text = write_seeds_report(tmp_path, "seeds").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| dp-sgd-central"))
    # headroom per seed = gain / 0.2; their mean and t-interval across the three seeds
    per_seed = [gains[s] / 0.2 for s in (0, 1, 2)]
    half = T_975[2] * np.std(per_seed, ddof=1) / math.sqrt(3)
    assert "0: +0.25, 1: +0.35, 2: +0.30" in row
    assert f"{np.mean(per_seed):+.2f} ± {half:.2f}" in row
    assert f"SD {np.std(per_seed, ddof=1):.2f}, +0.25 to +0.35" in row
    dice = [np.mean(public) + gains[s] for s in (0, 1, 2)]
    assert f"{np.mean(dice):.3f} ± {T_975[2] * np.std(dice, ddof=1) / math.sqrt(3):.3f}" in row
    # verdicts paired by seed: against each floor, with each seed's own paired-by-test-case verdict
    verdict = next(line for line in text.splitlines() if "dp-sgd-central beats public-only across seeds" in line)
    assert "paired t over 3 seeds" in verdict and "seed 0 beats public-only" in verdict
    assert any("public-selftrain across seeds" in line for line in text.splitlines())
    assert (tmp_path / "plot_headroom_by_seed.png").exists()
    assert "[seed 2](seed-2/report.md)" in text and "simulation" in text


# ------------------------------------------------------------------------------ shared ledgers over seeds
def test_planned_lifetime_covers_every_seeds_cells():
    from sim.runners.compare import planned_lifetime_epsilon

    assert planned_lifetime_epsilon(["dp-sgd-central", "public-only"], [1, 8], 1) == 9
    assert planned_lifetime_epsilon(["dp-sgd-central", "public-only"], [1, 8], 1, seeds=3) == 27
    assert planned_lifetime_epsilon(["pate-anchored", "dp-fedavg"], [2], 2, seeds=2) == 2 * (2 * 2 + 2)


def _fake_compare(calls):
    """Stands in for one seed's run_compare: its one private cell charges each hospital's lifetime ledger in
    ``ledger_dir`` through the real guard with the lifetime budget it was given (as DP-SGD cells do)."""
    from privacy.errors import BudgetExceeded
    from privacy.events import PureDPEvent
    from privacy.guard import BudgetGuard
    from privacy.ledger import Ledger

    def run(config):
        out, seed, ledger_dir, lifetime_epsilon, delta = (config.out, config.seed, config.ledger_dir,
                                                          config.lifetime_epsilon, config.delta)
        epsilons = config.epsilons
        calls.append({"seed": seed, "out": out, "ledger_dir": ledger_dir, "lifetime": lifetime_epsilon})
        out.mkdir(parents=True)
        charged = True
        for hospital in ("hospital-00", "hospital-01"):
            guard = BudgetGuard(Ledger(ledger_dir / f"{hospital}.jsonl"), {hospital: lifetime_epsilon}, delta)
            try:
                guard.charge([hospital], PureDPEvent(epsilon=float(epsilons[0])), f"seed-{seed}:cell")
            except BudgetExceeded:
                charged = False
        calls[-1]["charged"] = charged
        (out / "report-settings.json").write_text(json.dumps({"title": "t", "settings": {}, "overlays": []}))
        return out / "report.md"

    return run


def test_every_seed_charges_the_same_hospital_ledgers_and_the_lifetime_budget_refuses(tmp_path, monkeypatch):
    import sim.runners.compare as compare
    from privacy.ledger import Ledger

    calls = []
    monkeypatch.setattr(compare, "run_compare", _fake_compare(calls))
    monkeypatch.setattr(compare, "patient_homes", lambda preset, data, seeds, **where: {})
    out = tmp_path / "cmp"
    report = compare.run_compare_seeds(
        compare.CompareConfig("tiny", ["dp-sgd-central", "public-only"], [2.0], out,
                              compute=Compute(progress=False)), [0, 1, 2])
    assert report == out / "report.md" and report.exists()
    assert [c["seed"] for c in calls] == [0, 1, 2]
    assert {c["ledger_dir"] for c in calls} == {out / "hospital-ledgers"}          # one folder for all seeds
    assert [c["out"] for c in calls] == [out / f"seed-{s}" for s in (0, 1, 2)]
    assert {c["lifetime"] for c in calls} == {6.0} and all(c["charged"] for c in calls)   # 3 seeds x eps 2
    ledgers = sorted((out / "hospital-ledgers").glob("*.jsonl"))
    assert [p.stem for p in ledgers] == ["hospital-00", "hospital-01"] and not list(out.glob("seed-*/hospital-ledgers"))
    for path in ledgers:   # each hospital's one ledger holds every seed's release
        ids = {r["release_id"] for r in Ledger.load(path).records()}
        assert ids == {"seed-0:cell", "seed-1:cell", "seed-2:cell"}
        assert Ledger.load(path).spent(path.stem, 1e-3).epsilon == pytest.approx(6.0)
    assert "ε = 6 per patient" in report.read_text()                             # the combined ε covers all seeds
    assert "ε = 6 per patient" in (out / "seed-0" / "report.md").read_text()     # restated in every seed's report
    assert "../hospital-ledgers/" in (out / "seed-0" / "report.md").read_text()

    # a lifetime budget with room for two seeds' cells: the third seed's cell is refused, nothing is charged
    calls.clear()
    out = tmp_path / "tight"
    compare.run_compare_seeds(compare.CompareConfig("tiny", ["dp-sgd-central"], [2.0], out, lifetime_epsilon=5.0,
                                                    compute=Compute(progress=False)), [0, 1, 2])
    assert [c["charged"] for c in calls] == [True, True, False]
    for path in sorted((out / "hospital-ledgers").glob("*.jsonl")):
        assert {r["release_id"] for r in Ledger.load(path).records()} == {"seed-0:cell", "seed-1:cell"}


def test_one_seed_is_the_single_seed_comparison_and_reproducible_noise_takes_one_seed(tmp_path, monkeypatch):
    import sim.runners.compare as compare
    from task.errors import UserError

    seen = []
    monkeypatch.setattr(compare, "run_compare", lambda config: seen.append(config) or "report")
    plan = compare.CompareConfig("tiny", ["public-only"], [1.0], tmp_path)
    assert compare.run_compare_seeds(plan, [3]) == "report"
    config, = seen
    assert config.out == tmp_path and config.seed == 3 and config.ledger_dir is None   # OUT itself, as before
    with pytest.raises(UserError, match="--reproducible-noise"):
        compare.run_compare_seeds(dataclasses.replace(plan, reproducible_noise=True), [0, 1])
    with pytest.raises(UserError, match="--seeds"):
        compare.run_compare_seeds(plan, [0, 0])


def test_a_patient_at_two_hospitals_across_seeds_is_charged_both_ledgers(tmp_path):
    from privacy.accountants import epsilon_spent
    from privacy.events import GaussianEvent
    from privacy.ledger import Ledger
    from sim.runners.compare import combined_release

    folder = tmp_path / "hospital-ledgers"
    events = {"hospital-00": GaussianEvent(sensitivity=1.0, sigma=1.0), "hospital-01": GaussianEvent(sensitivity=1.0,
                                                                                                      sigma=2.0)}
    for hospital, event in events.items():
        Ledger(folder / f"{hospital}.jsonl").record([hospital], event, f"{hospital}:q")
    alone = combined_release(tmp_path, 1e-3, homes={"p1": ["hospital-00"], "p2": ["hospital-01"]})
    assert alone["patients_moving_between_hospitals"] == 0
    assert alone["combined_epsilon"] == pytest.approx(max(alone["combined_epsilon_per_hospital"].values()))
    moved = combined_release(tmp_path, 1e-3, homes={"p1": ["hospital-00", "hospital-01"], "p2": ["hospital-01"]})
    both = epsilon_spent(list(events.values()), 1e-3)[0]
    assert moved["patients_moving_between_hospitals"] == 1
    assert moved["combined_epsilon"] == pytest.approx(both) and both > alone["combined_epsilon"]


# ------------------------------------------------------------------------------ headroom per class
def test_per_class_headroom_matches_a_hand_computation(tmp_path):
    from sim.report import headroom_class_table, load_cells, summary_table, verdicts, write_report

    public = {"1": [0.5, 0.6, 0.7, 0.6], "2": [0.0, 0.1, None, 0.2], "3": [0.4, 0.4, 0.5, 0.5]}
    nonprivate = {"1": [0.7, 0.7, 0.8, 0.8], "2": [0.6, 0.5, None, 0.8], "3": [0.6, 0.6, 0.6, 0.7]}
    private = {"1": [0.6, 0.6, 0.7, 0.7], "2": [0.3, 0.2, None, 0.5], "3": [0.4, 0.5, 0.5, 0.6]}
    selftrain = {k: [None if v is None else v + 0.01 for v in values] for k, values in public.items()}

    def cell(method, table, budget=None):
        regions = {"WT": table["1"], "TC": table["3"], "ET": table["3"]}
        means = [float(np.mean([table[k][i] for k in "123" if table[k][i] is not None])) for i in range(4)]
        _write_cell(tmp_path / (method if budget is None else f"{method}/eps-{budget:g}"), method, means,
                    {**table, **regions}, budget)

    cell("public-only", public)
    cell("public-selftrain", selftrain)
    cell("nonprivate-central", nonprivate)
    cell("dp-sgd-central", private, budget=8.0)
    cells = load_cells(tmp_path)

    # class 2 by hand, over the three cases that contain it (case 2 has no class 2)
    d = np.array([0.3, 0.1, 0.3])        # private - public-only
    h = np.array([0.6, 0.4, 0.6])        # non-private - public-only
    ratio = d.mean() / h.mean()
    se = np.std(d - ratio * h, ddof=1) / np.sqrt(3) / h.mean()
    assert ratio == pytest.approx(0.4375)
    table = headroom_class_table(cells)
    row = next(line for line in table.splitlines() if line.startswith("| dp-sgd-central"))
    assert f"{ratio:+.2f} ± {se:.2f}" in row
    # class 1 on all four cases: d = (.1, 0, 0, .1), h = (.2, .1, .1, .2) -> 0.2 / 0.6
    d1, h1 = np.array([0.1, 0.0, 0.0, 0.1]), np.array([0.2, 0.1, 0.1, 0.2])
    r1 = d1.mean() / h1.mean()
    assert f"{r1:+.2f} ± {np.std(d1 - r1 * h1, ddof=1) / 2 / h1.mean():.2f}" in row
    summary = next(line for line in summary_table(cells).splitlines() if line.startswith("| dp-sgd-central"))
    assert f"{r1:+.2f} / {ratio:+.2f} / " in summary and "headroom over public-selftrain" in summary_table(cells)
    lines = verdicts(cells)
    assert any(line.startswith("Against public-selftrain at ε = 8: dp-sgd-central") for line in lines)
    assert any(line.startswith("Headroom recovered per class at ε = 8, dp-sgd-central") and
               f"necrotic / non-enhancing core (2) {ratio:+.2f} ± {se:.2f}" in line for line in lines)
    text = write_report(tmp_path, "t").read_text()
    assert "plot_headroom_per_class.png" in text and (tmp_path / "plot_headroom_per_class.png").stat().st_size > 1000
    assert "headroom over public-selftrain (± SE)" in text and "Headroom recovered per class and region" in text


def test_per_case_class_dice_is_none_where_the_truth_lacks_the_class():
    """What the per-class headroom pairs: a false positive on a case without the class says nothing about
    whether the class was learned, so that case is left out (None), not scored 0."""
    from task.learning.metrics import DiceAccumulator
    from task.learning.training import PerCaseDice, per_class_of

    truth = np.zeros((3, 4, 4, 4), int)
    pred = truth.copy()
    truth[0, :2] = 1
    pred[0, :1] = 1                    # class 1: 2|P∩T| / (|P| + |T|) = 2·16 / (16 + 32)
    truth[0, 3, 3, 3] = 2              # class 2 present in case 0, missed
    pred[1, 0, 0, 0] = 2               # a false positive of class 2 on case 1, whose truth has no class 2
    truth[2, :2] = 3
    pred[2, :2] = 3
    table = DiceAccumulator().add(pred, truth).case_table()
    assert table["1"] == [pytest.approx(2 / 3, rel=1e-6), None, None]
    assert table["2"] == [0.0, None, None]
    assert table["3"] == [None, None, 1.0] and table["ET"] == [None, None, 1.0]
    assert table["TC"][1] is None and table["TC"][2] == 1.0
    wrapped = PerCaseDice([0.5, 0.0, 1.0], table)
    assert wrapped == [0.5, 0.0, 1.0] and json.loads(json.dumps(wrapped)) == [0.5, 0.0, 1.0]
    assert per_class_of(wrapped) == table and per_class_of([0.5]) is None
