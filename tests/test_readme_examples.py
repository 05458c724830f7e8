"""The README's and the guide's examples run as written.

Every ```python and ```bash block of README.md and docs/guide/*.md is one example. The line before its
fence may say how it is tested:
- `<!-- test: run -->` (or nothing): run, from a folder that holds the checkout's `assets/`, with `vlmrun`
  on the PATH; it must exit 0;
- `<!-- test: server -->`: run the same way while the bundled model is served on 127.0.0.1 (its port
  written into the example where it says 127.0.0.1:8000);
- `<!-- test: skip REASON -->`: not run (it needs a hub model, a GPU, a cluster, starts a server in the
  foreground, ...); the reason must be given.
Every Python example, run or not, must compile and stand alone: each name it uses is imported or
assigned in it (no `client` or `MODEL` from an earlier block).
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
MARK = re.compile(r"<!--\s*test:\s*(run|server|skip)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(python|bash)\s*$")
DEFAULT_ADDRESS = "127.0.0.1:8000"


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    language: str
    code: str
    mode: str  # run | server | skip
    reason: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def examples() -> list[Example]:
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = MARK.search(lines[i - 1]) if i else None
            found.append(Example(path.relative_to(ROOT).as_posix(), i + 1, fence.group(1),
                                 "\n".join(lines[i + 1:end]) + "\n", mark.group(1) if mark else "run",
                                 mark.group(2) if mark else ""))
            i = end + 1
    return found


EXAMPLES = examples()
PYTHON = [e for e in EXAMPLES if e.language == "python"]
RUN = [e for e in EXAMPLES if e.mode == "run"]
SERVER = [e for e in EXAMPLES if e.mode == "server"]


def undefined_names(code: str) -> set[str]:
    """Names the code reads that it never binds (imports, assignments, definitions, parameters) and that
    are not builtins: what an example would take from an earlier one."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return used - bound


def test_the_docs_have_examples_and_each_skip_says_why() -> None:
    assert any(e.doc == "README.md" and e.mode == "run" for e in EXAMPLES)
    assert SERVER, "the README's server examples are marked <!-- test: server -->"
    assert [e.id for e in EXAMPLES if e.mode == "skip" and not e.reason] == []


@pytest.mark.parametrize("example", PYTHON, ids=[e.id for e in PYTHON])
def test_every_python_example_compiles_and_stands_alone(example: Example) -> None:
    compile(example.code, example.id, "exec")
    assert undefined_names(example.code) == set(), f"{example.id} uses names it does not define"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the checkout's assets/ and a `vlmrun` command that runs this checkout."""
    work = tmp_path_factory.mktemp("examples")
    (work / "assets").symlink_to(ROOT / "assets")
    bin_dir = work / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "vlmrun"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vlmrun.cli "$@"\n')
    shim.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return work


def _run(example: Example, workdir: Path, address: str = DEFAULT_ADDRESS) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{workdir / 'bin'}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    code = example.code.replace(DEFAULT_ADDRESS, address)
    command = [sys.executable, "-c", code] if example.language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    out = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{example.id} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{example.id} printed nothing"


@pytest.mark.parametrize("example", RUN, ids=[e.id for e in RUN])
def test_the_example_runs(example: Example, workdir: Path) -> None:
    _run(example, workdir)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """`vlmrun serve` with no model (the bundled one) on a free port of 127.0.0.1, in this process."""
    pytest.importorskip("fastapi")
    from vlmrun.config import EngineConfig
    from vlmrun.default_model import served_name
    from vlmrun.server.launch import build_engine, serve_in_thread
    from vlmrun.server.settings import ServerSettings

    engine = build_engine(EngineConfig(device="cpu", kv_cache_memory_bytes=1 << 27))
    server: Optional[object] = None
    try:
        server = serve_in_thread(engine, ServerSettings(served_model_name=served_name(None)))
        yield f"127.0.0.1:{server.port}"
    finally:
        if server is not None:
            server.stop()
        engine.shutdown()


@pytest.mark.parametrize("example", SERVER, ids=[e.id for e in SERVER])
def test_the_server_example_runs(example: Example, workdir: Path, served: str) -> None:
    if example.language == "python":
        pytest.importorskip("openai")
    _run(example, workdir, address=served)
