"""What `LLM.embed` and `LLM.encode` return: vLLM's output shapes.

`EmbeddingRequestOutput.outputs.embedding` is a list of floats; `PoolingRequestOutput.outputs.data`
the same vector as a float32 tensor. A request whose input was bad has `error` set and an empty
output (it fails alone; the other requests of the call complete), as `RequestOutput.error`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingOutput:
    data: torch.Tensor  # [dim] float32


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True
    error: Optional[str] = None


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True
    error: Optional[str] = None


def embedding_request_output(request_id: str, result: Any, prompt_token_ids: list[int],
                             error: Optional[str]) -> EmbeddingRequestOutput:
    """From the engine's result of a pooling request (`RequestResult.pooled`), or its error."""
    vector = [] if result is None or result.pooled is None else result.pooled.tolist()
    if result is not None:
        prompt_token_ids = list(result.prompt_token_ids)
    return EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), prompt_token_ids, error=error)


def pooling_request_output(request_id: str, result: Any, prompt_token_ids: list[int],
                           error: Optional[str]) -> PoolingRequestOutput:
    """`LLM.encode`'s shape: the same vector as a float32 tensor."""
    data = torch.zeros(0) if result is None or result.pooled is None else result.pooled
    if result is not None:
        prompt_token_ids = list(result.prompt_token_ids)
    return PoolingRequestOutput(request_id, PoolingOutput(data), prompt_token_ids, error=error)
