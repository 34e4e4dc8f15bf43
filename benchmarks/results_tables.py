"""The tables of docs/RESULTS.md, written from stored comparisons (their ``results.json``), so that the numbers
there cannot drift from the runs.

    .venv/bin/python benchmarks/results_tables.py LABEL=FOLDER [LABEL=FOLDER ...]
    e.g. benchmarks/results_tables.py "seed 0=runs/demo-s0" "seed 1=runs/demo-s1" "seed 2=runs/demo-s2"

Each FOLDER is one comparison (``fedpate compare`` or ``fedpate demo``; one seed). Prints, as markdown:

1. per comparison, one row per cell: phantom mean Dice, headroom recovered on the phantom test set (paired over
   its cases, ± SE: the report's estimator), and, where the comparison scored real cases (``--real-check``), the
   real WT / TC / ET Dice and the share of the real headroom (public-only -> non-private) recovered in each;
2. across the comparisons: each cell's mean phantom headroom, and the number of comparisons in which its real WT and
   TC headroom reach one half.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from sim.report import ceiling_of, floors_of, format_ratio, headroom_of, load_cells, reference_cell

REGIONS = ("WT", "TC", "ET")


def _label(cell) -> str:
    budget = cell.get("epsilon_budget")
    return cell["method"] + (f" ε {budget:g}" if budget else "")


def _real(cell) -> dict:
    return ((cell.get("real_check") or {}).get("dice")) or {}


def _real_headroom(cell, floor, ceiling, region: str) -> float | None:
    value, low, high = _real(cell).get(region), _real(floor).get(region), _real(ceiling).get(region)
    if None in (value, low, high) or high == low:
        return None
    return (value - low) / (high - low)


def _fmt(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def comparison_table(cells) -> tuple[str, dict[str, dict]]:
    """One comparison's markdown table and, per cell label, the numbers the across-comparison table needs."""
    floor = reference_cell(cells, floors_of(cells)[0]) if floors_of(cells) else None
    ceiling = reference_cell(cells, ceiling_of(cells))
    selftrain = reference_cell(cells, "public-selftrain")
    lines = ["| cell | phantom mean Dice | phantom headroom (± SE) | over public-selftrain (± SE) | real WT / TC / ET "
             "| real headroom WT / TC / ET |", "|---|---|---|---|---|---|"]
    numbers = {}
    for cell in sorted(cells, key=lambda c: (c["method"] != "public-only", c.get("epsilon_budget") or 0,
                                             c["method"])):
        phantom = headroom_of(cell, floor, ceiling) if floor and ceiling else None
        over = headroom_of(cell, selftrain, ceiling) if selftrain and ceiling and cell is not selftrain else None
        real = _real(cell)
        shares = {r: _real_headroom(cell, floor, ceiling, r) if floor and ceiling else None for r in REGIONS}
        lines.append(f"| {_label(cell)} | {_fmt(cell['dice'].get('mean'))} | {format_ratio(phantom)} | "
                     f"{format_ratio(over)} | {' / '.join(_fmt(real.get(r)) for r in REGIONS) if real else '—'} | "
                     f"{' / '.join(_fmt(shares[r], 2) for r in REGIONS) if real else '—'} |")
        numbers[_label(cell)] = {"phantom": None if phantom is None else phantom[0], **shares}
    return "\n".join(lines), numbers


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    across: dict[str, list[dict]] = defaultdict(list)
    for item in argv:
        label, _, folder = item.rpartition("=")
        cells = [c for c in load_cells(folder) if "_shared" not in c["_cell"]]
        table, numbers = comparison_table(cells)
        print(f"**{label or folder}**\n\n{table}\n")
        for name, values in numbers.items():
            across[name].append(values)
    print(f"**Across the {len(argv)} comparisons**\n")
    print("| cell | mean phantom headroom | comparisons with real WT headroom ≥ 0.5 | with real TC headroom ≥ 0.5 |")
    print("|---|---|---|---|")
    for name, rows in across.items():
        phantom = [r["phantom"] for r in rows if r["phantom"] is not None]
        mean = sum(phantom) / len(phantom) if phantom else None
        wt = sum(1 for r in rows if (r["WT"] or -1) >= 0.5)
        tc = sum(1 for r in rows if (r["TC"] or -1) >= 0.5)
        print(f"| {name} | {_fmt(mean, 2)} | {wt} of {len(rows)} | {tc} of {len(rows)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
