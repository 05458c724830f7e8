"""`kv_cache_dtype="fp8"`: the KV pool stores K/V in float8 e4m3 with per-layer scales (the checkpoint's, else
1.0), quantized on write (saturating) and dequantized on read by the cpu and torch backends; the cache plan
counts its bytes (twice the tokens of a 16-bit cache). Outputs are checked against the unquantized cache by
vLLM's rule for its FP8 KV cache tests (`check_logprobs_close`): greedy tokens equal until the first
difference, and there each run's token is among the other's top logprobs (tiny Qwen3, CPU)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from vlmrun import LLM, SamplingParams
from vlmrun.cache.kv_pool import KVPool, dequantize
from vlmrun.cache.plan import plan_for_budget
from vlmrun.config import CacheShape, EngineConfig

PROMPTS = [{"prompt_token_ids": [100 + (7 * i + j) % 300 for j in range(n)]} for i, n in enumerate((5, 19, 33, 48))]
TOP = 5


def check_logprobs_close(expected: list, got: list, top: int = TOP) -> None:
    """vLLM's rule: per prompt, tokens equal up to the first difference; there, each run's token is among
    the other's top-`top` logprobs (and the comparison of that prompt stops)."""
    for i, (a, b) in enumerate(zip(expected, got)):
        ids_a, ids_b = a.outputs[0].token_ids, b.outputs[0].token_ids
        for pos, (x, y) in enumerate(zip(ids_a, ids_b)):
            if x != y:
                top_a, top_b = set(a.outputs[0].logprobs[pos]), set(b.outputs[0].logprobs[pos])
                assert x in top_b and y in top_a, f"prompt {i} position {pos}: {x} vs {y} not in each other's top {top}"
                break


def value(logprob) -> float:
    """A logprob as a float (a float, or an object with `.logprob`)."""
    return float(getattr(logprob, "logprob", logprob))


def generate(model_dir, kv_cache_dtype: str, backend: str, dtype: str = "float32", path=None) -> tuple[LLM, list]:
    llm = LLM(str(path or model_dir), dtype=dtype, device="cpu", kv_cache_memory_bytes=16 << 20, page_size=8,
              max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=TOP, ignore_eos=True)
    return llm, llm.generate(PROMPTS, params, use_tqdm=False)


# ---------------------------------------------------------------------------- the pool and the plan


def test_write_quantizes_with_the_scale_and_saturates():
    pool = KVPool(2, 16, 2, 4, torch.float8_e4m3fn, torch.device("cpu"), page_size=4, compute_dtype=torch.float32)
    assert pool.quantized
    pool.set_scales([4.0, 1.0], [0.5, 1.0])
    k = torch.linspace(-1000, 1000, 24).view(3, 2, 4)  # [tokens, kv_heads, head_dim]
    loc = torch.tensor([1, 5, 9])
    pool.write(0, loc, k, k / 100)
    back = dequantize(pool.k_buffers[0][loc], pool.k_scales[0], torch.float32)
    assert torch.allclose(back, k, rtol=0.07, atol=0.5)  # e4m3: 3 mantissa bits
    assert torch.allclose(dequantize(pool.v_buffers[0][loc], pool.v_scales[0], torch.float32), k / 100, rtol=0.07)
    pool.write(1, loc, k, k)  # scale 1.0: |k| > 448 saturates, never inf or NaN
    stored = pool.k_buffers[1][loc].float()
    assert torch.isfinite(stored).all() and stored.abs().max() == 448.0
    with pytest.raises(ValueError, match="layer 1"):
        pool.set_scales([1.0, 0.0], [1.0, 1.0])


def test_the_plan_fits_twice_the_tokens_of_a_16_bit_cache(qwen3_5_dir):
    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(qwen3_5_dir)))  # hybrid: GDN state too
    budget = 64 << 20
    plans = {name: plan_for_budget(shape, EngineConfig(kv_cache_dtype=name, max_num_seqs=4, max_model_len=1 << 20),
                                   budget, dtype=torch.bfloat16, max_model_len=1 << 20) for name in ("auto", "fp8")}
    auto, fp8 = plans["auto"], plans["fp8"]
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.gdn_bytes_per_request == auto.gdn_bytes_per_request, "the GDN state keeps its dtype"
    assert fp8.num_pages - 1 == pytest.approx(2 * (auto.num_pages - 1), abs=1)


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_cache_torch_dtype(torch.bfloat16) is torch.float8_e5m2
    assert EngineConfig().kv_cache_torch_dtype(torch.bfloat16) is torch.bfloat16


# ---------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_cache_outputs_are_close_to_the_float32_cache(qwen3_dir, backend):
    _, expected = generate(qwen3_dir, "auto", backend)
    llm, got = generate(qwen3_dir, "fp8", backend)
    pool = llm.engine.caches.kv_pool
    assert pool.k_buffers[0].dtype is torch.float8_e4m3fn and pool.compute_dtype is torch.float32
    assert all(o.error is None and len(o.outputs[0].token_ids) == 12 for o in got)
    check_logprobs_close(expected, got)
    agree = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(expected, got))
    assert agree >= len(PROMPTS) // 2, "fp8 KV should change few greedy runs of the tiny model"
    first = [(a.outputs[0].logprobs[0], b.outputs[0].logprobs[0], a.outputs[0].token_ids[0]) for a, b in zip(expected, got)]
    assert max(abs(value(la[t]) - value(lb[t])) for la, lb, t in first if t in lb) > 1e-3, "the cache was not quantized"


def test_e5m2_cache_runs_with_unit_scales(qwen3_dir):
    _, expected = generate(qwen3_dir, "auto", "cpu")
    llm, got = generate(qwen3_dir, "fp8_e5m2", "cpu")
    assert llm.engine.caches.kv_pool.k_buffers[0].dtype is torch.float8_e5m2
    check_logprobs_close(expected, got)


def test_bfloat16_model_with_an_fp8_cache(qwen3_dir):
    _, expected = generate(qwen3_dir, "auto", "cpu", dtype="bfloat16")
    _, got = generate(qwen3_dir, "fp8", "cpu", dtype="bfloat16")
    check_logprobs_close(expected, got)


def with_kv_scales(model_dir, tmp_path, tensors: dict[str, torch.Tensor]):
    """A copy of the checkpoint with `tensors` added as one more shard (named in the index)."""
    path = tmp_path / "with_scales"
    shutil.copytree(model_dir, path)
    save_file(tensors, str(path / "kv_scales.safetensors"))
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update({name: "kv_scales.safetensors" for name in tensors})
    index_file.write_text(json.dumps(index))
    return path


def test_scales_are_read_from_the_checkpoint_as_vllm_names_them(qwen3_dir, tmp_path):
    path = with_kv_scales(qwen3_dir, tmp_path, {
        "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(2.0),
        "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.5)})
    llm, got = generate(qwen3_dir, "fp8", "cpu", path=path)
    pool = llm.engine.caches.kv_pool
    rest = [1.0] * (pool.num_layers - 2)
    assert (pool.k_scales, pool.v_scales) == ([2.0, 0.5, *rest], [0.25, 0.5, *rest])
    _, expected = generate(qwen3_dir, "auto", "cpu")
    check_logprobs_close(expected, got)
    auto = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)  # the scales: ignored
    assert auto.engine.caches.kv_pool.k_scales == [1.0] * pool.num_layers


def test_a_per_channel_scale_is_refused_naming_it(qwen3_dir, tmp_path):
    path = with_kv_scales(qwen3_dir, tmp_path, {"model.layers.0.self_attn.k_scale": torch.ones(4)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale.*per-tensor"):
        LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, kv_cache_dtype="fp8")


def test_hybrid_model_with_an_fp8_cache(qwen3_5_dir):
    """Qwen3.5 (GDN + full attention): the full-attention layers' KV in float8, the GDN state as before."""
    _, expected = generate(qwen3_5_dir, "auto", "cpu")
    llm, got = generate(qwen3_5_dir, "fp8", "cpu")
    caches = llm.engine.caches
    assert caches.kv_pool.dtype is torch.float8_e4m3fn
    assert caches.gdn_pool.recurrent_state.dtype is torch.float32
    check_logprobs_close(expected, got)
