"""The engine's output side: each request's text stream, the tokens a step appends, a finished request's result.

`OutputProcessor` owns one output object per live request (`add` when the engine takes it, `drop`
when it goes): an `OutputTextStream` for a request that streams, a `FinalOutput` (`final_output.py`)
for one whose consumer reads only its result (`add(req, stream=False)`). `append(req, tokens)` appends
a step's sampled tokens to the request one at a time, as plain decode would (a stop string, EOS, the
grammar's end or a length limit ends the request at that token; the rest are dropped), and returns the
step's `RequestUpdate` (None for a request that does not stream, but on its first token) and the finish
reason, if any. `result(req, reason)` is the finished request's `RequestResult`. The engine frees the
request's memory; this module only reads the request.

A step's tokens of one request mostly are one token of a request without a grammar: that case takes
a short path (`append_one`) with the same rules; a step's plain decodes (`ScheduledDecodes`) go through
`append_decodes`, one loop over the rows. A streamed row's token costs a `tokenizers` stream step and an
update; a row that does not stream appends its id and tests `FinalOutput`'s quick finish rule inline (no
call, no object), and gets an update only for its first token (the feed pipeline's signal that its
prefill is over) and its last (with the result); its text is decoded once, in `result`.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional, Sequence, Union

from vlmrun.engine.detokenizer import OutputTextStream
from vlmrun.engine.final_output import FinalOutput
from vlmrun.engine.outputs import RequestResult, RequestUpdate
from vlmrun.engine.request import Request, RequestStatus


class Finishing(NamedTuple):
    """A row of `OutputProcessor.append_decodes` whose token finished its request."""

    update_index: int  # its update in the returned list
    request: Request
    reason: str  # the finish reason


class OutputProcessor:
    """Text streams (or final-only outputs) of the live requests, and the updates and results made from
    their tokens."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._streams: dict[str, Union[OutputTextStream, FinalOutput]] = {}

    def add(self, req: Request, stream: bool = True) -> None:
        """Take a request: `stream` False when its consumer reads only its result (no per-step text)."""
        kind = OutputTextStream if stream else FinalOutput
        self._streams[req.request_id] = kind(self.tokenizer, req.prompt_token_ids, req.sampling_params,
                                             self.eos_token_ids, self.max_model_len)

    def drop(self, request_id: str) -> Union[OutputTextStream, FinalOutput, None]:
        return self._streams.pop(request_id, None)

    def append(self, req: Request, tokens: list) -> tuple[Optional[RequestUpdate], Optional[str]]:
        """A step's tokens for `req` (`SampledToken`s; several after accepted drafts) -> its update (None for
        a request that does not stream, but on its first token and its last) and the reason it finished
        (None: it runs on)."""
        stream = self._streams[req.request_id]
        if type(stream) is FinalOutput:
            return self._append_final(req, tokens, stream)
        if len(tokens) == 1 and req.grammar is None:
            return self.append_one(req, tokens[0].token_id, tokens[0].logprobs)
        update = RequestUpdate(req.request_id)
        for sampled in tokens:
            req.output_token_ids.append(sampled.token_id)
            update.new_token_ids.append(sampled.token_id)
            if sampled.logprobs is not None:
                req.output_logprobs.append(sampled.logprobs)
                update.new_logprobs.append(sampled.logprobs)
            grammar_finish = None if req.grammar is None else req.advance_grammar(sampled.token_id)
            token = stream.add_token(sampled.token_id)
            update.text_delta += token.delta
            finish_reason = token.finish_reason or grammar_finish
            if finish_reason is not None:
                return update, finish_reason
        return update, None

    def _append_final(self, req: Request, tokens: list,
                      final: FinalOutput) -> tuple[Optional[RequestUpdate], Optional[str]]:
        """`append` for a request that does not stream: the same tokens and finish rules, no text."""
        outputs = req.output_token_ids
        first = not outputs
        for sampled in tokens:
            token_id = sampled.token_id
            outputs.append(token_id)
            if sampled.logprobs is not None:
                req.output_logprobs.append(sampled.logprobs)
            grammar_finish = None if req.grammar is None else req.advance_grammar(token_id)
            n = len(outputs)
            finish_reason = None
            if (n > final.min_tokens and token_id in final.stop_ids) or n >= final.length_cap:
                finish_reason = final.finish_reason(outputs)
            finish_reason = finish_reason or grammar_finish
            if finish_reason is not None:
                return RequestUpdate(req.request_id), finish_reason
        return (RequestUpdate(req.request_id) if first else None), None

    def append_one(self, req: Request, token_id: int,
                   logprobs: Optional[dict[int, float]] = None) -> tuple[RequestUpdate, Optional[str]]:
        """One token of a request without a grammar: the common decode step of a request."""
        req.output_token_ids.append(token_id)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        token = self._streams[req.request_id].add_token(token_id)
        return (RequestUpdate(req.request_id, [token_id], [] if logprobs is None else [logprobs], token.delta),
                token.finish_reason)

    def append_decodes(self, requests: Sequence[Request], token_ids: Sequence[int],
                       logprobs: Sequence[Optional[dict[int, float]]]) -> tuple[list[RequestUpdate], list[Finishing]]:
        """A step's plain decodes in one pass (one token each, requests without a grammar): `append_one`'s
        rules per row, without its calls per token. Returns the updates, in row order, of the rows whose
        request had not finished (a request that finished or was aborted while the step ran gets nothing),
        and for each row the token finished, (its index in the updates, its request, the finish reason)."""
        streams = self._streams
        updates: list[RequestUpdate] = []
        finishing: list[Finishing] = []
        finished = RequestStatus.FINISHED
        for req, token_id, token_logprobs in zip(requests, token_ids, logprobs):
            if req.status is finished:
                continue
            outputs = req.output_token_ids
            outputs.append(token_id)
            if token_logprobs is not None:
                req.output_logprobs.append(token_logprobs)
            stream = streams[req.request_id]
            if type(stream) is FinalOutput:  # no text, no update: the quick finish test, inline
                n = len(outputs)
                if (n > stream.min_tokens and token_id in stream.stop_ids) or n >= stream.length_cap:
                    reason = stream.finish_reason(outputs)
                    if reason is not None:
                        finishing.append(Finishing(len(updates), req, reason))
                        updates.append(RequestUpdate(req.request_id))
                        continue
                if n == 1:  # its first token (it came with its prefill's chunk, so never here in practice)
                    updates.append(RequestUpdate(req.request_id))
                continue
            delta = stream.add_plain_token(token_id)
            if delta is None:  # a token that may end the request, or a request with stop strings
                token = stream.add_token(token_id)
                delta = token.delta
                if token.finish_reason is not None:
                    finishing.append(Finishing(len(updates), req, token.finish_reason))
            updates.append(RequestUpdate(req.request_id, [token_id], [] if token_logprobs is None else [token_logprobs],
                                         delta))
        return updates, finishing

    def result(self, req: Request, reason: str) -> RequestResult:
        """The finished request's whole result (its stream is dropped; a request that does not stream is
        detokenized here)."""
        text, stop_reason = self._streams.pop(req.request_id).final_text(req.output_token_ids)
        asked_logprobs = req.sampling_params.logprobs is not None
        grammar = req.grammar
        return RequestResult(text=text, token_ids=list(req.output_token_ids),
                             logprobs=list(req.output_logprobs) if asked_logprobs else None, finish_reason=reason,
                             num_prompt_tokens=req.num_prompt_tokens, arrival_time=req.arrival_time,
                             first_token_time=req.first_token_time, finished_time=time.monotonic(),
                             grammar_ended=grammar is not None and grammar.is_terminated,
                             stop_reason=stop_reason,
                             prompt_text=req.prompt.text or None, prompt_token_ids=list(req.prompt_token_ids),
                             prompt_logprobs=req.prompt_logprobs, spec_decode=req.spec_decode,
                             scheduled_time=req.scheduled_time, num_cached_tokens=req.prefix_hit_tokens)
