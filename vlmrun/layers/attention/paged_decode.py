"""The CPU's paged decode attention (paged_decode.c): decode rows attend to their KV pages where they lie.

Without it the CPU backend gathers each decode sequence's pages into a padded [seqs, kv_heads, max_seq,
head_dim] copy per layer and runs torch's SDPA over it, which costs a copy of every key and value each
step and a fixed cost per (sequence, KV head) in SDPA's CPU kernel (bench/bench_paged_decode.py times one
layer both ways). The C kernel reads the pool in place, as vLLM's and SGLang's
CPU builds do with their own (C++) kernels. No library on this project's list ships one for torch's CPU
build, so it is hand-written: plain C (no torch headers) built with the machine's C compiler the first
time a process needs it (about a second), cached by the source, the compiler and its flags, and called
through ctypes (which releases the GIL during the call).

Its flags follow the vector ISA torch itself runs (`cpu_kernels.cpu_features().capability`, which honours
`ATEN_CPU_CAPABILITY`): AVX-512 or AVX2 code only where torch runs it, the architecture's baseline
elsewhere (Arm, or a cap). OpenMP splits the (sequence, KV head) pairs over torch's thread count. Where torch's
wheel carries GNU OpenMP as `libgomp.so.1` and the compiler is GCC (Linux x86-64 and Arm here), the kernel
shares torch's OpenMP runtime and threads; with another pair (clang's libomp) a second runtime is loaded.

`load_paged_decode()` returns None, with one log line saying why, where it cannot be built (no C compiler,
not Linux, no OpenMP, an unwritable cache) or while `VLMRUN_CPU_PAGED_DECODE=0`: the backend then gathers as
before. The compiler is `$CC` (a command, "ccache gcc" too), else `cc`, else `gcc`. The cache is
`$VLMRUN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/vlmrun/kernels` (`~/.cache/vlmrun/kernels`); a build writes a
new file and renames it, so processes building at once do not see half a library, and a cached library that
does not load is built again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from vlmrun.layers.cpu_kernels import cpu_features

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # pool dtypes the kernel reads (its `kv_bf16` flag)
# Floating-point flags: sums may be reordered (vectorized), fused multiply-adds, no errno; infinities and
# NaN keep their IEEE meaning (no -ffinite-math-only: masked and NaN scores behave as in torch).
MATH_FLAGS = ("-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math", "-ffp-contract=fast")
ISA_FLAGS = {  # torch's capability -> the vector ISA the kernel may use (ATen's own requirement for it)
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}
BUILD_TIMEOUT_S = 120
OFF = "VLMRUN_CPU_PAGED_DECODE"  # "0": never built, the backend gathers


class PagedDecodeKernel:
    """The loaded library: `attend` runs one layer's decode rows of a group."""

    def __init__(self, path: Path, compiler: str, flags: tuple[str, ...]):
        self.path = path  # the built library
        self.compiler = compiler
        self.flags = flags
        self._lib = ctypes.CDLL(str(path))
        fn = self._lib.vlmrun_paged_decode
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                       ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def attend(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, pages: torch.Tensor,
               sees: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
        """q [seqs * width, num_heads, head_dim] (query head kv * group + g on KV head kv); one layer's pool
        k_buffer / v_buffer [slots, kv_heads, head_dim] (float32 or bfloat16); pages [seqs, max_pages] int64;
        sees [seqs, width] int64: query position j of a sequence sees its keys [0, sees[j]).
        -> [seqs * width, num_heads, head_dim] in q's dtype."""
        seqs, width = sees.shape
        _, num_heads, head_dim = q.shape
        kv_heads = k_buffer.shape[1]
        for name, t in (("pages", pages), ("sees", sees)):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
        if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()) or k_buffer.dtype not in KV_DTYPES:
            raise ValueError(f"the KV pool must be contiguous float32 or bfloat16, not {k_buffer.dtype}")
        if (v_buffer.dtype != k_buffer.dtype or v_buffer.shape != k_buffer.shape or k_buffer.shape[2] != head_dim
                or q.shape[0] != seqs * width or num_heads % kv_heads or pages.shape[0] != seqs
                or q.device.type != "cpu" or k_buffer.device.type != "cpu"):
            raise ValueError(f"paged decode shapes disagree: q {tuple(q.shape)}, k {tuple(k_buffer.shape)} "
                             f"{k_buffer.dtype}, v {tuple(v_buffer.shape)} {v_buffer.dtype}, pages "
                             f"{tuple(pages.shape)}, sees {tuple(sees.shape)}")
        q32 = q.to(torch.float32).contiguous()
        out = torch.empty_like(q32)
        failed = self._fn(q32.data_ptr(), k_buffer.data_ptr(), v_buffer.data_ptr(), KV_DTYPES[k_buffer.dtype],
                          pages.data_ptr(), pages.shape[1], sees.data_ptr(), seqs, width, kv_heads,
                          num_heads // kv_heads, head_dim, page_size, scale, out.data_ptr(), torch.get_num_threads())
        if failed:
            raise MemoryError("paged decode attention: no memory for its scratch rows")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def compiler_flags(capability: str) -> tuple[str, ...]:
    """The compiler's flags for torch's vector `capability` ("AVX512", "AVX2", "DEFAULT", "SVE256", ...)."""
    return ("-O3", "-shared", "-fPIC", "-fopenmp", *MATH_FLAGS, *ISA_FLAGS.get(capability, ()))


def cache_dir() -> Path:
    if os.environ.get("VLMRUN_KERNEL_CACHE"):
        return Path(os.environ["VLMRUN_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlmrun" / "kernels"


def build_paged_decode(directory: Path, compiler: str, capability: str) -> PagedDecodeKernel:
    """The kernel built by `compiler` (a command: "gcc", "ccache gcc") for `capability` into `directory`, reused
    when a library of the same source, compiler and flags is there (one that does not load, a file cut short,
    is built again once). Raises when the compiler fails or is missing."""
    command = shlex.split(compiler)
    flags = compiler_flags(capability)
    version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, *flags, platform.machine()]).encode()).hexdigest()
    path = directory / f"paged_decode-{key[:16]}.so"
    if path.exists():
        try:
            return PagedDecodeKernel(path, compiler, flags)
        except OSError:
            path.unlink(missing_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / path.name
        done = subprocess.run([*command, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, path)
    return PagedDecodeKernel(path, compiler, flags)


def load_paged_decode() -> Optional[PagedDecodeKernel]:
    """This process's kernel, built or found in the cache once; None where it cannot be (logged once), or while
    `VLMRUN_CPU_PAGED_DECODE=0` (read at each call: the backends built after it is set gather)."""
    if os.environ.get(OFF) == "0":
        return None
    return _load_once()


@functools.lru_cache(maxsize=None)
def _load_once() -> Optional[PagedDecodeKernel]:
    if platform.system() != "Linux":
        logger.info("paged decode attention is built on Linux only: decode attention copies each step's KV pages")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("paged decode attention: no C compiler ($CC, cc or gcc): decode attention copies each step's "
                    "KV pages")
        return None
    try:
        return build_paged_decode(cache_dir(), compiler, cpu_features().capability)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("paged decode attention could not be built (%s): decode attention copies each step's KV "
                       "pages", exc)
        return None
