"""No module of the installed package is over 400 lines: a longer one gets split along a seam (issue 31)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("vlmrun", "processors", "web")  # processors/ and web/ install as vlmrun.processors / vlmrun.web
MAX_LINES = 400


def long_modules(root: Path, folders: tuple[str, ...], max_lines: int) -> dict[str, int]:
    """{path relative to root: line count} of every .py file under `folders` longer than `max_lines`."""
    counts = {path.relative_to(root).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
              for folder in folders for path in sorted((root / folder).rglob("*.py"))}
    return {path: n for path, n in counts.items() if n > max_lines}


def test_no_module_is_over_400_lines():
    too_long = long_modules(ROOT, PACKAGE_FOLDERS, MAX_LINES)
    assert not too_long, f"split these along a seam (at most {MAX_LINES} lines each): {too_long}"


def test_a_long_module_is_named(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path, ("pkg",), MAX_LINES) == {"pkg/sub/long.py": MAX_LINES + 1}
