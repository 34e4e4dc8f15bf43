"""A report a reader can follow: tumour classes by name, PATE's noise and DP-SGD's noise multiplier in separate
columns, a smoke-test banner instead of a meaningless headroom, a note that interrupted releases count in the
combined epsilon, and methods that do not hide each other in plot_vs_epsilon.png."""

import json

import numpy as np

from sim import report
from sim.report import load_cells, privacy_statement, write_report

KEYS = ("1", "2", "3", "WT", "TC", "ET")


def _cell(root, folder, method, per_case, budget=None, sigma=None):
    path = root / folder
    path.mkdir(parents=True)
    (path / "ledger.jsonl").write_text("")
    per_case = [float(v) for v in per_case]
    result = {"method": method, "dice": {k: float(np.mean(per_case)) for k in ("mean", *KEYS)},
              "dice_per_case": per_case, "dice_per_case_class": {k: per_case for k in KEYS},
              "epsilon": None, "epsilon_budget": budget, "delta": None, "sigma": sigma}
    (path / "results.json").write_text(json.dumps(result))


def _comparison(root, headroom: np.ndarray):
    """public-only, non-private = public-only + headroom, and two private methods at ε = 1 and 8."""
    public = np.linspace(0.4, 0.6, len(headroom))
    _cell(root, "public-only", "public-only", public)
    _cell(root, "nonprivate-central", "nonprivate-central", public + headroom)
    for eps in (1, 8):
        _cell(root, f"pate-anchored/eps-{eps}", "pate-anchored", public + headroom / 2, eps, sigma=34.3)
        _cell(root, f"dp-sgd-central/eps-{eps}", "dp-sgd-central", public + headroom / 3, eps, sigma=4.85)


def _table_rows(text: str, first_header: str) -> list[dict]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |") and "PATE σ" in line)
    header = [h.strip() for h in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (v.strip() for v in line.strip("|").split("|")))))
    return rows


def test_classes_are_named_and_the_two_noise_scales_have_their_own_columns(tmp_path):
    _comparison(tmp_path, np.full(8, 0.2) + np.linspace(0, 0.02, 8))
    text = write_report(tmp_path, "names").read_text()
    assert "class 1" not in text and "class 2" not in text and "class 3" not in text
    for name in ("oedema (1)", "necrotic / non-enhancing core (2)", "enhancing (3)"):
        assert name in text
    assert "WT whole tumour" in text and "DP-SGD's noise multiplier" in text
    rows = {(r["method"], r["ε budget"]): r for r in _table_rows(text, "method")}
    pate, dpsgd = rows[("pate-anchored", "8")], rows[("dp-sgd-central", "8")]
    assert (pate["PATE σ"], pate["DP-SGD z"]) == ("34.3000", "—")
    assert (dpsgd["PATE σ"], dpsgd["DP-SGD z"]) == ("—", "4.8500")
    assert "Smoke test" not in text


def test_a_headroom_indistinguishable_from_zero_gets_a_smoke_test_banner_not_a_ratio(tmp_path):
    # a tiny run: the ceiling is level with the floor (mean +0.001, SE ~0.007): a ratio would be -43 ± 1068
    _comparison(tmp_path, np.array([0.02, -0.02, 0.01, -0.01, 0.015, -0.012, 0.003, 0.002]))
    text = write_report(tmp_path, "tiny").read_text()
    assert text.splitlines()[2].startswith("> **Smoke test: too small to compare.**")
    summary = next(line for line in text.splitlines() if line.startswith("| dp-sgd-central | 8 |"))
    assert "±" not in summary and "| — |" in summary     # the summary row shows no headroom ratio
    cells = load_cells(tmp_path)
    assert report.headroom_of(report.reference_cell(cells, "dp-sgd-central"),
                              report.reference_cell(cells, "public-only"),
                              report.reference_cell(cells, "nonprivate-central")) is None


def test_the_combined_epsilon_says_interrupted_releases_count():
    release = {"combined_epsilon": 9.5, "combined_epsilon_per_hospital": {"hospital-00": 9.5}, "delta": 1e-3,
               "relation": "replace-one", "accountant": "rdp", "hospital_ledgers": "hospital-ledgers/"}
    text = " ".join(privacy_statement([], release))
    assert "interrupted" in text and "count too" in text and "resumed" in text
    text = " ".join(privacy_statement([], release, ["pate-pca/eps-2.interrupted-20261126-101500"]))
    assert "Set aside here after an interruption: `pate-pca/eps-2.interrupted-20261126-101500`" in text


def test_the_report_names_the_cells_set_aside_after_an_interruption(tmp_path):
    from sim.report import interrupted_cells

    (tmp_path / "pate-pca" / "eps-2.interrupted-20261126-101500").mkdir(parents=True)
    (tmp_path / "pate-pca" / "eps-2").mkdir()
    assert interrupted_cells(tmp_path) == ["pate-pca/eps-2.interrupted-20261126-101500"]


def test_methods_with_equal_scores_do_not_hide_each_other_in_the_epsilon_plot(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    same = np.full(5, 0.5)   # dp-fedavg and dp-sgd-central both at the public model's level
    _cell(tmp_path, "dp-fedavg/eps-1", "dp-fedavg", same, 1)
    _cell(tmp_path, "dp-fedavg/eps-8", "dp-fedavg", same, 8)
    _cell(tmp_path, "dp-sgd-central/eps-1", "dp-sgd-central", same, 1)
    _cell(tmp_path, "dp-sgd-central/eps-8", "dp-sgd-central", same, 8)
    report.plot_metric_vs_epsilon(load_cells(tmp_path), tmp_path / "plot_vs_epsilon.png")
    lines = {line.get_label(): line for line in figures[0].axes[0].lines}
    fedavg, dpsgd = lines["dp-fedavg"], lines["dp-sgd-central"]
    assert (fedavg.get_marker(), fedavg.get_linestyle()) != (dpsgd.get_marker(), dpsgd.get_linestyle())
    assert all(a != b for a, b in zip(fedavg.get_xdata(), dpsgd.get_xdata()))
    assert all(abs(np.log2(a / b)) < 0.1 for a, b in zip(fedavg.get_xdata(), dpsgd.get_xdata()))   # near their ε


def test_a_seeds_report_names_the_seeds_whose_headroom_is_not_measurable(tmp_path):
    from sim.report_seeds import write_seeds_report

    _comparison(tmp_path / "seed-0", np.full(8, 0.2) + np.linspace(0, 0.02, 8))          # clear headroom
    _comparison(tmp_path / "seed-1", np.array([0.02, -0.02, 0.01, -0.01, 0.015, -0.012, 0.003, 0.002]))
    text = write_seeds_report(tmp_path, "seeds").read_text()
    assert "Headroom not measurable in some seeds.** In seed(s) 1 " in text
    for seed in (0, 1):
        (tmp_path / f"seed-{seed}").rename(tmp_path / f"old-{seed}")
    _comparison(tmp_path / "seed-2", np.array([0.02, -0.02, 0.01, -0.01, 0.015, -0.012, 0.003, 0.002]))
    assert "Smoke test: too small to compare.** In seed(s) 2 " in write_seeds_report(tmp_path, "seeds").read_text()


def test_a_cell_stopped_by_a_budget_is_named_in_the_privacy_section():
    cut = {"_cell": "dp-fedavg/eps-8", "method": "dp-fedavg", "stopped_by_budget": "7 of 10 rounds"}
    whole = {"_cell": "dp-fedavg/eps-1", "method": "dp-fedavg", "stopped_by_budget": None}
    text = " ".join(privacy_statement([cut, whole], None))
    assert "Stopped by a budget before their plan" in text and "`dp-fedavg/eps-8` (7 of 10 rounds)" in text
    assert "eps-1" not in text
    assert "Stopped by a budget" not in " ".join(privacy_statement([whole], None))
