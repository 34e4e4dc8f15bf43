"""Every name the product's code reads is defined: pyflakes over the five packages finds no undefined name.

A refactor that renames a parameter can leave a read of the old name in a path no unit test takes (it happened
in run_compare: found only by running the demo); this catches the whole class before anything runs."""

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import reporter as pyflakes_reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("clients", "server", "privacy", "task", "sim")


class _Collect(pyflakes_reporter.Reporter):
    def __init__(self):
        self.messages: list[str] = []

    def unexpectedError(self, filename, msg):
        self.messages.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        self.messages.append(str(message))


def undefined_names(paths) -> list[str]:
    collected = _Collect()
    for path in paths:
        pyflakes_api.checkPath(str(path), collected)
    return [m for m in collected.messages if "undefined name '" in m or "syntax" in m.lower()]


def test_no_undefined_names_in_the_product():
    paths = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    assert len(paths) > 50
    assert undefined_names(paths) == []


def test_the_check_finds_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def run(config):\n    return lifetime_epsilon\n")
    assert any("undefined name 'lifetime_epsilon'" in m for m in undefined_names([bad]))
