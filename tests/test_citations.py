"""Citations a reader of the repository can follow.

Code, tests, benchmarks and documentation cite papers by authors, year and arXiv id or DOI, rules of the
privacy model by ``docs/PRIVACY.md`` and a default fixed by a measurement by its note in ``docs/decisions/``.
They never cite what a reader cannot open: issue numbers, the work sessions that produced a change, numbered
items of a plan, section numbers of a document that is not in the repository, or files outside it.

The patterns are assembled from pieces so that this file does not match them itself. Product words that merely
contain the same letters (a device string, the folder a comparison keeps its shared models in) stay allowed:
:func:`test_product_terms_and_citations_pass`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: what is scanned: every text file under these folders, and these files
SCANNED_DIRS = ("clients", "server", "privacy", "task", "sim", "benchmarks", "experiments", "tests", "docs", ".ci")
SCANNED_FILES = ("README.md", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".json", ".sh", ""}

#: Files still to be rewritten: they are being reworked on another branch, and their references with them. Empty
#: this list as that work lands; a file listed here that no longer trips a pattern fails
#: :func:`test_pending_files_exist_and_still_need_the_rewrite`, so the list cannot outlive its reason.
PENDING_FILES: frozenset[str] = frozenset()

_ISSUE = "iss" + "ue"
_SECTION_WORD = "SP" + "EC"
_SHARED = "sha" + "red/"

#: name -> compiled pattern; each names a kind of reference a reader of the repository cannot follow
PATTERNS = {
    "issue number": re.compile(r"\b" + _ISSUE + r"s?[ -]#?\d", re.IGNORECASE),
    "issue in brackets": re.compile(r"\(" + _ISSUE + r"s?\b", re.IGNORECASE),
    "document section": re.compile(r"\b" + _SECTION_WORD + r"\b"),
    "section sign": re.compile("\u00a7"),
    "path outside the repository": re.compile(r"\.\./" + _SHARED + r"|(?<![\w.])" + _SHARED + r"|/wo" + r"rk/"),
    "field notes": re.compile("FIELD" + "_NOTES"),
    "work session": re.compile(r"\bsess" + r"ions? \d", re.IGNORECASE),
    "plan item": re.compile(r"\bite" + r"ms? \d", re.IGNORECASE),
    "research world": re.compile(r"\bresear" + r"ch r\d", re.IGNORECASE),
}


def scanned_files() -> list[Path]:
    """Every text file the check covers (caches and binary files skipped), sorted."""
    paths = [REPO / name for name in SCANNED_FILES if (REPO / name).is_file()]
    for folder in SCANNED_DIRS:
        root = REPO / folder
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
                paths.append(path)
    return sorted(paths)


def references_in(text: str) -> list[tuple[int, str, str]]:
    """``(line number, pattern name, line)`` for every reference a reader cannot follow."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for name, pattern in PATTERNS.items():
            if pattern.search(line):
                found.append((number, name, line.strip()))
    return found


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_no_reference_a_reader_cannot_follow():
    problems = []
    for path in scanned_files():
        if _relative(path) in PENDING_FILES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        problems += [f"{_relative(path)}:{number}: {name}: {line[:120]}" for number, name, line in references_in(text)]
    assert not problems, "references a reader cannot follow:\n" + "\n".join(problems)


def test_pending_files_exist_and_still_need_the_rewrite():
    """The allow-list names files that exist and still trip a pattern: empty it as they are rewritten."""
    stale = [name for name in sorted(PENDING_FILES)
             if not (REPO / name).is_file() or not references_in((REPO / name).read_text(encoding="utf-8"))]
    assert not stale, f"remove from PENDING_FILES (missing or already clean): {stale}"


def test_the_scan_covers_the_package_docs_and_tests():
    names = {_relative(path) for path in scanned_files()}
    for expected in ("README.md", "pyproject.toml", "docs/PRIVACY.md", "task/settings/presets.py", "tests/test_citations.py"):
        assert expected in names


@pytest.mark.parametrize("line", [
    "see " + _ISSUE + " 28, ite" + "m 5",
    "(" + _ISSUE + "s 17, " + _SECTION_WORD + " \u00a711)",
    _SECTION_WORD + " \u00a73 eq. 7",
    _ISSUE.capitalize() + " 28: the demo",
    "an " + _ISSUE + "-18 lever",
    "papers in `../" + _SHARED + "papers/`",
    "measured in sess" + "ion 5",
    "the world study (resear" + "ch r1)",
    "/wo" + "rk/research/r2",
    "FIELD" + "_NOTES: keep losses per-sample",
])
def test_each_kind_of_reference_is_caught(line):
    assert references_in(line), line


@pytest.mark.parametrize("line", [
    "check_device_" + _SECTION_WORD.lower() + "(device, option)",
    "runs/s0/_" + _SHARED + "K-128/public-model.pt",
    "dp_accounting's REPLACE_" + _SECTION_WORD + "IAL",
    "Fay, Sjölund & Oechtering, Sec. 3 (docs/PRIVACY.md, \"Neighbouring relations\")",
    "an issue of scale",
])
def test_product_terms_and_citations_pass(line):
    assert not references_in(line), line
