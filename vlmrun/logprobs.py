"""vLLM's logprob objects for `LLM`'s outputs: `Logprob(logprob, rank, decoded_token)`.

The engine hands out raw logprobs as {token id: float} per position (the top-k, most likely first,
then the chosen token when it is not among them), a `TokenLogprobs` dict whose `chosen_rank` is the
chosen token's rank in the whole vocabulary (the sampler counts it: `vlmrun/layers/sampler_output.py`).
`LLM` turns them into vLLM's shape at its output boundary (`sample_logprobs`, `prompt_logprobs`): per
position a dict token id -> `Logprob`, with

- `logprob`: the raw logprob (as before);
- `rank`: 1-based, as vLLM's: the top-k ranked 1..k in order (1 = most likely), the chosen token (the
  sampled one, or the prompt token) its rank in the whole vocabulary (how many tokens are at least as
  likely: `chosen_rank`), inside the top-k or not;
- `decoded_token`: `tokenizer.decode([token_id])`, special tokens kept (as vLLM and the server's
  logprobs write them).

`Logprob` is also a float (its value is the logprob), so code that did arithmetic on the bare
floats of earlier releases (`lp[t] - ref`, `math.isfinite(lp[t])`, `sum(...)`) keeps working. The
server and the caption job read the engine's floats, not these, so their JSON does not change.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

RawLogprobs = dict[int, float]  # one position: token id -> raw logprob, as the engine hands it out
Decode = Callable[[int], str]


class TokenLogprobs(dict):
    """One position's {token id: raw logprob}, as the engine hands it out, with `chosen_rank`: the chosen
    token's rank in the whole vocabulary (1-based; None when not counted)."""

    __slots__ = ("chosen_rank",)

    def __init__(self, *args: Any, chosen_rank: Optional[int] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chosen_rank = chosen_rank

    def __reduce__(self) -> tuple:  # pickle / copy (tensor-parallel ranks send these): items and the rank
        return TokenLogprobs, (dict(self),), {"chosen_rank": self.chosen_rank}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.chosen_rank = state["chosen_rank"]


class Logprob(float):
    """vLLM's `Logprob`: `.logprob`, `.rank` (None: not computed), `.decoded_token`; a float of the logprob."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: Optional[int] = None, decoded_token: Optional[str] = None) -> "Logprob":
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __getnewargs__(self) -> tuple[float, Optional[int], Optional[str]]:  # pickle / copy
        return float(self), self.rank, self.decoded_token

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


class TokenDecoder:
    """Token id -> its text (`tokenizer.decode([id])`, special tokens kept), cached per call."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def position_logprobs(raw: RawLogprobs, chosen: int, top_k: int, decode: Decode) -> dict[int, Logprob]:
    """One position's {token id: Logprob}: the top `top_k` entries ranked 1..k in the engine's order (most
    likely first); `chosen` (the sampled or prompt token) its rank in the vocabulary (`chosen_rank`; without
    one, its top-k rank, None outside the top-k)."""
    out: dict[int, Logprob] = {}
    rank = 0
    for token_id, value in raw.items():
        in_top = rank < top_k and not (token_id == chosen and len(raw) > top_k)
        if in_top:
            rank += 1
        out[token_id] = Logprob(value, rank if in_top else None, decode(token_id))
    counted = getattr(raw, "chosen_rank", None)
    if counted is not None and chosen in out:
        out[chosen] = Logprob(out[chosen], counted, out[chosen].decoded_token)
    return out


def sample_logprobs(raw: Optional[list[RawLogprobs]], token_ids: list[int], top_k: Optional[int],
                    decode: Decode) -> Optional[list[dict[int, Logprob]]]:
    """`CompletionOutput.logprobs`: per output token its dict (None when the request asked for none)."""
    if raw is None:
        return None
    return [position_logprobs(lps, t, top_k or 0, decode) for lps, t in zip(raw, token_ids)]


def prompt_logprobs(raw: Optional[list[Optional[RawLogprobs]]], prompt_token_ids: list[int], top_k: Optional[int],
                    decode: Decode) -> Optional[list[Optional[dict[int, Logprob]]]]:
    """`RequestOutput.prompt_logprobs`: per prompt position its dict; the first position (no context) None."""
    if raw is None:
        return None
    return [None if lps is None else position_logprobs(lps, t, top_k or 0, decode)
            for lps, t in zip(raw, prompt_token_ids)]


def cumulative_logprob(raw: Optional[list[RawLogprobs]], token_ids: list[int]) -> Optional[float]:
    """vLLM's `cumulative_logprob`: the sum of the chosen tokens' logprobs; None without logprobs."""
    if raw is None:
        return None
    return float(sum(lps[t] for lps, t in zip(raw, token_ids)))
