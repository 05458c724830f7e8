"""A step's sampling settings as device tensors: one `SamplingRow` per request in, one `SamplingBatch` out.

`SamplingBatch.build` gathers every row's settings (temperature, top-k / top-p / min-p, penalties,
min_tokens, logit_bias, allowed_token_ids, bad words, logprobs, per-request generators) into
`[batch, ...]` tensors on the logits' device; a field no row needs stays None, so the sampler skips
that step. It only copies host→device (pinned,
non-blocking on CUDA), never waits on the device. Grammar rows (structured outputs) fill their row
of the token bitmask here, on the host (the sampler's docstring says when and why).

Cost note: `build` makes everything from the rows (O(tokens) host work for rows with penalties; the
`[batch, vocab]` tensors are filled on the device from (row, token) index vectors). The model runner
calls it for speculative verification only (a row per verified position); its other steps gather
the same batch from the rows' persistent state (`vlmrun.layers.sampling_state.SamplingState`), which
calls `fill_masks_and_bias` on the few rows that need the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from vlmrun.host_to_device import upload
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
    blocked_rows: Optional[Tensor] = None  # [n] int64 } (row, token) pairs set to -inf: min_tokens' stop
    blocked_tokens: Optional[Tensor] = None  # [n] int64 } ids and the bad words' banned last tokens
    outside_allowed: Optional[Tensor] = None  # [batch, vocab] bool: True where allowed_token_ids leave a token out
    logit_bias: Optional[Tensor] = None  # [batch, vocab] float32 added to the logits; rows without one hold 0
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
        if any(reads_rows(p) for p in {id(p): p for p in params}.values()):  # each distinct params once
            _fill_penalties(batch, rows, device)
            fill_masks_and_bias(batch, rows, device)
        if any(r.grammar is not None for r in rows):
            _fill_grammar_bitmask(batch, rows, device)
        return batch


def fill_masks_and_bias(batch: SamplingBatch, rows: Sequence[SamplingRow], device: torch.device,
                        grammar: bool = False) -> None:
    """The settings read from the rows themselves every step, penalties aside: the blocked tokens
    (min_tokens, bad words), the allowed-token mask, the logit bias and (`grammar`) the grammar bitmask.
    `SamplingState` calls it on the few rows of a step that need them (a sub-batch)."""
    rows = list(rows)
    _fill_blocked_tokens(batch, rows, device)
    _fill_allowed_mask(batch, rows, device)
    _fill_logit_bias(batch, rows, device)
    if grammar:
        _fill_grammar_bitmask(batch, rows, device)


def reads_masks_or_bias(params: SamplingParams) -> bool:
    """The params ask for a setting `fill_masks_and_bias` fills: min_tokens, bad words, allowed ids, a bias."""
    return bool(params.min_tokens or params.bad_words_token_ids or params.allowed_token_ids or params.logit_bias)


def reads_rows(params: SamplingParams) -> bool:
    """The params ask for a setting filled from the rows: penalties, min_tokens, bad words, allowed ids, a bias."""
    return bool(params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
                or params.min_tokens or params.bad_words_token_ids or params.allowed_token_ids or params.logit_bias)


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


def _fill_blocked_tokens(batch: SamplingBatch, rows: list[SamplingRow], device: torch.device) -> None:
    """(row, token) pairs no row may sample this step: EOS / stop_token_ids of rows below min_tokens
    (not grammar rows: their grammar decides), and the last token of each bad word whose other
    tokens are the row's latest outputs."""
    lists = [_min_tokens_block(r) + _bad_word_bans(r.params.bad_words_token_ids, r.output_token_ids) for r in rows]
    if any(lists):
        batch.blocked_rows, batch.blocked_tokens = _flat_indices(lists, batch.vocab_size, device)


def _min_tokens_block(row: SamplingRow) -> list[int]:
    if len(row.output_token_ids) < row.params.min_tokens and row.grammar is None:
        return row.params.stop_ids_for(list(row.eos_token_ids))
    return []


def _bad_word_bans(bad_words: list[list[int]], outputs: Sequence[int]) -> list[int]:
    """The last token of every bad word whose tokens before it end `outputs` (a one-token word: always)."""
    banned = []
    for word in bad_words:
        before = word[:-1]
        if len(before) <= len(outputs) and list(outputs[len(outputs) - len(before):]) == before:
            banned.append(word[-1])
    return banned


def _fill_allowed_mask(batch: SamplingBatch, rows: list[SamplingRow], device: torch.device) -> None:
    """True on every token a row with allowed_token_ids may not sample (the others' rows all False)."""
    lists = [r.params.allowed_token_ids or [] for r in rows]
    restricted = [i for i, ids in enumerate(lists) if ids]
    if not restricted:
        return
    row_idx, tok_idx = _flat_indices(lists, batch.vocab_size, device)
    outside = torch.zeros((batch.batch_size, batch.vocab_size), dtype=torch.bool, device=device)  # [batch, vocab]
    outside[_to_device(restricted, torch.int64, device)] = True
    outside[row_idx, tok_idx] = False
    batch.outside_allowed = outside


def _fill_logit_bias(batch: SamplingBatch, rows: list[SamplingRow], device: torch.device) -> None:
    """The rows' logit_bias as one additive [batch, vocab] tensor (0 where a row sets none)."""
    biases = [r.params.logit_bias or {} for r in rows]
    if not any(biases):
        return
    row_idx, tok_idx, keep = _flat_pairs([list(b) for b in biases], batch.vocab_size)
    values = torch.tensor([v for b in biases for v in b.values()], dtype=torch.float32)  # [n]
    bias = torch.zeros((batch.batch_size, batch.vocab_size), dtype=torch.float32, device=device)  # [batch, vocab]
    bias[upload(row_idx[keep], device), upload(tok_idx[keep], device)] = upload(values[keep], device)
    batch.logit_bias = bias


def _fill_grammar_bitmask(batch: SamplingBatch, rows: list[SamplingRow], device: torch.device) -> None:
    """Each grammar row's allowed-next-token bitmask, filled on the host, moved to `device`."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return
    bitmask = torch.full((batch.batch_size, (batch.vocab_size + 31) // 32), -1, dtype=torch.int32)  # [batch, words]
    for i in constrained:
        rows[i].grammar.fill_bitmask(bitmask, i)
    batch.grammar_rows = constrained
    batch.token_bitmask = upload(bitmask, device)


def _flat_indices(lists: list[list[int]], vocab_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row and token index vectors for the (row, token) pairs in `lists`, ids >= vocab dropped."""
    row_idx, tok_idx, keep = _flat_pairs(lists, vocab_size)
    return upload(row_idx[keep], device), upload(tok_idx[keep], device)


def _flat_pairs(lists: list[list[int]], vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Host row and token index vectors [n] for the (row, token) pairs in `lists`, and which of them
    name a token of the vocabulary."""
    row_idx = torch.tensor([i for i, ids in enumerate(lists) for _ in ids], dtype=torch.int64)  # [n]
    tok_idx = torch.tensor([t for ids in lists for t in ids], dtype=torch.int64)  # [n]
    return row_idx, tok_idx, (tok_idx >= 0) & (tok_idx < vocab_size)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    return upload(torch.tensor(values, dtype=dtype), device)
