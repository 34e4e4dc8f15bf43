"""The report of a comparison over several seeds: ``OUT/report.md`` over ``OUT/seed-<S>/``.

Why: a seed decides the split of the same phantom patients (who is public, who is at which hospital, who is
tested), the public model and every training run. At one seed the report's standard errors are paired over
test cases only, which hides the largest source of variation: on the quick preset the best private method at ε = 8 once
recovered −1 % to 44 % of the headroom across three seeds (docs/RESULTS.md). This report puts that variation in view:

* per method x ε (x K): the mean over seeds of the mean Dice with a 95 % **t-interval across seeds**
  (mean ± t_{0.975, n−1} · SD / √n: the seeds are the independent replicates; with three seeds t = 4.30, so
  the intervals are honest and wide), every seed's value, the headroom recovered **per seed** (each paired
  over that seed's test cases, ``sim.report.headroom_of``) with its mean, interval and spread, per class too;
* verdicts **paired by seed**: the per-seed differences to a floor, tested with a paired t-interval across
  seeds ("beats" only when the interval excludes 0), and each seed's own verdict paired over its test
  cases (``sim.report._versus``, as in the per-seed reports, which stay in the seed folders).

Every Dice is a simulation's (phantom patients, test labels known to the simulator); the privacy statement
is the hospitals' ledgers', shared by every seed (``sim.runners.compare.run_compare_seeds``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from task.io import atomic_write_text
from sim import report_real
from task.settings.methods import is_ceiling
from sim.report import (CLASS_LEGEND, HEADROOM_KEYS, Column, _fmt, _pyplot, _save, _versus, best_private_cells,
                        cells_to_csv, ceiling_of, class_name, floors_of, headroom_of, interrupted_cells, load_cells,
                        plot_headroom_per_class, privacy_statement, reference_cell, smoke_test_banner, table)

SEED_FOLDER = re.compile(r"^seed-(\d+)$")
LEVEL = 0.95


def seed_cells(root: str | Path) -> dict[int, list[dict]]:
    """{seed: that seed's cells} for every ``seed-<S>`` folder of ``root`` that holds results."""
    found = {}
    for folder in sorted(Path(root).iterdir()):
        match = SEED_FOLDER.match(folder.name)
        if match and folder.is_dir():
            cells = load_cells(folder)
            if cells:
                found[int(match.group(1))] = cells
    return dict(sorted(found.items()))


def t_interval(values: Sequence[float | None], level: float = LEVEL) -> tuple[float, float | None, int] | None:
    """(mean, half-width, n) of the Student-t interval of the mean at ``level`` over the finite values: the
    seeds are independent replicates and few, so the normal 1.96 would understate the half-width (t_{0.975,2}
    = 4.30). Half-width None with one value; None without any."""
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not values:
        return None
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, None, 1
    from scipy import stats   # only where an interval is computed

    half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values)))
    return mean, half, len(values)


def paired_seed_verdict(differences: Sequence[float | None], level: float = LEVEL) -> tuple[str, tuple | None]:
    """A paired t-test across seeds on per-seed differences (method − other): "beats" when the interval lies
    above 0, "does NOT beat" below, "is level with" when it holds 0 or there are fewer than two seeds."""
    interval = t_interval(differences, level)
    if interval is None or interval[1] is None:
        return "is level with", interval
    mean, half, _ = interval
    if mean - half > 0:
        return "beats", interval
    if mean + half < 0:
        return "does NOT beat", interval
    return "is level with", interval


def _format_interval(interval, digits: int = 3, signed: bool = False) -> str:
    if interval is None:
        return "—"
    mean, half, n = interval
    value = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    return value if half is None else f"{value} ± {half:.{digits}f}"


def _key(cell: Mapping[str, Any]) -> tuple:
    budget = cell.get("epsilon_budget")
    return (str(cell.get("method")), math.inf if budget is None else float(budget), int(cell.get("teachers") or 0))


def aggregate(per_seed: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[dict]:
    """One row per method x ε x K present in any seed: per seed its mean Dice, its headroom recovered
    against each floor and per class (against the first floor); their intervals across seeds."""
    groups: dict[tuple, dict[int, Mapping[str, Any]]] = {}
    for seed, cells in per_seed.items():
        for cell in cells:
            groups.setdefault(_key(cell), {})[seed] = cell
    rows = []
    for key in sorted(groups):
        by_seed = groups[key]
        row = {"method": key[0], "epsilon_budget": None if key[1] == math.inf else key[1], "teachers": key[2] or None,
               "seeds": sorted(by_seed), "dice": {}, "headroom": {}, "headroom_by_floor": {}, "class_headroom": {}}
        for seed, cell in sorted(by_seed.items()):
            cells = per_seed[seed]
            floors = floors_of(cells)
            ceiling = reference_cell(cells, ceiling_of(cells))
            row["dice"][seed] = (cell.get("dice") or {}).get("mean")
            for index, floor in enumerate(floors):
                value = headroom_of(cell, reference_cell(cells, floor), ceiling)
                row["headroom_by_floor"].setdefault(floor, {})[seed] = None if value is None else value[0]
                if index == 0:
                    row["headroom"][seed] = None if value is None else value[0]
                    for k in HEADROOM_KEYS:
                        v = headroom_of(cell, reference_cell(cells, floor), ceiling, k)
                        row["class_headroom"].setdefault(k, {})[seed] = None if v is None else v[0]
        row["dice_interval"] = t_interval(row["dice"].values())
        row["headroom_interval"] = t_interval(row["headroom"].values())
        row["class_intervals"] = {k: t_interval(v.values()) for k, v in row["class_headroom"].items()}
        row["floor_intervals"] = {f: t_interval(v.values()) for f, v in row["headroom_by_floor"].items()}
        rows.append(row)
    return rows


def _per_seed(values: Mapping[int, float | None], signed: bool = False) -> str:
    return ", ".join(f"{seed}: " + ("—" if v is None else (f"{v:+.2f}" if signed else f"{v:.3f}"))
                     for seed, v in sorted(values.items()))


def _spread(values: Mapping[int, float | None]) -> str:
    finite = [v for v in values.values() if v is not None]
    if len(finite) < 2:
        return "—"
    return f"SD {np.std(finite, ddof=1):.2f}, {min(finite):+.2f} to {max(finite):+.2f}"


def summary_table(rows: Sequence[Mapping[str, Any]], floors: Sequence[str]) -> str:
    """Mean Dice and headroom across seeds: means with 95 % t-intervals, each seed's value, the spread."""
    def class_means(keys):
        return lambda row: " / ".join("—" if row["class_intervals"].get(k) is None
                                      else f"{row['class_intervals'][k][0]:+.2f}" for k in keys)

    columns: list[Column] = [
        *_ROW_KEY_COLUMNS, ("seeds", lambda row: str(len(row["seeds"]))),
        ("mean Dice (95 % CI over seeds)", lambda row: _format_interval(row["dice_interval"])),
        ("mean Dice per seed", lambda row: _per_seed(row["dice"])),
        ("headroom recovered per seed", lambda row: _per_seed(row["headroom"], signed=True)),
        ("headroom mean (95 % CI)", lambda row: _format_interval(row["headroom_interval"], 2, signed=True)),
        ("headroom spread (SD, range)", lambda row: _spread(row["headroom"])),
        *((f"headroom over {f} (95 % CI)",
           lambda row, f=f: _format_interval(row["floor_intervals"].get(f), 2, signed=True)) for f in floors[1:]),
        ("headroom: oedema / core / enhancing (classes 1 / 2 / 3, mean)", class_means(("1", "2", "3"))),
        ("WT / TC / ET headroom (mean)", class_means(("WT", "TC", "ET")))]
    return table(columns, rows)


def class_table(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """Headroom per class and region: mean over seeds ± the 95 % t half-width."""
    kept = [r for r in rows if any(v is not None for v in r["class_intervals"].values())]
    if not kept:
        return None
    return table([*_ROW_KEY_COLUMNS,
                  *((class_name(k),
                     lambda row, k=k: _format_interval(row["class_intervals"].get(k), 2, signed=True))
                    for k in HEADROOM_KEYS)], kept)


#: what names an aggregated row: the method, its budget and K
_ROW_KEY_COLUMNS: tuple[Column, ...] = (
    ("method", lambda row: row["method"]), ("ε budget", lambda row: _fmt(row["epsilon_budget"], 2)),
    ("K", lambda row: _fmt(row["teachers"])))


def seed_verdicts(per_seed: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Every private method x ε against every floor: a paired t-interval across seeds on the per-seed mean-Dice
    differences, then each seed's own verdict paired over its test cases."""
    best = {seed: best_private_cells(cells) for seed, cells in per_seed.items()}
    pairs = sorted({(eps, name) for methods in best.values() for eps, held in methods.items() for name in held})
    floors = [f for f in dict.fromkeys(f for cells in per_seed.values() for f in floors_of(cells))]
    lines = []
    for eps, name in pairs:
        for floor in floors:
            differences, per_seed_words = {}, []
            for seed, cells in per_seed.items():
                cell = best[seed].get(eps, {}).get(name)
                floor_cell = reference_cell(cells, floor)
                if cell is None or floor_cell is None:
                    continue
                score, other = cell["dice"]["mean"], floor_cell["dice"]["mean"]
                differences[seed] = score - other
                per_seed_words.append(f"seed {seed} " + _versus(cell, score, floor, other,
                                                                 floor_cell.get("dice_per_case"), loud=True))
            if not differences:
                continue
            word, interval = paired_seed_verdict(differences.values())
            test = ("fewer than two seeds: no interval" if interval is None or interval[1] is None else
                    f"mean difference {interval[0]:+.3f}, 95 % CI [{interval[0] - interval[1]:+.3f}, "
                    f"{interval[0] + interval[1]:+.3f}] (paired t over {interval[2]} seeds)")
            lines.append(f"ε = {eps:g}: {name} {word} {floor} across seeds ({test}); per seed, paired over test "
                         f"cases: " + "; ".join(per_seed_words) + ".")
    return lines


def plot_headroom_by_seed(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Each private method x ε: its headroom recovered at every seed (dots) and the mean (bar): the spread."""
    kept = [r for r in rows if r["epsilon_budget"] is not None and any(v is not None for v in r["headroom"].values())]
    if not kept:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(kept)), 4.2))
    seeds = sorted({s for r in kept for s in r["seeds"]})
    for i, row in enumerate(kept):
        values = [(s, v) for s, v in sorted(row["headroom"].items()) if v is not None]
        ax.bar(i, np.mean([v for _, v in values]), 0.6, color="lightgrey", edgecolor="grey")
        for s, v in values:
            ax.plot(i, v, marker="o", linestyle="", color=f"C{seeds.index(s) % 10}", label=f"seed {s}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(1, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(kept)))
    ax.set_xticklabels([f"{r['method']}\nε={r['epsilon_budget']:g}" + (f" K={r['teachers']}" if r["teachers"] else "")
                        for r in kept], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("headroom recovered (per seed; bar: mean)")
    ax.set_title("headroom recovered at each seed; simulation")
    ax.grid(alpha=0.3, axis="y")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7)
    path = _save(fig, path)
    plt.close(fig)
    return path


def write_seeds_report(root: str | Path, title: str, settings: Mapping[str, Any] | None = None,
                       release: Mapping[str, Any] | None = None) -> Path:
    """``root/report.md`` (and cells.csv over every seed, plots) aggregating ``root/seed-<S>/``."""
    root = Path(root)
    per_seed = seed_cells(root)
    all_cells = [cell for cells in per_seed.values() for cell in cells]
    for seed, cells in per_seed.items():   # cells.csv names each cell with its seed folder
        for cell in cells:
            cell["_cell"] = f"seed-{seed}/{cell['_cell']}"
    atomic_write_text(root / "cells.csv", cells_to_csv(all_cells))
    floors = [f for f in dict.fromkeys(f for cells in per_seed.values() for f in floors_of(cells))]
    rows = aggregate(per_seed)
    lines = [f"# {title}", ""]
    unmeasurable = [seed for seed, cells in per_seed.items() if smoke_test_banner(cells)]
    if unmeasurable:   # the per-seed reports say why, each with its own numbers
        everywhere = len(unmeasurable) == len(per_seed)
        lines += [f"> **{'Smoke test: too small to compare.' if everywhere else 'Headroom not measurable in some seeds.'}"
                  f"** In seed(s) {', '.join(map(str, unmeasurable))} the non-private ceiling does not beat the "
                  "public floor by more than two standard errors (see `seed-<S>/report.md`): there, *headroom "
                  "recovered* is left out (—)" + (" and the methods cannot be ranked." if everywhere else "."), ""]
    if settings:
        lines += ["Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items()), ""]
    lines += [report_real.header_line(all_cells), ""]
    lines += privacy_statement(all_cells, release, interrupted_cells(root))
    lines[-1:-1] = [f"- Every seed splits the same patients: all seeds' cells charged the same hospital ledgers under "
                    "one lifetime budget, and the combined ε above covers every seed."]
    if release and release.get("patients_moving_between_hospitals"):
        lines[-1:-1] = [f"- {release['patients_moving_between_hospitals']} patient(s) sat at different hospitals in "
                        f"different seeds; the combined ε composes every ledger they were charged in "
                        f"(ε = {release['combined_epsilon_moving_patients']:.3g})."]
    lines += [
        "## Across seeds", "",
        f"{len(per_seed)} seeds ({', '.join(map(str, per_seed))}). Each seed is its own split of the same phantom "
        "patients (who is public, at which hospital, tested), its own public model and training: the seeds are "
        "the replicates, so the intervals are **95 % Student-t intervals across seeds** (mean ± t · SD / √n; "
        "with few seeds they are wide: that is the point). *Headroom recovered* is computed within each seed "
        f"(paired over its test cases, from {floors[0] if floors else 'the first floor'} to the non-private "
        "model) and then summarised across seeds. All numbers are from a simulation (phantom patients; test "
        "labels known to the simulator). " + CLASS_LEGEND, "",
        summary_table(rows, floors), "",
    ]
    classes = class_table(rows)
    if classes:
        lines += ["Headroom recovered per class and region (mean over seeds ± 95 % t half-width):", "", classes, ""]
    lines += report_real.seeds_section(per_seed, t_interval, _format_interval)
    found = seed_verdicts(per_seed)
    if found:
        lines += ["## Verdicts paired by seed", "",
                  "Across seeds: a paired t-test on each seed's mean-Dice difference (\"beats\" only when the 95 % "
                  "interval excludes 0). Within each seed: the per-seed report's verdict, paired over its test "
                  "cases (two standard errors).", ""] + [f"- {v}" for v in found] + [""]
    class_rows = [(f"{r['method']}" + (f" ε={r['epsilon_budget']:g}" if r["epsilon_budget"] is not None else ""),
                   {k: None if r["class_intervals"].get(k) is None else
                    (r["class_intervals"][k][0], r["class_intervals"][k][1] or 0.0) for k in HEADROOM_KEYS})
                  for r in rows if r["method"] != (floors[0] if floors else None)
                  and not is_ceiling(r["method"])]
    plots = [plot_headroom_per_class(class_rows, root / "plot_headroom_per_class.png",
                                     error="mean over seeds ± 95 % t half-width",
                                     floor=floors[0] if floors else "floor"),
             plot_headroom_by_seed(rows, root / "plot_headroom_by_seed.png")]
    for plot in plots:
        if plot is not None:
            lines += [f"![{plot.stem}]({plot.relative_to(root)})", ""]
    lines += ["## Per-seed reports", ""] + [f"- [seed {s}](seed-{s}/report.md)" for s in per_seed] + [""]
    report = root / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report
