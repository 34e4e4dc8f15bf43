"""docs/ARCHITECTURE.md points at files that exist.

Its closing table, "Where things live" (columns: you look for | module | layer), names in its module column one or
more repository paths in backticks: a file (``task/settings/presets.py``) or a folder (``task/codecs/``). Every such path must
exist, so a row cannot outlive a file that was moved or removed. The rest of the page is held to the same rule for
the repository paths it names (a placeholder such as ``task/codecs/<kind>.py`` is skipped).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
TABLE_HEADING = "## Where things live"
COLUMNS = ("you look for", "module", "layer")
#: the top-level folders a repository path in the page starts with
TOP_LEVEL = ("privacy", "task", "server", "clients", "sim", "tests", "benchmarks", "experiments", "docs")

_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^[\w.\-]+(?:/[\w.\-]+)*(?:/|\.\w+)$")
_REPO_PATH = re.compile(r"(?<![\w/.])((?:" + "|".join(TOP_LEVEL) + r")/[\w./\-<>]*[\w/>])")


def table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the "Where things live" table (the header checked, the rule skipped)."""
    if TABLE_HEADING not in text:
        raise AssertionError(f"no {TABLE_HEADING!r} section")
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in section.splitlines() if line.strip().startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    if not rows or tuple(cell.lower() for cell in rows[0]) != COLUMNS:
        raise AssertionError(f"the table's columns must be {' | '.join(COLUMNS)}, got {rows[:1]}")
    return [row for row in rows[2:]]


def row_paths(row: list[str]) -> list[str]:
    """The repository paths (files or folders, in backticks) a row's module column names."""
    if len(row) != len(COLUMNS):
        raise AssertionError(f"row has {len(row)} cells, expected {len(COLUMNS)}: {row}")
    return [code for code in _CODE.findall(row[1]) if _PATH.match(code)]


def exists(path: str, root: Path = REPO) -> bool:
    """``path`` is in the checkout at ``root``; one ending in ``/`` must be a folder."""
    return (root / path).is_dir() if path.endswith("/") else (root / path).exists()


def missing_in_table(text: str, root: Path = REPO) -> list[str]:
    """Every table row whose module column names no path, or a path that is not in the checkout at ``root``."""
    problems = []
    for row in table_rows(text):
        paths = row_paths(row)
        if not paths:
            problems.append(f"row {row[0]!r} names no module path")
        problems += [f"row {row[0]!r}: {path} does not exist" for path in paths if not exists(path, root)]
    return problems


def missing_in_page(text: str, root: Path = REPO) -> list[str]:
    """Repository paths named anywhere in the page (in code spans or blocks) that do not exist."""
    problems = []
    for path in sorted(set(_REPO_PATH.findall(text))):
        if "<" in path or not re.search(r"(\.\w+|/)$", path):
            continue
        if not exists(path, root):
            problems.append(f"{path} does not exist")
    return problems


def test_every_row_of_the_table_names_paths_that_exist():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert len(table_rows(text)) >= 30
    assert missing_in_table(text) == []


def test_every_repository_path_the_page_names_exists():
    assert missing_in_page(ARCHITECTURE.read_text(encoding="utf-8")) == []


TOY_PAGE = """# toy

## Where things live

| you look for | module | layer |
|---|---|---|
| presets | `task/settings/presets.py` | 1 task |
| codecs | `task/codecs/` | 1 task |
| two files | `server/secure.py`, `server/no_such_module.py` | 2 server |
| a folder that is a file | `task/settings/presets.py/` | 1 task |
| nothing | the presets | 1 task |
"""


def test_the_check_fails_on_a_row_that_names_a_missing_file():
    problems = missing_in_table(TOY_PAGE)
    assert problems == ["row 'two files': server/no_such_module.py does not exist",
                        "row 'a folder that is a file': task/settings/presets.py/ does not exist",
                        "row 'nothing' names no module path"]
    assert missing_in_page(TOY_PAGE) == ["server/no_such_module.py does not exist",
                                         "task/settings/presets.py/ does not exist"]


def test_the_check_refuses_a_table_with_other_columns():
    with pytest.raises(AssertionError, match="columns"):
        table_rows("## Where things live\n\n| what | where |\n|---|---|\n| x | `task/io.py` |\n")
