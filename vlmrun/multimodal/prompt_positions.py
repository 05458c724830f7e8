"""How a family places a prompt's tokens: `PromptPositions`, what `Model.prompt_positions` returns.

A `PromptPositions` is called with a prompt's token ids and its media items (each with `grid_thw` and
`second_per_grid_t`, in prompt order: `vlmrun.processors.MMItem`) and gives the positions [3, L] int64 of
the prompt's tokens and the decode delta: the generated token at index i >= L sits at `i + delta` on all
three rows. Two kinds:
- `LinearPositions`: 1-D RoPE (text-only families): 0..L-1 on every row, delta 0; media are refused.
- `MRopePositions`: Qwen-VL M-RoPE (`vlmrun.multimodal.mrope`): a video item that carries its seconds per
  temporal group (a "qwen2"-style prompt: Qwen2.5-VL) steps its temporal row by them; Qwen3-VL / Qwen3.5
  videos come as one item per temporal group, their timestamps in the text.
The engine asks the checkpoint's family once per new request (`vlmrun.models.registry.prompt_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from vlmrun.multimodal.mrope import compute_mrope_positions


class PromptPositions(Protocol):
    def __call__(self, token_ids: Sequence[int], mm_items: Sequence[Any]) -> tuple[torch.Tensor, int]:
        """(positions [3, L] int64, decode delta) of one prompt; ValueError for media it cannot place."""


@dataclass(frozen=True)
class LinearPositions:
    """1-D positions on all three rows (a text-only model's rotary reads row 0)."""

    def __call__(self, token_ids: Sequence[int], mm_items: Sequence[Any]) -> tuple[torch.Tensor, int]:
        if mm_items:
            raise ValueError("this model takes no images")
        return torch.arange(len(token_ids), dtype=torch.int64).expand(3, -1).contiguous(), 0  # [3, L]


@dataclass(frozen=True)
class MRopePositions:
    """Qwen-VL M-RoPE over the model's config (image / video token ids, the vision config's merge size and
    `tokens_per_second`)."""

    hf_config: Any

    def __call__(self, token_ids: Sequence[int], mm_items: Sequence[Any]) -> tuple[torch.Tensor, int]:
        grids = [item.grid_thw for item in mm_items]  # (t, h, w) patches each
        seconds = [item.second_per_grid_t for item in mm_items]  # None but for "qwen2"-style videos
        return compute_mrope_positions(token_ids, grids, self.hf_config, seconds)
