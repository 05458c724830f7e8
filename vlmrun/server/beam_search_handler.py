"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the search of `vlmrun/beam_search.py`
(the body's fields: `vlmrun/server/beam_fields.py`).

The handler submits the first round as any request (`submission.submit`: admission, preparation,
the 400s of a bad input); `run_beam_search` then runs the following rounds on the async engine and
leaves, in `sub.choices`, the `n` best sequences of each prompt, as choices `prompt * n + j`: their
output tokens, text (a final EOS not written, as vLLM's server) and logprobs, finish_reason "stop" for
a sequence that ended with EOS, else "length". Every round's requests are added with `stream=False`: a round
reads only each request's result (its one token's logprobs).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import Request

from vlmrun.beam_search import BeamSearch, BeamSearchParams
from vlmrun.engine.request_group import EngineDeadError, EngineStepError
from vlmrun.lora.request import LoRARequest
from vlmrun.processors import ProcessedPrompt
from vlmrun.server import responses as R
from vlmrun.server.errors import internal
from vlmrun.server.state import ServerState
from vlmrun.server.submission import Submitted
from vlmrun.server.transport import until_done_or_disconnected

async def run_beam_search(state: ServerState, request: Request, sub: Submitted, prompts: list[ProcessedPrompt],
                          beam: BeamSearchParams, n: int, lora: Optional[LoRARequest]) -> None:
    """Finish the search `sub` started (its group is the first round, one request per prompt) and put the
    `n` best sequences of each prompt in `sub.choices`. 500 when the engine fails; the client leaving ends it."""
    search = BeamSearch(beam, state.engine.tokenizer)
    for prompt in prompts:
        search.start(prompt, lora)
    try:
        await until_done_or_disconnected(request, _rounds(state, sub, search, lora))
    except (EngineStepError, EngineDeadError) as exc:
        raise internal(str(exc)) from None
    eos = search.eos_token_id
    sub.choices = []
    for p, out in enumerate(search.outputs()):
        for j, seq in enumerate(out.sequences[:n]):
            ids = seq.output_token_ids
            shown = ids[:-1] if seq.finish_reason == "stop" and ids and ids[-1] == eos else ids
            sub.choices.append(R.ChoiceState(p * n + j, text=state.engine.tokenizer.decode(shown), token_ids=ids,
                                             logprobs=list(seq.logprobs), finish_reason=seq.finish_reason,
                                             num_prompt_tokens=seq.num_prompt_tokens,
                                             prompt_token_ids=seq.tokens[:seq.num_prompt_tokens]))


async def _rounds(state: ServerState, sub: Submitted, search: BeamSearch, lora: Optional[LoRARequest]) -> None:
    """Round one from `sub.group`, then a group per round until the search is done."""
    search.advance(await _candidates(sub.group, len(search.round_prompts()), sub))
    params = search.params.round_params()
    limit = state.engine.max_model_len
    while not search.done:
        batch = search.round_prompts()
        runnable = [i for i, (p, _) in enumerate(batch) if len(p.token_ids) < limit]  # vLLM drops the others
        candidates: list[Optional[dict[int, float]]] = [None] * len(batch)
        if runnable:
            group = await state.engine.submit(f"{sub.rid}-beam{search.rounds}", [(batch[i][0], params) for i in runnable],
                                              lora, stream=False)
            for i, found in zip(runnable, await _candidates(group, len(runnable))):
                candidates[i] = found
        search.advance(candidates)
        await asyncio.sleep(0)


async def _candidates(group: Any, size: int, sub: Optional[Submitted] = None) -> list[Optional[dict[int, float]]]:
    """Each request's first-token logprob dict (None where it produced none), read to the group's end."""
    found: list[Optional[dict[int, float]]] = [None] * size
    async for batch in group:
        if sub is not None:
            sub.tracker.on_batch(batch)
        for delta in batch:
            if delta.logprobs and found[delta.index] is None:
                found[delta.index] = delta.logprobs[0]
    return found
