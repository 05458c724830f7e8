"""The batched sampler: float32 logits `[batch, vocab]` in, one token per row out.

Per call, in this order:

1. **Logprobs** (only when some row asked) come from the RAW model logits: `log_softmax` of the
   unmodified float32 logits, before penalties, the min_tokens mask, temperature or truncation
   (vLLM's default "raw logprobs"). Each asking row gets its top-`logprobs` tokens plus the chosen
   token, so its dict has `logprobs` or `logprobs + 1` entries; rows that did not ask get None.
2. **Penalties**: repetition penalty (HF/vLLM: over prompt + output tokens, a positive logit is
   divided by the penalty, a non-positive one multiplied), then frequency and presence penalties
   (OpenAI: over output tokens only, `logit -= frequency * count + presence * (count > 0)`).
3. **min_tokens**: while a row has fewer than `min_tokens` outputs, its EOS ids (unless
   `ignore_eos`) and `stop_token_ids` get `-inf` (not for grammar rows: their grammar decides).
4. **Grammar mask** (structured outputs): a row whose request carries a grammar state gets `-inf`
   on every token its grammar does not allow next. The state fills its row of an int32 bitmask
   `[batch, ceil(vocab / 32)]` (bit j of word w = token `32 w + j`) on the host in
   `SamplingBatch.build`, which the runner calls after queueing the model's forward, so on CUDA the
   filling overlaps the forward; xgrammar's kernel (C++ on CPU, Triton on CUDA) then applies the
   grammar rows' masks to a copy of the logits.
5. **Greedy** rows take the argmax of those logits. **Sampled** rows divide by temperature, then
   min-p (relative to the most likely token), top-k, and top-p (on the distribution renormalised
   after top-k / min-p) turn the removed tokens to `-inf`; the survivors are drawn with the
   exponential race: `argmax(probs / E)`, `E ~ Exponential(1)` i.i.d. per vocab entry, which picks
   token i with probability `probs[i]`.

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

Cost note: penalties and the min_tokens mask are rebuilt from the token lists every step
(O(tokens) host work for rows that use them); the all-greedy, no-penalty path is one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from vlmrun.sampling_params import SamplingParams

Tensor = torch.Tensor


class SamplingRow(NamedTuple):
    """What the sampler needs to know about one request this step (a plain tuple of these six works too).

    `grammar` (structured outputs) is anything with `fill_bitmask(bitmask [n, words] int32 CPU, row)`
    that writes the tokens allowed next into `bitmask[row]`, e.g. `vlmrun.structured.GrammarState`."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: Optional[torch.Generator] = None
    eos_token_ids: Sequence[int] = ()
    grammar: Optional[Any] = None


RowLike = Union[SamplingRow, tuple]


# --------------------------------------------------------------------------------------------
# Batch of per-row settings, as device tensors
# --------------------------------------------------------------------------------------------


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step. A None field means "no row needs it"."""

    batch_size: int
    vocab_size: int
    all_greedy: bool
    greedy_mask: Optional[Tensor] = None  # [batch] bool; None unless greedy and sampled rows mix
    temperatures: Optional[Tensor] = None  # [batch, 1] float32, greedy rows 1.0; None if all greedy
    top_k: Optional[Tensor] = None  # [batch, 1] int64, off rows hold vocab_size
    top_k_max: int = 0  # largest top_k among rows that use it (host int: no sync to read it)
    top_p: Optional[Tensor] = None  # [batch, 1] float32, off rows hold +inf
    min_p: Optional[Tensor] = None  # [batch, 1] float32, off rows hold 0
    repetition_penalties: Optional[Tensor] = None  # [batch, 1] float32
    seen_mask: Optional[Tensor] = None  # [batch, vocab] bool: token occurs in prompt or output
    frequency_penalties: Optional[Tensor] = None  # [batch, 1] float32
    presence_penalties: Optional[Tensor] = None  # [batch, 1] float32
    output_counts: Optional[Tensor] = None  # [batch, vocab] float32: occurrences in the output
    blocked_rows: Optional[Tensor] = None  # [n] int64 } (row, token) pairs set to -inf
    blocked_tokens: Optional[Tensor] = None  # [n] int64 } by min_tokens
    grammar_rows: list[int] = field(default_factory=list)  # rows whose request has a grammar
    token_bitmask: Optional[Tensor] = None  # [batch, ceil(vocab / 32)] int32; read for grammar_rows only
    generators: list[Optional[torch.Generator]] = field(default_factory=list)  # per row
    seeded_rows: list[int] = field(default_factory=list)  # sampled rows with their own generator
    num_logprobs: list[Optional[int]] = field(default_factory=list)  # per row
    max_num_logprobs: Optional[int] = None  # None: no row asked for logprobs

    @classmethod
    def build(cls, rows: Sequence[RowLike], vocab_size: int,
              device: Union[torch.device, str] = "cpu") -> "SamplingBatch":
        """Gather the rows' settings into tensors on `device` (the logits' device)."""
        device = torch.device(device)
        rows = [r if isinstance(r, SamplingRow) else SamplingRow(*r) for r in rows]
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        asked = [p.logprobs for p in params]
        batch = cls(
            batch_size=len(rows),
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            generators=[r.generator for r in rows],
            num_logprobs=asked,
            max_num_logprobs=max((k for k in asked if k is not None), default=None),
        )
        if not batch.all_greedy:
            _fill_sampling_settings(batch, params, greedy, device)
            batch.seeded_rows = [i for i, r in enumerate(rows) if not greedy[i] and r.generator is not None]
        _fill_penalties(batch, rows, device)
        _fill_min_tokens_block(batch, rows, device)
        _fill_grammar_bitmask(batch, rows, device)
        return batch


def _fill_sampling_settings(batch: SamplingBatch, params: list[SamplingParams], greedy: list[bool],
                            device: torch.device) -> None:
    """Temperatures, greedy mask and truncation settings; greedy rows get neutral values."""
    vocab = batch.vocab_size
    temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
    top_k = [vocab if g or p.top_k <= 0 else min(p.top_k, vocab) for p, g in zip(params, greedy)]
    top_p = [float("inf") if g or p.top_p >= 1.0 else p.top_p for p, g in zip(params, greedy)]
    min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    batch.temperatures = _to_device(temps, torch.float32, device).view(-1, 1)
    if any(greedy):
        batch.greedy_mask = _to_device(greedy, torch.bool, device)
    if any(k < vocab for k in top_k):
        batch.top_k = _to_device(top_k, torch.int64, device).view(-1, 1)
        batch.top_k_max = max(k for k in top_k if k < vocab)
    if any(p < 1.0 for p in top_p):
        batch.top_p = _to_device(top_p, torch.float32, device).view(-1, 1)
    if any(p > 0.0 for p in min_p):
        batch.min_p = _to_device(min_p, torch.float32, device).view(-1, 1)


def _fill_penalties(batch: SamplingBatch, rows: list[SamplingRow], device: torch.device) -> None:
    """Repetition mask over prompt + output; output token counts for frequency/presence."""
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    shape = (batch.batch_size, batch.vocab_size)
    if any(x != 1.0 for x in rep):
        batch.repetition_penalties = _to_device(rep, torch.float32, device).view(-1, 1)
        lists = [(list(r.prompt_token_ids) + list(r.output_token_ids)) if x != 1.0 else []
                 for r, x in zip(rows, rep)]
        row_idx, tok_idx = _flat_indices(lists, batch.vocab_size, device)
        seen = torch.zeros(shape, dtype=torch.bool, device=device)  # [batch, vocab]
        seen[row_idx, tok_idx] = True
        batch.seen_mask = seen
    if any(f != 0.0 or p != 0.0 for f, p in zip(freq, pres)):
        batch.frequency_penalties = _to_device(freq, torch.float32, device).view(-1, 1)
        batch.presence_penalties = _to_device(pres, torch.float32, device).view(-1, 1)
        lists = [list(r.output_token_ids) if (f != 0.0 or p != 0.0) else []
                 for r, f, p in zip(rows, freq, pres)]
        row_idx, tok_idx = _flat_indices(lists, batch.vocab_size, device)
        counts = torch.zeros(shape, dtype=torch.float32, device=device)  # [batch, vocab]
        ones = torch.ones(row_idx.shape[0], dtype=torch.float32, device=device)
        counts.index_put_((row_idx, tok_idx), ones, accumulate=True)
        batch.output_counts = counts


def _fill_min_tokens_block(batch: SamplingBatch, rows: list[SamplingRow], device: torch.device) -> None:
    """(row, token) pairs of EOS / stop_token_ids that rows below min_tokens may not sample."""
    lists = [r.params.stop_ids_for(list(r.eos_token_ids))
             if len(r.output_token_ids) < r.params.min_tokens and r.grammar is None else []
             for r in rows]
    if any(lists):
        batch.blocked_rows, batch.blocked_tokens = _flat_indices(lists, batch.vocab_size, device)


def _fill_grammar_bitmask(batch: SamplingBatch, rows: list[SamplingRow], device: torch.device) -> None:
    """Each grammar row's allowed-next-token bitmask, filled on the host, moved to `device`."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return
    bitmask = torch.full((batch.batch_size, (batch.vocab_size + 31) // 32), -1, dtype=torch.int32)  # [batch, words]
    for i in constrained:
        rows[i].grammar.fill_bitmask(bitmask, i)
    batch.grammar_rows = constrained
    batch.token_bitmask = _move(bitmask, device)


def _flat_indices(lists: list[list[int]], vocab_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row and token index vectors for the (row, token) pairs in `lists`, ids >= vocab dropped."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    toks = [t for ids in lists for t in ids]
    row_idx = torch.tensor(rows, dtype=torch.int64)  # [n]
    tok_idx = torch.tensor(toks, dtype=torch.int64)  # [n]
    keep = (tok_idx >= 0) & (tok_idx < vocab_size)
    return _move(row_idx[keep], device), _move(tok_idx[keep], device)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _move(torch.tensor(values, dtype=dtype), device)


def _move(cpu: Tensor, device: torch.device) -> Tensor:
    """Host→device copy that does not make the host wait for queued device work."""
    if device.type == "cuda":
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


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
    _host: Optional[HostSamplerOutput] = field(default=None, repr=False)

    def to_host(self) -> HostSamplerOutput:
        """The one device→host sync: token ids and logprobs travel in a single transfer."""
        if self._host is None:
            self._host = self._transfer()
        return self._host

    @property
    def logprobs(self) -> list[Optional[dict[int, float]]]:
        """Per row: {token id: raw logprob} for the top-k tokens and the chosen one, or None."""
        return self.to_host().logprobs

    def _transfer(self) -> HostSamplerOutput:
        if self.chosen_logprobs is None:
            ids = self.token_ids.tolist()
            return HostSamplerOutput(ids, [None] * len(ids))
        parts = [self.token_ids.view(-1, 1), self.chosen_logprobs.view(-1, 1)]
        if self.top_logprobs is not None:
            parts += [self.top_token_ids, self.top_logprobs]
        # float64 holds every token id and float32 logprob exactly.
        packed = torch.cat([p.to(torch.float64) for p in parts], dim=1).tolist()  # [batch, 2 + 2k]
        k_max = 0 if self.top_logprobs is None else self.top_logprobs.shape[1]
        ids = [int(row[0]) for row in packed]
        dicts = [_logprob_dict(row, k, k_max) for row, k in zip(packed, self.num_logprobs)]
        return HostSamplerOutput(ids, dicts)


def _logprob_dict(row: list[float], k: Optional[int], k_max: int) -> Optional[dict[int, float]]:
    """Row layout: [chosen id, chosen logprob, top ids (k_max), top logprobs (k_max)]."""
    if k is None:
        return None
    top_ids = row[2:2 + k_max][:k]
    top_vals = row[2 + k_max:2 + 2 * k_max][:k]
    out = {int(t): v for t, v in zip(top_ids, top_vals)}
    out[int(row[0])] = row[1]
    return out


# --------------------------------------------------------------------------------------------
# Logit transforms (all out of place: the caller's logits are never written)
# --------------------------------------------------------------------------------------------


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


def apply_min_tokens_block(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Set the blocked (row, token) pairs to -inf."""
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


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


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
        logits = apply_penalties(logits, batch)
        logits = apply_min_tokens_block(logits, batch)
        logits = apply_token_bitmask(logits, batch)
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)  # [batch]
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
            token_ids = torch.where(batch.greedy_mask, logits.argmax(dim=-1), token_ids)
        return token_ids

    def _draw(self, probs: Tensor, batch: SamplingBatch) -> Tensor:
        """Exponential race: argmax(probs / E), E ~ Exp(1); seeded rows use their own generator."""
        noise = torch.empty_like(probs)  # [batch, vocab]
        if len(batch.seeded_rows) < batch.batch_size:
            noise.exponential_(generator=self.generator)
        for row in batch.seeded_rows:
            noise[row].exponential_(generator=batch.generators[row])
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # an exact 0 would make 0/0
        return (probs / noise).argmax(dim=-1)


def gather_logprobs(token_ids: Tensor, raw_logprobs: Optional[Tensor], batch: SamplingBatch) -> SamplerOutput:
    """Top-k and chosen-token raw logprobs for the rows that asked (tensors, no sync)."""
    out = SamplerOutput(token_ids=token_ids, num_logprobs=batch.num_logprobs)
    if raw_logprobs is None:
        return out
    out.chosen_logprobs = raw_logprobs.gather(-1, token_ids.view(-1, 1)).view(-1)  # [batch]
    k = min(batch.max_num_logprobs or 0, raw_logprobs.shape[-1])
    if k > 0:
        out.top_logprobs, out.top_token_ids = raw_logprobs.topk(k, dim=-1)  # [batch, k] each
    return out
