"""The Triton LoRA kernels (`vlmrun.lora.triton_ops`, `lora_kernel="triton"`) against the torch update.

On the CPU through Triton's interpreter (tests/lora_triton_check.py, in a process of its own so the
interpreter is on before triton is imported): the op, `LinearLoRA.add` and `ExpertsLoRA.add` on random
slots, ranks, fused parts, rows of several adapters and of none, padding rows, float32 and bfloat16.
On CUDA (gpu tests): the same cases compiled for the GPU, and an engine of mixed adapters (a MoE
model: linears and experts adapted) whose greedy tokens with the kernel equal the torch update's.
The option is refused off CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vlmrun.config import EngineConfig
from vlmrun.lora.manager import LoRAManager

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@needs_triton
def test_kernels_equal_the_torch_update_under_the_triton_interpreter():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "tests.lora_triton_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "torch.bfloat16: max |triton - torch|" in proc.stdout


def test_triton_kernel_is_refused_off_cuda_and_unknown_kernels_everywhere():
    with pytest.raises(ValueError, match="lora_kernel='triton' runs a Triton kernel on a CUDA device"):
        LoRAManager(nn.Module(), 2, 8, torch.device("cpu"), torch.float32, kernel="triton")
    with pytest.raises(ValueError, match="lora_kernel must be one of torch, triton, got 'punica'"):
        EngineConfig(lora_kernel="punica")
    for bad in (dict(max_loras=0), dict(max_lora_rank=0)):
        with pytest.raises(ValueError, match="max_loras and max_lora_rank must be >= 1"):
            EngineConfig(enable_lora=True, **bad)


def test_cli_flag_sets_the_engine_option():
    import argparse

    from vlmrun.cli_options import add_kernel_args, kernel_options

    p = argparse.ArgumentParser()
    add_kernel_args(p)
    assert kernel_options(p.parse_args([]))["lora_kernel"] == "torch"
    assert kernel_options(p.parse_args(["--lora-kernel", "triton"]))["lora_kernel"] == "triton"


@pytest.mark.gpu
def test_kernels_equal_the_torch_update_on_cuda():
    from tests.lora_triton_check import check

    lines, ok = check("cuda")
    print("\n".join(lines))
    assert ok, lines


@pytest.mark.gpu
def test_engine_with_the_triton_kernel_equals_the_torch_update_on_cuda(qwen3_vl_moe_dir, tmp_path):
    """Base and three adapters (every linear and the experts) in one batch, float32 on CUDA: greedy tokens
    with lora_kernel="triton" equal lora_kernel="torch", logprobs within 1e-4."""
    from testing.lora_adapters import EXPERT_PARAMETERS, TEXT_LINEARS, build_peft_adapter
    from vlmrun import LLM, LoRARequest, SamplingParams

    adapters = [LoRARequest(f"a{i}", i, str(build_peft_adapter(qwen3_vl_moe_dir, tmp_path / f"a{i}",
                                                               target_modules=TEXT_LINEARS, r=2 * i,
                                                               target_parameters=EXPERT_PARAMETERS, seed=i)))
                for i in (1, 2, 3)]
    prompts = [[{"role": "user", "content": f"Tell me about the sea, number {i}."}] for i in range(8)]
    loras = [None, *adapters] * 2
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    outs = {}
    for kernel in ("torch", "triton"):
        llm = LLM(str(qwen3_vl_moe_dir), dtype="float32", device="cuda", enable_lora=True, max_loras=4,
                  max_lora_rank=8, lora_kernel=kernel)
        assert llm.engine.executor.lora.kernel == kernel
        outs[kernel] = llm.chat(prompts, params, use_tqdm=False, lora_request=loras)
        del llm
        torch.cuda.empty_cache()
    for i, (want, got) in enumerate(zip(outs["torch"], outs["triton"], strict=True)):
        assert want.error is None and got.error is None, (want.error, got.error)
        assert got.token_ids == want.token_ids, f"prompt {i} ({loras[i]})"
        for step, (w, g) in enumerate(zip(want.logprobs, got.logprobs, strict=True)):
            token = want.token_ids[step]
            assert abs(w[token] - g[token]) < 1e-4, f"prompt {i} step {step}"
