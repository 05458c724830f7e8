"""bench/flashinfer_aot.py on the CPU, without compiling a kernel: the modules it builds cover every
shape the GPU checks and the benchmark run; its wheel, installed as the GPU run installs the wheels,
gives FlashInfer's AOT lookup what it reads (an importable `flashinfer_jit_cache` whose `__version__`
starts with flashinfer's, `get_jit_cache_dir()/<uri>/<uri>.so`), the `.so` loads from there; and,
where flashinfer is importable, FlashInfer's own lookup finds it with JIT off and no nvcc on PATH.
The .so here is a trivially compiled stand-in; the real build (minutes per module) is run by hand
(docs/gpu_checks.md) and verified with `--verify`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.flashinfer_aot import (
    CONFIGS,
    FLASHINFER_VERSION,
    KernelModule,
    missing_from_wheel,
    needed_modules,
    pack_wheel,
)

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_the_modules_cover_every_attention_shape_of_the_checks():
    needed = needed_modules()
    # head_dim 128 and 256 prefill (FA2, also the tensor-core decode); CUDA-core decode for Qwen3-VL-2B's GQA 2
    assert set(needed) == {KernelModule("prefill", 128), KernelModule("prefill", 256), KernelModule("decode", 128)}
    assert "Qwen3-VL-2B-Instruct.json: decode (GQA 2)" in needed[KernelModule("decode", 128)]


def test_the_modules_follow_the_configs(tmp_path):
    for file in CONFIGS.glob("*.json"):
        shutil.copy(file, tmp_path / file.name)
    (tmp_path / "wide.json").write_text(json.dumps({"text_config": {
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 192, "hidden_size": 2048}}))
    needed = needed_modules(tmp_path)
    assert KernelModule("decode", 192) in needed and KernelModule("prefill", 192) in needed


def fake_kernel(folder: Path) -> Path:
    """A stand-in for a module's .so: one C function, compiled in well under a second."""
    source = folder / "fake.c"
    source.write_text("int vlmrun_fake_kernel(void) { return 42; }\n")
    so = folder / "fake.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(so)], check=True)
    return so


def install(wheel_dir: Path, site: Path) -> None:
    """As bench/gpu_acceptance.py installs the carried wheels."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheel_dir.glob("*.whl"))],
                   check=True, capture_output=True)


def run_python(code: str, site: Path, **env: str) -> str:
    path = "/usr/bin:/bin"  # no nvcc: nothing may compile
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PATH": path, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT),
                                                                                        os.environ.get("PYTHONPATH", "")]),
                               **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@needs_cc
def test_the_wheel_gives_flashinfers_lookup_what_it_reads(tmp_path):
    module = KernelModule("decode", 128)
    wheel_dir = tmp_path / "whl"
    wheel = pack_wheel({module: fake_kernel(tmp_path)}, wheel_dir)
    assert missing_from_wheel(wheel_dir, [module]) == []
    assert missing_from_wheel(wheel_dir, [KernelModule("prefill", 256)]) == [KernelModule("prefill", 256).uri()]
    install(wheel_dir, tmp_path / "site")
    out = run_python(f"""
import ctypes, os
import flashinfer_jit_cache as cache
assert cache.__version__.startswith({FLASHINFER_VERSION!r}), cache.__version__
uri = {module.uri()!r}
so = os.path.join(cache.get_jit_cache_dir(), uri, uri + ".so")
assert ctypes.CDLL(so).vlmrun_fake_kernel() == 42
assert [m[3] for m in cache.MODULES] == [uri]
print("found", so)
""", tmp_path / "site")
    assert str(tmp_path / "site") in out


@needs_cc
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not importable (see the docstring)")
def test_flashinfers_own_lookup_finds_the_module_with_jit_off(tmp_path):
    module = KernelModule("decode", 128)
    pack_wheel({module: fake_kernel(tmp_path)}, tmp_path / "whl")
    install(tmp_path / "whl", tmp_path / "site")
    out = run_python(f"""
from bench.flashinfer_aot import KernelModule, jit_spec
spec = jit_spec(KernelModule("decode", 128))  # also checks flashinfer names it as KernelModule.uri does
assert spec.is_aot, spec.aot_path
assert spec.get_library_path() == spec.aot_path
print(spec.aot_path)
for kind, head_dim in [("prefill", 128), ("prefill", 256)]:
    assert not jit_spec(KernelModule(kind, head_dim)).is_aot  # not in this wheel
""", tmp_path / "site", FLASHINFER_DISABLE_JIT="1", FLASHINFER_CUDA_ARCH_LIST="9.0a")
    assert out.startswith(str(tmp_path / "site" / "flashinfer_jit_cache" / "jit_cache" / module.uri()))
