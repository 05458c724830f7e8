"""What the checkout's code defines, read with `ast` (nothing imported): the index `tests/doc_symbols.py`
checks the docs against.

Modules are named as they import: `vlmrun.x.y` for `vlmrun/x/y.py`, `vlmrun.processors.x` and
`vlmrun.web.x` for `processors/x.py` and `web/x.py` (installed under vlmrun's name), and `bench.x`,
`training.x`, `testing.x`, `tests.x` for the checkout-only folders. For each module: its top-level
names (definitions, assignments, imports); for each class: its members (methods, class attributes and
fields, and the `self.x` attributes its methods assign) and bases; for each function and method: its
parameter names. Scripts' command-line flags are the string options of their `add_argument` calls.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

PACKAGE_ROOTS = {"vlmrun": "vlmrun", "processors": "vlmrun.processors", "web": "vlmrun.web",
                 "bench": "bench", "training": "training", "testing": "testing", "tests": "tests"}
SKIPPED_DIRS = {".git", ".venv", "build", "dist", "__pycache__", "node_modules"}


@dataclass
class Signature:
    """Parameter names of one function or method; `open_keywords` when it takes **kwargs."""

    params: set[str]
    open_keywords: bool


@dataclass
class ClassInfo:
    name: str
    module: str
    bases: list[str]
    members: set[str] = field(default_factory=set)
    fields: list[str] = field(default_factory=list)  # annotated class-level names, in order (dataclass fields)
    methods: dict[str, Signature] = field(default_factory=dict)


@dataclass
class CodeIndex:
    root: Path
    modules: dict[str, Path] = field(default_factory=dict)  # dotted module name -> file
    top_names: dict[str, dict[str, Optional[str]]] = field(default_factory=dict)  # module -> {name: source module}
    classes: dict[str, list[ClassInfo]] = field(default_factory=dict)  # simple name -> classes of that name
    functions: dict[str, list[Signature]] = field(default_factory=dict)  # simple name -> functions and methods
    paths: set[str] = field(default_factory=set)  # every file and folder, relative to root ("a/b.py", "a/")
    script_flags: dict[str, set[str]] = field(default_factory=dict)  # relative .py path -> its --flags
    script_imports: dict[str, set[str]] = field(default_factory=dict)  # relative .py path -> modules it imports
    identifiers: set[str] = field(default_factory=set)  # every name, attribute, parameter and keyword in the code

    @classmethod
    def build(cls, root: Path, unread: tuple[str, ...] = ()) -> "CodeIndex":
        """Index every file under `root`; the Python files in `unread` count as paths only."""
        index = cls(root)
        for path in _walk(root):
            rel = path.relative_to(root).as_posix()
            index.paths.add(rel + "/" if path.is_dir() else rel)
            if path.suffix == ".py" and rel not in unread:
                index._add_python_file(path, rel)
        return index

    # ---------------------------------------------------------------------------------- lookups

    def class_named(self, name: str) -> list[ClassInfo]:
        return self.classes.get(name, [])

    def class_members(self, info: ClassInfo, seen: Optional[set[str]] = None) -> set[str]:
        """Members of `info` and of its bases found in the index (by simple name)."""
        seen = seen if seen is not None else set()
        if info.name in seen:
            return set()
        seen.add(info.name)
        members = set(info.members)
        for base in info.bases:
            for parent in self.class_named(base):
                members |= self.class_members(parent, seen)
        return members

    def method_signatures(self, info: ClassInfo, method: str) -> list[Signature]:
        """`method` of `info`, else of the nearest bases that define it."""
        if method in info.methods:
            return [info.methods[method]]
        return [s for base in info.bases for parent in self.class_named(base) if parent is not info
                for s in self.method_signatures(parent, method)]

    def constructor_signatures(self, info: ClassInfo) -> list[Signature]:
        """What `Class(...)` accepts: its `__init__` (or a base's), else its fields (dataclass, NamedTuple)."""
        return self.method_signatures(info, "__init__") or [Signature(set(info.fields), open_keywords=False)]

    def resolve_module_attribute(self, dotted: str) -> Optional[str]:
        """Why `vlmrun.x.Name.member` does not resolve (None when it does): the longest known module
        prefix, then a top-level name of it (followed through imports), then a class member."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in self.modules:
                return self._resolve_in_module(module, parts[cut:], dotted)
        return f"no module {parts[0]!r}" if len(parts) == 1 else f"no module {'.'.join(parts[:2])!r}"

    # ---------------------------------------------------------------------------------- building

    def _add_python_file(self, path: Path, rel: str) -> None:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        module = _module_name(rel)
        if module is not None:
            self.modules[module] = path
            self.top_names[module] = _top_level_names(tree, module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(_class_info(node, module or rel))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(_signature(node))
        self.identifiers |= _identifiers(tree)
        flags = _argparse_flags(tree)
        if flags:
            self.script_flags[rel] = flags
        self.script_imports[rel] = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    def _resolve_in_module(self, module: str, rest: list[str], dotted: str) -> Optional[str]:
        if not rest:
            return None
        names = self.top_names[module]
        if rest[0] not in names:
            return f"{module} has no {rest[0]!r}"
        source = names.get(rest[0])
        if source is not None and source != module and source in self.modules:
            return self._resolve_in_module(source, rest, dotted)  # a re-export: look where it comes from
        if len(rest) == 1:
            return None
        classes = [c for c in self.class_named(rest[0]) if c.module == module] or self.class_named(rest[0])
        if not classes:
            return None  # a function or a value: its attributes are not indexed
        if not any(rest[1] in self.class_members(c) for c in classes):
            return f"class {rest[0]} has no member {rest[1]!r}"
        return None


def _walk(root: Path):
    for path in sorted(root.iterdir()):
        if path.name in SKIPPED_DIRS or path.name.startswith(".") and path.is_dir():
            continue
        yield path
        if path.is_dir():
            yield from _walk(path)


def _module_name(rel: str) -> Optional[str]:
    parts = rel[:-len(".py")].split("/")
    if parts[0] not in PACKAGE_ROOTS:
        return None
    parts = PACKAGE_ROOTS[parts[0]].split(".") + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level_names(tree: ast.Module, module: str) -> dict[str, Optional[str]]:
    """{name: the module it is imported from (resolved if relative), or None when defined here}."""
    names: dict[str, Optional[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update({n.id: None for n in ast.walk(target) if isinstance(n, ast.Name)})
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names.update({n.value: None for n in ast.walk(node.value)  # lazily exported (module __getattr__)
                              if isinstance(n, ast.Constant) and isinstance(n.value, str)} | names)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module)
            names.update({(a.asname or a.name): source for a in node.names})
        elif isinstance(node, ast.Import):
            names.update({(a.asname or a.name.split(".")[0]): None for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            inner = ast.Module(body=[n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)], type_ignores=[])
            names.update(_top_level_names(inner, module))
    return names


def _absolute(node: ast.ImportFrom, module: str) -> Optional[str]:
    if not node.level:
        return node.module
    base = module.split(".")[:-node.level] if module else []
    return ".".join(base + ([node.module] if node.module else []))


def _class_info(node: ast.ClassDef, module: str) -> ClassInfo:
    info = ClassInfo(node.name, module, [_base_name(b) for b in node.bases])
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.members.add(item.name)
            info.methods[item.name] = _signature(item)
            info.members |= _self_attributes(item)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            info.members.add(item.target.id)
            info.fields.append(item.target.id)
        elif isinstance(item, ast.Assign):
            info.members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return info


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _self_attributes(func: ast.AST) -> set[str]:
    """`x` of every `self.x = ...` / `self.x: T = ...` in a method."""
    targets = []
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            targets += node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets.append(node.target)
    return {t.attr for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
    args = node.args
    params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs} - {"self", "cls"}
    return Signature(params, open_keywords=args.kwarg is not None)


def _identifiers(tree: ast.Module) -> set[str]:
    """Names, attributes, parameters, keywords, definitions and the identifier-like words of strings."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.alias):
            found.add((node.asname or node.name).split(".")[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(re.findall(r"[A-Za-z_]\w*", node.value))
    return found


def _argparse_flags(tree: ast.Module) -> set[str]:
    """The `--flag` strings of every `.add_argument(...)` call (and `--no-flag` for BooleanOptionalAction)."""
    flags: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        long_names = [n for n in names if n.startswith("--")]
        flags.update(long_names)
        action = next((k.value for k in node.keywords if k.arg == "action"), None)
        if isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction":
            flags.update("--no-" + n[2:] for n in long_names)
    return flags
