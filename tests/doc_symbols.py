"""The doc-symbol check: the code names that markdown docs write in backticks exist in the checkout.

A backticked token is checked when it looks like a code reference:

- a `vlmrun SUBCOMMAND --flag ...` command (in backticks or on a line of a fenced block): the
  subcommand and every `--flag` must be in `vlmrun.cli`'s real parser;
- a `python bench/x.py --flag` / `python -m bench.x` command, or `x.py --flag`: the script must
  exist and, when it declares flags with argparse, take those flags; a bare `--flag` must be a flag of
  `vlmrun` or of some script;
- a path (`vlmrun/engine/engine.py`, `layers/attention/base.py:113`, `assets/images/scene_*.png`,
  `base.py`): some file or folder of the checkout must end with it (and, with `:N`, have N lines);
- a dotted name under a package of the checkout (`vlmrun.engine.scheduler`, `vlmrun.LLM`,
  `bench.common`): the module, its top-level name and, for a class, the member must exist;
  `processors.x` / `web.x` are not importable (they install as `vlmrun.processors` / `vlmrun.web`);
- a class name (`ForwardBatch`, `Engine.step`, `EngineConfig.max_video_*`): a class of the checkout
  with that member, or a name of transformers or Python's builtins (HF's `Qwen2VLImageProcessor`);
- a call (`load_model(model_config, device, tp=SINGLE)`, `ChunkInput(row, start, ...)`): the function
  or class must exist and take each parameter the call names (any one definition of that name).

Plain words, JSON, shell snippets, numbers and lowercase attribute chains (`fb.attn_metadata`) are
not checked. `EXTERNAL_NAMES` lists the few names of other tools the docs mention in code form.
"""

from __future__ import annotations

import builtins
import sys
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from tests.code_index import PACKAGE_ROOTS, ClassInfo, CodeIndex, Signature

IMPORTABLE_ROOTS = {module.split(".")[0] for module in PACKAGE_ROOTS.values()}  # vlmrun, bench, ...
CHECKOUT_FOLDERS = ("vlmrun", "processors", "web", "bench", "training", "testing", "tests", "assets", "docs")

# Flags, files and functions of other tools that the docs name in code form.
EXTERNAL_NAMES = {
    "--python-version", "--platform", "--only-binary",  # pip download (README: offline wheels)
    "configuration_qwen3_next.py",  # transformers' Qwen3-Next config file
    "apply_chat_template",  # the HF tokenizer's method
    "NaN", "Infinity",  # JSON's non-finite numbers
    "sigmoid",  # math in the GDN contract
    "cpu_attn",  # vLLM's CPU attention ops
    "mkldnn_convolution", "layer_norm", "index_put",  # aten ops in profiles
}
UNREAD_FILES = ("tests/test_docs.py",)  # its strings plant stale names: they must not count as code
# `torch.x.y`, `sys.setswitchinterval`: looked up in the real module (the standard library's too)
EXTERNAL_MODULES = frozenset({"torch", "transformers"}) | frozenset(sys.stdlib_module_names)
PLACEHOLDER_CALLS = {"cls", "self", "super"}  # `cls(hf_config, tp)`: a call of whatever class is meant

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")  # a span never crosses a blank line
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
_PATH = re.compile(r"^[\w.*/-]+(:\d+)?$")
_NAME_AT_START = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_*][\w*]*)*")
_SNAKE_NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+_?$")  # `build_model_runner`, `max_num_seqs`
_ARG_NAME = re.compile(r"^([A-Za-z_]\w*)\s*(:|=|\[|$)")


@dataclass(frozen=True)
class Problem:
    """One stale reference: where it is, what it says, and what the code lacks."""

    doc: str
    line: int
    token: str
    reason: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: `{self.token}`: {self.reason}"


class DocChecker:
    """Checks markdown text against one `CodeIndex` and the `vlmrun` command-line parsers."""

    def __init__(self, index: CodeIndex, cli_flags: dict[str, set[str]], external: set[str]) -> None:
        self.index = index
        self.cli_flags = cli_flags  # subcommand -> its option strings
        self.external = external | EXTERNAL_NAMES
        self.all_flags = set().union(*cli_flags.values(), *index.script_flags.values())
        self.top_level_names = {n for names in index.top_names.values() for n in names}
        self.known_words = index.identifiers | self.external

    @classmethod
    def for_checkout(cls, root: Path) -> "DocChecker":
        import argparse

        import transformers

        from vlmrun.cli import build_parser

        subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        cli_flags = {name: set(p._option_string_actions) for name, p in subparsers.choices.items()}
        return cls(CodeIndex.build(root, unread=UNREAD_FILES), cli_flags, set(dir(transformers)) | set(dir(builtins)))

    def check(self, text: str, doc: str) -> list[Problem]:
        problems = []
        for line, token, fenced in _code_tokens(text):
            reasons = self._check_code_line(token) if fenced else self._check_token(token)
            problems += [Problem(doc, line, token, reason) for reason in reasons]
        return problems

    # ---------------------------------------------------------------------------------- tokens

    def _check_token(self, token: str) -> list[str]:
        t = token.strip()
        command = self._check_command(t)
        if command is not None:
            return command
        if t.startswith("--"):
            return [f"no command takes {flag}" for flag in _flags(t) if flag not in self.all_flags | self.external]
        if _PATH.match(t) and ("/" in t or t.split(":")[0].endswith(".py")):
            return self._check_path(t)
        if _SNAKE_NAME.match(t):
            return [] if t in self.known_words else [f"no name {t} in the code"]
        match = _NAME_AT_START.match(t)
        if match is None:
            return []
        name, rest = match.group(0), t[match.end():]
        if rest and not rest.startswith(("(", "[", ":", " ->")):
            return []  # words or an expression that starts with a name: `Describe the image.`, `Hv // Hk`
        args = _call_arguments(rest) if rest.startswith("(") else None
        return self._check_name(name, args)

    def _check_code_line(self, line: str) -> list[str]:
        """A line of a fenced block: a shell command, or a Python import from the checkout."""
        command = re.sub(r"^(\$\s+)?(\w+=\S*\s+)*", "", line.strip())
        checked = self._check_command(command)
        if checked is not None:
            return checked
        imported = re.match(r"^from\s+([\w.]+)\s+import\s+\(?([\w\s,]+)\)?\s*$", line.strip())
        if imported and imported.group(1).split(".")[0] in IMPORTABLE_ROOTS:
            names = [n.split(" as ")[0].strip() for n in imported.group(2).split(",") if n.strip()]
            return [r for n in names for r in self._check_name(f"{imported.group(1)}.{n}", None)]
        return []

    def _check_command(self, t: str) -> Optional[list[str]]:
        """Reasons a `vlmrun ...` / `python ...` / `x.py --flag` command is stale; None if `t` is none of them."""
        words = re.split(r"\s#", t, maxsplit=1)[0].split()  # without a shell comment
        if len(words) < 2:
            return None
        program = words[0].rsplit("/", 1)[-1]
        if program == "vlmrun":
            return self._check_vlmrun_command(words[1:])
        if program in ("python", "python3"):
            if words[1] == "-m" and len(words) > 2:
                if words[2].split(".")[0] not in CHECKOUT_FOLDERS:
                    return []  # another tool's module: `python -m pytest`, `python -m pip`
                return self._check_script(words[2].replace(".", "/") + ".py", words[3:])
            return self._check_script(words[1], words[2:]) if words[1].endswith(".py") else []
        if program.endswith(".py") and words[1].startswith("--"):
            return self._check_script(words[0], words[1:])
        return None

    def _check_vlmrun_command(self, words: list[str]) -> list[str]:
        if "|" in words:  # `vlmrun caption | serve | web`: the alternatives are subcommands
            return [f"vlmrun has no subcommand {w!r}" for w in words if w != "|" and w not in self.cli_flags]
        sub = words[0]
        if sub.startswith("-") or not re.match(r"^[a-z][\w-]*$", sub):
            return []
        if sub not in self.cli_flags:
            return [f"vlmrun has no subcommand {sub!r}"]
        known = self.cli_flags[sub]
        return [f"vlmrun {sub} has no flag {f}" for f in _flags(" ".join(words[1:])) if f not in known]

    def _check_script(self, script: str, words: list[str]) -> list[str]:
        found = self._paths_ending_with(script)
        if not found:
            in_checkout = script.split("/")[0] in CHECKOUT_FOLDERS or "/" not in script
            return [f"no script {script}"] if in_checkout else []
        flags = set().union(*(self._script_flags(path) for path in found))
        if not flags:
            return []
        return [f"{script} has no flag {f}" for f in _flags(" ".join(words)) if f not in flags]

    def _script_flags(self, path: str) -> set[str]:
        """Flags the script declares, and those of the checkout modules it imports (shared parsers)."""
        flags = set(self.index.script_flags.get(path, ()))
        for module in self.index.script_imports.get(path, ()):
            module_path = self.index.modules.get(module)
            if module_path is not None:
                flags |= self.index.script_flags.get(module_path.relative_to(self.index.root).as_posix(), set())
        return flags

    def _check_path(self, t: str) -> list[str]:
        path, _, line = t.partition(":")
        segments = [s for s in path.split("/") if s]
        if path.startswith((".", "/")) or any(s.isupper() for s in segments):
            return []  # outside the checkout, or a placeholder (`DIR/resume_state.pt`)
        if not (path.endswith((".py", "/")) or segments[0] in CHECKOUT_FOLDERS):
            return []  # an HF repo id, a URL without scheme, ...
        if path in self.external:
            return []
        found = self._paths_ending_with(path)
        if not found:
            return [f"no file or folder {path}"]
        if line and not any(self._line_count(p) >= int(line) for p in found):
            return [f"{path} has fewer than {line} lines"]
        return []

    def _check_name(self, name: str, args: Optional[list[tuple[str, bool]]]) -> list[str]:
        parts = name.split(".")
        head = parts[0]
        if head in ("processors", "web") and len(parts) > 1:
            return [f"not importable: it is vlmrun.{name}"]
        if head in IMPORTABLE_ROOTS and len(parts) > 1:
            reason = self.index.resolve_module_attribute(name)
            if reason is not None:
                return [reason]
            return self._check_call(parts[-1], parts[-2], args) if args is not None else []
        if head[:1].isupper() and not head.isupper():
            return self._check_class_reference(parts, args)
        if len(parts) == 1 and args is not None and head.islower() and head not in PLACEHOLDER_CALLS:
            return self._check_call(head, None, args)
        if head in EXTERNAL_MODULES:
            return _check_external_attribute(parts)
        if len(parts) > 1 and head.islower():  # `fb.attn_metadata`: each attribute must occur in the code
            return [f"no attribute {p} in the code" for p in parts[1:]
                    if p not in self.known_words]
        return []

    def _check_class_reference(self, parts: list[str], args: Optional[list[tuple[str, bool]]]) -> list[str]:
        head = parts[0]
        classes = self.index.class_named(head)
        if not classes:
            known = head in self.external or head in self.top_level_names
            return [] if known else [f"no class or name {head} in the code"]
        if len(parts) > 1:
            members = set().union(*(self.index.class_members(c) for c in classes))
            if not any(fnmatch.fnmatchcase(m, parts[1]) for m in members):
                return [f"class {head} has no member {parts[1]!r}"]
        if args is None or len(parts) > 2:
            return []
        return self._check_call(parts[1] if len(parts) > 1 else head, head, args)

    def _check_call(self, name: str, owner: Optional[str], args: list[tuple[str, bool]]) -> list[str]:
        """Each argument the call names must be a parameter of some definition of `name`."""
        signatures = self._signatures(name, owner)
        if not signatures:
            known = name in self.external or owner is not None
            return [] if known else [f"no function {name} in the code"]
        return [f"{name}() takes no parameter {arg!r}" for arg, keyword in args
                if not any(arg in s.params or (keyword and s.open_keywords) for s in signatures)]

    def _signatures(self, name: str, owner: Optional[str]) -> list[Signature]:
        """Definitions `name(...)` may call: a method of class `owner`, a class's constructor, or functions."""
        owner_classes: list[ClassInfo] = self.index.class_named(owner) if owner and owner != name else []
        if owner_classes:
            return [s for c in owner_classes for s in self.index.method_signatures(c, name)]
        if name in self.index.classes:
            return [s for c in self.index.class_named(name) for s in self.index.constructor_signatures(c)]
        if owner is not None and owner[:1].isupper():
            return []  # a class of another library
        return self.index.functions.get(name, [])

    # ---------------------------------------------------------------------------------- files

    def _paths_ending_with(self, path: str) -> list[str]:
        """Checkout files and folders equal to `path` or ending with `/path` (glob patterns allowed)."""
        bare = path.rstrip("/")
        pattern = bare if any(c in bare for c in "*?[") else None
        found = []
        for known in self.index.paths:
            candidate = known.rstrip("/")
            if pattern is not None:
                if fnmatch.fnmatchcase(candidate, pattern) or fnmatch.fnmatchcase(candidate, "*/" + pattern):
                    found.append(known)
            elif candidate == bare or candidate.endswith("/" + bare):
                found.append(known)
        return found

    def _line_count(self, path: str) -> int:
        full = self.index.root / path
        return len(full.read_text(encoding="utf-8").splitlines()) if full.is_file() else 0


def _code_tokens(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, token, fenced): the lines of fenced blocks (a line ending in a backslash joined with
    the next), and the inline backticked spans of the rest (a span may wrap onto the next line)."""
    prose = []
    fenced = False
    pending, pending_line = "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            prose.append("")
            continue
        prose.append("" if fenced else line)
        if not fenced:
            continue
        if not pending:
            pending_line = number
        continued = line.rstrip().endswith("\\")
        pending += line.rstrip().rstrip("\\") + " " if continued else line
        if not continued:
            yield pending_line, pending, True
            pending = ""
    joined = "\n".join(prose)
    for match in _INLINE.finditer(joined):
        yield joined.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split()), False


def _check_external_attribute(parts: list[str]) -> list[str]:
    """`torch.set_flush_denormal`: the attribute chain must exist in the imported module."""
    import importlib

    obj = importlib.import_module(parts[0])
    for depth, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):
            try:
                obj = importlib.import_module(".".join(parts[:depth + 1]))  # a submodule not imported yet
            except ImportError:
                return [f"{'.'.join(parts[:depth])} has no attribute {part!r}"]
        else:
            obj = getattr(obj, part)
    return []


def _flags(text: str) -> list[str]:
    return [f.split("=")[0] for f in _FLAG.findall(text)]



def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets, up to its first unmatched closing bracket
    ("a [n, m], b) c" -> ["a [n, m]", " b"])."""
    depth, current, parts = 0, "", []
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]

def _call_arguments(rest: str) -> list[tuple[str, bool]]:
    """(name, is keyword) of the arguments of the call at the start of `rest` that name a parameter:
    `name`, `name=value`, `name: type`, `name [shape]`; values, `...` and `*args` are skipped."""
    named = []
    for part in (p.strip() for p in split_top_level(rest[1:])):
        match = _ARG_NAME.match(part)
        if match:
            named.append((match.group(1), match.group(2) == "="))
    return named
