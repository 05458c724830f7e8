"""FlashInfer's kernels built ahead, on a CPU machine, for the lent GPU (sm_90a), packed as a wheel.

FlashInfer 0.6 compiles each attention module with nvcc at first use: minutes per module, which a
15-minute device lease cannot spare. This script builds the modules vlmrun's FlashInfer backend asks
for on every shape the GPU checks and the benchmark run, here, and packs them as a
`flashinfer_jit_cache` wheel into `.whl/` beside the other wheels (bench/gpu_wheels.sh runs it):

    PYTHONPATH=FI_SITE:. python -m bench.flashinfer_aot    # build what is missing, pack .whl/flashinfer_jit_cache-*.whl
    python -m bench.flashinfer_aot --plan                  # the modules and why (no flashinfer needed)
    PYTHONPATH=SITE:. python -m bench.flashinfer_aot --verify  # SITE holds the installed wheels: load each, no JIT

(FI_SITE: a folder flashinfer-python 0.6.4 is installed in, not the venv; SITE: where the GPU run
installed the carried wheels.)

How FlashInfer finds them: `JitSpec.build_and_load` loads `<AOT_DIR>/<uri>/<uri>.so` when that file
exists, and `flashinfer.jit.env` takes AOT_DIR from an importable `flashinfer_jit_cache` module whose
`__version__` starts with flashinfer's own version (`get_jit_cache_dir()`). The modules need only
libcudart.so.13, libstdc++, libgcc_s and libc (apache-tvm-ffi's ABI: no torch, no Python; glibc 2.14
and GLIBCXX 3.4.29 at most), so the GPU machine's torch does not matter. No GPU is needed to build: `FLASHINFER_CUDA_ARCH_LIST="9.0a"` picks
the target and an empty stub `libcuda.so` (soname libcuda.so.1), passed by
`FLASHINFER_EXTRA_LDFLAGS=-L<dir>`, satisfies the link's `-lcuda` (the linker drops it as unused:
the modules do not even name libcuda). Builds run one nvcc job at a time, niced, in `--build-dir` (ninja skips what is up to date).

Which modules (`needed_modules`): every full-attention shape of the published configs the checks
and the benchmark build models from (tests/configs/) and the kernel test's own GQA-4 batches, in
bf16 with int32 indices, no sliding window, no soft cap, no RoPE in the kernel:
  - `prefill` (FA2, `flashinfer_backend.PREFILL_BACKEND`): every head_dim; it also serves decode on
    tensor cores (GQA groups of `TENSOR_CORE_MIN_GROUP` or more);
  - `decode` (CUDA cores): every head_dim with a smaller group.
The planning and packing need the standard library only; building needs flashinfer-python, nvcc
and CUDA's headers and libcudart (`cudart_dir`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "configs"
FLASHINFER_VERSION = "0.6.4"  # bench/gpu_wheels.sh carries this flashinfer-python
CUDA_ARCH = "9.0a"  # H100 / H200: FlashInfer's FA2 kernels for sm_90a
WHEEL_TAG = "py3-none-linux_x86_64"
PACKAGE = "flashinfer_jit_cache"
# vlmrun/layers/attention/flashinfer_backend.py's choices, read from its source (flashinfer_backend
# imports torch; this script must plan without it): its prefill backend and its tensor-core threshold
BACKEND_SOURCE = ROOT / "vlmrun" / "layers" / "attention" / "flashinfer_backend.py"
KERNEL_TEST_GROUPS = [(128, 4), (256, 4)]  # tests/test_gpu_kernels.py::test_flashinfer_equals_torch_backend
DTYPES = ("bfloat16",)  # every fast-path check and the benchmark run bf16


@dataclass(frozen=True, order=True)
class KernelModule:
    """One FlashInfer JIT module: its kind, head_dim and dtype (q = kv = out)."""

    kind: str  # "prefill" (FA2; the tensor-core decode too) | "decode" (CUDA cores)
    head_dim: int
    dtype: str = "bfloat16"

    def uri(self) -> str:
        """FlashInfer 0.6's module name for it (jit/attention/modules.py: get_batch_{prefill,decode}_uri);
        checked against flashinfer's own functions when it is installed."""
        short = {"bfloat16": "bf16", "float16": "f16"}[self.dtype]
        common = (f"dtype_q_{short}_dtype_kv_{short}_dtype_o_{short}_dtype_idx_i32_head_dim_qk_{self.head_dim}_"
                  f"head_dim_vo_{self.head_dim}_posenc_0_use_swa_False_use_logits_cap_False")
        if self.kind == "decode":
            return f"batch_decode_with_kv_cache_{common}"
        return f"batch_prefill_with_kv_cache_{common}_f16qk_False"


def backend_constants(source: Path = BACKEND_SOURCE) -> tuple[str, int]:
    """(PREFILL_BACKEND, TENSOR_CORE_MIN_GROUP) as flashinfer_backend.py sets them."""
    import ast

    values = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("PREFILL_BACKEND", "TENSOR_CORE_MIN_GROUP"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["PREFILL_BACKEND"], values["TENSOR_CORE_MIN_GROUP"]


def attention_shapes(config_dir: Path = CONFIGS) -> dict[str, tuple[int, int]]:
    """config file -> (head_dim, query heads per KV head) of its full-attention layers."""
    shapes = {}
    for file in sorted(config_dir.glob("*.json")):
        config = json.loads(file.read_text())
        text = config.get("text_config", config)
        heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
        shapes[file.name] = (text.get("head_dim") or text["hidden_size"] // heads, heads // kv_heads)
    return shapes


def needed_modules(config_dir: Path = CONFIGS, dtypes: Iterable[str] = DTYPES) -> dict[KernelModule, list[str]]:
    """Every module the fast path asks FlashInfer for on the checks' and the benchmark's shapes -> why."""
    backend, min_group = backend_constants()
    if backend != "fa2":
        raise ValueError(f"flashinfer_backend.PREFILL_BACKEND is {backend!r}: this script builds FA2 modules only")
    shapes = {**attention_shapes(config_dir),
              **{f"kernel test (head_dim {d}, GQA {g})": (d, g) for d, g in KERNEL_TEST_GROUPS}}
    needed: dict[KernelModule, list[str]] = {}
    for source, (head_dim, group) in shapes.items():
        for dtype in dtypes:
            needed.setdefault(KernelModule("prefill", head_dim, dtype), []).append(f"{source}: prefill")
            kind = "prefill" if group >= min_group else "decode"
            needed.setdefault(KernelModule(kind, head_dim, dtype), []).append(f"{source}: decode (GQA {group})")
    return dict(sorted(needed.items()))


# ------------------------------------------------------------------ the wheel


def wheel_version(flashinfer_version: str = FLASHINFER_VERSION) -> str:
    return f"{flashinfer_version}+sm90a"  # FlashInfer's check: startswith(flashinfer.__version__)


def pack_wheel(built: dict[KernelModule, Path], out_dir: Path, flashinfer_version: str = FLASHINFER_VERSION) -> Path:
    """A `flashinfer_jit_cache` wheel holding `jit_cache/<uri>/<uri>.so` for every built module, and
    `MODULES` (kind, head_dim, dtype, uri) as the manifest."""
    version = wheel_version(flashinfer_version)
    dist = f"{PACKAGE}-{version}.dist-info"
    modules = [(m.kind, m.head_dim, m.dtype, m.uri()) for m in sorted(built)]
    init = (f'"""FlashInfer {flashinfer_version} modules prebuilt for sm_90a by vlmrun\'s bench/flashinfer_aot.py."""\n\n'
            "import os\n\n"
            f"__version__ = {version!r}\n"
            f"MODULES = {modules!r}  # (kind, head_dim, dtype, uri)\n\n\n"
            "def get_jit_cache_dir() -> str:\n"
            "    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'jit_cache')\n")
    files: dict[str, bytes] = {f"{PACKAGE}/__init__.py": init.encode()}
    for module, so in sorted(built.items()):
        files[f"{PACKAGE}/jit_cache/{module.uri()}/{module.uri()}.so"] = so.read_bytes()
    files[f"{dist}/METADATA"] = (f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n"
                                 f"Summary: FlashInfer {flashinfer_version} kernels for sm_90a (vlmrun's GPU checks)\n").encode()
    files[f"{dist}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: vlmrun bench/flashinfer_aot.py\n"
                              f"Root-Is-Purelib: false\nTag: {WHEEL_TAG}\n").encode()
    record = [f"{name},sha256={_digest(data)},{len(data)}" for name, data in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{PACKAGE}-*.whl"):
        old.unlink()  # one version of a package: two stop the whole install
    wheel = out_dir / f"{PACKAGE}-{version}-{WHEEL_TAG}.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_modules(wheel_dir: Path) -> set[str]:
    """The module uris the `flashinfer_jit_cache` wheel in `wheel_dir` holds (empty without one)."""
    uris: set[str] = set()
    for wheel in wheel_dir.glob(f"{PACKAGE}-*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            uris |= {Path(n).stem for n in zf.namelist() if n.endswith(".so") and "/jit_cache/" in n}
    return uris


def missing_from_wheel(wheel_dir: Path, needed: Iterable[KernelModule]) -> list[str]:
    have = wheel_modules(wheel_dir)
    return [m.uri() for m in needed if m.uri() not in have]


# ------------------------------------------------------------------ building (flashinfer and nvcc)


def stub_libcuda(folder: Path) -> Path:
    """An empty shared library named libcuda.so with soname libcuda.so.1: the link's -lcuda finds it
    here, the GPU machine's driver provides the real one at load time."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "libcuda.so"
    if not stub.exists():
        subprocess.run(["cc", "-shared", "-Wl,-soname,libcuda.so.1", "-x", "c", "/dev/null", "-o", str(stub)],
                       check=True)
    return stub


def cudart_dir() -> Path:
    """The folder of libcudart.so: FlashInfer links with -L$CUDA_HOME/lib64, and CUDA_HOME defaults to
    the folder above `nvcc`'s, which on this machine (/usr/local/bin/nvcc) holds no libcudart."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in filter(None, homes):
        if (Path(home) / "lib64" / "libcudart.so").exists():
            return Path(home) / "lib64"
    raise FileNotFoundError(f"no lib64/libcudart.so under {homes}: set CUDA_HOME")


def build_env(build_dir: Path, jobs: int) -> dict[str, str]:
    stub = stub_libcuda(build_dir / "stub")
    return {"FLASHINFER_CUDA_ARCH_LIST": CUDA_ARCH,
            "FLASHINFER_EXTRA_LDFLAGS": f"-L{stub.parent} -L{cudart_dir()}",
            "FLASHINFER_WORKSPACE_BASE": str(build_dir), "MAX_JOBS": str(jobs)}


def jit_spec(module: KernelModule):
    """FlashInfer's JitSpec of `module` (imports flashinfer and torch), checking its uri is ours."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module

    dtype = getattr(torch, module.dtype)
    common = (dtype, dtype, dtype, torch.int32, module.head_dim, module.head_dim, 0, False, False)
    spec = (gen_batch_decode_module(*common) if module.kind == "decode"
            else gen_batch_prefill_module("fa2", *common, False))
    if spec.name != module.uri():
        raise RuntimeError(f"flashinfer names {module} {spec.name}, this script {module.uri()}: update KernelModule.uri")
    return spec


def build(modules: Iterable[KernelModule], build_dir: Path, jobs: int = 1) -> dict[KernelModule, Path]:
    """Build each module (ninja skips the up-to-date ones); module -> its .so. Prints the time and size."""
    os.environ.update(build_env(build_dir, jobs))
    os.environ.pop("FLASHINFER_DISABLE_JIT", None)
    import flashinfer

    if flashinfer.__version__ != FLASHINFER_VERSION:
        raise RuntimeError(f"flashinfer {flashinfer.__version__} is importable, the wheels carry {FLASHINFER_VERSION}")
    built = {}
    for module in modules:
        spec = jit_spec(module)
        start = time.monotonic()
        spec.write_ninja()  # with this run's flags (FlashInfer keeps an existing build.ninja as it is)
        spec.build(verbose=False)
        so = spec.jit_library_path
        print(f"{module.kind} head_dim {module.head_dim} {module.dtype}: {time.monotonic() - start:.0f} s, "
              f"{so.stat().st_size / 2**20:.1f} MiB  {so}", flush=True)
        built[module] = so
    return built


def verify(modules: Iterable[KernelModule]) -> int:
    """In a process whose path holds flashinfer and the installed wheel: with FLASHINFER_DISABLE_JIT=1,
    FlashInfer's own lookup resolves each module to the wheel's file and loads it (no kernel runs)."""
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", CUDA_ARCH)  # a CPU machine has no device to ask
    import flashinfer_jit_cache

    from flashinfer.jit import env as jit_env

    failures, count = 0, 0
    print(f"flashinfer_jit_cache {flashinfer_jit_cache.__version__}: FlashInfer's AOT dir {jit_env.FLASHINFER_AOT_DIR}")
    for module in modules:
        count += 1
        spec = jit_spec(module)
        start = time.monotonic()
        try:
            if not spec.is_aot:
                raise FileNotFoundError(f"{spec.aot_path} is not in the wheel")
            spec.build_and_load()
            print(f"loaded {module.kind} head_dim {module.head_dim} {module.dtype} in {time.monotonic() - start:.2f} s "
                  f"from {spec.aot_path}", flush=True)
        except Exception as exc:  # every module is reported, then the exit status says it
            failures += 1
            print(f"FAILED {module.kind} head_dim {module.head_dim} {module.dtype}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{count - failures} of {count} FlashInfer modules loaded from the wheel, JIT off")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the modules and why, build nothing")
    parser.add_argument("--verify", action="store_true", help="load every module through FlashInfer's lookup, JIT off")
    parser.add_argument("--only", nargs="+", choices=["prefill", "decode"], help="build these kinds only")
    parser.add_argument("--head-dims", nargs="+", type=int, help="build these head dims only")
    parser.add_argument("--build-dir", type=Path, default=ROOT / ".cache" / "flashinfer_aot")
    parser.add_argument("--wheel-dir", type=Path, default=ROOT / ".whl")
    parser.add_argument("--jobs", type=int, default=1, help="nvcc jobs at once (the CPU machine is shared)")
    args = parser.parse_args()
    needed = needed_modules()
    modules = [m for m in needed if (not args.only or m.kind in args.only)
               and (not args.head_dims or m.head_dim in args.head_dims)]
    if args.plan:
        for module in needed:
            print(f"{module.kind:8} head_dim {module.head_dim} {module.dtype}: {module.uri()}")
            for why in needed[module]:
                print(f"    {why}")
        return 0
    if args.verify:
        return verify(modules)
    build(modules, args.build_dir, args.jobs)
    built = {m: jit_spec(m).jit_library_path for m in needed}  # this run's and earlier runs' modules
    packed = {m: so for m, so in built.items() if so.exists()}
    wheel = pack_wheel(packed, args.wheel_dir)
    print(f"{wheel}: {wheel.stat().st_size / 2**20:.1f} MiB, {len(packed)} modules")
    missing = missing_from_wheel(args.wheel_dir, needed)
    if missing:
        print("not built (the fast-path checks will fail on these): " + ", ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
