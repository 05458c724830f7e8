"""A request whose consumer reads only its result (`Engine.add_request(..., stream=False)`).

The batch consumers (`LLM.generate` / `chat` / `embed`, the caption and embedding jobs, run-batch: all
through `vlmrun/feed/pipeline.py`) read a request's `RequestResult` and nothing of its steps. Such a
request's tokens need per step only the token-level finish rules (`check_stop`: a stop token id or EOS
after `min_tokens` outputs, the length limits); its text is decoded once, when it finishes, with
`incremental_detokenizer.finished_text` (one decode of the output where that provably is the text), which gives
the text the per-token stream would have given.

`FinalOutput` keeps those rules in plain fields (`min_tokens`, `stop_ids`, `length_cap`) that the output
processor's per-row loop tests inline; only a token that passes the quick test calls `finish_reason`.
A request with stop strings needs its text every token (a stop string may end it anywhere): it keeps an
`OutputTextStream` and every token goes through it (its `length_cap` is 0), as a streamed request's does;
it just makes no per-step update.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from vlmrun.engine.detokenizer import FINISH_STOP, FinishRules, OutputTextStream, StopDecision, check_stop
from vlmrun.engine.incremental_detokenizer import CONTEXT_TOKENS, finished_text
from vlmrun.sampling_params import SamplingParams


class FinalOutput:
    """The finish rules and the final text of one request that does not stream (module docstring)."""

    __slots__ = ("tokenizer", "params", "eos_token_ids", "max_model_len", "num_prompt_tokens", "context",
                 "text_stream", "decision", "min_tokens", "stop_ids", "length_cap")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Sequence[int], max_model_len: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.context = list(prompt_token_ids[-CONTEXT_TOKENS:])  # what the detokenizer decodes ahead of the output
        self.decision: Optional[StopDecision] = None  # the token-level rule that ended the request
        # stop strings: the text of every token, through the streamed path's own object
        self.text_stream = (OutputTextStream(tokenizer, prompt_token_ids, params, eos_token_ids, max_model_len)
                            if any(params.stop_strings) else None)
        # the quick test per token (`FinishRules`, as plain fields the output processor's loop reads): only a
        # token after min_tokens outputs that is one of stop_ids, or the length_cap-th output, can end the
        # request (then `finish_reason` applies check_stop's full rules); with stop strings, every token
        self.min_tokens, self.stop_ids, length_cap = FinishRules.of(params, eos_token_ids, self.num_prompt_tokens,
                                                                     max_model_len)
        self.length_cap = 0 if self.text_stream is not None else length_cap

    def finish_reason(self, output_token_ids: list[int]) -> Optional[str]:
        """The reason the output's last token (one the quick test let through) ends the request, or None."""
        if self.text_stream is not None:
            return self.text_stream.add_token(output_token_ids[-1]).finish_reason
        self.decision = check_stop(output_token_ids, self.params, self.eos_token_ids, self.num_prompt_tokens,
                                   self.max_model_len)
        return None if self.decision is None else self.decision.finish_reason

    def final_text(self, output_token_ids: Sequence[int]) -> tuple[str, Union[int, str, None]]:
        """The finished request's text and stop reason: what its `OutputTextStream` would have given. A token
        that ended it by EOS or a stop id is not decoded (unless `include_stop_str_in_output`); after a
        token-level finish the held-back tail is flushed (a finish the stream did not see, such as a
        grammar's end or a prompt too long to go on, flushes nothing, as in the streamed path)."""
        if self.text_stream is not None:
            return self.text_stream.final_text(output_token_ids)
        decision, params = self.decision, self.params
        if not params.detokenize:
            return "", None if decision is None else decision.stop_reason
        ids = output_token_ids
        if decision is not None and decision.finish_reason == FINISH_STOP and not params.include_stop_str_in_output:
            ids = ids[:-1]
        text = finished_text(self.tokenizer, self.context, list(ids), params.skip_special_tokens,
                             params.spaces_between_special_tokens, flush=decision is not None)
        return text, None if decision is None else decision.stop_reason
