"""What the sampler returns: sampled token ids and raw logprobs, on the device until `to_host()`.

`gather_logprobs` picks, for the rows that asked, the top-`logprobs` raw logprobs and the chosen
token's (tensors, no sync). `SamplerOutput.to_host()` is the step's single device→host sync: token
ids and all logprobs travel in one transfer; the caller (model runner) does it once per step.
`start_transfer()` starts that copy without waiting (async scheduling: the host reads it one step
later). `SamplerOutput.logprobs` calls `to_host` (cached).

`gather_prompt_logprobs` does the same for prompt positions (`SamplingParams.prompt_logprobs`): the
raw logprob of each position's next prompt token and the top-k, packed in the row layout the
sampled tokens use, so `logprob_dicts` reads both. Both also count the chosen token's rank in the whole
vocabulary (vLLM's: the tokens at least as likely), handed out as the dict's `chosen_rank`
(`vlmrun.logprobs.TokenLogprobs`; `LLM` writes it in vLLM's `Logprob.rank`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from vlmrun.layers.sampling_batch import SamplingBatch
from vlmrun.logprobs import TokenLogprobs

Tensor = torch.Tensor


@dataclass
class HostSamplerOutput:
    """Sampler results on the host, after the one device→host sync."""

    token_ids: list[int]
    logprobs: list[Optional[dict[int, float]]]


@dataclass
class SamplerOutput:
    """Sampled tokens (still on the device) and the tensors the logprob dicts are made from."""

    token_ids: Tensor  # [batch] int64
    num_logprobs: list[Optional[int]]
    chosen_logprobs: Optional[Tensor] = None  # [batch] float32, raw logprob of the chosen token
    top_logprobs: Optional[Tensor] = None  # [batch, max_k] float32, descending
    top_token_ids: Optional[Tensor] = None  # [batch, max_k] int64
    chosen_ranks: Optional[Tensor] = None  # [batch] int64: tokens at least as likely as the chosen one
    _in_transit: Optional[tuple[Tensor, Optional[torch.cuda.Event]]] = field(default=None, repr=False)
    _host: Optional[HostSamplerOutput] = field(default=None, repr=False)

    def start_transfer(self) -> None:
        """Start the copy of everything to the host, without waiting for it (on CUDA: into pinned
        memory, behind the step's kernels, with an event to wait on). Idempotent."""
        if self._in_transit is not None or self._host is not None:
            return
        packed = self._pack()
        if packed.device.type != "cuda":
            self._in_transit = (packed, None)
            return
        host = packed.to("cpu", non_blocking=True)  # pinned: the copy runs after the step's kernels
        done = torch.cuda.Event()
        done.record()
        self._in_transit = (host, done)

    def to_host(self) -> HostSamplerOutput:
        """The one device→host sync: token ids and logprobs travel in a single transfer."""
        if self._host is None:
            self.start_transfer()
            packed, done = self._in_transit
            if done is not None:
                done.synchronize()
            self._host = self._unpack(packed.tolist())
            self._in_transit = None
        return self._host

    @property
    def logprobs(self) -> list[Optional[dict[int, float]]]:
        """Per row: {token id: raw logprob} for the top-k tokens and the chosen one, or None."""
        return self.to_host().logprobs

    def _pack(self) -> Tensor:
        """[batch] token ids, or with logprobs [batch, 3 + 2k] float64 rows (float64 holds every token id
        and float32 logprob exactly): chosen id, chosen logprob, top ids, top logprobs, chosen rank."""
        if self.chosen_logprobs is None:
            return self.token_ids
        parts = [self.token_ids.view(-1, 1), self.chosen_logprobs.view(-1, 1)]
        if self.top_logprobs is not None:
            parts += [self.top_token_ids, self.top_logprobs]
        parts.append(self.chosen_ranks.view(-1, 1))
        return torch.cat([p.to(torch.float64) for p in parts], dim=1)

    def _unpack(self, packed: list) -> HostSamplerOutput:
        if self.chosen_logprobs is None:
            return HostSamplerOutput(packed, [None] * len(packed))
        k_max = 0 if self.top_logprobs is None else self.top_logprobs.shape[1]
        ids = [int(row[0]) for row in packed]
        dicts = [_logprob_dict(row, k, k_max) for row, k in zip(packed, self.num_logprobs)]
        return HostSamplerOutput(ids, dicts)


def gather_prompt_logprobs(logits: Tensor, next_token_ids: Tensor, k: int) -> Tensor:
    """`logits` [m, vocab] float32 of m prompt positions, `next_token_ids` [m] int64 the prompt token after
    each -> [m, 3 + 2k] float64 rows: next id, its raw logprob, top-k ids, top-k logprobs, its rank."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [m, vocab]
    chosen = logprobs.gather(-1, next_token_ids.view(-1, 1))  # [m, 1]
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [m, k] each
    ranks = (logprobs >= chosen).sum(dim=-1, keepdim=True)  # [m, 1]
    parts = [next_token_ids.view(-1, 1), chosen, top_ids, top_logprobs, ranks]
    return torch.cat([p.to(torch.float64) for p in parts], dim=1)


def logprob_dicts(rows: list[list[float]], k: int) -> list[TokenLogprobs]:
    """Host rows of `gather_prompt_logprobs` -> one {token id: raw logprob} per position."""
    return [_logprob_dict(row, k, k) for row in rows]


def _logprob_dict(row: list[float], k: Optional[int], k_max: int) -> Optional[TokenLogprobs]:
    """Row layout: [chosen id, chosen logprob, top ids (k_max), top logprobs (k_max), chosen rank]."""
    if k is None:
        return None
    top_ids = row[2:2 + k_max][:k]
    top_vals = row[2 + k_max:2 + 2 * k_max][:k]
    out = TokenLogprobs((int(t), v) for t, v in zip(top_ids, top_vals))
    out[int(row[0])] = row[1]
    out.chosen_rank = int(row[2 + 2 * k_max])
    return out


def gather_logprobs(token_ids: Tensor, raw_logprobs: Optional[Tensor], batch: SamplingBatch) -> SamplerOutput:
    """Top-k and chosen-token raw logprobs for the rows that asked (tensors, no sync)."""
    out = SamplerOutput(token_ids=token_ids, num_logprobs=batch.num_logprobs)
    if raw_logprobs is None:
        return out
    out.chosen_logprobs = raw_logprobs.gather(-1, token_ids.view(-1, 1)).view(-1)  # [batch]
    out.chosen_ranks = (raw_logprobs >= out.chosen_logprobs.view(-1, 1)).sum(dim=-1)  # [batch]
    k = min(batch.max_num_logprobs or 0, raw_logprobs.shape[-1])
    if k > 0:
        out.top_logprobs, out.top_token_ids = raw_logprobs.topk(k, dim=-1)  # [batch, k] each
    return out
