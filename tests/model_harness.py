"""Run a vlmrun model over whole sequences with the torch attention backend, outside the engine.

Used by model-level tests: each call is one prefill of a fresh sequence (or several, batched).
"""

from __future__ import annotations

import torch

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool
from vlmrun.config import CacheShape
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import Attention, GDNAttention
from vlmrun.layers.attention.torch_backend import TorchAttnBackend
from vlmrun.models.blocks.text_decoder import DEEPSTACK


def prefill_logits(model, sequences: list[torch.Tensor], positions: list[torch.Tensor], *,
                   mm_mask: torch.Tensor | None = None, mm_embeds: torch.Tensor | None = None,
                   deepstack_embeds: torch.Tensor | None = None, all_logits: bool = True) -> torch.Tensor:
    """sequences[i]: [L_i] token ids; positions[i]: [3, L_i]. Returns logits [sum L_i, vocab] (or last rows)."""
    lens = [int(s.shape[0]) for s in sequences]
    total = sum(lens)
    shape = model.cache_shape()
    kv_pool = KVPool(shape.num_attention_layers, total + 1, shape.num_kv_heads, shape.head_dim, torch.float32,
                     torch.device("cpu"))
    req_pool = ReqToTokenPool(len(sequences), max(lens), torch.device("cpu"))
    slots = torch.arange(1, total + 1)  # slot 0 is the dummy
    start = 0
    for i, n in enumerate(lens):
        req_pool.req_to_token[i, :n] = slots[start:start + n]
        start += n
    backend = TorchAttnBackend(kv_pool, req_pool)
    ends = torch.cumsum(torch.tensor(lens), 0)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.cat(sequences),
        positions=torch.cat(positions, dim=1),
        req_pool_indices=torch.arange(len(sequences)),
        seq_lens=torch.tensor(lens),
        extend_prefix_lens=torch.zeros(len(sequences), dtype=torch.int64),
        extend_seq_lens=torch.tensor(lens),
        out_cache_loc=slots,
        seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(lens),
        extend_seq_lens_cpu=lens,
        logits_indices=torch.arange(total) if all_logits else ends - 1,
        attn_backend=backend,
        mm_mask=mm_mask,
        mm_embeds=mm_embeds,
        mm_extras=None if deepstack_embeds is None else {DEEPSTACK: deepstack_embeds},
    )
    backend.prepare(fb)
    with torch.no_grad():
        hidden = model(fb.input_ids, fb.positions, fb)
        return model.compute_logits(hidden[fb.logits_indices])


def cache_shape_of_layers(model) -> CacheShape:
    """The cache shape the built layers need, read off their `Attention` / `GDNAttention` modules."""
    full = [m for m in model.modules() if isinstance(m, Attention)]
    gdn_layers = [m for m in model.modules() if isinstance(m, GDNAttention)]
    fields = dict(num_attention_layers=len(full), num_kv_heads=full[0].num_kv_heads, head_dim=full[0].head_dim,
                  num_gdn_layers=len(gdn_layers))
    if gdn_layers:
        fields.update(gdn_conv_dim=gdn_layers[0].conv_dim, gdn_conv_kernel=gdn_layers[0].conv_kernel_size,
                      gdn_num_v_heads=gdn_layers[0].num_v_heads, gdn_head_v_dim=gdn_layers[0].head_v_dim,
                      gdn_head_k_dim=gdn_layers[0].head_k_dim)
    return CacheShape(**fields)
