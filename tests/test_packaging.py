"""What `pip install .` puts into site-packages: everything under the name `vlmrun`, nothing else.

`processors/` and `web/` stay beside `vlmrun/` in the checkout and install as `vlmrun.processors` and
`vlmrun.web` (pyproject's package-dir), so they cannot collide with another distribution's top-level
`processors` or `web`. The wheel is built from a copy of the sources, offline (no build isolation).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"vlmrun": "vlmrun", "vlmrun.processors": "processors", "vlmrun.web": "web"}


def source_packages() -> set[str]:
    """Every package of the checkout under its installed name: a folder with an __init__.py."""
    found = set()
    for name, folder in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join([name, *parts]))
    return found


def test_pyproject_lists_every_package_of_the_tree() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == source_packages()
    assert setuptools["package-dir"] == {k: v for k, v in FOLDERS.items() if k != v}


def test_the_wheel_installs_only_under_vlmrun(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in FOLDERS.values():
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("vlmrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"vlmrun"}
    assert "vlmrun/processors/image_processor.py" in names and "vlmrun/web/app.py" in names
    assert "vlmrun/layers/attention/paged_decode.c" in names  # (package data: built where it is installed)
