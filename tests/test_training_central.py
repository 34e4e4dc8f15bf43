"""End-to-end central baselines through the CLI: schema-complete results.json, ledger, model."""

import json

import pytest

from sim.cli import main

SCHEMA = ("method", "dice", "epsilon", "epsilon_budget", "delta", "relation", "accountant", "teachers",
          "hospitals", "queries", "sigma", "teacher_dice_mean", "ensemble_dice_mean",
          "bytes_up_per_query_per_teacher", "wall_seconds", "seed")
DICE = {"1", "2", "3", "mean", "WT", "TC", "ET"}


def _run(tmp_path, monkeypatch, data, *extra):
    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    status = main(["central", "--preset", "tiny", "--data", str(data), "--out", str(out), "--epochs", "2",
                   "--no-progress", *extra])
    assert status == 0
    text = (out / "results.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    results = json.loads(text)
    assert all(key in results for key in SCHEMA)
    assert set(results["dice"]) == DICE
    assert len(results["dice_per_case"]) > 0 and all(v is None or 0 <= v <= 1 for v in results["dice_per_case"])
    assert (out / "model" / "weights.pt").is_file() and (out / "ledger.jsonl").is_file()
    assert not (out / "model" / "model.pt").exists(), "one weight file per bundle, covered by its digest"
    return out, results


@pytest.mark.slow
def test_central_nonprivate_cli(tmp_path, monkeypatch, tiny_phantoms):
    out, results = _run(tmp_path, monkeypatch, tiny_phantoms, "--method", "nonprivate")
    assert results["method"] == "nonprivate-central"
    for key in ("epsilon", "epsilon_budget", "delta", "relation", "accountant", "sigma", "teachers"):
        assert results[key] is None
    assert (out / "ledger.jsonl").read_text() == ""
    assert results["dice"]["mean"] is None or 0.0 <= results["dice"]["mean"] <= 1.0
    from task.reporting.bundle import load_bundle

    assert load_bundle(out).card["private"] is False


@pytest.mark.slow
def test_central_dpsgd_cli(tmp_path, monkeypatch, tiny_phantoms):
    out, results = _run(tmp_path, monkeypatch, tiny_phantoms, "--method", "dp-sgd", "--epsilon", "8",
                        "--delta", "1e-3", "--sampling", "shuffle")
    from privacy.ledger import Ledger

    assert results["method"] == "dp-sgd-central"
    assert results["relation"] == "replace-one" and results["accountant"] == "zcdp"  # the default relation
    ledger = Ledger.load(out / "ledger.jsonl")
    assert ledger.owners() == ["hospital-00", "hospital-01"]     # the pooled patients' hospitals
    spent = ledger.spent("hospital-00", 1e-3)
    assert results["epsilon"] == pytest.approx(spent.epsilon)
    assert 0 < results["epsilon"] <= 8.0 and results["epsilon_budget"] == 8.0 and results["sigma"] > 0
    # a finished DP run keeps no resume checkpoint; a rerun into its folder is refused and charges nothing
    assert not (out / "checkpoint").exists()
    before = (out / "ledger.jsonl").read_text()
    assert main(["central", "--preset", "tiny", "--data", str(tiny_phantoms), "--out", str(out), "--method",
                 "dp-sgd", "--no-progress", "--epochs", "2", "--sampling", "shuffle"]) == 2
    assert (out / "ledger.jsonl").read_text() == before


@pytest.fixture(autouse=True)
def _no_public_world(monkeypatch):
    """Runs on synthetic data have no public world to pre-train on: their public start is a fixed U-Net."""
    import torch

    import sim.runners.central as central
    from task.learning.networks import build_unet

    def fixed_public_start(preset, **kwargs):
        torch.manual_seed(1234)
        model = build_unet(preset.unet)
        torch.save(model.state_dict(), kwargs["checkpoint"])   # as the real one checkpoints its training
        return model.state_dict()

    monkeypatch.setattr(central, "public_start", fixed_public_start)


def _fake_loader(preset, seed=0, data=None, cache_root=None, progress=True):
    from synthetic_worlds import pooled_world

    return pooled_world(preset, seed, n_train=4, n_test=2)


@pytest.mark.parametrize("method", ["nonprivate", "dp-sgd"])
def test_run_central_schema_with_synthetic_data(tmp_path, monkeypatch, method):
    import sim.runners.central as central

    monkeypatch.setattr(central, "load_central_data", _fake_loader)
    results = central.run_central(central.CentralConfig.of(method=method, preset="tiny", out=tmp_path / "run", epsilon=8.0, delta=1e-3,
                                  progress=False, epochs=1, sampling="shuffle", augment=False))
    written = json.loads((tmp_path / "run" / "results.json").read_text())
    assert written == json.loads(json.dumps(results))
    assert all(key in written for key in SCHEMA) and set(written["dice"]) == DICE
    from task.reporting.bundle import load_bundle

    bundle = load_bundle(tmp_path / "run")   # verifies weights digest and the card against the ledger
    assert bundle.card["epsilon"] == written["epsilon"]
    # nothing left behind that only a run in progress needs: no checkpoint, no public-model checkpoint, no lock file
    assert not list((tmp_path / "run").rglob("*.lock")) and not list((tmp_path / "run").rglob("*.pt.tmp*"))
    assert not (tmp_path / "run" / "public-model.pt").exists() and not (tmp_path / "run" / "checkpoint").exists()
    if method == "dp-sgd":
        from privacy.ledger import Ledger

        spent = Ledger.load(tmp_path / "run" / "ledger.jsonl").spent("h1", 1e-3)
        assert written["epsilon"] == pytest.approx(spent.epsilon) and written["accountant"] == "zcdp"
        assert written["relation"] == "replace-one" and written["epsilon_budget"] == 8.0
        # shuffled epochs (explicit ρ) cannot be re-read under another relation: null, never absent
        assert written["epsilon_replace_one"] == written["epsilon"] and written["epsilon_add_remove"] is None
    else:
        assert written["epsilon"] is None and written["relation"] is None and written["delta"] is None
        assert (tmp_path / "run" / "ledger.jsonl").read_text() == ""


def test_central_dpsgd_charges_every_hospitals_lifetime_ledger(tmp_path, monkeypatch):
    """In a comparison the pooled DP-SGD run spends each hospital's lifetime budget too, and is refused
    before any epoch when a hospital's lifetime ledger has no room left."""
    import sim.runners.central as central
    from privacy.errors import BudgetExceeded
    from privacy.ledger import Ledger

    monkeypatch.setattr(central, "load_central_data", _fake_loader)
    ledgers = tmp_path / "hospital-ledgers"
    results = central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "a", epsilon=2.0, delta=1e-3,
                                  progress=False, epochs=1, sampling="shuffle", augment=False,
                                  hospital_ledger_dir=ledgers, lifetime_epsilon=3.0))
    for h in ("h0", "h1"):
        own = Ledger.load(ledgers / f"{h}.jsonl")
        assert own.owners() == [h] and own.spent(h, 1e-3).epsilon == pytest.approx(results["epsilon"])
    spent_elsewhere = next(e for e in Ledger.load(ledgers / "h1.jsonl").events("h1"))   # same kind of event
    Ledger(ledgers / "h1.jsonl").record(["h1"], spent_elsewhere, "another-run:epoch-0")
    with pytest.raises(BudgetExceeded, match="h1"):
        central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "b", epsilon=2.0, delta=1e-3,
                            progress=False, epochs=1, sampling="shuffle", augment=False,
                            hospital_ledger_dir=ledgers, lifetime_epsilon=3.0))
    assert len(Ledger.load(ledgers / "h0.jsonl")) == 1        # nothing recorded for the refused run


def test_run_central_poisson_states_both_relations(tmp_path, monkeypatch):
    """Replace-one by default (train_cases is published); the add/remove ε of the same run is stated beside it."""
    import sim.runners.central as central
    from privacy.accountants import epsilon_under
    from privacy.ledger import Ledger

    monkeypatch.setattr(central, "load_central_data", _fake_loader)
    written = central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "run", epsilon=8.0, delta=1e-3,
                                  progress=False, epochs=1, sampling="poisson", augment=False,
                                  noise_mode="fixed", noise_multiplier=2.0))
    ledger = Ledger.load(tmp_path / "run" / "ledger.jsonl")
    spent = ledger.spent("h0", 1e-3)
    assert (written["relation"], written["accountant"]) == ("replace-one", "pld") == (spent.relation, spent.accountant)
    assert written["epsilon"] == pytest.approx(spent.epsilon) and written["epsilon"] <= 8.0
    assert written["epsilon_replace_one"] == written["epsilon"] and written["train_cases"] == 4
    add_remove = epsilon_under(ledger.events("h0"), 1e-3, "add-remove")[0]
    assert written["epsilon_add_remove"] == pytest.approx(add_remove) and add_remove < written["epsilon"]
    assert written["dpsgd"]["adaptive"] is False
    # its wall time (and where it went) grows with the secret Poisson batch sizes: listed as a diagnostic no
    # guarantee covers
    assert written["not_private_diagnostics"] == ["wall_seconds", "phase_seconds"]
    assert written["wall_seconds"] is not None and written["phase_seconds"]["training"] > 0
    from sim.report import privacy_statement

    statement = " ".join(privacy_statement([written], None))
    assert "wall times" in statement and "Poisson batch sizes" in statement


def test_a_finished_dpsgd_run_holds_and_prints_no_training_loss_or_sample_count(tmp_path, monkeypatch, capfd):
    """The training loss (unbounded sensitivity) and the Poisson batch sizes stay inside the run:
    not in any file of the finished folder, not on the console (the progress bar shows sigma and epsilon)."""
    import sim.runners.central as central
    import task.learning.training as training

    monkeypatch.setattr(central, "load_central_data", _fake_loader)
    monkeypatch.setattr(training, "tqdm", _EagerBar)
    central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "run", epsilon=8.0, delta=1e-3,
                        progress=True, epochs=2, augment=False))
    console = capfd.readouterr()
    shown = console.out + console.err
    assert "epsilon" in shown and "loss" not in shown and "samples" not in shown
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert files and not any(p.suffix == ".pt" and "checkpoint" in p.parts for p in files)
    for path in files:
        content = path.read_bytes()
        assert b"loss" not in content and b"samples" not in content and b"empty_batches" not in content, path


class _EagerBar:
    """tqdm stand-in that prints every postfix it is given (a real bar may skip refreshes)."""

    def __init__(self, iterable, **kwargs):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, values):
        import sys

        print(f"postfix {values}", file=sys.stderr)

    def close(self):
        pass
