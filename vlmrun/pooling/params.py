"""`PoolingParams`: what a pooling request asks for (vLLM's names), and its check against the checkpoint.

`dimensions` (Matryoshka): keep the first `dimensions` values of the pooled vector, then normalize.
Refused, as vLLM refuses it, when the checkpoint does not say it is Matryoshka, when it names other
sizes, or past the hidden size. `normalize` None takes the checkpoint's (`PoolerConfig.normalize`).
`truncate_prompt_tokens` keeps the last k prompt tokens (-1: as many as fit), as for generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vlmrun.pooling.config import PoolerConfig


@dataclass
class PoolingParams:
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    task: str = "embed"  # "embed" (LLM.embed, /v1/embeddings) | "encode" (LLM.encode): the same pooled vector

    def __post_init__(self) -> None:
        if self.task not in ("embed", "encode"):
            raise ValueError(f"PoolingParams.task must be embed or encode, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")

    def choices(self) -> list["PoolingParams"]:
        """One engine request per input (as `SamplingParams.choices` with n=1)."""
        return [self]

    def resolve(self, config: PoolerConfig) -> "ResolvedPooling":
        """What the request computes on this checkpoint; a ValueError naming the field when it cannot."""
        dims = self.dimensions
        if dims is not None:
            if dims < 1:
                raise ValueError(f"dimensions must be >= 1, got {dims}")
            if not config.is_matryoshka:
                raise ValueError(f"dimensions={dims}: this model does not support Matryoshka representation "
                                 f"(its config sets no is_matryoshka / matryoshka_dimensions); truncated "
                                 f"embeddings would be poor. Leave dimensions unset.")
            if config.matryoshka_dimensions is not None and dims not in config.matryoshka_dimensions:
                raise ValueError(f"dimensions={dims}: this model supports only the Matryoshka dimensions "
                                 f"{list(config.matryoshka_dimensions)}")
            if config.hidden_size and dims > config.hidden_size:
                raise ValueError(f"dimensions={dims} is larger than the model's hidden size {config.hidden_size}")
        normalize = config.normalize if self.normalize is None else bool(self.normalize)
        return ResolvedPooling(config.pooling_type, normalize, dims)


@dataclass(frozen=True)
class ResolvedPooling:
    """A pooling request's pooling on its checkpoint: every choice made."""

    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    dimensions: Optional[int]  # None: the whole hidden state

    @property
    def reads_prefix(self) -> bool:
        """It needs the hidden states of every prompt position (MEAN) or of the first (CLS): a prefix-cache
        hit would skip computing them, so such a request neither reuses nor fills the prefix cache (the
        last position is always computed, so LAST pooling uses it as generation does)."""
        return self.pooling_type != "LAST"
