"""The tables of docs/RESULTS.md, written from stored comparisons (their ``results.json``), so that the numbers
there cannot drift from the runs.

    .venv/bin/python benchmarks/results_tables.py [--write FILE] [GROUP:]LABEL=FOLDER [...]
    e.g. benchmarks/results_tables.py "demo:seed 1=runs/demo-s1" "demo:seed 2=runs/demo-s2" \\
             "secure-dp:seed 0=runs/ddp-s0"

Each FOLDER is one comparison (``fedpate compare`` or ``fedpate demo``; one seed). Comparisons of one GROUP
(``main`` when the label names none) were run with the same methods and are summarised together; two groups may
hold the same seed (different runs of it). The tables, by name:

* ``GROUP:cells`` -- per comparison, one row per cell: phantom mean Dice, headroom recovered on the phantom test
  set (paired over its cases, ± SE: the report's estimator), the same over ``public-selftrain`` and, where the
  comparison scored real cases (``--real-check``), the real WT / TC / ET Dice (means over the cases), their mean,
  and the share of the real headroom (public-only -> non-private) recovered in each, paired over the cases (± SE,
  ``sim.report_real.ratio_over_cases``);
* ``GROUP:across`` -- per cell, over the group's comparisons: mean phantom Dice, mean headroom ± its standard error
  across the comparisons (each comparison's value beside it), mean real Dice and real headroom, and the number of
  comparisons whose real WT, TC and ET headroom all reach three quarters;
* ``GROUP:real-cases`` -- per comparison scored on real cases, one row per cell and one column per case: that
  case's real WT / TC / ET Dice (cases whose reference is an algorithm's output marked †);
* ``GROUP:rank`` -- per comparison, Kendall's τ between the phantom and the real ranking of the private models
  (``sim.report_real.rank_agreement``), and its mean ± standard error across the group's comparisons;
* ``GROUP:cost`` -- every cell's wall seconds (``wall_seconds`` of its results) per comparison;
* ``secure-vs-trusted`` -- every comparison holding a secure method and its trusted counterpart
  (``pate-anchored-secure`` / ``pate-anchored``, ``dp-fedavg-secure`` / ``dp-sgd-central``): both mean Dice, the
  paired difference over the test cases (± SE), both headrooms and their ratio;
* ``secure-sums`` -- per secure cell: the secure sums it ran and the bytes each hospital sent and received per sum;
* ``goals`` -- the product's goals read off the same numbers, met or not, per comparison;
* ``goal-list`` -- the goals themselves, in words, from the thresholds below (no run needed);
* ``settings`` -- each registered preset's world and recipe as ``task.settings.presets`` holds them: hospitals, teachers
  per hospital, K, the grid, the public query scans, the student's epochs, DP-SGD's clip and fixed σ (no run
  needed: the prose names K or a grid by pointing here, so a changed preset changes the documents' table);
* ``command`` -- the command that wrote them (folders below their common parent, shown as ``RUNS``).

Every table read from runs ends in a stamp naming what it was written from: how many ``results.json`` of how many
comparisons, the commit(s) they record (``commit``, written by ``task.reporting.results.write_run``; "not recorded" for runs
older than that field) and a digest of those files: the first 12 hex digits of the sha256 of their sha256 digests,
sorted, one per line. With the runs at hand, the same digest is

    find FOLDER... -name results.json -not -path '*/_shared/*' -exec sha256sum {} + | cut -c1-64 | sort \
        | sha256sum | cut -c1-12

(the group's folders for a ``GROUP:`` table, every folder for the others), so a number can be traced to its runs.

Without comparisons, ``--write FILE`` rewrites only the blocks of the tables that need no run (``settings``,
``goal-list``) and leaves every other block as it is, stamp and all:

    .venv/bin/python benchmarks/results_tables.py --write docs/GUIDE.md

Without ``--write`` every table is printed as markdown. With ``--write FILE`` each block of FILE between
``<!-- results_tables:NAME begin -->`` and ``<!-- results_tables:NAME end -->`` is replaced by the table NAME, the
text outside the blocks is left as it is, and FILE is replaced atomically (a temporary file, then ``os.replace``).
A block whose table these comparisons do not give is refused (name its group's comparisons, or remove the block):
a table is never left stale beside a command that claims to have written it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from task.settings import methods as registry
from task.options import Trainable
from task.settings.presets import PRESETS
from sim.report import (ceiling_of, floors_of, format_ratio, headroom_of, load_cells, paired_difference,
                        per_case_of, reference_cell)
from sim.report_real import case_list, per_case_table, rank_agreement, ratio_over_cases
from task.reporting.realcheck import real_region_mean

REPO = Path(__file__).resolve().parents[1]
REGIONS = ("WT", "TC", "ET")
DEFAULT_GROUP = "main"
#: (secure method, its trusted counterpart, the goal's kind): PATE's secure sum against trusted PATE (mean Dice
#: within 0.02), distributed DP gradient descent against pooled DP-SGD (at least 90 % of its headroom)
SECURE_PAIRS = (("pate-anchored-secure", "pate-anchored", "dice"),
                ("dp-fedavg-secure", "dp-sgd-central", "headroom"),
                ("dp-fedavg-secure", "dp-fedavg", "above"))
#: the goals' thresholds (docs/RESULTS.md, "Goals")
PHANTOM_GOALS = ((8.0, 0.5), (1.0, 0.2))
#: the best private model's real-scan goal: at least this share of the real headroom in every region
REAL_GOAL = 0.75
REAL_GOAL_REGIONS = ("WT", "TC", "ET")
#: PATE's own real-scan goal: at least this share of the real WT and TC headroom, and above the self-trained floor
REAL_PATE_GOAL = 0.6
#: the real ceiling (non-private, trained on phantoms) and the public floor's real WT, per region
CEILING = "nonprivate-central"
REAL_CEILING_GOAL = {"WT": 0.85, "TC": 0.70, "ET": 0.60}
PUBLIC_ONLY = "public-only"
REAL_FLOOR_GOAL = {"WT": 0.70}
#: the phantom ranking of the private models predicts the real one: Kendall's τ at least this
RANK_GOAL = 0.7
PATE = "pate-anchored"
SELFTRAIN = "public-selftrain"
SECURE_DICE_TOLERANCE = 0.02
SECURE_HEADROOM_SHARE = 0.9
#: hex digits of the runs' digest shown in a table's stamp
DIGEST_CHARS = 12
#: hex digits of a commit shown in a table's stamp (git's own short names are 7 to 12)
COMMIT_CHARS = 12
MARKER = re.compile(r"(<!-- results_tables:(?P<name>[\w:.-]+) begin -->\n)(?P<body>.*?)"
                    r"(<!-- results_tables:(?P=name) end -->)", re.DOTALL)


@dataclass
class Comparison:
    """One comparison folder: its group, label, cells (the shared models' folders left out) and settings."""
    group: str
    label: str
    folder: Path
    cells: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    #: the sha256 of every cell's results.json as read, by cell folder
    file_digests: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.label if self.group == DEFAULT_GROUP else f"{self.group}: {self.label}"

    def cell(self, method: str, budget: float | None = None):
        found = [c for c in self.cells if c.get("method") == method
                 and (budget is None or (c.get("epsilon_budget") or 0) == budget)]
        return found[0] if found else None

    @property
    def floor(self):
        floors = floors_of(self.cells)
        return reference_cell(self.cells, floors[0]) if floors else None

    @property
    def ceiling(self):
        return reference_cell(self.cells, ceiling_of(self.cells))

    def headroom(self, cell):
        floor, ceiling = self.floor, self.ceiling
        return headroom_of(cell, floor, ceiling) if floor and ceiling and cell else None

    def real_share(self, cell, region: str) -> tuple[float, float | None, int] | None:
        """(share, its standard error or None, cases) of the real headroom ``cell`` recovers in ``region``, paired
        over the real cases (the report's estimator, ``sim.report_real.ratio_over_cases``)."""
        floor, ceiling = self.floor, self.ceiling
        if not (floor and ceiling and cell):
            return None
        return ratio_over_cases(cell, floor, ceiling, region)

    def real_headroom(self, cell, region: str) -> float | None:
        found = self.real_share(cell, region)
        return None if found is None else found[0]


def parse_item(item: str) -> tuple[str, str, Path]:
    """``[GROUP:]LABEL=FOLDER`` -> (group, label, folder); one-line error naming the argument otherwise."""
    head, equals, folder = item.rpartition("=")
    if not equals or not folder:
        raise SystemExit(f"results_tables: expected [GROUP:]LABEL=FOLDER, got {item!r}")
    group, colon, label = head.partition(":")
    if not colon:
        group, label = DEFAULT_GROUP, head
    if not group or not label:
        raise SystemExit(f"results_tables: empty group or label in {item!r}")
    return group, label, Path(folder)


def load_comparison(group: str, label: str, folder: Path) -> Comparison:
    if not (folder / "compare.json").is_file():
        raise SystemExit(f"results_tables: {folder} is not a comparison folder (no compare.json)")
    cells = [c for c in load_cells(folder) if "_shared" not in Path(c["_cell"]).parts]
    if not cells:
        raise SystemExit(f"results_tables: {folder} holds no results.json")
    digests = {cell["_cell"]: hashlib.sha256((folder / cell["_cell"] / "results.json").read_bytes()).hexdigest()
               for cell in cells}
    return Comparison(group, label, folder, cells, json.loads((folder / "compare.json").read_text()), digests)


def runs_digest(comparisons: list["Comparison"]) -> str:
    """The first :data:`DIGEST_CHARS` hex digits of the sha256 of the comparisons' results.json digests, sorted, one
    per line (``sha256sum`` of the files, sorted, through ``sha256sum`` again: the module docstring's command)."""
    lines = "".join(f"{digest}\n" for digest in sorted(d for c in comparisons for d in c.file_digests.values()))
    return hashlib.sha256(lines.encode("ascii")).hexdigest()[:DIGEST_CHARS]


def _commit_name(cell) -> str:
    commit = cell.get("commit")
    if not commit:
        return "not recorded"
    head, dirty, _ = str(commit).partition("-dirty")
    return head[:COMMIT_CHARS] + ("-dirty" if dirty else "")


def stamp(comparisons: list["Comparison"]) -> str:
    """The line under a table: what it was written from (its runs' count, their commits and digest)."""
    files = sum(len(c.file_digests) for c in comparisons)
    commits = Counter(_commit_name(cell) for c in comparisons for cell in c.cells)
    named = (", ".join(f"{name} ({count})" for name, count in sorted(commits.items())) if len(commits) > 1
             else next(iter(commits), "none"))
    return (f"*Written from {files} results.json of {len(comparisons)} comparison(s); commit "
            f"{named}; runs digest {runs_digest(comparisons)}.*")


def _label(cell) -> str:
    budget = cell.get("epsilon_budget")
    return cell["method"] + (f" ε {budget:g}" if budget else "")


def _order(cell):
    return (cell["method"] != "public-only", cell.get("epsilon_budget") or 0, cell["method"])


def _real(cell) -> dict:
    return ((cell.get("real_check") or {}).get("dice")) or {}


def _fmt(value, digits: int = 3, sign: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _se(values) -> float | None:
    """Standard error of the mean across comparisons (None below two)."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def _describe(comparison: Comparison) -> str:
    settings = comparison.settings
    real = settings.get("real_check") or []
    parts = [f"seed {settings.get('seed')}", f"preset {settings.get('preset')}",
             "ε " + ", ".join(f"{e:g}" for e in settings.get("epsilons") or []),
             f"{len(comparison.cells[0].get('dice_per_case') or [])} phantom test cases"]
    cases = {case.get("case") for cell in comparison.cells for case in ((cell.get("real_check") or {}).get("cases")
                                                                           or [])}
    if real:
        parts.append(f"real check on {len(cases)} case(s)")
    return "; ".join(parts)


def cells_table(comparison: Comparison) -> str:
    """One comparison's markdown table, one row per cell."""
    selftrain = reference_cell(comparison.cells, "public-selftrain")
    ceiling = comparison.ceiling
    lines = ["| cell | phantom mean Dice | phantom headroom (± SE) | over public-selftrain (± SE) | real WT / TC / ET "
             "| real mean (WT, TC, ET) | real headroom WT / TC / ET (± SE over the cases) |",
             "|---|---|---|---|---|---|---|"]
    for cell in sorted(comparison.cells, key=_order):
        over = (headroom_of(cell, selftrain, ceiling) if selftrain and ceiling and cell is not selftrain else None)
        real = _real(cell)
        shares = [_share(comparison.real_share(cell, r)) for r in REGIONS]
        lines.append(f"| {_label(cell)} | {_fmt((cell.get('dice') or {}).get('mean'))} | "
                     f"{format_ratio(comparison.headroom(cell))} | {format_ratio(over)} | "
                     f"{' / '.join(_fmt(real.get(r)) for r in REGIONS) if real else '—'} | "
                     f"{_fmt(real_region_mean(cell)) if real else '—'} | "
                     f"{' / '.join(shares) if real else '—'} |")
    return "\n".join(lines)


def _share(found) -> str:
    if found is None:
        return "—"
    return f"{found[0]:.2f}" + (f" ± {found[1]:.2f}" if found[1] is not None else "")


def real_cases_table(comparisons: list[Comparison]) -> str:
    """Per comparison scored on real cases: every cell's WT / TC / ET Dice on every case (``sim.report_real``)."""
    blocks = []
    for comparison in comparisons:
        scored = [c for c in comparison.cells if _real(c)]
        if not scored:
            continue
        cases = case_list(scored)
        origin = "; ".join(f"{c['case']} from {Path(str(c['folder'])).name}"
                           + (f" ({c['reference']})" if c.get("reference") else "") for c in cases)
        blocks.append(f"**{comparison.label}** ({origin}; † an algorithm's reference)\n\n"
                      + per_case_table(sorted(scored, key=_order), cases))
    return "\n\n".join(blocks) if blocks else "(No comparison given was scored on real cases.)"


def rank_table(comparisons: list[Comparison]) -> str:
    """Kendall's τ between the phantom and the real ranking of the private models, per comparison and on average;
    beside it τ with the phantoms scored by the real side's metric (the mean of the phantom WT, TC and ET)."""
    lines = ["| comparison | private models | Kendall τ | pairs ranked alike / reversed / tied "
             "| τ, phantom WT/TC/ET mean |", "|---|---|---|---|---|"]
    taus, matched_taus = [], []
    for comparison in comparisons:
        found = rank_agreement(comparison.cells)
        if found is None:
            continue
        matched = rank_agreement(comparison.cells, regions=True)
        taus.append(found["tau"])
        if matched is not None:
            matched_taus.append(matched["tau"])
        lines.append(f"| {comparison.name} | {found['n']} | {found['tau']:+.2f} | {found['concordant']} / "
                     f"{found['discordant']} / {found['tied']} | "
                     + ("—" if matched is None else f"{matched['tau']:+.2f}") + " |")
    if not taus:
        return "(No comparison given ranks two private models on phantoms and real scans.)"
    se, matched_se = _se(taus), _se(matched_taus)
    lines.append(f"| mean over {len(taus)} | | {_mean(taus):+.2f}" + (f" ± {se:.2f}" if se is not None else "")
                 + " | | " + ("—" if not matched_taus else f"{_mean(matched_taus):+.2f}"
                              + (f" ± {matched_se:.2f}" if matched_se is not None else "")) + " |")
    return "\n".join(lines)


def group_cells(comparisons: list[Comparison]) -> str:
    return "\n\n".join(f"**{c.label}** ({_describe(c)})\n\n{cells_table(c)}" for c in comparisons)


def across_table(comparisons: list[Comparison]) -> str:
    """Per cell, its numbers over the group's comparisons."""
    rows: dict[str, list] = defaultdict(list)
    order: dict[str, tuple] = {}
    for comparison in comparisons:
        for cell in comparison.cells:
            name = _label(cell)
            order.setdefault(name, _order(cell))
            headroom = comparison.headroom(cell)
            rows[name].append({
                "dice": (cell.get("dice") or {}).get("mean"),
                "headroom": None if headroom is None else headroom[0],
                "real": _real(cell),
                "share": {r: comparison.real_headroom(cell, r) for r in REGIONS},
            })
    lines = [f"Over {len(comparisons)} comparison(s): " + ", ".join(c.label for c in comparisons) + ".", "",
             "| cell | comparisons | phantom mean Dice (mean) | headroom mean ± SE across comparisons (each) "
             "| real WT / TC / ET (mean) | real headroom WT / TC / ET (mean) "
             f"| real WT, TC and ET headroom ≥ {REAL_GOAL:g} |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(rows, key=order.get):
        values = rows[name]
        headrooms = [v["headroom"] for v in values]
        mean, se = _mean(headrooms), _se(headrooms)
        each = " / ".join(_fmt(h, 2, sign=True) for h in headrooms)
        headroom = "—" if mean is None else (f"{mean:+.2f}" + (f" ± {se:.2f}" if se is not None else "")
                                             + f" ({each})")
        has_real = [v for v in values if v["real"]]
        real = " / ".join(_fmt(_mean(v["real"].get(r) for v in has_real)) for r in REGIONS) if has_real else "—"
        share = (" / ".join(_fmt(_mean(v["share"][r] for v in has_real), 2) for r in REGIONS) if has_real else "—")
        both = sum(1 for v in has_real if all(v["share"][r] is not None and _reaches(v["share"][r], REAL_GOAL)
                                               for r in REAL_GOAL_REGIONS))
        lines.append(f"| {name} | {len(values)} | {_fmt(_mean(v['dice'] for v in values))} | {headroom} | {real} "
                     f"| {share} | {f'{both} of {len(has_real)}' if has_real else '—'} |")
    return "\n".join(lines)


def cost_table(comparisons: list[Comparison]) -> str:
    """Every cell's wall seconds, one column per comparison of the group."""
    names: dict[str, tuple] = {}
    seconds: dict[tuple[str, str], float] = {}
    for comparison in comparisons:
        for cell in comparison.cells:
            names.setdefault(_label(cell), _order(cell))
            if cell.get("wall_seconds") is not None:
                seconds[(_label(cell), comparison.label)] = float(cell["wall_seconds"])
    header = "| cell | " + " | ".join(f"{c.label}: wall s" for c in comparisons) + " |"
    lines = [header, "|---" * (len(comparisons) + 1) + "|"]
    for name in sorted(names, key=names.get):
        lines.append(f"| {name} | " + " | ".join(_fmt(seconds.get((name, c.label)), 0) for c in comparisons) + " |")
    return "\n".join(lines)


def secure_pairs(comparisons: list[Comparison]):
    """(comparison, budget, secure cell, trusted cell, kind) for every pair a comparison holds."""
    for comparison in comparisons:
        for secure_method, trusted_method, kind in SECURE_PAIRS:
            for secure in sorted((c for c in comparison.cells if c.get("method") == secure_method), key=_order):
                trusted = comparison.cell(trusted_method, secure.get("epsilon_budget"))
                if trusted is not None:
                    yield comparison, secure.get("epsilon_budget"), secure, trusted, kind


def headroom_share(h_secure, h_trusted) -> float | None:
    """The secure method's headroom as a share of its trusted counterpart's; None unless both were measured and
    the trusted headroom is above zero by more than two standard errors (a share of a headroom that cannot be
    told from zero is any number: -20483 % on one seed's ε 1)."""
    if not h_secure or not h_trusted or h_trusted[0] <= 2 * h_trusted[1]:
        return None
    return h_secure[0] / h_trusted[0]


def secure_table(comparisons: list[Comparison]) -> str:
    lines = ["| comparison | secure / trusted | ε | trusted mean Dice | secure mean Dice "
             "| secure − trusted, paired over test cases (± SE) | trusted headroom | secure headroom "
             "| secure ÷ trusted headroom |", "|---|---|---|---|---|---|---|---|---|"]
    found = False
    for comparison, budget, secure, trusted, _ in secure_pairs(comparisons):
        found = True
        difference = paired_difference(per_case_of(secure), per_case_of(trusted))
        h_secure, h_trusted = comparison.headroom(secure), comparison.headroom(trusted)
        ratio = headroom_share(h_secure, h_trusted)
        lines.append(f"| {comparison.name} | {secure['method']} / {trusted['method']} | {budget:g} | "
                     f"{_fmt(trusted['dice'].get('mean'))} | {_fmt(secure['dice'].get('mean'))} | "
                     f"{'—' if difference is None else f'{difference[0]:+.3f} ± {difference[1]:.3f}'} | "
                     f"{format_ratio(h_trusted)} | {format_ratio(h_secure)} | "
                     f"{'—' if ratio is None else f'{100 * ratio:.0f} %'} |")
    return "\n".join(lines) if found else "(No comparison given holds a secure method beside its trusted counterpart.)"


def _bytes_per_sum(secure: dict) -> tuple[int | None, int | None, int | None]:
    """(sums, bytes up, bytes down) per hospital per secure sum, the largest over hospitals and sums."""
    record = secure.get("secure_aggregation") or {}

    def largest(value):
        if isinstance(value, dict):
            return max(value.values(), default=None)
        if isinstance(value, list):
            return max((largest(v) for v in value if largest(v) is not None), default=None)
        return value

    if "bytes_up_per_hospital_per_step" in record:
        return (record.get("steps_released"), largest(record["bytes_up_per_hospital_per_step"]),
                largest(record.get("bytes_down_per_hospital_per_step")))
    if "bytes_up_per_hospital" in record:
        ups = record["bytes_up_per_hospital"]
        return (len(ups) if isinstance(ups, list) else None, largest(ups),
                largest(record.get("bytes_down_per_hospital")))
    return None, None, None


def secure_sums_table(comparisons: list[Comparison]) -> str:
    lines = ["| comparison | cell | hospitals | secure sums | bytes up per hospital per sum "
             "| bytes down per hospital per sum | wall s |", "|---|---|---|---|---|---|---|"]
    found = False
    for comparison in comparisons:
        for cell in sorted(comparison.cells, key=_order):
            if cell.get("aggregation") != "secure":
                continue
            found = True
            sums, up, down = _bytes_per_sum(cell)
            hospitals = (cell.get("secure_aggregation") or {}).get("participants", cell.get("hospitals"))
            lines.append(f"| {comparison.name} | {_label(cell)} | {hospitals if hospitals is not None else '—'} | "
                         f"{sums if sums is not None else '—'} | {f'{up:,}' if up is not None else '—'} | "
                         f"{f'{down:,}' if down is not None else '—'} | {_fmt(cell.get('wall_seconds'), 0)} |")
    return "\n".join(lines) if found else "(No comparison given holds a secure cell.)"


def _reaches(value: float, threshold: float, digits: int = 2) -> bool:
    """``value`` >= ``threshold`` as the tables show it (rounded to ``digits``): a goal is read off the printed
    number, so 0.4999999 shown as 0.50 meets one half."""
    return round(value, digits) >= threshold


def _yes(met: bool) -> str:
    return "**met**" if met else "not met"


def goal_rows(comparisons: list[Comparison]) -> list[tuple[str, str, str, str]]:
    """(goal, comparison, what was measured, met or not) for every goal a comparison can answer."""
    rows = []
    for budget, share in PHANTOM_GOALS:
        goal = f"best private method ≥ {100 * share:.0f} % of the phantom headroom at ε {budget:g}"
        for comparison in comparisons:
            scored = [(comparison.headroom(c), c) for c in comparison.cells
                      if registry.role_of(c.get("method")) == "private" and (c.get("epsilon_budget") or 0) == budget]
            scored = [(h[0], c) for h, c in scored if h is not None]
            if scored:
                value, cell = max(scored, key=lambda pair: pair[0])
                rows.append((goal, comparison.name, f"{cell['method']} {value:+.2f}", _yes(_reaches(value, share))))
    budget = max(b for b, _ in PHANTOM_GOALS)
    rows += _real_level_rows(comparisons)
    goal = (f"a private method at ε {budget:g} recovers ≥ {100 * REAL_GOAL:.0f} % of the real WT, TC and ET headroom "
            "(best by the smallest of the three)")
    for comparison in comparisons:
        scored = []
        for cell in comparison.cells:
            if registry.role_of(cell.get("method")) != "private" or (cell.get("epsilon_budget") or 0) != budget:
                continue
            shares = [comparison.real_headroom(cell, r) for r in REAL_GOAL_REGIONS]
            if all(v is not None for v in shares):
                scored.append((min(shares), shares, cell))
        if scored:
            low, shares, cell = max(scored, key=lambda item: item[0])
            measured = " / ".join(f"{r} {v:+.2f}" for r, v in zip(REAL_GOAL_REGIONS, shares))
            rows.append((goal, comparison.name, f"{cell['method']} {measured}", _yes(_reaches(low, REAL_GOAL))))
            rows += _above_selftrain_rows(comparison, cell, budget)
    rows += _pate_real_rows(comparisons, budget)
    for comparison in comparisons:
        found = rank_agreement(comparison.cells)
        if found is not None:
            rows.append((f"the phantom ranking of the private models predicts the real one: Kendall τ ≥ {RANK_GOAL:g}",
                         comparison.name, f"τ {found['tau']:+.2f} over {found['n']} private models",
                         _yes(_reaches(found["tau"], RANK_GOAL))))
    for comparison, budget, secure, trusted, kind in secure_pairs(comparisons):
        if kind == "dice":
            goal = f"{secure['method']} within {SECURE_DICE_TOLERANCE} of {trusted['method']} (paired mean Dice)"
            difference = paired_difference(per_case_of(secure), per_case_of(trusted))
            if difference is not None:
                rows.append((goal, comparison.name, f"ε {budget:g}: {difference[0]:+.3f} ± {difference[1]:.3f}",
                             _yes(_reaches(difference[0], -SECURE_DICE_TOLERANCE, 3))))
        elif kind == "above":
            goal = f"{secure['method']} above {trusted['method']} (paired mean Dice)"
            difference = paired_difference(per_case_of(secure), per_case_of(trusted))
            if difference is not None:
                rows.append((goal, comparison.name, f"ε {budget:g}: {difference[0]:+.3f} ± {difference[1]:.3f}",
                             _yes(difference[0] > 0)))
        else:
            goal = (f"{secure['method']} recovers ≥ {100 * SECURE_HEADROOM_SHARE:.0f} % of {trusted['method']}'s "
                    "phantom headroom")
            h_secure, h_trusted = comparison.headroom(secure), comparison.headroom(trusted)
            ratio = headroom_share(h_secure, h_trusted)
            if ratio is not None:
                rows.append((goal, comparison.name, f"ε {budget:g}: {100 * ratio:.0f} %",
                             _yes(_reaches(ratio, SECURE_HEADROOM_SHARE))))
            elif h_secure and h_trusted:
                rows.append((goal, comparison.name, f"ε {budget:g}: {trusted['method']}'s headroom "
                             f"{format_ratio(h_trusted)} is not above zero by two standard errors", "no share"))
    return rows


def _above_selftrain_rows(comparison: Comparison, cell, budget: float) -> list[tuple[str, str, str, str]]:
    """The best private method on the real scans (by the real goal's rule) against the self-trained public model,
    which uses no hospital: real WT and TC above it."""
    selftrain = comparison.cell(SELFTRAIN)
    if selftrain is None or not _real(selftrain) or not _real(cell):
        return []
    ours, floor = _real(cell), _real(selftrain)
    if any(ours.get(r) is None or floor.get(r) is None for r in ("WT", "TC")):
        return []
    goal = f"that method at ε {budget:g} is above {SELFTRAIN} on the real scans (WT and TC)"
    measured = (f"{cell['method']} WT {ours['WT']:.3f} vs {floor['WT']:.3f} / "
                f"TC {ours['TC']:.3f} vs {floor['TC']:.3f}")
    return [(goal, comparison.name, measured, _yes(ours["WT"] > floor["WT"] and ours["TC"] > floor["TC"]))]


def _pate_real_rows(comparisons: list[Comparison], budget: float) -> list[tuple[str, str, str, str]]:
    """PATE's student on the real scans: at least REAL_PATE_GOAL of the real WT and TC headroom, and above
    public-selftrain in both."""
    rows = []
    goal = (f"{PATE} at ε {budget:g} recovers ≥ {100 * REAL_PATE_GOAL:.0f} % of the real WT and TC headroom and is "
            f"above {SELFTRAIN} in both")
    for comparison in comparisons:
        pate, selftrain = comparison.cell(PATE, budget), comparison.cell(SELFTRAIN)
        shares = [comparison.real_headroom(pate, r) if pate else None for r in ("WT", "TC")]
        if any(s is None for s in shares) or selftrain is None or any(
                _real(selftrain).get(r) is None for r in ("WT", "TC")):
            continue
        ours, floor = _real(pate), _real(selftrain)
        measured = "; ".join(f"{r} {share:+.2f} of the headroom, {ours[r]:.3f} vs {floor[r]:.3f}"
                             for r, share in zip(("WT", "TC"), shares))
        met = all(_reaches(s, REAL_PATE_GOAL) for s in shares) and all(ours[r] > floor[r] for r in ("WT", "TC"))
        rows.append((goal, comparison.name, measured, _yes(met)))
    return rows


def _real_level_rows(comparisons: list[Comparison]) -> list[tuple[str, str, str, str]]:
    """The world's real ceiling and floor: the non-private model's and the public model's real Dice against their
    levels (the world limits every method's real result)."""
    rows = []
    for method, levels in ((CEILING, REAL_CEILING_GOAL), (PUBLIC_ONLY, REAL_FLOOR_GOAL)):
        goal = f"{method} on the real scans: " + ", ".join(f"{r} ≥ {v:g}" for r, v in levels.items())
        for comparison in comparisons:
            cell = comparison.cell(method)
            real = _real(cell) if cell else {}
            if not real or any(real.get(r) is None for r in levels):
                continue
            measured = " / ".join(f"{r} {real[r]:.3f}" for r in levels)
            rows.append((goal, comparison.name, measured, _yes(all(real[r] >= v for r, v in levels.items()))))
    return rows


def goal_list() -> str:
    """The goals the ``goals`` table checks, in words, from this module's thresholds (written once, here)."""
    phantom = " and ".join(f"≥ {100 * share:.0f} %" + (" of the phantom headroom" if i == 0 else "")
                           + f" at ε {budget:g}" for i, (budget, share) in enumerate(PHANTOM_GOALS))
    secure = {"dice": "`{0}` within {tolerance:g} of `{1}` (paired mean Dice)",
              "headroom": "`{0}` recovers ≥ {share:.0f} % of `{1}`'s phantom headroom",
              "above": "`{0}` above `{1}` (paired mean Dice)"}
    secure_goals = "; ".join(secure[kind].format(s, t, tolerance=SECURE_DICE_TOLERANCE,
                                                 share=100 * SECURE_HEADROOM_SHARE) for s, t, kind in SECURE_PAIRS)
    budget = max(b for b, _ in PHANTOM_GOALS)
    regions = ", ".join(REAL_GOAL_REGIONS[:-1]) + f" and {REAL_GOAL_REGIONS[-1]}"
    levels = lambda goal: ", ".join(f"{r} ≥ {v:g}" for r, v in goal.items())  # noqa: E731
    return "\n".join([
        f"1. the best private method recovers {phantom}, at every seed;",
        f"2. on the real scans, a private method at ε {budget:g} recovers ≥ {100 * REAL_GOAL:.0f} % of the real "
        f"{regions} headroom (the best by the smallest of the three) and is above `{SELFTRAIN}` on the real WT and "
        "TC;",
        f"3. `{PATE}` at ε {budget:g} recovers ≥ {100 * REAL_PATE_GOAL:.0f} % of the real WT and TC headroom and is "
        f"above `{SELFTRAIN}` in both;",
        f"4. the world's real levels: `{CEILING}` {levels(REAL_CEILING_GOAL)}; `{PUBLIC_ONLY}` "
        f"{levels(REAL_FLOOR_GOAL)};",
        f"5. the phantom ranking of the private models predicts the real one: Kendall's τ ≥ {RANK_GOAL:g};",
        f"6. secure aggregation costs little: {secure_goals}.",
    ])


#: the presets the ``settings`` table shows, in this order
SETTINGS_PRESETS = ("tiny", "quick", "paper")


def _grid_text(grid) -> str:
    """``32³`` for a cubic grid, else ``a × b × c``."""
    return f"{grid[0]}³" if len(set(grid)) == 1 else " × ".join(str(g) for g in grid)


def _student_epochs(student) -> str:
    """The student's epochs; with ``finetune`` (linear probing, then every weight) the two stages' epochs; with
    ``ema_decay`` the average of the iterates that is released."""
    if student.finetune and student.trainable is not Trainable.ALL and student.epochs > 0:
        text = f"{student.epochs} + {student.epochs} (every weight)"
    else:
        text = str(student.epochs)
    if student.ema_decay is not None and student.epochs > 0:
        text += f", average of the iterates (decay {student.ema_decay:g})"
    return text


def settings_table() -> str:
    """The ``settings`` table: one row per preset of :data:`SETTINGS_PRESETS`, read from ``task.settings.presets`` (no run
    needed), so that a document never states K, a grid or a hospital count by hand."""
    lines = ["| preset | hospitals | teachers per hospital | K | grid | public query scans | student epochs "
             "| DP-SGD clip | DP-SGD σ (fixed noise) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in SETTINGS_PRESETS:
        preset = PRESETS[name]
        dp = preset.dp_sgd
        clip = f"{dp.max_grad_norm:g} {'per layer' if dp.per_layer else 'flat'}"
        lines.append(f"| `{name}` | {preset.hospitals} | {preset.teachers_per_hospital} | {preset.teachers} "
                     f"| {_grid_text(preset.grid)} | {preset.federation.n_query} | {_student_epochs(preset.student)} "
                     f"| {clip} | {dp.noise_multiplier:.3g} |")
    return "\n".join(lines + [
        "",
        "K = hospitals × teachers per hospital. DP-SGD's σ is its noise multiplier where the noise is fixed "
        "(`--noise-mode fixed`, or a schedule's start); by default σ is calibrated to the budget. Written from "
        "`task.settings.presets` by `benchmarks/results_tables.py` (table `settings`)."])


def run_free_tables() -> dict[str, str]:
    """The tables that need no run, by marker name."""
    return {"goal-list": goal_list(), "settings": settings_table()}


def goals_table(comparisons: list[Comparison]) -> str:
    rows = goal_rows(comparisons)
    if not rows:
        return "(No comparison given answers a goal.)"
    lines = ["| goal | comparison | measured | |", "|---|---|---|---|"]
    lines += [f"| {goal} | {name} | {measured} | {met} |" for goal, name, measured, met in rows]
    return "\n".join(lines)


def command_text(argv: list[str], comparisons: list[Comparison]) -> str:
    """The command that wrote the tables, each folder shown below ``RUNS`` (their common parent): a path of the
    machine the runs were made on is no part of the document."""
    parents = [str(c.folder.resolve().parent) for c in comparisons]
    root = Path(os.path.commonpath(parents)) if parents else Path(".")
    words = []
    for item in argv:
        if item.startswith("--write="):
            words.append(item)
            continue
        head, equals, folder = item.rpartition("=")
        if equals and head and not item.startswith("--"):
            relative = Path(folder).resolve().relative_to(root).as_posix()
            words.append(shlex.quote(f"{head}=RUNS/{relative}"))
        else:
            words.append(shlex.quote(item))
    return ("Written by\n\n```bash\n.venv/bin/python benchmarks/results_tables.py " + " \\\n    ".join(words)
            + "\n```\n\nwhere RUNS is the folder holding the comparisons. They are:\n\n"
            + "\n".join(f"- `{c.name}`: `RUNS/{c.folder.resolve().relative_to(root).as_posix()}` ({_describe(c)}; "
                        f"methods {', '.join(c.settings.get('methods') or [])})" for c in comparisons))


def tables(comparisons: list[Comparison], argv: list[str]) -> dict[str, str]:
    """Every table these comparisons give, by marker name."""
    out = {}
    groups: dict[str, list[Comparison]] = defaultdict(list)
    for comparison in comparisons:
        groups[comparison.group].append(comparison)
    for group, members in groups.items():
        read = stamp(members)
        out[f"{group}:cells"] = f"{group_cells(members)}\n\n{read}"
        out[f"{group}:across"] = f"{across_table(members)}\n\n{read}"
        out[f"{group}:cost"] = f"{cost_table(members)}\n\n{read}"
        out[f"{group}:real-cases"] = f"{real_cases_table(members)}\n\n{read}"
        out[f"{group}:rank"] = f"{rank_table(members)}\n\n{read}"
    read = stamp(comparisons)
    out["secure-vs-trusted"] = f"{secure_table(comparisons)}\n\n{read}"
    out["secure-sums"] = f"{secure_sums_table(comparisons)}\n\n{read}"
    out["goals"] = f"{goals_table(comparisons)}\n\n{read}"
    out.update(run_free_tables())
    out["command"] = f"{command_text(argv, comparisons)}\n\n{read}"
    return out


def rewrite(text: str, written: dict[str, str], keep_others: bool = False) -> tuple[str, list[str]]:
    """``text`` with every marked block replaced by its table, and the names replaced; refuses a block whose
    table is not in ``written``, and a text without any block. ``keep_others`` (the run-free tables alone):
    a block whose table is not in ``written`` is left as it is, and a text without any of them is refused."""
    names = [m.group("name") for m in MARKER.finditer(text)]
    if not names:
        raise SystemExit("results_tables: no <!-- results_tables:NAME begin --> ... end block in the file")
    missing = sorted({n for n in names if n not in written})
    if keep_others:
        names = [n for n in names if n in written]
        if not names:
            raise SystemExit(f"results_tables: no block of a table that needs no run ({', '.join(sorted(written))}) "
                             "in the file: give the comparisons its blocks need")
    elif missing:
        raise SystemExit(f"results_tables: no table for block(s) {', '.join(missing)}: give their group's "
                         "comparisons, or remove the block(s)")
    return MARKER.sub(lambda m: (m.group(1) + written[m.group("name")].rstrip("\n") + "\n" + m.group(4)
                                 if m.group("name") in written else m.group(0)), text), names


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` at once: a temporary file in its folder, flushed, then ``os.replace``."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _shown(path: Path) -> str:
    """``path`` as the command in the document shows it: below the repository root, else its name alone."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return path.name


def main(argv: list[str]) -> None:
    target, items, command = None, [], []
    index = 0
    while index < len(argv):
        item = argv[index]
        if item == "--write":
            if index + 1 >= len(argv):
                raise SystemExit("results_tables: --write needs a FILE")
            target = Path(argv[index + 1])
            command.append(f"--write={_shown(target)}")
            index += 2
            continue
        if item.startswith("--write="):
            target = Path(item.split("=", 1)[1])
            item = f"--write={_shown(target)}"
        elif item.startswith("-"):
            raise SystemExit(f"results_tables: unknown option {item!r}")
        else:
            items.append(item)
        command.append(item)
        index += 1
    if not items and target is None:
        sys.exit(__doc__)
    comparisons = [load_comparison(*parse_item(item)) for item in items]
    names = {(c.group, c.label) for c in comparisons}
    if len(names) != len(comparisons):
        raise SystemExit("results_tables: two comparisons share a group and label")
    written = tables(comparisons, command) if comparisons else run_free_tables()
    if target is None:
        for name, table in written.items():
            print(f"### {name}\n\n{table}\n")
        return
    text, replaced = rewrite(target.read_text(encoding="utf-8"), written, keep_others=not comparisons)
    write_atomic(target, text)
    unused = sorted(set(written) - set(replaced))
    print(f"results_tables: rewrote {len(replaced)} block(s) of {target}"
          + (f"; tables without a block there: {', '.join(unused)}" if unused else ""), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
