"""The engine path of hybrid (GDN + full attention) models, with a tiny hybrid model defined here.

`TinyHybridLM` implements the model contract of docs/contracts.md ("Hybrid models"): GDN layers
call `GDNAttention`, the full-attention layer calls `Attention`, and the runner sizes a KV pool
(full-attention layers only) and a GDN state pool from its attributes. Every case runs through
`vlmrun.LLM` (scheduler, chunked prefill, preemption, GDN slots) and is compared with a direct
unbatched computation of the same weights: HF's `causal_conv1d_fn` + `torch_chunk_gated_delta_rule`
for the GDN layers and causal SDPA for attention, recomputed over the whole sequence every step.
The checkpoint directory (tokenizer, config) is the tiny Qwen3 one; `load_model` is patched to
return the hybrid model.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.utils import logging as hf_logging

from vlmrun.processors import ProcessedPrompt
from vlmrun import LLM, SamplingParams
from vlmrun.config import CacheShape
from vlmrun.engine import engine as engine_module
from vlmrun.cache.plan import gdn_bytes_per_request, kv_bytes_per_token
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention, GDNAttention

hf_logging.set_verbosity_error()

HIDDEN = 32
HK, HV, DK, DV, KERNEL = 2, 4, 8, 8, 4  # GDN: each q/k head serves two value heads
CONV_DIM = 2 * HK * DK + HV * DV
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
TOPK = 5
ATOL = 1e-4


class TinyGDN(nn.Module):
    def __init__(self, layer_id: int):
        super().__init__()
        self.in_proj_qkv = nn.Linear(HIDDEN, CONV_DIM, bias=False)
        self.in_proj_ab = nn.Linear(HIDDEN, 2 * HV, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(CONV_DIM, KERNEL) * 0.5)  # [conv_dim, K]
        self.A_log = nn.Parameter(torch.log(torch.rand(HV) * 2 + 0.1))
        self.dt_bias = nn.Parameter(torch.randn(HV) * 0.5)
        self.out_proj = nn.Linear(HV * DV, HIDDEN, bias=False)
        self.linear_attn = GDNAttention(layer_id, HK, HV, DK, DV, KERNEL)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.in_proj_ab(x).chunk(2, dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] float32 log-decay
        return g, b.sigmoid()

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        g, beta = self.gates(x)
        core = self.linear_attn(self.in_proj_qkv(x), g, beta, self.conv_weight, fb)  # [T, Hv, Dv]
        return self.out_proj(core.flatten(1))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence x [L, hidden], no cache, with HF's torch functions."""
        n = x.shape[0]
        y = hf.causal_conv1d_fn(self.in_proj_qkv(x).t()[None], self.conv_weight, activation="silu")[0].t()
        q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
        g, beta = self.gates(x)
        core, _ = hf.torch_chunk_gated_delta_rule(q.view(1, n, HK, DK), k.view(1, n, HK, DK), v.view(1, n, HV, DV),
                                                  g=g[None], beta=beta[None], use_qk_l2norm_in_kernel=True)
        return self.out_proj(core[0].flatten(1))


class TinyAttention(nn.Module):
    def __init__(self, layer_id: int):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.kv_proj = nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        return self.o_proj(self.attn(self.q_proj(x), k, v, fb))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        q = self.q_proj(x).view(n, HEADS, HEAD_DIM).transpose(0, 1)
        k, v = (t.view(n, KV_HEADS, HEAD_DIM).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=HEAD_DIM ** -0.5, enable_gqa=True)
        return self.o_proj(out.transpose(0, 1).reshape(n, HEADS * HEAD_DIM))


class TinyHybridLM(nn.Module):
    """GDN, full attention, GDN; implements the part of `vlmrun.models.base.Model` the engine calls."""

    supports_images = False

    def cache_shape(self) -> CacheShape:
        return CacheShape(num_attention_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_gdn_layers=2,
                          gdn_conv_dim=CONV_DIM, gdn_conv_kernel=KERNEL, gdn_num_v_heads=HV,
                          gdn_head_v_dim=DV, gdn_head_k_dim=DK)

    def __init__(self, vocab_size: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, HIDDEN)
        self.layers = nn.ModuleList([TinyGDN(0), TinyAttention(0), TinyGDN(1)])
        self.norms = nn.ModuleList([nn.RMSNorm(HIDDEN) for _ in range(len(self.layers) + 1)])
        self.lm_head = nn.Linear(HIDDEN, vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=1.0)  # a wide spread keeps greedy argmax away from ties

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed(input_ids)
        for norm, layer in zip(self.norms, self.layers):
            h = h + layer(norm(h), fb)
        return self.norms[-1](h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        h = self.embed(torch.tensor(token_ids))
        for norm, layer in zip(self.norms, self.layers):
            h = h + layer.reference(norm(h))
        return self.compute_logits(self.norms[-1](h))  # [L, vocab]


@pytest.fixture(scope="module")
def hybrid_model(qwen3_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(qwen3_dir).vocab_size
    return TinyHybridLM(vocab).eval()


@pytest.fixture
def make_llm(qwen3_dir, hybrid_model, monkeypatch):
    monkeypatch.setattr(engine_module, "load_model", lambda model_config, device, **_: hybrid_model)

    def make(**kwargs) -> LLM:
        return LLM(str(qwen3_dir), dtype="float32", device="cpu", **kwargs)

    return make


def prompts_of(lengths: list[int], seed: int = 0) -> list[ProcessedPrompt]:
    gen = torch.Generator().manual_seed(seed)
    return [ProcessedPrompt(token_ids=torch.randint(0, 500, (n,), generator=gen).tolist(), mm_items=[])
            for n in lengths]


def reference_greedy(model: TinyHybridLM, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(steps):
        lp = torch.log_softmax(model.reference_logits(ids)[-1], dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(lp)
        ids.append(tok)
    return tokens, logprobs


def run_and_compare(llm: LLM, model: TinyHybridLM, prompts: list[ProcessedPrompt], max_new: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=TOPK, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.error is None, out.error
        tokens, ref = reference_greedy(model, prompt.token_ids, max_new)
        assert out.token_ids == tokens, f"request {i} (prompt of {len(prompt.token_ids)}): greedy tokens differ"
        for step, (ours, lp) in enumerate(zip(out.logprobs, ref)):
            for tok, value in ours.items():
                assert abs(value - lp[tok].item()) < ATOL, f"request {i} step {step} token {tok}"
    caches = llm.engine.caches
    assert caches.allocator.num_free_pages() == caches.allocator.num_usable_pages()
    assert caches.req_to_token.num_free() == caches.req_to_token.max_reqs


def test_runner_builds_a_gdn_pool_and_reports_bytes(make_llm, caplog):
    with caplog.at_level(logging.INFO, logger="vlmrun.engine.engine"):
        llm = make_llm(max_num_seqs=4)
    runner, caches = llm.engine.executor, llm.engine.caches
    shape = runner.model.cache_shape()
    assert caches.kv_pool.num_layers == 1, "KV only for the full-attention layer"
    assert caches.gdn_pool.conv_state.shape == (2, 5, CONV_DIM, KERNEL - 1)
    assert caches.gdn_pool.recurrent_state.shape == (2, 5, HV, DV, DK)
    assert caches.gdn_pool.recurrent_state.dtype == torch.float32
    assert caches.plan.kv_bytes_per_token == kv_bytes_per_token(shape, torch.float32) == 2 * KV_HEADS * HEAD_DIM * 4
    assert caches.plan.gdn_bytes_per_request == gdn_bytes_per_request(shape, torch.float32, torch.float32) \
        == 2 * (CONV_DIM * (KERNEL - 1) * 4 + HV * DV * DK * 4)
    line = [r.getMessage() for r in caplog.records if "GDN state" in r.getMessage()]
    assert line and f"{caches.plan.gdn_bytes_per_request} bytes/request" in line[0]
    assert f"KV {caches.plan.kv_bytes_per_token} bytes/token" in line[0]


def test_gdn_state_dtype_option(make_llm):
    llm = make_llm(max_num_seqs=2, gdn_state_dtype="bfloat16")
    assert llm.engine.caches.gdn_pool.recurrent_state.dtype == torch.bfloat16
    assert llm.engine.caches.gdn_pool.conv_state.dtype == torch.float32  # the model dtype


def test_mixed_batch_with_chunked_prefill(make_llm, hybrid_model):
    # Budget 100: prefill chunks of odd sizes share steps with other requests' decodes.
    llm = make_llm(max_num_batched_tokens=100, page_size=4)
    run_and_compare(llm, hybrid_model, prompts_of([3, 17, 64, 65, 130, 250, 1], seed=1), max_new=6)


@pytest.mark.parametrize("budget", [63, 64, 65, 8192])
def test_chunk_boundaries_and_long_prompts(make_llm, hybrid_model, budget):
    # One request alone is cut at (64), before (63) or after (65) every 64-token GDN chunk; with
    # 8192 each prompt (longer than three GDN chunks) is one extend.
    llm = make_llm(max_num_batched_tokens=budget)
    run_and_compare(llm, hybrid_model, prompts_of([230], seed=2), max_new=4)
    run_and_compare(llm, hybrid_model, prompts_of([200, 70, 129], seed=3), max_new=4)


def test_preemption_and_recompute(make_llm, hybrid_model):
    prompts = prompts_of([40, 33, 47, 29, 52], seed=4)
    max_new, page, seqs = 10, 4, 8
    longest = max(len(p.token_ids) for p in prompts) + max_new
    pages = (longest + page - 1) // page + 2  # room for the longest request alone, not for all at once
    shape = hybrid_model.cache_shape()
    budget = (pages * page * kv_bytes_per_token(shape, torch.float32)
              + (seqs + 1) * gdn_bytes_per_request(shape, torch.float32, torch.float32))
    llm = make_llm(page_size=page, max_num_batched_tokens=16, max_num_seqs=seqs, kv_cache_memory_bytes=budget)
    assert llm.engine.caches.plan.max_num_seqs == seqs
    run_and_compare(llm, hybrid_model, prompts + prompts, max_new=max_new)
    assert llm.engine.scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"


def test_slot_reuse(make_llm, hybrid_model):
    # Two rows (GDN slots 1 and 2) serve seven requests one after another: every new request
    # starts from a zeroed slot that another request used before.
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=50)
    assert llm.engine.caches.gdn_pool.num_slots == 3
    run_and_compare(llm, hybrid_model, prompts_of([90, 5, 66, 12, 140, 3, 64], seed=5), max_new=5)
    run_and_compare(llm, hybrid_model, prompts_of([20, 21], seed=6), max_new=3)


def test_non_hybrid_model_has_no_gdn_pool(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", max_num_seqs=2)
    runner, caches = llm.engine.executor, llm.engine.caches
    assert caches.gdn_pool is None and caches.plan.gdn_bytes_per_request == 0
    assert type(runner.attn_backend).__name__ == "CpuAttnBackend"
