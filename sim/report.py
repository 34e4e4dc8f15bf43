"""The comparison report: one row per method x epsilon (x K), a CSV of all cells, plots.

Every number comes from the cells' ``results.json`` (whose epsilon is the ledger's); the report
re-checks each cell's epsilon against its ``ledger.jsonl`` and flags any disagreement in the table,
so a report can never show an epsilon its ledger does not support.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from privacy.ledger import Ledger
from task.data.layouts import CLASSES, PHANTOMS_SOURCE, LayoutName
from task.io import atomic_write_bytes, atomic_write_text
from sim import report_real
from task.settings import methods as registry   # every method's family and role: the report never tests a name
from task.settings.methods import Role
from task.options import Init, NoiseKind
from task.learning.phases import PHASES
from task.reporting.results import CSV_COLUMNS as RESULT_CSV_COLUMNS, DICE_KEYS, csv_row
from task.reporting.trust import PROTECTS, trust_line

DICE_COLUMNS = DICE_KEYS
#: the comparison's world (task.world.describe_world), written by sim.runners.compare beside the cells
WORLD_FILE = "world.json"
#: the results record's columns (task.reporting.results.RunResults), with the cell's folder and the ledger re-check
CSV_COLUMNS = ("cell",) + RESULT_CSV_COLUMNS + ("ledger_check",)
#: what headroom is also given for, class by class: the three classes and the BraTS regions
HEADROOM_KEYS = ("1", "2", "3", "WT", "TC", "ET")
#: the BraTS regions, by their usual abbreviations
REGIONS = {"WT": "whole tumour", "TC": "tumour core", "ET": "enhancing tumour"}


def class_name(key: str) -> str:
    """A class or region as a reader knows it: ``"1"`` -> ``"oedema (1)"``, ``"WT"`` stays ``"WT"`` (the
    report says once what the regions are)."""
    return f"{CLASSES[int(key)]} ({key})" if str(key).isdigit() else str(key)


#: one sentence naming every class and region, for reports and plots
CLASS_LEGEND = ("Classes: " + ", ".join(f"{k} {CLASSES[k]}" for k in (1, 2, 3)) + "; regions: "
                + ", ".join(f"{k} {v}" for k, v in REGIONS.items()) + " (WT = 1+2+3, TC = 2+3, ET = 3).")


def load_cells(root: str | Path) -> list[dict]:
    """Every ``results.json`` below ``root`` (one per cell), with its folder and a ledger check."""
    cells = []
    for path in sorted(Path(root).rglob("results.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a cell being written by a live run; atomic writes make this rare
        result["_cell"] = str(path.parent.relative_to(root))
        result["_ledger_check"] = ledger_check(path.parent, result)
        cells.append(result)
    return cells


def ledger_check(cell_dir: Path, result: Mapping[str, Any]) -> str:
    """'ok' when the cell's epsilon equals its ledger's worst owner (or both are absent), else why not."""
    ledger_path = cell_dir / "ledger.jsonl"
    epsilon = result.get("epsilon")
    if not ledger_path.exists():
        return "ok" if epsilon is None else "ledger missing"
    ledger = Ledger.load(ledger_path)
    if len(ledger) == 0:
        return "ok" if not epsilon else "ledger empty"
    if epsilon is None:
        return "epsilon missing"
    relation = result.get("relation")
    worst = max(ledger.spent(owner, result["delta"], relation=relation).epsilon for owner in ledger.owners())
    return "ok" if math.isclose(worst, float(epsilon), rel_tol=1e-6, abs_tol=1e-9) else f"ledger says {worst:.4g}"


def cells_to_csv(cells: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for cell in cells:
        writer.writerow({"cell": cell["_cell"], **csv_row(cell), "ledger_check": cell["_ledger_check"]})
    return buffer.getvalue()


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.3g}"
    return str(value)


def _sort_key(cell: Mapping[str, Any]):
    return (str(cell.get("method")), float(cell.get("epsilon_budget") or math.inf), int(cell.get("teachers") or 0))


#: a table column: its header and how a cell's row shows it
Column = tuple[str, Callable[[Mapping[str, Any]], Any]]


def table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]]) -> str:
    """A markdown table whose every column is declared once, header beside value (no parallel lists)."""
    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(value(row)) for _, value in columns) + " |" for row in rows]
    return "\n".join(lines)


def _number(key: str, digits: int = 3) -> Callable[[Mapping[str, Any]], str]:
    return lambda cell: _fmt(cell.get(key), digits)


def _dice(key: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda cell: _fmt((cell.get("dice") or {}).get(key))


def _noise(pate: bool) -> Callable[[Mapping[str, Any]], str]:
    """A cell's ``sigma`` in the column of what it is: PATE's absolute noise standard deviation on the teachers'
    aggregated codes (``pate``), or DP-SGD's noise multiplier z = σ / clip norm."""
    return lambda cell: (_fmt(cell.get("sigma"), 4) if registry.is_pate(cell.get("method")) == pate else "—")


#: what the two noise columns hold (said under the table)
NOISE_NOTE = ("*PATE σ* is the standard deviation of the Gaussian noise added to the teachers' aggregated codes, on "
              "the codes' own scale (the ledger divides it by the codec's sensitivity at that K); *DP-SGD z* is "
              "DP-SGD's noise multiplier, the noise's standard deviation divided by the clipping norm (the first "
              "epoch's under a schedule). The two are not on one scale.")

_PRIVACY_COLUMNS: tuple[Column, ...] = (
    ("method", lambda c: c.get("method")), ("ε budget", _number("epsilon_budget", 2)),
    ("ε spent", _number("epsilon", 3)))
_GUARANTEE_COLUMNS: tuple[Column, ...] = (
    ("δ", lambda c: _fmt(c.get("delta"), 6) if c.get("delta") is not None else "—"),
    ("relation", lambda c: c.get("relation") or "—"), ("accountant", lambda c: c.get("accountant") or "—"))
#: the classification table (sim.runners.classification_compare)
ACCURACY_COLUMNS: tuple[Column, ...] = (
    *_PRIVACY_COLUMNS, *_GUARANTEE_COLUMNS, ("accuracy", _number("accuracy")), ("wall s", _number("wall_seconds", 0)),
    ("ledger", lambda c: c["_ledger_check"]))
#: the segmentation table: every cell's privacy, its Dice per class and region, its costs
SEGMENTATION_COLUMNS: tuple[Column, ...] = (
    *_PRIVACY_COLUMNS, ("ε add/remove", _number("epsilon_add_remove", 3)), *_GUARANTEE_COLUMNS,
    ("PATE σ", _noise(pate=True)), ("DP-SGD z", _noise(pate=False)), ("K", _number("teachers")),
    ("H", _number("hospitals")), ("N", _number("queries")),
    *((f"Dice {class_name(k)}" if k.isdigit() else k, _dice(k)) for k in DICE_COLUMNS),
    ("teacher mean", _number("teacher_dice_mean")), ("ensemble", _number("ensemble_dice_mean")),
    ("bytes up", _number("bytes_up_per_query_per_teacher")), ("wall s", _number("wall_seconds", 0)),
    ("ledger", lambda c: c["_ledger_check"]))


def markdown_table(cells: Sequence[Mapping[str, Any]], accuracy: bool = False) -> str:
    """Every cell, sorted by method, ε and K: the classification (``accuracy``) or segmentation columns."""
    return table(ACCURACY_COLUMNS if accuracy else SEGMENTATION_COLUMNS, sorted(cells, key=_sort_key))


def verdicts(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Plain statements of where PATE beats DP-SGD and public-only at each epsilon, and where not."""
    def mean_dice(cell):
        return (cell.get("dice") or {}).get("mean")

    by_eps: dict[float, dict[str, list]] = {}
    for cell in cells:
        if cell.get("epsilon_budget") is None or mean_dice(cell) is None:
            continue
        by_eps.setdefault(float(cell["epsilon_budget"]), {}).setdefault(cell["method"], []).append(cell)
    def best_reference(role):   # the first method of that role with a scored cell, and its best cell
        for name in registry.names(role=role):
            found = [c for c in cells if c.get("method") == name and mean_dice(c) is not None]
            if found:
                return name, max(found, key=mean_dice)
        return registry.names(role=role)[0], None

    floor_name, public_cell = best_reference(Role.FLOOR)
    public_only = mean_dice(public_cell) if public_cell is not None else None
    nonprivate = mean_dice(best_reference(Role.CEILING)[1]) if best_reference(Role.CEILING)[1] is not None else None
    lines = []
    for eps in sorted(by_eps):
        methods = by_eps[eps]
        best = {m: max(methods[m], key=mean_dice) for m in methods}
        # teacher-based methods (their K is swept: the PATE family) against the other private methods
        pate = {m: c for m, c in best.items() if _record(m) is not None and _record(m).sweeps_k}
        dpsgd = {m: c for m, c in best.items() if registry.is_private(m) and m not in pate}
        if public_only is not None:   # the DP baselines against the public model they started from
            for name, cell in sorted(dpsgd.items()):
                start = "the public model" if cell.get("init") == Init.PUBLIC else "random weights"
                lines.append(f"ε = {eps:g}: {name} (from {start}) with mean Dice "
                             f"{mean_dice(cell):.3f} " + _versus(cell, mean_dice(cell), floor_name, public_only,
                                                                 public_cell.get("dice_per_case")) + ".")
        if not pate:
            continue
        top_pate_method, top_pate = max(pate.items(), key=lambda kv: mean_dice(kv[1]))
        parts = [f"ε = {eps:g}: best PATE is {top_pate_method} (K = {top_pate.get('teachers')}) with mean Dice "
                 f"{mean_dice(top_pate):.3f}"]
        for name, cell in sorted(dpsgd.items()):
            parts.append("it " + _versus(top_pate, mean_dice(top_pate), name, mean_dice(cell),
                                         cell.get("dice_per_case")))
        if public_only is not None:
            per_case = public_cell.get("dice_per_case") or top_pate.get("public_only_dice_per_case")
            parts.append("it " + _versus(top_pate, mean_dice(top_pate), floor_name, public_only, per_case,
                                         loud=True))
        ceiling = top_pate.get("ensemble_dice_mean")
        if ceiling is not None:
            # not a ceiling: the student generalises from its pseudo-labels and can score above their decode
            parts.append(f"the teachers' encodings averaged and decoded without noise score {ceiling:.3f} through "
                         "this compressor (a diagnostic, not a release)")
        lines.append("; ".join(parts) + ".")
    lines += floor_verdicts(cells)
    if nonprivate is not None:
        lines.append(f"Non-private centralised training reaches {nonprivate:.3f} (no privacy).")
    return lines


def per_case_of(cell: Mapping[str, Any] | None, key: str = "mean") -> list | None:
    """A cell's per-test-case Dice: ``mean`` -- each case's mean over its classes (``dice_per_case``); a class
    or region (:data:`HEADROOM_KEYS`) -- that class's Dice on the cases whose truth contains it, ``None`` on the
    others (``dice_per_case_class``, task.learning.training.PerCaseDice)."""
    if cell is None:
        return None
    if key == "mean":
        return cell.get("dice_per_case")
    return (cell.get("dice_per_case_class") or {}).get(key)


def reference_cell(cells: Sequence[Mapping[str, Any]], method: str | None) -> Mapping[str, Any] | None:
    """The (first) cell of a floor or ceiling method that has per-case Dice, or None."""
    found = [c for c in cells if method is not None and c.get("method") == method and c.get("dice_per_case")]
    return found[0] if found else None


def _record(name):
    try:
        return registry.method(name)
    except KeyError:
        return None


def floors_of(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The public floors present in these cells, in the registry's order (the first is the one *headroom
    recovered* is measured from; the report also states it against the others)."""
    return [m for m in registry.names(role=Role.FLOOR) if reference_cell(cells, m) is not None]


def ceiling_of(cells: Sequence[Mapping[str, Any]]) -> str | None:
    return next((m for m in registry.names(role=Role.CEILING) if reference_cell(cells, m) is not None), None)


def headroom_of(cell, floor_cell, ceiling_cell, key: str = "mean") -> tuple[float, float, int] | None:
    """:func:`headroom_recovered` of ``cell`` between a floor and the ceiling, over the test cases for ``key``
    (``mean``: every case; a class or region: the cases that contain it). One estimator for every key."""
    return headroom_recovered(per_case_of(cell, key), per_case_of(floor_cell, key), per_case_of(ceiling_cell, key))


def headroom_per_class(cell, floor_cell, ceiling_cell) -> dict[str, tuple[float, float, int] | None]:
    """Headroom recovered per class (1, 2, 3) and region (WT, TC, ET): (Dice_c - floor_c) / (ceiling_c - floor_c)
    paired over the test cases that contain c, with the same delta-method standard error as the mean's."""
    return {key: headroom_of(cell, floor_cell, ceiling_cell, key) for key in HEADROOM_KEYS}


def format_ratio(value: tuple[float, float, int] | None, se: bool = True) -> str:
    if value is None:
        return "—"
    return f"{value[0]:+.2f} ± {value[1]:.2f}" if se else f"{value[0]:+.2f}"


def best_private_cells(cells: Sequence[Mapping[str, Any]]) -> dict[float, dict[str, Mapping[str, Any]]]:
    """Per budget, each private method's cell (with a K sweep: its best K by mean Dice, as the verdicts above)."""
    by_eps: dict[float, dict[str, Mapping[str, Any]]] = {}
    for cell in cells:
        dice = (cell.get("dice") or {}).get("mean")
        if not registry.is_private(cell.get("method")) or cell.get("epsilon_budget") is None or dice is None:
            continue
        slot = by_eps.setdefault(float(cell["epsilon_budget"]), {})
        held = slot.get(cell["method"])
        if held is None or dice > held["dice"]["mean"]:
            slot[cell["method"]] = cell
    return by_eps


def floor_verdicts(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every private method against every public floor after the first (``public-selftrain``: what
    the public query scans give with no hospital), paired over test cases, and each method's headroom
    recovered per class against the first floor -- *what* it learned, class by class."""
    floors = floors_of(cells)
    ceiling = reference_cell(cells, ceiling_of(cells))
    lines = []
    for eps, methods in sorted(best_private_cells(cells).items()):
        for name, cell in sorted(methods.items()):
            score = cell["dice"]["mean"]
            for floor in floors[1:]:
                floor_cell = reference_cell(cells, floor)
                lines.append(f"Against {floor} at ε = {eps:g}: {name} with mean Dice {score:.3f} "
                             + _versus(cell, score, floor, floor_cell["dice"]["mean"], floor_cell.get("dice_per_case"),
                                       loud=True) + ".")
            if floors and ceiling is not None:
                per_class = headroom_per_class(cell, reference_cell(cells, floors[0]), ceiling)
                if any(v is not None for v in per_class.values()):
                    lines.append(f"Headroom recovered per class at ε = {eps:g}, {name} (over {floors[0]}, ± SE): "
                                 + ", ".join(f"{class_name(k)} {format_ratio(v)}"
                                             for k, v in per_class.items()) + ".")
    return lines


def paired_difference(first: Sequence[float | None] | None,
                      second: Sequence[float | None] | None) -> tuple[float, float, int] | None:
    """(mean, standard error, n) of first - second over the cases both scored; None if not comparable.

    Two models evaluated on the same test cases: the per-case difference removes the between-case spread
    that dominates each model's own average, so a real gap shows up with far fewer cases.
    """
    if not first or not second or len(first) != len(second):
        return None
    diffs = np.array([a - b for a, b in zip(first, second) if a is not None and b is not None], dtype=np.float64)
    if len(diffs) < 3:
        return None
    return float(diffs.mean()), float(diffs.std(ddof=1) / np.sqrt(len(diffs))), int(len(diffs))


def headroom_recovered(cell: Sequence[float | None] | None, public_only: Sequence[float | None] | None,
                       nonprivate: Sequence[float | None] | None) -> tuple[float, float, int] | None:
    """Share of the headroom a method recovers, paired over test cases: (ratio, standard error, n).

    R = mean(d) / mean(h) with d_i = Dice_i - public-only_i and h_i = non-private_i - public-only_i on the same
    test case i: 0 is the public model's level, 1 the non-private pooled model's. Its standard error
    is the ratio estimator's (delta method): sqrt(var(d - R h) / n) / |mean(h)|. None when the three were not
    scored on the same cases, or when the headroom is not positive by more than two of its standard errors
    (:func:`headroom_is_measurable`): a ratio over a denominator indistinguishable from zero has no bounded
    confidence interval (Fieller 1954) and its delta-method error is meaningless (e.g. -43 ± 1068).
    """
    if not cell or not public_only or not nonprivate or not (len(cell) == len(public_only) == len(nonprivate)):
        return None
    rows = [(c, p, q) for c, p, q in zip(cell, public_only, nonprivate) if None not in (c, p, q)]
    if len(rows) < 3:
        return None
    values = np.asarray(rows, dtype=np.float64)
    d, h = values[:, 0] - values[:, 1], values[:, 2] - values[:, 1]
    if not headroom_is_measurable(float(h.mean()), float(np.std(h, ddof=1) / np.sqrt(len(h)))):
        return None
    ratio = d.mean() / h.mean()
    se = float(np.std(d - ratio * h, ddof=1) / np.sqrt(len(d)) / abs(h.mean()))
    return float(ratio), se, int(len(d))


def headroom_is_measurable(mean: float, se: float) -> bool:
    """The headroom (ceiling minus floor, paired) is positive by more than two standard errors -- the rule the
    verdicts use for "beats". Below it, Fieller's 95 % confidence set of a ratio over it is unbounded."""
    return mean > 0 and mean > 2 * se


def smoke_test_banner(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """A warning at the top of a report whose non-private ceiling does not clearly beat the public floor:
    then no method can be placed between them (a tiny run's headroom of -43 ± 1068), so the report is a
    check that everything runs, not a comparison. Empty when the headroom is measurable or absent."""
    floors, ceiling = floors_of(cells), ceiling_of(cells)
    if not floors or ceiling is None:
        return []
    paired = paired_difference(per_case_of(reference_cell(cells, ceiling)),
                               per_case_of(reference_cell(cells, floors[0])))
    if paired is None or headroom_is_measurable(paired[0], paired[1]):
        return []
    mean, se, n = paired
    return [f"> **Smoke test: too small to compare.** {ceiling} beats {floors[0]} by {mean:+.3f} ± {se:.3f} mean "
            f"Dice over {n} test cases, not by more than two standard errors, so there is no headroom to place a "
            "private method in: *headroom recovered* is left out (—) and the verdicts below cannot rank the "
            "methods. This run checks that everything works; compare methods on a larger preset.", ""]


def summary_table(cells: Sequence[Mapping[str, Any]]) -> str:
    """The question's table: mean Dice and the share of headroom recovered (paired SE) per method and ε --
    against the first public floor, against every other floor, and per class and region --
    where each method started and which setting it chose (on public validation)."""
    floors = floors_of(cells)
    primary = reference_cell(cells, floors[0] if floors else registry.names(role=Role.FLOOR)[0])
    ceiling = reference_cell(cells, ceiling_of(cells))

    def recovered(cell):
        found = headroom_of(cell, primary, ceiling)
        return "—" if found is None else f"{found[0]:+.2f} ± {found[1]:.2f}"

    def over(floor):
        reference = reference_cell(cells, floor)
        return lambda cell: format_ratio(headroom_of(cell, reference, ceiling))

    classes = {id(cell): headroom_per_class(cell, primary, ceiling) for cell in cells}   # once per row

    def per_class(keys):
        return lambda cell: " / ".join(format_ratio(classes[id(cell)][k], se=False) for k in keys)

    columns: list[Column] = [
        *_PRIVACY_COLUMNS, ("mean Dice", _dice("mean")), ("headroom recovered (± SE)", recovered),
        *((f"headroom over {floor} (± SE)", over(floor)) for floor in floors[1:]),
        ("headroom: oedema / core / enhancing (classes 1 / 2 / 3)", per_class(("1", "2", "3"))),
        ("WT / TC / ET", per_class(("WT", "TC", "ET"))),
        ("started from", _started_from), ("setting (chosen on public validation)", _setting_chosen)]
    return table(columns, sorted(cells, key=_sort_key))


def _started_from(cell: Mapping[str, Any]) -> str:
    record = _record(cell.get("method"))
    start = cell.get("init") or ("public model" if record is not None and record.starts_from_public else "—")
    return {"public": "public model", "scratch": "random weights"}.get(start, start)


def _describe_setting(setting: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in setting.items())


def _setting_chosen(cell: Mapping[str, Any]) -> str:
    selection = cell.get("selection")
    if selection:   # private selection (task.learning.selection): a grid entry or the public model, unchanged
        index, candidates = int(selection.get("chosen") or 0), selection.get("candidates") or []
        chosen = candidates[index] if index < len(candidates) else None
        what = _describe_setting(chosen) if isinstance(chosen, Mapping) else str(chosen)
        return f"{what} ({index + 1} of {len(candidates)}, private selection on held-out private patients)"
    if cell.get("settings_grid"):
        chosen = cell["settings_grid"][int(cell.get("setting_chosen") or 0)]
        return (_describe_setting(chosen)
                + f" ({int(cell.get('setting_chosen') or 0) + 1} of {len(cell['settings_grid'])})")
    if cell.get("selftrain"):
        chosen = cell["selftrain"]
        return f"round {chosen.get('round_chosen')} of {chosen.get('rounds')}, temperature {chosen.get('temperature'):g}"
    return "—"


def headroom_class_table(cells: Sequence[Mapping[str, Any]]) -> str | None:
    """Headroom recovered per class and region with its paired standard error, one row per cell that is
    neither a floor nor the ceiling; None when no cell has per-class Dice (older results)."""
    floors = floors_of(cells)
    ceiling = reference_cell(cells, ceiling_of(cells))
    if not floors or ceiling is None:
        return None
    primary = reference_cell(cells, floors[0])
    shown = [(cell, headroom_per_class(cell, primary, ceiling)) for cell in sorted(cells, key=_sort_key)
             if not registry.is_ceiling(cell.get("method")) and cell.get("method") != floors[0]]
    shown = [(cell, ratios) for cell, ratios in shown if any(v is not None for v in ratios.values())]
    if not shown:
        return None
    columns: list[Column] = [
        ("method", lambda row: row[0].get("method")), ("ε budget", lambda row: _fmt(row[0].get("epsilon_budget"), 2)),
        ("K", lambda row: _fmt(row[0].get("teachers"))),
        *((f"{class_name(k)} (± SE)", lambda row, k=k: format_ratio(row[1][k]))
          for k in HEADROOM_KEYS)]
    return table(columns, shown)


def _versus(cell: Mapping[str, Any], score: float, other: str, other_score: float,
            other_per_case: Sequence[float | None] | None, loud: bool = False) -> str:
    """Says "beats" only when the paired difference exceeds two standard errors, "is level with" otherwise."""
    paired = paired_difference(cell.get("dice_per_case"), other_per_case)
    if paired is None:                                   # older results without per-case Dice: compare means
        word = "beats" if score > other_score else ("does NOT beat" if loud else "does not beat")
        return f"{word} {other} ({other_score:.3f})"
    mean, se, n = paired
    if abs(mean) <= 2 * se:
        word = "is level with"
    elif mean > 0:
        word = "beats"
    else:
        word = "does NOT beat" if loud else "does not beat"
    return (f"{word} {other} ({other_score:.3f}; paired difference {mean:+.3f} ± {se:.3f} over {n} test cases"
            f"{', within two standard errors' if word == 'is level with' else ''})")


def scoring_line(cells: Sequence[Mapping[str, Any]]) -> str:
    """How the cells' models were scored (their ``inference``, ``task.learning.inference``), phantom test set and real
    scans alike; cells written before test-time mirroring carry none and were scored with one forward pass."""
    named = [c["inference"] for c in cells if c.get("inference")]
    kinds = sorted(set(named))
    one_pass = len(cells) - len(named)
    if not kinds:
        return "Scoring: one forward pass per scan."
    if not one_pass:
        return f"Scoring: {'; '.join(kinds)}."
    return (f"Scoring: {'; '.join(kinds)} for {len(named)} cell(s); one forward pass for {one_pass} (scored "
            "before test-time mirroring): compare them with care.")


def write_report(root: str | Path, title: str, settings: Mapping[str, Any] | None = None,
                 accuracy: bool = False, overlays: Iterable[Path] = (),
                 release: Mapping[str, Any] | None = None) -> Path:
    """Write cells.csv, report.md and plots into ``root``; returns the report path.

    Args:
        root: the comparison's folder: every ``results.json`` below it is one cell; the report, cells.csv and
            the plots are written there (its world.json, when present, gives the World section).
        title: the report's heading.
        settings: the comparison's settings, listed under the title (None or empty = not listed).
        accuracy: the cells are classification tasks (accuracy, not Dice): no Dice-only tables, plots or
            verdicts.
        overlays: further images (e.g. ``plot_comparison_overlays``) embedded at the end when they exist.
        release: what the comparison released together (``sim.runners.compare.combined_release``): the
            combined epsilon per hospital from the hospitals' own ledgers, stated before the table.
    """
    root = Path(root)
    cells = load_cells(root)
    atomic_write_text(root / "cells.csv", cells_to_csv(cells))
    plots = plot_metric_vs_epsilon(cells, root / "plot_vs_epsilon.png", accuracy=accuracy)
    k_plot = None if accuracy else plot_dice_vs_teachers(cells, root / "plot_dice_vs_teachers.png")
    class_plot = None if accuracy else plot_headroom_per_class(headroom_rows(cells), root / "plot_headroom_per_class.png")
    lines = [f"# {title}", ""]
    if not accuracy:
        lines += smoke_test_banner(cells)
    if settings:
        lines += ["Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items()), ""]
    if not accuracy:
        lines += [report_real.header_line(cells), scoring_line(cells), ""]
    if (root / WORLD_FILE).exists():
        lines += world_section(json.loads((root / WORLD_FILE).read_text()), cells)
    lines += privacy_statement(cells, release, interrupted_cells(root))
    lines += [
        "Every ε below is what the cell's ledger says was spent (column *ledger* re-checks it). Column "
        "*ensemble* decodes the teachers' averaged encodings without noise: the best pseudo-labels that "
        "compressor can deliver (a simulation-only diagnostic, not a private result); *teacher mean* is the "
        "teachers' own test Dice (likewise).",
        "",
    ]
    if not accuracy:
        lines += ["*Headroom recovered* = (Dice − public-only) / (non-private − public-only), paired over the test "
                  "cases (0: no better than the public model; 1: as good as pooling every patient without "
                  "privacy), with its standard error. It and the verdicts below pair each test case's Dice "
                  "averaged over the classes present in that case; the *mean Dice* column averages each class "
                  "over the cases that contain it, then the three classes, so a class present in few cases "
                  "weighs more there and the two can differ by a few hundredths. DP-SGD, DP-FedAvg and "
                  "non-private training start from the same public model as PATE's teachers and student unless "
                  "the table says otherwise.", "",
                  "*Headroom per class* is the same estimator for one class c (or region): (Dice_c − public-only_c) / "
                  "(non-private_c − public-only_c), paired over the test cases whose truth contains c; *headroom "
                  "over public-selftrain* measures from the public model self-trained on the public unlabelled query "
                  "scans instead (no hospital involved): the share of the headroom the hospitals themselves gave. "
                  "Every Dice here is a simulation's: phantom patients, test labels known to the simulator. "
                  + CLASS_LEGEND, "",
                  summary_table(cells), ""]
        class_table = headroom_class_table(cells)
        if class_table:
            lines += ["Headroom recovered per class and region, with its paired standard error:", "", class_table, ""]
        floors, ceiling = floors_of(cells), reference_cell(cells, ceiling_of(cells))
        primary = reference_cell(cells, floors[0]) if floors else None
        lines += report_real.real_section(cells, lambda cell: headroom_of(cell, primary, ceiling))
        lines += ["All fields. " + NOISE_NOTE, ""]
    lines += [
        markdown_table(cells, accuracy=accuracy),
        "",
    ]
    if not accuracy:
        found = verdicts(cells)
        if found:
            lines += ["## Where PATE helps, and where it does not", ""] + [f"- {v}" for v in found] + [""]
    lines += cost_section(cells)
    for plot in (plots, k_plot, class_plot, *overlays):
        if plot is not None and Path(plot).exists():
            lines += [f"![{Path(plot).stem}]({Path(plot).relative_to(root)})", ""]
    report = root / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report


def cost_table(cells: Sequence[Mapping[str, Any]]) -> str | None:
    """Seconds per phase of every cell that recorded them (``phase_seconds`` in results.json, ``task.learning.phases``):
    one column per phase any cell spent time in, in :data:`task.learning.phases.PHASES` order, then the wall time."""
    timed = [cell for cell in cells if isinstance(cell.get("phase_seconds"), Mapping)]
    if not timed:
        return None
    seen = {name for cell in timed for name, value in cell["phase_seconds"].items() if value}
    names = [name for name in PHASES if name in seen] + sorted(seen - set(PHASES))
    columns: list[Column] = [("method", lambda c: c.get("method")), ("ε budget", _number("epsilon_budget", 2)),
                             ("K", _number("teachers"))]
    columns += [(name, lambda c, name=name: _fmt(c["phase_seconds"].get(name), 1)) for name in names]
    columns.append(("wall s", _number("wall_seconds", 1)))
    return table(columns, sorted(timed, key=_sort_key))


def cost_section(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's cost table (:func:`cost_table`) under its heading; nothing when no cell recorded phases."""
    found = cost_table(cells)
    if found is None:
        return []
    return ["## Cost", "",
            "Wall seconds per phase of each cell, as the cell measured them (exclusive: time inside a nested phase "
            "counts once, for the inner one). *imports* is the process's start-up before its first cell (later "
            "cells of one process share it); *other* is the rest of the cell's wall time. A DP-SGD cell's times "
            "depend on its secret Poisson batch sizes: a simulation diagnostic no guarantee covers.", "", found, ""]


def _describe_source(source: Mapping[str, Any]) -> str:
    if source.get("kind") == PHANTOMS_SOURCE:
        return (f"phantoms, generator seed {source.get('seed')}, {source.get('institutions')} institution(s), "
                f"shift regime '{source.get('shift')}', {source.get('cases')} cases "
                f"(generator v{source.get('generator_version')})")
    return f"{source.get('kind', 'data')} {source.get('name', '')} ({source.get('cases')} cases)".replace("  ", " ")


def world_section(world: Mapping[str, Any], cells: Sequence[Mapping[str, Any]] = ()) -> list[str]:
    """The report's opening: who holds what, how many, from which distribution, and the room
    between the public-only and the non-private baselines that every private method is placed in."""
    lines = ["## World", ""]
    for name, source in (world.get("sources") or {}).items():
        lines.append(f"- source **{name}**: {_describe_source(source)}")
    if not world.get("two_sources"):
        lines.append("- one population: the public sets are drawn from the same distribution as the hospitals' "
                     "patients (a --data folder, MSD or BraTS, has one population)")
    if world.get("layout") and world.get("layout") != LayoutName.MSD:
        lines.append(f"- data layout: {world['layout']} (label codes mapped to ours: 1 oedema, 2 necrotic / "
                     "non-enhancing core, 3 enhancing; task/data/layouts.py)")
    partitions = world.get("partition_file")
    if partitions:
        chosen = ", ".join(f"{k} ({v})" for k, v in (partitions.get("hospital_partitions") or {}).items())
        lines.append(f"- hospitals from the partition file `{partitions.get('file')}`: {partitions.get('rule')}. "
                     f"Hospital partitions (patients): {chosen}; left out: {partitions.get('left_out_partitions')} "
                     f"partition(s) with {partitions.get('left_out_patients')} patient(s), and "
                     f"{partitions.get('unlisted_cases')} case(s) the file does not list")
    hospitals = world.get("hospitals") or {}
    per = ", ".join(f"{h} {v['patients']} ({'/'.join(v['institutions'])}, {v['teachers']} teachers)"
                    for h, v in hospitals.items())
    lines.append(f"- hospitals (private, {world.get('private_patients')} patients, split seed "
                 f"{world.get('split_seed')}, scheme {world.get('scheme')}): {per}")
    for name, info in (world.get("sets") or {}).items():
        lines.append(f"- {name}: {info['patients']} patients from {info['source']} "
                     f"({'/'.join(info['institutions'])}); {info['role']}")
    if world.get("reference_is_query"):
        lines.append("- the public reference set is the query set's labels (Fay et al.)")
    ceiling = ceiling_of(cells)
    for index, floor in enumerate(floors_of(cells) if ceiling else []):
        paired = paired_difference(per_case_of(reference_cell(cells, ceiling)), per_case_of(reference_cell(cells, floor)))
        if paired is not None:
            mean, se, n = paired
            lines.append(f"- headroom: {ceiling} minus {floor} mean Dice {mean:+.3f} ± {se:.3f} "
                         f"(paired over {n} test cases)" + (": the room every private method is placed in"
                                                             if index == 0 else ": what is left once the public "
                                                             "query scans are used without any hospital"))
    return lines + [""]


def interrupted_cells(root: str | Path) -> list[str]:
    """The cells of a comparison that were interrupted after releasing and set aside when it was resumed
    (``<cell>.interrupted-<time>``, ``sim.runners.compare.set_aside_interrupted``), relative to ``root``."""
    root = Path(root)
    return sorted(str(path.relative_to(root)) for path in root.rglob("*.interrupted-*") if path.is_dir())


def who_sees_what_lines(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per method whose cells say so (results.json ``who_sees_what``), who could see what: the trusted and
    the secure aggregation differ exactly there (server/pate_secure.py)."""
    seen: dict[str, tuple[str, Mapping[str, str]]] = {}
    for cell in sorted(cells, key=lambda c: str(c.get("method"))):
        parties = cell.get("who_sees_what")
        if isinstance(parties, Mapping) and parties and cell.get("method") not in seen:
            seen[str(cell["method"])] = (str(cell.get("aggregation", "trusted")), parties)
    return [f"- {trust_line(method, aggregation, parties)}" for method, (aggregation, parties) in seen.items()]


def privacy_statement(cells: Sequence[Mapping[str, Any]], release: Mapping[str, Any] | None,
                      interrupted: Sequence[str] = ()) -> list[str]:
    """The relation every ε is stated under (one per comparison, else a warning), the threat model, and
    the combined ε of everything released together -- releases of ``interrupted`` cells included."""
    relations = sorted({c.get("relation") for c in cells if c.get("relation")})
    lines = ["## Privacy", ""]
    if len(relations) == 1:
        lines.append(f"- One neighbouring relation for every method: **{relations[0]}** (one patient at one "
                     "hospital), so the ε columns are comparable.")
    elif relations:
        lines.append(f"- WARNING: the cells use different neighbouring relations ({', '.join(relations)}); "
                     "their ε are not comparable at face value.")
    lines.append(f"- Threat model: {PROTECTS}. Who could see what before the noise differs per method (each "
                 "model card states its own, in the same words as below). Each hospital keeps its own ledger and "
                 "lifetime budget.")
    lines += who_sees_what_lines(cells)
    lines.append("- **Simulation-only numbers in this report are not covered by any guarantee**: the "
                 "`nonprivate-central` row (trained on the pooled patients without noise), and every field a "
                 "cell lists under `not_private_diagnostics` in its results.json (teacher Dice, the noise-free "
                 "teacher ensemble, pseudo-label Dice, fallback-teacher counts). A deployment never computes "
                 "them; they exist here to explain the private numbers. So are the wall times (`wall s`) and the "
                 "progress bars' rates of DP-SGD and DP-FedAvg: they grow with the Poisson batch sizes, the "
                 "sampling's secret randomness.")
    noise = sorted({c.get("noise") for c in cells if c.get("noise")})
    if NoiseKind.REPRODUCIBLE in noise:
        lines.append("- The noise of this comparison was **reproducible** (seeded, `--reproducible-noise`): its "
                     "noise is derived from the run's seed, which is the world's split seed printed in the World "
                     "section -- **the noise is public** and anyone can subtract it. A simulation, not a private "
                     "release.")
    if release:
        combined = release.get("combined_epsilon")
        if combined is None:
            lines.append("- Nothing was released from the hospitals' patients under privacy accounting.")
        else:
            per = ", ".join(f"{h} {e:.3g}" for h, e in sorted(release["combined_epsilon_per_hospital"].items()))
            lines.append(f"- **Everything this comparison released, together: ε = {combined:.3g} per patient** "
                         f"at δ = {release['delta']:g} ({release['relation']}, accountant {release['accountant']}), "
                         f"the worst hospital's, from the hospitals' own ledgers `{release['hospital_ledgers']}` "
                         f"({per}). The cells share patients: shipping several models together spends their "
                         "combined ε, not each cell's. Releases by cells that were interrupted before they finished "
                         "count too (each was charged before its noise was drawn), so this ε can exceed what the "
                         "finished cells compose to, and it rises when an interrupted comparison is resumed."
                         + (f" Set aside here after an interruption: {', '.join(f'`{c}`' for c in interrupted)}."
                            if interrupted else ""))
    stopped = [f"`{c['_cell']}` ({c['stopped_by_budget']})" for c in cells if c.get("stopped_by_budget")]
    if stopped:
        lines.append("- **Stopped by a budget before their plan** (a hospital's lifetime budget, shared with the other "
                     "cells, ran out; raise `--lifetime-epsilon` to let them finish): " + ", ".join(stopped) + ".")
    if any(registry.is_ceiling(c.get("method")) for c in cells):
        lines.append("- `nonprivate-central` is trained on the hospitals' patients without privacy: a yardstick "
                     "for the simulation, never a release.")
    return lines + [""]


def _pyplot():
    # matplotlib only where a plot is drawn (about 1.5 s to import): reading cells and tables stays light
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(path, buffer.getvalue())
    return path


#: per method in plot_vs_epsilon.png: markers and line styles that tell overlapping methods apart, and how far
#: (in log2 of ε) neighbouring methods are dodged sideways
SERIES_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
SERIES_LINES = ("-", "--", "-.", ":")
DODGE_LOG2 = 0.04


def plot_metric_vs_epsilon(cells, path: Path, accuracy: bool = False) -> Path | None:
    key = "accuracy" if accuracy else "dice"
    series: dict[str, list[tuple[float, float]]] = {}
    flat: dict[str, float] = {}
    for cell in cells:
        value = cell.get("accuracy") if accuracy else (cell.get("dice") or {}).get("mean")
        if value is None:
            continue
        if cell.get("epsilon_budget") is None:
            flat[cell["method"]] = max(value, flat.get(cell["method"], -1))
        else:
            series.setdefault(cell["method"], []).append((float(cell["epsilon_budget"]), value))
    if not series and not flat:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for index, (method, points) in enumerate(sorted(series.items())):
        best: dict[float, float] = {}
        for eps, value in points:  # with a K sweep, show each method's best K per epsilon
            best[eps] = max(value, best.get(eps, -1))
        xs = sorted(best)
        # methods with equal scores (e.g. two DP baselines at the public model's level) would hide each other:
        # each gets its own marker and line style, and is dodged sideways by a few per cent of its ε
        marker, linestyle = SERIES_MARKERS[index % len(SERIES_MARKERS)], SERIES_LINES[index % len(SERIES_LINES)]
        dodge = 2.0 ** (DODGE_LOG2 * (index - (len(series) - 1) / 2))
        ax.plot([x * dodge for x in xs], [best[x] for x in xs], marker=marker, linestyle=linestyle,
                markerfacecolor="none" if index % 2 else None, label=method)
    for i, (method, value) in enumerate(sorted(flat.items())):
        ax.axhline(value, linestyle="--", color=f"C{(len(series) + i) % 10}", label=f"{method} (no ε)")
    ax.set_xscale("log", base=2)
    if series:
        budgets = sorted({eps for points in series.values() for eps, _ in points})
        ax.set_xticks(budgets, [f"{eps:g}" for eps in budgets])
    ax.set_xlabel("ε budget" + (" (methods dodged sideways to stay visible)" if len(series) > 1 else ""))
    ax.set_ylabel("accuracy" if accuracy else "mean Dice (oedema, core, enhancing)")
    ax.set_title(f"{key} against the privacy budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save(fig, path)
    plt.close(fig)
    return path


def _sweeps_k(cell) -> bool:
    record = _record(cell.get("method"))
    return record is not None and record.sweeps_k


def plot_dice_vs_teachers(cells, path: Path) -> Path | None:
    series: dict[tuple[str, float], list[tuple[int, float]]] = {}
    for cell in cells:
        dice = (cell.get("dice") or {}).get("mean")
        if not _sweeps_k(cell) or dice is None or not cell.get("teachers"):
            continue
        series.setdefault((cell["method"], float(cell["epsilon_budget"])), []).append((int(cell["teachers"]), dice))
    if not any(len({k for k, _ in pts}) > 1 for pts in series.values()):
        return None  # no K sweep in this comparison
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (method, eps), points in sorted(series.items()):
        points.sort()
        ax.plot([k for k, _ in points], [d for _, d in points], marker="o", label=f"{method}, ε={eps:g}")
    teachers: dict[int, float] = {}   # the teachers' own mean test Dice (a simulation diagnostic)
    for cell in cells:
        if _sweeps_k(cell) and cell.get("teachers") and cell.get("teacher_dice_mean"):
            teachers[int(cell["teachers"])] = float(cell["teacher_dice_mean"])
    if len(teachers) > 1:
        ks = sorted(teachers)
        ax.plot(ks, [teachers[k] for k in ks], marker="s", linestyle=":", color="grey", label="mean teacher")
    references = [(m, "--") for m in registry.names(role=Role.FLOOR)] + [(m, "-.") for m in registry.names(role=Role.CEILING)]
    for name, style in references:
        dice = [(c.get("dice") or {}).get("mean") for c in cells if c.get("method") == name]
        if dice and dice[0] is not None:
            ax.axhline(dice[0], linestyle=style, color="black", linewidth=1, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("teachers K")
    ax.set_ylabel("student mean Dice")
    ax.set_title("PATE: Dice against the number of teachers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save(fig, path)
    plt.close(fig)
    return path


def headroom_rows(cells: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, tuple[float, float] | None]]]:
    """(label, {key: (headroom, SE)}) per private method x ε (best K) and per floor after the first, against the
    first floor -- what :func:`plot_headroom_per_class` draws for one comparison."""
    floors = floors_of(cells)
    ceiling = reference_cell(cells, ceiling_of(cells))
    if not floors or ceiling is None:
        return []
    primary = reference_cell(cells, floors[0])
    rows = []
    for floor in floors[1:]:
        rows.append((floor, {k: (v[0], v[1]) if v else None
                             for k, v in headroom_per_class(reference_cell(cells, floor), primary, ceiling).items()}))
    for eps, methods in sorted(best_private_cells(cells).items()):
        for name, cell in sorted(methods.items()):
            rows.append((f"{name} ε={eps:g}", {k: (v[0], v[1]) if v else None
                                               for k, v in headroom_per_class(cell, primary, ceiling).items()}))
    return rows


def plot_headroom_per_class(rows, path: Path, error: str = "± 1 SE, paired over test cases",
                            floor: str | None = None) -> Path | None:
    """Grouped bars: headroom recovered per class and region (x), one bar per method x ε, with error bars.
    ``rows``: (label, {key: (value, error) | None}); the seeds report passes means and CI half-widths."""
    rows = [(label, values) for label, values in rows if any(v is not None for v in values.values())]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 1.2 * len(HEADROOM_KEYS) + 0.25 * len(rows)), 4.2))
    width = 0.8 / len(rows)
    for i, (label, values) in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(HEADROOM_KEYS))]
        heights = [values[k][0] if values.get(k) else np.nan for k in HEADROOM_KEYS]
        errors = [values[k][1] if values.get(k) else 0.0 for k in HEADROOM_KEYS]
        ax.bar(xs, heights, width, yerr=errors, capsize=2, label=label, color=f"C{i % 10}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(1, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(HEADROOM_KEYS)))
    ax.set_xticklabels([class_name(k).replace(" / ", "/\n").replace(" (", "\n(") if k.isdigit() else k
                        for k in HEADROOM_KEYS], fontsize=8)
    ax.set_ylabel(f"headroom recovered (0 = {floor or registry.names(role=Role.FLOOR)[0]}, 1 = non-private)")
    ax.set_title(f"headroom recovered per class ({error}); simulation")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_overlays(path: Path, images, truth, predictions: Mapping[str, Any], slices: int = 3) -> Path:
    """Mid-tumour axial slices: FLAIR with ground truth and each prediction (e.g. student, ensemble).

    ``images`` (n, 4, X, Y, Z), ``truth`` (n, X, Y, Z), ``predictions`` {name: (n, X, Y, Z)}.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap([(0, 0, 0, 0), (0.2, 0.8, 0.2, 0.6), (0.9, 0.2, 0.2, 0.6), (1.0, 0.9, 0.1, 0.7)])
    columns = ["ground truth", *predictions]
    rows = min(slices, len(truth))
    fig, axes = plt.subplots(rows, len(columns), figsize=(2.6 * len(columns), 2.6 * rows), squeeze=False)
    for r in range(rows):
        tumour = (truth[r] > 0).sum(axis=(0, 1))
        z = int(np.argmax(tumour)) if tumour.any() else truth[r].shape[-1] // 2
        flair = images[r, 0, :, :, z]
        for c, name in enumerate(columns):
            label = truth[r] if name == "ground truth" else predictions[name][r]
            ax = axes[r][c]
            ax.imshow(flair.T, cmap="gray", origin="lower")
            ax.imshow(label[:, :, z].T, cmap=cmap, vmin=0, vmax=3, origin="lower", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(name, fontsize=9)
    fig.suptitle("green oedema · red non-enhancing core · yellow enhancing", fontsize=8)
    path = _save(fig, path)
    plt.close(fig)
    return path
