"""A run folder is resumed only with the settings it was started with: ``compare`` with another seed used to
rewrite the header and keep the earlier seed's cells in the report; ``central`` reused an earlier start's public
model. Anything else is refused in one line naming what differs, before anything is written or charged."""

import json
from pathlib import Path

import pytest

from task.learning.compute import Compute
from task.errors import UserError
from sim.runners.compare import CompareConfig, run_compare, run_compare_seeds


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("fedpate-cache")
    with pytest.MonkeyPatch.context() as env:   # module scope: the function-scoped monkeypatch cannot
        env.setenv("FEDPATE_CACHE", str(root))
        yield root


def _config(out, data, **changes):
    # no methods: the folder's header and world are written exactly as a full comparison writes them, in seconds
    compute = {k: changes.pop(k) for k in ("precision", "workers") if k in changes}
    settings = dict(preset="tiny", methods=(), epsilons=(1.0,), out=Path(out), data=str(data),
                    compute=Compute(progress=False, **compute))
    return CompareConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def started(cache, tiny_phantoms, tmp_path_factory):
    """A comparison folder started with seed 0 and secure noise."""
    out = tmp_path_factory.mktemp("compare") / "cmp"
    run_compare(_config(out, tiny_phantoms))
    return out


@pytest.mark.parametrize("changes, named", [
    ({"seed": 1}, "--seed 0 there, 1 now"),
    ({"delta": 1e-4}, "--delta 0.001 there, 0.0001 now"),
    ({"reproducible_noise": True}, "--reproducible-noise secure there, reproducible now"),
    ({"init": "scratch"}, "--init public there, scratch now"),
    ({"teachers_per_hospital": (2,)}, "--teachers-per-hospital [4] there, [2] now"),
    ({"precision": "bf16"}, "--precision 32 there, bf16 now"),
    ({"lifetime_epsilon": 5.0}, "--lifetime-epsilon not given there, 5.0 now"),
    ({"engine": "flower"}, "--engine inprocess there, flower now"),
])
def test_compare_resumes_a_folder_only_with_its_settings(started, tiny_phantoms, changes, named):
    before = {p.name: p.read_bytes() for p in started.iterdir() if p.is_file()}
    with pytest.raises(UserError) as refused:
        run_compare(_config(started, tiny_phantoms, **changes))
    message = str(refused.value)
    assert named in message and len(message.splitlines()) == 1, message
    # nothing was rewritten: the header and the report still describe the folder's own run
    assert before == {p.name: p.read_bytes() for p in started.iterdir() if p.is_file()}


def test_compare_on_other_data_is_refused(started, tiny_phantoms, tmp_path):
    import shutil

    other = shutil.copytree(tiny_phantoms, tmp_path / "other")
    with pytest.raises(UserError, match="--data .* there, .*other now"):
        run_compare(_config(started, other))


def test_adding_budgets_resumes_and_the_header_covers_every_cell(started, tiny_phantoms):
    run_compare(_config(started, tiny_phantoms, epsilons=(2.0, 1.0), workers=1))
    header = json.loads((started / "compare.json").read_text())
    assert header["epsilons"] == [1.0, 2.0] and header["seed"] == 0


def test_reproducible_noise_checks_the_unpublished_seed_through_the_split(cache, tiny_phantoms, tmp_path):
    out = tmp_path / "cmp"
    run_compare(_config(out, tiny_phantoms, reproducible_noise=True))
    assert json.loads((out / "compare.json").read_text())["seed"] is None
    with pytest.raises(UserError, match="another world") as refused:
        run_compare(_config(out, tiny_phantoms, reproducible_noise=True, seed=1))
    assert "there" not in str(refused.value)   # the seeds' values are not printed
    run_compare(_config(out, tiny_phantoms, reproducible_noise=True))   # the same seed resumes


def test_single_and_multi_seed_folders_are_not_mixed(cache, tiny_phantoms, tmp_path):
    out = tmp_path / "seeds"
    run_compare_seeds(_config(out, tiny_phantoms), [0, 1])
    with pytest.raises(UserError, match="several seeds"):
        run_compare(_config(out, tiny_phantoms))
    with pytest.raises(UserError, match="--delta"):
        run_compare_seeds(_config(out, tiny_phantoms, delta=1e-4), [0, 1])
    run_compare_seeds(_config(tmp_path / "single", tiny_phantoms), [0])   # one seed: a plain comparison
    with pytest.raises(UserError, match="single-seed"):
        run_compare_seeds(_config(tmp_path / "single", tiny_phantoms), [0, 1])


@pytest.mark.slow
def test_compare_cli_with_another_seed_keeps_the_earlier_report(cache, tiny_phantoms, tmp_path, capsys):
    """The case as a user met it: a finished cell, then the same command with ``--seed 1``."""
    from sim.cli import main

    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny", "--epsilons", "1", "--methods", "public-only", "--data", str(tiny_phantoms),
            "--out", str(out), "--no-progress"]
    assert main(args) == 0
    report = (out / "report.md").read_text()
    capsys.readouterr()
    assert main(args + ["--seed", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--seed 0 there, 1 now" in err and len(err.splitlines()) == 1, err
    assert (out / "report.md").read_text() == report and json.loads((out / "compare.json").read_text())["seed"] == 0


@pytest.mark.slow
def test_central_resumes_a_folder_only_with_its_settings(cache, tiny_phantoms, tmp_path, capsys):
    """A finished run leaves no checkpoint behind (its public model, ``public-model.pt``, was only needed to
    resume), and its settings still bind the folder: a rerun with another seed would state seed 1 over seed 0's
    results. A failed start binds nothing."""
    from sim.cli import main

    out = tmp_path / "central"
    args = ["central", "--preset", "tiny", "--method", "nonprivate", "--data", str(tiny_phantoms), "--epochs", "1",
            "--out", str(out), "--no-progress"]
    assert main(args) == 0 and not (out / "public-model.pt").exists() and not (out / "checkpoint").exists()
    capsys.readouterr()
    assert main(args + ["--seed", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--seed 0 there, 1 now" in err and len(err.splitlines()) == 1, err
    assert json.loads((out / "results.json").read_text())["seed"] == 0


def test_dpfedavg_refuses_an_earlier_runs_folder(tmp_path):
    """As PATE's: a second run into a folder whose ledger holds an earlier run's releases mixed both runs' records
    in one ledger under the second run's results. Refused before any hospital is asked for a round."""
    from privacy.events import GaussianEvent
    from privacy.ledger import Ledger
    from server.dpfedavg import DpFedAvgConfig, run_dpfedavg
    from task.settings.presets import get_preset

    (tmp_path / "run").mkdir()
    Ledger(tmp_path / "run" / "ledger.jsonl").record(["hospital-0"], GaussianEvent(sensitivity=1.0, sigma=1.0),
                                                      "earlier-run")

    class Untouched:
        def __getattr__(self, name):
            raise AssertionError(f"the hospitals were asked ({name}) before the folder was checked")

    with pytest.raises(UserError, match="already holds ledger.jsonl from an earlier run"):
        run_dpfedavg(Untouched(), None, get_preset("tiny"), DpFedAvgConfig(8.0, 1e-3, compute=Compute(progress=False)),
                     tmp_path / "run")


@pytest.mark.slow
def test_cells_added_to_a_finished_comparison_leave_its_models_loadable(cache, tiny_phantoms, tmp_path, capsys):
    """Adding a private method charges the hospitals' ledgers after the first cells' bundles stated what they were
    released with; the report's overlays load those bundles, so every bundle must state the new release first."""
    from task.reporting.bundle import load_bundle

    out = tmp_path / "cmp"
    methods = ("public-only", "dp-sgd-central")
    run_compare(_config(out, tiny_phantoms, methods=methods, epsilons=(8.0,), workers=1))
    first = load_bundle(out / "public-only").card["released_with"]["combined_epsilon"]
    run_compare(_config(out, tiny_phantoms, methods=methods, epsilons=(8.0, 1.0), workers=1))
    assert "overlay plot skipped" not in capsys.readouterr().out
    assert json.loads((out / "report-settings.json").read_text())["overlays"] == ["overlays.png"]
    # each bundle is checked against the ledgers the added cell charged, and states their larger combined epsilon
    assert load_bundle(out / "public-only").card["released_with"]["combined_epsilon"] > first > 0
    assert load_bundle(out / "dp-sgd-central" / "eps-8").card["released_with"]["combined_epsilon"] > first
