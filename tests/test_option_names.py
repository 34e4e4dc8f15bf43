"""A bad engine, start, calibration or role is refused in one line that names the option and lists its choices
(``task.options.look_up_option``), and the names code compares against are enum members, not literals."""

import pytest

from sim.runners.compare import CompareConfig
from sim.runners.simulation import simulate
from task.errors import UserError
from task.settings.methods import Family, Method, Role, is_ceiling, is_pate, is_private, role_of
from task.options import Engine, Init
from task.settings.runconfig import RunSettings


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_a_bad_engine_or_init_lists_the_choices(tmp_path):
    with pytest.raises(UserError) as error:
        CompareConfig("tiny", ["public-only"], [1.0], tmp_path, engine="ray")
    assert _one_line(error).startswith("--engine: unknown value 'ray'; expected one of flower, runtime, inprocess")
    with pytest.raises(UserError) as error:
        CompareConfig("tiny", ["public-only"], [1.0], tmp_path, init="warm")
    assert _one_line(error).startswith("--init: unknown value 'warm'; expected one of public, scratch")
    with pytest.raises(UserError) as error:   # refused before a world is built or a hospital started
        simulate(RunSettings(preset="tiny"), engine="ray")
    assert "flower, runtime, inprocess" in _one_line(error)
    with pytest.raises(UserError) as error:
        RunSettings(preset="tiny", calibration="loose")
    assert _one_line(error).startswith("calibration: unknown value 'loose'; expected one of exact, paper")


def test_a_user_value_becomes_its_member(tmp_path):
    config = CompareConfig("tiny", ["public-only"], [1.0], tmp_path, engine="flower", init="scratch")
    assert config.engine is Engine.FLOWER and config.init is Init.SCRATCH
    assert RunSettings(preset="tiny", calibration="paper").calibration == "paper"


def test_roles_and_families_are_members_and_predicates():
    assert role_of("public-only") is Role.FLOOR and role_of("not-a-method") is None
    assert is_private("dp-fedavg") and not is_private("public-only") and not is_private(None)
    assert is_ceiling("nonprivate-central") and not is_ceiling("pate-ae")
    assert is_pate("pate-anchored-secure") and not is_pate("dp-fedavg-secure")
    # a record given its role as text keeps the member; a bad role names the choices
    assert Method("toy", "toy", "floor", runner="toy").role is Role.FLOOR
    with pytest.raises(ValueError, match="role must be one of private, floor, ceiling, got 'judge'"):
        Method("toy", Family.PATE, "judge", runner="toy")
