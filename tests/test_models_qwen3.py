"""Qwen3 text model parity with HF transformers (float32, CPU), single and batched prefill."""

from __future__ import annotations

import pytest
import torch

from tests.model_harness import cache_shape_of_layers, prefill_logits
from vlmrun.loader import iter_weights
from vlmrun.models.registry import get_model_class


@pytest.fixture(scope="module")
def models(qwen3_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(qwen3_dir))
    ours = get_model_class(config.architectures)(config).eval()
    loaded = ours.load_weights(iter_weights(qwen3_dir))
    assert loaded == {n for n, _ in ours.named_parameters()}
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf


def _ours(model, seqs):
    positions = [torch.arange(len(s)).expand(3, -1) for s in seqs]
    return prefill_logits(model, seqs, positions)


def test_attributes(models):
    ours, hf = models
    cfg = hf.config
    assert cache_shape_of_layers(ours) == ours.cache_shape()  # the shape it declares is what its layers need
    assert ours.cache_shape().num_attention_layers == cfg.num_hidden_layers
    assert ours.cache_shape().num_kv_heads == cfg.num_key_value_heads
    assert ours.cache_shape().head_dim == cfg.head_dim
    assert ours.lm_head.in_features == cfg.hidden_size and ours.lm_head.out_features == cfg.vocab_size
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tiny qwen3 ties embeddings


def test_logits_match_hf_single_and_batched(models):
    ours, hf = models
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, ours.lm_head.out_features, (n,), generator=gen) for n in (17, 6)]
    batched = _ours(ours, seqs)
    start = 0
    for s in seqs:
        with torch.no_grad():
            ref = hf(input_ids=s[None]).logits[0].float()
        single = _ours(ours, [s])
        assert (single - ref).abs().max().item() < 1e-4
        assert (batched[start:start + len(s)] - single).abs().max().item() < 5e-5  # padding: float noise
        start += len(s)


def test_registry_unknown_architecture():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(["LlamaForCausalLM"])
