"""Beam search as vLLM runs it: one engine token per beam per round, candidates from the top logprobs.

vLLM drives beam search from above the engine, and so does vlmrun (`BeamSearch`, a state machine
both `LLM.beam_search` and the server's `use_beam_search` feed):

- every round, each live beam of a prompt is a one-token request (the prompt + its tokens so far,
  `SamplingParams(logprobs=2 * beam_width, max_tokens=1, temperature=...)`); the prefix cache
  makes the repeated prefix cheap (only the new tail is computed);
- each entry of the returned logprob dict (the top 2 * beam_width raw logprobs, plus the sampled
  token) extends the beam by that token, adding its logprob to `cum_logprob`; a candidate ending in
  the tokenizer's EOS token is complete (unless `ignore_eos`), the others compete for the
  `beam_width` live beams of the next round;
- beams are ranked by `beam_score`: cum_logprob / (length ** length_penalty), length counting the
  prompt and the output tokens, an EOS at the end not counted (vLLM's formula, after HF's);
- after `max_tokens` rounds (or when no beam is live) the completed and the live beams are ranked
  together and the best `beam_width` returned, `text` the decoded tokens (prompt included), as vLLM.

A beam that the engine could not extend (its prompt reached the context limit, or it failed) is
dropped, as in vLLM. `BeamSearchParams` checks its fields (ValueError naming the field); a beam width
over `MAX_LOGPROBS // 2` is refused, since a round reads `2 * beam_width` logprobs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from vlmrun.logprobs import Logprob
from vlmrun.lora.request import LoRARequest
from vlmrun.processors import ProcessedPrompt
from vlmrun.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a round asks for 2 * beam_width logprobs


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, lo, hi in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"{name} must be an integer {bound}, got {value!r}"
                                 + (f" (a round reads 2 * beam_width logprobs, at most {MAX_LOGPROBS})"
                                    if name == "beam_width" else ""))
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")

    def round_params(self) -> SamplingParams:
        """The one-token request each live beam runs per round."""
        return SamplingParams(logprobs=2 * self.beam_width, max_tokens=1, temperature=float(self.temperature))


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (the prompt's, then the output's), per output token its logprob dict,
    `cum_logprob` the sum of its output tokens' logprobs; `text` set when returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Optional[LoRARequest] = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (it ended with EOS) | "length"
    stop_reason: Optional[int] = None  # vLLM's field: None (EOS is not a stop token id)
    num_prompt_tokens: int = field(default=0, repr=False)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first; `error` (vlmrun's) when its input failed."""

    sequences: list[BeamSearchSequence]
    error: Optional[str] = None


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: Optional[int], length_penalty: float) -> float:
    """vLLM's score: cum_logprob / len ** length_penalty, len counting all tokens but a final EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


@dataclass
class BeamInstance:
    """One prompt's search: its processed prompt, live `beams` and `completed` ones."""

    prompt: ProcessedPrompt
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    error: Optional[str] = None


class BeamSearch:
    """The search over any engine front: `start` per prompt, then rounds of `round_prompts` (what to run)
    and `advance` (their logprob dicts), then `outputs`."""

    def __init__(self, params: BeamSearchParams, tokenizer: Any):
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        self.instances: list[BeamInstance] = []
        self.rounds = 0

    def start(self, prompt: Optional[ProcessedPrompt], lora: Optional[LoRARequest] = None,
              error: Optional[str] = None) -> None:
        """Add a prompt (processed), or one whose input failed (`error`, no beams)."""
        if prompt is None:
            self.instances.append(BeamInstance(ProcessedPrompt(token_ids=[]), [], error=error))
            return
        ids = list(prompt.token_ids)
        self.instances.append(BeamInstance(prompt, [BeamSearchSequence(ids, [], lora, num_prompt_tokens=len(ids))]))

    @property
    def done(self) -> bool:
        return self.rounds >= self.params.max_tokens or not any(inst.beams for inst in self.instances)

    def round_prompts(self) -> list[tuple[ProcessedPrompt, Optional[LoRARequest]]]:
        """This round's one-token requests: every live beam, prompt by prompt, beam by beam."""
        return [(dataclasses.replace(inst.prompt, token_ids=list(beam.tokens), text=""), beam.lora_request)
                for inst in self.instances for beam in inst.beams]

    def advance(self, candidates: list[Optional[dict[int, Logprob]]]) -> None:
        """Extend every live beam by the candidates its request returned (one dict per `round_prompts`
        entry; None: the engine could not extend it, the beam is dropped) and keep the best."""
        it = iter(candidates)
        for inst in self.instances:
            grown: list[BeamSearchSequence] = []
            for beam in inst.beams:
                dict_ = next(it)
                if dict_ is None:
                    continue
                for token_id, logprob in dict_.items():
                    child = dataclasses.replace(beam, tokens=[*beam.tokens, token_id], logprobs=[*beam.logprobs, dict_],
                                                cum_logprob=beam.cum_logprob + float(logprob))
                    if token_id == self.eos_token_id and not self.params.ignore_eos:
                        child.finish_reason = "stop"
                        inst.completed.append(child)
                    else:
                        grown.append(child)
            grown.sort(key=self.score, reverse=True)
            inst.beams = grown[:self.params.beam_width]
        self.rounds += 1

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def outputs(self) -> list[BeamSearchOutput]:
        """Per prompt its best `beam_width` beams (completed and live together), best first, with text."""
        out = []
        for inst in self.instances:
            ranked = sorted(inst.completed + inst.beams, key=self.score, reverse=True)[:self.params.beam_width]
            for beam in ranked:
                beam.finish_reason = beam.finish_reason or "length"
                beam.text = self.tokenizer.decode(beam.tokens)
            out.append(BeamSearchOutput(ranked, inst.error))
        return out
