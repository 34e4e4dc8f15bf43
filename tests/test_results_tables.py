"""benchmarks/results_tables.py writes the tables of docs/RESULTS.md from comparison folders, in place."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import results_tables  # noqa: E402

FLOOR = [0.40, 0.50, 0.60, 0.50]
CEILING = [0.60, 0.70, 0.80, 0.70]


def _shift(values, by):
    return [round(v + by, 6) for v in values]


def _cell(root, folder, method, per_case, budget=None, real=None, wall=10.0, secure=None):
    cell = root / folder
    cell.mkdir(parents=True)
    result = {"method": method, "dice": {"mean": sum(per_case) / len(per_case)}, "dice_per_case": per_case,
              "epsilon": budget, "epsilon_budget": budget, "delta": 1e-3 if budget else None,
              "wall_seconds": wall, "hospitals": 4}
    if real is not None:   # three real cases around the given means, the last with an algorithm's reference
        cases = [{"case": f"real-{i}", "folder": "/data/real-gt" if i < 2 else "/data/real-dev",
                  "reference": "expert" if i < 2 else "algorithm",
                  **{k: round(v + offset, 6) for k, v in zip(("WT", "TC", "ET"), real)}}
                 for i, offset in enumerate((-0.05, 0.0, 0.05))]
        result["real_check"] = {"dice": dict(zip(("WT", "TC", "ET"), real)), "cases": cases}
    if secure is not None:
        result.update(aggregation="secure", secure_aggregation=secure)
    (cell / "results.json").write_text(json.dumps(result))


def _comparison(root, seed, methods, real=False):
    root.mkdir(parents=True)
    (root / "compare.json").write_text(json.dumps({"seed": seed, "preset": "quick", "epsilons": [1.0, 8.0],
                                                   "methods": methods, "real_check": ["cases"] if real else []}))
    return root


@pytest.fixture
def runs(tmp_path):
    """Two demo comparisons (with a real check) and one holding both secure pairs."""
    demo = []
    for seed, gain in ((1, 0.10), (2, 0.16)):
        root = _comparison(tmp_path / f"demo-s{seed}", seed, ["pate-anchored", "dp-sgd-central"], real=True)
        _cell(root, "public-only", "public-only", FLOOR, real=(0.70, 0.40, 0.50))
        _cell(root, "nonprivate-central", "nonprivate-central", CEILING, real=(0.90, 0.80, 0.70))
        # headroom 0.50 at seed 1 and 0.80 at seed 2; real: half the headroom in every region at seed 1
        # (0.80 / 0.60 / 0.60), 0.8 of it at seed 2 (0.86 / 0.72 / 0.66)
        _cell(root, "pate-anchored/eps-8", "pate-anchored", _shift(FLOOR, gain), 8.0,
              real=(0.80, 0.60, 0.60) if seed == 1 else (0.86, 0.72, 0.66), wall=123.4)
        _cell(root, "dp-sgd-central/eps-8", "dp-sgd-central", _shift(FLOOR, 0.02), 8.0, real=(0.72, 0.44, 0.52))
        # the self-trained floor: PATE's real WT and TC are above it at both seeds
        _cell(root, "public-selftrain", "public-selftrain", _shift(FLOOR, 0.01),
              real=(0.75, 0.55, 0.50) if seed == 1 else (0.85, 0.55, 0.50))
        _cell(root, "_shared/K-128", "public-only", FLOOR)   # a shared model's folder: never a cell
        demo.append(root)
    secure = _comparison(tmp_path / "secure-s0", 0, ["pate-anchored", "pate-anchored-secure", "dp-fedavg-secure",
                                                     "dp-sgd-central"])
    _cell(secure, "public-only", "public-only", FLOOR)
    _cell(secure, "nonprivate-central", "nonprivate-central", CEILING)
    _cell(secure, "pate-anchored/eps-1", "pate-anchored", _shift(FLOOR, 0.10), 1.0)
    _cell(secure, "pate-anchored-secure/eps-1", "pate-anchored-secure", _shift(FLOOR, 0.07), 1.0,
          secure={"participants": 4, "bytes_up_per_hospital": [{"h0": 7188, "h1": 7100}] * 5,
                  "bytes_down_per_hospital": [{"h0": 900, "h1": 901}] * 5})
    _cell(secure, "dp-sgd-central/eps-8", "dp-sgd-central", _shift(FLOOR, 0.16), 8.0)
    _cell(secure, "dp-fedavg/eps-8", "dp-fedavg", _shift(FLOOR, 0.05), 8.0)
    _cell(secure, "dp-fedavg-secure/eps-8", "dp-fedavg-secure", _shift(FLOOR, 0.18), 8.0, wall=361.0,
          secure={"participants": 4, "steps_released": 120, "bytes_up_per_hospital_per_step": {"h0": 4284},
                  "bytes_down_per_hospital_per_step": {"h0": 5156}})
    return demo, secure


DOCUMENT = """# Results

Prose before, with a table of its own that no run writes:

| a | b |
|---|---|
| 1 | 2 |

<!-- results_tables:demo:cells begin -->
stale cells
<!-- results_tables:demo:cells end -->

Between the blocks.

<!-- results_tables:demo:across begin -->
<!-- results_tables:demo:across end -->
<!-- results_tables:secure-vs-trusted begin -->
old
<!-- results_tables:secure-vs-trusted end -->
<!-- results_tables:secure-sums begin -->
<!-- results_tables:secure-sums end -->
<!-- results_tables:goals begin -->
<!-- results_tables:goals end -->
<!-- results_tables:command begin -->
<!-- results_tables:command end -->

Prose after.
"""


def _block(text, name):
    begin, end = f"<!-- results_tables:{name} begin -->\n", f"<!-- results_tables:{name} end -->"
    return text.split(begin, 1)[1].split(end, 1)[0]


def _outside(text):
    return results_tables.MARKER.sub(lambda m: m.group(1) + m.group(4), text)


def _row(block, start):
    return next(line for line in block.splitlines() if line.startswith(start))


def test_write_fills_the_blocks_with_the_runs_numbers_and_leaves_the_rest(runs, tmp_path, capsys):
    demo, secure = runs
    document = tmp_path / "RESULTS.md"
    document.write_text(DOCUMENT)
    results_tables.main(["--write", str(document), f"demo:seed 1={demo[0]}", f"demo:seed 2={demo[1]}",
                         f"secure:seed 0={secure}"])
    text = document.read_text()
    assert _outside(text) == _outside(DOCUMENT)
    assert "stale cells" not in text and "\nold\n" not in text

    cells = _block(text, "demo:cells")
    assert "**seed 1**" in cells and "**seed 2**" in cells and "_shared" not in cells
    assert "real check on 3 case(s)" in cells
    pate = _row(cells.split("**seed 2**")[0], "| pate-anchored ε 8")
    # phantom mean Dice 0.600, headroom +0.50 ± 0.00 (+0.47 over public-selftrain: 0.09 of its 0.19),
    # real 0.800 / 0.600 / 0.600 (their mean 0.667) -> headroom 0.50 / 0.50 / 0.50, the same at every case
    assert pate == ("| pate-anchored ε 8 | 0.600 | +0.50 ± 0.00 | +0.47 ± 0.00 | 0.800 / 0.600 / 0.600 | 0.667 "
                    "| 0.50 ± 0.00 / 0.50 ± 0.00 / 0.50 ± 0.00 |")

    across = _row(_block(text, "demo:across"), "| pate-anchored ε 8")
    # headroom 0.50 and 0.80: mean 0.65, SE across two = 0.15; only seed 2 reaches 0.75 of the real headroom
    assert "+0.65 ± 0.15 (+0.50 / +0.80)" in across and "| 1 of 2 |" in across
    assert "| 0 of 2 |" in _row(_block(text, "demo:across"), "| dp-sgd-central ε 8")

    pairs = _block(text, "secure-vs-trusted")
    pate_pair = _row(pairs, "| secure: seed 0 | pate-anchored-secure")
    assert "| 0.600 | 0.570 | -0.030 ± 0.000 |" in pate_pair
    dp_pair = _row(pairs, "| secure: seed 0 | dp-fedavg-secure")
    assert "+0.80 ± 0.00 | +0.90 ± 0.00 | 112 % |" in dp_pair

    sums = _block(text, "secure-sums")
    assert "| pate-anchored-secure ε 1 | 4 | 5 | 7,188 | 901 |" in sums
    assert "| dp-fedavg-secure ε 8 | 4 | 120 | 4,284 | 5,156 | 361 |" in sums

    goals = _block(text, "goals")
    assert "| demo: seed 1 | pate-anchored +0.50 | **met** |" in goals
    assert "| demo: seed 1 | pate-anchored WT +0.50 / TC +0.50 / ET +0.50 | not met |" in goals
    assert "| demo: seed 2 | pate-anchored WT +0.80 / TC +0.80 / ET +0.80 | **met** |" in goals
    # the world's real ceiling and floor against their levels
    assert "| nonprivate-central on the real scans: WT ≥ 0.85, TC ≥ 0.7, ET ≥ 0.6 | demo: seed 1 " \
           "| WT 0.900 / TC 0.800 / ET 0.700 | **met** |" in goals
    assert "| public-only on the real scans: WT ≥ 0.7 | demo: seed 1 | WT 0.700 | **met** |" in goals
    assert "| secure: seed 0 | ε 1: -0.030 ± 0.000 | not met |" in goals
    assert "| secure: seed 0 | ε 8: 112 % | **met** |" in goals
    # dp-fedavg-secure against today's DP-FedAvg: +0.13 paired
    assert "| dp-fedavg-secure above dp-fedavg (paired mean Dice) | secure: seed 0 | ε 8: +0.130 ± 0.000 | **met** |" in goals
    # the best real method against the self-trained floor, and PATE's own real goal (60 % of the WT and TC headroom)
    assert ("| demo: seed 1 | pate-anchored WT 0.800 vs 0.750 / TC 0.600 vs 0.550 | **met** |") in goals
    assert ("| demo: seed 2 | pate-anchored WT 0.860 vs 0.850 / TC 0.720 vs 0.550 | **met** |") in goals
    assert ("| demo: seed 1 | WT +0.50 of the headroom, 0.800 vs 0.750; TC +0.50 of the headroom, 0.600 vs 0.550 "
            "| not met |") in goals
    assert ("| demo: seed 2 | WT +0.80 of the headroom, 0.860 vs 0.850; TC +0.80 of the headroom, 0.720 vs 0.550 "
            "| **met** |") in goals

    # the phantom ranking of the private models (pate-anchored above dp-sgd-central) is the real one at both seeds
    assert ("| the phantom ranking of the private models predicts the real one: Kendall τ ≥ 0.7 | demo: seed 1 "
            "| τ +1.00 over 2 private models | **met** |") in goals

    command = _block(text, "command")
    assert "--write" in command and "'demo:seed 1=RUNS/demo-s1'" in command and str(tmp_path) not in command
    assert "results_tables: rewrote 6 block(s)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_real_cases_and_the_rank_agreement_are_tabled_per_comparison(runs, tmp_path):
    demo, _ = runs
    comparisons = [results_tables.load_comparison("demo", f"seed {i + 1}", folder) for i, folder in enumerate(demo)]
    written = results_tables.tables(comparisons, [])
    cases = written["demo:real-cases"]
    assert "real-0 from real-gt (expert); real-1 from real-gt (expert); real-2 from real-dev (algorithm)" in cases
    assert "| method | ε budget | K | real-0 WT / TC / ET | real-1 WT / TC / ET | real-2† WT / TC / ET |" in cases
    assert "| pate-anchored | 8.00 | — | 0.750 / 0.550 / 0.550 | 0.800 / 0.600 / 0.600 | 0.850 / 0.650 / 0.650 |" in cases
    rank = written["demo:rank"]
    assert "| demo: seed 1 | 2 | +1.00 | 1 / 0 / 0 |" in rank and "| mean over 2 | | +1.00 ± 0.00 | |" in rank
    # a reversed pair at one seed: τ −1 there, the mean over the two 0
    flipped = json.loads((demo[1] / "dp-sgd-central/eps-8/results.json").read_text())
    flipped["dice"]["mean"] = 0.99
    (demo[1] / "dp-sgd-central/eps-8/results.json").write_text(json.dumps(flipped))
    comparisons[1] = results_tables.load_comparison("demo", "seed 2", demo[1])
    rank = results_tables.tables(comparisons, [])["demo:rank"]
    assert "| demo: seed 2 | 2 | -1.00 | 0 / 1 / 0 |" in rank and "| mean over 2 | | +0.00 ± 1.00 | |" in rank


def test_a_block_without_its_runs_is_refused_and_the_file_kept(runs, tmp_path):
    demo, _ = runs
    document = tmp_path / "RESULTS.md"
    document.write_text(DOCUMENT + "<!-- results_tables:other:cells begin -->\nkeep\n"
                                   "<!-- results_tables:other:cells end -->\n")
    before = document.read_text()
    with pytest.raises(SystemExit, match="other:cells"):
        results_tables.main(["--write", str(document), f"demo:seed 1={demo[0]}"])
    assert document.read_text() == before


def test_without_write_the_tables_are_printed(runs, capsys):
    demo, _ = runs
    results_tables.main([f"seed 1={demo[0]}"])
    out = capsys.readouterr().out
    assert "### main:cells" in out and "| pate-anchored ε 8 | 0.600 | +0.50 ± 0.00 |" in out


@pytest.mark.parametrize("item", ["no-equals-sign", "demo:=folder", ":label=folder"])
def test_malformed_arguments_are_refused_in_one_line(item):
    with pytest.raises(SystemExit, match="results_tables"):
        results_tables.parse_item(item)


def test_a_share_of_a_headroom_that_cannot_be_told_from_zero_is_not_given():
    share = results_tables.headroom_share
    assert share((0.5, 0.1, 40), (0.6, 0.1, 40)) == pytest.approx(0.5 / 0.6)
    assert share((0.5, 0.1, 40), (0.002, 0.14, 40)) is None      # +0.00 ± 0.14: any ratio at all
    assert share((0.5, 0.1, 40), (-0.1, 0.05, 40)) is None
    assert share(None, (0.6, 0.1, 40)) is None


def _stamp(block):
    return block.rstrip("\n").splitlines()[-1]


def _sha256(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_table_is_stamped_with_its_runs_commits_and_digest(runs, tmp_path):
    import hashlib

    demo, secure = runs
    for folder, commit in ((demo[0], "a" * 40), (demo[1], "b" * 40 + "-dirty")):   # recorded by write_run
        for path in folder.rglob("results.json"):
            if "_shared" not in path.parts:
                path.write_text(json.dumps({**json.loads(path.read_text()), "commit": commit}))
    document = tmp_path / "RESULTS.md"
    document.write_text(DOCUMENT)
    results_tables.main(["--write", str(document), f"demo:seed 1={demo[0]}", f"demo:seed 2={demo[1]}",
                         f"secure:seed 0={secure}"])
    text = document.read_text()
    assert _outside(text) == _outside(DOCUMENT)

    def digest(*folders):   # what the module docstring's shell command computes
        files = sorted(_sha256(p) for f in folders for p in f.rglob("results.json") if "_shared" not in p.parts)
        return hashlib.sha256("".join(f"{h}\n" for h in files).encode()).hexdigest()[:12]

    # a group's tables read that group's runs (5 cells a seed), the others every run (7 secure cells, no commit)
    assert _stamp(_block(text, "demo:cells")) == _stamp(_block(text, "demo:across")) == (
        f"*Written from 10 results.json of 2 comparison(s); commit aaaaaaaaaaaa (5), bbbbbbbbbbbb-dirty (5); "
        f"runs digest {digest(*demo)}.*")
    for name in ("secure-vs-trusted", "secure-sums", "goals", "command"):
        assert _stamp(_block(text, name)) == (
            f"*Written from 17 results.json of 3 comparison(s); commit aaaaaaaaaaaa (5), bbbbbbbbbbbb-dirty (5), "
            f"not recorded (7); runs digest {digest(*demo, secure)}.*"), name
    # one changed result changes the digest of every table that read it, and of no other
    path = demo[1] / "pate-anchored/eps-8/results.json"
    path.write_text(path.read_text().replace('"hospitals": 4', '"hospitals": 5'))
    written = results_tables.tables([results_tables.load_comparison("demo", "seed 1", demo[0]),
                                     results_tables.load_comparison("demo", "seed 2", demo[1])], [])
    assert digest(*demo) in _stamp(written["demo:cells"]) and digest(*demo) not in text


def test_one_commit_is_named_once_and_the_goals_are_listed_from_the_thresholds(runs):
    demo, _ = runs
    comparison = results_tables.load_comparison("demo", "seed 1", demo[0])
    assert "; commit not recorded; " in results_tables.stamp([comparison])
    goals = results_tables.goal_list()
    assert f"≥ {100 * results_tables.REAL_GOAL:.0f} % of the real WT, TC and ET headroom" in goals
    assert "`pate-anchored-secure` within 0.02 of `pate-anchored`" in goals and goals.count("\n") == 5


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("document", ["docs/RESULTS.md", "docs/GUIDE.md"])
def test_the_documents_settings_table_is_what_the_presets_give_now(document):
    """K, the hospitals and the grid are stated once, in task.settings.presets: the documents' settings block is the
    generator's table as the presets stand, so a changed preset fails here until the block is written again
    (``benchmarks/results_tables.py --write DOCUMENT``)."""
    text = (REPO / document).read_text(encoding="utf-8")
    assert _block(text, "settings").rstrip("\n") == results_tables.settings_table()


def test_the_settings_table_reads_each_preset(monkeypatch):
    from task.settings.presets import PRESETS

    quick = PRESETS["quick"]
    changed = quick.with_changes(hospitals=3, teachers_per_hospital=5, grid=(24, 24, 16), dp_sgd=dict(max_grad_norm=0.5))
    monkeypatch.setattr(results_tables, "PRESETS", {**PRESETS, "quick": changed})
    row = _row(results_tables.settings_table(), "| `quick` |")
    assert row.startswith("| `quick` | 3 | 5 | 15 | 24 × 24 × 16 | ") and "| 0.5 flat | 2.45 |" in row
    assert row != _row(_block((REPO / "docs/GUIDE.md").read_text(encoding="utf-8"), "settings"), "| `quick` |")


def test_without_comparisons_write_fills_only_the_tables_that_need_no_run(tmp_path, capsys):
    document = tmp_path / "GUIDE.md"
    document.write_text("Before.\n<!-- results_tables:settings begin -->\nstale\n<!-- results_tables:settings end -->\n"
                        "<!-- results_tables:demo:cells begin -->\nkept, stamp and all\n"
                        "<!-- results_tables:demo:cells end -->\nAfter.\n")
    results_tables.main(["--write", str(document)])
    text = document.read_text()
    assert _block(text, "settings").rstrip("\n") == results_tables.settings_table()
    assert _block(text, "demo:cells") == "kept, stamp and all\n" and _outside(text).startswith("Before.\n")
    runs_only = tmp_path / "RUNS.md"
    runs_only.write_text("<!-- results_tables:demo:cells begin -->\nx\n<!-- results_tables:demo:cells end -->\n")
    with pytest.raises(SystemExit, match="no block of a table that needs no run"):
        results_tables.main(["--write", str(runs_only)])
