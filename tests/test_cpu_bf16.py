"""bfloat16 on the CPU fast path (the CPU attention backend, the bf16 patch-embed GEMM) follows HF
transformers bfloat16 on the CPU by vLLM's rule (tests/bf16_rule.py), on every architecture."""

from __future__ import annotations

import pytest

from tests.bf16_rule import check_bf16_follows_hf
from tests.test_engine_parity import ARCHS
from vlmrun import LLM


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_cpu_follows_hf(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    check_bf16_follows_hf(model_dir, arch, lambda: LLM(str(model_dir), dtype="bfloat16", device="cpu"), "cpu")
