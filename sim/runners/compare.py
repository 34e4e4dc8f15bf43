"""``fedpate compare``: every method x epsilon (x K) on the same world, then one report.

Cells and where they run:
- ``pate-ae``, ``pate-pca``, ``pate-naive``, ``dp-fedavg``: one Flower simulation per teacher count K,
  running all of that K's cells in sequence (sim/runners/simulation.py). Teachers are trained once per K
  and reused across epsilon: they do not depend on it (PATE spends its budget at query time).
- ``dp-sgd-central``, ``nonprivate-central``: pooled training (sim/runners/central.py).
- ``public-only``: the student trained only on the public labelled reference set -- the honest baseline PATE must
  beat; ``public-selftrain`` (sim/runners/selftrain.py): the public model self-trained on the public unlabelled query
  scans -- a floor that uses all public data (docs/PRIVACY.md, "What limits PATE").

Resumable: a cell whose results.json exists is skipped; a cell interrupted after it had released
something (a ledger but no results) is kept aside as ``<cell>.interrupted-<time>`` and run again -- its
releases stay counted. A folder is resumed only with the settings compare.json records (seed, preset, δ, data,
world, noise, ...; :func:`resume_settings`, ``sim.runners.resume``): anything else is refused before anything
is written, so one header never covers cells of two runs; methods and budgets may be added. Every cell writes
results.json, ledger.jsonl and a model bundle; the report re-checks each epsilon against its ledger.

Releases add up (docs/PRIVACY.md, "The ledger"): the cells share the hospitals' patients, so every cell that touches
them also charges each hospital's own ledger, ``hospital-ledgers/<hospital>.jsonl``, persistent across
the cells and across resumes, under a lifetime budget per hospital (``lifetime_epsilon``; default: the
sum of the private cells' budgets). The report and every model card state the combined ε of everything
the comparison released together, from those ledgers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from privacy.accountants import epsilon_spent, gdp_epsilon, gdp_mu_for, zcdp_epsilon, zcdp_rho_for
from privacy.errors import BudgetExceeded, PrivacyError
from privacy.ledger import Ledger
from task.reporting.bundle import attach_release, load_bundle
from task.learning.compute import Compute, check_compute
from task.learning.device import resolve_device
from task.errors import UserError
from task.io import atomic_write_json, writing_folder
from task.settings import methods as registry
from task.settings.methods import Role
from task.options import AUTO, Engine, Init, NoiseKind, look_up_option
from task.reporting import realcheck
from task.settings.presets import Preset, get_preset, preset_reference
from sim.report import WORLD_FILE, load_cells, plot_overlays, write_report
from task.settings.runconfig import Cell, RunSettings, check_epsilon
from sim.runners.cells import CompareContext, cell_runner, shared_public_models
from sim.runners.inprocess import InProcessTransport, simulated_hospitals
from sim.runners.resume import merged, read_settings, refuse_other_settings, refuse_other_world
from sim.runners.resume import set_aside_interrupted  # noqa: F401  (re-exported: cells set aside here)
from sim.runners.simulation import simulate
from task.learning.training import predict_probs
from task.world import build_world, describe_world, load_world, materialise_world, open_world



def parse_list(text: str, kind, option: str) -> list:
    try:
        values = [kind(item) for item in str(text).split(",") if item.strip()]
    except ValueError as exc:
        said = str(exc)   # an item parser that names the option says what it expected
        raise UserError(said if said.startswith(option) else
                        f"{option}: expected a comma-separated list, got {text!r}") from None
    if not values:
        raise UserError(f"{option}: empty list")
    return values


@dataclass(frozen=True)
class CompareConfig:
    """One comparison's plan: every method x epsilon (x K) on one world; validated once, here.

    Args:
        preset: the preset: a registered name, a variant's :attr:`task.settings.presets.Preset.reference`, or a
            :class:`task.settings.presets.Preset` (kept as its reference, which every cell and worker rebuilds it from).
        methods: registered method names (``task.settings.methods``).
        epsilons: the private cells' budgets (each checked by ``task.settings.runconfig.check_epsilon``).
        out: the comparison's folder (cells, hospital ledgers, report).
        seed: the world's split, public model and training; the noise only under ``reproducible_noise``.
        data: an MSD Task01 or BraTS folder (None = the embedded phantoms); ``layout`` (None = detected) and
            ``partition_file`` (a FeTS partition CSV whose partitions are the hospitals, ``task.world``) shape
            its world; every cell sees the same world.
        delta: δ of every private cell (None = the preset's).
        hospitals: the number of hospitals (None = the preset's, or the partition file's partitions).
        teachers_per_hospital: the K sweep (None = the preset's one K); methods that do not sweep K run at
            the first.
        engine: ``inprocess`` (default; the same protocol code as the Flower apps, torch on every core) or
            ``flower`` (Flower's simulation engine).
        reproducible_noise: simulation only -- every cell's noise seeded by ``seed``, which is then published
            nowhere.
        lifetime_epsilon: each hospital's lifetime budget over the comparison (None = the sum of the private
            cells' budgets, :func:`planned_lifetime_epsilon`).
        init: where DP-SGD, DP-FedAvg and non-private training start -- ``public`` (the public model PATE's
            teachers and student start from; one checkpoint shared by every cell) or ``scratch``.
        ledger_dir: the hospitals' own lifetime ledgers every private cell charges (None =
            ``out/hospital-ledgers``); :func:`run_compare_seeds` points every seed at one folder.
        compute: every cell's device and precision, passed on as a spec (each party resolves it where it runs),
            progress bars, and ``workers``: how many cells run at once, each group of cells in its own process with
            its share of the cores (:func:`run_in_workers`; 1 = every cell in this process, in sequence;
            :func:`default_workers`).
        lane: internal -- this run is one worker's share of a comparison: it runs its methods' cells and
            writes neither compare.json, world.json nor a report (its parent does).
        real_check: folders of labelled real cases (``--real-check``, each ``[KIND=]DIR``): every model a cell
            releases is also scored on them (``task.reporting.realcheck``); checked here, before anything trains. Not a resume setting: a
            resumed folder may add or change them (cells scored before keep what they were scored on).
    """

    preset: str | Preset
    methods: Sequence[str]
    epsilons: Sequence[float]
    out: Path
    seed: int = 0
    data: str | None = None
    delta: float | None = None
    hospitals: int | None = None
    teachers_per_hospital: Sequence[int] | None = None
    engine: str = Engine.INPROCESS
    reproducible_noise: bool = False
    lifetime_epsilon: float | None = None
    init: str = Init.PUBLIC
    ledger_dir: Path | None = None
    layout: str | None = None
    partition_file: str | None = None
    compute: Compute = Compute()
    lane: bool = False
    real_check: Sequence[str] = ()
    #: the secure methods' threat model as RunSettings' fields (``secure_colluders``, ``secure_dropouts``,
    #: ``secure_threshold``); empty = none colluding, no dropout, the smallest threshold
    threat: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # a variant travels to the cells, workers and Flower's run config as its reference (task.settings.presets)
        object.__setattr__(self, "preset", preset_reference(self.preset))
        object.__setattr__(self, "init", look_up_option(self.init, Init, "--init"))
        object.__setattr__(self, "engine", look_up_option(self.engine, Engine, "--engine"))
        check_compute(self.compute)
        if self.compute.workers > 1 and self.engine is not Engine.INPROCESS:
            raise UserError(f"--workers {self.compute.workers}: cells run in worker processes with --engine inprocess "
                            "only (Flower's simulation engine schedules its own processes); use --workers 1")
        known = registry.names()
        unknown = [m for m in self.methods if m not in known]
        if unknown:
            raise UserError(f"--methods: unknown {unknown}; expected some of {', '.join(known)}")
        hospitals = self.hospitals
        if self.partition_file and hospitals is None:   # every partition is a hospital (task.data.fets)
            from task.data.fets import count_partitions

            hospitals = count_partitions(self.partition_file)
        fields = {"methods": tuple(self.methods),
                  # the one place a comparison's budgets are checked
                  "epsilons": tuple(check_epsilon(e) for e in self.epsilons),
                  "out": Path(self.out), "hospitals": hospitals,
                  "teachers_per_hospital": tuple(self.teachers_per_hospital) if self.teachers_per_hospital else None,
                  "ledger_dir": Path(self.ledger_dir) if self.ledger_dir is not None else None,
                  "real_check": tuple(str(folder) for folder in (self.real_check or ()))}
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        if set(self.methods) & set(registry.names(secure_sum=True)):   # a threat model its hospitals cannot hold
            from task.wire.secagg import check_secure_settings

            threat = dict(self.threat)
            check_secure_settings(self.base_preset.hospitals, threat.get("secure_colluders", 0),
                                  threat.get("secure_dropouts", 0), threat.get("secure_threshold"))
        self.real_cases   # a bad --real-check folder is refused now, before anything trains

    @functools.cached_property
    def real_cases(self):
        """The :class:`task.reporting.realcheck.RealCheck` of ``real_check`` (None without folders)."""
        return realcheck.open_check(self.real_check, read=not self.lane)   # a worker's parent read every file

    @property
    def where(self) -> dict:
        """The data folder's layout and partition file (build_world's options)."""
        return {"layout": self.layout, "partition_file": self.partition_file}

    # resolved once per plan (cached on the frozen object; dataclasses.replace makes a new plan)
    @functools.cached_property
    def base_preset(self):
        return get_preset(self.preset, hospitals=self.hospitals)

    @functools.cached_property
    def teacher_sweep(self) -> list[int]:
        return list(self.teachers_per_hospital or [self.base_preset.teachers_per_hospital])

    @property
    def resolved_delta(self) -> float:
        return self.base_preset.delta if self.delta is None else self.delta

    @functools.cached_property
    def federations(self) -> list:
        """The federation spec of every K of the sweep: the preset with this comparison's hospitals x that K's
        teachers per hospital (the first is the world every baseline uses)."""
        return [get_preset(self.preset, hospitals=self.hospitals, teachers_per_hospital=k) for k in self.teacher_sweep]


def refuse_unreadable_ledgers(ledger_dir: Path, out: Path) -> None:
    """Every ledger a resumed comparison would charge or account (the hospitals' own, every cell's), read before
    anything runs: a corrupt line (an edit, a disk error) is one line naming the file and the line and what to do,
    instead of a traceback from every worker that opens it and advice to resume that fails the same way."""
    for path in [*sorted(Path(ledger_dir).glob("*.jsonl")), *sorted(out.glob("**/ledger.jsonl"))]:
        try:
            Ledger.load(path, read_only=True)
        except PrivacyError as exc:
            raise UserError(f"{exc} -- nothing was run: what was spent from those patients cannot be known; restore "
                            f"{path.name} from a backup (a ledger line is never edited by hand), or start a new --out "
                            "(its releases still count against those patients)") from None


def cell_dir(out: Path, method: str, epsilon: float | None = None, teachers: int | None = None) -> Path:
    path = out / method
    if epsilon is not None:
        path = path / f"eps-{epsilon:g}"
    if teachers is not None:
        path = path / f"K-{teachers}"
    return path


def run_compare(config: CompareConfig) -> Path:
    """:func:`compare_in_folder` with ``config.out`` held for this run (``task.io.writing_folder``): a second
    comparison started on the same folder is refused in one line before it reads or writes there. A worker of this
    comparison (``lane``) runs inside its parent's hold."""
    if config.lane:
        return compare_in_folder(config)
    config.out.mkdir(parents=True, exist_ok=True)
    with writing_folder(config.out):
        return compare_in_folder(config)


def compare_in_folder(config: CompareConfig) -> Path:
    """Every method x epsilon (x K) on one world (``config``, :class:`CompareConfig`); returns the report's path.

    Federated methods run one simulation per K (all of that K's cells in sequence); every other method runs
    through its record's cell runner (``sim.runners.cells``); with ``config.compute.workers`` > 1 the cells are spread
    over that many processes (:func:`run_in_workers`); then the overlays, the combined release and the
    report. A GPU asked for and missing is refused here, before any cell starts.
    """
    resolve_device(config.compute.device)
    if not config.lane and (config.out / "compare-seeds.json").exists():
        raise UserError(f"--out {config.out}: holds a comparison over several seeds; resume it with its --seeds, "
                        "or use a new --out folder")
    preset_name, methods, epsilons = config.preset, config.methods, config.epsilons
    seed, data, hospitals, where = config.seed, config.data, config.hospitals, config.where
    device, engine = config.compute.device, config.engine
    progress, reproducible_noise = config.compute.progress, config.reproducible_noise
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    base = config.base_preset
    delta = config.resolved_delta
    sweep = config.teacher_sweep
    started = time.perf_counter()
    ledger_dir = config.ledger_dir if config.ledger_dir is not None else out / HOSPITAL_LEDGERS
    if config.lane:   # a worker of this comparison: its parent checked the folder and planned the lifetime
        _run_cells(config, float(config.lifetime_epsilon or
                                 planned_lifetime_epsilon(methods, epsilons, len(sweep), delta=delta)), ledger_dir)
        return out
    # a folder is resumed only with the settings it was started with (sim.runners.resume), checked before
    # anything is written or charged; who holds what in this comparison's world: the split of the first K
    saved = read_settings(out / "compare.json") or {}
    refuse_other_settings(out / "compare.json", resume_settings(config))
    refuse_unreadable_ledgers(ledger_dir, out)
    prepared, split = build_world(config.federations[0], data, seed, progress, **where)
    world = describe_world(prepared, split)
    refuse_other_world(out / WORLD_FILE, world)
    # a resume may add methods or budgets (each cell is its own folder, with these same settings): the header and
    # the planned lifetime budget cover every cell of the folder
    methods_all, epsilons_all = merged(saved.get("methods"), list(methods)), merged(saved.get("epsilons"), list(epsilons))
    lifetime = float(config.lifetime_epsilon or
                     planned_lifetime_epsilon(methods_all, epsilons_all, len(sweep), delta=delta))
    atomic_write_json(out / "compare.json", {"methods": methods_all, "epsilons": epsilons_all,
                                             **resume_settings(config), "lifetime_epsilon": lifetime,
                                             "hospital_ledgers": os.path.relpath(ledger_dir, out),
                                             "real_check": list(config.real_check)})
    atomic_write_json(out / WORLD_FILE, world)
    realcheck.prepare_cases(config.real_cases, getattr(prepared, "config", None))   # once, before the cells
    if ledger_dir == out / HOSPITAL_LEDGERS:   # run_compare_seeds states the budget of all seeds itself
        print(f"compare: each hospital's lifetime budget over this comparison: epsilon {lifetime:g} "
              f"({'--lifetime-epsilon' if config.lifetime_epsilon else 'the sum of the private cells budgets'})", flush=True)
    # every model a cell releases is scored on the real cases (config.real_cases, handed to each cell's run)
    if config.compute.workers > 1:
        worlds = run_in_workers(config, lifetime, ledger_dir)
    else:
        worlds = _run_cells(config, lifetime, ledger_dir)
    first_k = min(worlds) if worlds else None

    # --- report --------------------------------------------------------------------------------------
    # every bundle first states what it was released with: the overlays load the bundles, and loading checks that
    # statement against the hospitals' ledgers, which cells added to a resumed comparison have just charged
    release = combined_release(out, delta, ledger_dir=ledger_dir)
    attach_release_everywhere(out, release)
    overlays = []
    try:
        overlay = plot_comparison_overlays(out, worlds.get(first_k) if first_k else None, preset_name, seed,
                                           hospitals, sweep[0], device=str(device))
        if overlay is not None:
            overlays.append(overlay)
    except Exception as exc:  # a plot must never lose the finished cells' report
        print(f"compare: overlay plot skipped ({exc.__class__.__name__}: {exc})")
    title = f"fedpate comparison — preset {preset_name}"
    settings = {"preset": preset_name, "hospitals": base.hospitals, "teachers per hospital": ",".join(map(str, sweep)),
                "δ": delta, "seed": "—" if reproducible_noise else seed, "start model": base.public_start,
                "engine": engine, "workers": config.compute.workers,
                "wall minutes": round((time.perf_counter() - started) / 60, 1)}
    # kept so that a multi-seed comparison can restate this seed's report with everything released after it
    atomic_write_json(out / REPORT_SETTINGS, {"title": title, "settings": settings,
                                              "overlays": [str(Path(o).relative_to(out)) for o in overlays]})
    return write_report(out, title, settings=settings, overlays=overlays, release=release)


def resume_settings(config: CompareConfig) -> dict[str, Any]:
    """What decides a comparison's cells, recorded in compare.json and required to be the same when the folder
    is resumed (``sim.runners.resume``). Methods and budgets may be added (each cell is its own folder); the
    device and the number of workers may change (each cell records its device). A multi-seed comparison's
    seeds share their parent's lifetime budget, which its own compare-seeds.json records."""
    settings = {"task": "segmentation", "preset": config.preset, "delta": config.resolved_delta,
                # the seed drives the noise when it is reproducible: not published (world.json's split checks it)
                "seed": None if config.reproducible_noise else config.seed,
                "noise": NoiseKind.REPRODUCIBLE if config.reproducible_noise else NoiseKind.SECURE,
                "hospitals": config.base_preset.hospitals, "teachers_per_hospital": config.teacher_sweep,
                "data": config.data, **config.where, "engine": config.engine, "init": config.init,
                "precision": config.compute.precision}
    if config.ledger_dir is None:
        settings["lifetime_epsilon_given"] = config.lifetime_epsilon
    if any(config.threat.values()):   # only when given: folders started before it existed resume as they were
        settings["threat_model"] = dict(config.threat)
    return settings


def _planned_cells(config: CompareConfig, record) -> list[tuple[int, float | None, int | None, Path]]:
    """``(K index, epsilon, teachers, folder)`` of every cell of ``record`` in this comparison: federated methods
    without teachers run at the first K only; a K sweep names the K in the folder of methods with teachers."""
    sweeping = len(config.teacher_sweep) > 1
    planned = []
    for index, preset in enumerate(config.federations):
        if not (record.federated and record.sweeps_k) and index > 0:
            continue
        teachers = preset.teachers if sweeping and record.sweeps_k else None
        for epsilon in (config.epsilons if record.per_epsilon else [None]):
            planned.append((index, epsilon, teachers, cell_dir(config.out, record.name, epsilon, teachers)))
    return planned


def _cell_done(path: Path) -> bool:
    """A cell whose results.json exists is done; one interrupted after releasing is set aside first."""
    if (path / "results.json").exists():
        return True
    set_aside_interrupted(path)
    return False


def _run_cells(config: CompareConfig, lifetime: float, ledger_dir: Path) -> dict[int, str]:
    """Every not yet finished cell of ``config``'s methods, in this process, in sequence; returns each K's
    materialised world. Federated cells: one simulation per K; every other cell through its record's runner."""
    out, seed, data, init = config.out, config.seed, config.data, config.init
    federations = config.federations
    first = federations[0]
    chosen = [registry.method(m) for m in config.methods]
    # --- federated cells: one Flower simulation per K -------------------------------------------------
    worlds: dict[int, str] = {}
    for index, (per_hospital, preset) in enumerate(zip(config.teacher_sweep, federations)):
        cells = []
        for record in chosen:
            if not record.federated:
                continue
            # a method without teachers shares the first K's public model (the one every baseline uses)
            shared = out / "_shared" / f"K-{(preset if record.sweeps_k else first).teachers}"
            cells += [Cell(record.name, epsilon, str(path), init=init, shared_dir=str(shared), teachers=teachers)
                      for k_index, epsilon, teachers, path in _planned_cells(config, record)
                      if k_index == index and not _cell_done(path)]
        worlds[preset.teachers] = str(materialise_world(preset, data, seed, config.compute.progress, **config.where))
        # the settings every cell of this K shares; each cell names its own method (RunSettings needs one)
        settings = RunSettings(method=cells[0].method if cells else registry.names(federated=True)[0],
                               preset=config.preset, delta=config.resolved_delta, seed=seed, data=data,
                               hospitals=config.hospitals, teachers_per_hospital=per_hospital,
                               out=str(out / "_shared"), world=worlds[preset.teachers],
                               reproducible_noise=config.reproducible_noise, ledger_dir=str(ledger_dir),
                               lifetime_epsilon=lifetime, layout=config.layout, partition_file=config.partition_file,
                               compute=config.compute, **dict(config.threat), real_check=config.real_cases)
        if cells:
            print(f"compare: {len(cells)} federated cell(s) at K = {preset.teachers} "
                  f"({preset.hospitals} hospitals x {per_hospital} teachers)", flush=True)
            simulate(settings, engine=config.engine, cells=cells)

    # --- every other cell, in this process, through its record's runner (sim.runners.cells) ---------------
    context = _cell_context(config, lifetime, ledger_dir)
    # the references first (as before the registry): the ceiling, then the private ones, then the floors
    order = {Role.CEILING: 0, Role.PRIVATE: 1, Role.FLOOR: 2}
    for record in sorted((r for r in chosen if not r.federated), key=lambda r: order[r.role]):
        for _, epsilon, _, path in _planned_cells(config, record):
            if _cell_done(path):
                continue
            try:
                cell_runner(record.runner)(context, Cell(record.name, epsilon, str(path), init=init,
                                                         shared_dir=str(context.shared_dir)))
            except BudgetExceeded as exc:   # a hospital's lifetime budget has no room for this cell
                print(f"compare: {path.relative_to(out)} not run: {exc}", flush=True)
    return worlds


def _cell_context(config: CompareConfig, lifetime: float, ledger_dir: Path) -> CompareContext:
    """What every non-federated cell runner shares: the first K's world, public model checkpoint and ledgers."""
    first = config.federations[0]
    return CompareContext(preset_name=config.preset, preset=first, data=config.data, seed=config.seed,
                          delta=config.resolved_delta, hospitals=config.hospitals, ledger_dir=ledger_dir,
                          lifetime_epsilon=lifetime,
                          public_checkpoint=config.out / "_shared" / f"K-{first.teachers}" / "public-model.pt",
                          reproducible_noise=config.reproducible_noise, compute=config.compute,
                          where=config.where, real_check=config.real_cases)


def parse_workers(text: str | int | None, engine: str, device: str) -> int:
    """``--workers``: a whole number >= 1, or ``auto`` (:func:`default_workers`)."""
    if text is None or str(text).strip().lower() == AUTO:
        return default_workers(engine, device)
    try:
        workers = int(str(text))
    except ValueError:
        workers = 0
    if workers < 1:
        raise UserError(f"--workers: expected a whole number >= 1 or auto, got {text!r}")
    return workers


#: what one cell may hold on a GPU, an allowance: the largest thing a cell holds is the paper preset's DP-SGD step
#: (64^3 scans at expected batch 16, Poisson batches up to about twice that; about 60 MiB of activations per scan
#: forward, several times that kept for the per-sample backward; per-sample gradients of 2.45 M weights), plus a
#: CUDA context and the cuDNN workspace
GPU_BYTES_PER_CELL = 8 * 2 ** 30
#: at most this many cells share one GPU: enough for one cell's host phases (queries, encoding, decoding,
#: accounting) to overlap another's kernels; more processes only time-slice the same device
MAX_CELLS_PER_GPU = 4


def default_workers(engine: str, device: str) -> int:
    """How many cells a comparison runs at once when not told (the in-process engine only; Flower's engine
    schedules its own processes: one).

    On a CPU with at least two cores: two. Why: the quick preset's 32^3 U-Net does not scale over two torch
    threads (one training step: 75 ms on one thread, 54 ms on two, 70-74 ms each when two one-thread processes
    run side by side -- 1.5 times the throughput), and much of a cell is single-threaded Python and host
    augmentation. On a GPU: as many as its free memory holds at :data:`GPU_BYTES_PER_CELL` each, at most
    :data:`MAX_CELLS_PER_GPU` and one per two host cores -- a cell alone leaves the GPU idle through its host
    phases (measured on an H100: busy 0-22 % of the quick demo), which another cell's kernels fill."""
    cores = os.cpu_count() or 1
    if engine != Engine.INPROCESS or cores < 2:
        return 1
    where = resolve_device(device)
    if where.type == "cpu":
        return 2
    if where.type != "cuda":
        return 1
    import torch

    free, _ = torch.cuda.mem_get_info(where)
    return int(max(1, min(cores // 2, MAX_CELLS_PER_GPU, free // GPU_BYTES_PER_CELL)))


#: a PATE method's first cell at a K also trains that K's teachers (quick preset, one-thread worker, fresh-clone
#: demo on 2026-11-28 after the profiled speed-ups: the epsilon-1 cell took 408 s, the epsilon-8 cell 266 s)
TEACHER_TRAINING_SECONDS = 142.0


def _work_units(config: CompareConfig) -> list[tuple[tuple[str, ...], float]]:
    """The comparison's unfinished work as ``(methods, estimated seconds)`` units that may run side by side.
    Methods with teachers form one unit (they share the hospitals' trained teachers on disk, trained by
    whichever cell comes first); every other method is a unit of its own."""
    teachers, units = [], []
    for record in map(registry.method, config.methods):
        pending = [path for *_, path in _planned_cells(config, record) if not (path / "results.json").exists()]
        if not pending:
            continue
        seconds = len(pending) * record.cell_seconds
        if record.federated and record.sweeps_k:
            teachers.append((record.name, seconds))
        else:
            units.append(((record.name,), seconds))
    if teachers:
        units.append((tuple(name for name, _ in teachers),
                      sum(seconds for _, seconds in teachers) + TEACHER_TRAINING_SECONDS * len(config.teacher_sweep)))
    return units


def spread_over_workers(units: Sequence[tuple[tuple[str, ...], float]], workers: int) -> list[list[str]]:
    """Longest unit first, each onto the least loaded worker (Graham's LPT rule: within 4/3 of the best
    makespan); returns each non-empty worker's methods in the comparison's order within its units."""
    loads = [[0.0, []] for _ in range(max(1, int(workers)))]
    for names, seconds in sorted(units, key=lambda unit: -unit[1]):
        lightest = min(loads, key=lambda load: load[0])
        lightest[0] += seconds
        lightest[1].extend(names)
    return [names for _, names in loads if names]


def run_in_workers(config: CompareConfig, lifetime: float, ledger_dir: Path) -> dict[int, str]:
    """Run the comparison's cells in ``config.compute.workers`` processes at once (so the demo fits in 15 min on
    two cores); returns each K's materialised world.

    This process first materialises every K's world and trains what every worker would otherwise train
    concurrently -- the first K's public model and its public-only schedule (:func:`prepare_public_models`) --
    then starts one process per group of methods (:func:`spread_over_workers`), each a
    ``run_compare(lane=True)`` on the same folder with ``cpu_count // workers`` torch threads, and shows one
    progress bar over every cell's results.json. Each cell is exactly the cell ``--workers 1`` runs (same
    world, public model, settings, seeds and ledgers; floating-point sums may differ in the last bits with
    another thread count). Privacy: the workers charge the same hospital ledgers; every charge checks and
    records under the ledger file's exclusive lock, re-read inside it (``privacy.ledger.Ledger.exclusive``),
    so two workers cannot both spend the last of a hospital's budget. A failed worker leaves its finished
    cells; the same command resumes the rest. The workers are fresh interpreters: they know the methods
    registered on import (``task.settings.methods.BUILTIN_METHODS``), so a comparison with a method a script registered
    at run time runs every cell in this process.
    """
    import multiprocessing

    worlds = {preset.teachers: str(materialise_world(preset, config.data, config.seed, config.compute.progress,
                                                     **config.where))
              for preset in config.federations}
    lanes = spread_over_workers(_work_units(config), config.compute.workers)
    runtime_registered = [m for m in config.methods if m not in registry.BUILTIN_METHODS]
    if runtime_registered:
        print(f"compare: {', '.join(runtime_registered)} registered at run time, unknown to worker processes: "
              "every cell runs in this process", flush=True)
    if len(lanes) <= 1 or runtime_registered:
        _run_cells(config, lifetime, ledger_dir)
        return worlds
    prepare_public_models(_cell_context(config, lifetime, ledger_dir))
    threads = max(1, (os.cpu_count() or 1) // len(lanes))
    planned = [path for record in map(registry.method, config.methods) for *_, path in _planned_cells(config, record)]
    print(f"compare: {len(lanes)} workers x {threads} torch thread(s): "
          + "; ".join(", ".join(lane) for lane in lanes), flush=True)
    spawn = multiprocessing.get_context("spawn")   # no forked torch / OpenMP state
    processes = [spawn.Process(target=_run_lane, name=f"fedpate-worker-{i}",
                               args=(dataclasses.replace(config, methods=tuple(lane), lane=True,
                                                         compute=config.compute.replace(workers=1, progress=False),
                                                         lifetime_epsilon=lifetime,
                                                         ledger_dir=ledger_dir, delta=config.resolved_delta),
                                     threads))
                 for i, lane in enumerate(lanes)]
    # A Ctrl-C reaches every process of the terminal's group. Each worker starts with SIGINT blocked (the mask
    # is inherited) and unblocks it once its lane runs (_run_lane), so an interrupt while it is still importing
    # ends it there, quietly, instead of as a traceback from the interpreter's start-up.
    masking = hasattr(signal, "pthread_sigmask")   # POSIX
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if masking else None
    try:
        for process in processes:
            process.start()
    finally:
        if masking:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    bar = _cells_bar(len(planned)) if config.compute.progress else None
    try:
        while any(process.is_alive() for process in processes):
            if bar is not None:
                bar.update(sum((path / "results.json").exists() for path in planned) - bar.n)
            time.sleep(2.0)
    except KeyboardInterrupt:   # the command line prints one line: interrupted, finished cells kept, resumable
        stop_workers(processes)
        raise
    finally:
        for process in processes:
            process.join()
        if bar is not None:
            bar.update(sum((path / "results.json").exists() for path in planned) - bar.n)
            bar.close()
    failed = [f"{p.name} ({', '.join(lane)}): exit {p.exitcode}" for p, lane in zip(processes, lanes) if p.exitcode]
    if failed:
        # exit 2: the worker said why in one line above (a setting or file to fix first); resuming alone repeats it
        told = any(p.exitcode == 2 for p in processes)
        raise UserError(f"compare: worker(s) failed -- {'; '.join(failed)}; finished cells are kept: "
                        + ("fix what the worker's error above says, then run the same command again to resume"
                           if told else "run the same command again to resume"))
    return worlds


def stop_workers(processes, grace: float = 5.0, interrupt_wait: float = 30.0) -> None:
    """After the parent was interrupted: give the workers ``grace`` seconds to end on the same Ctrl-C (a
    terminal sends it to the whole process group), interrupt those still running (the parent alone was
    signalled), and terminate any still alive ``interrupt_wait`` seconds later. A worker stopped mid-cell
    leaves that cell unfinished (no results.json), and the ledgers whole (each charge is one locked,
    fsynced append), so the same command resumes it."""
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive() and process.pid is not None:
            try:
                os.kill(process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + interrupt_wait
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join()


def _run_lane(config: CompareConfig, threads: int) -> None:
    try:
        if hasattr(signal, "pthread_sigmask"):   # blocked while starting (run_in_workers)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        import torch

        torch.set_num_threads(int(threads))
        run_compare(config)
    except (UserError, PrivacyError) as exc:   # one line, as the command line would print it; the parent names
        print(f"error: {exc}", flush=True)      # the worker
        raise SystemExit(2) from None
    except KeyboardInterrupt:   # quiet: the parent says once that the run was interrupted and can be resumed
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(130) from None


def _cells_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="compare cells", unit="cell")


def prepare_public_models(context: CompareContext) -> None:
    """Train (or load) the first K's public model and its public-only schedule at their shared checkpoints, so
    that concurrent workers load them instead of each training them (``sim.runners.cells.shared_public_models``)."""
    world = load_world(*build_world(context.preset, context.data, context.seed, context.compute.progress,
                                    **context.where))
    shared_public_models(world, context.preset, context.seed, context.shared_dir, context.compute)


#: a single-seed comparison's report title, settings and overlays (rewritten by run_compare_seeds at the end)
REPORT_SETTINGS = "report-settings.json"
#: a multi-seed comparison's per-seed folders: ``seed-<S>``
SEED_FOLDER = "seed-{}"


def attach_release_everywhere(root: Path, release: dict) -> None:
    """Every model bundle below ``root`` states what it was released with (the combined ε, ledger digests)."""
    for cell in sorted(Path(root).rglob("results.json")):
        if (cell.parent / "model" / "bundle.json").exists():
            attach_release(cell.parent, release)


def run_compare_seeds(config: CompareConfig, seeds: Sequence[int]) -> Path:
    """The grid once per seed: each seed its own world split, public model, training and cells, in
    ``out/seed-<S>/`` (a complete single-seed comparison with its own report), then one report at ``out``
    that aggregates across seeds (``sim.report_seeds``). One seed: exactly :func:`run_compare` on ``out``.
    ``config.seed`` is ignored: ``seeds`` say which.

    Privacy (releases add up; docs/PRIVACY.md, "The ledger"): the seeds split the *same* patients (one phantom world,
    ``task.world.PHANTOM_SEED``), so every seed's cells charge the same per-hospital ledgers,
    ``out/hospital-ledgers/<hospital>.jsonl``, under one lifetime budget planned over every seed's cells
    (:func:`planned_lifetime_epsilon` with ``seeds``); a cell that would exceed it is refused before it
    touches private data. The combined ε stated at the end, in every report and every model card, is
    composed from those ledgers; where a patient sat at different hospitals in different seeds (a split
    scheme that moves patients), it composes every ledger that patient was charged in
    (:func:`patient_homes`, :func:`combined_release`).
    """
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds: expected distinct seeds, got {seeds}")
    if len(seeds) == 1:
        return run_compare(dataclasses.replace(config, seed=seeds[0]))
    if config.reproducible_noise:   # each seed would drive its own noise, and the seed folders name them
        raise UserError("--reproducible-noise: takes one seed (the seed drives the noise and is never published); "
                        "several --seeds would publish them in the folder names")
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    with writing_folder(out):   # each seed's run_compare holds its own seed-<S> folder inside
        return _compare_seeds_in_folder(config, seeds)


def _compare_seeds_in_folder(config: CompareConfig, seeds: list[int]) -> Path:
    out = config.out
    if (out / "compare.json").exists():
        raise UserError(f"--out {out}: holds a single-seed comparison; several --seeds need a new --out folder")
    preset_name, methods, epsilons = config.preset, config.methods, config.epsilons
    base = config.base_preset
    delta = config.resolved_delta
    sweep = config.teacher_sweep
    ledger_dir = out / HOSPITAL_LEDGERS
    # resumed only with the same settings (each seed's folder checks its own too); seeds, methods and budgets may
    # be added, and the planned lifetime budget covers every seed and cell of the folder
    settings = {k: v for k, v in resume_settings(config).items() if k != "seed"}
    saved = read_settings(out / "compare-seeds.json") or {}
    refuse_other_settings(out / "compare-seeds.json", settings)
    methods_all, epsilons_all = merged(saved.get("methods"), list(methods)), merged(saved.get("epsilons"), list(epsilons))
    seeds_all = merged(saved.get("seeds"), seeds)
    lifetime = float(config.lifetime_epsilon or
                     planned_lifetime_epsilon(methods_all, epsilons_all, len(sweep), seeds=len(seeds_all),
                                              delta=delta))
    started = time.perf_counter()
    atomic_write_json(out / "compare-seeds.json", {"methods": methods_all, "epsilons": epsilons_all,
                                                   "seeds": seeds_all, **settings, "lifetime_epsilon": lifetime,
                                                   "hospital_ledgers": f"{HOSPITAL_LEDGERS}/",
                                                   "real_check": list(config.real_check)})
    print(f"compare: {len(seeds)} seeds; each hospital's lifetime budget over every seed's cells: epsilon "
          f"{lifetime:g} ({'--lifetime-epsilon' if config.lifetime_epsilon else 'the sum of the private cells budgets over all seeds'})",
          flush=True)
    for seed in seeds:
        print(f"compare: seed {seed}", flush=True)
        run_compare(dataclasses.replace(config, seed=seed, out=out / SEED_FOLDER.format(seed), delta=delta,
                                        lifetime_epsilon=lifetime, ledger_dir=ledger_dir))
    homes = patient_homes(config.federations[0], config.data, seeds, **config.where)
    release = combined_release(out, delta, homes=homes)
    if release.get("patients_moving_between_hospitals"):
        print(f"compare: {release['patients_moving_between_hospitals']} patient(s) sat at different hospitals in "
              "different seeds; no single hospital's guard saw all their releases: the combined epsilon composes "
              f"every ledger they were charged in ({release.get('combined_epsilon_moving_patients'):.3g})", flush=True)
    # every seed's bundles and report state everything released together, the later seeds' cells included
    attach_release_everywhere(out, release)
    for seed in seeds:
        folder = out / SEED_FOLDER.format(seed)
        saved = json.loads((folder / REPORT_SETTINGS).read_text())
        write_report(folder, saved["title"], settings=saved["settings"],
                     overlays=[folder / o for o in saved["overlays"]],
                     release={**release, "hospital_ledgers": os.path.relpath(ledger_dir, folder) + "/"})
    from sim.report_seeds import write_seeds_report

    return write_seeds_report(out, f"fedpate comparison over seeds {', '.join(map(str, seeds))} — preset {preset_name}",
                              settings={"preset": preset_name, "hospitals": base.hospitals,
                                        "teachers per hospital": ",".join(map(str, sweep)), "δ": delta,
                                        "seeds": ",".join(map(str, seeds)), "start model": base.public_start,
                                        "wall minutes": round((time.perf_counter() - started) / 60, 1)},
                              release=release)


def patient_homes(preset, data, seeds: Sequence[int], **where) -> dict[str, list[str]]:
    """Patient -> the hospitals holding that patient in any of ``seeds``' splits (sorted). With the institution
    scheme and at least as many institutions as hospitals every patient stays at its institution's hospital;
    other schemes may move patients between hospitals from one seed to the next."""
    homes: dict[str, set[str]] = {}
    for seed in seeds:
        _, split = build_world(preset, data, seed, progress=False, **where)
        for hospital in split.hospitals:
            for patient in split.patients_of(split.hospital_cases(hospital)):
                homes.setdefault(patient, set()).add(hospital)
    return {patient: sorted(held) for patient, held in homes.items()}


HOSPITAL_LEDGERS = "hospital-ledgers"


def planned_lifetime_epsilon(methods: Sequence[str], epsilons: Sequence[float], teacher_counts: int,
                             seeds: int = 1, delta: float | None = None) -> float:
    """Default lifetime budget per hospital: the sum of the budgets of every cell that touches its
    patients (PATE cells once per K of a sweep; DP-FedAvg and DP-SGD once), once per seed of a multi-seed
    comparison (every seed's cells release from the same patients). Basic composition's total; the ledgers'
    accountants compose tighter, and the report states what was actually spent.

    When secure-sum cells (RDP/zCDP) and PLD-accounted cells share the hospitals' ledgers, those ledgers are read
    by the split accountant (``privacy.accountants.SplitDeltaAccountant``), each family at δ/2; each cell's
    budget is then planned as its ε at δ/2 (``delta``: the cells' δ; required for such a mix), taken as the larger
    of the μ-GDP and the ρ-zCDP readings of a mechanism calibrated to (ε, δ) -- the two shapes a composition of
    Gaussian-like releases takes -- so that the cells still fit the plan."""
    records = [record for record in map(registry.method, methods) if record.private]
    families = {record.secure_sum for record in records}
    if len(families) > 1 and delta is None:
        raise ValueError("planned_lifetime_epsilon: secure-sum and other private cells share the ledgers; give delta")
    per_cell = {float(e): _read_at_split_delta(float(e), delta, len(families)) for e in epsilons}
    total = 0.0
    for record in records:
        repeats = teacher_counts if record.sweeps_k else 1
        total += repeats * sum(per_cell[float(e)] for e in epsilons)
    return int(seeds) * total or max(float(e) for e in epsilons)


def _read_at_split_delta(epsilon: float, delta: float | None, families: int) -> float:
    """ε at δ/``families`` of a Gaussian-like mechanism calibrated to (``epsilon``, δ) (``epsilon`` itself for one
    family)."""
    if families <= 1:
        return epsilon
    split = delta / families
    return max(gdp_epsilon(gdp_mu_for(epsilon, delta), split), zcdp_epsilon(zcdp_rho_for(epsilon, delta), split))


def combined_release(out: Path, delta: float, ledger_dir: str | Path | None = None,
                     homes: dict[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """What the comparison released together, per hospital, from the hospitals' own ledgers: the combined
    epsilon of every cell (all methods, all budgets, all K, all seeds) that touched that hospital's patients.

    ``ledger_dir``: where they are (default ``out/hospital-ledgers``; a seed of a multi-seed comparison
    points at its parent's). ``homes`` (multi-seed: :func:`patient_homes`): a patient held by several
    hospitals across the seeds was charged in each of their ledgers, so its ε composes all of them; the
    combined ε is then the worst of the hospitals' and of those patients'."""
    ledger_dir = Path(ledger_dir) if ledger_dir is not None else out / HOSPITAL_LEDGERS
    per_hospital, digests, relations, accountants, events = {}, {}, set(), set(), {}
    for path in sorted(ledger_dir.glob("*.jsonl")):
        ledger = Ledger.load(path)
        for owner in ledger.owners():
            spent = ledger.spent(owner, delta)
            per_hospital[owner] = spent.epsilon
            relations.add(spent.relation)
            accountants.add(spent.accountant)
            events[owner] = ledger.events(owner)
        digests[path.name] = ledger.digest()
    combined = max(per_hospital.values()) if per_hospital else None
    release = {"combined_epsilon": combined,
               "combined_epsilon_per_hospital": per_hospital, "delta": delta,
               "relation": ", ".join(sorted(r for r in relations if r)) or None,
               "accountant": ", ".join(sorted(accountants)) or None,
               "hospital_ledgers": os.path.relpath(ledger_dir, out) + "/", "hospital_ledger_digests": digests}
    if homes is not None:
        moving = {tuple(held) for held in homes.values() if len([h for h in held if h in events]) > 1}
        worst = None
        for held in moving:   # each distinct set of hospitals once: the same events, the same epsilon
            charged = [event for h in held for event in events.get(h, [])]
            worst = max(worst or 0.0, epsilon_spent(charged, delta)[0])
        release["patients_moving_between_hospitals"] = sum(
            1 for held in homes.values() if len([h for h in held if h in events]) > 1)
        if worst is not None:
            release["combined_epsilon_moving_patients"] = worst
            release["combined_epsilon"] = max(combined or 0.0, worst)
    return release


def plot_comparison_overlays(out: Path, world_dir: str | None, preset_name, seed, hospitals, per_hospital,
                             device: str = "auto"):
    """Same test slices: ground truth, the best cell of every private family (PATE's with its teacher ensemble),
    and the public floors (what no hospital taught). Returns the plot's path (None when nothing to plot).

    Args:
        out: the comparison's folder (its cells; ``overlays.png`` is written there).
        world_dir: the world folder of the comparison's first K (its test slices, and its simulated hospitals'
            teachers under ``nodes``); None = no plot.
        preset_name: the preset's name (rebuilds the hospitals for the teacher ensemble).
        seed: the simulated hospitals' seed (as in the comparison).
        hospitals / per_hospital: the number of hospitals and the teachers per hospital of that world.
        device: where the models predict (``task.learning.device``; default auto).
    """
    if world_dir is None:
        return None
    world = load_world(*open_world(world_dir))
    images, truth = world.test_images[:3], world.test_labels[:3]
    cells = load_cells(out)

    def best(family):   # chosen on public validation Dice, never on the test set
        found = [c for c in cells if registry.family_of(c.get("method")) == family
                 and c.get("validation_dice_mean") is not None]
        return max(found, key=lambda c: (c.get("epsilon_budget") or 0, c["validation_dice_mean"]), default=None)

    families = list(dict.fromkeys(r.family for r in registry.methods(role=Role.PRIVATE)))
    families += list(dict.fromkeys(r.family for r in registry.methods(role=Role.FLOOR)))
    predictions: dict[str, Any] = {}
    for family in families:
        cell = best(family)
        if cell is None:
            continue
        model = load_bundle(out / cell["_cell"]).model
        eps = cell.get("epsilon_budget")
        name = f"{cell['method']}" + (f" ε={eps:g}" if eps else "")
        predictions[name] = predict_probs(model, images, device=device, mirror=True).argmax(axis=1)
        if registry.method(cell["method"]).sweeps_k:   # a teacher-based method: its teachers' noise-free vote
            ensemble = teacher_ensemble(Path(world_dir), images, preset_name, hospitals, per_hospital, seed, device)
            if ensemble is not None:
                predictions["teacher ensemble (no noise)"] = ensemble.argmax(axis=1)
    if not predictions:
        return None
    return plot_overlays(out / "overlays.png", images, truth, predictions)


def teacher_ensemble(world_dir: Path, images, preset_name, hospitals, per_hospital, seed: int = 0,
                     device: str = "auto") -> np.ndarray | None:
    """Simulation-only diagnostic: the simulated hospitals' teachers' averaged probabilities, asked of the
    hospitals themselves (``TeacherEnsembleDiagnostics``); None when they have not trained teachers.

    Args:
        world_dir: the world folder (``task.world.materialise_world``) whose hospitals keep their teachers under
            ``world_dir/nodes``.
        images: the scans the teachers predict.
        preset_name: the preset's name.
        hospitals / per_hospital: the number of hospitals and the teachers per hospital (None = the preset's).
        seed: the simulated hospitals' seed (as in the comparison).
        device: where the teachers predict (``task.learning.device``; default auto).
    """
    preset = get_preset(preset_name, hospitals=hospitals, teachers_per_hospital=per_hospital)
    prepared, split = open_world(world_dir)
    members = simulated_hospitals(prepared, split, preset, world_dir / "nodes", seed)
    if not all(member.has_trained_teachers() for member in members):
        return None
    return InProcessTransport(members).ensemble_probabilities(images, {"device": device})
