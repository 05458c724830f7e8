"""Which CPU kernels run, chosen once from what the CPU can do: the one place that asks.

torch answers the two questions that matter here, and both honour the caps a user (or a test) sets
before torch starts, `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2`:
- `torch.backends.cpu.get_cpu_capability()`: the vector ISA ATen's kernels run ("AVX512", "AVX2",
  "DEFAULT", "SVE256", ...);
- `torch.ops.mkldnn._is_mkldnn_bf16_supported()`: whether oneDNN's bfloat16 kernels run (x86-64:
  AVX-512 BW/VL/DQ or AVX-NE-CONVERT). Without it `mkldnn._reorder_linear_weight` refuses bf16.

The choices, each read from `CpuFeatures` and a table of measurements keyed by capability and dtype
(BENCHMARKS.md, "CPU kernel choices", names the machine each figure came from):
- `pack_threshold`: which dense linears run from oneDNN-packed weights (`layers/packed_linear.py`)
  instead of `F.linear` (the reference). "auto" packs only where a measurement says it wins: oneDNN's
  call costs ~25-30 us more than F.linear's (AVX2, AVX-512 float32), so a weight smaller than the
  threshold stays unpacked; a capability or dtype nobody measured keeps the reference. An explicit
  "onednn" packs every linear, and where the CPU cannot run it is a ValueError naming what is missing.
- `patch_embed_as_gemm`: the vision patch embed as one GEMM or as the conv HF runs (float32 on the CPU;
  `models/blocks/vision_common.py`); the GEMM won in half precision on every ISA measured.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# (capability, dtype) -> the fewest weight elements a dense linear needs for "auto" to pack it: where
# packed oneDNN GEMMs beat F.linear. Missing: never packed by "auto" (not measured, or slower).
# oneDNN's call costs ~25-30 us more than F.linear's, so small weights lose at decode sizes on every
# CPU measured (bench/bench_cpu_kernels.py --shapes; BENCHMARKS.md, "CPU kernel choices"): AVX2, a
# 2-core AMD EPYC without AVX-512: packed takes 0.27-0.88x F.linear's time from 1,024 x 512 weights up
# at 8-32 rows, 1.4-5x it for 384 x 128 ones; AVX512 float32, a 2-core Intel Xeon: 0.48-0.90x from
# 1,024 x 512 up at 8-32 rows, 1.2-4x for 384 x 128 and 128 x 384 (a 2-core AMD EPYC with AVX-512 ran
# hidden-512 shapes packed 1.4-1.6x faster at decode size). bfloat16 (AVX512): packed at every size,
# F.linear has no fast bf16 GEMM for small ones (the Xeon: the bundled model's decode step 0.83-0.98x).
PACK_THRESHOLD: dict[tuple[str, torch.dtype], int] = {
    ("AVX512", torch.float32): 512 * 512,
    ("AVX512", torch.bfloat16): 0,
    ("AVX2", torch.float32): 512 * 512,
}

@dataclass(frozen=True)
class CpuFeatures:
    """What this process's torch can run on this CPU (after any ATEN / oneDNN ISA cap)."""

    capability: str  # torch.backends.cpu.get_cpu_capability()
    onednn: bool  # torch.backends.mkldnn.is_available()
    onednn_bf16: bool  # oneDNN's bfloat16 kernels run here

    @classmethod
    def detect(cls) -> "CpuFeatures":
        onednn = torch.backends.mkldnn.is_available()
        return cls(capability=torch.backends.cpu.get_cpu_capability(), onednn=onednn,
                   onednn_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))

    def describe(self) -> str:
        """One line for logs and benchmarks: the CPU's model name and what torch runs on it."""
        return (f"{_cpu_model_name()} ({platform.machine()}): ATen capability {self.capability}, "
                f"oneDNN {'with' if self.onednn_bf16 else 'without'} bf16 kernels")

    def cannot_pack(self, dtype: torch.dtype) -> str | None:
        """Why oneDNN cannot pack `dtype` linear weights on this CPU; None when it can."""
        if not self.onednn:
            return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
        if dtype == torch.bfloat16 and not self.onednn_bf16:
            return (f"oneDNN's bfloat16 kernels need AVX-512 (avx512bw, avx512vl, avx512dq) or AVX-NE-CONVERT, "
                    f"which this CPU lacks (ATen capability {self.capability})")
        if dtype not in (torch.float32, torch.bfloat16):
            return f"oneDNN packs float32 and bfloat16 weights, not {dtype}"
        return None


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's `CpuFeatures` (read once: the ISA does not change while it runs)."""
    return CpuFeatures.detect()


def pack_threshold(linear_backend: str, device: torch.device, dtype: torch.dtype,
                   features: CpuFeatures | None = None) -> int | None:
    """The fewest weight elements a dense linear of a `dtype` model on `device` needs to run from
    oneDNN-packed weights, for `EngineConfig.linear_backend` ("auto" | "torch" | "onednn");
    None: no linear is packed."""
    if linear_backend == "torch":
        return None
    if device.type != "cpu":
        if linear_backend == "onednn":
            raise ValueError(f"linear_backend='onednn' runs on the CPU only, not on {device.type}")
        return None
    features = features or cpu_features()
    missing = features.cannot_pack(dtype)
    if linear_backend == "onednn":
        if missing:
            raise ValueError(f"linear_backend='onednn' cannot run {dtype} here: {missing}; "
                             "use linear_backend='auto' or 'torch'")
        return 0
    return None if missing else PACK_THRESHOLD.get((features.capability, dtype))


def patch_embed_as_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the vision patch embed runs as one GEMM (else as the Conv3d HF runs): float32 on the CPU
    runs the conv, whose sums round as HF's do (CPU parity); on CUDA the GEMM (cuDNN would run the conv
    in TF32); in half precision on the CPU the GEMM on every ISA measured (bench/bench_cpu_kernels.py,
    32 images of 224x224: ~3x faster than oneDNN's conv on the AVX-512 EPYC, 4.2-4.7x on the AVX2 one)."""
    return device.type != "cpu" or dtype != torch.float32


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
