"""What may import what: a walk over the source of the package and of the checkout's other folders.

Inside the installed package (`vlmrun/`, `processors/`, `web/`), imports run downward and never in a
circle. `processors/` and `web/` install as `vlmrun.processors` and `vlmrun.web` (pyproject's
package-dir), so their modules are named that way here. The floors, top to bottom
(docs/architecture.md): api / cli / server / web / jobs / ray -> engine -> executor -> models,
multimodal -> layers, cache -> processors, loader, config, configs, forward_batch. A module may import modules
of its own floor and of any floor below, never of a floor above. Neither modules nor the parts of the
table (`FLOORS`' keys: a package or a module) may import each other in a circle.

Beside it, the checkout holds folders that are never installed (`MAY_IMPORT`): the package imports
none of them; `testing/` (what tests, benchmarks and training share) imports only the package;
`bench/` and `training/` import the package and `testing/`, never `tests/` and never each other;
`tests/` imports anything. A script is a module of `bench/` or `training/` with an
`if __name__ == "__main__":` block (run as `python -m bench.NAME`): no module of those folders imports
one, so scripts share code only through modules that are not scripts (`bench.common`); a test may
import a script to check its functions. No module edits `sys.path`.

The source is parsed with `ast`, nothing is imported, and every import statement counts: at module
level, inside functions (lazy imports) and under `if TYPE_CHECKING`. Imports by string
(`importlib.import_module(name)`, as the model registry does) are not seen.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"vlmrun": "vlmrun", "vlmrun.processors": "processors", "vlmrun.web": "web"}  # name -> folder, as pyproject ships them
CHECKOUT = {"testing": "testing", "bench": "bench", "training": "training", "tests": "tests"}  # never installed

# Top-level name -> the top-level names its modules may import (vlmrun: the installed package, all of it).
MAY_IMPORT: dict[str, set[str]] = {
    "vlmrun": {"vlmrun"},
    "testing": {"vlmrun", "testing"},
    "bench": {"vlmrun", "testing", "bench"},
    "training": {"vlmrun", "testing", "training"},
    "tests": {"vlmrun", "testing", "bench", "training", "tests"},
}
SCRIPT_FOLDERS = ("bench", "training")  # where a module with a __main__ block is a script, imported by no module there

# Module prefix -> floor (higher floors import lower ones). A key covers that module and everything
# under it; the longest key wins. A module under no other key falls under "vlmrun": the top floor,
# which nothing below may import, so a new module must be given its floor here before they can.
# The keys are packages and the top-level modules of vlmrun/: a module inside a package has its
# package's floor (what a lower floor needs moves into a leaf package of that floor, as the feature
# configs that vlmrun.config holds live in vlmrun.configs); test_the_floor_table_has_no_exceptions.
FLOORS: dict[str, int] = {
    "vlmrun": 6, "vlmrun.api": 6, "vlmrun.cli": 6, "vlmrun.server": 6, "vlmrun.web": 6, "vlmrun.jobs": 6,
    "vlmrun.ray": 6, "vlmrun.shape_scenes": 6, "vlmrun.feed": 6,
    "vlmrun.request_output": 6, "vlmrun.beam_search": 6, "vlmrun.llm_options": 6, "vlmrun.llm_metrics": 6, "vlmrun.llm_calls": 6,
    "vlmrun.logprobs": 1,
    "vlmrun.engine": 5,
    "vlmrun.executor": 4,
    "vlmrun.models": 3, "vlmrun.multimodal": 3, "vlmrun.quantization": 3, "vlmrun.lora": 3,
    "vlmrun.layers": 2, "vlmrun.cache": 2, "vlmrun.spec_decode": 2,
    "vlmrun.processors": 1, "vlmrun.loader": 1, "vlmrun.config": 1, "vlmrun.configs": 1, "vlmrun.forward_batch": 1,
    "vlmrun.host_to_device": 1, "vlmrun.generation_config": 1,
    "vlmrun.sampling_params": 1, "vlmrun.sampling_fields": 1, "vlmrun.default_model": 1, "vlmrun.families": 1, "vlmrun.threads": 1, "vlmrun.parallel": 1, "vlmrun.structured": 1,
    "vlmrun.pooling": 1,
}


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` (both module names), first at `path:line`."""

    source: str
    target: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


# ------------------------------------------------------------------------------------ the import graph


def module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of `packages` (name -> folder) under `root`."""
    files: dict[str, Path] = {}
    for package, folder in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [package, *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is one of `modules` (None: not ours)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The modules of ours that one import statement in `module` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [t for t in (_known(n, modules) for n in names) if t]
    base = node.module or ""
    if node.level:  # relative: start from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    found = []
    for alias in node.names:  # `from pkg import mod` names a module; `from mod import name` the module itself
        target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules)
        if target:
            found.append(target)
    return found


def import_graph(root: Path, packages: dict[str, str]) -> list[Edge]:
    """Every (importer, imported) pair of modules of `packages`, with where it first happens."""
    modules = module_files(root, packages)
    edges: dict[tuple[str, str], Edge] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        nodes = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
                       key=lambda n: n.lineno)
        for node in nodes:
            for target in _targets(node, module, path.name == "__init__.py", modules):
                if target != module and (module, target) not in edges:
                    edges[(module, target)] = Edge(module, target, str(path.relative_to(root)), node.lineno)
    return list(edges.values())


# ------------------------------------------------------------------------------------ the rules


def part_of(module: str, floors: dict[str, int]) -> str:
    """The key of `floors` that covers `module` (the longest one)."""
    keys = [k for k in floors if module == k or module.startswith(k + ".")]
    if not keys:
        raise KeyError(f"{module} is under no key of the floor table")
    return max(keys, key=len)


def upward_imports(edges: list[Edge], floors: dict[str, int]) -> list[str]:
    found = []
    for e in edges:
        low, high = part_of(e.source, floors), part_of(e.target, floors)
        if floors[high] > floors[low]:
            found.append(f"upward import: {e.source} ({low}, floor {floors[low]}) imports {e.target} "
                         f"({high}, floor {floors[high]}) at {e.where()}")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each strongly connected group of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(min(group), set(group), graph) for group in groups]


def _cycle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside `group` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group always has one


def import_cycles(edges: list[Edge], floors: dict[str, int]) -> list[str]:
    """Cycles between modules, and between the parts of the floor table (packages that import each other)."""
    found = []
    for kind, name in (("module", lambda m: m), ("package", lambda m: part_of(m, floors))):
        graph: dict[str, set[str]] = defaultdict(set)
        first: dict[tuple[str, str], Edge] = {}
        for e in edges:
            a, b = name(e.source), name(e.target)
            if a != b:
                graph[a].add(b)
                first.setdefault((a, b), e)
        for cycle in sorted(_cycles(graph)):
            steps = [first[(a, b)] for a, b in zip(cycle, cycle[1:])]
            via = "; ".join(f"{s.source} -> {s.target} at {s.where()}" for s in steps)
            found.append(f"{kind} cycle: {' -> '.join(cycle)} ({via})")
    return found


def violations(root: Path, packages: dict[str, str], floors: dict[str, int]) -> list[str]:
    edges = import_graph(root, packages)
    return upward_imports(edges, floors) + import_cycles(edges, floors)


def floor_exceptions(floors: dict[str, int], modules: dict[str, Path], roots: set[str]) -> list[str]:
    """Keys of `floors` that are no module of `modules`, and keys below the top level (not a root
    package nor a module or package right inside one) whose floor differs from their package's."""
    found = []
    for key, floor in floors.items():
        if key not in modules:
            found.append(f"{key} (floor {floor}) names no module or package")
            continue
        package = key.rpartition(".")[0]
        if key in roots or package in roots:
            continue
        outer = part_of(package, floors)
        if floors[outer] != floor:
            found.append(f"{key} has floor {floor} inside {outer} (floor {floors[outer]}): a module takes its "
                         "package's floor; move what a lower floor needs into a leaf package of that floor")
    return found


def is_script(tree: ast.Module) -> bool:
    """Whether a module has a top-level `if __name__ == "__main__":` block."""
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)):
            return True
    return False


def edits_sys_path(tree: ast.Module) -> int | None:
    """The line of the first `sys.path` attribute in a module (an insert, an append, an assignment), or None."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys"):
            return node.lineno
    return None


def checkout_violations(root: Path, packages: dict[str, str], may_import: dict[str, set[str]],
                        script_folders: tuple[str, ...]) -> list[str]:
    """Imports across the checkout's top-level folders that `may_import` forbids, imports of a script
    by a module of `script_folders`, and `sys.path` edits."""
    modules = module_files(root, packages)
    trees = {name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for name, path in modules.items()}
    scripts = {name for name, tree in trees.items() if name.split(".")[0] in script_folders and is_script(tree)}
    found = []
    for e in import_graph(root, packages):
        source, target = e.source.split(".")[0], e.target.split(".")[0]
        if target not in may_import[source]:
            found.append(f"{e.source} imports {e.target} at {e.where()}: {source} may import only "
                         f"{', '.join(sorted(may_import[source]))}")
        elif e.target in scripts and source in script_folders:
            found.append(f"{e.source} imports the script {e.target} at {e.where()}: share code through a module "
                         "that is no script")
    for name, tree in trees.items():
        if (line := edits_sys_path(tree)) is not None:
            found.append(f"{name} edits sys.path at {modules[name].relative_to(root)}:{line}")
    return found


# ------------------------------------------------------------------------------------ the tests


def test_imports_run_downward_and_never_in_a_circle() -> None:
    found = violations(REPO, PACKAGES, FLOORS)
    assert not found, f"{len(found)} import rule violation(s):\n" + "\n".join(found)


def test_the_floor_table_has_no_exceptions() -> None:
    """No module inside a package gets a floor of its own (the table's keys: packages and top-level modules)."""
    found = floor_exceptions(FLOORS, module_files(REPO, PACKAGES), set(PACKAGES))
    assert not found, "\n".join(found)


EXECUTOR_INTERFACE = "vlmrun.executor.base"
EXECUTORS = ("vlmrun.executor.model_runner", "vlmrun.executor.overlap", "vlmrun.executor.distributed",
             "vlmrun.executor.ray_executor")  # the modules of the classes that implement it


def imported_by(module: str, edges: list[Edge]) -> set[str]:
    """Every module `module` imports, directly or through others."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.source].add(e.target)
    seen: set[str] = set()
    frontier = [module]
    while frontier:
        frontier = [t for m in frontier for t in graph[m] if t not in seen]
        seen.update(frontier)
    return seen


def test_the_executor_interface_imports_no_implementation() -> None:
    """executor/base.py (the `Executor` protocol) reaches none of its implementations, not even through
    the records it names (executor/step_input.py, executor/step_output.py)."""
    reached = imported_by(EXECUTOR_INTERFACE, import_graph(REPO, PACKAGES))
    assert reached and not reached & set(EXECUTORS), sorted(reached & set(EXECUTORS))


def test_the_floor_check_catches_a_module_with_a_floor_of_its_own(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "", "pkg/feature/__init__.py": "",
                      "pkg/feature/config.py": "", "pkg/feature/run.py": "", "pkg/feature/sub/__init__.py": ""})
    modules = module_files(tmp_path, {"pkg": "pkg"})
    floors = {"pkg": 3, "pkg.top": 1, "pkg.feature": 2, "pkg.feature.config": 1, "pkg.feature.run": 2,
              "pkg.feature.sub": 1, "pkg.gone": 1}
    assert floor_exceptions(floors, modules, {"pkg"}) == [
        "pkg.feature.config has floor 1 inside pkg.feature (floor 2): a module takes its package's floor; move "
        "what a lower floor needs into a leaf package of that floor",
        "pkg.feature.sub has floor 1 inside pkg.feature (floor 2): a module takes its package's floor; move what "
        "a lower floor needs into a leaf package of that floor",
        "pkg.gone (floor 1) names no module or package",
    ]
    del floors["pkg.feature.config"], floors["pkg.feature.sub"], floors["pkg.gone"]
    assert floor_exceptions(floors, modules, {"pkg"}) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_walk_catches_upward_imports_and_cycles(tmp_path: Path) -> None:
    """A fake package: a lazy upward import, a relative import cycle, a package cycle, and clean imports."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/top.py": "from pkg.low import base\nimport pkg.mid.a\n",
        "pkg/low/__init__.py": "",
        "pkg/low/base.py": "import os\n\ndef f():\n    from pkg import top  # lazy, still upward\n",
        "pkg/mid/__init__.py": "",
        "pkg/mid/a.py": "from . import b\nfrom pkg.side import s\n",
        "pkg/mid/b.py": "from .a import thing\n",
        "pkg/side.py": "from pkg.mid import b as s\n",
    })
    floors = {"pkg": 3, "pkg.mid": 2, "pkg.side": 2, "pkg.low": 1}
    found = violations(tmp_path, {"pkg": "pkg"}, floors)
    assert found == [
        "upward import: pkg.low.base (pkg.low, floor 1) imports pkg.top (pkg, floor 3) at pkg/low/base.py:4",
        "module cycle: pkg.low.base -> pkg.top -> pkg.low.base "
        "(pkg.low.base -> pkg.top at pkg/low/base.py:4; pkg.top -> pkg.low.base at pkg/top.py:1)",
        "module cycle: pkg.mid.a -> pkg.mid.b -> pkg.mid.a "
        "(pkg.mid.a -> pkg.mid.b at pkg/mid/a.py:1; pkg.mid.b -> pkg.mid.a at pkg/mid/b.py:1)",
        "package cycle: pkg -> pkg.low -> pkg "
        "(pkg.top -> pkg.low.base at pkg/top.py:1; pkg.low.base -> pkg.top at pkg/low/base.py:4)",
        "package cycle: pkg.mid -> pkg.side -> pkg.mid "
        "(pkg.mid.a -> pkg.side at pkg/mid/a.py:2; pkg.side -> pkg.mid.b at pkg/side.py:1)",
    ]
    _write(tmp_path, {"pkg/low/base.py": "import os\n", "pkg/mid/b.py": "x = 1\n", "pkg/side.py": "y = 2\n"})
    assert violations(tmp_path, {"pkg": "pkg"}, floors) == []


def test_the_checkout_folders_import_only_what_they_may() -> None:
    found = checkout_violations(REPO, {**PACKAGES, **CHECKOUT}, MAY_IMPORT, SCRIPT_FOLDERS)
    assert not found, f"{len(found)} import rule violation(s):\n" + "\n".join(found)


def test_the_walk_catches_imports_across_folders_script_imports_and_path_edits(tmp_path: Path) -> None:
    """A fake checkout: the package importing testing lazily, testing importing bench, a script importing
    another script and training, training importing a script and tests, a sys.path edit; and the imports
    that are allowed (bench.common from a script and from a test, training and a script from a test)."""
    _write(tmp_path, {
        "vlmrun/__init__.py": "",
        "vlmrun/core.py": "def f():\n    from testing.fixtures import x\n",
        "testing/__init__.py": "",
        "testing/fixtures.py": "import vlmrun.core\nfrom bench.common import timer\n",
        "bench/__init__.py": "",
        "bench/common.py": "from vlmrun import core\nfrom testing import fixtures\n",
        "bench/one.py": "from bench.common import timer\nfrom bench.two import main\nimport training.recipe\n"
                        "if __name__ == '__main__':\n    main()\n",
        "bench/two.py": "import sys\nsys.path.insert(0, '.')\n\ndef main():\n    pass\n\n"
                        "if __name__ == '__main__':\n    main()\n",
        "training/__init__.py": "",
        "training/recipe.py": "from tests.helpers import h\nfrom training import run\n",
        "training/run.py": "if __name__ == '__main__':\n    pass\n",
        "tests/__init__.py": "",
        "tests/helpers.py": "h = 1\n",
        "tests/test_it.py": "from bench.common import timer\nfrom training import recipe\nfrom bench import one\n",
    })
    folders = {name: name for name in MAY_IMPORT}
    found = checkout_violations(tmp_path, folders, MAY_IMPORT, SCRIPT_FOLDERS)
    assert found == [
        "vlmrun.core imports testing.fixtures at vlmrun/core.py:2: vlmrun may import only vlmrun",
        "testing.fixtures imports bench.common at testing/fixtures.py:2: testing may import only testing, vlmrun",
        "bench.one imports the script bench.two at bench/one.py:2: share code through a module that is no script",
        "bench.one imports training.recipe at bench/one.py:3: bench may import only bench, testing, vlmrun",
        "training.recipe imports tests.helpers at training/recipe.py:1: training may import only testing, training, "
        "vlmrun",
        "training.recipe imports the script training.run at training/recipe.py:2: share code through a module that "
        "is no script",
        "bench.two edits sys.path at bench/two.py:2",
    ]
    _write(tmp_path, {"vlmrun/core.py": "x = 1\n", "testing/fixtures.py": "import vlmrun.core\n",
                      "bench/one.py": "from bench.common import timer\nif __name__ == '__main__':\n    pass\n",
                      "bench/two.py": "if __name__ == '__main__':\n    pass\n", "training/recipe.py": "y = 2\n",
                      "tests/test_it.py": "from bench.common import timer\nfrom training import recipe\n"
                                          "from bench import one\n"})
    assert checkout_violations(tmp_path, folders, MAY_IMPORT, SCRIPT_FOLDERS) == []


def test_model_files_never_import_each_other() -> None:
    """A family file (vlmrun/models/<family>.py) imports shared blocks, never another family's file."""
    models = REPO / "vlmrun" / "models"
    families = {p.stem for p in models.glob("*.py")} - {"__init__", "base", "registry", "weights"}
    found = []
    for path in sorted(models.glob("*.py")):
        if path.stem not in families:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n.startswith("vlmrun.models.") and n.split(".")[2] in families - {path.stem}]
    assert families and not found, "\n".join(found)
