"""Private selection (Papernot & Steinke 2022, arXiv 2110.03620): RepeatAndSelectEvent, its accounting, and
task.learning.selection's mechanism."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from privacy.accountants import (accountant_for, epsilon_spent, make_accountant,
                                 replace_one_sampled_gaussian_rdp)
from privacy.errors import BudgetExceeded, PrivacyError, UnsupportedEvent
from privacy.events import ComposedEvent, GaussianEvent, RepeatAndSelectEvent, SampledGaussianEvent, event_from_dict
from privacy.guard import BudgetGuard, CoveredGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource

DELTA = 1e-3


def _inner(relation="add-remove", z=1.0):
    return ComposedEvent((SampledGaussianEvent(1 / 9, z, 45, relation=relation),
                          GaussianEvent(1.0, 2.0, relation=relation)))


# ------------------------------------------------------------------------------------------------ the event
@pytest.mark.parametrize("shape", [None, 0.0, 0.5, 1.0, 2.0])
def test_repeat_and_select_epsilon_is_dp_accountings(shape):
    """Golden: our RDP accountant (own curve, base_rdp_curve) gives dp_accounting's RdpAccountant's ε for its
    RepeatAndSelectDpEvent, for every distribution of T; and the event round-trips through JSON."""
    from dp_accounting.rdp import rdp_privacy_accountant

    event = RepeatAndSelectEvent(_inner(), 3.0, shape)
    reference = rdp_privacy_accountant.RdpAccountant()
    reference.compose(event.to_dp_accounting("add-remove"))
    ours, name = epsilon_spent([event], DELTA)
    assert name == "rdp" and ours == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)
    assert event_from_dict(json.loads(json.dumps(event.to_dict()))) == event
    # selection costs more than one run, less than mean-many runs composed... at least more than one run
    assert ours > epsilon_spent([_inner()], DELTA, accountant="rdp")[0]


def test_repeat_and_select_golden_value():
    """A fixed number, so a change in dp_accounting or in our plumbing is seen (computed once, 2025)."""
    event = RepeatAndSelectEvent(_inner(), 3.0, 1.0)
    assert epsilon_spent([event], DELTA)[0] == pytest.approx(7.31958, abs=1e-4)


def test_replace_one_with_relation_free_inner_matches_dp_accounting():
    """A replace-one inner with explicit sensitivities only: dp_accounting can take it, and our curve agrees."""
    from dp_accounting.rdp import rdp_privacy_accountant

    inner = ComposedEvent((GaussianEvent(0.1, 0.3, count=3), GaussianEvent(1 / 20, 0.05)))
    event = RepeatAndSelectEvent(inner, 4.0, 0.0)
    reference = rdp_privacy_accountant.RdpAccountant()
    reference.compose(event.to_dp_accounting("add-remove"))
    assert epsilon_spent([event], DELTA)[0] == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)


def test_only_rdp_accounts_repeated_selection():
    event = RepeatAndSelectEvent(_inner("replace-one"), 3.0, 1.0)
    assert accountant_for([event]).name == "rdp"
    for name in ("pld", "gdp-exact", "zcdp", "basic"):
        with pytest.raises(UnsupportedEvent):
            make_accountant(name).compose(event)
    # replace-one DP-SGD outside a selection is exact in PLD only; mixed with a selection, the split accountant
    # reads each by its own (PLD; rdp for the selection) at δ/2, or rdp over both through the weak triangle
    # inequality (a valid, looser curve), whichever is smaller -- never below the selection alone
    mixed, name = epsilon_spent([event, SampledGaussianEvent(0.1, 1.0, 10, relation="replace-one")], DELTA)
    assert name == "split:pld+rdp" and mixed > epsilon_spent([event], DELTA)[0]
    with pytest.raises(PrivacyError):
        RepeatAndSelectEvent(_inner(), 0.5, 1.0)           # mean < 1
    with pytest.raises(PrivacyError):
        RepeatAndSelectEvent(SampledGaussianEvent(0.1, 1.0, 10, adaptive=True), 2.0, 1.0)


def _log_mix(x, q, z, m):
    from scipy import stats
    return np.logaddexp(np.log(q) + stats.norm.logpdf(x, m, z), np.log1p(-q) + stats.norm.logpdf(x, 0, z))


def _renyi(logp, logq, alpha):
    x = np.linspace(-60, 60, 400001)
    v = alpha * logp(x) + (1 - alpha) * logq(x)
    top = v.max()
    return (top + np.log(np.trapezoid(np.exp(v - top), x))) / (alpha - 1)


@pytest.mark.parametrize("q,z", [(1 / 9, 1.0), (0.25, 2.0)])
def test_replace_one_curve_bounds_the_numeric_divergence(q, z):
    """The weak-triangle replace-one curve is >= the numerically integrated replace-one divergence of one step
    (q N(-1, z²) + (1-q) N(0, z²) against q N(1, z²) + (1-q) N(0, z²)), and dp_accounting's add/remove curve
    bounds the reverse direction D_α(N(0) || mixture) too (what the triangle needs)."""
    from scipy import stats

    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    for alpha in (1.5, 2.0, 4.0, 8.0):
        exact = _renyi(lambda x: _log_mix(x, q, z, -1), lambda x: _log_mix(x, q, z, 1), alpha)
        bound = replace_one_sampled_gaussian_rdp(q, z, 1, [alpha])[0]
        assert exact <= bound
        acc = rdp_privacy_accountant.RdpAccountant(orders=[alpha])
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)))
        reverse = _renyi(lambda x: stats.norm.logpdf(x, 0, z), lambda x: _log_mix(x, q, z, 1), alpha)
        assert reverse <= acc.rdp[0] * (1 + 1e-6)
    # q = 1 is the Gaussian of sensitivity 2: within the triangle's factor of the exact 4α/(2z²)
    alpha = np.array([2.0, 10.0])
    exact = 4 * alpha / (2 * z * z)
    bound = replace_one_sampled_gaussian_rdp(1.0, z, 1, alpha)
    assert np.all(bound >= exact * (1 - 1e-9)) and np.all(bound <= exact * (2 * alpha - 1) ** 2 / (4 * alpha * (alpha - 1)) * 1.001)


def test_calibrated_selection_spends_the_budget():
    from privacy.calibration import PrivateSelection, private_selection_noise_multiplier, selection_event

    z = private_selection_noise_multiplier(8.0, DELTA, PrivateSelection(1 / 9, 45, 1 / 20, 0.05, 3.0, 1.0, "replace-one"))
    spent = epsilon_spent([selection_event(1 / 9, z, 45, 1 / 20, 0.05, 3.0, 1.0)], DELTA)[0]
    assert 8.0 * (1 - 1e-2) <= spent <= 8.0
    with pytest.raises(PrivacyError, match="score alone"):
        private_selection_noise_multiplier(1.0, DELTA, PrivateSelection(1 / 9, 45, 1.0, 0.05, 3.0, 1.0, "replace-one"))


# --------------------------------------------------------------------------------------- the covered guard
def test_covered_guard_records_nothing_and_refuses_what_is_not_covered():
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, 100.0, DELTA)
    event = RepeatAndSelectEvent(_inner("replace-one"), 2.0, 1.0)
    covered = CoveredGuard(guard, "sel", event, ["h0"])
    epoch = SampledGaussianEvent(1 / 9, 1.0, 9, relation="replace-one")
    covered.next_repetition()
    with pytest.raises(PrivacyError, match="not charged first"):
        covered.charge(["h0"], epoch, "e0")
    guard.charge(["h0"], event, "sel")
    for e in range(5):                                        # 5 epochs x 9 steps = the 45 covered steps
        covered.charge(["h0"], epoch, f"e{e}")
    with pytest.raises(PrivacyError, match="beyond"):
        covered.charge(["h0"], epoch, "e5")
    with pytest.raises(PrivacyError, match="not covered"):
        covered.charge(["h0"], SampledGaussianEvent(1 / 9, 0.9, 9, relation="replace-one"), "x")
    with pytest.raises(PrivacyError, match="owners"):
        covered.charge(["h1"], epoch, "x")
    covered.next_repetition()                                 # a new repetition may use the steps again
    covered.charge(["h0"], epoch, "r1e0")
    assert len(ledger) == 1


# ------------------------------------------------------------------------------------ the mechanism (sim/)
def _selection(guard, noise, *, scores, calls, settings=None, seed=0, config=None):
    from task.learning.dpsgd import steps_per_epoch
    from task.learning.selection import SelectionBudget, SelectionCallbacks, SelectionConfig, run_private_selection

    settings = settings or [{"learning_rate": 1e-3, "max_grad_norm": 1.0, "batch_size": 4, "epochs": 2},
                            {"learning_rate": 3e-3, "max_grad_norm": 1.0, "batch_size": 4, "epochs": 1}]
    n = 20
    images, labels = np.arange(n, dtype=np.float32)[:, None], np.zeros((n, 1))

    def public_model():
        calls.append("public")
        return "public"

    def train_candidate(setting, index, rep, x, y, z, covered, stream):
        calls.append(("train", index))
        assert len(x) == 16                                  # the 4 held-out patients are not trained on
        steps = steps_per_epoch(len(x), setting["batch_size"])
        for epoch in range(setting["epochs"]):               # what DP-SGD's session does per epoch
            covered.charge(("h0", "h1"), SampledGaussianEvent(1 / steps, z, steps, relation="replace-one"),
                           f"rep{rep}-e{epoch}")
        stream.generator("epoch-0").standard_normal((1,))
        return SimpleNamespace(model=f"trained-{index}")

    def evaluate(model, x, y):
        calls.append(("score", model))
        assert len(x) == 4
        return [scores[model]] * len(x)

    return run_private_selection(
        settings, images, labels,
        budget=SelectionBudget(guard=guard, owners=("h0", "h1"), release_prefix="run", noise=noise, epsilon=8.0,
                               delta=DELTA, relation="replace-one"),
        seed=seed, config=config or SelectionConfig(mean=4.0, score_noise=0.5),
        callbacks=SelectionCallbacks(public_model=public_model, train_candidate=train_candidate,
                                     evaluate_per_case=evaluate, steps_per_epoch=steps_per_epoch))


def test_selection_is_charged_before_anything_is_drawn_or_trained():
    """A guard without room for the whole event refuses it: nothing trained, scored or drawn, nothing recorded."""
    drawn = []

    class SpySource(NoiseSource):
        def generator(self, *names):
            drawn.append(names)
            return super().generator(*names)

        def child(self, *names):
            child = SpySource(None, self.path + tuple(str(n) for n in names))
            return child

    ledger = Ledger(None)
    calls = []
    with pytest.raises(BudgetExceeded):
        _selection(BudgetGuard(ledger, 7.0, DELTA), SpySource(), scores={}, calls=calls)   # planned for 8
    assert calls == [] and drawn == [] and len(ledger) == 0


def test_the_public_model_unchanged_can_win_and_only_one_event_is_recorded():
    ledger = Ledger(None)
    calls = []
    scores = {"public": 1.0, "trained-0": 0.0, "trained-1": 0.0}
    picked = None
    for seed in range(20):   # T >= 1 with geometric T; the public candidate drawn w.p. 1/3 per repetition
        calls.clear()
        ledger = Ledger(None)
        picked = _selection(BudgetGuard(ledger, 8.0, DELTA), NoiseSource.reproducible(seed), scores=scores,
                            calls=calls)
        if "public" in calls:
            break
    assert "public" in calls
    assert picked.setting is None and picked.model == "public" and picked.result is None
    assert picked.info["candidates"][picked.info["chosen"]] == "the public model, unchanged"
    assert len(ledger) == 1 and ledger.spent("h0", DELTA).epsilon <= 8.0
    assert picked.info["epsilon"] == pytest.approx(ledger.spent("h0", DELTA).epsilon)
    assert picked.repetitions == sum(1 for c in calls if c[0] == "score")
    # and a trained candidate wins when it scores better
    calls.clear()
    best = _selection(BudgetGuard(Ledger(None), 8.0, DELTA), NoiseSource.reproducible(3),
                      scores={"public": 0.0, "trained-0": 1.0, "trained-1": 0.5}, calls=calls)
    if ("train", 0) in calls:
        assert best.model == "trained-0" and best.setting["learning_rate"] == 1e-3


def test_noisy_score_sensitivity_on_a_worst_case_replace_one_pair():
    """Held-out patient p replaced by one whose Dice goes from 0 to 1 (everything else equal, same noise
    draw): the score moves by exactly 1/n, the sensitivity charged; undefined Dice counts as 0."""
    from task.learning.selection import noisy_mean_score

    n = 7
    before = [0.3, None, 0.9, 0.1, 0.5, 0.2, 0.0]
    after = list(before)
    after[-1] = 1.0
    a = noisy_mean_score(before, 0.05, NoiseSource.reproducible(0).generator("s"))
    b = noisy_mean_score(after, 0.05, NoiseSource.reproducible(0).generator("s"))
    assert b - a == pytest.approx(1.0 / n, abs=1e-12)
    # values outside [0, 1] cannot widen it
    worse = list(before)
    worse[-1] = 5.0
    assert noisy_mean_score(worse, 0.05, NoiseSource.reproducible(0).generator("s")) == pytest.approx(b)
    # and the charged event's score sensitivity is 1/n of the held-out count
    calls = []
    picked = _selection(BudgetGuard(Ledger(None), 8.0, DELTA), NoiseSource.reproducible(0),
                        scores={"public": 0.5, "trained-0": 0.5, "trained-1": 0.5}, calls=calls)
    score_event = event_from_dict(picked.info["event"]).inner.events[1]
    assert score_event.sensitivity == pytest.approx(1 / 4) and score_event.sigma == 0.5


def test_reproducible_noise_repeats_secure_noise_does_not():
    scores = {"public": 0.5, "trained-0": 0.52, "trained-1": 0.48}
    runs = [_selection(BudgetGuard(Ledger(None), 8.0, DELTA), NoiseSource.reproducible(5), scores=scores, calls=[])
            for _ in range(2)]
    assert runs[0].info["chosen"] == runs[1].info["chosen"]
    assert runs[0].info["chosen_noisy_score"] == runs[1].info["chosen_noisy_score"]
    assert runs[0].repetitions == runs[1].repetitions is not None
    secure = [_selection(BudgetGuard(Ledger(None), 8.0, DELTA), NoiseSource(), scores=scores, calls=[])
              for _ in range(2)]
    assert all(s.repetitions is None for s in secure)   # T is not even kept in memory
    assert secure[0].info["chosen_noisy_score"] != secure[1].info["chosen_noisy_score"]
    # the secure source hands out unseeded streams, whatever the run's seed
    from privacy.mechanisms import SecureNoiseGenerator
    assert isinstance(NoiseSource().child("private-selection").generator("score", 0), SecureNoiseGenerator)


def test_repetition_distribution_has_the_charged_mean():
    from task.learning.selection import repetition_pmf

    for shape in (0.0, 0.5, 1.0, 2.0, None):
        ks = range(0 if shape is None else 1, 400)
        pmf = [repetition_pmf(k, 3.0, shape) for k in ks]
        assert sum(pmf) == pytest.approx(1.0, abs=1e-9)
        assert sum(k * p for k, p in zip(ks, pmf)) <= 3.0 + 1e-9
        assert sum(k * p for k, p in zip(ks, pmf)) == pytest.approx(3.0, rel=1e-6)


def test_selection_refuses_mixed_batches_and_add_remove():
    from task.errors import UserError

    settings = [{"learning_rate": 1e-3, "max_grad_norm": 1.0, "batch_size": 4, "epochs": 2},
                {"learning_rate": 3e-3, "max_grad_norm": 1.0, "batch_size": 8, "epochs": 1}]
    with pytest.raises(UserError, match="one expected batch"):
        _selection(BudgetGuard(Ledger(None), 8.0, DELTA), NoiseSource.reproducible(0), scores={}, calls=[],
                   settings=settings)


# ------------------------------------------------------------------------------------------ run_central hook
def test_run_central_private_selection_end_to_end(tmp_path, monkeypatch):
    """tiny preset, synthetic world: one ledger record (the selection event, ε <= budget, RDP), the selection
    block in results.json, and the default stays public."""
    import torch

    import sim.runners.central as central
    from task.learning.networks import build_unet
    from task.learning.selection import SelectionConfig
    from synthetic_worlds import pooled_world

    def fixed_public_start(preset, **kwargs):
        torch.manual_seed(1234)
        return build_unet(preset.unet).state_dict()

    monkeypatch.setattr(central, "public_start", fixed_public_start)
    monkeypatch.setattr(central, "load_central_data",
                        lambda preset, seed=0, data=None, progress=True, **kw: pooled_world(preset, seed, n_train=6,
                                                                                          n_test=2))
    written = central.run_central(central.CentralConfig.of(
        method="dp-sgd", preset="tiny", out=tmp_path / "run", epsilon=8.0, delta=DELTA, progress=False, epochs=1,
        augment=False, selection="private", reproducible_noise=True,
        selection_config=SelectionConfig(mean=2.0, score_noise=2.0)))
    records = Ledger.load(tmp_path / "run" / "ledger.jsonl").records()
    assert len(records) == 1 and records[0]["event"]["type"] == "repeat-and-select"
    assert written["accountant"] == "rdp" and written["relation"] == "replace-one" and written["epsilon"] <= 8.0
    sel = written["selection"]
    assert sel["candidates"][-1] == "the public model, unchanged" and len(sel["candidates"]) == 3
    assert sel["epsilon"] == pytest.approx(written["epsilon"]) and sel["score"]["heldout_patients"] == 1
    assert written["sigma"] == sel["dpsgd_noise_multiplier"] and "realised" not in sel["repetitions"]
    assert written["train_cases"] == 6
    assert written["wall_seconds"] is None   # the run's duration would tell how many repetitions it made
    from sim.report import _setting_chosen   # the report names the candidate private selection released

    shown = _setting_chosen(written)
    assert "private selection" in shown and f"{sel['chosen'] + 1} of 3" in shown
    assert ("the public model, unchanged" in shown) == (sel["chosen"] == 2)


def test_private_selection_is_refused_inside_a_comparisons_hospital_ledgers(tmp_path):
    import sim.runners.central as central
    from task.errors import UserError

    with pytest.raises(UserError, match="not inside a comparison"):
        central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path, selection="private",
                                 hospital_ledger_dir=tmp_path / "ledgers")


# ------------------------------------------------------------ nothing observable depends on T (the secret)
def _tiny_selection_world(monkeypatch):
    """run_central on a fixed synthetic world (whatever the seed) and a fixed public model: two runs at different
    seeds then differ only in the selection's own randomness (T, the candidates drawn, their noise)."""
    import torch

    import sim.runners.central as central
    from task.learning.networks import build_unet
    from synthetic_worlds import pooled_world

    def fixed_public_start(preset, **kwargs):
        torch.manual_seed(1234)
        return build_unet(preset.unet).state_dict()

    monkeypatch.setattr(central, "public_start", fixed_public_start)
    monkeypatch.setattr(central, "load_central_data",
                        lambda preset, seed=0, data=None, progress=True, **kw: pooled_world(preset, 0, n_train=6,
                                                                                          n_test=2))
    return central


def _folder_view(folder, prefix):
    """Every file of a run folder as comparable text/bytes: the run's release-id nonce (random per run, the
    same for every T) and the ledger digest that covers it replaced, the released noisy score set aside, the
    model card's creation stamps (written as the run ends) replaced and returned, and the bundle's digests of
    those set aside."""
    import re

    view, stamps = {}, set()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix in (".json", ".jsonl", ".md"):
            data = data.replace(prefix.encode(), b"<release>")
            data = data.replace(Ledger.load(folder / "ledger.jsonl").digest().encode(), b"<ledger digest>")
            stamps |= set(re.findall(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data))
            data = re.sub(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", b"<created>", data)
        if path.name == "results.json":
            record = json.loads(data)
            record["selection"].pop("chosen_noisy_score")
            data = json.dumps(record, sort_keys=True).encode()
        if path.name == "bundle.json":   # the card's and the bundle's digests cover the stamps replaced above
            record = json.loads(data)
            record.pop("model_card_sha256"), record.pop("bundle_sha256")
            data = json.dumps(record, sort_keys=True).encode()
        view[str(path.relative_to(folder))] = data
    return view, stamps


@pytest.mark.slow   # two runs, one of them trains a candidate: ~30 s on 2 shared cores
def test_two_selections_with_different_repetitions_cannot_be_told_apart(tmp_path, monkeypatch, capfd):
    """Papernot & Steinke's guarantee needs T secret. Two runs through the command line, with reproducible noise
    chosen so that one makes one repetition (the public model, nothing trained) and the other two (a grid entry
    trained, then the public model released, by a score-noise margin far above any Dice difference): their
    console output, warnings, file set, file contents (but the released noisy score and the run's random
    release id) and file times are the same; the ledger record carries no time, results.json no wall time, and
    every file and folder of a run has one modification time."""
    import warnings

    import task.learning.selection as selection
    from sim.cli import main

    central = _tiny_selection_world(monkeypatch)
    monkeypatch.setenv("FEDPATE_PHANTOM_WORKERS", "1")
    realised, trained = [], []
    real_sample, real_train = selection.sample_repetitions, central.train_segmentation
    monkeypatch.setattr(selection, "sample_repetitions", lambda *a, **k: realised.append(real_sample(*a, **k))
                        or realised[-1])
    monkeypatch.setattr(central, "train_segmentation", lambda *a, **k: trained.append(1) or real_train(*a, **k))
    runs = []
    for seed in (0, 12):   # found by drawing T, the candidates and the score noise of each seed's streams
        folder = tmp_path / f"seed-{seed}"
        realised.clear(), trained.clear(), capfd.readouterr()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            status = main(["central", "--method", "dp-sgd", "--preset", "tiny", "--out", str(folder), "--epsilon",
                           "8", "--epochs", "1", "--no-augment", "--device", "cpu", "--seed", str(seed),
                           "--reproducible-noise", "--selection", "private", "--selection-mean", "3",
                           "--selection-score-noise", "100"])
        stdout, stderr = capfd.readouterr()
        assert status == 0, stderr
        record = Ledger.load(folder / "ledger.jsonl").records()[0]
        prefix = record["release_id"].rsplit(":", 1)[0]
        view, stamps = _folder_view(folder, prefix)
        runs.append({"T": realised[0], "trained": len(trained), "stdout": stdout.replace(str(folder), "<out>"),
                     "stderr": stderr, "warnings": [str(w.message) for w in seen], "record": record,
                     "results": json.loads((folder / "results.json").read_text()),
                     "view": view, "stamps": stamps,
                     "times": {p.stat().st_mtime for p in (folder, *folder.rglob("*"))}})
    one, two = runs
    assert (one["T"], one["trained"]) == (1, 0) and (two["T"], two["trained"]) == (2, 1)   # the premise
    assert one["results"]["selection"]["chosen_candidate"] == two["results"]["selection"]["chosen_candidate"] \
        == "the public model, unchanged"
    assert one["stderr"] == two["stderr"] and "private selection" in one["stderr"]
    assert "repetition" not in one["stderr"] + two["stderr"] and "setting" not in one["stderr"] + two["stderr"]
    assert one["stdout"] == two["stdout"] and one["warnings"] == two["warnings"]
    assert one["view"].keys() == two["view"].keys() and one["view"] == two["view"]
    for run in runs:
        assert run["record"]["time"] is None and run["results"]["wall_seconds"] is None
        assert len(run["times"]) == 1   # the ledger (written before the repetitions) no earlier than the model
        # the model card's creation stamp (the only time written in a file) is that same end of the run
        (mtime,) = run["times"]
        assert {time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)).encode() for t in (mtime, mtime - 1)} \
            >= run["stamps"] and len(run["stamps"]) == 1
