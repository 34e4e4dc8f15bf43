"""The README a newcomer reads first, and the links between the documents.

The README opens with the two commands a fresh machine needs (install and run the demo; run the test suite), then
three lines of what fedpate is and for whom, then a map with one link per topic. It states no number by hand: a
number goes stale silently, so the README links to where the number is written from runs (docs/RESULTS.md). Every
relative link of the README and of docs/ points at a file that exists and, with an anchor, at a heading it has.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: the two commands, in order: what `.ci/run` runs too
INSTALL_AND_DEMO = "bash .ci/install && .venv/bin/fedpate demo"
TEST_SUITE = ".venv/bin/python -m pytest"
#: words of the README's prose that hold a digit and are names, not measurements
NAMED_DIGITS = {"3-D"}

_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")


def _commands(block: str) -> list[str]:
    """The command lines of a fenced shell block, comments and blank lines left out."""
    lines = block.strip("`").split("\n", 1)[1].rsplit("```", 1)[0].splitlines()
    return [line.split("  #", 1)[0].strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _sections(text: str) -> tuple[str, str, str]:
    """(title, the first fenced block, everything after it) of the README."""
    title, rest = text.split("\n", 1)
    block = _FENCE.search(rest)
    assert block is not None, "the README has no fenced block"
    assert not rest[:block.start()].strip(), f"text before the commands: {rest[:block.start()].strip()[:80]!r}"
    return title, block.group(0), rest[block.end():]


def test_the_readme_opens_with_the_two_commands_a_fresh_machine_needs():
    title, block, _ = _sections(README.read_text(encoding="utf-8"))
    assert title == "# fedpate"
    assert block.startswith("```bash\n")
    assert _commands(block) == [INSTALL_AND_DEMO, TEST_SUITE]
    # the commands stay true: CI installs the same way and runs the same test command, and `demo` is a command
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "bash .ci/install || exit 1" in ci and TEST_SUITE in ci
    from sim.cli import build_parser

    parser = build_parser()
    demo = shlex.split(INSTALL_AND_DEMO.split("&&")[1])[1:]
    assert parser.parse_args(demo).command == "demo"


def test_then_three_lines_and_a_map_with_one_link_a_topic():
    _, _, after = _sections(README.read_text(encoding="utf-8"))
    lines = [line for line in after.splitlines() if line.strip()]
    table = [i for i, line in enumerate(lines) if line.startswith("|")]
    assert table and table[0] == 3, f"expected three lines before the map, got {table[:1]}: {lines[:4]}"
    prose = " ".join(lines[:3])
    assert "anchored" in prose and "PCA or an autoencoder" not in prose   # what the demo runs
    rows = lines[table[0] + 2:]
    assert rows and all(row.startswith("|") for row in rows), "the map ends the README"
    assert all(_LINK.search(row.split("|")[2]) for row in rows), rows
    linked = " ".join(rows)
    for topic in ("docs/RESULTS.md", "#what-the-demo-does", "#commands", "#the-real-scan-check",
                  "#predicting-new-scans", "docs/DEPLOYMENT.md", "docs/PRIVACY.md"):
        assert topic in linked, topic


def numbers_by_hand(text: str) -> list[str]:
    """Words of ``text``'s prose holding a digit: code blocks, inline code and link targets left out (a link's
    text is prose, and checked)."""
    prose = _INLINE_CODE.sub("", _FENCE.sub("", text))
    prose = _LINK.sub(lambda m: m.group("text"), prose)
    return [word for word in re.findall(r"\S*\d\S*", prose) if word.strip(".,;:()") not in NAMED_DIGITS]


def test_the_readme_states_no_number_by_hand():
    found = numbers_by_hand(README.read_text(encoding="utf-8"))
    assert not found, f"the README states numbers by hand (link to docs/RESULTS.md instead): {found}"


def test_the_number_check_catches_a_measurement():
    assert numbers_by_hand("the demo takes 11-20 minutes, 0.83 Dice") == ["11-20", "0.83"]
    assert numbers_by_hand("trains 3-D U-Nets ([how long](docs/RESULTS.md#cost)) `bash .ci/run2`") == []


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def _documents() -> list[Path]:
    found = [README] + sorted((REPO / "docs").rglob("*.md"))
    for folder in ("experiments", "benchmarks"):
        found += sorted((REPO / folder).rglob("*.md"))
    return found


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` whose file, or whose anchor's heading, does not exist."""
    problems = []
    for match in _LINK.finditer(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        target = match.group("target")
        if re.match(r"[a-z]+:", target):
            continue   # a web address or mailto: not this test's business
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file) if file else path
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _headings(resolved):
            problems.append(f"{target}: no heading with that anchor")
    return problems


@pytest.mark.parametrize("path", _documents(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path):
    problems = broken_links(path)
    assert not problems, f"{path.relative_to(REPO)}: " + "; ".join(problems)


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A title\n\n## Cost\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#cost) [title](a.md#a-title) [gone](c.md) [no](a.md#price) [web](https://x.org)\n")
    assert broken_links(page) == ["c.md: no such file", "a.md#price: no heading with that anchor"]
    assert github_anchor("GPU: `--device` and `--precision`") == "gpu---device-and---precision"


RESULTS = REPO / "docs" / "RESULTS.md"
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def opening_lines(text: str) -> list[str]:
    """The lines of a results document's first section, its heading and HTML comments left out."""
    title, rest = text.split("\n", 1)
    assert title.startswith("# "), title
    section = rest.lstrip("\n")
    assert section.startswith("## In ten lines\n"), f"the first section is {section.splitlines()[0]!r}"
    body = _COMMENT.sub("", section.split("\n", 1)[1].split("\n## ", 1)[0])
    return [line for line in body.splitlines() if line.strip()]


def test_results_opens_with_at_most_ten_lines_and_ends_with_how_it_was_made():
    text = RESULTS.read_text(encoding="utf-8")
    opening = opening_lines(text)
    assert 0 < len(opening) <= 10, opening
    said = " ".join(opening).lower()
    for topic in ("compared", "pick", "phantom", "real", "case", "cost"):
        assert topic in said, topic
    last = text.rsplit("\n## ", 1)[1]
    assert last.startswith("How these tables were made") and "results_tables:command begin" in last


def test_the_opening_check_catches_a_long_or_missing_summary():
    eleven = "# R\n\n## In ten lines\n\n" + "".join(f"- line {i}\n" for i in range(11)) + "\n## Next\n"
    assert len(opening_lines(eleven)) == 11
    with pytest.raises(AssertionError, match="first section"):
        opening_lines("# R\n\nProvenance first.\n\n## In ten lines\n")
