"""The batched sampler: float32 logits `[batch, vocab]` in, one token per row out.

The parts: `SamplingRow` / `SamplingBatch` (`sampling_batch.py`, the step's per-row settings as
tensors), the logit transforms (`logit_transforms.py`), `SamplerOutput` (`sampler_output.py`, ids
and logprobs until the one host sync); `Sampler` here runs them in order.

Per call, in this order (vLLM's: its model runner applies the grammar bitmask before its sampler,
which then applies allowed_token_ids, bad words, min_tokens and logit_bias, then penalties):

1. **Logprobs** (only when some row asked) come from the RAW model logits: `log_softmax` of the
   unmodified float32 logits, before any of the steps below (grammar mask, allowed_token_ids, bad
   words, min_tokens, logit_bias, penalties, temperature, truncation). vLLM's default
   `logprobs_mode="raw_logprobs"` is the same, except that there a grammar row's logprobs already
   see the grammar mask (applied before vLLM's sampler); vlmrun's do not. Each asking row gets its
   top-`logprobs` tokens plus the chosen token, so its dict has `logprobs` or `logprobs + 1`
   entries; rows that did not ask get None.
2. **Masks**, each turning tokens to `-inf`:
   - the **grammar mask** (structured outputs): a row whose request carries a grammar state gets
     `-inf` on every token its grammar does not allow next. The state fills its row of an int32
     bitmask `[batch, ceil(vocab / 32)]` (bit j of word w = token `32 w + j`) on the host in
     `SamplingBatch.build`, which the runner calls after queueing the model's forward, so on CUDA
     the filling overlaps the forward; xgrammar's kernel (C++ on CPU, Triton on CUDA) then applies
     the grammar rows' masks to a copy of the logits;
   - **allowed_token_ids**: every token outside a row's list;
   - **blocked tokens**: a bad word's last token when its other tokens are the row's latest
     outputs; and while a row has fewer than `min_tokens` outputs, its EOS ids (unless
     `ignore_eos`) and `stop_token_ids` (not for grammar rows: their grammar decides).
3. **logit_bias**: each row's bias is added (a masked token stays `-inf`, so a bias cannot undo a
   grammar, allowed_token_ids, bad words or min_tokens).
4. **Penalties**: repetition penalty (HF/vLLM: over prompt + output tokens, a positive logit is
   divided by the penalty, a non-positive one multiplied), then frequency and presence penalties
   (OpenAI: over output tokens only, `logit -= frequency * count + presence * (count > 0)`); they
   see the biased logits.
5. **Greedy** rows take the argmax of those logits. **Sampled** rows divide by temperature, then
   min-p (relative to the most likely token), top-k, and top-p (on the distribution renormalised
   after top-k / min-p) turn the removed tokens to `-inf`; the survivors are drawn with the
   exponential race: `argmax(probs / E)`, `E ~ Exponential(1)` i.i.d. per vocab entry, which picks
   token i with probability `probs[i]`. Both argmaxes are `last_dim_argmax` (torch.argmax's indices, in
   three vectorized passes on the CPU: `vlmrun/layers/argmax.py`).

Randomness: a row whose request carries a `torch.Generator` (the engine makes one per seeded
request from its seed, on the logits' device, and passes the same object every step) draws its
noise row from that generator alone, so a seeded request gives the same tokens whatever batch
or position it sits in. Other rows share `Sampler.generator` (None: torch's default generator).
Seeded rows cost one small kernel each; everything else is batched. Top-k keeps every token whose
logit is >= the k-th largest (so exact ties at the k-th value may keep a few more than k). Each
row's result depends only on that row, whichever of the truncation paths its batch takes (top-k
alone uses `topk`; with top-p a full sort), so seeded rows stay reproducible.

Host syncs: `Sampler.sample` never waits on the device; `SamplingBatch.build` only copies
host→device (pinned, non-blocking on CUDA). The single device→host sync is
`SamplerOutput.to_host()`, which moves token ids and all logprobs in one transfer; the caller
(model runner) does it once per step. `SamplerOutput.logprobs` calls it (cached).

Cost note: the model runner does not rebuild the batch from the rows each step: it gathers it from
its `SamplingState` (`sampling_state.py`: per page-table row settings and penalty counts, kept from
step to step, O(1) host work per penalty row); the blocked tokens, the logit bias and the allowed
mask are built from the rows that use them (speculative verification builds every row with
`SamplingBatch.build`). The all-greedy path with none of them is one argmax.
"""

from __future__ import annotations

from typing import Optional

import torch

from vlmrun.layers.argmax import last_dim_argmax
from vlmrun.layers.logit_transforms import (apply_allowed_token_ids, apply_blocked_tokens, apply_logit_bias,
                                            apply_penalties, apply_token_bitmask, apply_truncation)
from vlmrun.layers.sampler_output import SamplerOutput, gather_logprobs
from vlmrun.layers.sampling_batch import SamplingBatch

Tensor = torch.Tensor


class Sampler:
    """Turns a step's logits into tokens. `generator` feeds the unseeded sampled rows."""

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        self.generator = generator

    def sample(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [batch, vocab] float32 (never modified). No device→host sync happens here."""
        logits = logits.float()
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [batch, vocab]
        logits = apply_token_bitmask(logits, batch)
        logits = apply_allowed_token_ids(logits, batch)
        logits = apply_blocked_tokens(logits, batch)
        logits = apply_logit_bias(logits, batch)
        logits = apply_penalties(logits, batch)
        if batch.all_greedy:
            token_ids = last_dim_argmax(logits)  # [batch]
        else:
            token_ids = self._sample_rows(logits, batch)
        return gather_logprobs(token_ids, raw_logprobs, batch)

    def _sample_rows(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """Temperature, truncation and a draw for every row; greedy rows then take the argmax."""
        scaled = logits / batch.temperatures  # [batch, vocab]
        scaled = apply_truncation(scaled, batch)
        probs = torch.softmax(scaled, dim=-1)  # [batch, vocab]
        token_ids = self._draw(probs, batch)  # [batch]
        if batch.greedy_mask is not None:
            token_ids = torch.where(batch.greedy_mask, last_dim_argmax(logits), token_ids)
        return token_ids

    def _draw(self, probs: Tensor, batch: SamplingBatch) -> Tensor:
        """Exponential race: argmax(probs / E), E ~ Exp(1); seeded rows use their own generator."""
        noise = torch.empty_like(probs)  # [batch, vocab]
        if len(batch.seeded_rows) < batch.batch_size:
            noise.exponential_(generator=self.generator)
        for row in batch.seeded_rows:
            noise[row].exponential_(generator=batch.generators[row])
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # an exact 0 would make 0/0
        return last_dim_argmax(probs / noise)
