"""Every function of the product stays readable: at most 8 parameters (self / cls not counted; a longer list
becomes a frozen config dataclass) and at most 100 lines (a longer body becomes named steps)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("privacy", "task", "server", "clients", "sim")
MAX_PARAMETERS = 8
MAX_LINES = 100


def _functions():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}", node


def _parameters(node) -> int:
    arguments = node.args
    positional = [a.arg for a in arguments.posonlyargs + arguments.args]
    count = len(positional) + len(arguments.kwonlyargs)
    return count - 1 if positional and positional[0] in ("self", "cls") else count


def test_the_scan_sees_the_product():
    assert sum(1 for _ in _functions()) > 500


def test_no_function_takes_more_than_eight_parameters():
    wide = [f"{where} ({_parameters(node)})" for where, node in _functions() if _parameters(node) > MAX_PARAMETERS]
    assert not wide, "take a config dataclass instead: " + ", ".join(wide)


def test_no_function_is_longer_than_a_hundred_lines():
    long = [f"{where} ({node.end_lineno - node.lineno + 1} lines)" for where, node in _functions()
            if node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, "split into named steps: " + ", ".join(long)


@pytest.mark.parametrize("source, parameters", [("def f(self, a, b): pass", 2), ("def f(a, *, b, c): pass", 3)])
def test_the_parameter_count_skips_self_only(source, parameters):
    assert _parameters(ast.parse(source).body[0]) == parameters
