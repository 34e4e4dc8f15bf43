"""The reports' "Real scans" section: each model's Dice on labelled real cases beside its phantom Dice.

Reads the ``real_check`` record each cell's ``results.json`` carries when the run was given real cases
(``task.reporting.realcheck``). The cases of every ``--real-check`` folder are pooled; the section lists each case with
its folder and who drew its reference (``--real-check expert=DIR`` / ``algorithm=DIR``; not stated otherwise).
For one comparison (:func:`real_section`), per method x ε (x K):

* the mean Dice over the cases per region (WT, TC, ET) and the real mean of the three, each region's beside its
  difference to the public-only model **paired over the cases** with its standard error;
* the share of the real headroom (public-only -> non-private) recovered per region, paired over the cases,
  with the ratio estimator's standard error (the phantom report's estimator, ``sim.report.headroom_recovered``);
* every case's WT / TC / ET Dice;
* the rank agreement between phantom and real scans over the private models: Kendall's τ-b (Kendall 1945)
  between phantom mean Dice and the real mean of WT, TC and ET, over every private method x ε x K (the floors
  and the non-private ceiling are left out: they rank themselves), and every place the two rankings disagree
  (the best private method at a budget; a private method above a public floor on one and not on the other).

Across seeds (:func:`seeds_section`): the same means and headroom, each a mean over seeds with its 95 % Student-t
interval, the headroom seed by seed, τ seed by seed and its mean over seeds.

Standard errors need three cases (one or two real cases are anecdotes; the section says how many cases stand
behind every number). A headroom that is not above zero by two of its standard errors is flagged and no share of it
is given (a ratio over it has no bounded confidence interval; Fieller 1954).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from task.settings import methods as registry
from task.settings.methods import Role
from task.options import Reference
from task.reporting.realcheck import REGIONS, case_name, real_dice, real_per_case, real_region_mean

#: the phantom side of the rankings: the phantom report's *mean Dice* (over the three classes); the real side is
#: the mean of the real WT, TC and ET Dice (:func:`task.reporting.realcheck.real_region_mean`)
RANK_KEY = "mean"
#: standard errors across cases from this many cases on
MIN_CASES_FOR_SE = 3
NONE_GIVEN = ("Real scans: no labelled real cases were given, so every Dice in this report is on phantoms "
              "(`--real-check DIR` scores every model on real cases as well).")
REAL_MEAN = "real mean (WT, TC, ET)"


def checked(cells: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The cells scored on real cases (a check that failed is not a score)."""
    return [c for c in cells if (c.get("real_check") or {}).get("dice")]


def _folders(cells: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    folders: dict[str, dict] = {}
    for cell in cells:
        for entry in (cell.get("real_check") or {}).get("folders") or []:
            folders.setdefault(entry.get("folder"), entry)
    return folders


def describe_reference(reference: str | None) -> str:
    """Who drew a case's reference, in words."""
    if reference == Reference.EXPERT:
        return "expert"
    if reference == Reference.ALGORITHM:
        return "an algorithm's output"
    return "not stated"


def header_line(cells: Sequence[Mapping[str, Any]]) -> str:
    """The report header's one line: which real cases, from which folders, in which layout, whose references
    (or none given)."""
    folders = _folders([c for c in cells if c.get("real_check")])
    if not folders:
        return NONE_GIVEN
    parts = []
    for folder, entry in folders.items():
        cases = entry.get("cases") or []
        shown = ", ".join(cases[:5]) + (f" and {len(cases) - 5} more" if len(cases) > 5 else "")
        parts.append(f"{shown} ({entry.get('layout')} layout, reference {describe_reference(entry.get('reference'))}, "
                     f"in {folder})")
    total = sum(len(e.get("cases") or []) for e in folders.values())
    return (f"Real-scan check: {total} labelled real case(s), pooled: " + "; ".join(parts)
            + " (section *Real scans*).")


METHOD_NOTE = ("Every model is scored as `fedpate evaluate` scores a bundle: preprocessed as in training, segmented, "
               "mapped back to the case's own grid and compared with its label map there, in our classes. The "
               "references are the ones given: fedpate cannot tell a radiologist's segmentation from an "
               "algorithm's output (it reads no file beside the cases), so each case is shown with its folder and "
               "the reference its folder was given (`--real-check expert=DIR` or `--real-check algorithm=DIR`); "
               "against an algorithm's reference a Dice measures agreement with that algorithm.")


# ------------------------------------------------------------------------------------------ statistics
def _paired_rows(cells: Sequence[Mapping[str, Any] | None], key: str) -> np.ndarray | None:
    """(cases, len(cells)) Dice for ``key`` over the cases every cell scored with a value; None if not comparable."""
    per_case = [real_per_case(c, key) if c is not None else None for c in cells]
    if not all(per_case):
        return None
    shared = [k for k in per_case[0] if all(k in other and other[k] is not None for other in per_case)]
    if not shared:
        return None
    return np.asarray([[other[k] for other in per_case] for k in shared], dtype=np.float64)


def _se(values: np.ndarray) -> float | None:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) >= MIN_CASES_FOR_SE else None


def paired_over_cases(cell, other, key: str) -> tuple[float, float | None, int] | None:
    """(mean of Dice(cell) − Dice(other), its standard error or None, n) over the cases both scored for ``key``:
    the difference per case removes the between-case spread (a hard case is hard for every model)."""
    rows = _paired_rows((cell, other), key)
    if rows is None:
        return None
    d = rows[:, 0] - rows[:, 1]
    return float(d.mean()), _se(d), int(len(d))


def ratio_over_cases(cell, floor, ceiling, key: str) -> tuple[float, float | None, int] | None:
    """(R, standard error or None, n) of the headroom ``cell`` recovers on real scans for ``key``, paired over
    the cases all three scored: R = mean(d) / mean(h), d = Dice − floor and h = ceiling − floor per case, with
    the ratio estimator's (delta-method) standard error sqrt(var(d − R h) / n) / |mean(h)|. None when not
    comparable, when the headroom is not positive, or, from three cases on, when it is not above zero by two of
    its standard errors (the phantom report's rule, ``sim.report.headroom_is_measurable``: a ratio over a
    denominator indistinguishable from zero has no bounded confidence interval)."""
    rows = _paired_rows((cell, floor, ceiling), key)
    if rows is None:
        return None
    d, h = rows[:, 0] - rows[:, 1], rows[:, 2] - rows[:, 1]
    if h.mean() <= 0 or (len(h) >= MIN_CASES_FOR_SE and not h.mean() > 2 * _se(h)):
        return None
    ratio = float(d.mean() / h.mean())
    se = None
    if len(d) >= MIN_CASES_FOR_SE:
        se = float(np.std(d - ratio * h, ddof=1) / math.sqrt(len(d)) / abs(h.mean()))
    return ratio, se, int(len(d))


def kendall_tau(first: Sequence[float], second: Sequence[float]) -> dict | None:
    """Kendall's τ-b (Kendall 1945; ties in either ranking corrected) between two scorings of the same items, with
    its concordant, discordant and tied pair counts; None with fewer than two items or when either scoring ties
    every item (τ undefined)."""
    x, y = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if len(x) != len(y):
        raise ValueError(f"kendall_tau: {len(x)} against {len(y)} values")
    n = len(x)
    if n < 2:
        return None
    i, j = np.triu_indices(n, k=1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    concordant, discordant = int(np.sum(dx * dy > 0)), int(np.sum(dx * dy < 0))
    untied_x, untied_y = int(np.sum(dx != 0)), int(np.sum(dy != 0))
    if untied_x == 0 or untied_y == 0:
        return None
    tau = (concordant - discordant) / math.sqrt(untied_x * untied_y)
    return {"tau": float(tau), "n": n, "pairs": len(i), "concordant": concordant, "discordant": discordant,
            "tied": len(i) - concordant - discordant}


def _cases_of(cell) -> frozenset:
    return frozenset((row.get("folder"), row.get("case")) for row in (cell.get("real_check") or {}).get("cases") or [])


def phantom_region_mean(cell: Mapping[str, Any]) -> float | None:
    """The mean of a cell's phantom WT, TC and ET Dice: the phantom side scored with the real side's metric (None
    when a region is missing)."""
    dice = cell.get("dice") or {}
    values = [dice.get(region) for region in REGIONS]
    return None if any(v is None for v in values) else float(sum(values) / len(values))


def _phantom_score(cell: Mapping[str, Any], regions: bool) -> float | None:
    return phantom_region_mean(cell) if regions else (cell.get("dice") or {}).get(RANK_KEY)


def rank_agreement(cells: Sequence[Mapping[str, Any]], regions: bool = False) -> dict | None:
    """Kendall's τ-b between phantom mean Dice and the real mean of WT, TC and ET over every private model (each
    private method x ε x K; floors and ceiling left out), as :func:`kendall_tau` gives it, with ``models``
    (label, phantom, real) and ``left_out`` (models scored on other real cases than the most common set, whose
    means are not comparable). ``regions``: the phantom side is the mean of the phantom WT, TC and ET Dice (the
    real side's own metric) instead of the mean over the three classes. None when it is not defined."""
    private = [c for c in checked(cells) if registry.is_private(c.get("method"))
               and _phantom_score(c, regions) is not None and real_region_mean(c) is not None]
    if not private:
        return None
    common, _ = Counter(_cases_of(c) for c in private).most_common(1)[0]
    kept = sorted((c for c in private if _cases_of(c) == common), key=_sort_key)
    found = kendall_tau([_phantom_score(c, regions) for c in kept], [real_region_mean(c) for c in kept])
    if found is None:
        return None
    found["models"] = [(_label(c), _phantom_score(c, regions), real_region_mean(c)) for c in kept]
    found["left_out"] = len(private) - len(kept)
    return found


# ------------------------------------------------------------------------------------------ formatting
def _fmt(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(value) -> str:
    if value is None:
        return "—"
    return f"{value[0]:+.2f}" + (f" ± {value[1]:.2f}" if value[1] is not None else "")


def _difference(value) -> str:
    if value is None:
        return "—"
    return f"{value[0]:+.3f}" + (f" ± {value[1]:.3f}" if value[1] is not None else "")


def _reference(cells, role: Role, method: str | None = None):
    names = [method] if method else registry.names(role=role)
    for name in names:
        found = [c for c in cells if c.get("method") == name]
        if found:
            return found[0]
    return None


def _floor_and_ceiling(cells):
    return _reference(cells, Role.FLOOR, registry.names(role=Role.FLOOR)[0]), _reference(cells, Role.CEILING)


def _label(cell, budget: bool = True) -> str:
    epsilon = cell.get("epsilon_budget") if budget else None
    teachers = cell.get("teachers")
    return (f"{cell.get('method')}" + (f" ε={epsilon:g}" if epsilon is not None else "")
            + (f" K={teachers}" if teachers and cell.get("method") in registry.names(sweeps_k=True) else ""))


def _sort_key(cell):
    budget = cell.get("epsilon_budget")
    return (str(cell.get("method")), math.inf if budget is None else float(budget), int(cell.get("teachers") or 0))


def _budget(cell) -> str:
    return _fmt(cell.get("epsilon_budget"), 2) if cell.get("epsilon_budget") is not None else "—"


def case_list(cells: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Every real case any cell was scored on, once, in the order the folders were given: case, folder, layout,
    reference."""
    found: dict[tuple, dict] = {}
    for cell in cells:
        for row in (cell.get("real_check") or {}).get("cases") or []:
            key = (row.get("folder"), row.get("case"))
            if key not in found:
                reference = row.get("reference")
                if reference is None:   # a record written before cases carried it: its folder's, if stated
                    entry = _folders([cell]).get(row.get("folder")) or {}
                    reference = entry.get("reference")
                found[key] = {"case": row.get("case"), "folder": row.get("folder"), "layout": row.get("layout"),
                              "reference": reference}
    cases = list(found.values())
    for case in cases:   # a case id in two folders is shown with its folder's name
        case["name"] = case_name(case, cases)
    return cases


def _case_header(case: Mapping[str, Any]) -> str:
    return f"{case.get('name', case['case'])}{'†' if case.get('reference') == Reference.ALGORITHM else ''}"


def cases_table(cases: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| case | folder | layout | reference |", "|---|---|---|---|"]
    lines += [f"| {_case_header(c)} | {c['folder']} | {c['layout']} | {describe_reference(c.get('reference'))} |"
              for c in cases]
    return "\n".join(lines)


def headroom_line(floor, ceiling) -> str:
    """The real-scan headroom from the public-only model to the non-private one, per region, with the paired
    difference's standard error over the cases, and which regions' headroom is not above zero by two of them."""
    parts, unclear = [], []
    for key in REGIONS:
        low, high = real_dice(floor, key), real_dice(ceiling, key)
        paired = paired_over_cases(ceiling, floor, key)
        if low is None or high is None or paired is None:
            parts.append(f"{key} —")
            continue
        parts.append(f"{key} {low:.3f} → {high:.3f} ({_difference(paired)}, {paired[2]} cases)")
        if paired[1] is None or not paired[0] > 2 * paired[1]:
            unclear.append(key)
    line = (f"Headroom on real scans, {floor.get('method')} → {ceiling.get('method')} (mean over the cases; the "
            "difference paired over them ± SE): " + ", ".join(parts) + ".")
    if unclear:
        line += (f" In {', '.join(unclear)} the headroom is not above zero by two standard errors (or too few cases "
                 "give one): no share of it is given there from three cases on (—), and below three a share is "
                 "unstable.")
    return line


def _region_with_difference(cell, floor, key: str) -> str:
    value = real_dice(cell, key)
    if value is None:
        return "—"
    if floor is None or cell is floor:
        return _fmt(value)
    return f"{value:.3f} ({_difference(paired_over_cases(cell, floor, key))})"


def mean_table(cells, floor, ceiling, phantom_headroom: Callable[[Mapping[str, Any]], Any]) -> str:
    """One row per scored cell: phantom mean Dice and headroom; the real mean of WT, TC and ET; each region's mean
    over the cases with its difference to the floor paired over the cases (± SE); the real headroom per region
    (± SE); how many cases and how long the scoring took."""
    floor_name = floor.get("method") if floor is not None else "the floor"
    header = ["method", "ε budget", "K", "phantom mean Dice", "phantom headroom", REAL_MEAN,
              *(f"real {k} (− {floor_name} ± SE)" for k in REGIONS), "real headroom WT / TC / ET (± SE)", "cases",
              "scoring s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in sorted(cells, key=_sort_key):
        phantom = phantom_headroom(cell)
        found = cell.get("real_check") or {}
        ratios = " / ".join(_ratio(ratio_over_cases(cell, floor, ceiling, k)) if floor is not None
                            and ceiling is not None else "—" for k in REGIONS)
        row = [str(cell.get("method")), _budget(cell), str(cell.get("teachers") or "—"),
               _fmt((cell.get("dice") or {}).get(RANK_KEY)), "—" if phantom is None else f"{phantom[0]:+.2f}",
               _fmt(real_region_mean(cell)), *(_region_with_difference(cell, floor, k) for k in REGIONS), ratios,
               str(len(found.get("cases") or [])), _fmt(found.get("seconds"), 1)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _rows_of(cell, cases: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any] | None]:
    """The cell's scored row of each case (None where it has none), in the order of ``cases``."""
    rows = {(r.get("folder"), r.get("case")): r for r in (cell.get("real_check") or {}).get("cases") or []}
    return [rows.get((case["folder"], case["case"])) for case in cases]


def per_case_table(cells, cases: Sequence[Mapping[str, Any]]) -> str:
    """One row per scored cell, one column per case: that case's WT / TC / ET Dice."""
    header = ["method", "ε budget", "K", *(f"{_case_header(c)} WT / TC / ET" for c in cases)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in sorted(cells, key=_sort_key):
        shown = ["—" if row is None else " / ".join(_fmt(row.get(k)) for k in REGIONS)
                 for row in _rows_of(cell, cases)]
        lines.append("| " + " | ".join([str(cell.get("method")), _budget(cell), str(cell.get("teachers") or "—"),
                                         *shown]) + " |")
    return "\n".join(lines)


def volume_table(cells, cases: Sequence[Mapping[str, Any]]) -> str | None:
    """The reference's WT / TC / ET volume of each case (first row), then each scored cell's: whether a model
    under- or over-calls a region (Dice alone does not say). None when no cell recorded volumes (results written
    before they were)."""
    by_cell = [(cell, _rows_of(cell, cases)) for cell in sorted(cells, key=_sort_key)]
    if not any(row and row.get("volume_ml") for _, rows in by_cell for row in rows):
        return None

    def shown(row, which: int) -> str:
        volumes = (row or {}).get("volume_ml")
        return "—" if not volumes else " / ".join(f"{volumes[k][which]:.0f}" for k in REGIONS)

    reference = []
    for i in range(len(cases)):
        found = next((rows[i] for _, rows in by_cell if rows[i] and rows[i].get("volume_ml")), None)
        reference.append(shown(found, 0))
    header = ["method", "ε budget", "K", *(f"{_case_header(c)} WT / TC / ET ml" for c in cases)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
             "| **reference** | | | " + " | ".join(f"**{v}**" for v in reference) + " |"]
    for cell, rows in by_cell:
        lines.append("| " + " | ".join([str(cell.get("method")), _budget(cell), str(cell.get("teachers") or "—"),
                                         *(shown(row, 1) for row in rows)]) + " |")
    return "\n".join(lines)


def _ranks(values: Sequence[float]) -> list[float]:
    """Rank 1 = highest; ties share their mean rank."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    ranks = [0.0] * len(values)
    position = 0
    while position < len(order):
        end = position
        while end + 1 < len(order) and values[order[end + 1]] == values[order[position]]:
            end += 1
        for index in order[position:end + 1]:
            ranks[index] = (position + end) / 2 + 1
        position = end + 1
    return ranks


def tau_sentence(found: dict | None) -> str:
    """τ, stated with its value and what it is over."""
    if found is None:
        return ("Rank agreement: Kendall τ is not defined here (fewer than two private models scored on phantoms "
                "and real scans, or one of the two scorings ties them all).")
    left = (f" ({found['left_out']} private model(s) scored on other real cases left out)"
            if found.get("left_out") else "")
    return (f"Rank agreement between the phantom and the real ranking of the {found['n']} private models "
            f"(every private method × ε × K; the public floors and the non-private ceiling are left out, since they "
            f"rank themselves){left}: **Kendall τ = {found['tau']:+.2f}** (τ-b, phantom mean Dice against the real "
            f"mean of WT, TC and ET; {found['concordant']} of {found['pairs']} pairs ranked alike, "
            f"{found['discordant']} reversed, {found['tied']} tied; 1: the same ranking, 0: unrelated, −1: reversed).")


def rank_table(found: dict) -> str:
    labels, phantom, real = zip(*found["models"])
    phantom_rank, real_rank = _ranks(list(phantom)), _ranks(list(real))
    lines = [f"| private model | phantom mean Dice | phantom rank | {REAL_MEAN} | real rank |", "|---|---|---|---|---|"]
    for index in sorted(range(len(labels)), key=lambda i: phantom_rank[i]):
        lines.append(f"| {labels[index]} | {phantom[index]:.3f} | {phantom_rank[index]:g} | {real[index]:.3f} | "
                     f"{real_rank[index]:g} |")
    return "\n".join(lines)


def _best_private(cells) -> dict[float, list]:
    """Per budget, each private method's cells (every K)."""
    by_eps: dict[float, list] = {}
    for cell in cells:
        if registry.is_private(cell.get("method")) and cell.get("epsilon_budget") is not None:
            by_eps.setdefault(float(cell["epsilon_budget"]), []).append(cell)
    return by_eps


def _scores(cell) -> str:
    return (f"mean Dice {_fmt((cell.get('dice') or {}).get(RANK_KEY))} on phantoms, {_fmt(real_region_mean(cell))} "
            f"on real scans with " + ", ".join(f"{k} {_fmt(real_dice(cell, k))}" for k in REGIONS))


def disagreements(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every place the phantom ranking (mean Dice on the phantom test set) and the real-scan ranking (the real mean
    of WT, TC and ET) disagree: the best private method at a budget, and a private method against each public
    floor."""
    scored = checked(cells)
    lines = []
    floors = [c for c in (_reference(scored, Role.FLOOR, m) for m in registry.names(role=Role.FLOOR)) if c is not None]
    for eps, group in sorted(_best_private(scored).items()):
        group = [c for c in group if (c.get("dice") or {}).get(RANK_KEY) is not None
                 and real_region_mean(c) is not None]
        if not group:
            continue
        on_phantoms = max(group, key=lambda c: c["dice"][RANK_KEY])
        on_real = max(group, key=real_region_mean)
        if on_phantoms is not on_real:
            lines.append(f"At ε = {eps:g} the best private method on phantoms is {_label(on_phantoms, False)} "
                         f"({_scores(on_phantoms)}); on real scans it is {_label(on_real, False)} ({_scores(on_real)}).")
        for cell in group:
            for floor in floors:
                if (floor.get("dice") or {}).get(RANK_KEY) is None or real_region_mean(floor) is None:
                    continue
                above_phantom = cell["dice"][RANK_KEY] > floor["dice"][RANK_KEY]
                above_real = real_region_mean(cell) > real_region_mean(floor)
                if above_phantom != above_real:
                    lines.append(f"{_label(cell)} is {'above' if above_phantom else 'below'} {floor['method']} on "
                                 f"phantoms but {'above' if above_real else 'below'} it on real scans ({_scores(cell)}; "
                                 f"{floor['method']}: {_scores(floor)}).")
    return lines


def real_section(cells: Sequence[Mapping[str, Any]],
                 phantom_headroom: Callable[[Mapping[str, Any]], Any] = lambda cell: None) -> list[str]:
    """The "Real scans" section of one comparison's report (markdown lines); none without real cases.

    ``phantom_headroom(cell)``: the cell's headroom recovered on the phantom test set (``(ratio, ...)`` or
    None), shown beside the real-scan one."""
    scored = checked(cells)
    failed = [c for c in cells if (c.get("real_check") or {}).get("error")]
    if not scored and not failed:
        return []   # the header says so (header_line)
    lines = ["## Real scans", "", METHOD_NOTE, ""]
    if failed:
        lines += [f"Scoring failed for {len(failed)} model(s): " + "; ".join(
            f"{c.get('_cell', c.get('method'))}: {c['real_check']['error']}" for c in failed) + ".", ""]
    if not scored:
        return lines
    cases = case_list(scored)
    algorithm = [c for c in cases if c.get("reference") == Reference.ALGORITHM]
    lines += [f"The {len(cases)} real case(s), pooled (every mean below is over all of them"
              + (f"; † marks the {len(algorithm)} whose reference is an algorithm's output" if algorithm else "")
              + "):", "", cases_table(cases), ""]
    floor, ceiling = _floor_and_ceiling(scored)
    if floor is not None and ceiling is not None:
        lines += [headroom_line(floor, ceiling), ""]
    else:
        lines += ["Headroom on real scans: needs both public-only and non-private cells scored on the real cases.", ""]
    lines += [f"*{REAL_MEAN}* averages each region's mean over the cases. *real WT* (likewise TC, ET) is the mean "
              "Dice over the cases, beside its difference to "
              f"{floor.get('method') if floor is not None else 'the public-only model'} paired over the cases "
              f"(± SE across cases, from {MIN_CASES_FOR_SE} cases on). *Real headroom* = (Dice − public-only) / "
              "(non-private − public-only) per region, paired over the cases, ± the ratio estimator's SE; *phantom "
              "headroom* is the report's own, on the phantom test set.", "",
              mean_table(scored, floor, ceiling, phantom_headroom), ""]
    found = rank_agreement(scored)
    lines += [tau_sentence(found), ""]
    matched = rank_agreement(scored, regions=True)
    if matched is not None:
        lines += [f"With the phantom side scored by the real side's metric (the mean of the phantom WT, TC and ET "
                  f"Dice, not of the three classes): **Kendall τ = {matched['tau']:+.2f}** "
                  f"({matched['concordant']} of {matched['pairs']} pairs ranked alike).", ""]
    if found is not None:
        lines += [rank_table(found), ""]
    lines += ["Dice per case (WT / TC / ET):", "", per_case_table(scored, cases), ""]
    volumes = volume_table(scored, cases)
    if volumes is not None:
        lines += ["Volume per case (ml, the reference's first): a model that labels less of a region than the "
                  "reference holds under-calls it, more over-calls it (Dice alone does not say which).", "", volumes,
                  ""]
    disagreeing = disagreements(scored)
    if disagreeing:
        lines += ["Where the phantom and real-scan rankings disagree:", ""] + [f"- {line}" for line in disagreeing] + [""]
    elif not _best_private(scored):
        lines += ["No private method was scored on the real cases: no ranking to compare.", ""]
    else:
        lines += ["The phantom and real-scan rankings agree on the best private method at each budget and on each "
                  "private method against each public floor (τ above counts every pair of private models).", ""]
    return lines


# ------------------------------------------------------------------------------------------ across seeds
def seeds_section(per_seed: Mapping[int, Sequence[Mapping[str, Any]]], interval: Callable, fmt_interval: Callable
                  ) -> list[str]:
    """The multi-seed report's "Real scans" section: per method x ε x K, the real-scan Dice per region and the
    real headroom per region, each a mean over seeds with its interval (``interval``: values -> (mean,
    half-width, n); ``fmt_interval`` formats it); the real headroom seed by seed; Kendall's τ seed by seed and its
    mean over seeds; then each seed's disagreements."""
    scored_by_seed = {seed: checked(cells) for seed, cells in per_seed.items()}
    if not any(scored_by_seed.values()):
        return []   # the header says so (header_line)
    lines = ["## Real scans", "", METHOD_NOTE, ""]
    cases = case_list([c for cells in scored_by_seed.values() for c in cells])
    lines += [f"The {len(cases)} real case(s), pooled:", "", cases_table(cases), ""]
    groups: dict[tuple, dict[int, Mapping[str, Any]]] = {}
    for seed, cells in scored_by_seed.items():
        for cell in cells:
            groups.setdefault(_sort_key(cell), {})[seed] = cell
    seeds = sorted(scored_by_seed)
    header = ["method", "ε budget", "K", "seeds", "phantom mean Dice", REAL_MEAN, "real WT", "real TC", "real ET",
              "real headroom WT", "real headroom TC", "real headroom ET"]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    per_seed_header = ["method", "ε budget", "K", *(f"seed {s}: WT / TC / ET" for s in seeds)]
    per_seed_table = ["| " + " | ".join(per_seed_header) + " |", "|" + "---|" * len(per_seed_header)]
    for key in sorted(groups):
        by_seed = groups[key]
        headroom: dict[str, dict[int, float | None]] = {k: {} for k in REGIONS}
        for seed, cell in by_seed.items():
            floor, ceiling = _floor_and_ceiling(scored_by_seed[seed])
            for k in REGIONS:
                found = ratio_over_cases(cell, floor, ceiling, k) if floor and ceiling else None
                headroom[k][seed] = None if found is None else found[0]
        budget = None if key[1] == math.inf else key[1]
        label = [key[0], "—" if budget is None else f"{budget:g}", str(key[2] or "—")]
        table.append("| " + " | ".join([
            *label, ",".join(map(str, sorted(by_seed))),
            fmt_interval(interval([(c.get("dice") or {}).get(RANK_KEY) for c in by_seed.values()])),
            fmt_interval(interval([real_region_mean(c) for c in by_seed.values()])),
            *(fmt_interval(interval([real_dice(c, k) for c in by_seed.values()])) for k in REGIONS),
            *(fmt_interval(interval(list(headroom[k].values())), signed=True) for k in REGIONS)]) + " |")
        per_seed_table.append("| " + " | ".join([
            *label, *("—" if s not in by_seed else " / ".join(_fmt_share(headroom[k][s]) for k in REGIONS)
                      for s in seeds)]) + " |")
    lines += ["Mean over seeds ± 95 % t half-width; each seed's real headroom runs from its own public-only model to "
              "its own non-private one, paired over the cases.", "", "\n".join(table), "",
              "Real headroom recovered, seed by seed (WT / TC / ET):", "", "\n".join(per_seed_table), ""]
    taus = {seed: rank_agreement(cells) for seed, cells in scored_by_seed.items()}
    matched = {seed: rank_agreement(cells, regions=True) for seed, cells in scored_by_seed.items()}
    rows = ["| seed | private models | Kendall τ | pairs ranked alike / reversed / tied "
            "| τ, phantom WT/TC/ET mean |", "|---|---|---|---|---|"]
    for seed, found in taus.items():
        other = "—" if matched.get(seed) is None else f"{matched[seed]['tau']:+.2f}"
        if found is None:
            rows.append(f"| {seed} | — | — | — | {other} |")
        else:
            rows.append(f"| {seed} | {found['n']} | {found['tau']:+.2f} | {found['concordant']} / "
                        f"{found['discordant']} / {found['tied']} | {other} |")
    summary = interval([found["tau"] for found in taus.values() if found is not None])
    lines += ["Rank agreement between the phantom and the real ranking of the private models (Kendall τ-b between "
              "phantom mean Dice and the real mean of WT, TC and ET, over every private method × ε × K of the seed; "
              "floors and ceiling left out), seed by seed: mean τ over seeds "
              + (f"**{fmt_interval(summary, digits=2, signed=True)}** over {summary[2]} seed(s)." if summary
                 else "not defined (no seed has two ranked private models)."), "", "\n".join(rows), ""]
    found = [f"seed {seed}: {line}" for seed, cells in scored_by_seed.items() for line in disagreements(cells)]
    if found:
        lines += ["Where the phantom and real-scan rankings disagree, seed by seed:", ""] + [f"- {x}" for x in found] + [""]
    else:
        lines += ["At every seed the phantom and real-scan rankings agree on the best private method at each budget "
                  "and on each private method against each public floor (τ above counts every pair).", ""]
    return lines


def _fmt_share(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}"
