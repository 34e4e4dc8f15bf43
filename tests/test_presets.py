"""The typed recipe (task.settings.presets): immutable presets, variants by with_changes, one-line errors naming the
setting, the option enums' lookup listing the choices, and the run config derived from RunSettings' fields."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from privacy.errors import PrivacyError
from privacy.options import Relation, Sampling, ScheduleFamily
from privacy.options import look_up_option as privacy_look_up
from task.errors import UserError
from task.options import Decoder, PcaMode, PublicStart, SplitScheme, Trainable, look_up_option
from task.settings.presets import (PRESETS, Codec, DpFedAvg, DpSetting, DpSgd, Federation, Preset, SelfTraining,
                                   Student, Teachers, World, get_preset, preset_reference)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_cannot_be_mutated(name):
    preset = get_preset(name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.epsilon = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.teacher.epochs = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.world.grid = (8, 8, 8)
    with pytest.raises(TypeError):
        PRESETS[name] = preset.with_changes(epsilon=1.0)
    with pytest.raises(TypeError):
        del PRESETS[name]
    assert not hasattr(preset, "extra") and get_preset(name) is PRESETS[name]


def test_a_variant_is_a_new_preset_and_leaves_the_registered_one_alone():
    tiny = get_preset("tiny")
    variant = tiny.with_changes(teacher=dict(epochs=9), codec=dict(anchored_intensity_bins=2), hospitals=3,
                                epsilon=2.0)
    assert (variant.teacher.epochs, variant.codec.anchored_intensity_bins, variant.hospitals, variant.epsilon) == \
        (9, 2, 3, 2.0)
    assert variant.teacher.trainable is tiny.teacher.trainable and variant.codec.ae_epochs == tiny.codec.ae_epochs
    assert PRESETS["tiny"].teacher.epochs == 3 and PRESETS["tiny"].hospitals == 2 and get_preset("tiny") == tiny
    # a whole group, or the shortcut next to the group, or dataclasses.replace for a top-level field
    assert tiny.with_changes(federation=Federation(hospitals=3, teachers_per_hospital=4, n_query=8)).teachers == 12
    assert dataclasses.replace(tiny, epsilon=2.0) == tiny.with_changes(epsilon=2.0)
    assert get_preset("tiny", hospitals=None) is tiny   # None overrides are ignored


def test_an_unknown_setting_is_refused_in_one_line_naming_it():
    with pytest.raises(UserError, match=r"^preset tiny: unknown setting 'teacher_epochs'; expected one of name, "
                                        r"world, .*hospitals, teachers_per_hospital, grid$"):
        get_preset("tiny", teacher_epochs=1)
    with pytest.raises(UserError, match=r"^teacher: unknown setting 'epoch'; expected one of epochs, trainable, "
                                        r"learning_rate, augment$"):
        get_preset("tiny").with_changes(teacher=dict(epoch=1))
    with pytest.raises(UserError, match=r"^--preset: unknown preset 'small'; expected one of tiny, quick, paper$"):
        get_preset("small")


@pytest.mark.parametrize("build, message", [
    (lambda: get_preset("tiny").with_changes(teacher=dict(trainable="heads")),
     r"^teacher\.trainable: unknown value 'heads'; expected one of all, decoder, head, bias, voxel-head, "
     r"voxel-head\+all$"),
    (lambda: get_preset("tiny").with_changes(codec=dict(anchored_decoder="argmax")),
     r"^codec\.anchored_decoder: unknown value 'argmax'; expected one of mass-matching, head-fit$"),
    (lambda: get_preset("tiny").with_changes(world=dict(split_scheme="random")),
     r"^world\.split_scheme: unknown value 'random'; expected one of institution, iid, dirichlet, paper$"),
    (lambda: get_preset("tiny").with_changes(hospitals=0), r"^federation\.hospitals: expected an integer >= 1, got 0$"),
    (lambda: get_preset("tiny").with_changes(grid=(16, 16)), r"^world\.grid: expected three positive integers"),
    (lambda: get_preset("tiny").with_changes(delta=1.0), r"^delta: expected a number in \(0, 1\), got 1\.0$"),
    (lambda: get_preset("tiny").with_changes(world=dict(public_shift="warp")), r"^world\.public_shift: expected"),
    (lambda: get_preset("tiny").with_changes(self_training=dict(temperature=0.0)),
     r"^self_training\.temperature: expected a positive number, got 0\.0$"),
    (lambda: DpFedAvg(grid=(DpSetting(epochs=2),)), r"^dp_fedavg\.grid entry: 'epochs' is not a dp_fedavg setting$"),
    (lambda: DpSgd(grid=({"learning_rate": -1.0},)), r"^settings grid entry: learning_rate: expected a positive"),
    (lambda: Teachers(epochs=1, augment="no"), r"^teacher\.augment: expected true or false, got 'no'$"),
    (lambda: Codec(anchored_shells=(5, -2)), r"^codec\.anchored_shells: expected two increasing integers"),
])
def test_a_bad_recipe_value_is_refused_when_the_recipe_is_built(build, message):
    with pytest.raises(UserError, match=message):
        build()


def test_option_strings_become_their_enums_and_stay_their_strings():
    preset = get_preset("quick").with_changes(public_start="self-trained", codec=dict(anchored_decoder="mass-matching"))
    assert preset.public_start is PublicStart.SELF_TRAINED and preset.codec.anchored_decoder is Decoder.MASS_MATCHING
    assert preset.teacher.trainable is Trainable.VOXEL_HEAD == "voxel-head"
    assert preset.world.split_scheme is SplitScheme.INSTITUTION
    assert preset.dp_sgd.grid == (DpSetting(learning_rate=1e-2, trainable=Trainable.VOXEL_HEAD),)
    assert preset.to_dict()["teacher"]["trainable"] == "voxel-head"


def test_the_lookup_lists_the_choices_in_one_line():
    assert look_up_option("add-remove", Relation, "relation") is Relation.ADD_REMOVE
    assert look_up_option(Sampling.SHUFFLE, Sampling, "--sampling") is Sampling.SHUFFLE
    with pytest.raises(UserError, match=r"^--sampling: unknown value 'uniform'; expected one of poisson, shuffle$"):
        look_up_option("uniform", Sampling, "--sampling")
    with pytest.raises(PrivacyError, match=r"^relation: unknown value 'swap'; expected one of replace-one, "
                                           r"add-remove, zero-out$"):
        privacy_look_up("swap", Relation, "relation")
    with pytest.raises(UserError, match=r"^pca_mode: unknown value 'exact'; expected one of public, paper, clip$"):
        look_up_option("exact", PcaMode, "pca_mode")
    with pytest.raises(PrivacyError, match=r"^family: unknown value 'cosine'; expected one of time, exponential, "
                                           r"step, polynomial, validation$"):
        privacy_look_up("cosine", ScheduleFamily, "family")


def test_a_variant_travels_as_its_reference_and_is_rebuilt_exactly():
    quick = get_preset("quick")
    assert quick.reference == "quick" and quick.changes == {}
    variant = quick.with_changes(codec=dict(anchored_intensity_bins=5), teacher=dict(epochs=3),
                                 dp_sgd=dict(grid=(DpSetting(learning_rate=2e-3, epochs=5),)))
    assert variant.reference.startswith("quick{") and "anchored_intensity_bins" in variant.reference
    assert get_preset(variant.reference) == variant and preset_reference(variant) == variant.reference
    assert Preset.from_dict(variant.to_dict()) == variant
    foreign = dataclasses.replace(quick, name="mine")
    with pytest.raises(UserError, match=r"^preset 'mine': not a registered preset or a variant of one"):
        preset_reference(foreign)
    with pytest.raises(UserError, match=r"^--preset: the changes after 'quick' are not JSON"):
        get_preset("quick{codec")


def test_compare_and_central_take_a_variant_and_keep_its_reference(tmp_path):
    from sim.runners.central import CentralConfig
    from sim.runners.compare import CompareConfig

    variant = get_preset("tiny").with_changes(dp_sgd=dict(grid=()))
    plan = CompareConfig(variant, ["public-only"], [8.0], tmp_path / "compare")
    assert plan.preset == variant.reference and plan.base_preset == variant
    central = CentralConfig.of(method="dp-sgd", preset=variant, out=tmp_path / "central")
    assert central.preset == variant.reference and get_preset(central.preset).dp_sgd.grid == ()


def test_the_defaults_live_in_the_groups():
    """A preset that names nothing gets each group's own defaults (one place each)."""
    paper = get_preset("paper")
    assert paper.teacher == Teachers(epochs=100) and paper.student == Student(epochs=100)
    assert paper.dp_sgd == DpSgd() and paper.dp_fedavg == DpFedAvg() and paper.self_training == SelfTraining()
    assert paper.public_start is PublicStart.REFERENCE and isinstance(paper.world, World)


def test_the_run_config_is_derived_from_the_run_settings_fields():
    from task.settings.runconfig import RunSettings, run_config_keys

    app_config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert list(app_config) and set(app_config) == set(run_config_keys())
    settings = RunSettings.from_run_config(app_config)
    assert RunSettings.from_run_config(settings.to_run_config()) == settings
    given = RunSettings(method="dp-fedavg", hospitals=3, query_timeout=5.0, reproducible_noise=True)
    config = given.to_run_config()
    assert config["hospitals"] == 3 and config["teachers-per-hospital"] == 0 and config["data"] == ""
    again = RunSettings.from_run_config(config)
    assert (again.hospitals, again.teachers_per_hospital, again.data, again.query_timeout,
            again.reproducible_noise) == (3, None, None, 5.0, True)



def test_the_cells_and_the_real_check_travel_typed_beside_the_run_config(tmp_path):
    """A comparison's cells are a tuple of Cell records and its real-scan check an open RealCheck: neither is a
    run-config key (Flower's run config holds scalars), both reach the ServerApp's settings as the in-process
    engines bind them in (``make_app``'s overrides); anything but Cell records is refused in one line."""
    from sim.runners.simulation import _settings_fields
    from task.errors import UserError
    from task.reporting.realcheck import RealCheck
    from task.settings.runconfig import Cell, RunSettings, run_config_keys

    cells = (Cell("pate-anchored", 8.0, str(tmp_path / "a")), Cell("dp-fedavg", 1.0, str(tmp_path / "b")))
    check = RealCheck(folders=(str(tmp_path),), cases=())
    settings = RunSettings(method="pate-anchored", epsilon=8.0, delta=1e-3, cells=list(cells), real_check=check)
    assert settings.cells == cells and settings.planned_cells() == cells
    config = settings.to_run_config()
    assert set(config) == set(run_config_keys()) and not {"cells", "real-check", "extra"} & set(config)
    assert all(isinstance(value, (str, int, float, bool)) for value in config.values())
    assert RunSettings.from_run_config(config) == settings.replace(cells=(), real_check=None)
    served = RunSettings.from_run_config(config, **_settings_fields(settings))   # what the ServerApp runs
    assert served == settings and served.cells == cells and served.real_check is check
    alone = RunSettings(method="dp-fedavg", epsilon=2.0, out=str(tmp_path / "c"))
    assert alone.planned_cells() == (Cell("dp-fedavg", 2.0, str(tmp_path / "c")),)
    with pytest.raises(UserError, match="cells: expected a sequence of task.settings.runconfig.Cell records"):
        RunSettings(cells=({"method": "pate-ae", "epsilon": 8.0, "out": "x"},))


def test_a_preset_is_resolved_once_per_process(monkeypatch):
    """The same name (or reference) and overrides give the same immutable Preset object: a reference's JSON is
    parsed once, however many layers ask for it; a bad name is still refused every time."""
    from task.settings import presets

    variant = get_preset("tiny", hospitals=3, teachers_per_hospital=2)
    parsed = []
    monkeypatch.setattr(presets.json, "loads", lambda text, _loads=presets.json.loads: parsed.append(text) or
                        _loads(text))
    presets._resolved_preset.cache_clear()   # as in a fresh process
    reference = variant.reference
    assert get_preset(reference) == variant and get_preset(reference) is get_preset(reference)
    assert len(parsed) == 1
    variant = get_preset("tiny", hospitals=3, teachers_per_hospital=2)
    assert get_preset("tiny", hospitals=3, teachers_per_hospital=2, delta=None) is variant
    assert get_preset("tiny", teacher={"epochs": 1}).teacher.epochs == 1   # a mapping override: resolved anew
    for _ in range(2):
        with pytest.raises(UserError, match="unknown preset"):
            get_preset("nope")

def test_the_cli_offers_exactly_the_enums_choices():
    """The CLI spells the choices itself (its help must not import the privacy core); this keeps them in step."""
    import argparse

    from sim.commands import central as command
    from task.learning.dpsgd import SCHEDULE_FAMILIES, schedule_family

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    central = parser._subparsers._group_actions[0].choices["central"]
    choices = {action.dest: tuple(action.choices) for action in central._actions if action.choices}
    assert choices["sampling"] == tuple(Sampling) and choices["relation"] == tuple(Relation)
    assert choices["trainable"] == tuple(Trainable) and choices["schedule"] == SCHEDULE_FAMILIES
    assert {schedule_family(name) for name in SCHEDULE_FAMILIES} == set(ScheduleFamily)
