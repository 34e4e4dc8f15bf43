"""Every option a run cannot honour is refused before any work: before the device, the data, the public model
or the ledger is touched, in one line that names the flag, and with no file left behind (a ledger left by a
run that then failed would make its folder refuse the rerun)."""

from __future__ import annotations

import pytest

from privacy.errors import PrivacyError
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test as soon as a command starts work: every command resolves its device first."""
    import task.learning.device
    import sim.runners.central as central
    import sim.runners.compare   # noqa: F401  imported before the patch: a module that binds resolve_device at
    import sim.runners.simulation  # noqa: F401  import must keep the real one for the tests that run after this

    def started(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(task.learning.device, "resolve_device", started)
    monkeypatch.setattr(central, "load_central_data", started)
    monkeypatch.setattr(central, "public_start", started)


# refused by the parser: one flag, one value
PARSER_REFUSALS = [
    ("central", ["--method", "dp-sgd", "--epsilon", "0"], "--epsilon"),
    ("central", ["--method", "dp-sgd", "--epsilon", "nan"], "--epsilon"),
    ("central", ["--method", "dp-sgd", "--epsilon", "inf"], "--epsilon"),
    ("central", ["--method", "nonprivate", "--epsilon", "-1"], "--epsilon"),
    ("central", ["--method", "dp-sgd", "--delta", "2"], "--delta"),
    ("central", ["--method", "dp-sgd", "--delta", "0"], "--delta"),
    ("central", ["--method", "dp-sgd", "--seed", "-1"], "--seed"),
    ("central", ["--method", "dp-sgd", "--epochs", "0"], "--epochs"),
    ("central", ["--method", "dp-sgd", "--batch-size", "0"], "--batch-size"),
    ("central", ["--method", "dp-sgd", "--learning-rate", "-1"], "--learning-rate"),
    ("central", ["--method", "dp-sgd", "--max-grad-norm", "0"], "--max-grad-norm"),
    ("central", ["--method", "dp-sgd", "--noise-mode", "fixed", "--noise-multiplier", "0"], "--noise-multiplier"),
    ("central", ["--method", "dp-sgd", "--augmentation-multiplicity", "0"], "--augmentation-multiplicity"),
    ("central", ["--method", "dp-sgd", "--ema-decay", "2"], "--ema-decay"),
    ("central", ["--method", "dp-sgd", "--selection", "private", "--selection-heldout", "1.5"], "--selection-heldout"),
    ("central", ["--method", "dp-sgd", "--selection", "private", "--selection-score-noise", "0"],
     "--selection-score-noise"),
    ("central", ["--method", "dp-sgd", "--selection", "private", "--selection-mean", "0.5"], "--selection-mean"),
    ("central", ["--method", "dp-sgd", "--selection", "private", "--selection-shape", "abc"], "--selection-shape"),
    ("central", ["--method", "dp-sgd", "--selection", "private", "--selection-shape", "-1"], "--selection-shape"),
    ("simulate", ["--method", "dp-fedavg", "--epsilon", "0"], "--epsilon"),
    ("simulate", ["--method", "pate-pca", "--delta", "2"], "--delta"),
    ("simulate", ["--method", "pate-pca", "--seed", "-1"], "--seed"),
    ("compare", ["--delta", "2"], "--delta"),
    ("compare", ["--seed", "-1"], "--seed"),
    ("demo", ["--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize("command,argv,flag", PARSER_REFUSALS, ids=[" ".join([c, *a]) for c, a, _ in PARSER_REFUSALS])
def test_a_bad_value_is_refused_by_the_parser_naming_its_flag(tmp_path, capsys, no_work, command, argv, flag):
    from sim.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        main([command, "--preset", "tiny", "--out", str(out), *argv])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"fedpate {command}: error: argument {flag}") and "expected" in error
    assert not out.exists()


# refused when the run's settings are put together: values that are wrong only in combination
CONFIG_REFUSALS = [
    (["--selection", "private", "--selection-mean", "1"], "--selection-mean"),                      # geometric
    (["--selection", "private", "--selection-mean", "1", "--selection-shape", "0"], "--selection-mean"),   # log.
    (["--noise-mode", "schedule"], "--schedule"),
    (["--sampling", "shuffle", "--relation", "add-remove"], "--relation"),
    (["--selection", "private", "--noise-mode", "fixed"], "--selection private"),
    (["--data", "/no/such/folder"], "--data"),
]


@pytest.mark.parametrize("argv,flag", CONFIG_REFUSALS, ids=[" ".join(a) for a, _ in CONFIG_REFUSALS])
def test_a_bad_combination_is_refused_before_any_work_naming_its_flag(tmp_path, capsys, no_work, argv, flag):
    from sim.cli import main

    out = tmp_path / "run"
    status = main(["central", "--method", "dp-sgd", "--preset", "tiny", "--out", str(out), *argv])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1 and error[0].startswith(f"fedpate central: error: {flag}")
    assert not out.exists()


def test_the_config_refuses_what_the_command_line_would(tmp_path):
    """Scripts and the comparison runner build CentralConfig directly: the same checks, the same flag names."""
    from task.errors import UserError
    from sim.runners.central import CentralConfig
    from task.learning.selection import SelectionConfig

    for options, flag in (({"epsilon": 0.0}, "--epsilon"), ({"delta": 2.0}, "--delta"), ({"seed": -1}, "--seed"),
                          ({"epochs": 0}, "--epochs"), ({"max_grad_norm": 0.0}, "--max-grad-norm"),
                          ({"levers": {"ema_decay": 1.0}}, "--ema-decay"),
                          ({"selection": "private", "selection_config": SelectionConfig(mean=1.0, shape=0.0)},
                           "--selection-mean")):
        with pytest.raises(UserError, match=f"^{flag}"):
            CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "run", **options)
    assert not (tmp_path / "run").exists()


def test_selection_mean_one_is_refused_before_the_charge():
    """A truncated negative binomial of mean 1 does not exist (γ < 1 gives mean > 1): refused before the
    ledger is charged, by the selection and by the event itself."""
    from test_private_selection import _inner, _selection

    from privacy.events import RepeatAndSelectEvent
    from task.errors import UserError
    from task.learning.selection import SelectionConfig

    for shape in (1.0, 0.0, 0.5):
        ledger = Ledger(None)
        calls = []
        with pytest.raises(UserError, match="--selection-mean"):
            _selection(BudgetGuard(ledger, 8.0, 1e-3), NoiseSource.reproducible(0), scores={}, calls=calls,
                       config=SelectionConfig(mean=1.0, shape=shape))
        assert len(ledger) == 0 and calls == []
        with pytest.raises(PrivacyError, match="mean > 1"):
            RepeatAndSelectEvent(_inner(), 1.0, shape)
    RepeatAndSelectEvent(_inner(), 1.0, None)   # a Poisson of mean 1 is a distribution: still accepted


def test_a_selection_the_budget_cannot_pay_for_is_refused_before_the_public_model(tmp_path, monkeypatch):
    """The selection's plan needs only the pooled patients' count: a score noise too small for the budget (the
    default 0.05 with one held-out patient) is refused before the public model is trained or the ledger made."""
    import sim.runners.central as central
    from task.errors import UserError
    from synthetic_worlds import pooled_world

    def started(*args, **kwargs):
        raise AssertionError("the public model was trained for a run that cannot happen")

    monkeypatch.setattr(central, "public_start", started)
    monkeypatch.setattr(central, "load_central_data",
                        lambda preset, seed=0, data=None, progress=True, **kw: pooled_world(preset, seed, n_train=6,
                                                                                          n_test=2))
    out = tmp_path / "run"
    with pytest.raises(UserError, match="--selection private: .*score noise"):
        central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=out, epsilon=8.0,
                                                     progress=False, selection="private"))
    # the folder holds at most the start's settings record (which binds nothing): no public model, no ledger
    assert not (out / "public-model.pt").exists() and not (out / "ledger.jsonl").exists()


# impossible secure-sum parameters: every hospital would refuse, nothing would be released, and the public model
# would ship under the secure method's name -- refused in one line before any work
SECURE_REFUSALS = [
    (["compare", "--methods", "pate-anchored-secure", "--epsilons", "8", "--secure-threshold", "99"],
     "threshold 99 exceeds"),
    (["simulate", "--method", "pate-anchored-secure", "--secure-threshold", "1"], "threshold 1 must be at least 2"),
    (["simulate", "--method", "pate-anchored-secure", "--hospitals", "1"], "a secure sum needs at least 2"),
    (["compare", "--methods", "dp-fedavg-secure", "--epsilons", "1", "--hospitals", "1"],
     "a secure sum needs at least 2"),
    (["simulate", "--method", "dp-fedavg-secure", "--secure-colluders", "2"], "leave no honest noise share"),
    (["simulate", "--method", "pate-anchored-secure", "--secure-dropouts", "1"], "exceeds the 1 hospitals left"),
]


@pytest.mark.parametrize("argv,said", SECURE_REFUSALS, ids=[" ".join(a) for a, _ in SECURE_REFUSALS])
def test_impossible_secure_parameters_are_refused_before_any_work(tmp_path, capsys, no_work, argv, said):
    from sim.cli import main

    out = tmp_path / "run"
    status = main([*argv, "--preset", "tiny", "--out", str(out)])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1 and error[0].startswith(f"fedpate {argv[0]}: error: secure aggregation")
    assert said in error[0] and "--secure-threshold" in error[0], error
    assert not out.exists()


def test_a_secure_setting_the_hospitals_accept_is_not_refused():
    from task.settings.runconfig import RunSettings
    from task.wire.secagg import check_secure_settings

    check_secure_settings(4, 1, 1, None)    # the smallest threshold the hospitals accept: 3 of 4, 3 survivors
    check_secure_settings(5, 1, 1, 4)
    RunSettings(method="pate-anchored", hospitals=1)   # a trusted method sums nothing securely


def test_a_pate_cell_that_released_nothing_fails_and_ships_no_model(tmp_path, monkeypatch):
    """Every hospital refused (or every batch failed): the student would be the public model under a private name.
    The run fails after the query phase, before a student is trained or anything is written."""
    from types import SimpleNamespace

    import server.pate as pate
    from task.errors import UserError

    def never(*args, **kwargs):
        raise AssertionError("a student was trained on no released query")

    monkeypatch.setattr(pate, "pretrain_public_model", lambda world, preset, config: SimpleNamespace(start=None))
    monkeypatch.setattr(pate, "train_teachers", lambda transport, preset, config, start: None)
    monkeypatch.setattr(pate, "plan_release", lambda *args: None)
    monkeypatch.setattr(pate, "run_secure_query_phase", lambda *args: (
        pate.QueryPhase(unreleased=list(range(8))), None))
    monkeypatch.setattr(pate, "decode_and_train_student", never)
    transport = SimpleNamespace(deployed={})
    config = pate.PateConfig("pate-anchored-secure", 8.0, 1e-3, seed=0, diagnostics=False)
    with pytest.raises(UserError, match=r"^pate-anchored-secure at epsilon 8: no query was released \(every query "
                                        r"batch failed \(8 queries"):
        pate.run_pate(transport, None, None, config, tmp_path / "run")
    assert not (tmp_path / "run" / "results.json").exists() and not (tmp_path / "run" / "model").exists()


def test_a_fixed_noise_that_affords_no_epoch_is_refused_before_the_public_model(tmp_path, monkeypatch):
    """``--noise-mode fixed --noise-multiplier 0.3 --epsilon 0.05``: one epoch costs far more than the budget, so
    training would stop before its first step and the start model would ship, uncharged, as DP-SGD's. Refused in
    one line naming the flags, before the public model is trained or a ledger is made."""
    import sim.runners.central as central
    from task.errors import UserError
    from synthetic_worlds import pooled_world

    def started(*args, **kwargs):
        raise AssertionError("the public model was trained for a run that cannot happen")

    monkeypatch.setattr(central, "public_start", started)
    monkeypatch.setattr(central, "load_central_data",
                        lambda preset, seed=0, data=None, progress=True, **kw: pooled_world(preset, seed, n_train=6,
                                                                                          n_test=2))
    out = tmp_path / "run"
    for mode in ({"noise_mode": "fixed"}, {"noise_mode": "schedule", "schedule": "exp"}):
        with pytest.raises(UserError, match=r"^--noise-multiplier 0.3: one epoch .* more than --epsilon 0.05"):
            central.run_central(central.CentralConfig.of(method="dp-sgd", preset="tiny", out=out, epsilon=0.05,
                                                         noise_multiplier=0.3, progress=False, **mode))
        assert not (out / "public-model.pt").exists() and not (out / "ledger.jsonl").exists()


def test_dp_sgd_that_trained_no_epoch_ships_no_model(tmp_path, monkeypatch):
    """Whatever stopped it (a lifetime budget already spent elsewhere), DP-SGD that charged no epoch releases
    nothing: the start model is not written as DP-SGD's."""
    from types import SimpleNamespace

    import sim.runners.central as central
    from privacy.errors import BudgetExceeded

    run = SimpleNamespace(config=central.CentralConfig.of(method="dp-sgd", preset="tiny", out=tmp_path / "run"),
                          out=tmp_path / "run")
    untrained = SimpleNamespace(epochs_completed=0, stopped_reason="budget spent: the next epoch would exceed it")
    monkeypatch.setattr(central, "prepare_run", lambda config: run)
    monkeypatch.setattr(central, "_train_grid", lambda run: ([({}, untrained, None)], None))
    monkeypatch.setattr(central, "write_run", lambda *a, **k: pytest.fail("a model was written"))
    with pytest.raises(BudgetExceeded, match="no epoch fitted the budget .*budget spent"):
        central.run_central(run.config)


def test_the_first_epoch_check_agrees_with_the_guard_at_the_budgets_edge():
    """The fast estimate decides only far from the budget; near it the guard's own check decides, as at the
    charge: a budget 2 % above one epoch's ε passes, 2 % below is refused."""
    from privacy.accountants import epsilon_spent
    from task.learning.dpsgd import DPConfig, _epoch_event, check_first_epoch, steps_per_epoch
    from task.errors import UserError

    steps = steps_per_epoch(34, 2)
    probe = DPConfig(mode="fixed", epsilon=8.0, delta=1e-3, noise_multiplier=2.0, max_grad_norm=4.0)
    epoch = epsilon_spent([_epoch_event(probe, 1.0 / steps, 2.0, steps)], 1e-3)[0]
    check_first_epoch(DPConfig(mode="fixed", epsilon=1.02 * epoch, delta=1e-3, noise_multiplier=2.0,
                               max_grad_norm=4.0), 34, 2)
    with pytest.raises(UserError, match="^--noise-multiplier 2: one epoch"):
        check_first_epoch(DPConfig(mode="fixed", epsilon=0.98 * epoch, delta=1e-3, noise_multiplier=2.0,
                                   max_grad_norm=4.0), 34, 2)
