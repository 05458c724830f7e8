"""The engine's output side: each request's text stream, the tokens a step appends, a finished request's result.

`OutputProcessor` owns one `OutputTextStream` per live request (`add` when the engine takes it, `drop`
when it goes). `append(req, tokens)` appends a step's sampled tokens to the request one at a time, as
plain decode would (a stop string, EOS, the grammar's end or a length limit ends the request at that
token; the rest are dropped), and returns the step's `RequestUpdate` and the finish reason, if any.
`result(req, reason)` is the finished request's `RequestResult`. The engine frees the request's
memory; this module only reads the request.

A step's tokens of one request mostly are one token of a request without a grammar: that case takes
a short path (`append_one`) with the same rules; a step's plain decodes (`ScheduledDecodes`) go through
`append_decodes`, one loop over the rows whose common token costs a `tokenizers` stream step and an update.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional, Sequence

from vlmrun.engine.detokenizer import OutputTextStream
from vlmrun.engine.outputs import RequestResult, RequestUpdate
from vlmrun.engine.request import Request, RequestStatus


class Finishing(NamedTuple):
    """A row of `OutputProcessor.append_decodes` whose token finished its request."""

    update_index: int  # its update in the returned list
    request: Request
    reason: str  # the finish reason


class OutputProcessor:
    """Text streams of the live requests, and the updates and results made from their tokens."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._streams: dict[str, OutputTextStream] = {}

    def add(self, req: Request) -> None:
        self._streams[req.request_id] = OutputTextStream(self.tokenizer, req.prompt_token_ids, req.sampling_params,
                                                         self.eos_token_ids, self.max_model_len)

    def drop(self, request_id: str) -> Optional[OutputTextStream]:
        return self._streams.pop(request_id, None)

    def append(self, req: Request, tokens: list) -> tuple[RequestUpdate, Optional[str]]:
        """A step's tokens for `req` (`SampledToken`s; several after accepted drafts) -> its update and the
        reason it finished (None: it runs on)."""
        if len(tokens) == 1 and req.grammar is None:
            return self.append_one(req, tokens[0].token_id, tokens[0].logprobs)
        update = RequestUpdate(req.request_id)
        stream = self._streams[req.request_id]
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
            req.output_token_ids.append(token_id)
            new_logprobs = []
            if token_logprobs is not None:
                req.output_logprobs.append(token_logprobs)
                new_logprobs = [token_logprobs]
            stream = streams[req.request_id]
            delta = stream.add_plain_token(token_id)
            if delta is None:  # a token that may end the request, or a request with stop strings
                token = stream.add_token(token_id)
                delta = token.delta
                if token.finish_reason is not None:
                    finishing.append(Finishing(len(updates), req, token.finish_reason))
            updates.append(RequestUpdate(req.request_id, [token_id], new_logprobs, delta))
        return updates, finishing

    def result(self, req: Request, reason: str) -> RequestResult:
        """The finished request's whole result (its stream is dropped)."""
        stream = self._streams.pop(req.request_id)
        asked_logprobs = req.sampling_params.logprobs is not None
        grammar = req.grammar
        return RequestResult(text=stream.text, token_ids=list(req.output_token_ids),
                             logprobs=list(req.output_logprobs) if asked_logprobs else None, finish_reason=reason,
                             num_prompt_tokens=req.num_prompt_tokens, arrival_time=req.arrival_time,
                             first_token_time=req.first_token_time, finished_time=time.monotonic(),
                             grammar_ended=grammar is not None and grammar.is_terminated,
                             stop_reason=None if stream.finished is None else stream.finished.stop_reason,
                             prompt_text=req.prompt.text or None, prompt_token_ids=list(req.prompt_token_ids),
                             prompt_logprobs=req.prompt_logprobs, spec_decode=req.spec_decode,
                             scheduled_time=req.scheduled_time, num_cached_tokens=req.prefix_hit_tokens)
