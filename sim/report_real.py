"""The reports' "Real scans" section: each model's Dice on labelled real cases beside its phantom Dice.

Reads the ``real_check`` record each cell's ``results.json`` carries when the run was given real cases
(``task.realcheck``). For one comparison (:func:`real_section`): which cases were scored; the headroom on
real scans, from the public-only model to the non-private one, per region (WT, TC, ET); the share of it
each method x ε recovers there; and every place where the phantom ranking and the real-scan ranking
disagree (the best private method at a budget; a private method above a public floor on phantoms and not
on real scans, or the reverse). Across seeds (:func:`seeds_section`): the same, each number a mean over
seeds with its 95 % Student-t interval, and the disagreements seed by seed.

Headroom recovered on real scans is the ratio of means over the real cases whose reference contains the
region, R = mean(Dice - floor) / mean(ceiling - floor), as on the phantom test set
(``sim.report.headroom_recovered``); with fewer than three cases no standard error is given (one real case
is an anecdote, and the section says how many cases stand behind every number).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from task import methods as registry
from task.methods import Role
from task.realcheck import REGIONS, real_dice, real_per_case

#: the key both rankings use: the mean over the three classes, as the phantom report's *mean Dice*
RANK_KEY = "mean"
NONE_GIVEN = ("Real scans: no labelled real cases were given, so every Dice in this report is on phantoms "
              "(`--real-check DIR` scores every model on real cases as well).")


def checked(cells: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The cells scored on real cases (a check that failed is not a score)."""
    return [c for c in cells if (c.get("real_check") or {}).get("dice")]


def _folders(cells: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    folders: dict[str, dict] = {}
    for cell in cells:
        for entry in (cell.get("real_check") or {}).get("folders") or []:
            folders.setdefault(entry.get("folder"), entry)
    return folders


def header_line(cells: Sequence[Mapping[str, Any]]) -> str:
    """The report header's one line: which real cases, from which folders, in which layout (or none given)."""
    folders = _folders([c for c in cells if c.get("real_check")])
    if not folders:
        return NONE_GIVEN
    parts = []
    for folder, entry in folders.items():
        cases = entry.get("cases") or []
        shown = ", ".join(cases[:5]) + (f" and {len(cases) - 5} more" if len(cases) > 5 else "")
        parts.append(f"{shown} ({entry.get('layout')} layout, in {folder})")
    total = sum(len(e.get("cases") or []) for e in folders.values())
    return f"Real-scan check: {total} labelled real case(s): " + "; ".join(parts) + " (section *Real scans*)."


METHOD_NOTE = ("Every model is scored as `fedpate evaluate` scores a bundle: preprocessed as in training, segmented, "
               "mapped back to the case's own grid and compared with its label map there, in our classes. The "
               "references are the ones given: fedpate cannot tell a radiologist's segmentation from an "
               "algorithm's output (it reads no file beside the cases), so where a reference is an algorithm's, "
               "these scores measure agreement with that algorithm; say so beside this report.")


def ratio_over_cases(cell, floor, ceiling, key: str) -> tuple[float, float | None, int] | None:
    """(R, standard error or None, n) of the headroom ``cell`` recovers on real scans for ``key``, paired over
    the cases all three scored; None when not comparable or the headroom is not positive."""
    mine, low, high = (real_per_case(c, key) if c is not None else None for c in (cell, floor, ceiling))
    if not mine or not low or not high:
        return None
    rows = [(mine[k], low[k], high[k]) for k in mine if k in low and k in high
            and None not in (mine[k], low.get(k), high.get(k))]
    if not rows:
        return None
    values = np.asarray(rows, dtype=np.float64)
    d, h = values[:, 0] - values[:, 1], values[:, 2] - values[:, 1]
    if h.mean() <= 0:
        return None
    ratio = float(d.mean() / h.mean())
    se = None
    if len(d) >= 3:
        se = float(np.std(d - ratio * h, ddof=1) / math.sqrt(len(d)) / abs(h.mean()))
    return ratio, se, int(len(d))


def _fmt(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(value) -> str:
    if value is None:
        return "—"
    return f"{value[0]:+.2f}" + (f" ± {value[1]:.2f}" if value[1] is not None else "")


def _reference(cells, role: Role, method: str | None = None):
    names = [method] if method else registry.names(role=role)
    for name in names:
        found = [c for c in cells if c.get("method") == name]
        if found:
            return found[0]
    return None


def _label(cell, budget: bool = True) -> str:
    epsilon = cell.get("epsilon_budget") if budget else None
    teachers = cell.get("teachers")
    return (f"{cell.get('method')}" + (f" ε={epsilon:g}" if epsilon is not None else "")
            + (f" K={teachers}" if teachers and cell.get("method") in registry.names(sweeps_k=True) else ""))


def _sort_key(cell):
    budget = cell.get("epsilon_budget")
    return (str(cell.get("method")), math.inf if budget is None else float(budget), int(cell.get("teachers") or 0))


def headroom_line(floor, ceiling) -> str:
    """The real-scan headroom from the public-only model to the non-private one, per region."""
    parts = []
    for key in REGIONS:
        low, high = real_dice(floor, key), real_dice(ceiling, key)
        if low is None or high is None:
            parts.append(f"{key} —")
        else:
            parts.append(f"{key} {low:.3f} → {high:.3f} ({high - low:+.3f})")
    return (f"Headroom on real scans, {floor.get('method')} → {ceiling.get('method')}: " + ", ".join(parts) + ".")


def real_table(cells, floor, ceiling, phantom_headroom: Callable[[Mapping[str, Any]], Any]) -> str:
    """One row per scored cell: phantom mean Dice and headroom beside real WT / TC / ET Dice and headroom."""
    header = ["method", "ε budget", "K", "phantom mean Dice", "phantom headroom", "real mean Dice",
              "real WT / TC / ET", "real headroom WT / TC / ET", "cases", "scoring s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in sorted(cells, key=_sort_key):
        phantom = phantom_headroom(cell)
        found = cell.get("real_check") or {}
        ratios = " / ".join(_ratio(ratio_over_cases(cell, floor, ceiling, k)) if floor is not None
                            and ceiling is not None else "—" for k in REGIONS)
        row = [str(cell.get("method")), _fmt(cell.get("epsilon_budget"), 2) if cell.get("epsilon_budget") is not None
               else "—", str(cell.get("teachers") or "—"), _fmt((cell.get("dice") or {}).get("mean")),
               "—" if phantom is None else f"{phantom[0]:+.2f}", _fmt(real_dice(cell, RANK_KEY)),
               " / ".join(_fmt(real_dice(cell, k)) for k in REGIONS), ratios,
               str(len(found.get("cases") or [])), _fmt(found.get("seconds"), 1)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _best_private(cells) -> dict[float, list]:
    """Per budget, each private method's cells (every K)."""
    by_eps: dict[float, list] = {}
    for cell in cells:
        if registry.is_private(cell.get("method")) and cell.get("epsilon_budget") is not None:
            by_eps.setdefault(float(cell["epsilon_budget"]), []).append(cell)
    return by_eps


def _scores(cell) -> str:
    return (f"mean Dice {_fmt((cell.get('dice') or {}).get(RANK_KEY))} on phantoms, {_fmt(real_dice(cell, RANK_KEY))} "
            f"on real scans with " + ", ".join(f"{k} {_fmt(real_dice(cell, k))}" for k in REGIONS))


def disagreements(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every place the phantom ranking (mean Dice on the phantom test set) and the real-scan ranking (mean
    Dice on the real cases) disagree: the best private method at a budget, and a private method against
    each public floor."""
    scored = checked(cells)
    lines = []
    floors = [c for c in (_reference(scored, Role.FLOOR, m) for m in registry.names(role=Role.FLOOR)) if c is not None]
    for eps, group in sorted(_best_private(scored).items()):
        group = [c for c in group if (c.get("dice") or {}).get(RANK_KEY) is not None
                 and real_dice(c, RANK_KEY) is not None]
        if not group:
            continue
        on_phantoms = max(group, key=lambda c: c["dice"][RANK_KEY])
        on_real = max(group, key=lambda c: real_dice(c, RANK_KEY))
        if on_phantoms is not on_real:
            lines.append(f"At ε = {eps:g} the best private method on phantoms is {_label(on_phantoms, False)} "
                         f"({_scores(on_phantoms)}); on real scans it is {_label(on_real, False)} ({_scores(on_real)}).")
        for cell in group:
            for floor in floors:
                if (floor.get("dice") or {}).get(RANK_KEY) is None or real_dice(floor, RANK_KEY) is None:
                    continue
                above_phantom = cell["dice"][RANK_KEY] > floor["dice"][RANK_KEY]
                above_real = real_dice(cell, RANK_KEY) > real_dice(floor, RANK_KEY)
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
    floor, ceiling = _reference(scored, Role.FLOOR, registry.names(role=Role.FLOOR)[0]), _reference(scored, Role.CEILING)
    if floor is not None and ceiling is not None:
        lines += [headroom_line(floor, ceiling), ""]
    else:
        lines += ["Headroom on real scans: needs both public-only and non-private cells scored on the real cases.", ""]
    lines += ["*Real headroom* = (Dice − public-only) / (non-private − public-only) per region, over the real cases "
              "whose reference contains it (± SE from three cases on); *phantom headroom* is the report's own, on "
              "the phantom test set. Rankings below compare mean Dice over the three classes on each.", "",
              real_table(scored, floor, ceiling, phantom_headroom), ""]
    found = disagreements(scored)
    if found:
        lines += ["Where the phantom and real-scan rankings disagree:", ""] + [f"- {line}" for line in found] + [""]
    elif not _best_private(scored):
        lines += ["No private method was scored on the real cases: no ranking to compare.", ""]
    else:
        lines += ["The phantom and real-scan rankings agree (best private method at each budget, and each private "
                  "method against each public floor).", ""]
    return lines


# ------------------------------------------------------------------------------------------ across seeds
def seeds_section(per_seed: Mapping[int, Sequence[Mapping[str, Any]]], interval: Callable, fmt_interval: Callable
                  ) -> list[str]:
    """The multi-seed report's "Real scans" section: per method x ε x K, the real-scan Dice per region and the
    real headroom per region, each a mean over seeds with its interval (``interval``: values -> (mean,
    half-width, n); ``fmt_interval`` formats it); then each seed's disagreements."""
    scored_by_seed = {seed: checked(cells) for seed, cells in per_seed.items()}
    if not any(scored_by_seed.values()):
        return []   # the header says so (header_line)
    lines = ["## Real scans", "", METHOD_NOTE, ""]
    groups: dict[tuple, dict[int, Mapping[str, Any]]] = {}
    for seed, cells in scored_by_seed.items():
        for cell in cells:
            groups.setdefault(_sort_key(cell), {})[seed] = cell
    header = ["method", "ε budget", "K", "seeds", "phantom mean Dice", "real mean Dice", "real WT", "real TC", "real ET",
              "real headroom WT", "real headroom TC", "real headroom ET"]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in sorted(groups):
        by_seed = groups[key]
        headroom = {k: [] for k in REGIONS}
        for seed, cell in by_seed.items():
            cells = scored_by_seed[seed]
            floor = _reference(cells, Role.FLOOR, registry.names(role=Role.FLOOR)[0])
            ceiling = _reference(cells, Role.CEILING)
            for k in REGIONS:
                found = ratio_over_cases(cell, floor, ceiling, k) if floor and ceiling else None
                headroom[k].append(None if found is None else found[0])
        budget = None if key[1] == math.inf else key[1]
        row = [key[0], "—" if budget is None else f"{budget:g}", str(key[2] or "—"),
               ",".join(map(str, sorted(by_seed))),
               fmt_interval(interval([(c.get("dice") or {}).get(RANK_KEY) for c in by_seed.values()])),
               fmt_interval(interval([real_dice(c, RANK_KEY) for c in by_seed.values()])),
               *(fmt_interval(interval([real_dice(c, k) for c in by_seed.values()])) for k in REGIONS),
               *(fmt_interval(interval(headroom[k]), signed=True) for k in REGIONS)]
        table.append("| " + " | ".join(row) + " |")
    lines += ["Mean over seeds ± 95 % t half-width; each seed's real headroom runs from its own public-only model to "
              "its own non-private one.", "", "\n".join(table), ""]
    found = [f"seed {seed}: {line}" for seed, cells in scored_by_seed.items() for line in disagreements(cells)]
    if found:
        lines += ["Where the phantom and real-scan rankings disagree, seed by seed:", ""] + [f"- {x}" for x in found] + [""]
    else:
        lines += ["The phantom and real-scan rankings agree at every seed.", ""]
    return lines
