"""The layer rule of docs/ARCHITECTURE.md, read from the imports (ast, function-level ones included).

    0 privacy   <-   1 task (the shared ML core)   <-   2 server, clients   <-   3 sim (orchestration: runners,
                                                                                 deployment, commands, cli, reports)

A module imports only its own layer or below; server and clients never import each other; no import
cycle between these packages, nor between their rooms (a module, or a sub-package such as ``task/data/`` or
``task/learning/`` counted as one), nor between the modules inside one room (an import inside a function counts:
one there only to dodge a cycle hides it); flwr only in the Flower adapters; the command line's start-up stays free
of torch, monai and flwr. A setting is resolved once: the hospital (clients/) never reads a training setting from
its own preset (``preset.teacher``, ``preset.batch_size``, ``preset.learning_rate``, ``preset.dp_sgd``, ...) --
the server's request carries it whole. ``check_tree`` takes any checkout, so the rule can be checked on an older
tree too (``python tests/test_architecture.py PATH``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: each top-level package's layer
LAYERS = {"privacy": 0, "task": 1, "server": 2, "clients": 2, "sim": 3}
#: the parts of sim/ that are units of their own for the cycle check (all layer 3); the rest of sim (the
#: report modules) is the unit "sim"
SIM_PARTS = ("sim.runners", "sim.deployment", "sim.commands", "sim.cli")
#: the only modules that may import flwr: the two apps, the wire format they share, the SecAgg+ primitives,
#: the Flower transport, the in-process simulation engine (flwr.simulation.run_simulation) and the echo app
FLOWER_ADAPTERS = ("server.server_app", "server.flower_transport", "clients.client_app", "task.wire.flower_wire",
                   "task.wire.secagg", "sim.runners.simulation", "sim.deployment.echo_app")


def unit_of(module: str) -> str | None:
    """The unit a module belongs to for the layer rule (None: not part of fedpate)."""
    for name in SIM_PARTS:
        if module == name or module.startswith(name + "."):
            return name
    top = module.split(".")[0]
    return top if top in LAYERS else None


def layer_of(unit: str) -> int:
    return LAYERS[unit.split(".")[0]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, at any depth."""
    found = []
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.append((target, node.lineno))
            # ``from task import codecs`` imports the module task.codecs
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


def check_tree(root: Path) -> list[str]:
    """Every violation of the layer rule in the checkout at ``root``, one line per import statement."""
    problems: dict[tuple[str, str], str] = {}   # (where, rule) -> message: one line per import and rule
    edges = set()
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            source = unit_of(module)
            for target, line in imports_of(path, module):
                where = f"{path.relative_to(root)}:{line}"
                if target.split(".")[0] == "flwr" and not module.startswith(FLOWER_ADAPTERS):
                    problems.setdefault((where, "flwr"), f"{where}: {module} imports flwr (only the Flower "
                                                         f"adapters {', '.join(FLOWER_ADAPTERS)} may)")
                destination = unit_of(target)
                if destination is None or destination == source:
                    continue
                edges.add((source, destination))
                if layer_of(destination) > layer_of(source):
                    problems.setdefault((where, "upward"), f"{where}: {module} (layer {layer_of(source)}) imports "
                                                           f"{target} (layer {layer_of(destination)}): upward")
                elif {source, destination} == {"server", "clients"}:
                    problems.setdefault((where, "sideways"), f"{where}: {module} imports {target}: server and "
                                                             "clients never import each other")
    cycles = [f"import cycle between packages: {' -> '.join(cycle)}" for cycle in package_cycles(edges)]
    return list(problems.values()) + cycles + module_cycles(root) + hospital_recipe_reads(root)


def module_of_import(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
                     modules: set[str]) -> list[str]:
    """The fedpate modules an import statement runs (the deepest module each imported name is or is in)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else []))
        names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target for alias in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def runtime_imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import statement, inside a function) for every import that can run: all but those under
    ``if TYPE_CHECKING:`` (annotations only)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit_one(other, in_function)
                continue
            visit_one(child, in_function)

    def visit_one(child: ast.AST, in_function: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append((child, in_function))
        visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def module_cycles(root: Path) -> list[str]:
    """One line per group of fedpate rooms that import each other, at module level or inside a function -- a room
    is a module, or a sub-package below a top-level package (``task/data/``, ``task/learning/``, ``sim/runners/``)
    counted as one -- and one per group of modules inside one room that import each other."""
    paths = {module_name(path, root): path for package in LAYERS for path in sorted((root / package).rglob("*.py"))}
    packages = {module for module, path in paths.items() if path.name == "__init__.py"}

    def unit(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 and ".".join(parts[:2]) in packages else module

    rooms: dict[str, set[str]] = {}     # room -> the rooms it imports
    inside: dict[str, set[str]] = {}    # module -> the modules of its own room it imports
    where: dict[tuple[str, str], str] = {}
    for module, path in paths.items():
        for node, in_function in runtime_imports(ast.parse(path.read_text(), str(path))):
            for target in module_of_import(node, module, path.name == "__init__.py", set(paths)):
                a, b = unit(module), unit(target)
                edge = (a, b) if a != b else (module, target)
                (rooms if a != b else inside).setdefault(edge[0], set()).add(edge[1])
                where.setdefault(edge, f"{path.relative_to(root)}:{node.lineno}"
                                       + (" inside a function" if in_function else ""))
    cycles = []
    for graph in (rooms, inside):
        for group in strongly_connected(graph):
            cycle = _path_back({a: graph[a] & set(group) for a in group}, group[0])
            steps = [f"{a} ({where[(a, b)]})" for a, b in zip(cycle, cycle[1:])]
            cycles.append(f"import cycle between modules: {' -> '.join(steps)} -> {cycle[-1]}")
    return cycles


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted; sorted by first node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


#: the preset's training settings a hospital never reads from its own preset, and the request that carries each
#: (resolved once, by the server). Not the network (``unet``: the weights sent must fit it), nor what the hospital
#: decides itself (its grid and teachers when deployed, the δ of its lifetime ledger).
HOSPITAL_FORBIDDEN_SETTINGS = {
    "teacher": "TeacherTrainingRequest.RECIPE",
    "batch_size": "TeacherTrainingRequest.RECIPE, FedAvgRoundRequest.RECIPE",
    "learning_rate": "TeacherTrainingRequest.RECIPE, FedAvgRoundRequest.RECIPE",
    "dp_sgd": "FedAvgRoundRequest.RECIPE",
    "dp_fedavg": "FedAvgRoundRequest.RECIPE",
}


def hospital_recipe_reads(root: Path) -> list[str]:
    """Every place under clients/ that reads a training setting from a preset (``<...>preset.teacher``,
    ``<...>preset.batch_size``, or ``getattr(<...>preset, "teacher")``; :data:`HOSPITAL_FORBIDDEN_SETTINGS`): the
    server resolves it once and its request carries it whole."""
    found = []
    for path in sorted((root / "clients").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in HOSPITAL_FORBIDDEN_SETTINGS
                    and _names_a_preset(node.value)):
                setting = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and _names_a_preset(node.args[0])
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in HOSPITAL_FORBIDDEN_SETTINGS):
                setting = node.args[1].value
            else:
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: a hospital reads its own preset's {setting} "
                         f"(a training setting: the request carries it, {HOSPITAL_FORBIDDEN_SETTINGS[setting]})")
    return found


def _names_a_preset(node: ast.AST) -> bool:
    """Whether ``node`` is a preset: a name or an attribute called ``preset`` (``preset``, ``self.preset``)."""
    return (isinstance(node, ast.Name) and node.id == "preset") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "preset")


def package_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """One cycle through each group of packages that import each other (strongly connected components)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        path = _path_back(graph, start)
        if path:
            cycles.append(path)
            done.update(path)
    return cycles


def _path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one (breadth first, so the shortest)."""
    frontier, seen = [[start]], {start}
    while frontier:
        path = frontier.pop(0)
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(path + [nxt])
    return None


def test_the_tree_keeps_the_layer_rule():
    assert check_tree(REPO) == []


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    def write(name: str, text: str) -> None:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for package in ("privacy", "task", "task/learning", "task/settings", "server", "clients", "sim", "sim/runners",
                    "sim/deployment"):
        write(f"{package}/__init__.py", "")
    write("privacy/maths.py", "def f():\n    from task import world\n")           # upward, inside a function
    write("task/world.py", "from sim.runners.compare import run_compare\n")       # core -> orchestration
    write("task/wire/flower_wire.py", "import flwr.app\n")                      # an adapter: allowed
    write("server/app.py", "from clients.hospital import Hospital\n")           # server <-> clients
    write("server/results.py", "from sim.report import write_report\n")         # server -> sim's report module
    write("clients/hospital.py", "import flwr.app\n")                            # flwr outside the adapters
    write("clients/fallback.py", "def f(self):\n    return self.preset.teacher.epochs\n")   # a setting read twice
    write("clients/fallback_too.py", "def f(preset):\n    return getattr(preset, 'teacher')\n")
    write("clients/fallback_batch.py", "def f(self, request):\n    return request.batch_size or self.preset.batch_size\n")
    write("clients/fallback_clip.py", "def f(hospital):\n    return hospital.preset.dp_sgd.max_grad_norm\n")
    write("clients/network.py", "def f(self):\n    return self.preset.unet, self.preset.delta\n")   # not a recipe
    write("task/learning/training.py", "from task.learning.headgrad import check\n")   # in one room, dodged in
    write("task/learning/headgrad.py", "def f():\n    from task.learning.training import loss\n")   # a function
    write("task/settings/presets.py", "from task.data.shifts import SHIFTS\n")   # a room <-> a room, no module cycle
    write("task/data/__init__.py", "")
    write("task/data/shifts.py", "SHIFTS = ()\n")
    write("task/data/phantoms.py", "from task.settings.presets import get_preset\n")
    write("task/typed.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from task.world import World\n")
    write("sim/runners/compare.py", "from sim.deployment import local\n")
    write("sim/deployment/local.py", "from ..runners import compare\n")          # a cycle, relative import
    found = check_tree(tmp_path)
    problems = "\n".join(found)
    assert "privacy/maths.py:2: privacy.maths (layer 0) imports task (layer 1): upward" in problems
    assert "task.world (layer 1) imports sim.runners.compare (layer 3): upward" in problems
    assert "server.results (layer 2) imports sim.report (layer 3): upward" in problems
    assert "server and clients never import each other" in problems
    assert "clients.hospital imports flwr" in problems
    assert "import cycle between packages: sim.deployment -> sim.runners -> sim.deployment" in problems
    assert "task.wire.flower_wire imports flwr" not in problems
    assert "clients/fallback.py:2: a hospital reads its own preset's teacher" in problems
    assert "clients/fallback_too.py:2: a hospital reads its own preset's teacher" in problems
    assert "clients/fallback_batch.py:2: a hospital reads its own preset's batch_size" in problems
    assert "clients/fallback_clip.py:2: a hospital reads its own preset's dp_sgd" in problems
    assert "clients/network.py" not in problems
    assert ("import cycle between modules: task.learning.headgrad (task/learning/headgrad.py:2 inside a function) -> "
            "task.learning.training (task/learning/training.py:1) -> task.learning.headgrad") in problems
    assert ("import cycle between modules: task.data (task/data/phantoms.py:1) -> task.settings "
            "(task/settings/presets.py:1) -> task.data") in problems
    assert ("import cycle between modules: sim.deployment (sim/deployment/local.py:1) -> sim.runners "
            "(sim/runners/compare.py:1) -> sim.deployment") in problems   # the package cycle, module by module
    assert "task.typed" not in problems   # an import for annotations only (TYPE_CHECKING) closes no cycle
    assert len(found) == 13, problems


def test_the_command_line_starts_without_torch_monai_or_flwr():
    """``fedpate --help`` and ``fedpate privacy ...`` import only what they use (the heavy frameworks
    are imported lazily by the commands that train or run Flower)."""
    script = ("import sys\nfrom sim.cli import build_parser, main\nbuild_parser()\n"
              "main(['privacy', 'calibrate', '--epsilon', '1', '--delta', '1e-3', '--queries', '80', '--teachers', "
              "'8', '--compressor', 'ae', '--json', '--no-pld'])\n"
              "print(sorted(m for m in ('torch', 'monai', 'flwr', 'opacus') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


if __name__ == "__main__":   # check another checkout: python tests/test_architecture.py PATH
    found = check_tree(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    print("\n".join(found) or "the layer rule holds")
    sys.exit(1 if found else 0)
