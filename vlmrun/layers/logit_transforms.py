"""The sampler's logit transforms: the grammar mask, the allowed-token mask, the blocked tokens
(min_tokens, bad words), the logit bias, penalties, truncation.

Each takes float32 logits `[batch, vocab]` and the step's `SamplingBatch` (or the tensors it holds)
and returns new logits; all work out of place, so the caller's logits are never written. Removed
tokens become `-inf`.
"""

from __future__ import annotations

from typing import Optional

import torch

from vlmrun.layers.sampling_batch import SamplingBatch

Tensor = torch.Tensor


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, then frequency and presence penalties. logits: [batch, vocab] float32."""
    if batch.seen_mask is not None:
        logits = apply_repetition_penalty(logits, batch.seen_mask, batch.repetition_penalties)
    if batch.output_counts is not None:
        logits = apply_frequency_presence_penalties(
            logits, batch.output_counts, batch.frequency_penalties, batch.presence_penalties)
    return logits


def apply_repetition_penalty(logits: Tensor, seen_mask: Tensor, penalties: Tensor) -> Tensor:
    """Seen tokens: positive logits / penalty, others * penalty. seen_mask [batch, vocab], penalties [batch, 1]."""
    penalised = torch.where(logits > 0, logits / penalties, logits * penalties)  # [batch, vocab]
    return torch.where(seen_mask, penalised, logits)


def apply_frequency_presence_penalties(logits: Tensor, counts: Tensor, frequency: Tensor,
                                       presence: Tensor) -> Tensor:
    """logit -= frequency * count + presence * (count > 0). counts [batch, vocab]; penalties [batch, 1]."""
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_allowed_token_ids(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Tokens outside a row's allowed_token_ids become -inf. logits and mask [batch, vocab]."""
    if batch.outside_allowed is None:
        return logits
    return logits.masked_fill(batch.outside_allowed, float("-inf"))


def apply_logit_bias(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Add each row's logit_bias. logits and bias [batch, vocab]."""
    if batch.logit_bias is None:
        return logits
    return logits + batch.logit_bias


def apply_blocked_tokens(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Set the blocked (row, token) pairs (min_tokens, bad words) to -inf."""
    if batch.blocked_rows is None:
        return logits
    logits = logits.clone()
    logits[batch.blocked_rows, batch.blocked_tokens] = float("-inf")
    return logits


def apply_token_bitmask(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Grammar rows: tokens whose bit is 0 become -inf. logits [batch, vocab]; bitmask [batch, words]."""
    if batch.token_bitmask is None:
        return logits
    import xgrammar  # only a batch with grammar rows gets here

    logits = logits.clone()
    xgrammar.apply_token_bitmask_inplace(logits, batch.token_bitmask, vocab_size=logits.shape[-1],
                                         indices=batch.grammar_rows)
    return logits


def apply_truncation(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Min-p, top-k, then top-p: removed tokens become -inf. logits [batch, vocab] (temperature-scaled)."""
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    if batch.top_p is not None:
        return apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.top_k is not None:
        return apply_top_k(logits, batch.top_k, batch.top_k_max)
    return logits


def apply_top_k(logits: Tensor, top_k: Tensor, k_max: int) -> Tensor:
    """Keep logits >= the row's k-th largest (ties at the k-th value survive). top_k [batch, 1]."""
    values = logits.topk(k_max, dim=-1).values  # [batch, k_max], descending
    kth = values.gather(-1, top_k.clamp(max=k_max) - 1)  # [batch, 1]
    kth = kth.masked_fill(top_k >= logits.shape[-1], float("-inf"))  # rows with top-k off
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Optional[Tensor], top_p: Tensor) -> Tensor:
    """Top-k (same rule as `apply_top_k`), then top-p on the renormalised survivors, in sorted order."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [batch, vocab]
    if top_k is not None:
        kth = sorted_logits.gather(-1, top_k - 1)  # [batch, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [batch, vocab]
    mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 at rank 0, so the top token stays
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the top probability. min_p [batch, 1]."""
    probs = torch.softmax(logits, dim=-1)  # [batch, vocab]
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [batch, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))
