"""``fedpate ... --help`` is written for the person at the terminal: every option says what it does, no
Sphinx markup or source paths, no option that is always refused, and the demo says which preset it runs."""

import argparse
import re

import pytest

from sim.cli import build_parser, main


def _commands(parser, path=("fedpate",)):
    """(path, parser) of every command and subcommand."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


def _help(*path) -> str:
    return dict(_commands(build_parser()))[("fedpate", *path)].format_help()


def test_every_option_of_every_command_has_help():
    missing = [f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
               for path, parser in _commands(build_parser()) for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and action.help is None]
    assert not missing, missing


@pytest.mark.parametrize("path", [(), ("data",), ("deploy",), ("demo",), ("compare",), ("central",),
                                  ("simulate",), ("predict",), ("privacy",), ("deploy", "local"),
                                  ("data", "phantoms")])
def test_help_has_no_sphinx_markup_or_source_paths(path):
    text = _help(*path)
    assert "``" not in text and ":class:" not in text and ":func:" not in text, text
    assert not re.search(r"\bsim/|\.py\b", text), text


def test_demo_help_names_the_preset_it_runs():
    text = " ".join(_help("demo").split())
    assert "--preset quick" not in text              # it runs the preset given, not always quick
    assert "tiny = a smoke test" in text and "quick = the demo's size" in text


def test_the_presets_size_in_the_help_is_read_from_the_preset(monkeypatch):
    """K and the grid are written once, in task.settings.presets: the help states what the preset holds."""
    import sim.commands.common as common
    from task.settings.presets import get_preset

    quick = get_preset("quick")
    said = (f"{quick.federation.hospitals} hospitals x {quick.federation.teachers_per_hospital} teachers on a "
            f"{'x'.join(map(str, quick.world.grid))} grid")
    assert said in common.PRESET_SIZES["quick"]
    # another preset's numbers give another text: nothing is written by hand
    monkeypatch.setattr(type(quick.federation), "teachers_per_hospital", property(lambda self: 7), raising=False)
    assert "x 7 teachers" in common._size_of("quick")


def test_compare_help_hides_epsilon_and_still_refuses_it_in_one_line(capsys, tmp_path):
    text = _help("compare")
    assert not re.search(r"--epsilon\b(?!s)", text), text
    assert "--epsilons" in text
    status = main(["compare", "--preset", "tiny", "--epsilon", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and "--epsilons 2" in err and "Traceback" not in err


def test_every_option_with_a_default_says_what_it_is():
    """An option a user may leave out says, in its help, what it then is (``default: ...``)."""
    silent = [f"{' '.join(path)} {'/'.join(action.option_strings)} (default {action.default!r})"
              for path, parser in _commands(build_parser()) for action in parser._actions
              if action.option_strings and not isinstance(action, (argparse._SubParsersAction, argparse._HelpAction))
              and action.help != argparse.SUPPRESS and not action.required
              and action.default not in (None, False, [], ()) and "default" not in (action.help or "").lower()]
    assert not silent, silent


def test_no_choice_or_default_is_shown_as_an_enum_repr(capsys):
    """argparse names a bad value's choices by their repr: an option enum's would read
    ``<CompareTask.SEGMENTATION: 'segmentation'>``. Every choice and default is the string a user types, and a
    parser error is one line (the usage is one --help away)."""
    from enum import Enum

    enums = [f"{' '.join(path)} {'/'.join(action.option_strings)}"
             for path, parser in _commands(build_parser()) for action in parser._actions
             if not isinstance(action, argparse._SubParsersAction)
             and (isinstance(action.default, Enum) or any(isinstance(c, Enum) for c in action.choices or ()))]
    assert not enums, enums
    for argv in (["compare", "--out", "x", "--task", "nope"], ["simulate", "--out", "x", "--engine", "nope"],
                 ["central", "--out", "x", "--method", "nope"], ["demo", "--init", "nope"]):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("\n") == 1 and "<" not in err and "usage" not in err, err


def test_the_docs_state_every_flower_variable_and_every_data_layout_a_hospital_may_use():
    """The guide's Flower-app section exports every variable the product sets for Flower (an update check
    left on waits on the network); DEPLOYMENT.md's ``data-dir`` takes every layout ``--data`` reads."""
    from pathlib import Path

    from sim.deployment.flower_cli import FLOWER_ENV

    root = Path(__file__).resolve().parents[1]
    guide = (root / "docs" / "GUIDE.md").read_text().split("## As a Flower app", 1)[1].split("\n## ", 1)[0]
    assert all(key in guide for key in FLOWER_ENV), [key for key in FLOWER_ENV if key not in guide]
    row = next(line for line in (root / "docs" / "DEPLOYMENT.md").read_text().splitlines()
               if line.startswith("| `data-dir` |"))
    assert "MSD" in row and "BraTS" in row
