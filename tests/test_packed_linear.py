"""oneDNN-packed linear weights (the CPU fast path's GEMMs) against F.linear and the unpacked engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.config import EngineConfig
from vlmrun.layers.cpu_kernels import cpu_features
from vlmrun.layers.linear import ParallelLMHead, ReplicatedLinear, VocabParallelEmbedding
from vlmrun.layers.packed_linear import onednn_linear, pack_linear_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 64), (3, 5, 64)])
def test_packed_linear_equals_f_linear(dtype, shape):
    if missing := cpu_features().cannot_pack(dtype):
        pytest.skip(missing)
    gen = torch.Generator().manual_seed(0)
    layer = ReplicatedLinear(64, 96).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=gen))
        layer.bias.copy_(torch.randn(96, generator=gen))
    x = torch.randn(*shape, generator=gen).to(dtype)
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        assert pack_linear_weights(layer) == 1 and layer.weight.is_mkldnn and layer.method.name == "onednn"
        got = layer(x)
        assert torch.equal(got, onednn_linear(x, layer.weight, layer.bias))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(50, 16)
        self.proj = ReplicatedLinear(16, 16, bias=False)
        self.conv = nn.Conv1d(16, 16, 3)  # not a linear: stays as it is
        self.head = ParallelLMHead(50, 16)
        self.head.weight = self.embed.weight  # tied


def test_tied_and_non_linear_weights_stay_unpacked():
    model = TiedLM()
    assert pack_linear_weights(model) == 1
    assert model.proj.weight.is_mkldnn
    assert not model.head.weight.is_mkldnn and model.head.weight is model.embed.weight
    assert not model.conv.weight.is_mkldnn
    assert pack_linear_weights(model) == 0  # packed once only (a runner built again over the same model)


def test_linear_backend_option():
    with pytest.raises(ValueError, match="linear_backend must be"):
        EngineConfig(linear_backend="mkl")


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5", "qwen3_vl_moe"])
def test_engine_packed_equals_unpacked(request, arch):
    """Every dense linear packed (text, vision tower, GDN projections, MoE router and shared expert):
    the same greedy tokens as the unpacked engine, logprobs within float32 summation-order noise."""
    from tests.test_engine_parity import params, setup_for
    from vlmrun import LLM

    model_dir, cases, _ = setup_for(request, arch)
    outs = {}
    for backend in ("torch", "onednn"):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", linear_backend=backend)
        packed = [m for m in llm.engine.executor.model.modules() if getattr(getattr(m, "weight", None), "is_mkldnn", False)]
        assert bool(packed) == (backend == "onednn")
        outs[backend] = llm.chat(list(cases.values()), params(), use_tqdm=False)
    for name, ours, ref in zip(cases, outs["onednn"], outs["torch"]):
        assert ours.token_ids == ref.token_ids, name
        gap = max(abs(a[t] - b[t]) for a, b in zip(ours.logprobs, ref.logprobs) for t in a.keys() & b.keys())
        assert gap < 1e-4, f"{name}: {gap}"
