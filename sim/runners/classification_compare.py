"""Grid of seed systems × ε on a classification task, with per-cell results, a CSV and a report.

Entry point for ``fedpate compare --task mnist5k|slice-classification``::

    from sim.runners.classification_compare import ClassificationCompareConfig, run_classification_compare
    cells = run_classification_compare(ClassificationCompareConfig(
        task="mnist5k", methods=["dp-mac", "adlm", ...], epsilons=[1, 8], out="runs/cls", seed=0, delta=1e-5,
        hospitals=None, compute=Compute(progress=True), preset="tiny", data=None, teachers_per_hospital=None,
        reproducible_noise=False))

Which methods there are, and what the comparison needs to know about each (its trainer, whether it has one cell
per ε, its report note, what its ε does not cover), are the records of ``task.settings.methods.ClassificationMethod``; the
trainers are found here by the record's ``runner`` key (:func:`register_classification_runner`), so nothing
below tests a method's name.

Writes ``out/<method>/eps-<E>/results.json`` (the results schema, ``"dice": null``, ``"accuracy"`` set) and
``ledger.jsonl`` per cell (``nonprivate`` is one cell, ``out/nonprivate/eps-inf``; so are the reference rows
``public-only``, in every report, and ``adlm-noise-free``, beside AdLM/ILM: the records with ``reference``),
``out/cells.csv``, ``out/report.md`` (with a verdict of every private cell against public-only) and
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from privacy.options import NoiseKind
from task.classification import PrivacyUnit, SeedResult, SeedRun
from task.classification.adlm import AdLMConfig, train_adlm
from task.classification.dpmac import DPMACConfig, train_dpmac
from task.classification.dpsgd_classifier import DPSGDConfig, train_dpsgd, train_public_only
from task.classification.gnmax import GNMaxConfig, train_pate_gnmax
from task.classification.tasks import load_task, task_name
from task.learning.compute import Compute, check_compute
from task.errors import UserError
from task.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from task.settings.methods import CLASSIFICATION, CLASSIFICATION_METHODS, ClassificationMethod, Role
from task.settings.registry import Registry
from task.reporting.results import CSV_COLUMNS as RESULT_CSV_COLUMNS
from task.reporting.results import RunResults, csv_row, write_run
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

#: what one cell's ε protects (docs/PRIVACY.md, "The unit of privacy"), by ``task.privacy_unit``
PRIVACY_UNITS = {PrivacyUnit.RECORD: "one record (an MNIST digit) at one hospital",
                 PrivacyUnit.PATIENT: "one patient (all of the patient's slices) at one hospital"}

SIZE_DETAILS = ("units",)       # dataset sizes in ``details``, published as they are


def not_private_diagnostics(method: str, details: dict) -> list[str]:
    """The result keys of one cell that are not covered by its ε: the record's ``not_private`` (GNMax's
    teachers and their noise-free ensemble see the private records directly, DP-SGD's empty-batch count is a
    function of the secret Poisson batches, the non-private rows cover nothing) and the dataset sizes, published
    as they are."""
    record = _known(method)
    return list(record.not_private if record else ()) + [f"details.{k}" for k in SIZE_DETAILS if k in details]


def _eps_dir(epsilon: float | None) -> str:
    return "eps-inf" if epsilon is None else f"eps-{epsilon:g}"


def _batch_size(n: int, wanted: int) -> int:
    """Keep the sampling rate meaningful on small tasks (slices of the tiny phantoms): about n/10."""
    return int(max(16, min(wanted, n // 10)))


# ------------------------------------------------------------------------------------------------ one cell
@dataclass(frozen=True)
class CellSettings:
    """What every cell of a comparison shares besides its method, budget and folder.

    Args:
        delta: the cells' δ.
        seed: the methods' non-private randomness (initialisation, partitions; see each method); recorded
            unless the noise is reproducible.
        preset: ``tiny`` or ``quick`` (:data:`PRESET_SETTINGS`: epochs, teachers, queries).
        progress: per-epoch lines, a summary line and, on an error, its traceback.
        teachers_per_hospital: PATE-GNMax's teachers per hospital (None or 0 = the preset setting's, else its
            rule).
    """

    delta: float
    seed: int = 0
    preset: str = "tiny"
    progress: bool = True
    teachers_per_hospital: int | None = None

    def __post_init__(self) -> None:
        if self.preset not in PRESET_SETTINGS:
            raise UserError(f"--preset: classification tasks support {', '.join(PRESET_SETTINGS)}, "
                            f"got {self.preset!r}")
        if self.delta is None or not (0 < self.delta < 1):
            raise UserError(f"--delta: expected a number in (0, 1), got {self.delta}")


@dataclass(frozen=True)
class Cell:
    """One cell as its trainer sees it: the method's record, the run (task, budget -- None for a record that is
    not private --, guard, owners, seed, noise) and the comparison's settings."""

    record: ClassificationMethod
    run: SeedRun
    settings: CellSettings

    @property
    def training(self) -> dict:
        """The preset's training sizes (:data:`PRESET_SETTINGS`)."""
        return PRESET_SETTINGS[self.settings.preset]

    @property
    def units(self) -> int:
        """The privacy units DP-MAC and DP-SGD sample (patients on the slice task)."""
        return len(self.run.task.unit_records())


CellTrainer = Callable[[Cell], SeedResult]
_TRAINERS: Registry[CellTrainer] = Registry("classification runner")
register_classification_runner = _TRAINERS.register
unregister_classification_runner = _TRAINERS.unregister


def _train_dpmac(cell: Cell) -> SeedResult:
    settings = cell.training
    cfg = DPMACConfig(epochs=settings.get("dpmac_epochs", settings["epochs"]),
                      batch_size=_batch_size(cell.units, DPMAC_BATCH), pca_components=min(60, cell.run.task.input_dim))
    return train_dpmac(cell.run, cfg)


def _adlm_trainer(adaptive: bool) -> CellTrainer:
    """AdLM (``adaptive``) or ILM; a record that is not private (AdLM's noise-free row) runs without a budget."""

    def train(cell: Cell) -> SeedResult:
        cfg = AdLMConfig(epochs=cell.training["adlm_epochs"], batch_size=_batch_size(len(cell.run.task.y_private), 128))
        res = train_adlm(cell.run, cfg, adaptive=adaptive)
        res.method = cell.record.name
        return res

    return train


def _train_public_only(cell: Cell) -> SeedResult:
    # the non-private cell's network and optimiser for the same number of Adam steps, on the public
    # labelled reference records only
    task = cell.run.task
    cfg = DPSGDConfig(epochs=cell.training["epochs"], batch_size=_batch_size(cell.units, 250))
    steps = cfg.epochs * math.ceil(len(task.y_private) / cfg.batch_size)
    return train_public_only(task, cfg, steps, _batch_size(len(task.y_reference), cfg.batch_size), seed=cell.run.seed)


def _train_gnmax(cell: Cell) -> SeedResult:
    # a preset may pin K or N; otherwise the rules of task.classification.gnmax choose them
    settings = cell.training
    teachers = cell.settings.teachers_per_hospital or settings.get("teachers_per_hospital")
    cfg = GNMaxConfig(teachers_per_hospital=teachers, queries=settings.get("queries"),
                      teacher_epochs=settings["teacher_epochs"])
    return train_pate_gnmax(cell.run, cfg)


def _dpsgd_trainer(schedule: str | None) -> CellTrainer:
    """DP-SGD with constant noise (``schedule`` None) or a schedule; a record that is not private (the
    non-private baseline) trains the same net without clipping or noise."""

    def train(cell: Cell) -> SeedResult:
        cfg = DPSGDConfig(epochs=cell.training["epochs"], batch_size=_batch_size(cell.units, 250), schedule=schedule)
        return train_dpsgd(cell.run, cfg)

    return train


register_classification_runner("dp-mac", _train_dpmac)
register_classification_runner("adlm", _adlm_trainer(adaptive=True))
register_classification_runner("ilm", _adlm_trainer(adaptive=False))
register_classification_runner("public-only", _train_public_only)
register_classification_runner("pate-gnmax", _train_gnmax)
register_classification_runner("dp-sgd", _dpsgd_trainer(None))
register_classification_runner("dp-sgd-scheduled", _dpsgd_trainer("exp"))   # Yu et al. 2019, Sec. IV-A-2b


def _train(record: ClassificationMethod, task, epsilon: float | None, guard, settings: CellSettings,
           noise) -> SeedResult:
    """Train one cell: a private record spends ``epsilon``; any other trains without noise."""
    run = SeedRun(task, epsilon if record.private else None, settings.delta, guard, list(task.hospitals),
                  seed=settings.seed, noise=noise, progress=settings.progress)
    return _TRAINERS.get(record.runner)(Cell(record, run, settings))


def _known(method: str) -> ClassificationMethod | None:
    """The record of a method name, None for a name no record has (a cell written by another version)."""
    return CLASSIFICATION.get(method) if method in CLASSIFICATION else None


def _record_of(method: str) -> ClassificationMethod:
    record = _known(method)
    if record is None:
        raise UserError(f"--methods: unknown method {method!r}; expected some of {', '.join(CLASSIFICATION_METHODS)}")
    return record


@dataclass(frozen=True)
class _Outcome:
    """How a cell's training ended: its result, or the error that stopped it, and its wall time."""

    result: SeedResult | None
    error: str | None
    wall_seconds: float


def run_cell(task, method: str, epsilon: float | None, out: Path, settings: CellSettings, noise=None) -> dict:
    """One method at one ε: fresh ledger + guard in ``out``, train, write results.json.

    A method that raises does not stop the grid: its error is written into the cell.

    Args:
        task: the :class:`task.classification.tasks.ClassificationTask`; every hospital of it is a ledger owner.
        method: a registered classification method (``task.settings.methods.ClassificationMethod``).
        epsilon: the cell's budget (None = an ε-free cell: nothing is accounted).
        out: the cell's folder (ledger.jsonl, results.json). A folder already holding releases (an earlier,
            unfinished run of the cell) is refused: its ledger is never deleted or added to.
        settings: δ, seed, preset, progress and GNMax's teachers (:class:`CellSettings`).
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
    guard = BudgetGuard(ledger, epsilon if epsilon is not None else 1e-9, settings.delta)
    start = time.perf_counter()
    error, res = None, None
    try:
        res = _train(_record_of(method), task, epsilon, guard, settings, noise)
    except Exception as exc:  # one failing cell must not lose the grid; the error is written into the cell
        error = f"{type(exc).__name__}: {exc}"
        if settings.progress:
            traceback.print_exc()
    outcome = _Outcome(res, error, time.perf_counter() - start)
    if not ledger_path.exists():
        # a non-private cell has an (empty) ledger too: nothing was released; owner-only as every ledger
        atomic_write_text(ledger_path, "", private=True)
    results = _cell_results(task, method, epsilon, outcome, ledger, settings, noise)
    result = write_run(out, results)
    if settings.progress:
        acc = "n/a" if result["accuracy"] is None else f"{result['accuracy']:.3f}"
        eps = "—" if result["epsilon"] is None else f"{result['epsilon']:.3f}"
        print(f"[{method} ε={epsilon}] accuracy {acc}, ε spent {eps} ({results.accountant}), "
              f"{outcome.wall_seconds:.1f}s" + (f"  ERROR {error}" if error else ""), flush=True)
    return result


def _cell_results(task, method: str, epsilon: float | None, outcome: _Outcome, ledger: Ledger,
                  settings: CellSettings, noise) -> RunResults:
    """The cell's results record: every ε in it is the ledger's (the worst hospital's)."""
    res = outcome.result
    details = dict(res.details) if res else {}
    results = RunResults(
        method=method, accuracy=None if res is None else res.accuracy, epsilon_budget=epsilon,
        teachers=res.teachers if res else None, hospitals=len(task.hospitals),
        queries=res.queries if res else None, sigma=res.sigma if res else None,
        bytes_up_per_query_per_teacher=res.bytes_up_per_query_per_teacher if res else None,
        seed=None if noise.is_reproducible else settings.seed)
    if epsilon is not None:   # every epsilon written is the ledger's (the worst hospital's)
        results.account(ledger, settings.delta, relation=res.relation if res else None)
    else:
        results.relation = res.relation if res else None
    results.delta = settings.delta
    results.wall_seconds = outcome.wall_seconds
    results.extras = {
        "task": task.name,
        "teacher_accuracy_mean": details.get("teacher_accuracy_mean"),
        "ensemble_accuracy": details.get("ensemble_accuracy"),
        **(noise.describe() if epsilon is not None else {}), "preset": settings.preset,
        "privacy_unit": PRIVACY_UNITS[task.privacy_unit],
        "details": details, "error": outcome.error,
        "not_private_diagnostics": not_private_diagnostics(method, details),
    }
    return results


# ------------------------------------------------------------------------------------------------ the grid
def _listed(values) -> list:
    """A list, or one comma-separated string, as a list."""
    return values.split(",") if isinstance(values, str) else list(values)


def _with_reference_rows(methods: list[str]) -> list[str]:
    """The requested methods, then the reference rows the comparison adds: those run beside a requested method
    (AdLM's noise-free row beside AdLM/ILM), then those in every report (public-only)."""
    rows = list(methods)
    for record in CLASSIFICATION.where(reference=True):
        if any(m in methods for m in record.reference_for) and record.name not in rows:
            rows.append(record.name)
    for record in CLASSIFICATION.where(reference=True, always=True):
        if record.name not in rows:
            rows.append(record.name)
    return rows


@dataclass(frozen=True)
class ClassificationCompareConfig:
    """One classification comparison: every method × ε on one task; validated once, here.

    Args:
        task: ``mnist5k`` or ``slice-classification`` (``task.classification.tasks.load_task``).
        methods: method names (a list, or one comma-separated string); ``nonprivate`` is one cell. The
            reference rows (public-only always, AdLM's noise-free row beside AdLM/ILM) are added here.
        epsilons: the private cells' budgets (positive; a list, or one comma-separated string).
        out: the comparison's folder (``out/<method>/eps-<E>`` per cell, cells.csv, report.md, the plot).
        seed: the task's split (mnist5k's permutation, the slice task's world) and every method's non-private
            randomness; also the noise under ``reproducible_noise``.
        delta: δ of every cell (in (0, 1)).
        hospitals: the number of hospitals (None = 4 for mnist5k, the preset's for the slice task).
        compute: ``progress``: progress lines (:class:`task.learning.compute.Compute`; the classification tasks are small
            enough for the CPU, so its device, precision and workers are not read).
        preset: ``tiny`` or ``quick``: the training sizes (:data:`PRESET_SETTINGS`) and the slice task's world.
        data: the slice task's MSD Task01 or BraTS folder (None = the preset's phantoms; mnist5k ignores it).
        teachers_per_hospital: PATE-GNMax's teachers per hospital (None = the preset setting's).
        reproducible_noise: simulation only -- noise and private sampling seeded by ``seed`` (per cell and
            release); the seed is then left out of everything written. Default: secure noise.
    """

    task: str
    methods: Sequence[str]
    epsilons: Sequence[float]
    out: Path
    seed: int = 0
    delta: float = 1e-5
    hospitals: int | None = None
    compute: Compute = Compute()
    preset: str = "tiny"
    data: str | None = None
    teachers_per_hospital: int | None = None
    reproducible_noise: bool = False

    def __post_init__(self) -> None:
        if self.preset not in PRESET_SETTINGS:
            raise UserError(f"--preset: classification tasks support {', '.join(PRESET_SETTINGS)}, "
                            f"got {self.preset!r}")
        methods = [m.strip() for m in _listed(self.methods) if m.strip()]
        unknown = [m for m in methods if m not in CLASSIFICATION]
        if unknown:
            raise UserError(f"--methods: unknown {', '.join(unknown)}; expected some of "
                            f"{', '.join(CLASSIFICATION_METHODS)}")
        object.__setattr__(self, "methods", _with_reference_rows(methods))
        epsilons = [float(e) for e in _listed(self.epsilons)]
        if any(not (e > 0 and math.isfinite(e)) for e in epsilons):
            raise UserError(f"--epsilons: expected positive numbers, got {epsilons}")
        object.__setattr__(self, "epsilons", epsilons)
        if self.delta is None or not (0 < self.delta < 1):
            raise UserError(f"--delta: expected a number in (0, 1), got {self.delta}")
        object.__setattr__(self, "task", str(task_name(self.task)))
        object.__setattr__(self, "out", Path(self.out))
        check_compute(self.compute)

    @property
    def cell_settings(self) -> CellSettings:
        return CellSettings(self.delta, self.seed, self.preset, self.compute.progress, self.teachers_per_hospital)

    @property
    def hidden_settings(self) -> tuple[str, ...]:
        """Settings recorded as None (the seed of reproducible noise, published nowhere)."""
        return ("seed",) if self.reproducible_noise else ()


def run_classification_compare(config: ClassificationCompareConfig) -> list[dict]:
    """Run every method × ε of ``config`` on its task and write the cells, ``cells.csv``, ``report.md`` and the
    plot. Returns every finished cell's results (this run's and a resumed folder's earlier ones)."""

    logging.getLogger("absl").setLevel(logging.ERROR)   # dp_accounting's RDP order warnings drown the progress
    out = config.out
    task, settings, saved = _open_folder(config)
    noise = NoiseSource.reproducible(config.seed) if config.reproducible_noise else NoiseSource()
    summary = task.summary()
    if config.reproducible_noise:
        summary.pop("seed", None)      # the seed of reproducible noise must not appear in anything written
    if config.compute.progress:
        print(f"task {task.name}: {summary}", flush=True)
    # a resume may add methods or budgets (each cell is its own folder, with these same settings): the header and
    # the report cover every cell of the folder
    methods_all = merged(saved.get("methods"), config.methods)
    epsilons_all = merged(saved.get("epsilons"), config.epsilons)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "compare.json", {"methods": methods_all, "epsilons": epsilons_all, **settings})
    atomic_write_json(out / WORLD_FILE, describe_split(task))
    for method in config.methods:
        for epsilon in _cell_budgets(method, config.epsilons):
            path = out / method / _eps_dir(epsilon)
            if (path / "results.json").exists():      # finished: nothing is run or charged again
                continue
            set_aside_interrupted(path, counted_in=f"its own ledger, {path.name}.interrupted-*/ledger.jsonl")
            run_cell(task, method, epsilon, path, config.cell_settings, noise)
    cells = [json.loads((out / m / _eps_dir(e) / "results.json").read_text())
             for m in methods_all for e in _cell_budgets(m, epsilons_all)
             if (out / m / _eps_dir(e) / "results.json").exists()]
    write_cells_csv(cells, out / "cells.csv")
    write_report(cells, out, summary, config.delta, interrupted=interrupted_releases(out, config.delta))
    return cells


def _open_folder(config: ClassificationCompareConfig):
    """``(task, settings, saved header)``: the task loaded, once the folder's recorded settings and split (if
    it holds a run) are those of ``config`` (``sim.runners.resume``) -- checked before anything is written or
    charged."""
    out, header, hidden = config.out, config.out / "compare.json", config.hidden_settings
    saved = read_settings(header) or {}
    settings = resume_settings(config)
    if saved and "task" not in saved:   # written by a segmentation comparison before it recorded its task
        raise UserError(f"--out {out}: holds a run with other settings (--task segmentation there, {config.task} "
                        "now); resume it with the same settings, or use a new --out folder")
    refuse_other_settings(header, settings, hidden=hidden)
    task = load_task(config.task, preset=config.preset, hospitals=config.hospitals, seed=config.seed, data=config.data)
    settings["hospitals"] = len(task.hospitals)   # the number the task resolved (--hospitals or the task's default)
    refuse_other_settings(header, settings, hidden=hidden)
    saved_split = read_settings(out / WORLD_FILE)
    if saved_split is not None and saved_split != describe_split(task):
        # every other setting matched: the seed (not recorded under reproducible noise) or the data changed
        raise UserError(f"--out {out}: holds a run on another split of the private records (--seed differs, "
                        "its value unpublished under reproducible noise, or the --data folder changed); resume it "
                        "with the same settings and data, or use a new --out folder")
    return task, settings, saved


#: the split of a classification comparison (who holds how many records, and a digest of which), beside compare.json
WORLD_FILE = "world.json"


def _cell_budgets(method: str, epsilons) -> list:
    """One cell per budget for a private method; one ε-free cell for any other."""
    record = _known(method)
    return [None] if record is not None and not record.per_epsilon else list(epsilons)


def resume_settings(config: ClassificationCompareConfig) -> dict:
    """What decides a classification comparison's cells, recorded in compare.json and required to be the same
    when the folder is resumed (``sim.runners.resume``); methods and budgets may be added. The seed drives the
    noise when it is reproducible: then it is not recorded (the split in world.json still checks it)."""
    return {"task": config.task, "preset": config.preset, "delta": config.delta,
            "seed": None if config.reproducible_noise else config.seed,
            "noise": NoiseKind.REPRODUCIBLE if config.reproducible_noise else NoiseKind.SECURE,
            "data": None if config.data is None else str(config.data),
            "teachers_per_hospital": config.teachers_per_hospital}


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


#: the results record's columns (task.reporting.results), and a failed cell's error
CSV_COLUMNS = RESULT_CSV_COLUMNS + ("error",)


def write_cells_csv(cells: list[dict], path: Path) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for c in cells:
        row = {**csv_row(c), "error": c.get("error")}
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    atomic_write_text(path, buf.getvalue())


# ------------------------------------------------------------------------------------------------ the report
def _fmt(value, spec=".3f") -> str:
    return "—" if value is None else format(value, spec)


def _gnmax_note(c: dict) -> str:
    d = c.get("details") or {}
    return (f"K={c['teachers']}, σ={_fmt(c['sigma'], '.1f')}, label acc {_fmt(d.get('label_accuracy'))}; "
            f"not private: teacher acc {_fmt(d.get('teacher_accuracy_mean'))}, "
            f"ensemble {_fmt(d.get('ensemble_accuracy'))}")


def _noise_multiplier_note(c: dict) -> str:
    return f"noise multiplier {_fmt(c['sigma'], '.2f')}" if c.get("sigma") else ""


def _laplace_note(c: dict) -> str:
    d = c.get("details") or {}
    return (f"feature Laplace scale (median) {_fmt(d.get('feature_scale_median'), '.1f')}, "
            f"label scale {_fmt(d.get('label_scale'), '.1f')}")


def _noise_free_note(c: dict) -> str:
    return "NOT PRIVATE: AdLM's network, loss and optimiser with the mechanism switched off; no ε is claimed"


def _public_only_note(c: dict) -> str:
    d = c.get("details") or {}
    return (f"public labelled reference set only ({d.get('reference_records')} records); no private record "
            "read, nothing charged")


#: the note beside a cell in the report, by its record's ``report_note``
REPORT_NOTES: dict[str, Callable[[dict], str]] = {
    "gnmax": _gnmax_note, "noise-multiplier": _noise_multiplier_note, "laplace": _laplace_note,
    "noise-free": _noise_free_note, "public-only": _public_only_note}


def _note(c: dict) -> str:
    """A failed cell's error, else its record's note (empty for a record without one)."""
    if c.get("error"):
        return c["error"]
    record = _known(c["method"])
    write = REPORT_NOTES.get(record.report_note) if record is not None else None
    return write(c) if write is not None else ""


def _unit_lines(unit: PrivacyUnit) -> list[str]:
    """What every ε of the report protects, method by method."""
    lines = [f"Privacy unit: {PRIVACY_UNITS[unit]}. DP-MAC, DP-SGD: replace-one {unit}, Poisson sampling of "
             f"{unit}s, PLD accountant. AdLM/ILM: replace-one {unit}, pure ε (basic composition ε1+ε2+ε3, "
             f"independent of epochs). PATE-GNMax: replace-one {unit}, data-independent accounting of Gaussian "
             "noisy-argmax (gdp-exact). ε spent is read from each cell's ledger.jsonl. Numbers listed under "
             "`not_private_diagnostics` in a cell's results.json (GNMax's teacher and noise-free ensemble "
             "accuracies, DP-SGD's empty-batch count, dataset sizes) are simulation diagnostics that no ε covers.",
             ""]
    if unit is PrivacyUnit.PATIENT:
        lines += ["Every ε here is per patient, not per slice: DP-MAC and DP-SGD sample whole patients and clip "
                  "the sum of a patient's slice contributions (coefficients, DP-PCA second moment, gradient) to C; "
                  "AdLM/ILM take exactly k slices per patient (`records_per_unit` in results) and size every "
                  "slice's noise for ε/k; PATE-GNMax's teachers partition whole patients.", ""]
    return lines


def write_report(cells: list[dict], out: Path, task_summary: dict, delta: float,
                 interrupted: list[dict] = ()) -> None:
    unit = PrivacyUnit(task_summary.get("privacy_unit", PrivacyUnit.RECORD))
    lines = [f"# Seed systems on `{task_summary['task']}`", "", f"Task: {task_summary}", "", *_unit_lines(unit)]
    lines += ["| method | ε budget | ε spent | δ | relation | accountant | accuracy | wall s | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['method']} | {_fmt(c['epsilon_budget'], 'g')} | {_fmt(c['epsilon'])} | "
                     f"{_delta(c)} | "
                     f"{c['relation'] or '—'} | {c['accountant'] or '—'} | {_fmt(c['accuracy'])} | "
                     f"{c['wall_seconds']:.1f} | {_note(c)} |")
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
    record = _known(cell["method"])
    return "0" if record is not None and record.pure_epsilon else f"{cell['delta']:g}"


def verdicts(cells: list[dict]) -> list[str]:
    """Report lines comparing every private cell with the public-only floor: a private method is worth its
    privacy cost only where it beats the same network trained on the public labelled records alone."""
    floor_name = CLASSIFICATION.names(role=Role.FLOOR)[0]
    floor = next((c["accuracy"] for c in cells if c["method"] == floor_name and c["accuracy"] is not None), None)
    if floor is None:
        return ["", f"Verdicts: no {floor_name} accuracy (its cell failed), so no private method is compared with it."]
    lines = ["", f"## Verdicts against {floor_name} (accuracy {floor:.3f})", ""]
    for c in cells:
        if c["epsilon_budget"] is None or c["accuracy"] is None:
            continue
        gap = c["accuracy"] - floor
        verdict = f"beats {floor_name}" if gap > 0 else f"does not beat {floor_name}"
        lines.append(f"- {c['method']} at ε = {c['epsilon_budget']:g}: {c['accuracy']:.3f} ({gap:+.3f}): {verdict}")
    return lines


def _order(method: str) -> int:
    known = CLASSIFICATION.names()
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
        record = _known(m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        elif record is not None and not record.per_epsilon:   # one ε-free cell: a horizontal line
            acc = next((c["accuracy"] for c in cells if c["method"] == m and c["accuracy"] is not None), None)
            if acc is not None:
                colour, style = record.plot_style
                ax.axhline(acc, color=colour, linestyle=style, label=m)
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
