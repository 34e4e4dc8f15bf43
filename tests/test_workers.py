"""A comparison's cells in worker processes (``compare/demo --workers``, so the demo fits in 15 minutes on
two cores): how cells are grouped and spread, what is refused, and -- end to end on the tiny preset -- that the
cells run by two workers are the cells one process runs (same Dice, same epsilon, same hospital ledgers)."""

import json

import pytest

from privacy.ledger import Ledger
from task.settings import methods as registry
from task.learning.compute import Compute
from task.errors import UserError
from sim.runners import compare
from sim.runners.compare import CompareConfig, spread_over_workers


def test_longest_unit_first_onto_the_least_loaded_worker():
    units = [(("a",), 100.0), (("b",), 60.0), (("c",), 50.0), (("d", "e"), 700.0), (("f",), 300.0)]
    lanes = spread_over_workers(units, 2)
    assert lanes == [["d", "e"], ["f", "a", "b", "c"]]          # 700 against 510
    assert spread_over_workers(units, 1) == [["d", "e", "f", "a", "b", "c"]]
    assert spread_over_workers([(("a",), 5.0)], 3) == [["a"]]    # no empty worker is started


def test_methods_with_teachers_are_one_unit_and_finished_cells_are_not_work(tmp_path):
    config = CompareConfig("quick", ["pate-anchored", "pate-pca", "dp-sgd-central", "public-only"], [1.0, 8.0],
                           tmp_path, compute=Compute(progress=False))
    PATE_CELL, PCA_CELL = registry.method("pate-anchored").cell_seconds, registry.method("pate-pca").cell_seconds
    units = dict(compare._work_units(config))
    assert set(units) == {("pate-anchored", "pate-pca"), ("dp-sgd-central",), ("public-only",)}
    assert units[("pate-anchored", "pate-pca")] == 2 * PATE_CELL + 2 * PCA_CELL + compare.TEACHER_TRAINING_SECONDS
    # a finished cell is not work; a method with every cell finished is no unit at all
    for epsilon in ("eps-1", "eps-8"):
        (tmp_path / "dp-sgd-central" / epsilon).mkdir(parents=True)
        (tmp_path / "dp-sgd-central" / epsilon / "results.json").write_text("{}")
    (tmp_path / "pate-pca" / "eps-8").mkdir(parents=True)
    (tmp_path / "pate-pca" / "eps-8" / "results.json").write_text("{}")
    units = dict(compare._work_units(config))
    assert ("dp-sgd-central",) not in units
    assert units[("pate-anchored", "pate-pca")] == 2 * PATE_CELL + PCA_CELL + compare.TEACHER_TRAINING_SECONDS


def test_workers_are_checked_once_and_only_with_the_inprocess_engine(tmp_path, monkeypatch):
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(UserError, match="--workers"):
            CompareConfig("tiny", ["public-only"], [1.0], tmp_path, compute=Compute(workers=bad))
    with pytest.raises(UserError, match="--engine inprocess only"):
        CompareConfig("tiny", ["public-only"], [1.0], tmp_path, engine="flower", compute=Compute(workers=2))
    assert compare.parse_workers("3", "inprocess", "cpu") == 3
    with pytest.raises(UserError, match="--workers: expected a whole number"):
        compare.parse_workers("many", "inprocess", "cpu")
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    assert compare.parse_workers("auto", "inprocess", "cpu") == 2
    assert compare.parse_workers("auto", "flower", "cpu") == 1
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 1)
    assert compare.parse_workers("auto", "inprocess", "cpu") == 1


def test_cells_share_a_gpu_as_far_as_its_free_memory_and_the_host_cores_allow(monkeypatch):
    """``--workers auto`` on CUDA: one cell per GPU_BYTES_PER_CELL of free memory, at most MAX_CELLS_PER_GPU and one
    per two host cores (a cell alone leaves the GPU idle through its host phases)."""
    import torch

    monkeypatch.setattr(compare, "resolve_device", lambda spec: torch.device("cuda:0"))
    free = {"bytes": 80 * 2 ** 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 141 * 2 ** 30))
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 16)
    assert compare.MAX_CELLS_PER_GPU == 4 and compare.parse_workers("auto", "inprocess", "cuda") == 4
    free["bytes"] = 2 * compare.GPU_BYTES_PER_CELL + 1
    assert compare.parse_workers("auto", "inprocess", "cuda") == 2
    free["bytes"] = compare.GPU_BYTES_PER_CELL - 1
    assert compare.parse_workers("auto", "inprocess", "cuda") == 1     # not even one cell's allowance: one
    free["bytes"] = 80 * 2 ** 30
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 6)
    assert compare.parse_workers("auto", "inprocess", "cuda") == 3     # one per two host cores
    assert compare.parse_workers("auto", "flower", "cuda") == 1


@pytest.mark.slow
def test_two_workers_run_the_cells_one_process_runs(tmp_path, monkeypatch):
    """Tiny preset, reproducible noise: every cell run by two workers has the Dice and epsilon of the same cell
    run in one process; both workers' DP cells are in the hospitals' one set of ledgers; one report."""
    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    methods = ["dp-sgd-central", "nonprivate-central", "public-only"]
    results = {}
    for workers in (1, 2):
        out = tmp_path / f"workers-{workers}"
        report = compare.run_compare(CompareConfig("tiny", methods, [2.0], out,
                                                   reproducible_noise=True,
                                                   compute=Compute(workers=workers, progress=False)))
        assert report.exists() and f"workers = {workers}," in report.read_text()
        results[workers] = {path.parent.relative_to(out).as_posix(): json.loads(path.read_text())
                            for path in out.rglob("results.json")}
        ledgers = sorted((out / "hospital-ledgers").glob("*.jsonl"))
        assert ledgers and all(len(Ledger.load(path)) > 0 for path in ledgers)
    assert set(results[1]) == set(results[2]) == {"dp-sgd-central/eps-2", "nonprivate-central", "public-only"}
    for cell, one in results[1].items():
        two = results[2][cell]
        assert two["dice"]["mean"] == pytest.approx(one["dice"]["mean"], abs=1e-6), cell
        assert two.get("epsilon") == one.get("epsilon"), cell


def test_a_method_registered_at_run_time_keeps_every_cell_in_this_process(tmp_path, monkeypatch, capsys):
    """Worker processes are fresh interpreters that would not know it: no worker is started."""
    from task.settings.methods import Method, register_method, unregister_method

    ran = []
    monkeypatch.setattr(compare, "_run_cells", lambda config, lifetime, ledger_dir: ran.append(config.methods))
    monkeypatch.setattr(compare, "materialise_world", lambda *a, **k: tmp_path / "world")
    monkeypatch.setattr(compare, "prepare_public_models", lambda context: pytest.fail("no worker should start"))
    register_method(Method("toy-late", "toy-late", "floor", runner="public-only"))
    try:
        config = CompareConfig("tiny", ["toy-late", "dp-sgd-central", "nonprivate-central"], [1.0], tmp_path,
                               compute=Compute(workers=2, progress=False))
        compare.run_in_workers(config, 1.0, tmp_path / "ledgers")
    finally:
        unregister_method("toy-late")
    assert ran == [("toy-late", "dp-sgd-central", "nonprivate-central")]
    assert "registered at run time" in capsys.readouterr().out
