"""The secure methods' threat model (t colluders, d dropouts, the Shamir threshold) travels from the command line
and Flower's run config to both secure protocols and to the simulated hospitals' policy."""

from __future__ import annotations

import pytest


def test_run_settings_carry_the_threat_model_to_the_server_and_the_simulated_hospitals():
    from task.settings.runconfig import RunSettings

    settings = RunSettings(method="pate-anchored-secure", hospitals=6, secure_colluders=1, secure_dropouts=2,
                           secure_threshold=4)
    assert settings.threat_model == {"colluders": 1, "dropouts": 2, "threshold": 4}
    assert settings.hospital_privacy_config()["secure_policy"] == {"colluders": 1, "dropouts": 2}
    assert RunSettings(method="pate-anchored-secure").threat_model == {"colluders": 0, "dropouts": 0}
    # Flower's run config: one key per field, and back
    config = settings.to_run_config()
    assert (config["secure-colluders"], config["secure-dropouts"], config["secure-threshold"]) == (1, 2, 4)
    assert RunSettings.from_run_config(config).threat_model == settings.threat_model


@pytest.mark.parametrize("field", ["secure_colluders", "secure_dropouts", "secure_threshold"])
def test_a_negative_threat_setting_is_refused_in_one_line(field):
    from task.errors import UserError
    from task.settings.runconfig import RunSettings

    with pytest.raises(UserError, match=rf"^{field.replace('_', '-')}: expected a non-negative integer, got -1$"):
        RunSettings(method="pate-anchored-secure", **{field: -1})


def test_both_secure_protocols_receive_the_declared_threat_model(monkeypatch, tmp_path):
    import server.protocols as protocols
    from task.settings.runconfig import Cell, RunSettings

    seen = {}
    monkeypatch.setattr(protocols, "run_pate", lambda transport, world, preset, config, out, noise: seen.update(
        pate=config.secure) or {})
    monkeypatch.setattr(protocols, "run_dpfedavg_secure", lambda transport, world, preset, config, out, init_weights:
                        seen.update(fedavg=dict(config.threat)) or {})
    settings = RunSettings(method="pate-anchored-secure", hospitals=4, secure_colluders=1, secure_dropouts=1)
    protocols.run_pate_cell(None, None, settings, Cell("pate-anchored-secure", 8.0, str(tmp_path / "a")))
    protocols.run_dpfedavg_secure_cell(None, None, settings, Cell("dp-fedavg-secure", 8.0, str(tmp_path / "b"),
                                                                  init="scratch"))
    assert seen == {"pate": {"colluders": 1, "dropouts": 1}, "fedavg": {"colluders": 1, "dropouts": 1}}
    protocols.run_pate_cell(None, None, settings, Cell("pate-anchored", 8.0, str(tmp_path / "c")))
    assert seen["pate"] is None                       # a trusted method has no threat model to declare


def test_the_command_line_options_reach_the_comparison(tmp_path):
    from sim.cli import build_parser
    from sim.commands.common import threat_options

    args = build_parser().parse_args(["compare", "--out", str(tmp_path), "--secure-colluders", "1",
                                      "--secure-dropouts", "1"])
    assert threat_options(args) == {"secure_colluders": 1, "secure_dropouts": 1, "secure_threshold": None}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--out", str(tmp_path), "--secure-dropouts", "-1"])


@pytest.mark.parametrize("flag, expected", [([], set()), (["--secure"], {"pate-anchored-secure", "dp-fedavg-secure"})])
def test_the_demo_shows_the_secure_variants_when_asked(tmp_path, monkeypatch, flag, expected):
    import sim.runners.compare as compare
    from sim.cli import main

    asked = {}
    monkeypatch.setattr(compare, "run_compare", lambda config: asked.update(methods=list(config.methods))
                        or tmp_path / "report.md")
    assert main(["demo", "--preset", "tiny", "--out", str(tmp_path / "demo"), "--no-progress", *flag]) == 0
    assert {"pate-anchored", "dp-fedavg", "dp-sgd-central"} <= set(asked["methods"])
    assert {m for m in asked["methods"] if m.endswith("-secure")} == expected


@pytest.mark.parametrize("hospitals, colluders, dropouts, threshold, match", [
    (4, 0, 1, 2, "must exceed half of 4 participants"),     # a server lying about dropouts could unmask one
    (5, 1, 1, 3, "must exceed half of 5 participants"),     # colluders hold both kinds of share: 2t > H + c
    (3, 1, 0, 1, "above the 1 colluder"),
    (4, 0, 1, 4, "exceeds the 3 hospitals left"),
    (2, 1, 1, None, "leave no honest noise share"),
])
def test_a_threat_model_the_hospitals_cannot_hold_is_refused_in_one_line_before_any_work(
        tmp_path, capsys, monkeypatch, hospitals, colluders, dropouts, threshold, match):
    import sim.runners.compare as compare
    from sim.cli import main
    from task.errors import UserError
    from task.settings.runconfig import RunSettings

    with pytest.raises(UserError, match=match):
        RunSettings(method="dp-fedavg-secure", hospitals=hospitals, secure_colluders=colluders,
                    secure_dropouts=dropouts, secure_threshold=threshold)
    RunSettings(method="dp-fedavg", hospitals=hospitals, secure_colluders=colluders, secure_dropouts=dropouts,
                secure_threshold=threshold)   # a trusted method never runs a secure sum: nothing to refuse
    monkeypatch.setattr(compare, "run_compare", lambda config: pytest.fail("the comparison started"))
    flags = ["--secure-colluders", str(colluders), "--secure-dropouts", str(dropouts),
             *(["--secure-threshold", str(threshold)] if threshold else [])]
    assert main(["compare", "--preset", "tiny", "--methods", "pate-anchored-secure", "--epsilons", "8", "--hospitals",
                 str(hospitals), "--out", str(tmp_path / "c"), "--no-progress", *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert match in error and "\n" not in error


def test_the_smallest_threshold_is_safe_and_the_default():
    from task.wire.secagg import smallest_threshold, threat_problem

    for hospitals in range(2, 12):
        for colluders in range(hospitals):
            for dropouts in range(hospitals):
                threshold = smallest_threshold(hospitals, colluders, dropouts)
                if threat_problem(hospitals, colluders, dropouts, None) is None:
                    assert threshold > colluders and (dropouts == 0 or 2 * threshold > hospitals + colluders)
                    assert threat_problem(hospitals, colluders, dropouts, threshold - 1) is not None \
                        or threshold == 2
