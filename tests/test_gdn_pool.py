"""GDN state pool: memory sizing of published configs, zeroing, slot reuse through the GDN backend.

The sizing cases are the hand calculations of docs/hybrid_memory.md, built from transformers'
own config classes with the published Qwen3.5-2B and Qwen3-Next-80B-A3B values.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig

from tests.model_harness import cache_shape_of_layers
from vlmrun.cache.gdn_pool import GDNPool, gdn_slot_for_row
from vlmrun.config import CacheShape
from vlmrun.cache.plan import gdn_bytes_per_request, kv_bytes_per_token, plan_cache_memory
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import GDNAttention
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend
from vlmrun.layers.gdn_ops import causal_conv1d, chunk_gated_delta_rule

GIB = 1 << 30


def qwen3_5_2b() -> Qwen3_5TextConfig:
    """Qwen/Qwen3.5-2B text_config (sources in docs/hybrid_memory.md)."""
    return Qwen3_5TextConfig(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
                             linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                             linear_num_key_heads=16, linear_num_value_heads=16, max_position_embeddings=262144)


def qwen3_next_80b_a3b() -> Qwen3NextConfig:
    """Qwen/Qwen3-Next-80B-A3B-Instruct config (sources in docs/hybrid_memory.md)."""
    return Qwen3NextConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                           num_key_value_heads=2, head_dim=256, full_attention_interval=4, linear_conv_kernel_dim=4,
                           linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                           linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
                           max_position_embeddings=262144)


# name: (config, full layers, GDN layers, conv_dim, KV bytes/token bf16, GDN bytes/request bf16 conv + fp32 state,
#        the same two with a float32 model)
PUBLISHED = {
    "qwen3_5_2b": (qwen3_5_2b, 6, 18, 6144, 12_288, 19_537_920, 24_576, 20_201_472),
    "qwen3_next_80b_a3b": (qwen3_next_80b_a3b, 12, 36, 8192, 24_576, 77_266_944, 49_152, 79_036_416),
}

# name: (budget, max_num_seqs) -> (num_pages, max_model_len, effective max_num_seqs), page_size 16, bf16
PLANS = {
    ("qwen3_5_2b", 16 * GIB, 64): (80_922, 262_144, 64),
    ("qwen3_5_2b", 2 * GIB, 256): (5_557, 88_896, 53),
    ("qwen3_next_80b_a3b", 16 * GIB, 64): (30_919, 262_144, 64),
    ("qwen3_next_80b_a3b", 2 * GIB, 256): (2_907, 46_496, 12),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bytes_of_published_configs(name):
    build, full, linear, conv_dim, kv_bf16, gdn_bf16, kv_fp32, gdn_fp32 = PUBLISHED[name]
    shape = CacheShape.from_hf_config(build())
    assert (shape.num_attention_layers, shape.num_gdn_layers, shape.gdn_conv_dim) == (full, linear, conv_dim)
    assert shape.is_hybrid and shape.gdn_conv_kernel == 4
    assert kv_bytes_per_token(shape, torch.bfloat16) == kv_bf16
    assert gdn_bytes_per_request(shape, torch.bfloat16, torch.float32) == gdn_bf16
    assert kv_bytes_per_token(shape, torch.float32) == kv_fp32
    assert gdn_bytes_per_request(shape, torch.float32, torch.float32) == gdn_fp32


@pytest.mark.parametrize("key", sorted(PLANS))
def test_one_budget_split_between_gdn_and_kv(key):
    name, budget, max_num_seqs = key
    pages, max_len, seqs = PLANS[key]
    shape = CacheShape.from_hf_config(PUBLISHED[name][0]())
    plan = plan_cache_memory(shape, budget, dtype=torch.bfloat16, gdn_state_dtype=torch.float32,
                             max_num_seqs=max_num_seqs, max_model_len=262_144, page_size=16,
                             max_model_len_fixed=False)
    assert (plan.num_pages, plan.max_model_len, plan.max_num_seqs) == (pages, max_len, seqs)
    assert plan.num_gdn_slots == seqs + 1
    assert plan.gdn_bytes + (plan.num_pages - 1) * 16 * plan.kv_bytes_per_token <= budget


def test_plan_without_gdn_layers_is_the_kv_only_plan():
    shape = CacheShape(num_attention_layers=2, num_kv_heads=2, head_dim=16)
    plan = plan_cache_memory(shape, 1 << 20, dtype=torch.float32, gdn_state_dtype=torch.float32, max_num_seqs=8,
                             max_model_len=4096, page_size=16, max_model_len_fixed=False)
    per_token = 2 * 2 * 2 * 16 * 4
    assert plan.gdn_bytes == 0 and plan.num_gdn_slots == 0 and plan.max_num_seqs == 8
    assert plan.num_pages == (1 << 20) // per_token // 16 + 1


def test_budget_too_small_for_one_request_is_a_clear_error():
    shape = CacheShape.from_hf_config(qwen3_next_80b_a3b())
    with pytest.raises(ValueError, match="GDN state of one request"):
        plan_cache_memory(shape, 100 << 20, dtype=torch.bfloat16, gdn_state_dtype=torch.float32, max_num_seqs=4,
                          max_model_len=4096, page_size=16, max_model_len_fixed=False)


def test_gdn_state_dtype_is_configurable():
    shape = CacheShape.from_hf_config(qwen3_5_2b())
    assert gdn_bytes_per_request(shape, torch.bfloat16, torch.bfloat16) == 18 * (6144 * 3 * 2 + 16 * 128 * 128 * 2)


def test_model_attributes_agree_with_the_config():
    """The cache shape a hybrid model declares is the one its built layers need, and the config's."""
    from testing.tiny_models import _CONFIG_BUILDERS, SpecialIds
    from vlmrun.models.registry import get_model_class

    tiny = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                vocab_size=128, num_hidden_layers=4)
    qwen3_5 = _CONFIG_BUILDERS["qwen3_5"](128, SpecialIds(*range(120, 128)))  # the VL checkpoint's config
    cases = [("Qwen3_5ForConditionalGeneration", qwen3_5, qwen3_5.text_config),
             ("Qwen3NextForCausalLM", *[Qwen3NextConfig(**tiny, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=32)] * 2)]
    for arch, config, text in cases:
        config.architectures = [arch]
        model = get_model_class([arch])(config)  # a ValueError here: the architecture is no longer registered
        assert cache_shape_of_layers(model) == model.cache_shape() == CacheShape.from_hf_config(text), arch


# ---------------------------------------------------------------------------------------------
# Pool and backend
# ---------------------------------------------------------------------------------------------

HK, HV, DK, DV, KERNEL = 2, 4, 8, 8, 4
CONV_DIM = 2 * HK * DK + HV * DV


def make_pool(num_slots: int = 5, num_layers: int = 2) -> GDNPool:
    return GDNPool(num_layers, num_slots, CONV_DIM, KERNEL, HV, DV, DK, torch.float32, torch.float32,
                   torch.device("cpu"))


def test_pool_layout_and_bytes():
    pool = make_pool()
    assert pool.conv_state.shape == (2, 5, CONV_DIM, KERNEL - 1)
    assert pool.recurrent_state.shape == (2, 5, HV, DV, DK) and pool.recurrent_state.dtype == torch.float32
    assert pool.slot_bytes() == GDNPool.bytes_per_slot(2, CONV_DIM, KERNEL, HV, DV, DK, torch.float32, torch.float32)
    assert gdn_slot_for_row(0) == 1  # slot 0 is the dummy


def test_zero_resets_only_the_given_slots():
    pool = make_pool()
    pool.conv_state.normal_()
    pool.recurrent_state.normal_()
    before_conv, before_rec = pool.conv_state.clone(), pool.recurrent_state.clone()
    pool.zero(torch.tensor([1, 3]))
    for slot in range(5):
        zeroed = slot in (1, 3)
        assert bool((pool.conv_state[:, slot] == 0).all()) == zeroed
        assert bool((pool.recurrent_state[:, slot] == 0).all()) == zeroed
        if not zeroed:
            assert torch.equal(pool.conv_state[:, slot], before_conv[:, slot])
            assert torch.equal(pool.recurrent_state[:, slot], before_rec[:, slot])


def gdn_batch(backend: TorchGDNBackend, lens: list[int], prefix: list[int], slots: list[int]) -> ForwardBatch:
    num_tokens = sum(lens)
    seq_lens = [p + n for p, n in zip(prefix, lens)]
    fb = ForwardBatch(
        mode=ForwardMode.DECODE if all(n == 1 for n in lens) else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64), positions=torch.zeros(3, num_tokens, dtype=torch.int64),
        req_pool_indices=torch.tensor([s - 1 for s in slots]), seq_lens=torch.tensor(seq_lens),
        extend_prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(lens),
        out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64), seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=lens, logits_indices=torch.zeros(0, dtype=torch.int64),
        state_slots=torch.tensor(slots),
    )
    backend.prepare(fb)
    return fb


class Stream:
    """Random GDN inputs of one sequence, and its output computed in one piece from zero state."""

    def __init__(self, length: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, CONV_DIM, generator=gen)
        self.g = -torch.rand(length, HV, generator=gen) * 0.5
        self.beta = torch.rand(length, HV, generator=gen)

    def reference(self, weight: torch.Tensor) -> torch.Tensor:
        y, _ = causal_conv1d(self.x, weight)
        q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
        t = y.shape[0]
        out, _ = chunk_gated_delta_rule(q.view(1, t, HK, DK), k.view(1, t, HK, DK), v.view(1, t, HV, DV),
                                        self.g[None], self.beta[None])
        return out[0]


def run_steps(backend: TorchGDNBackend, layer: GDNAttention, weight: torch.Tensor,
              plan: list[list[tuple[Stream, int, int, int]]]) -> dict[int, list[torch.Tensor]]:
    """Each step: [(stream, slot, start, n)]; returns the outputs of each stream id, in order."""
    outs: dict[int, list[torch.Tensor]] = {}
    for step in plan:
        fb = gdn_batch(backend, [n for _, _, _, n in step], [s for _, _, s, _ in step], [sl for _, sl, _, _ in step])
        x = torch.cat([st.x[s:s + n] for st, _, s, n in step])
        g = torch.cat([st.g[s:s + n] for st, _, s, n in step])
        beta = torch.cat([st.beta[s:s + n] for st, _, s, n in step])
        out = backend.forward(x, g, beta, weight, layer, fb)
        row = 0
        for st, _, _, n in step:
            outs.setdefault(id(st), []).append(out[row:row + n])
            row += n
    return outs


def test_mixed_batches_through_the_backend_match_whole_sequences():
    pool = make_pool()
    backend = TorchGDNBackend(pool)
    layer = GDNAttention(1, HK, HV, DK, DV, KERNEL)
    weight = torch.randn(CONV_DIM, KERNEL, generator=torch.Generator().manual_seed(0)) * 0.5
    a, b, c, d = Stream(150, 1), Stream(72, 2), Stream(7, 3), Stream(31, 4)
    plan = [
        [(a, 1, 0, 64), (b, 2, 0, 40)],  # two prefill chunks
        # a one-token chunk, a chunk over a carried state batched with a prompt of its length, a whole prompt
        [(a, 1, 64, 1), (b, 2, 40, 30), (c, 4, 0, 5), (d, 3, 0, 30)],
        [(a, 1, 65, 85)],  # a chunk over two 64-token GDN chunks, alone
        [(b, 2, 70, 1), (c, 4, 5, 1), (d, 3, 30, 1)],  # a DECODE step
        [(c, 4, 6, 1), (b, 2, 71, 1)],  # another, batch order swapped
    ]
    outs = run_steps(backend, layer, weight, plan)
    for st in (a, b, c, d):
        torch.testing.assert_close(torch.cat(outs[id(st)]), st.reference(weight), atol=1e-5, rtol=1e-5)
    assert not pool.conv_state[:, 0].any() and not pool.recurrent_state[:, 0].any(), "the dummy slot stays unused"
    assert not pool.recurrent_state[0].any(), "GDN layer 0 was never run"


def test_reused_slot_shows_no_state_of_the_previous_request():
    pool = make_pool()
    backend = TorchGDNBackend(pool)
    layer = GDNAttention(0, HK, HV, DK, DV, KERNEL)
    weight = torch.randn(CONV_DIM, KERNEL, generator=torch.Generator().manual_seed(1)) * 0.5
    old, new = Stream(90, 10), Stream(40, 11)
    run_steps(backend, layer, weight, [[(old, 2, 0, 89)], [(old, 2, 89, 1)]])  # the old request ends in slot 2
    assert pool.recurrent_state[0, 2].abs().sum() > 0

    pool.zero(torch.tensor([2]))  # what the scheduler does before a request's first extend
    outs = run_steps(backend, layer, weight, [[(new, 2, 0, 30)], [(new, 2, 30, 10)]])
    torch.testing.assert_close(torch.cat(outs[id(new)]), new.reference(weight), atol=1e-5, rtol=1e-5)

    # Without the reset the old state leaks into the new request's output.
    run_steps(backend, layer, weight, [[(old, 2, 0, 90)]])
    leaked = run_steps(backend, layer, weight, [[(new, 2, 0, 40)]])[id(new)][0]
    assert not torch.allclose(leaked, new.reference(weight), atol=1e-3)
