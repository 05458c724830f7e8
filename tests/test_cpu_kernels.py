"""CPU kernel choices (`vlmrun/layers/cpu_kernels.py`): made from what the CPU can do, never a kernel
it cannot run.

The tables on stand-in CPUs (AVX-512, AVX2 with and without AVX-NE-CONVERT, Arm, no oneDNN); this
process's features against torch's own answers; the engine's choice on this machine; and, in a
subprocess with oneDNN and ATen capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`, `ATEN_CPU_CAPABILITY=avx2`:
what an AVX2-only CPU shows, on any x86-64 machine), this file, the packed-linear tests and the
bfloat16 engine against HF by the bf16 rule.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmrun import LLM
from vlmrun.layers.cpu_kernels import CpuFeatures, cpu_features, pack_threshold, patch_embed_as_gemm
from vlmrun.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

REPO = Path(__file__).resolve().parents[1]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16 = torch.float32, torch.bfloat16

AVX512 = CpuFeatures(capability="AVX512", onednn=True, onednn_bf16=True)
AVX2 = CpuFeatures(capability="AVX2", onednn=True, onednn_bf16=False)
AVX2_NE_CONVERT = CpuFeatures(capability="AVX2", onednn=True, onednn_bf16=True)
ARM = CpuFeatures(capability="SVE256", onednn=True, onednn_bf16=True)
NO_ONEDNN = CpuFeatures(capability="DEFAULT", onednn=False, onednn_bf16=False)
LINEAR_TYPES = (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def _tied(llm: LLM, layer: torch.nn.Module) -> bool:
    """Whether the layer's weight is shared with another module (stays unpacked: the embeddings read it)."""
    uses = [p for _, p in llm.engine.executor.model.named_parameters(remove_duplicate=False) if p is layer.weight]
    return len(uses) > 1


def test_auto_packs_only_where_runnable_and_measured_faster():
    assert pack_threshold("auto", CPU, BF16, AVX512) == 0
    assert pack_threshold("auto", CPU, F32, AVX512) == 512 * 512  # small weights measured slower packed
    assert pack_threshold("auto", CPU, F32, AVX2) == 512 * 512
    assert pack_threshold("auto", CPU, BF16, AVX2) is None  # oneDNN's bf16 kernels do not run there
    assert pack_threshold("auto", CPU, BF16, AVX2_NE_CONVERT) is None  # runnable, never measured: the reference
    assert pack_threshold("auto", CPU, F32, ARM) is None
    assert pack_threshold("auto", CPU, F32, NO_ONEDNN) is None
    assert pack_threshold("auto", CPU, torch.float16, AVX512) is None
    assert pack_threshold("torch", CPU, F32, AVX512) is None
    assert pack_threshold("auto", CUDA, F32, AVX512) is None


def test_explicit_onednn_packs_every_linear_where_it_runs_and_names_what_is_missing():
    assert pack_threshold("onednn", CPU, F32, AVX2) == 0  # the user's call
    assert pack_threshold("onednn", CPU, BF16, AVX2_NE_CONVERT) == 0
    with pytest.raises(ValueError, match=r"cannot run torch.bfloat16 here: .*AVX-512 \(avx512bw, avx512vl, "
                                         r"avx512dq\) or AVX-NE-CONVERT.*capability AVX2"):
        pack_threshold("onednn", CPU, BF16, AVX2)
    with pytest.raises(ValueError, match="no oneDNN"):
        pack_threshold("onednn", CPU, F32, NO_ONEDNN)
    with pytest.raises(ValueError, match="float32 and bfloat16 weights, not torch.float16"):
        pack_threshold("onednn", CPU, torch.float16, AVX512)
    with pytest.raises(ValueError, match="runs on the CPU only"):
        pack_threshold("onednn", CUDA, F32, AVX512)


def test_patch_embed_choice():
    assert not patch_embed_as_gemm(CPU, F32)  # HF's conv
    assert patch_embed_as_gemm(CUDA, F32)  # cuDNN's conv would run in TF32
    assert patch_embed_as_gemm(CPU, BF16)


def test_features_are_torchs_answers():
    features = cpu_features()
    assert features.capability == torch.backends.cpu.get_cpu_capability()
    assert features.onednn == torch.backends.mkldnn.is_available()
    assert features.onednn_bf16 == (features.onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        assert features.capability == "AVX2"
    if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2":
        assert not features.onednn_bf16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_follows_the_choice(qwen3_vl_dir, dtype):
    """Each dense linear packed or not as `pack_threshold` says for this CPU (tiny weights: none on AVX2)."""
    llm = LLM(str(qwen3_vl_dir), dtype=dtype, device="cpu")
    threshold = pack_threshold("auto", CPU, getattr(torch, dtype))
    linears = [m for m in llm.engine.executor.model.modules() if isinstance(m, LINEAR_TYPES)]
    for layer in linears:
        if layer.weight.is_mkldnn:
            assert threshold is not None and layer.weight.numel() >= threshold
        elif threshold is not None:
            assert layer.weight.numel() < threshold or layer.weight.dim() != 2 or _tied(llm, layer)
    out = llm.generate(["Describe a red circle."], use_tqdm=False)[0]
    assert out.error is None and out.token_ids


def test_engine_onednn_bfloat16_where_it_cannot_run_is_a_value_error(qwen3_vl_dir):
    if cpu_features().onednn_bf16:
        pytest.skip("this CPU runs oneDNN's bf16 kernels (the capped-ISA run below checks the error)")
    with pytest.raises(ValueError, match="linear_backend='onednn' cannot run torch.bfloat16 here"):
        LLM(str(qwen3_vl_dir), dtype="bfloat16", device="cpu", linear_backend="onednn")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY caps name x86-64 ISAs")
def test_capped_at_avx2_the_bfloat16_engine_builds_and_follows_hf():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not capped",
           "tests/test_cpu_kernels.py", "tests/test_packed_linear.py",
           "tests/test_cpu_bf16.py::test_bfloat16_cpu_follows_hf[qwen3_vl]",
           "tests/test_cpu_bf16.py::test_bfloat16_cpu_follows_hf[qwen3_5]"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
    # the cap took: bf16 packing skipped with its reason, the engine's ValueError checked (not skipped)
    assert "oneDNN's bfloat16 kernels need AVX-512" in run.stdout, tail
    assert "this CPU runs oneDNN's bf16 kernels" not in run.stdout, tail
