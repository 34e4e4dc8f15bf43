"""Every public entry point with more than five parameters documents them.

Public: a module-level function or a method of a module-level class whose name does not start with ``_``, in
the packages clients/, server/, privacy/, task/ and sim/. Parameters: positional and keyword-only ones, ``self`` /
``cls`` excluded; ``*args`` / ``**kwargs`` are not counted (they may still have an entry). Such a function's
docstring has a Google-style ``Args:`` section (as MONAI and Opacus write theirs) with one entry per parameter:
``name: ...``, ``name (type): ...``, or a joint entry ``a / b: ...`` for parameters that share one meaning.
``check_tree`` takes any checkout (``python tests/test_docstrings.py PATH``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("clients", "server", "privacy", "task", "sim")
#: more parameters than this and a public function needs an Args section
MAX_UNDOCUMENTED = 5
#: an entry's label: everything before its first colon (a ``(type)`` after the names is allowed)
_ENTRY = re.compile(r"^(?P<label>[^:]+?)\s*(\([^)]*\))?:(\s|$)")


def public_functions(tree: ast.Module):
    """(qualified name, node) of every public module-level function and method of a module-level class."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                    yield f"{node.name}.{sub.name}", sub


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Positional and keyword-only parameter names, without ``self`` / ``cls``."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return [name for name in names if name not in ("self", "cls")]


def args_section(doc: str) -> list[str] | None:
    """The lines of the docstring's ``Args:`` section (None when it has none): every line after ``Args:``
    indented deeper than it, up to the next line that is not (blank lines included)."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Args:":
            indent = len(line) - len(line.lstrip())
            section = []
            for following in lines[i + 1:]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                section.append(following)
            return section
    return None


def documented_names(section: list[str]) -> set[str]:
    """The parameter names the section's entries (its least indented lines) document."""
    filled = [line for line in section if line.strip()]
    if not filled:
        return set()
    indent = min(len(line) - len(line.lstrip()) for line in filled)
    names = set()
    for line in filled:
        if len(line) - len(line.lstrip()) != indent:
            continue   # an entry's continuation
        match = _ENTRY.match(line.strip())
        if match:
            names.update(part.strip().lstrip("*") for part in re.split(r"[/,]", match["label"]))
    return names


def check_tree(root: Path) -> list[str]:
    """One message per public function of ``root``'s packages that has more than five parameters and does not
    document them all in an Args section."""
    problems = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for name, node in public_functions(tree):
                params = parameters(node)
                if len(params) <= MAX_UNDOCUMENTED:
                    continue
                where = f"{path.relative_to(root)}:{node.lineno} {name}"
                section = args_section(ast.get_docstring(node) or "")
                if section is None:
                    problems.append(f"{where}: {len(params)} parameters and no Args: section")
                    continue
                documented = documented_names(section)
                problems += [f"{where}: Args: does not document {param!r}" for param in params
                             if param not in documented]
    return problems


def test_public_functions_with_many_parameters_document_them():
    problems = check_tree(REPO)
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_is_missing(tmp_path):
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "m.py").write_text('''
def documented(a, b, c, d, e, *rest, f=1, **where):
    """Doc.

    Args:
        a: one.
        b (int): two,
            continued -- c: is not an entry.
        c / d: shared.
        e, f: shared too.
        **where: the rest.
    """

def partly(a, b, c, d, e, f):
    """Doc.

    Args:
        a: one.
        b / c / d / e: more.

    Returns:
        f: not in the Args section.
    """

def bare(a, b, c, d, e, f):
    """No section."""

def _private(a, b, c, d, e, f):
    pass

def few(a, b, c, d, e, *args, **kwargs):
    pass

class Thing:
    def method(self, a, b, c, d, e, f):
        pass
''')
    problems = check_tree(tmp_path)
    assert len(problems) == 3, problems
    assert "partly" in problems[0] and "'f'" in problems[0]
    assert "bare" in problems[1] and "no Args" in problems[1]
    assert "Thing.method" in problems[2]


if __name__ == "__main__":
    found = check_tree(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    print("\n".join(found) or "every public function with more than five parameters documents them")
    sys.exit(1 if found else 0)
