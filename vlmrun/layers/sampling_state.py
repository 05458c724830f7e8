"""Sampling state that persists from step to step, one slot per page-table row: `SamplingState`.

The model runner owns one, sized for every page-table row (`max_reqs + 1`, the dummy row included).
A request's sampling settings are written to its row once, the first step it samples there (and again
only when the row changes hands), as columns: a float32 block `[rows, 6]` (temperature, top_p, min_p,
repetition, frequency and presence penalties; neutral values for greedy rows and for settings off)
and an int64 top_k `[rows, 1]` on the device, mirrored on the host in numpy columns (greedy, seeded,
logprobs, which settings a row uses) for the step's host-side decisions. A step's `SamplingBatch` is
then one gather by the step's row indices (one index tensor up) plus a few numpy reductions: no
Python work per plain row (what is per row is C-level: `map`, `itemgetter`, numpy indexing).

Penalties keep their counts on the device: a seen-token mask `[rows, vocab]` bool (repetition:
prompt + outputs) and output counts `[rows, vocab]` float32 (frequency / presence), allocated the
first time a row uses them. A row's are built from its prompt and outputs when it first samples
there (O(tokens), once), then each step adds the token the step sampled for it by a scatter on the
device (`record`), so the step's host work for them is O(1): it checks that the row still holds the
same output list and that the list grew by exactly the tokens recorded (penalty rows wait for their
tokens under async scheduling, `Scheduler.must_wait`); anything else (a new request in the row, a
preempted one back, rows made anew each step on tensor-parallel ranks) rebuilds the row from its
lists. Objects are compared by identity and held, so an id is never reused while the state holds it.

Speculative verification (n-gram drafts): the step's decode rows come first, one position each, then a
speculating request's row is gathered at each of its 1 + d positions, with drafts[:j] added to position
j's gathered copy (`appended`), and `record` takes only the emitted positions' tokens
(`emitted_positions`: every decode row's, each chunk's first 1 + accepted, acceptance computed on the
device; rejected positions write a scratch row). MTP steps are built with `SamplingBatch.build`.

What cannot be a column (min_tokens' and bad words' blocked tokens, allowed ids, a logit bias, a
grammar bitmask) is built as `SamplingBatch.build` builds it, over the step's rows that use it only
(a sub-batch), then placed at their rows of the step. The result equals `SamplingBatch.build`'s for
the same rows, tensor for tensor (tests/test_sampling_state.py), so sampling is unchanged: same rows
in the same order, the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, is_, itemgetter
from typing import Optional, Sequence, Union

import numpy as np
import torch

from vlmrun.host_to_device import upload
from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow, fill_masks_and_bias, reads_masks_or_bias
from vlmrun.sampling_params import SamplingParams

Tensor = torch.Tensor

TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(6)  # the float block's columns
# a row's flags (one uint8 column: a step ORs its rows' to know what it needs)
GREEDY, SAMPLED, SEEDED, USES_SEEN, USES_COUNTS, USES_MASKS, LOGPROBS, GENERATOR = (1 << i for i in range(8))
_PARAMS, _PROMPT, _OUTPUTS, _GENERATOR, _EOS, _GRAMMAR = (itemgetter(i) for i in range(6))  # SamplingRow fields
_LOGPROBS = attrgetter("logprobs")


@dataclass
class GatheredStep:
    """A step's batch from the state, and where its penalty rows' sampled tokens go (`SamplingState.record`)."""

    batch: SamplingBatch
    repetition_at: Optional[tuple[Tensor, Tensor]] = None  # (positions in the step [m], page-table rows [m])
    counts_at: Optional[tuple[Tensor, Tensor]] = None  # the same, for frequency / presence rows
    penalty_rows: Optional[np.ndarray] = None  # page-table rows whose recorded outputs grow by the step's tokens
    # a speculative verify step (`appended`): per penalty row, it has verified positions beside its own, so its
    # outputs grow by 1 + accepted (False: by one, a decode row or a chunk without drafts); None: no verify step
    verified: Optional[np.ndarray] = None


class SamplingState:
    """Per page-table row sampling settings and penalty counts, written when a request samples in a row."""

    def __init__(self, num_rows: int, device: Union[torch.device, str]) -> None:
        self.num_rows = num_rows
        self.device = torch.device(device)
        self.vocab_size = 0  # set by the first step (the logits' width)
        self.seen: Optional[Tensor] = None  # [rows, vocab] bool: token in prompt or outputs (repetition rows)
        self.counts: Optional[Tensor] = None  # [rows, vocab] float32: occurrences in the outputs (freq / pres rows)
        self._reset()

    def _reset(self) -> None:
        rows = self.num_rows
        self._params: list[Optional[SamplingParams]] = [None] * rows  # held: the settings written come from it
        self._generators: list[Optional[torch.Generator]] = [None] * rows
        self._floats = np.zeros((rows, 6), dtype=np.float32)  # host mirror of `floats`
        self._top_k = np.zeros(rows, dtype=np.int64)  # host mirror of `top_k`
        self._flags = np.full(rows, GREEDY, dtype=np.uint8)  # GREEDY | SAMPLED | SEEDED | USES_... | LOGPROBS | GENERATOR
        self._logprobs = np.full(rows, -1, dtype=np.int64)  # -1: none asked
        self._outputs: list[Optional[Sequence[int]]] = [None] * rows  # the output list the counts were built from
        self._recorded = np.full(rows, -1, dtype=np.int64)  # outputs in the counts (-1: none built)
        self._verified = np.zeros(rows, dtype=bool)  # counts took a verify step's emitted tokens (1 + accepted)
        self.floats = torch.zeros((rows, 6), dtype=torch.float32, device=self.device)  # [rows, 6]
        self.top_k = torch.zeros((rows, 1), dtype=torch.int64, device=self.device)  # [rows, 1]
        self.seen = self.counts = None
        # the last `rows` list gathered, with its page rows and grammar rows: passed again, its settings are the ones
        # written (a list passed again is never changed in place: the decode table's `columns_of`)
        self._checked: Optional[tuple[Sequence[SamplingRow], list[int], Optional[np.ndarray]]] = None

    def gather(self, page_rows: Sequence[int], rows: Sequence[SamplingRow], vocab_size: int,
               appended: Optional[Sequence[Sequence[int]]] = None) -> GatheredStep:
        """The step's batch: `rows[i]` samples at step position i in page-table row `page_rows[i]`.

        Speculative verification: `appended[i]` are the tokens position i's outputs hold beyond its
        request's (drafts[:j] at position j; empty at the request's own position, which comes first);
        they are added to that position's gathered counts, never to the row's.

        The same `rows` list as the last call's (identity) with the same page rows skips the per-row check of
        what each row holds (`_admit`) and of its grammar: a steady decode step's (O(1) Python per row)."""
        if vocab_size != self.vocab_size:
            self.vocab_size = vocab_size
            self._reset()
        n, device = len(rows), self.device
        checked = self._checked
        if checked is not None and checked[0] is rows and checked[1] == page_rows:
            grammar = checked[2]
        else:
            self._admit(page_rows, rows, list(map(_PARAMS, rows)))
            grammars = list(map(_GRAMMAR, rows))  # (grammar rows come as chunks, never as plain decode rows)
            grammar = np.array([g is not None for g in grammars], dtype=bool) if grammars.count(None) < n else None
            self._checked = (rows, list(page_rows), grammar)
        idx = np.fromiter(page_rows, dtype=np.int64, count=n)  # [n]
        flags = self._flags[idx]  # [n]
        union = int(np.bitwise_or.reduce(flags))  # what some row of the step needs
        max_logprobs = int(self._logprobs[idx].max()) if union & LOGPROBS else -1
        # a step where no row has a generator (asks for logprobs) needs no pass for them: all None
        step = GatheredStep(batch=SamplingBatch(
            batch_size=n, vocab_size=vocab_size, all_greedy=not union & SAMPLED,
            generators=list(map(_GENERATOR, rows)) if union & GENERATOR else [None] * n,
            num_logprobs=list(map(_LOGPROBS, map(_PARAMS, rows))) if union & LOGPROBS else [None] * n,
            max_num_logprobs=None if max_logprobs < 0 else max_logprobs))
        batch = step.batch
        if union & (SAMPLED | USES_SEEN | USES_COUNTS):
            idx_dev = upload(torch.from_numpy(idx), device)  # [n]
            floats = self.floats[idx_dev]  # [n, 6]
            if union & SAMPLED:
                self._fill_sampling_settings(batch, idx, idx_dev, flags, union, floats)
            if union & (USES_SEEN | USES_COUNTS):
                self._fill_penalties(step, page_rows, rows, idx, idx_dev, flags, floats, appended)
        masks = (flags & USES_MASKS) != 0 if union & USES_MASKS else None
        if grammar is not None:
            masks = grammar if masks is None else masks | grammar
        if masks is not None:
            _fill_sub_batch(batch, rows, np.flatnonzero(masks).tolist(), device)
        return step

    def record(self, step: GatheredStep, token_ids: Tensor, emitted: Optional[Tensor] = None) -> None:
        """The step sampled `token_ids` [n] (on the device): add its penalty rows' tokens to their counts
        there (no host read), so the next step's are current. A verify step passes `emitted` [n] bool (on
        the device, `emitted_positions`): only those positions' tokens are the requests'."""
        if step.repetition_at is not None:
            at, rows = step.repetition_at
            if emitted is not None:  # the others write the scratch row
                rows = torch.where(emitted[at], rows, self.num_rows)
            self.seen[rows, token_ids[at]] = True
        if step.counts_at is not None:
            at, rows = step.counts_at
            ones = torch.ones_like(rows, dtype=torch.float32) if emitted is None else emitted[at].to(torch.float32)
            self.counts.index_put_((rows, token_ids[at]), ones, accumulate=True)
        if step.penalty_rows is None:
            return
        if step.verified is None:
            self._recorded[step.penalty_rows] += 1
        else:
            self._recorded[step.penalty_rows[~step.verified]] += 1
            self._verified[step.penalty_rows[step.verified]] = True  # (1 + accepted: the host knows how many at collect)

    # ----------------------------------------------------------------------------- settings columns

    def _admit(self, page_rows: Sequence[int], rows: Sequence[SamplingRow], params: list[SamplingParams]) -> None:
        """Write the settings of every row whose request (params, generator) is not the one written there."""
        held = itemgetter(*page_rows)
        held_params, held_generators = held(self._params), held(self._generators)
        if len(page_rows) == 1:
            held_params, held_generators = (held_params,), (held_generators,)
        if all(map(is_, held_params, params)) and all(map(is_, held_generators, map(_GENERATOR, rows))):
            return
        changed = [(row, r) for row, r in zip(page_rows, rows)
                   if self._params[row] is not r.params or self._generators[row] is not r.generator]
        for row, r in changed:
            self._write(row, r.params, r.generator)
        at = torch.tensor([row for row, _ in changed], dtype=torch.int64)  # [c] (host)
        at_dev = upload(at, self.device)
        self.floats[at_dev] = upload(torch.from_numpy(self._floats[at.numpy()]), self.device)
        self.top_k[at_dev] = upload(torch.from_numpy(self._top_k[at.numpy()]).view(-1, 1), self.device)
        if self.seen is not None:  # a new request in the row: nothing seen, nothing counted
            self.seen[at_dev] = False
            self.counts[at_dev] = 0.0

    def _write(self, row: int, params: SamplingParams, generator: Optional[torch.Generator]) -> None:
        """The host columns of `row` from `params` (greedy rows hold neutral settings, as `build` makes them)."""
        vocab, greedy = self.vocab_size, params.is_greedy
        self._params[row], self._generators[row] = params, generator
        self._floats[row] = (1.0 if greedy else params.temperature,
                             float("inf") if greedy or params.top_p >= 1.0 else params.top_p,
                             0.0 if greedy else params.min_p,
                             params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        self._top_k[row] = vocab if greedy or params.top_k <= 0 else min(params.top_k, vocab)
        self._logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self._flags[row] = ((GREEDY if greedy else SAMPLED) | (SEEDED if not greedy and generator is not None else 0)
                            | (USES_SEEN if params.repetition_penalty != 1.0 else 0)
                            | (USES_COUNTS if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0 else 0)
                            | (USES_MASKS if reads_masks_or_bias(params) else 0)
                            | (LOGPROBS if params.logprobs is not None else 0)
                            | (GENERATOR if generator is not None else 0))
        self._outputs[row], self._recorded[row], self._verified[row] = None, -1, False

    def _fill_sampling_settings(self, batch: SamplingBatch, idx: np.ndarray, idx_dev: Tensor, flags: np.ndarray,
                                union: int, floats: Tensor) -> None:
        """Temperatures, greedy mask, truncation settings: views of the gathered columns."""
        vocab, host = self.vocab_size, self._floats[idx]  # [n, 6]
        batch.temperatures = floats[:, TEMPERATURE:TEMPERATURE + 1]  # [n, 1]
        if union & GREEDY:
            batch.greedy_mask = upload(torch.from_numpy((flags & GREEDY) != 0), self.device)  # [n]
        top_k = self._top_k[idx]
        limited = top_k < vocab
        if limited.any():
            batch.top_k = self.top_k[idx_dev]  # [n, 1]
            batch.top_k_max = int(top_k[limited].max())
        if (host[:, TOP_P] < 1.0).any():
            batch.top_p = floats[:, TOP_P:TOP_P + 1]
        if (host[:, MIN_P] > 0.0).any():
            batch.min_p = floats[:, MIN_P:MIN_P + 1]
        if union & SEEDED:
            batch.seeded_rows = np.flatnonzero(flags & SEEDED).tolist()

    # ----------------------------------------------------------------------------- penalties

    def _fill_penalties(self, step: GatheredStep, page_rows: Sequence[int], rows: Sequence[SamplingRow],
                        idx: np.ndarray, idx_dev: Tensor, flags: np.ndarray, floats: Tensor,
                        appended: Optional[Sequence[Sequence[int]]]) -> None:
        """The penalty columns and the gathered seen mask / counts; each penalty row's counts are
        checked (O(1)) and rebuilt from its lists only when they are not its request's."""
        if self.seen is None:
            shape = (self.num_rows + 1, self.vocab_size)  # (+ a scratch row: a verify step's rejected tokens)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)  # [rows, vocab]
            self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)  # [rows, vocab]
        repetition, frequency = (flags & USES_SEEN) != 0, (flags & USES_COUNTS) != 0
        positions = np.flatnonzero(repetition | frequency)
        own = positions if appended is None else positions[[not appended[i] for i in positions.tolist()]]
        stale = [i for i in own.tolist() if not self._counts_current(page_rows[i], rows[i])]
        if stale:
            self._rebuild_counts([page_rows[i] for i in stale], [rows[i] for i in stale])
        batch = step.batch
        step.penalty_rows = idx[own]
        if appended is not None:  # a row's verified positions follow its own, with drafts appended
            step.verified = np.array([i + 1 < len(rows) and len(appended[i + 1]) > 0 for i in own.tolist()],
                                     dtype=bool)
        if repetition.any():
            batch.repetition_penalties = floats[:, REPETITION:REPETITION + 1]  # [n, 1]
            batch.seen_mask = self.seen[idx_dev]  # [n, vocab]
            step.repetition_at = self._positions_and_rows(repetition, idx)
        if frequency.any():
            batch.frequency_penalties = floats[:, FREQUENCY:FREQUENCY + 1]  # [n, 1]
            batch.presence_penalties = floats[:, PRESENCE:PRESENCE + 1]
            batch.output_counts = self.counts[idx_dev]  # [n, vocab]
            step.counts_at = self._positions_and_rows(frequency, idx)
        if appended is not None:
            self._add_appended(batch, appended, repetition, frequency)

    def _add_appended(self, batch: SamplingBatch, appended: Sequence[Sequence[int]], repetition: np.ndarray,
                      frequency: np.ndarray) -> None:
        """Each verified position's drafts before it, into its gathered seen mask / counts (copies)."""
        for used, target in ((repetition, batch.seen_mask), (frequency, batch.output_counts)):
            pairs = [(i, t) for i in np.flatnonzero(used).tolist() for t in appended[i] if 0 <= t < self.vocab_size]
            if not pairs:
                continue
            at, tokens = upload(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), self.device)  # [2, m]
            if target.dtype == torch.bool:
                target[at, tokens] = True
            else:
                target.index_put_((at, tokens), torch.ones_like(at, dtype=torch.float32), accumulate=True)

    def _positions_and_rows(self, used: np.ndarray, idx: np.ndarray) -> tuple[Tensor, Tensor]:
        """(step positions, page-table rows) of the rows in `used`, both on the device, one upload."""
        positions = np.flatnonzero(used)
        both = upload(torch.from_numpy(np.stack([positions, idx[positions]])), self.device)  # [2, m]
        return both[0], both[1]

    def _counts_current(self, page_row: int, row: SamplingRow) -> bool:
        """O(1): the row's counts hold this request's outputs so far (the same list, as many tokens)."""
        outputs = row.output_token_ids
        if self._outputs[page_row] is not outputs:
            return False
        if self._verified[page_row]:  # a verify step's 1 + accepted tokens, at least one
            self._verified[page_row] = False
            if len(outputs) <= self._recorded[page_row]:
                return False
            self._recorded[page_row] = len(outputs)
        return self._recorded[page_row] == len(outputs)

    def _rebuild_counts(self, page_rows: list[int], rows: list[SamplingRow]) -> None:
        """The rows' seen masks (prompt + outputs) and output counts from their lists: one scatter each."""
        flags = self._flags[page_rows]
        at = upload(torch.tensor(page_rows, dtype=torch.int64), self.device)  # [r]
        self.seen[at] = False
        self.counts[at] = 0.0
        seen = [list(r.prompt_token_ids) + list(r.output_token_ids) if f & USES_SEEN else []
                for r, f in zip(rows, flags.tolist())]
        rows_at, tokens = self._flat(page_rows, seen)
        self.seen[rows_at, tokens] = True
        counted = [list(r.output_token_ids) if f & USES_COUNTS else [] for r, f in zip(rows, flags.tolist())]
        rows_at, tokens = self._flat(page_rows, counted)
        self.counts.index_put_((rows_at, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        for page_row, r in zip(page_rows, rows):
            self._outputs[page_row], self._recorded[page_row] = r.output_token_ids, len(r.output_token_ids)
            self._verified[page_row] = False

    def _flat(self, page_rows: list[int], lists: list[list[int]]) -> tuple[Tensor, Tensor]:
        """(page-table row, token) index vectors [m] on the device for the ids in `lists`, ids outside the
        vocabulary (placeholders, ids past it) dropped."""
        tokens = torch.tensor([t for ids in lists for t in ids], dtype=torch.int64)  # [m]
        rows = torch.repeat_interleave(torch.tensor(page_rows, dtype=torch.int64),
                                       torch.tensor([len(ids) for ids in lists], dtype=torch.int64))  # [m]
        keep = (tokens >= 0) & (tokens < self.vocab_size)
        return upload(rows[keep], self.device), upload(tokens[keep], self.device)


def _fill_sub_batch(batch: SamplingBatch, rows: Sequence[SamplingRow], positions: list[int],
                    device: torch.device) -> None:
    """Blocked tokens, allowed mask, logit bias and grammar bitmask of the rows at `positions` (built as
    `SamplingBatch.build` builds them, over those rows only), placed at their positions in `batch`."""
    sub = SamplingBatch(batch_size=len(positions), vocab_size=batch.vocab_size, all_greedy=True)
    fill_masks_and_bias(sub, [rows[i] for i in positions], device, grammar=True)
    at = upload(torch.tensor(positions, dtype=torch.int64), device)  # [m] sub row -> step position
    shape = (batch.batch_size, batch.vocab_size)
    if sub.blocked_rows is not None:
        batch.blocked_rows, batch.blocked_tokens = at[sub.blocked_rows], sub.blocked_tokens
    if sub.outside_allowed is not None:
        batch.outside_allowed = torch.zeros(shape, dtype=torch.bool, device=device)  # [n, vocab]
        batch.outside_allowed[at] = sub.outside_allowed
    if sub.logit_bias is not None:
        batch.logit_bias = torch.zeros(shape, dtype=torch.float32, device=device)  # [n, vocab]
        batch.logit_bias[at] = sub.logit_bias
    if sub.token_bitmask is not None:
        words = sub.token_bitmask.shape[1]
        batch.token_bitmask = torch.full((batch.batch_size, words), -1, dtype=torch.int32, device=device)
        batch.token_bitmask[at] = sub.token_bitmask  # [n, words]
        batch.grammar_rows = [positions[i] for i in sub.grammar_rows]


def emitted_positions(accepted: Tensor, spans: Sequence[int], device: torch.device, num_decodes: int = 0) -> Tensor:
    """A verify step's positions whose token its request emits: [positions] bool on the device, from
    `accepted` [chunks] (drafts each chunk keeps, on the device) and `spans[c]` (chunk c's positions:
    1 + drafts, 0 when it does not sample); chunk c emits its first 1 + accepted[c]. The step's first
    `num_decodes` positions are decode rows (`DecodeRows`): always emitted."""
    lens = torch.tensor(spans, dtype=torch.int64)  # [chunks]
    chunk_of = torch.repeat_interleave(torch.arange(len(spans)), lens)  # [chunk positions]
    index_in_chunk = torch.arange(chunk_of.shape[0]) - (torch.cumsum(lens, 0) - lens)[chunk_of]  # [chunk positions]
    both = torch.stack([chunk_of, index_in_chunk])  # [2, chunk positions]
    if num_decodes:  # a decode row reads as index 0 of chunk 0: 0 <= any count, always emitted
        both = torch.cat([torch.zeros((2, num_decodes), dtype=torch.int64), both], dim=1)  # [2, positions]
    both = upload(both, device)
    return both[1] <= accepted[both[0]]
