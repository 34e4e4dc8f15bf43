"""Grid of seed systems × ε on a classification task, with per-cell results, a CSV and a report.

Entry point for ``fedpate compare --task mnist5k|slice-classification``::

    from sim.runners.classification_compare import run_classification_compare
    cells = run_classification_compare(task="mnist5k", methods=["dp-mac", "adlm", ...], epsilons=[1, 8],
                                       out="runs/cls", seed=0, delta=1e-5, hospitals=None, progress=True,
                                       preset="tiny", data=None, teachers_per_hospital=None,
                                       reproducible_noise=False)

Writes ``out/<method>/eps-<E>/results.json`` (the results schema, ``"dice": null``, ``"accuracy"`` set) and
``ledger.jsonl`` per cell (``nonprivate`` is one cell, ``out/nonprivate/eps-inf``; so are the reference rows
``public-only``, in every report, and ``adlm-noise-free``, beside AdLM/ILM: see ``REFERENCE_METHODS``), ``out/cells.csv``,
``out/report.md`` (with a verdict of every private cell against public-only) and
``out/accuracy_vs_epsilon.png``. Every ε written comes from the cell's ledger
(the maximum over hospitals; all hospitals carry the same events here).

Resumable, like the segmentation comparison (``sim.runners.resume``): ``out/compare.json`` records the settings
that decide the cells (task, seed, preset, δ, hospitals, data, teachers, noise) and ``out/world.json`` the
split; the same command again skips every finished cell (nothing is charged again), may add methods or budgets,
and refuses any other setting in one line naming its flag. No ledger is ever deleted: a cell found with
releases on its ledger but no results was interrupted and is kept aside as ``<cell>.interrupted-<time>``
(its ε still in the report) before it runs again.

Noise (docs/PRIVACY.md, "Noise"): every cell gets its own namespace ``<method>/eps-<E>`` of a
``privacy.mechanisms.NoiseSource`` and every release in it its own stream; secure by default.
``reproducible_noise=True`` (simulation only) seeds the streams from ``seed``; the seed is then written nowhere
(``"seed": null``, not in the task summary) and each cell says ``"noise": "reproducible"``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import time
import traceback
from pathlib import Path

from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from task.classification import METHODS
from task.classification.adlm import AdLMConfig, train_adlm
from task.classification.dpmac import DPMACConfig, train_dpmac
from task.classification.dpsgd_classifier import DPSGDConfig, train_dpsgd, train_public_only
from task.classification.gnmax import GNMaxConfig, train_pate_gnmax
from task.classification.tasks import load_task
from task.errors import UserError
from task.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from task.results import CSV_COLUMNS as RESULT_CSV_COLUMNS
from task.results import RunResults, csv_row, write_run
from sim.runners.resume import merged, read_settings, refuse_other_settings, set_aside_interrupted

# per-preset training sizes; the nets are the same across methods (fully connected, as in DP-MAC Sec. 3).
# DP-MAC: the classifier settings of the DP-MAC workshop paper (Harder, Köhler, Welling & Park, App. B: batch
# 1000, 30 epochs; the later arXiv version 1910.06924 trains a 300-100 net with batch 50 for 20 epochs) on
# quick, the batch capped at n/10 by ``_batch_size`` like every method here. PATE-GNMax's teachers and queries
# follow the stated rules of ``task.classification.gnmax`` (K ≈ n/10, the vote-margin query count) unless a
# preset or ``teachers_per_hospital`` pins them.
PRESET_SETTINGS = {
    "tiny": {"epochs": 5, "dpmac_epochs": 5, "adlm_epochs": 10, "teacher_epochs": 30},
    "quick": {"epochs": 15, "dpmac_epochs": 30, "adlm_epochs": 30, "teacher_epochs": 40},
}
DPMAC_BATCH = 1000   # the paper's batch (capped at n/10 on small tasks)

#: rows every report carries beside the requested methods (no ε, nothing charged):
#: ``public-only`` -- the non-private cell's network trained on the public labelled reference set alone, the
#: floor a private method must beat (always run); ``adlm-noise-free`` -- AdLM's network, polynomial loss and
#: optimiser with the mechanism switched off (run whenever adlm or ilm is), NOT private.
PUBLIC_ONLY = "public-only"
ADLM_NOISE_FREE = "adlm-noise-free"
REFERENCE_METHODS = (PUBLIC_ONLY, ADLM_NOISE_FREE)

#: what one cell's ε protects (docs/PRIVACY.md, "The unit of privacy"), by ``task.privacy_unit``
PRIVACY_UNITS = {"record": "one record (an MNIST digit) at one hospital",
                 "patient": "one patient (all of the patient's slices) at one hospital"}


#: numbers a cell writes that the DP guarantee does NOT cover (simulation diagnostics), by method:
#: GNMax's teachers and their noise-free ensemble see the private records directly, DP-SGD's empty-batch
#: count is a function of the secret Poisson batches, dataset sizes are published as they are, and the
#: non-private baseline covers nothing. Dotted names point into ``details``.
NOT_PRIVATE = {
    "pate-gnmax": ("teacher_accuracy_mean", "ensemble_accuracy", "details.teacher_accuracy_mean",
                   "details.ensemble_accuracy", "details.records_per_teacher"),
    "dp-sgd": ("details.empty_batches",),
    "dp-sgd-scheduled": ("details.empty_batches",),
    "nonprivate": ("accuracy",),
    ADLM_NOISE_FREE: ("accuracy",),
}
SIZE_DETAILS = ("units",)       # dataset sizes in ``details``, published as they are


def not_private_diagnostics(method: str, details: dict) -> list[str]:
    """The result keys of one cell that are not covered by its ε (see ``NOT_PRIVATE``)."""
    return list(NOT_PRIVATE.get(method, ())) + [f"details.{k}" for k in SIZE_DETAILS if k in details]


def _eps_dir(epsilon: float | None) -> str:
    return "eps-inf" if epsilon is None else f"eps-{epsilon:g}"


def _batch_size(n: int, wanted: int) -> int:
    """Keep the sampling rate meaningful on small tasks (slices of the tiny phantoms): about n/10."""
    return int(max(16, min(wanted, n // 10)))


def _run_method(method: str, task, epsilon, delta, guard, owners, preset: str, seed: int, progress: bool,
                teachers_per_hospital: int | None, noise):
    settings = PRESET_SETTINGS[preset]
    n = len(task.y_private)
    units = len(task.unit_records())       # DP-MAC and DP-SGD sample units (patients on the slice task)
    if method == "dp-mac":
        cfg = DPMACConfig(epochs=settings.get("dpmac_epochs", settings["epochs"]), batch_size=_batch_size(units, DPMAC_BATCH),
                          pca_components=min(60, task.input_dim))
        return train_dpmac(task, epsilon, delta, guard, owners, cfg, seed=seed, progress=progress, noise=noise)
    if method in ("adlm", "ilm", ADLM_NOISE_FREE):
        cfg = AdLMConfig(epochs=settings["adlm_epochs"], batch_size=_batch_size(n, 128))
        res = train_adlm(task, None if method == ADLM_NOISE_FREE else epsilon, delta, guard, owners, cfg, seed=seed,
                         adaptive=method != "ilm", progress=progress, noise=noise)
        res.method = method
        return res
    if method == PUBLIC_ONLY:
        # the non-private cell's network and optimiser for the same number of Adam steps, on the public
        # labelled reference records only
        cfg = DPSGDConfig(epochs=settings["epochs"], batch_size=_batch_size(units, 250))
        steps = cfg.epochs * math.ceil(n / cfg.batch_size)
        return train_public_only(task, cfg, steps, _batch_size(len(task.y_reference), cfg.batch_size), seed=seed)
    if method == "pate-gnmax":
        # a preset may pin K or N; otherwise the rules of task.classification.gnmax choose them
        cfg = GNMaxConfig(teachers_per_hospital=teachers_per_hospital or settings.get("teachers_per_hospital"),
                          queries=settings.get("queries"), teacher_epochs=settings["teacher_epochs"])
        return train_pate_gnmax(task, epsilon, delta, guard, owners, cfg, seed=seed, progress=progress, noise=noise)
    if method in ("dp-sgd", "dp-sgd-scheduled", "nonprivate"):
        cfg = DPSGDConfig(epochs=settings["epochs"], batch_size=_batch_size(units, 250),
                          schedule="exp" if method == "dp-sgd-scheduled" else None)
        return train_dpsgd(task, None if method == "nonprivate" else epsilon, delta, guard, owners, cfg, seed=seed,
                           progress=progress, noise=noise)
    raise UserError(f"--methods: unknown method {method!r}; expected some of {', '.join(METHODS)}")


def run_cell(task, method: str, epsilon: float | None, out: Path, delta: float, seed: int, preset: str,
             progress: bool = True, teachers_per_hospital: int | None = None, noise=None) -> dict:
    """One method at one ε: fresh ledger + guard in ``out``, train, write results.json.

    A method that raises does not stop the grid: its error is written into the cell.

    Args:
        task: the :class:`task.classification.tasks.ClassificationTask`; every hospital of it is a ledger owner.
        method: one of ``task.classification.METHODS``.
        epsilon: the cell's budget (None = the non-private cell: nothing is accounted).
        out: the cell's folder (ledger.jsonl, results.json). A folder already holding releases (an earlier,
            unfinished run of the cell) is refused: its ledger is never deleted or added to.
        delta: the cell's δ.
        seed: the method's non-private randomness (initialisation, partitions; see each method); recorded
            unless the noise is reproducible.
        preset: ``tiny`` or ``quick`` (:data:`PRESET_SETTINGS`: epochs, teachers, queries).
        progress: per-epoch lines, a summary line and, on an error, its traceback.
        teachers_per_hospital: PATE-GNMax's teachers per hospital (None = the preset setting's).
        noise: the comparison's ``privacy.mechanisms.NoiseSource`` (secure when None); the cell draws from its
            child ``<method>/eps-<E>``. A reproducible source keeps the seed out of results.json.
    """

    noise = (noise if noise is not None else NoiseSource()).child(method, _eps_dir(epsilon))

    out.mkdir(parents=True, exist_ok=True)
    ledger_path = out / "ledger.jsonl"
    # the cell's ledger must describe exactly this run, and no release may be forgotten: a folder that already
    # released is not reused (run_classification_compare skips finished cells and sets interrupted ones aside)
    if (out / "results.json").exists() or (ledger_path.exists() and ledger_path.stat().st_size > 0):
        raise UserError(f"{out}: holds an earlier run of this cell (its releases stay on {ledger_path.name}); "
                        "use a new folder")
    ledger = Ledger(ledger_path)
    guard = BudgetGuard(ledger, epsilon if epsilon is not None else 1e-9, delta)
    owners = list(task.hospitals)
    start = time.perf_counter()
    error, res = None, None
    try:
        res = _run_method(method, task, epsilon, delta, guard, owners, preset, seed, progress, teachers_per_hospital,
                          noise)
    except Exception as exc:  # one failing cell must not lose the grid; the error is written into the cell
        error = f"{type(exc).__name__}: {exc}"
        if progress:
            traceback.print_exc()
    wall = time.perf_counter() - start
    if not ledger_path.exists():
        # a non-private cell has an (empty) ledger too: nothing was released; owner-only as every ledger
        atomic_write_text(ledger_path, "", private=True)
    details = dict(res.details) if res else {}
    results = RunResults(
        method=method, accuracy=None if res is None else res.accuracy, epsilon_budget=epsilon,
        teachers=res.teachers if res else None, hospitals=len(task.hospitals),
        queries=res.queries if res else None, sigma=res.sigma if res else None,
        bytes_up_per_query_per_teacher=res.bytes_up_per_query_per_teacher if res else None,
        seed=None if noise.is_reproducible else seed)
    if epsilon is not None:   # every epsilon written is the ledger's (the worst hospital's)
        results.account(ledger, delta, relation=res.relation if res else None)
    else:
        results.relation = res.relation if res else None
    results.delta = delta
    results.wall_seconds = wall
    results.extras = {
        "task": task.name,
        "teacher_accuracy_mean": details.get("teacher_accuracy_mean"),
        "ensemble_accuracy": details.get("ensemble_accuracy"),
        **(noise.describe() if epsilon is not None else {}), "preset": preset,
        "privacy_unit": PRIVACY_UNITS[task.privacy_unit],
        "details": details, "error": error,
        "not_private_diagnostics": not_private_diagnostics(method, details),
    }
    result = write_run(out, results)
    if progress:
        acc = "n/a" if result["accuracy"] is None else f"{result['accuracy']:.3f}"
        eps = "—" if result["epsilon"] is None else f"{result['epsilon']:.3f}"
        print(f"[{method} ε={epsilon}] accuracy {acc}, ε spent {eps} ({results.accountant}), {wall:.1f}s"
              + (f"  ERROR {error}" if error else ""), flush=True)
    return result


def run_classification_compare(task: str, methods, epsilons, out, seed: int = 0, delta: float = 1e-5,
                               hospitals: int | None = None, progress: bool = True, preset: str = "tiny",
                               data: str | None = None, teachers_per_hospital: int | None = None,
                               reproducible_noise: bool = False) -> list[dict]:
    """Run every method × ε on ``task`` and write the cells, ``cells.csv``, ``report.md`` and the plot.

    Args:
        task: ``mnist5k`` or ``slice-classification`` (``task.classification.tasks.load_task``).
        methods: method names (a list, or one comma-separated string); ``nonprivate`` is one cell.
        epsilons: the private cells' budgets (positive; a list, or one comma-separated string).
        out: the comparison's folder (``out/<method>/eps-<E>`` per cell, cells.csv, report.md, the plot).
        seed: the task's split (mnist5k's permutation, the slice task's world) and every method's non-private
            randomness; also the noise under ``reproducible_noise``.
        delta: δ of every cell (in (0, 1)).
        hospitals: the number of hospitals (None = 4 for mnist5k, the preset's for the slice task).
        progress: progress lines.
        preset: ``tiny`` or ``quick``: the training sizes (:data:`PRESET_SETTINGS`) and the slice task's world.
        data: the slice task's MSD Task01 or BraTS folder (None = the preset's phantoms; mnist5k ignores it).
        teachers_per_hospital: PATE-GNMax's teachers per hospital (None = the preset setting's).
        reproducible_noise: simulation only -- noise and private sampling seeded by ``seed`` (per cell and
            release); the seed is then left out of everything written. Default: secure noise.
    """

    logging.getLogger("absl").setLevel(logging.ERROR)   # dp_accounting's RDP order warnings drown the progress
    if preset not in PRESET_SETTINGS:
        raise UserError(f"--preset: classification tasks support {', '.join(PRESET_SETTINGS)}, got {preset!r}")
    methods = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    unknown = [m for m in methods if m not in METHODS + REFERENCE_METHODS]
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(unknown)}; expected some of {', '.join(METHODS)}")
    # the reference rows (REFERENCE_METHODS): public-only in every report, AdLM's noise-free row beside AdLM/ILM
    if any(m in methods for m in ("adlm", "ilm")) and ADLM_NOISE_FREE not in methods:
        methods.append(ADLM_NOISE_FREE)
    if PUBLIC_ONLY not in methods:
        methods.append(PUBLIC_ONLY)
    epsilons = [float(e) for e in (epsilons.split(",") if isinstance(epsilons, str) else epsilons)]
    if any(not (e > 0 and math.isfinite(e)) for e in epsilons):
        raise UserError(f"--epsilons: expected positive numbers, got {epsilons}")
    if delta is None or not (0 < delta < 1):
        raise UserError(f"--delta: expected a number in (0, 1), got {delta}")
    out = Path(out)
    header = out / "compare.json"
    # a folder is resumed only with the settings it was started with (sim.runners.resume), checked before
    # anything is written or charged
    saved = read_settings(header) or {}
    settings = resume_settings(task, seed, delta, preset, data, teachers_per_hospital, reproducible_noise)
    if saved and "task" not in saved:   # written by a segmentation comparison before it recorded its task
        raise UserError(f"--out {out}: holds a run with other settings (--task segmentation there, {task} now); "
                        "resume it with the same settings, or use a new --out folder")
    hidden = ("seed",) if reproducible_noise else ()
    refuse_other_settings(header, settings, hidden=hidden)
    t = load_task(task, preset=preset, hospitals=hospitals, seed=seed, data=data)
    settings["hospitals"] = len(t.hospitals)   # the number the task resolved (--hospitals or the task's default)
    refuse_other_settings(header, settings, hidden=hidden)
    saved_split = read_settings(out / WORLD_FILE)
    if saved_split is not None and saved_split != describe_split(t):
        # every other setting matched: the seed (not recorded under reproducible noise) or the data changed
        raise UserError(f"--out {out}: holds a run on another split of the private records (--seed differs, "
                        "its value unpublished under reproducible noise, or the --data folder changed); resume it "
                        "with the same settings and data, or use a new --out folder")
    noise = NoiseSource.reproducible(seed) if reproducible_noise else NoiseSource()
    summary = t.summary()
    if reproducible_noise:
        summary.pop("seed", None)      # the seed of reproducible noise must not appear in anything written
    if progress:
        print(f"task {t.name}: {summary}", flush=True)
    # a resume may add methods or budgets (each cell is its own folder, with these same settings): the header and
    # the report cover every cell of the folder
    methods_all, epsilons_all = merged(saved.get("methods"), methods), merged(saved.get("epsilons"), epsilons)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(header, {"methods": methods_all, "epsilons": epsilons_all, **settings})
    atomic_write_json(out / WORLD_FILE, describe_split(t))
    for method in methods:
        for epsilon in _cell_budgets(method, epsilons):
            path = out / method / _eps_dir(epsilon)
            if (path / "results.json").exists():      # finished: nothing is run or charged again
                continue
            set_aside_interrupted(path, counted_in=f"its own ledger, {path.name}.interrupted-*/ledger.jsonl")
            run_cell(t, method, epsilon, path, delta, seed, preset, progress, teachers_per_hospital, noise)
    cells = [json.loads((out / m / _eps_dir(e) / "results.json").read_text())
             for m in methods_all for e in _cell_budgets(m, epsilons_all)
             if (out / m / _eps_dir(e) / "results.json").exists()]
    write_cells_csv(cells, out / "cells.csv")
    write_report(cells, out, summary, delta, interrupted=interrupted_releases(out, delta))
    return cells


#: the split of a classification comparison (who holds how many records, and a digest of which), beside compare.json
WORLD_FILE = "world.json"


def _cell_budgets(method: str, epsilons) -> list:
    return [None] if method in ("nonprivate",) + REFERENCE_METHODS else list(epsilons)


def resume_settings(task: str, seed: int, delta: float, preset: str, data, teachers_per_hospital,
                    reproducible_noise: bool) -> dict:
    """What decides a classification comparison's cells, recorded in compare.json and required to be the same
    when the folder is resumed (``sim.runners.resume``); methods and budgets may be added. The seed drives the
    noise when it is reproducible: then it is not recorded (the split in world.json still checks it).

    Args:
        task: the classification task's name.
        seed: the run's seed (left out under reproducible noise).
        delta: the comparison's δ.
        preset: the preset's name.
        data: the data folder given, or None for the task's own data.
        teachers_per_hospital: the GNMax teachers per hospital given (None: the default rule).
        reproducible_noise: whether the run's noise is seeded (a simulation).
    """
    return {"task": task, "preset": preset, "delta": delta, "seed": None if reproducible_noise else seed,
            "noise": "reproducible" if reproducible_noise else "secure",
            "data": None if data is None else str(data), "teachers_per_hospital": teachers_per_hospital}


def describe_split(task) -> dict:
    """Who holds how many private records, and a digest of exactly which (inputs, labels, hospitals and the
    test set): another seed or other data gives another split, which a resume refuses."""
    digest = hashlib.sha256()
    for array in (task.x_private, task.y_private, task.hospital_of, task.y_test):
        digest.update(array.tobytes())
    return {"hospitals": task.summary()["hospitals"], "private": int(len(task.y_private)),
            "split_sha256": digest.hexdigest()}


def interrupted_releases(out: Path, delta: float) -> list[dict]:
    """The cells interrupted after releasing and kept aside (``<cell>.interrupted-<time>``): what each spent, from
    its own ledger (the worst hospital's ε at ``delta``), so that no release drops out of the report."""
    found = []
    for path in sorted(p for p in out.glob("*/*.interrupted-*") if p.is_dir()):
        ledger_path = path / "ledger.jsonl"
        if not ledger_path.exists():
            continue
        ledger = Ledger.load(ledger_path)
        spent = [ledger.spent(owner, delta) for owner in ledger.owners()]
        worst = max(spent, key=lambda s: s.epsilon, default=None)
        found.append({"cell": str(path.relative_to(out)), "releases": len(ledger.records()),
                      "epsilon": None if worst is None else worst.epsilon, "delta": delta,
                      "relation": None if worst is None else worst.relation,
                      "accountant": None if worst is None else worst.accountant})
    return found


#: the results record's columns (task.results), and a failed cell's error
CSV_COLUMNS = RESULT_CSV_COLUMNS + ("error",)


def write_cells_csv(cells: list[dict], path: Path) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for c in cells:
        row = {**csv_row(c), "error": c.get("error")}
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    atomic_write_text(path, buf.getvalue())


def _fmt(value, spec=".3f") -> str:
    return "—" if value is None else format(value, spec)


def write_report(cells: list[dict], out: Path, task_summary: dict, delta: float,
                 interrupted: list[dict] = ()) -> None:
    unit = task_summary.get("privacy_unit", "record")
    lines = [f"# Seed systems on `{task_summary['task']}`", "",
             f"Task: {task_summary}", "",
             f"Privacy unit: {PRIVACY_UNITS[unit]}. DP-MAC, DP-SGD: replace-one {unit}, Poisson sampling of "
             f"{unit}s, PLD accountant. AdLM/ILM: replace-one {unit}, pure ε (basic composition ε1+ε2+ε3, "
             f"independent of epochs). PATE-GNMax: replace-one {unit}, data-independent accounting of Gaussian "
             "noisy-argmax (gdp-exact). ε spent is read from each cell's ledger.jsonl. Numbers listed under "
             "`not_private_diagnostics` in a cell's results.json (GNMax's teacher and noise-free ensemble "
             "accuracies, DP-SGD's empty-batch count, dataset sizes) are simulation diagnostics that no ε covers.",
             ""]
    if unit == "patient":
        lines += ["Every ε here is per patient, not per slice: DP-MAC and DP-SGD sample whole patients and clip "
                  "the sum of a patient's slice contributions (coefficients, DP-PCA second moment, gradient) to C; "
                  "AdLM/ILM take exactly k slices per patient (`records_per_unit` in results) and size every "
                  "slice's noise for ε/k; PATE-GNMax's teachers partition whole patients.", ""]
    lines += ["| method | ε budget | ε spent | δ | relation | accountant | accuracy | wall s | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        d = c.get("details") or {}
        note = c.get("error") or ""
        if c["method"] == "pate-gnmax" and not note:
            note = (f"K={c['teachers']}, σ={_fmt(c['sigma'], '.1f')}, label acc {_fmt(d.get('label_accuracy'))}; "
                    f"not private: teacher acc {_fmt(d.get('teacher_accuracy_mean'))}, "
                    f"ensemble {_fmt(d.get('ensemble_accuracy'))}")
        elif c["method"] in ("dp-mac", "dp-sgd", "dp-sgd-scheduled") and c.get("sigma") and not note:
            note = f"noise multiplier {_fmt(c['sigma'], '.2f')}"
        elif c["method"] in ("adlm", "ilm") and not note:
            note = (f"feature Laplace scale (median) {_fmt(d.get('feature_scale_median'), '.1f')}, "
                    f"label scale {_fmt(d.get('label_scale'), '.1f')}")
        elif c["method"] == ADLM_NOISE_FREE and not note:
            note = "NOT PRIVATE: AdLM's network, loss and optimiser with the mechanism switched off; no ε is claimed"
        elif c["method"] == PUBLIC_ONLY and not note:
            note = (f"public labelled reference set only ({d.get('reference_records')} records); no private record "
                    "read, nothing charged")
        lines.append(f"| {c['method']} | {_fmt(c['epsilon_budget'], 'g')} | {_fmt(c['epsilon'])} | "
                     f"{_delta(c)} | "
                     f"{c['relation'] or '—'} | {c['accountant'] or '—'} | {_fmt(c['accuracy'])} | "
                     f"{c['wall_seconds']:.1f} | {note} |")
    lines += verdicts(cells)
    if interrupted:   # their releases happened: the ε they spent stays in the report
        lines += ["", "## Interrupted cells (kept aside; their releases stay counted)", "",
                  "Each ran again in a fresh folder; what it released before the interruption is spent on top of "
                  "the rerun's ε, on the same private records.", "",
                  "| kept as | releases | ε spent | δ | relation | accountant |", "|---|---|---|---|---|---|"]
        lines += [f"| {i['cell']} | {i['releases']} | {_fmt(i['epsilon'])} | {i['delta']:g} | {i['relation'] or '—'} | "
                  f"{i['accountant'] or '—'} |" for i in interrupted]
    try:
        _plot(cells, out / "accuracy_vs_epsilon.png")
        lines += ["", "![accuracy vs epsilon](accuracy_vs_epsilon.png)"]
    except Exception as exc:  # the report must still be written when plotting fails
        lines += ["", f"(plot failed: {exc})"]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")


def _delta(cell: dict) -> str:
    """δ of a private cell (0 for the pure-ε Laplace releases of AdLM/ILM); "—" where nothing is claimed."""
    if cell["epsilon_budget"] is None:
        return "—"
    return "0" if cell["method"] in ("adlm", "ilm") else f"{cell['delta']:g}"


def verdicts(cells: list[dict]) -> list[str]:
    """Report lines comparing every private cell with the public-only floor: a private method is worth its
    privacy cost only where it beats the same network trained on the public labelled records alone."""
    floor = next((c["accuracy"] for c in cells if c["method"] == PUBLIC_ONLY and c["accuracy"] is not None), None)
    if floor is None:
        return ["", "Verdicts: no public-only accuracy (its cell failed), so no private method is compared with it."]
    lines = ["", f"## Verdicts against public-only (accuracy {floor:.3f})", ""]
    for c in cells:
        if c["epsilon_budget"] is None or c["accuracy"] is None:
            continue
        gap = c["accuracy"] - floor
        verdict = "beats public-only" if gap > 0 else "does not beat public-only"
        lines.append(f"- {c['method']} at ε = {c['epsilon_budget']:g}: {c['accuracy']:.3f} ({gap:+.3f}): {verdict}")
    return lines


def _order(method: str) -> int:
    known = list(METHODS) + list(REFERENCE_METHODS)
    return known.index(method) if method in known else len(known)


def _plot(cells: list[dict], path: Path) -> None:
    # matplotlib (~1.5 s) only where the plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    methods = sorted({c["method"] for c in cells}, key=_order)
    for m in methods:
        pts = sorted((c["epsilon_budget"], c["accuracy"]) for c in cells
                     if c["method"] == m and c["accuracy"] is not None and c["epsilon_budget"] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        elif m in ("nonprivate",) + REFERENCE_METHODS:   # one ε-free cell: a horizontal line
            acc = next((c["accuracy"] for c in cells if c["method"] == m and c["accuracy"] is not None), None)
            if acc is not None:
                style = {"nonprivate": ("k", "--"), PUBLIC_ONLY: ("tab:gray", ":")}.get(m, ("tab:brown", "-."))
                ax.axhline(acc, color=style[0], linestyle=style[1], label=m)
    ax.set_xscale("log")
    ax.set_xlabel("ε (budget)")
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)

    atomic_write_bytes(path, buf.getvalue())
