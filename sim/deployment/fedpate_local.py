"""The real fedpate app as a multi-process deployment on this machine (``fedpate deploy local --preset``).

Each hospital gets *its own* MSD-layout folder holding only its patients (files linked from the
simulated world's data), runs as its own SuperNode process (TLS, authenticated key) and prepares and
partitions that folder itself -- exactly what a hospital machine does. The aggregator reads only the
public sets of the world. Processes are started and stopped by PID (sim/deployment/local.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sim.deployment.flower_cli import PROJECT_ROOT
from sim.deployment.local import LocalDeployment
from task.errors import UserError
from task.io import atomic_write_json
from task.settings.runconfig import RunSettings
from task.world import materialise_world, open_world

#: written beside results.json by :func:`run_local_deployment`
DEPLOYMENT_FILE = "deployment.json"


def export_hospital_folders(world_dir: str | Path, out_root: str | Path) -> dict[str, Path]:
    """One folder per hospital of the world's split, with only that hospital's cases: MSD Task01 layout, or
    the source's BraTS case folders (each hospital's node detects the layout as ``--data`` does)."""

    prepared, split = open_world(world_dir)
    source_root = Path(prepared.manifest["source_root"])
    if not (source_root / "dataset.json").is_file():
        return _export_case_folders(source_root, split, out_root)
    dataset = json.loads((source_root / "dataset.json").read_text())
    by_id = {Path(entry["image"]).name.split(".nii")[0]: entry for entry in dataset["training"]}
    folders = {}
    for hospital in sorted(split.hospitals):
        folder = Path(out_root) / hospital
        cases = split.hospital_cases(hospital)
        entries = []
        for case in cases:
            entry = by_id[case]
            for key in ("image", "label"):
                target = folder / entry[key]
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    try:
                        os.link(source_root / entry[key], target)
                    except OSError:  # another file system: copy instead
                        shutil.copyfile(source_root / entry[key], target)
            entries.append(entry)
        atomic_write_json(folder / "dataset.json", {**dataset, "training": entries, "numTraining": len(entries),
                                                    "test": [], "numTest": 0,
                                                    "description": f"{hospital}'s own patients (fedpate deployment)"})
        folders[hospital] = folder
    return folders


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:
            os.link(source, target)
        except OSError:  # another file system: copy instead
            shutil.copyfile(source, target)


def _export_case_folders(source_root: Path, split, out_root: str | Path) -> dict[str, Path]:
    """BraTS sources: each hospital gets its cases' folders (hard links), as its own download would hold."""
    folders = {}
    for hospital in sorted(split.hospitals):
        folder = Path(out_root) / hospital
        for case in split.hospital_cases(hospital):
            for path in sorted((source_root / case).glob("*.nii*")):
                _link(path, folder / case / path.name)
        folders[hospital] = folder
    return folders


def run_local_deployment(settings: RunSettings, work_dir: str | Path, *, tls: bool = True, timeout: float = 3600.0,
                         kill_hospital_during_queries: str | None = None, verbose: bool = False,
                         every: float = 30.0) -> dict[str, Any]:
    """Deploy on localhost, run ``settings.method`` once, stop everything; returns results.json's content
    with ``"deployment"`` (run id, status, TLS), which is also written to ``deployment.json`` beside it.

    Args:
        settings: the run (method, preset, budget, world, device), as Flower's run config carries it.
        work_dir: the deployment's folder (hospital folders, certificates, process logs).
        tls: TLS and authenticated SuperNodes (False: plain HTTP, for tests).
        timeout: seconds before the run is abandoned.
        kill_hospital_during_queries: kill that hospital's SuperNode (and its ClientApp) by PID once the first
            PATE query has been charged to the ledger -- the dropout test.
        verbose: say each step as it starts, and every ``every`` seconds while the run goes on how long it has
            run and what its ledger holds (a run takes minutes; silence reads as a hang).
        every: seconds between two progress lines.
    """
    say = (lambda text: print(f"[deploy] {text}", flush=True)) if verbose else (lambda text: None)

    if settings.reproducible_noise:
        raise UserError("reproducible-noise: a deployment always draws secure noise (seeded noise can be "
                        "regenerated and subtracted; it is for simulations only)")
    work = Path(work_dir).resolve()
    preset = settings.resolved_preset
    say(f"preparing the world of preset {preset.name} ({preset.hospitals} hospitals; its public sets for the "
        "aggregator, each hospital's own patients for that hospital)")
    world = materialise_world(preset, settings.data, settings.seed, settings.compute.progress, layout=settings.layout,
                              partition_file=settings.partition_file)
    folders = export_hospital_folders(world, work / "hospital-data")
    out = Path(settings.out).resolve()
    (out / "results.json").unlink(missing_ok=True)
    # each hospital's own lifetime budget and delta, as its IT would set them in the node config
    hospitals = [{"hospital-id": h, "data-dir": str(folder), "workdir": str(work / "hospitals" / h),
                  "teachers-per-hospital": preset.teachers_per_hospital,
                  "epsilon-budget": float(settings.lifetime_epsilon or settings.budget),
                  "max-teachers": preset.teachers_per_hospital * len(folders),
                  "delta": float(settings.resolved_delta),
                  # each hospital's device is its own machine's; on localhost: the run's spec
                  "device": settings.compute.device, "precision": settings.compute.precision}
                 for h, folder in folders.items()]
    run_config = {**settings.replace(out=str(out)).to_run_config(), "world": str(world)}
    security = "TLS, authenticated SuperNodes" if tls else "no TLS"
    say(f"starting a SuperLink and {len(hospitals)} SuperNodes on 127.0.0.1 ({security})")
    with LocalDeployment(PROJECT_ROOT, work / "deployment", hospitals, tls=tls, auth=tls,
                         secure_roster=True, verbose=verbose) as deployment:
        if kill_hospital_during_queries is None:
            future = deployment.submit(run_config, timeout=timeout)
            say(f"running {settings.method} (flwr run; logs in {work / 'deployment'})")
            status = _wait_saying_progress(future, out / "ledger.jsonl", say, every)
        else:
            future = deployment.submit(run_config, timeout=timeout)
            _wait_for_first_query(out / "ledger.jsonl", future, timeout)
            deployment.kill_supernode(kill_hospital_during_queries)
            status = future.result()
    if not (out / "results.json").exists():
        raise UserError(f"deployment run {status.run_id} ended '{status.status}' without results.json "
                        f"(ServerApp log: {status.log_path})")
    # how the run was deployed, beside its results (results.json has one writer: task.reporting.results.write_run)
    deployment = {"run_id": status.run_id, "status": status.status, "seconds": status.seconds,
                  "tls": tls, "supernode_auth": tls}
    atomic_write_json(out / DEPLOYMENT_FILE, deployment)
    return {**json.loads((out / "results.json").read_text()), "deployment": deployment}


def _wait_saying_progress(future, ledger: Path, say, every: float):
    """The run's status once it ends; meanwhile, every ``every`` seconds, its running time and the releases its
    ledger holds (how far it is: a count the ledger states anyway, nothing else of the run)."""
    from concurrent.futures import TimeoutError as StillRunning

    started = time.monotonic()
    while True:
        try:
            return future.result(timeout=every)
        except StillRunning:
            released = sum(1 for line in ledger.read_text().splitlines() if line.strip()) if ledger.exists() else 0
            say(f"still running after {time.monotonic() - started:.0f} s; {released} release(s) charged to the "
                "run's ledger so far")


def _wait_for_first_query(ledger: Path, future, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ledger.exists() and 'query-' in ledger.read_text():
            return
        if future.done():
            status = future.result()
            raise UserError(f"deployment run {status.run_id} ended '{status.status}' before its query phase "
                            f"began (ServerApp log: {status.log_path})")
        time.sleep(0.5)
    raise UserError(f"no PATE query was released within {timeout:.0f} s")
